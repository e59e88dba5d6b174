"""The worker side of `docs/serving-protocol.md`: request validation, the
`params` map, error replies, the worker counters."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvrelay.model.errors import RequestError
from kvrelay.model.sampling import SamplingParams

PARAM_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids")


class Busy(Exception):
    """The worker's queue is full (or it is draining): try another worker."""


def pages_of(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def sampling(params: dict, **override) -> SamplingParams:
    """The protocol's `params` map (validated by `check_params`) as SamplingParams.
    A missing seed is 0, so prefill and decode draw the same tokens."""
    fields = {**params, **override}
    fields["seed"] = fields.get("seed") or 0
    fields["stop_token_ids"] = tuple(fields.get("stop_token_ids") or ())
    return SamplingParams(**fields)


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_tokens(tokens, vocab: int, name: str = "tokens") -> list[int]:
    if not isinstance(tokens, list) or not tokens:
        raise RequestError(f"{name} must be a non-empty list of token ids")
    if not all(is_int(t) and 0 <= t < vocab for t in tokens):
        raise RequestError(f"{name} must be integers in [0, {vocab})")
    return tokens


def check_params(params, vocab: int) -> dict:
    """The `params` map with defaults filled in; RequestError for bad values."""
    if not isinstance(params, dict):
        raise RequestError("params must be a map")
    unknown = set(params) - set(PARAM_FIELDS)
    if unknown:
        raise RequestError(f"unknown params {sorted(map(repr, unknown))}")
    out = {
        "max_new_tokens": params.get("max_new_tokens", 16),
        "temperature": params.get("temperature", 0.0),
        "top_k": params.get("top_k", 0),
        "top_p": params.get("top_p", 1.0),
        "seed": params.get("seed"),
        "stop_token_ids": params.get("stop_token_ids") or [],
    }
    if not is_int(out["max_new_tokens"]) or not is_int(out["top_k"]):
        raise RequestError("max_new_tokens and top_k must be integers")
    if not all(isinstance(out[k], int | float) for k in ("temperature", "top_p")):
        raise RequestError("temperature and top_p must be numbers")
    if out["seed"] is not None and not is_int(out["seed"]):
        raise RequestError("seed must be an integer or null")
    if not isinstance(out["stop_token_ids"], list) or not all(
        is_int(t) and 0 <= t < vocab for t in out["stop_token_ids"]
    ):
        raise RequestError(f"stop_token_ids must be integers in [0, {vocab})")
    sampling(out)  # SamplingParams' own range checks
    return out


def error_reply(exc: BaseException, rid=None) -> dict:
    reply = {"ok": False, "error": type(exc).__name__, "message": str(exc)[:2000]}
    if rid is not None:
        reply["rid"] = rid
    return reply


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
