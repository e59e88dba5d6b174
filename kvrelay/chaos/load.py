"""A bounded load run on loopback: `requests` requests from `sessions`
concurrent sessions (each loop bounded in count and time); throughput,
p50/p99 TTFT, errors, lost, and the RSS of every process before and after."""

from __future__ import annotations

import time
from collections import Counter

from kvrelay import procfs
from kvrelay.chaos.cluster import ChaosCluster
from kvrelay.chaos.workload import CORRECT, Workload


def process_rss(cluster: ChaosCluster) -> dict[str, int]:
    """KiB resident per process of the cluster, its children included."""
    out = {}
    for process in cluster.processes:
        pids = [process.popen.pid, *procfs.descendants(process.popen.pid)]
        out[process.name] = sum(procfs.status_kib(pid, "VmRSS") for pid in pids)
    return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def load_run(cluster: ChaosCluster, workload: Workload, requests: int,
                   sessions: int) -> dict:  # fmt: skip
    if requests <= 0:
        return {}
    turns = max(1, requests // sessions)
    before = process_rss(cluster)
    start = time.monotonic()
    outcomes = await workload.run(sessions, turns)
    elapsed = time.monotonic() - start
    after = process_rss(cluster)
    kinds = Counter(o.kind for o in outcomes)
    ttfts = [o.ttft_s for o in outcomes if o.kind == CORRECT]
    return {
        "requests": len(outcomes), "sessions": sessions, "seconds": round(elapsed, 2),
        "requests_per_s": round(len(outcomes) / elapsed, 2),
        "ttft_p50_s": round(percentile(ttfts, 0.5), 4),
        "ttft_p99_s": round(percentile(ttfts, 0.99), 4),
        "outcomes": dict(kinds), "rss_kib_before": before, "rss_kib_after": after,
    }  # fmt: skip
