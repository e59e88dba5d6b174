"""Figures of a demo run: per cache mode, hit rate against the workload's
optimum, TTFT and inter-token latency percentiles, throughput; a table, a
JSON document and a PNG."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvrelay.demo.replay import TurnRecord

MODE_LABELS = {"shared": "shared tier", "local": "local caches only", "none": "no cache"}


@dataclass(slots=True)
class ModeSummary:
    mode: str
    requests: int
    errors: int
    prompt_tokens: int
    hit_tokens: int
    tier_tokens: int
    optimum_tokens: int
    after_redeploy_hit: float  # hit rate of the turns after the prefill pool changed config
    after_redeploy_optimum: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    tokens_per_s: float
    wall_s: float

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / max(1, self.prompt_tokens)

    @property
    def optimum(self) -> float:
        return self.optimum_tokens / max(1, self.prompt_tokens)


def _pct(values, q) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def summarize(mode, records: list[TurnRecord], optimum: dict, split_turn: int, wall_s: float):
    ok = [r for r in records if r.error is None]
    after = [r for r in ok if r.turn >= split_turn]
    gaps = [g for r in ok for g in r.gaps_s]

    def rate(rs, tokens):
        return sum(tokens(r) for r in rs) / max(1, sum(r.prompt_tokens for r in rs))

    return ModeSummary(
        mode=mode,
        requests=len(records),
        errors=len(records) - len(ok),
        prompt_tokens=sum(r.prompt_tokens for r in ok),
        hit_tokens=sum(r.cached_local + r.cached_tier for r in ok),
        tier_tokens=sum(r.cached_tier for r in ok),
        optimum_tokens=sum(optimum[(r.session, r.turn)] for r in ok),
        after_redeploy_hit=rate(after, lambda r: r.cached_local + r.cached_tier),
        after_redeploy_optimum=rate(after, lambda r: optimum[(r.session, r.turn)]),
        ttft_p50=_pct([r.ttft_s for r in ok], 50),
        ttft_p99=_pct([r.ttft_s for r in ok], 99),
        itl_p50=_pct(gaps, 50),
        itl_p99=_pct(gaps, 99),
        tokens_per_s=sum(len(r.tokens) for r in ok) / max(wall_s, 1e-9),
        wall_s=wall_s,
    )


def table(summaries: list[ModeSummary]) -> str:
    base = next((s for s in summaries if s.mode == "none"), None)
    head = ("| mode | hit rate | optimum | tier share | hit after redeploy (opt) "
            "| TTFT p50 s | TTFT p99 s | p50 vs no cache | ITL p50 ms | ITL p99 ms "
            "| tok/s | wall s | errors |")  # fmt: skip
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in summaries:
        speedup = f"{base.ttft_p50 / s.ttft_p50:.1f}x" if base and s.ttft_p50 > 0 else "-"
        lines.append(
            f"| {MODE_LABELS.get(s.mode, s.mode)} | {s.hit_rate:.3f} | {s.optimum:.3f} "
            f"| {s.tier_tokens / max(1, s.hit_tokens):.2f} "
            f"| {s.after_redeploy_hit:.3f} ({s.after_redeploy_optimum:.3f}) "
            f"| {s.ttft_p50:.3f} | {s.ttft_p99:.3f} | {speedup} "
            f"| {s.itl_p50 * 1e3:.1f} | {s.itl_p99 * 1e3:.1f} "
            f"| {s.tokens_per_s:.1f} | {s.wall_s:.0f} | {s.errors} |"
        )
    return "\n".join(lines)


def plot(path, runs: dict[str, list[TurnRecord]], summaries: list[ModeSummary]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, records in runs.items():
        turns = sorted({r.turn for r in records if r.error is None})
        medians = [np.median([r.ttft_s for r in records if r.turn == t and r.error is None])
                   for t in turns]  # fmt: skip
        left.plot([t + 1 for t in turns], medians, marker="o", label=MODE_LABELS.get(mode, mode))
    left.set_xlabel("turn")
    left.set_ylabel("median TTFT (s)")
    left.set_yscale("log")
    left.set_title("time to first token as the context grows")
    left.legend()
    names = [MODE_LABELS.get(s.mode, s.mode) for s in summaries]
    x = np.arange(len(summaries))
    right.bar(x - 0.2, [s.hit_rate for s in summaries], 0.4, label="hit rate")
    right.bar(x + 0.2, [s.optimum for s in summaries], 0.4, label="workload optimum")
    right.set_xticks(x, names)
    right.set_ylim(0, 1)
    right.set_title("prompt tokens served from cache")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
