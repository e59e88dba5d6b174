"""Request statistics kept by control: counters, token sources, latency percentiles.

Token sources come from the prefill replies (`cached_tokens.local`,
`cached_tokens.tier`, the rest computed); bytes moved and per-node queues
come from the workers' heartbeats (the registry).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

SAMPLES = 4096  # latency samples kept per series (a sliding window)
PHASE_SAMPLES = 512  # per (request class, phase)
QUANTILES = (0.5, 0.9, 0.99)
# Request classes by prompt length (tokens): the upper bound of each bucket.
# TTFT's phases scale differently with the context (compute with new tokens
# over it, tier pull with its pages), so they are kept per class.
CLASS_BOUNDS = ((8192, "<8K"), (32768, "8K-32K"), (131072, "32K-128K"),
                (524288, "128K-512K"), (None, ">=512K"))  # fmt: skip
# A request's time to first token, in order: control (tier probe, dispatch,
# the wire), then the prefill worker's own phases. decode_pull (decode's pull
# of the pages plus its first step) comes after the first token.
TTFT_PHASES = ("control", "queue", "lookup", "tier_pull", "compute", "stage", "publish")


def request_class(prompt_tokens: int) -> str:
    for bound, name in CLASS_BOUNDS:
        if bound is None or prompt_tokens < bound:
            return name
    raise AssertionError("unreachable")


def ttft_phases(ttft_s: float, prefill_timings: dict[str, float]) -> dict[str, float]:
    """TTFT split into TTFT_PHASES: the prefill worker's breakdown, and what
    remains of the TTFT control measured (never below zero)."""
    phases = {name: float(prefill_timings.get(f"{name}_s", 0.0)) for name in TTFT_PHASES[1:]}
    return {"control": max(0.0, ttft_s - sum(phases.values()))} | phases


def percentile(values, q: float) -> float | None:
    """Nearest-rank percentile; None without samples."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass(slots=True)
class ControlStats:
    requests: int = 0
    completed: int = 0
    errors: int = 0  # requests answered with an error (any status)
    client_errors: int = 0  # of those, 4xx (bad input)
    retries: int = 0  # a prefill or decode attempt repeated elsewhere after a fault
    busy: int = 0  # Busy answers that moved a request to the next worker
    busy_waits: int = 0  # waits for capacity after every prefill worker was busy
    resumed: int = 0  # requests resumed through prefill after a decode died mid-stream
    cancelled: int = 0  # clients that went away mid-request
    prompt_tokens: int = 0
    local_tokens: int = 0
    tier_tokens: int = 0
    computed_tokens: int = 0
    completion_tokens: int = 0
    probed_tier_tokens: int = 0  # what control's own tier probes found
    ttft_s: deque = field(default_factory=lambda: deque(maxlen=SAMPLES))
    itl_s: deque = field(default_factory=lambda: deque(maxlen=SAMPLES))
    # (request class, phase) -> recent samples, for /stats' per-class breakdown.
    phases_s: dict = field(default_factory=dict)
    ttft_sum: float = 0.0
    ttft_count: int = 0
    itl_sum: float = 0.0
    itl_count: int = 0
    # The app's Prometheus histograms (metrics.LatencyHistograms), fed as
    # latencies are recorded; None when no /metrics is served.
    histograms: object | None = None

    def _observe(self, what: str, seconds: float, count: int = 1, **labels: str) -> None:
        if self.histograms is not None:
            self.histograms.observe(what, seconds, count, **labels)

    def record_prefill(self, prompt_tokens: int, local: int, tier: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.local_tokens += local
        self.tier_tokens += tier
        self.computed_tokens += max(prompt_tokens - local - tier, 0)

    def record_ttft(self, seconds: float) -> None:
        self.ttft_s.append(seconds)
        self.ttft_sum += seconds
        self.ttft_count += 1
        self._observe("ttft", seconds)

    def record_gap(self, seconds: float, tokens: int) -> None:
        """A batch of `tokens` arrived `seconds` after the previous one: each
        token's inter-token latency is the gap shared over the batch."""
        if tokens <= 0:
            return
        per_token = seconds / tokens
        for _ in range(tokens):
            self.itl_s.append(per_token)
        self.itl_sum += seconds
        self.itl_count += tokens
        self._observe("itl", per_token, tokens)

    def record_prefill_phases(self, timings: dict[str, float]) -> None:
        """The prefill worker's own breakdown (`queue_s`, `lookup_s`, ...)."""
        for name, seconds in timings.items():
            self._observe("prefill_phase", seconds, phase=name.removesuffix("_s"))

    def record_transfer(self, seconds: float, prompt_tokens: int | None = None) -> None:
        """Decode request sent with the handles -> its first token batch."""
        self._observe("handoff", seconds)
        if prompt_tokens is not None:
            self._phase(request_class(prompt_tokens), "decode_pull", seconds)

    def record_ttft_phases(self, prompt_tokens: int, phases: dict[str, float]) -> None:
        """One request's TTFT by phase (`ttft_phases`), under its class."""
        klass = request_class(prompt_tokens)
        for name, seconds in phases.items():
            self._phase(klass, name, seconds)

    def _phase(self, klass: str, name: str, seconds: float) -> None:
        samples = self.phases_s.get((klass, name))
        if samples is None:
            samples = self.phases_s[klass, name] = deque(maxlen=PHASE_SAMPLES)
        samples.append(seconds)
        self._observe("ttft_phase", seconds, phase=name, request_class=klass)

    def phase_breakdown(self) -> dict:
        """{class: {phase: {p50, p90, p99, count}}}, classes and phases in order."""
        order = [name for _, name in CLASS_BOUNDS]
        names = (*TTFT_PHASES, "decode_pull")
        out: dict[str, dict] = {}
        for klass in order:
            for name in names:
                samples = self.phases_s.get((klass, name))
                if samples:
                    summary = self.latency(samples) | {"count": len(samples)}
                    out.setdefault(klass, {})[name] = summary
        return out

    def record_tier_probe(self, seconds: float) -> None:
        self._observe("tier_probe", seconds)

    def hit_rates(self) -> dict[str, float | None]:
        total = self.prompt_tokens
        if total == 0:
            return {"local": None, "tier": None, "computed": None}
        return {
            "local": self.local_tokens / total,
            "tier": self.tier_tokens / total,
            "computed": self.computed_tokens / total,
        }

    def latency(self, samples) -> dict[str, float | None]:
        return {f"p{round(q * 100)}": percentile(samples, q) for q in QUANTILES}

    def snapshot(self) -> dict:
        return {
            "requests": self.requests, "completed": self.completed, "errors": self.errors,
            "client_errors": self.client_errors, "retries": self.retries, "busy": self.busy,
            "busy_waits": self.busy_waits, "resumed": self.resumed,
            "cancelled": self.cancelled,
            "tokens": {
                "prompt": self.prompt_tokens, "local": self.local_tokens,
                "tier": self.tier_tokens, "computed": self.computed_tokens,
                "completion": self.completion_tokens, "probed_tier": self.probed_tier_tokens,
            },
            "hit_rates": self.hit_rates(),
            "ttft_s": self.latency(self.ttft_s) | {"count": self.ttft_count},
            "inter_token_s": self.latency(self.itl_s) | {"count": self.itl_count},
            "ttft_phases_s": self.phase_breakdown(),
        }  # fmt: skip
