"""What `Dispatcher.run` yields to the completion routes, one type per event."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class FirstToken:
    """Prefill answered with the first token. The request's first answer
    also carries its TTFT, cache hits and prefill phases (a resumed
    request's later prefills do not)."""

    tokens: list[int]
    prefill: str  # node id
    cached: dict[str, int] = field(default_factory=dict)  # {"local", "tier"} tokens
    ttft_s: float | None = None
    prefill_timings: dict[str, float] = field(default_factory=dict)
    decode: None = None  # no decode worker yet (events share the field)


@dataclass(slots=True)
class Tokens:
    """A batch of tokens a decode worker streamed."""

    tokens: list[int]
    decode: str  # node id


@dataclass(slots=True)
class Done:
    """The request ended: `finish_reason` ("stop" or "length")."""

    finish_reason: str
    decode: str | None = None  # node id; None when prefill's first token ended it
    decode_first_s: float | None = None  # decode request sent -> its first token batch


Event = FirstToken | Tokens | Done
