"""The adapter's settings, read from SGLang's `--hicache-storage-backend-extra-config`."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

# Keys SGLang itself reads from the extra config (the dynamic loader's, the
# cache controller's); they are accepted and left to SGLang.
SGLANG_KEYS = frozenset(
    {"backend_name", "module_path", "class_name", "interface_v1", "interface_v2", "tp_lcm_size"}
)

Positive = Annotated[int, msgspec.Meta(gt=0)]
Address = Annotated[str, msgspec.Meta(pattern=r":[0-9]+$")]  # "host:port"

# SGLang's cache controller asks for at most this many pages per storage call
# (hicache_storage.STORAGE_BATCH_SIZE).
SGLANG_BATCH_PAGES = 128
STAGING_BYTES_CAP = 256 << 20


class AdapterConfigError(ValueError):
    """An extra config the adapter cannot run with (missing, mistyped or unknown keys)."""


class AdapterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One SGLang rank's view of the kvrelay tier, its types checked by msgspec.

    `servers` are cache server control addresses ("host:port"), `token` the
    cluster token, `backend` the transfer backend for page bytes (tcp or ucx).
    The model identity (`model_id`, `weights_fingerprint`, `salt`) names the
    pages' namespace together with the geometry taken from SGLang's host pool;
    `num_layers` / `num_kv_heads` are the model's global counts, needed when a
    rank sees only part of them (PP, or TP beyond the KV heads) and otherwise
    taken from the pool. `mla_rope_interleave` is the MLA model's
    `rope_interleave` (DeepSeek's default, true). A DSA model's pages name `index_topk` and its
    global `index_layers` (taken from the indexer pool at pp_size 1); draft
    pages name `draft_model_id` / `draft_weights_fingerprint` (the target's,
    `#draft`, by default) and `draft_num_kv_heads` (MHA drafts). Every call
    returns within about `timeout_s`.
    `staging_pages` sizes each staging arena (reads, writes) in pages; unset,
    it holds one SGLang storage batch (`SGLANG_BATCH_PAGES`) so that a batch
    moves in one round of server calls, fewer when that exceeds
    `STAGING_BYTES_CAP`.
    """

    servers: Annotated[tuple[Address, ...], msgspec.Meta(min_length=1)]
    token: Annotated[str, msgspec.Meta(min_length=1)]
    backend: Literal["tcp", "ucx"] = "tcp"
    model_id: str = ""
    weights_fingerprint: str = ""
    salt: str = ""
    num_layers: Positive | None = None
    num_kv_heads: Positive | None = None
    mla_rope_interleave: bool = True
    index_topk: Positive | None = None
    index_layers: tuple[int, ...] | None = None
    draft_model_id: str = ""
    draft_weights_fingerprint: str = ""
    draft_num_kv_heads: Positive | None = None
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=600)] = 5.0
    staging_pages: Positive | None = None

    def staging_rows(self, rect_bytes: int) -> int:
        """Pages per staging arena for rectangles of `rect_bytes`."""
        if self.staging_pages is not None:
            return self.staging_pages
        return max(1, min(SGLANG_BATCH_PAGES, STAGING_BYTES_CAP // rect_bytes))

    @classmethod
    def from_extra_config(cls, extra: dict | None) -> AdapterConfig:
        """Build from SGLang's extra config; unknown keys are refused, not ignored."""
        if not isinstance(extra, dict):
            raise AdapterConfigError("the kvrelay backend needs an extra config (a JSON object)")
        own = set(cls.__struct_fields__)
        unknown = sorted(set(extra) - own - SGLANG_KEYS)
        if unknown:
            raise AdapterConfigError(f"unknown extra config keys {unknown}; known: {sorted(own)}")
        values = {k: v for k, v in extra.items() if k in own}
        if isinstance(values.get("servers"), str):  # "host:port,host:port"
            values["servers"] = [s for s in values["servers"].split(",") if s]
        try:
            return msgspec.convert(values, cls)
        except msgspec.ValidationError as exc:
            raise AdapterConfigError(f"kvrelay extra config: {exc}") from exc
