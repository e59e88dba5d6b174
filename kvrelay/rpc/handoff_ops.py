"""Frames of a vLLM prefill engine's handoff service (`kvrelay.adapters.vllm.handoff`).

A decode engine's worker asks the prefill engine's worker of the same rank
for a finished prefill's blocks; the reply is a block handle over the
prefill's own KV cache memory, which the decode pulls one-sided and then
releases through the prefill's transfer agent.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvrelay.rpc.messages import U64, Message

BlockIds = Annotated[list[U64], msgspec.Meta(max_length=1 << 20)]


class HandoffWelcome(Message, tag="handoff"):
    """The prefill rank's cache: where block `b` of layer `l` lies in its
    registered memory (`layer_offsets[l] + b * block_stride`, `block_bytes`
    long) and the fingerprint of the tiling inside a block."""

    layout: str
    layer_offsets: list[U64]
    block_stride: U64
    block_bytes: U64


class HandoffPull(Message, tag="handoff_pull"):
    """Blocks of a held request the reader wants; `layout` is the reader's
    fingerprint, which must equal the prefill's (bytes move as they are)."""

    request_id: Annotated[str, msgspec.Meta(max_length=512)]
    block_ids: BlockIds
    layout: str


class HandoffGrant(Message, tag="handoff_grant"):
    """A block handle (`BlockHandle.to_bytes`) over the blocks' runs, under a
    lease that ends when the reader releases it or the hold expires."""

    handle: bytes
