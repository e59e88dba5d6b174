"""`kvrelay bench sglang-server`'s numbers from its requests: per mode and phase
(before and after a redeploy), hit rate against the optimum, TTFT quantiles,
whether the modes generated the same tokens, and the request-by-request
TTFT ratio of two modes."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from kvrelay.demo.workload import optimum_hit_tokens


@dataclass(frozen=True)
class Served:
    """One request as a mode's server answered it."""

    turn: int
    prompt: list[int]
    reply: object  # SGLangServer's Reply: output_ids, prompt_tokens, cached/storage_tokens, ttft_s
    seconds: float  # the whole request, last token included


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(served: list[Served]) -> dict:
    replies = [s.reply for s in served]
    prompt_tokens = sum(r.prompt_tokens for r in replies)
    ttfts = [r.ttft_s for r in replies]
    return {
        "hit_rate": sum(r.cached_tokens for r in replies) / prompt_tokens,
        "storage_hit_rate": sum(r.storage_tokens for r in replies) / prompt_tokens,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p25_s": percentile(ttfts, 0.25),
        "ttft_p75_s": percentile(ttfts, 0.75),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "ttfts_s": ttfts,
        "prompt_tokens": prompt_tokens,
        "requests": len(replies),
        "serving_s": sum(s.seconds for s in served),
    }


def reference_mode(modes: list[str]) -> str:
    """Whose tokens the others' are compared with: the server without an L3
    (it computes every token's KV itself) where it ran."""
    return "none" if "none" in modes else modes[0]


def phase(requests: dict[str, list[Served]], turns: range, page_size: int,
          reference: str) -> dict:  # fmt: skip
    """Every mode's summary over its requests of `turns`; its optimum (the
    prompt tokens an infinite cache of every page seen since the first turn
    would serve, over the mode's own requests: a mode whose tokens differ has
    other contexts); the hit rate of the phase's first turn (after a
    redeploy: what the store kept); and which modes' tokens differ from
    `reference`'s in these turns."""
    modes, outputs = {}, {}
    for mode, served in requests.items():
        best = optimum_hit_tokens([(s.prompt, s.reply.output_ids) for s in served], page_size)
        inside = [i for i, s in enumerate(served) if s.turn in turns]
        picked = [served[i] for i in inside]
        entry = summary(picked)
        optimum = sum(best[i] for i in inside) / sum(len(served[i].prompt) for i in inside)
        first = [s.reply for s in picked if s.turn == turns.start]
        modes[mode] = entry | {
            "optimum": optimum,
            "x_optimum": entry["hit_rate"] / optimum if optimum else None,
            "first_turn_hit_rate": (sum(r.cached_tokens for r in first)
                                    / sum(r.prompt_tokens for r in first)),
        }  # fmt: skip
        outputs[mode] = [s.reply.output_ids for s in picked]
    differ = [m for m in outputs if outputs[m] != outputs[reference]]
    return {"optimum": modes[reference]["optimum"], "outputs_equal": not differ,
            "outputs_differ": differ, "modes": modes}  # fmt: skip


def paired(results: dict, mode: str, other: str) -> dict | None:
    """Request by request (the same prompt, sent back to back), `mode`'s TTFT
    over `other`'s: the median ratio, its quartiles, and how many requests
    `mode` served first; None unless both modes ran."""
    if mode not in results or other not in results:
        return None
    ratios = [a / b for a, b in zip(results[mode]["ttfts_s"], results[other]["ttfts_s"],
                                     strict=True)]  # fmt: skip
    return {
        "median_ratio": statistics.median(ratios),
        "p25_ratio": percentile(ratios, 0.25),
        "p75_ratio": percentile(ratios, 0.75),
        "faster": sum(r < 1 for r in ratios),
        "requests": len(ratios),
    }


HEADERS = ["phase", "L3", "hit rate", "x optimum", "first turn", "from L3", "TTFT p50 ms",
           "p25-p75 ms", "TTFT p99 ms", "serving s"]  # fmt: skip


def table_rows(name: str, modes: dict) -> list[list[str]]:
    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.0f}"

    return [[name, m, f"{r['hit_rate']:.3f}",
             "-" if r["x_optimum"] is None else f"{r['x_optimum']:.3f}",
             f"{r['first_turn_hit_rate']:.3f}", f"{r['storage_hit_rate']:.3f}",
             ms(r["ttft_p50_s"]), f"{ms(r['ttft_p25_s'])}-{ms(r['ttft_p75_s'])}",
             ms(r["ttft_p99_s"]), f"{r['serving_s']:.0f}"]
            for m, r in modes.items()]  # fmt: skip
