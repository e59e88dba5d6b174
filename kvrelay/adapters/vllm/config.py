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
    """

    servers: Annotated[tuple[Address, ...], msgspec.Meta(min_length=1)]
    token: Annotated[str, msgspec.Meta(min_length=1)]
    backend: Literal["tcp", "ucx"] = "tcp"
    model_id: str = ""
    weights_fingerprint: str = ""
    salt: str = ""
    key_scheme: Literal["kvrelay", "sglang"] = "kvrelay"
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=600)] = 5.0
    staging_pages: Positive = 64

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
            return msgspec.convert(values, cls)
        except msgspec.ValidationError as exc:
            raise ConnectorConfigError(f"kvrelay kv_connector_extra_config: {exc}") from exc
