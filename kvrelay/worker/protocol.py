"""The worker side of `kvrelay.rpc.worker_ops`: what the typed messages do
not say by themselves (token ids inside this model's vocabulary, the
sampling values `SamplingParams` refuses), the worker counters."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import msgspec
import numpy as np

from kvrelay.model.errors import RequestError
from kvrelay.model.sampling import SamplingParams
from kvrelay.rpc.worker_ops import Params


class Busy(Exception):
    """The worker's queue is full (or it is draining): try another worker."""


def pages_of(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def sampling(params: Params, **override) -> SamplingParams:
    """The protocol's params as SamplingParams. A missing seed is 0, so
    prefill and decode draw the same tokens."""
    fields = msgspec.structs.asdict(params) | override
    fields["seed"] = fields["seed"] or 0
    fields["stop_token_ids"] = tuple(fields["stop_token_ids"])
    return SamplingParams(**fields)


def check_tokens(packed: bytes, vocab: int, name: str = "tokens") -> int:
    """The number of packed token ids (the message type checked their
    framing); RequestError unless each lies inside the vocabulary."""
    array = np.frombuffer(packed, dtype="<u4")
    if array.size and int(array.max()) >= vocab:
        raise RequestError(f"{name} must be integers in [0, {vocab})")
    return int(array.size)


def check_params(params: Params, vocab: int) -> None:
    """RequestError for sampling values this model cannot honour."""
    # NaN passed every range check and then failed the whole batch.
    if not (math.isfinite(params.temperature) and math.isfinite(params.top_p)):
        raise RequestError("temperature and top_p must be finite numbers")
    if any(t >= vocab for t in params.stop_token_ids):
        raise RequestError(f"stop_token_ids must be integers in [0, {vocab})")
    sampling(params)  # SamplingParams' own range checks


@dataclass(slots=True)
class WorkerCounters:
    """The `stats` map of the protocol (heartbeats and the `stats` op)."""

    requests: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0
    local_hit_tokens: int = 0
    tier_hit_tokens: int = 0
    generated_tokens: int = 0
    bytes_from_tier: int = 0
    bytes_to_tier: int = 0
    bytes_from_prefill: int = 0
    busy_rejections: int = 0
    errors: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_steps: int = 0
    writeback_skipped_pages: int = 0  # decode: full pages not written back, no staging rows

    def as_dict(self) -> dict:
        return asdict(self)
