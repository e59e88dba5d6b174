"""Messages between control and the prefill/decode workers' fronts
(docs/serving-protocol.md is checked against these types by a test).

One TCP connection per request: hello -> `WorkerWelcome`, then one request.
`Prefill` is answered by one `PrefillReply`; `Decode` by a stream of
`TokenBatch` frames and a last `DecodeDone`; either may be an `Error`
instead (`Busy`, `RequestError`, `PoolExhausted`, anything else a fault).
`WorkerStats` -> `StatsReply`; `FlushPool`, `Drain` -> `Ok`.
"""

from __future__ import annotations

import enum
from typing import Annotated, Literal, Union

import msgspec

from kvrelay.rpc.cache_ops import DEFAULT_LEASE_S, LeaseSeconds
from kvrelay.rpc.messages import Count, Message, Run, Tokens

TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]
FinishReason = Literal["stop", "length"]


class Role(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class Params(msgspec.Struct, forbid_unknown_fields=True):
    """Sampling parameters (kvrelay.model `SamplingParams` fields); seed None
    means seed 0 on both workers, so prefill and decode draw the same tokens."""

    max_new_tokens: Annotated[int, msgspec.Meta(ge=1)] = 16
    temperature: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    top_k: Count = 0
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    seed: int | None = None
    stop_token_ids: list[TokenId] = msgspec.field(default_factory=list)


def _packed(tokens: bytes, name: str = "tokens") -> None:
    if not tokens or len(tokens) % 4:
        raise ValueError(f"{name} must be packed uint32 token ids, at least one")


class HandleRef(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One writer rank's pages: `handle` is `BlockHandle.to_bytes()` (for each
    page i, the rank's rectangle runs shifted to page i's arena row), `runs`
    the rank's rectangle runs within one page object."""

    handle: bytes
    runs: list[Run]
    # Only under context parallelism: the page indices the handle holds, in
    # its runs' order (CP rank r of C: pages i with i % C == r).
    pages: list[Count] | None = None
    # A handle over draft (MTP) pages (`runs` within a draft page object;
    # `pages` set): a decode without the MTP layer releases it unread.
    draft: bool = False


class WorkerWelcome(Message, tag="worker"):
    role: Role


class Prefill(Message, tag="prefill"):
    rid: str
    tokens: Tokens
    params: Params = msgspec.field(default_factory=Params)
    lease_s: LeaseSeconds = DEFAULT_LEASE_S  # how long staging rows wait for decode

    def __post_init__(self) -> None:
        _packed(self.tokens)


class CachedTokens(msgspec.Struct):
    local: Count = 0
    tier: Count = 0


class ParallelShape(msgspec.Struct):
    tp: int = 1
    pp: int = 1
    cp: int = 1


class PrefillReply(Message, tag="prefill_reply"):
    rid: str
    first_token: TokenId
    prompt_tokens: Count
    pages: Count  # pages of the prompt (full + trailing partial)
    finish_reason: FinishReason | None = None  # set: decode is not needed
    cached_tokens: CachedTokens = msgspec.field(
        default_factory=CachedTokens
    )  # prompt tokens not computed, by source
    tier_pages: Count = 0  # leading full pages sealed in the tier (hit + written through)
    spec: ParallelShape = msgspec.field(default_factory=ParallelShape)  # prefill's parallel config
    handles: list[HandleRef] = msgspec.field(
        default_factory=list
    )  # one per writer rank; [] when finish_reason is set
    timings: dict[str, float] = msgspec.field(
        default_factory=dict
    )  # queue_s, lookup_s, tier_pull_s, compute_s, stage_s, publish_s


class Decode(Message, tag="decode"):
    rid: str
    tokens: Tokens  # the prompt
    first_token: TokenId
    pages: Count
    params: Params = msgspec.field(default_factory=Params)
    tier_pages: Count = 0
    handles: list[HandleRef] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        _packed(self.tokens)


class TokenBatch(Message, tag="tokens"):
    rid: str
    tokens: Tokens  # newly generated tokens (after first_token)

    def __post_init__(self) -> None:
        _packed(self.tokens)


class Pulled(msgspec.Struct):
    local_pages: Count = 0
    tier_pages: Count = 0
    prefill_pages: Count = 0
    recomputed_pages: Count = 0  # neither the tier nor prefill had them: decode computed them


class DraftPulled(msgspec.Struct):
    """With `--speculative`: the draft pages of prompt + first token that decode
    restored, by source (the engine recomputes the rest)."""

    local_pages: Count = 0
    tier_pages: Count = 0
    prefill_pages: Count = 0


class DecodeDone(Message, tag="done"):
    rid: str
    finish_reason: FinishReason
    pulled: Pulled = msgspec.field(default_factory=Pulled)
    written_back_pages: Count = 0
    # With `--speculative`: {"proposed", "accepted", "steps"} of the request.
    spec: dict[str, int] | None = None
    draft_pulled: DraftPulled | None = None  # with `--speculative`


class WorkerStats(Message, tag="stats"):
    pass


class StatsReply(Message, tag="stats_reply"):
    stats: dict[str, int]


class FlushPool(Message, tag="flush"):
    pass


class Drain(Message, tag="drain"):
    pass


WorkerRequest = Union[Prefill, Decode, WorkerStats, FlushPool, Drain]  # noqa: UP007
