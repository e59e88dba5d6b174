"""Pydantic models of the HTTP edge (the only place pydantic is used).

Each field constraint names the field in the error, so a 422 says exactly
what is wrong. Checks that need the registry (vocabulary, known model) are
made by the routes.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_TOKENS_LIMIT = 1 << 16  # per request; a worker's pool bounds it further
MAX_PROMPT_TOKENS = 1 << 20
_ADDRESS = re.compile(r"^[A-Za-z0-9.\-]+:\d{1,5}$")
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")

NonNegative = Annotated[int, Field(ge=0)]
Positive = Annotated[int, Field(ge=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Lenient(BaseModel):
    # Workers are built separately: a field this control does not know yet is
    # ignored rather than failing every registration or heartbeat.
    model_config = ConfigDict(extra="ignore")


def _check_namespace(value: str) -> str:
    if not _HEX64.match(value):
        raise ValueError("namespace must be 64 hex characters (a sha256 digest)")
    return value.lower()


class NodeRegistration(_Lenient):
    role: Literal["prefill", "decode"]
    address: str
    model: str = Field(min_length=1, max_length=256)
    namespace: str
    page_size: Positive
    vocab_size: Positive
    tp: Positive = 1
    pp: Positive = 1
    num_pages: Positive
    cache: bool = False

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        if not _ADDRESS.match(value) or not 0 < int(value.rsplit(":", 1)[1]) < 65536:
            raise ValueError("address must be host:port with a port in 1-65535")
        return value

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        return _check_namespace(value)


class Heartbeat(_Lenient):
    queued: NonNegative = 0
    active: NonNegative = 0
    free_pages: NonNegative = 0
    stats: dict[str, int | float] = Field(default_factory=dict)


class CompletionRequest(BaseModel):
    # Unknown OpenAI fields (n, logprobs, ...) are ignored, as clients send them.
    model: str | None = None
    prompt: str | list[int]
    max_tokens: int = Field(16, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=0, lt=1 << 63)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=1024)
    stream: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: str | list[int]) -> str | list[int]:
        if len(value) == 0:
            raise ValueError("prompt must not be empty")
        if isinstance(value, list) and len(value) > MAX_PROMPT_TOKENS:
            raise ValueError(f"prompt has more than {MAX_PROMPT_TOKENS} tokens")
        if isinstance(value, list) and min(value) < 0:
            raise ValueError("prompt token ids must not be negative")
        return value


class FlushRequest(_Strict):
    namespace: str | None = None

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str | None) -> str | None:
        return None if value is None else _check_namespace(value)


class DrainRequest(_Strict):
    node_id: str = Field(min_length=1)
