"""The adapter's settings, read from SGLang's `--hicache-storage-backend-extra-config`."""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvrelay.transfer import BACKENDS

# Keys SGLang itself reads from the extra config (the dynamic loader's, the
# cache controller's); they are accepted and left to SGLang.
SGLANG_KEYS = frozenset(
    {"backend_name", "module_path", "class_name", "interface_v1", "interface_v2", "tp_lcm_size"}
)


class AdapterConfigError(ValueError):
    """An extra config the adapter cannot run with (missing, mistyped or unknown keys)."""


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """One SGLang rank's view of the kvrelay tier.

    `servers` are cache server control addresses ("host:port"), `token` the
    cluster token, `backend` the transfer backend for page bytes (tcp or ucx).
    The model identity (`model_id`, `weights_fingerprint`, `salt`) names the
    pages' namespace together with the geometry taken from SGLang's host pool;
    `num_layers` / `num_kv_heads` are the model's global counts, needed when a
    rank sees only part of them (PP, or TP beyond the KV heads) and otherwise
    taken from the pool. Every call returns within about `timeout_s`.
    """

    servers: tuple[str, ...]
    token: str
    backend: str = "tcp"
    model_id: str = ""
    weights_fingerprint: str = ""
    salt: str = ""
    num_layers: int | None = None
    num_kv_heads: int | None = None
    timeout_s: float = 5.0
    staging_pages: int = 64

    def __post_init__(self) -> None:
        if not self.servers or not all(
            isinstance(s, str) and s.rpartition(":")[2].isdigit() for s in self.servers
        ):
            raise AdapterConfigError("servers must be a non-empty list of 'host:port'")
        if not isinstance(self.token, str) or not self.token:
            raise AdapterConfigError("token (the cluster token) must be a non-empty string")
        if self.backend not in BACKENDS or self.backend == "loopback":
            raise AdapterConfigError("backend must be 'tcp' or 'ucx'")
        for name in ("model_id", "weights_fingerprint", "salt"):
            if not isinstance(getattr(self, name), str):
                raise AdapterConfigError(f"{name} must be a string")
        for name in ("num_layers", "num_kv_heads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise AdapterConfigError(f"{name} must be a positive int")
        if not isinstance(self.timeout_s, int | float) or not 0 < self.timeout_s <= 600:
            raise AdapterConfigError("timeout_s must be in (0, 600]")
        if not isinstance(self.staging_pages, int) or self.staging_pages <= 0:
            raise AdapterConfigError("staging_pages must be a positive int")

    @classmethod
    def from_extra_config(cls, extra: dict | None) -> AdapterConfig:
        """Build from SGLang's extra config; unknown keys are refused, not ignored."""
        if not isinstance(extra, dict):
            raise AdapterConfigError("the kvrelay backend needs an extra config (a JSON object)")
        own = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - own - SGLANG_KEYS)
        if unknown:
            raise AdapterConfigError(f"unknown extra config keys {unknown}; known: {sorted(own)}")
        values = {k: v for k, v in extra.items() if k in own}
        if "servers" not in values or "token" not in values:
            raise AdapterConfigError("the extra config needs 'servers' and 'token'")
        servers = values["servers"]
        if isinstance(servers, str):
            servers = [s for s in servers.split(",") if s]
        if not isinstance(servers, list | tuple):
            raise AdapterConfigError("servers must be a list of 'host:port'")
        values["servers"] = tuple(servers)
        return cls(**values)
