"""The P/D handoff's `kv_transfer_params`, as vLLM's disaggregated serving passes them.

vLLM's proxy pattern: the prefill request carries `{"do_remote_decode": true}`
and `max_tokens=1`; the prefill engine's reply carries the params below; the
proxy sends the same prompt to a decode engine with those params. The
`do_remote_*` keys are vLLM's convention (the same proxy drives
NixlConnector); kvrelay's part is under `"kvrelay"`.
"""

from __future__ import annotations

import logging
from typing import Annotated

import msgspec

log = logging.getLogger("kvrelay.adapters.vllm")

Address = Annotated[str, msgspec.Meta(pattern=r":[0-9]+$")]


class HandoffParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where a finished prefill's blocks wait: one handoff service per prefill
    rank (`agents[r]`), the prefill's request id and block ids, the tokens
    its KV covers, and the namespace (model identity and geometry) they are in."""

    agents: Annotated[list[Address], msgspec.Meta(min_length=1)]
    request_id: str
    block_ids: list[Annotated[int, msgspec.Meta(ge=0)]]
    num_tokens: Annotated[int, msgspec.Meta(ge=0)]
    namespace: str  # hex
    expires: float  # wall clock: the decode's pull must end before


def prefill_reply(params: HandoffParams) -> dict:
    """The finished prefill's `kv_transfer_params`."""
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "kvrelay": msgspec.to_builtins(params)}  # fmt: skip


def wants_remote_decode(params: dict | None) -> bool:
    """A prefill request whose KV a decode engine will pull."""
    return bool(params) and bool(params.get("do_remote_decode"))


def remote_prefill(params: dict | None, namespace: bytes) -> HandoffParams | None:
    """The handoff a decode request carries, or None (none, malformed, another
    model's: each is a local prefill, the last two with a warning)."""
    if not params or not params.get("do_remote_prefill") or "kvrelay" not in params:
        return None
    try:
        handoff = msgspec.convert(params["kvrelay"], HandoffParams)
    except msgspec.ValidationError as exc:
        log.warning("kvrelay: ignoring malformed kv_transfer_params (%s); prefilling here", exc)
        return None
    if handoff.namespace != namespace.hex():
        log.warning(
            "kvrelay: kv_transfer_params of another model or geometry (namespace %s..., "
            "this engine %s...); prefilling here", handoff.namespace[:12], namespace.hex()[:12],
        )  # fmt: skip
        return None
    return handoff
