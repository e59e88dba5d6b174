"""Prometheus exposition through `prometheus_client`, one registry per app
(no process-global state: two apps in one process, as in the tests, keep
their own series).

Latencies are histograms observed as they happen (`ControlStats` calls
`LatencyHistograms.observe`); counters and per-node gauges are read from
`ControlStats` and the `Registry` at scrape time by a custom collector, so
`/stats` and `/metrics` can never disagree.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector

from kvrelay.control.registry import COUNTER_NAMES, Registry
from kvrelay.control.stats import ControlStats

# What `generate_latest` writes (the library answers a scraper without an
# Accept header with the same).
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

# Bucket bounds in seconds: the client library's default grid, stretched to
# minutes where a long prompt's prefill can go.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
                40.0, 80.0, 160.0, 320.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
               0.75, 1.0, 2.5, 5.0, 10.0)  # fmt: skip
PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                 2.5, 5.0, 10.0, 30.0, 60.0)  # fmt: skip


class LatencyHistograms:
    """The histograms of one app, keyed by what `ControlStats` observes."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def histogram(name: str, doc: str, buckets, labels=()) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry)

        self.ttft = histogram("kvrelay_ttft_seconds",
                              "Time to first token, from the request to prefill's answer.",
                              TTFT_BUCKETS)  # fmt: skip
        self.itl = histogram("kvrelay_inter_token_seconds",
                             "Latency between generated tokens (a decode batch's gap "
                             "shared over its tokens).", ITL_BUCKETS)  # fmt: skip
        self.prefill_phase = histogram(
            "kvrelay_prefill_phase_seconds",
            "Prefill worker's own timing by phase: queue, lookup (pool and tier, pulling "
            "tier pages), compute, publish (staging pages for decode).",
            PHASE_BUCKETS, ("phase",),
        )  # fmt: skip
        self.ttft_phase = histogram(
            "kvrelay_ttft_phase_seconds",
            "Time to first token by phase and request class (prompt length bucket): "
            "control (tier probe, dispatch, wire), queue, lookup, tier_pull, compute, "
            "stage, publish; and decode_pull (decode's pull plus first step, after TTFT).",
            (*PHASE_BUCKETS, 120.0, 300.0), ("phase", "request_class"),
        )  # fmt: skip
        self.handoff = histogram(
            "kvrelay_kv_transfer_seconds",
            "From sending decode the prefill's handles to its first token batch: pulling "
            "the pages (prefill to decode, tier) plus one decode step.", TTFT_BUCKETS,
        )  # fmt: skip
        self.tier_probe = histogram("kvrelay_tier_lookup_seconds",
                                    "Control's probe of the cache tier for a prompt's prefix.",
                                    PHASE_BUCKETS)  # fmt: skip

    def observe(self, what: str, seconds: float, count: int = 1, **labels: str) -> None:
        histogram = getattr(self, what)
        if labels:
            histogram = histogram.labels(**labels)
        for _ in range(count):
            histogram.observe(seconds)


class _StateCollector(Collector):
    """Counters and gauges from /stats' sources, read at each scrape."""

    def __init__(self, stats: ControlStats, registry: Registry) -> None:
        self.stats = stats
        self.registry = registry

    def describe(self):
        return []  # values are read at collect time; nothing to check at registration

    def collect(self):
        s = self.stats
        yield _counter("kvrelay_requests", "Completion requests received.", s.requests)
        errors = CounterMetricFamily(
            "kvrelay_request_errors", "Requests answered with an error.", labels=["kind"]
        )
        errors.add_metric(["client"], s.client_errors)
        errors.add_metric(["server"], s.errors - s.client_errors)
        yield errors
        yield _counter("kvrelay_retries", "Attempts repeated on another worker.", s.retries)
        yield _counter("kvrelay_busy", "Busy answers from workers.", s.busy)
        yield _counter(
            "kvrelay_busy_waits", "Waits for capacity after every prefill worker was busy.",
            s.busy_waits,
        )  # fmt: skip
        yield _counter(
            "kvrelay_resumed", "Requests resumed after a decode failed mid-stream.", s.resumed
        )
        yield _counter("kvrelay_cancelled", "Clients that went away mid-request.", s.cancelled)
        tokens = CounterMetricFamily("kvrelay_prompt_tokens",
                                     "Prompt tokens by source: local pool, cache tier, computed.",
                                     labels=["source"])  # fmt: skip
        for source, value in (("local", s.local_tokens), ("tier", s.tier_tokens),
                              ("computed", s.computed_tokens)):  # fmt: skip
            tokens.add_metric([source], value)
        yield tokens
        yield _counter("kvrelay_completion_tokens", "Tokens generated.", s.completion_tokens)
        totals = self.registry.counter_totals()
        events = CounterMetricFamily("kvrelay_worker_events",
                                     "Sums of the workers' heartbeat counters (bytes moved, "
                                     "tokens, ...).", labels=["counter"])  # fmt: skip
        for name in COUNTER_NAMES:
            events.add_metric([name], totals[name])
        yield events
        yield from self._nodes()

    def _nodes(self):
        nodes = sorted(self.registry.nodes.values(), key=lambda n: n.node_id)
        for name, doc, attr in (
            ("kvrelay_node_queue_depth", "Requests queued on a worker.", "queued"),
            ("kvrelay_node_active", "Requests running on a worker.", "active"),
            ("kvrelay_node_inflight", "Requests control has open on a worker.", "inflight"),
        ):
            family = GaugeMetricFamily(name, doc, labels=["node", "role"])
            for node in nodes:
                family.add_metric([node.node_id, node.role], getattr(node, attr))
            yield family
        states: dict[tuple[str, str], int] = {}
        for node in nodes:
            states[node.role, node.state] = states.get((node.role, node.state), 0) + 1
        family = GaugeMetricFamily("kvrelay_nodes", "Registered workers by role and state.",
                                   labels=["role", "state"])  # fmt: skip
        for (role, state), count in sorted(states.items()):
            family.add_metric([role, state], count)
        yield family


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class ControlMetrics:
    """One app's Prometheus registry: the histograms `stats` feeds, and the
    collector of its counters and the registry's gauges."""

    def __init__(self, stats: ControlStats, registry: Registry) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        stats.histograms = LatencyHistograms(self.registry)
        self.registry.register(_StateCollector(stats, registry))

    def render(self) -> bytes:
        return generate_latest(self.registry)
