"""What the control endpoint's OpenAPI document says each route answers, so
that it tells the truth (checked by schemathesis in tests/control).

FastAPI documents a 422 `HTTPValidationError` for every route with inputs;
this endpoint answers schema errors with 400 in its own error shape, so
`openapi_without_422` drops those and the routes declare what they answer.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: int


class ErrorBody(BaseModel):
    """Every error answer: OpenAI's `error` object, and FastAPI's `detail`."""

    error: ErrorDetail
    detail: str


def _error(description: str) -> dict:
    return {"model": ErrorBody, "description": description}


BAD_REQUEST = {400: _error("The body or a parameter is invalid; the message says which and why")}
AUTH = {
    401: _error("No bearer token"),
    403: _error("Wrong bearer token"),
}
UNKNOWN_NODE = {404: _error("Unknown node id")}
# One server-sent event: `data` is a JSON chunk, `[DONE]`, or an error object
# (with `event: error`).
SSE_EVENT = {
    "type": "object",
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
    "required": ["data"],
}
COMPLETION = {
    200: {
        "description": "The completion (JSON), or server-sent events with `stream: true`",
        "content": {"text/event-stream": {"schema": SSE_EVENT}},
    },
    **BAD_REQUEST,
    404: _error("Unknown model"),
    502: _error("Workers failed after the retries"),
    503: _error("No worker available, or every one stayed busy until the deadline"),
    504: _error("The request timed out"),
}
CHAT = COMPLETION | {400: _error("The body is invalid, or the model has no chat template")}
METRICS = {
    200: {
        "description": "Prometheus text exposition format",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }
}


def openapi_without_422(app: FastAPI):
    """`app.openapi` replacement: FastAPI's document minus the 422 answers
    (and their schemas) that this endpoint never sends."""

    def build() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    return build
