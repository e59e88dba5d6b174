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


def sampling(params: dict, **override) -> SamplingParams:
    """The protocol's params (as `params_of` gives them) as SamplingParams.
    A missing seed is 0, so prefill and decode draw the same tokens."""
    fields = {**params, **override}
    fields["seed"] = fields.get("seed") or 0
    fields["stop_token_ids"] = tuple(fields.get("stop_token_ids") or ())
    return SamplingParams(**fields)


def tokens_of(packed: bytes, vocab: int, name: str = "tokens") -> list[int]:
    """Packed token ids (the message type checked their framing) as a list,
    each inside the vocabulary."""
    array = np.frombuffer(packed, dtype="<u4")
    if array.size and int(array.max()) >= vocab:
        raise RequestError(f"{name} must be integers in [0, {vocab})")
    return array.tolist()


def params_of(params: Params, vocab: int) -> dict:
    """The request's params as the ranks take them; RequestError for values
    this model cannot honour."""
    # NaN passed every range check and then failed the whole batch.
    if not (math.isfinite(params.temperature) and math.isfinite(params.top_p)):
        raise RequestError("temperature and top_p must be finite numbers")
    if any(t >= vocab for t in params.stop_token_ids):
        raise RequestError(f"stop_token_ids must be integers in [0, {vocab})")
    out = msgspec.structs.asdict(params)
    sampling(out)  # SamplingParams' own range checks
    return out


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
    writeback_skipped_pages: int = 0  # decode: full pages not written back, no staging rows

    def as_dict(self) -> dict:
        return asdict(self)
