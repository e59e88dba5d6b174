"""The control endpoint's HTTP routes (FastAPI). Routes and their answers:
docs/serving-protocol.md; behaviour: docs/architecture.md, "Control endpoint"."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import re
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvrelay.control import metrics
from kvrelay.control.cache_members import CacheMembers, add_cache_routes
from kvrelay.control.completions import CompletionRunner, error_body
from kvrelay.control.config import ControlConfig
from kvrelay.control.dispatch import Dispatcher
from kvrelay.control.fast_json import FastJSONRoute
from kvrelay.control.openapi import (
    AUTH,
    BAD_REQUEST,
    CHAT,
    COMPLETION,
    METRICS,
    UNKNOWN_NODE,
    openapi_without_422,
)
from kvrelay.control.registry import MISSED_HEARTBEATS, NodeState, Registry
from kvrelay.control.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DrainRequest,
    FlushRequest,
    Heartbeat,
    NodeRegistration,
)
from kvrelay.control.stats import ControlStats
from kvrelay.control.tier import TierProbe
from kvrelay.control.worker_client import WorkerError, one_shot
from kvrelay.rpc import Ok
from kvrelay.rpc.worker_ops import Drain, FlushPool

# pydantic names a union's member in the error location ("prompt.list[int]");
# the client knows its field by name only.
_UNION_MEMBER = re.compile(r"^(constrained-|function-|list\[|dict\[|(str|int|float|bool)$)")


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for error in exc.errors():
        loc = [str(p) for p in error.get("loc", ()) if p != "body"]
        loc = [p for p in loc if not _UNION_MEMBER.match(p)]
        parts.append(f"{'.'.join(loc) or 'body'}: {error.get('msg', 'invalid')}")
    return "; ".join(parts)


# Module level: the routes' annotations are resolved in this module's globals.
_BEARER = HTTPBearer(auto_error=False, description="The cluster token")


def _authorizer(token: str):
    """The dependency that admits the cluster token as a bearer token."""

    def authorized(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)],
    ) -> None:
        if credentials is None or not credentials.credentials:
            raise HTTPException(401, "missing bearer token",
                                headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
        given = credentials.credentials.strip().encode()
        if not hmac.compare_digest(given, token.encode()):
            raise HTTPException(403, "wrong token")

    return authorized


def create_app(config: ControlConfig) -> FastAPI:
    if not config.token:
        raise ValueError("the control endpoint needs a cluster token")
    registry = Registry(config.heartbeat_s)
    stats = ControlStats()
    prometheus = metrics.ControlMetrics(stats, registry)
    tier = TierProbe(config.cache, config.token, config.tier_timeout_s)  # the ring may grow
    members = CacheMembers(config.cache, config.heartbeat_s)
    runner = CompletionRunner(Dispatcher(config, registry, stats, tier), registry, stats)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        async def sweep() -> None:
            while True:
                await asyncio.sleep(min(config.heartbeat_s / 2, 1.0))
                registry.sweep()
                members.sweep()

        sweeper = asyncio.create_task(sweep())
        try:
            yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            tier.close()

    app = FastAPI(title="kvrelay control", lifespan=lifespan)
    app.router.route_class = FastJSONRoute  # bodies through msgspec: 1M-token prompts
    app.openapi = openapi_without_422(app)
    app.state.registry, app.state.stats, app.state.tier = registry, stats, tier

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        if request.url.path in ("/v1/completions", "/v1/chat/completions"):
            stats.requests += 1
            stats.errors += 1
            stats.client_errors += 1
        return JSONResponse(error_body(400, _validation_message(exc)), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # One error shape for every answer (OpenAI's, plus FastAPI's `detail`).
        message = str(exc.detail)
        return JSONResponse(error_body(exc.status_code, message),
                            status_code=exc.status_code, headers=exc.headers)  # fmt: skip

    authorized = _authorizer(config.token)
    _serving_routes(app, registry, stats, tier, runner, prometheus)
    _node_routes(app, registry, config, [Depends(authorized)])
    _admin_routes(app, registry, tier, config, [Depends(authorized)])
    add_cache_routes(app, members, tier, [Depends(authorized)])
    return app


def _serving_routes(app, registry, stats, tier, runner, prometheus) -> None:
    """Completions, models, health, stats and metrics (no token needed)."""

    @app.post("/v1/completions", responses=COMPLETION)
    async def completions(body: CompletionRequest, request: Request):
        return await runner.handle(body, request)

    @app.post("/v1/chat/completions", responses=CHAT)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await runner.handle(body, request)

    @app.get("/v1/models")
    async def models() -> dict:
        data = [
            {"id": name, "object": "model", "owned_by": "kvrelay",
             "vocab_size": m["vocab_size"], "page_size": m["page_size"],
             "namespace": m["namespace"].hex(),
             "workers": {"prefill": m["prefill"], "decode": m["decode"]}}
            for name, m in sorted(registry.models().items())
        ]  # fmt: skip
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health() -> dict:
        live = {"prefill": 0, "decode": 0}
        for node in registry.nodes.values():
            live[node.role] += node.state is NodeState.LIVE
        return {"status": "ok", "live_nodes": live, "ready": all(live.values())}

    @app.get("/stats")
    async def stats_route() -> dict:
        nodes = sorted(registry.nodes.values(), key=lambda n: n.node_id)
        totals = registry.counter_totals()
        return stats.snapshot() | {
            "bytes_moved": {k: totals[k] for k in
                            ("bytes_from_tier", "bytes_to_tier", "bytes_from_prefill")},
            "worker_counters": totals,
            "queues": {n.node_id: {"role": n.role, "queued": n.queued, "active": n.active,
                                   "inflight": n.inflight} for n in nodes},
            "nodes": [n.describe() for n in nodes],
            "removed_nodes": dict(registry.removed),
            "tier": None if not tier.servers else {"servers": tier.servers, "probes": tier.probes,
                                               "errors": tier.errors},
        }  # fmt: skip

    @app.get("/metrics", response_class=PlainTextResponse, responses=METRICS)
    async def metrics_route() -> PlainTextResponse:
        return PlainTextResponse(prometheus.render(), media_type=metrics.CONTENT_TYPE)


def _node_routes(app, registry, config, admin) -> None:
    """Workers register, heartbeat and deregister (with the cluster token)."""

    @app.post("/v1/nodes", dependencies=admin, responses=BAD_REQUEST | AUTH)
    async def register(body: NodeRegistration) -> dict:
        node = registry.register(
            role=body.role, address=body.address, model=body.model,
            namespace=bytes.fromhex(body.namespace), page_size=body.page_size,
            vocab_size=body.vocab_size, tp=body.tp, pp=body.pp, num_pages=body.num_pages,
            cache=body.cache, model_dir=body.model_dir, key_scheme=body.key_scheme,
        )  # fmt: skip
        return {"node_id": node.node_id, "heartbeat_s": config.heartbeat_s,
                "missed_heartbeats_allowed": MISSED_HEARTBEATS}  # fmt: skip

    @app.post("/v1/nodes/{node_id}/heartbeat", dependencies=admin,
              responses=BAD_REQUEST | AUTH | UNKNOWN_NODE)  # fmt: skip
    async def heartbeat(node_id: str, body: Heartbeat) -> dict:
        if not registry.heartbeat(node_id, body.queued, body.active, body.free_pages, body.stats):
            raise HTTPException(404, f"unknown node {node_id}: register again")
        return {}

    @app.delete("/v1/nodes/{node_id}", dependencies=admin, responses=AUTH | UNKNOWN_NODE)
    async def deregister(node_id: str) -> dict:
        if not registry.deregister(node_id):
            raise HTTPException(404, f"unknown node {node_id}")
        return {}


def _admin_routes(app, registry, tier, config, admin) -> None:
    """Operators flush pages and drain workers (with the cluster token)."""

    @app.post("/admin/flush", dependencies=admin, responses=BAD_REQUEST | AUTH)
    async def flush(body: FlushRequest) -> dict:
        namespace = None if body.namespace is None else bytes.fromhex(body.namespace)
        nodes = [n for n in registry.nodes.values()
                 if namespace is None or n.namespace == namespace]  # fmt: skip

        async def flush_node(node) -> bool:
            node.estimate.clear()
            try:
                async with asyncio.timeout(config.admin_timeout_s):
                    await one_shot(node, config.token, FlushPool(), Ok)
            except (WorkerError, TimeoutError):
                return False
            return True

        tier_result = await tier.flush(namespace)
        results = await asyncio.gather(*(flush_node(n) for n in nodes))
        workers = {n.node_id: ok for n, ok in zip(nodes, results, strict=True)}
        return {"tier": tier_result, "workers": workers}

    @app.post("/admin/drain", dependencies=admin,
              responses=BAD_REQUEST | AUTH | UNKNOWN_NODE)  # fmt: skip
    async def drain(body: DrainRequest) -> dict:
        node = registry.drain(body.node_id)
        if node is None:
            raise HTTPException(404, f"unknown node {body.node_id}")
        try:
            async with asyncio.timeout(config.admin_timeout_s):
                await one_shot(node, config.token, Drain(), Ok)
            acknowledged = True
        except (WorkerError, TimeoutError):
            acknowledged = False
        return {"node_id": node.node_id, "state": node.state, "acknowledged": acknowledged}
