"""The connector's settings, read from vLLM's `kv_connector_extra_config`."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

Positive = Annotated[int, msgspec.Meta(gt=0)]
Address = Annotated[str, msgspec.Meta(pattern=r":[0-9]+$")]  # "host:port"


class ConnectorConfigError(ValueError):
    """An extra config the connector cannot run with (missing, mistyped or unknown keys)."""


class ConnectorConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One vLLM engine's view of the kvrelay tier, its types checked by msgspec.

    `servers` are cache server control addresses ("host:port"), `token` the
    cluster token, `backend` the transfer backend for page bytes. The model
    identity (`model_id`, default vLLM's served model name;
    `weights_fingerprint`; `salt`, a tenant) and the geometry vLLM reports
    name the pages' namespace: give the identity kvrelay's own workers print
    (`kv_spec(...)`) to share pages with them, and `key_scheme: "sglang"` to
    share pages with SGLang servers through kvrelay's HiCache backend. Every
    tier call returns within about `timeout_s`; a slower or failed one is a
    miss or a page not written, never a failed request.

    P/D: `handoff_port` (non-zero) starts a prefill engine's handoff service,
    rank `r` listening on `handoff_host:handoff_port + r`; a finished prefill
    keeps its blocks for its decode at most `handoff_hold_s`. A decode engine
    needs no port. `servers` may be empty in an engine that only hands off.
    `huge_pages` moves vLLM's CPU KV cache onto transparent huge pages when
    the connector registers it (the kernel copies between engines pin and
    walk pages; on 4 KiB pages that walk is a large part of a pull).
    `async_loads`: "auto" loads a request's pages (from the tier or a
    prefill) while the engine steps its other requests when it has any, and
    before the request's first step when it has none (waiting a step would
    only add to its TTFT); "always" and "never" force one way.
    `mla_rope_interleave`: an MLA model's RoPE key sits in vLLM's cache as
    interleaved pairs (vLLM's DeepSeek-family attention rotates GPT-J
    style); false for a model vLLM rotates NeoX style (`latent_blocks.py`).
    """

    servers: tuple[Address, ...] = ()
    token: Annotated[str, msgspec.Meta(min_length=1)] = ""
    backend: Literal["tcp", "ucx"] = "tcp"
    model_id: str = ""
    weights_fingerprint: str = ""
    salt: str = ""
    key_scheme: Literal["kvrelay", "sglang"] = "kvrelay"
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=600)] = 5.0
    staging_pages: Positive = 64
    handoff_host: str = "127.0.0.1"
    handoff_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    handoff_hold_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 60.0
    huge_pages: bool = True
    async_loads: Literal["auto", "always", "never"] = "auto"
    mla_rope_interleave: bool = True

    def handoff_agents(self, tp_size: int) -> list[str]:
        """The handoff service of each rank, or none."""
        if not self.handoff_port:
            return []
        if self.handoff_port + tp_size - 1 > 65535:
            raise ConnectorConfigError(f"handoff_port {self.handoff_port} + {tp_size} ranks")
        return [f"{self.handoff_host}:{self.handoff_port + r}" for r in range(tp_size)]

    @classmethod
    def from_extra_config(cls, extra: dict | None) -> ConnectorConfig:
        """Build from the extra config; unknown keys are refused, not ignored."""
        if not isinstance(extra, dict):
            raise ConnectorConfigError(
                "KvrelayConnector needs kv_connector_extra_config (a JSON object)"
            )
        own = set(cls.__struct_fields__)
        unknown = sorted(set(extra) - own)
        if unknown:
            raise ConnectorConfigError(
                f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(own)}"
            )
        values = dict(extra)
        if isinstance(values.get("servers"), str):  # "host:port,host:port"
            values["servers"] = [s for s in values["servers"].split(",") if s]
        try:
            config = msgspec.convert(values, cls)
        except msgspec.ValidationError as exc:
            raise ConnectorConfigError(f"kvrelay kv_connector_extra_config: {exc}") from exc
        if not config.token:
            raise ConnectorConfigError("kv_connector_extra_config needs the cluster 'token'")
        return config
