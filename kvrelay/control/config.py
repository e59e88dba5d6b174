"""The control process's settings: one dataclass, the source of
`kvrelay launch control`'s flags and of their `KVRELAY_<FIELD>` variables."""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.options import option
from kvrelay.rpc.cache_ops import DEFAULT_LEASE_S, MAX_LEASE_S


@dataclass(slots=True)
class ControlConfig:
    token: str = option(help="cluster token (bearer token of the admin routes, hello token)")
    listen: str = option("127.0.0.1:8000", help="HTTP address HOST:PORT")
    cache: tuple[str, ...] = option((), help="cache servers H:P[,H:P...] to probe")
    heartbeat_s: float = option(
        1.0, help="workers' heartbeat period; 3 missed take a node out", positive=True
    )
    request_timeout_s: float = option(
        300.0, help="a request's whole budget, retries included", positive=True
    )
    attempt_timeout_s: float = option(
        60.0,
        help="wait for a prefill reply or decode's first frame before trying another worker",
        positive=True,
    )
    lease_s: float = option(
        DEFAULT_LEASE_S,
        help=f"how long prefill keeps a request's pages for decode (at most {MAX_LEASE_S:g})",
        positive=True,
        maximum=MAX_LEASE_S,
    )
    max_retries: int = option(
        2, help="attempts repeated after worker faults, per request", minimum=0
    )
    connect_timeout_s: float = option(
        5.0, help="connect + hello of one worker attempt", positive=True
    )
    admin_timeout_s: float = option(5.0, help="per worker call of /admin routes", positive=True)
    tier_timeout_s: float = option(1.0, help="per cache server call of a probe", positive=True)
    log_level: str = option("warning", help="uvicorn log level")
