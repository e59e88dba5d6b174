"""Messages between a worker's front and its rank processes.

The front sends every rank the same command and reads one reply per rank
(`ParallelEngine.ask`). Each command is a `msgspec.Struct` tagged by `op`
that names its reply type (`reply`); it travels as msgpack bytes and is
decoded and validated in one place, `RankService.serve`, in the rank. Token
arrays travel packed (little-endian uint32), as on the wire to control.
An exception a rank raises still reaches the front as the exception itself
(the engine's error path), so the front catches `PoolExhausted` by class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Union

import msgspec

from kvrelay.rpc.messages import Count, Ok, Tokens
from kvrelay.rpc.worker_ops import DraftPulled, FinishReason, HandleRef, Params, TokenId


class RankMessage(msgspec.Struct, tag_field="op", forbid_unknown_fields=True):
    """A command of the front to every rank; `reply` is what each answers."""

    reply: ClassVar[type] = Ok


class Refusal(msgspec.Struct, forbid_unknown_fields=True):
    """A request the ranks answered with an error of their own (every rank
    agreed on it): `error` is the exception class name."""

    error: str
    message: str


# -- every role -----------------------------------------------------------------------
class RankCounters(msgspec.Struct, forbid_unknown_fields=True):
    bytes_from_tier: Count
    bytes_to_tier: Count
    free_pages: Count
    staging_free: Count
    leases: Count = 0  # prefill: published handles not yet released
    writeback_skipped_pages: Count = 0  # decode: full pages not written back, no staging rows


class Counters(RankMessage, tag="counters"):
    reply: ClassVar[type] = RankCounters


class ClearCache(RankMessage, tag="clear_cache"):
    """Drop the pool's cached (unreferenced) pages."""


# -- prefill ---------------------------------------------------------------------------
class PrefillItem(msgspec.Struct, forbid_unknown_fields=True):
    tokens: Tokens
    params: Params
    lease_s: float  # how long the staging rows wait for decode


class RankPrefill(msgspec.Struct, forbid_unknown_fields=True):
    """One rank's answer for one prefilled request."""

    first_token: TokenId
    finish_reason: FinishReason | None  # set: decode is not needed
    cached_local: Count  # prompt tokens from this worker's pool
    cached_tier: Count  # prompt tokens from the tier
    tier_pages: Count  # leading full pages sealed in the tier
    pages: Count
    handle: HandleRef | None  # None: a replica, a CP rank owning no page, or finished
    timings: dict[str, float]
    draft: HandleRef | None = None  # over its draft (MTP) pages, with speculation


class PrefillRan(msgspec.Struct, forbid_unknown_fields=True):
    """The leading requests of the batch that ran (the front keeps the others
    queued); or `refused`: the first request can never fit (its new pages
    exceed the whole staging arena)."""

    answers: list[RankPrefill] = msgspec.field(default_factory=list)
    refused: Refusal | None = None


class PrefillBatch(RankMessage, tag="prefill_batch"):
    reply: ClassVar[type] = PrefillRan
    items: list[PrefillItem]


class DropHandles(RankMessage, tag="drop_handles"):
    """End this rank's leases among `handles` (`BlockHandle.to_bytes()`):
    control went away before decode could read them."""

    handles: list[bytes]


# -- decode ----------------------------------------------------------------------------
class LoadStarted(msgspec.Struct, forbid_unknown_fields=True):
    local_pages: Count  # pages of the prompt found in this worker's pool


class LoadStart(RankMessage, tag="load_start"):
    """Reserve room for a request and start pulling its pages."""

    reply: ClassVar[type] = LoadStarted

    load_id: Count
    tokens: Tokens  # the prompt
    first_token: TokenId
    params: Params
    pages: Count
    tier_pages: Count
    handles: list[HandleRef]


class LoadDone(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A load whose pulls finished on every rank: admitted as `seq_id`, or failed."""

    load_id: Count
    local_pages: Count
    seq_id: int | None = None
    error: Refusal | None = None
    tier_pages: Count = 0
    prefill_pages: Count = 0
    bytes_from_prefill: Count = 0
    recomputed_pages: Count = 0  # neither the tier nor prefill had them
    draft: DraftPulled | None = None  # from a rank holding the MTP layer


class SeqOutput(msgspec.Struct, forbid_unknown_fields=True):
    """What one step produced for one sequence on one rank."""

    seq_id: int
    tokens: Tokens  # new tokens of this step
    finish_reason: FinishReason | None
    spec: dict[str, int] | None = None  # speculation counts, once finished
    written: Count | None = None  # pages written back, if already known
    writing: bool = False  # a write-back of this rank still runs


class Stepped(msgspec.Struct, forbid_unknown_fields=True):
    loads: list[LoadDone]
    outputs: list[SeqOutput]
    writes_done: list[tuple[int, Count]]  # (seq_id, pages written) of finished write-backs


class Step(RankMessage, tag="step"):
    """Finish the loads that are done, then one step of the running batch."""

    reply: ClassVar[type] = Stepped


class Cancel(RankMessage, tag="cancel"):
    seq_id: int


# -- the rank side ---------------------------------------------------------------------
class RankService:
    """What a worker runs in each rank: `handlers` maps each command type to
    its method; `serve` decodes a command (validated against the union of
    those types), runs it and encodes the reply (None: `Ok`)."""

    def __init__(self, handlers: dict[type[RankMessage], Callable[[Any], Any]]) -> None:
        self.handlers = handlers
        self._decoder = msgspec.msgpack.Decoder(Union[tuple(handlers)])  # noqa: UP007

    def serve(self, payload: bytes) -> bytes:
        message = self._decoder.decode(payload)
        reply = self.handlers[type(message)](message)
        return msgspec.msgpack.encode(Ok() if reply is None else reply)

    def close(self) -> None:
        pass


_DECODERS: dict[type, msgspec.msgpack.Decoder] = {}


def encode(message: RankMessage) -> bytes:
    return msgspec.msgpack.encode(message)


def decode_reply(message: RankMessage, payload: bytes):
    """A rank's reply to `message`, validated as its `reply` type."""
    kind = type(message).reply
    decoder = _DECODERS.get(kind)
    if decoder is None:
        decoder = _DECODERS[kind] = msgspec.msgpack.Decoder(kind)
    return decoder.decode(payload)
