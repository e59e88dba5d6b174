"""Prometheus text exposition (format 0.0.4), written by hand from /stats' sources."""

from __future__ import annotations

from kvrelay.control.registry import COUNTER_NAMES, Registry
from kvrelay.control.stats import QUANTILES, ControlStats, percentile

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _label(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_label(v)}"' for k, v in labels.items()) + "}"


def _number(value: float) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    return repr(float(value))


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str, samples) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")
        for suffix, labels, value in samples:
            self.lines.append(f"{name}{suffix}{_labels(labels)} {_number(value)}")

    def summary(self, name: str, help_text: str, samples, total: float, count: int) -> None:
        rows = []
        for q in QUANTILES:
            value = percentile(samples, q)
            rows.append(("", {"quantile": str(q)}, float("nan") if value is None else value))
        rows += [("_sum", {}, total), ("_count", {}, count)]
        self.family(name, "summary", help_text, rows)


def render(stats: ControlStats, registry: Registry) -> str:
    out = _Writer()
    out.family("kvrelay_requests_total", "counter", "Completion requests received.",
               [("", {}, stats.requests)])  # fmt: skip
    out.family("kvrelay_request_errors_total", "counter", "Requests answered with an error.",
               [("", {"kind": "client"}, stats.client_errors),
                ("", {"kind": "server"}, stats.errors - stats.client_errors)])  # fmt: skip
    out.family("kvrelay_retries_total", "counter", "Attempts repeated on another worker.",
               [("", {}, stats.retries)])  # fmt: skip
    out.family("kvrelay_busy_total", "counter", "Busy answers from workers.",
               [("", {}, stats.busy)])  # fmt: skip
    out.family("kvrelay_prompt_tokens_total", "counter",
               "Prompt tokens by source: local pool, cache tier, computed.",
               [("", {"source": "local"}, stats.local_tokens),
                ("", {"source": "tier"}, stats.tier_tokens),
                ("", {"source": "computed"}, stats.computed_tokens)])  # fmt: skip
    out.family("kvrelay_completion_tokens_total", "counter", "Tokens generated.",
               [("", {}, stats.completion_tokens)])  # fmt: skip
    out.summary("kvrelay_ttft_seconds", "Time to first token.", stats.ttft_s,
                stats.ttft_sum, stats.ttft_count)  # fmt: skip
    out.summary("kvrelay_inter_token_seconds", "Latency between generated tokens.",
                stats.itl_s, stats.itl_sum, stats.itl_count)  # fmt: skip
    totals = registry.counter_totals()
    out.family("kvrelay_worker_events_total", "counter",
               "Sums of the workers' heartbeat counters (bytes moved, tokens, ...).",
               [("", {"counter": name}, totals[name]) for name in COUNTER_NAMES])  # fmt: skip
    nodes = sorted(registry.nodes.values(), key=lambda n: n.node_id)
    out.family("kvrelay_node_queue_depth", "gauge", "Requests queued on a worker.",
               [("", {"node": n.node_id, "role": n.role}, n.queued) for n in nodes])  # fmt: skip
    out.family("kvrelay_node_active", "gauge", "Requests running on a worker.",
               [("", {"node": n.node_id, "role": n.role}, n.active) for n in nodes])  # fmt: skip
    out.family("kvrelay_node_inflight", "gauge", "Requests control has open on a worker.",
               [("", {"node": n.node_id, "role": n.role}, n.inflight) for n in nodes])  # fmt: skip
    states: dict[tuple[str, str], int] = {}
    for node in nodes:
        states[node.role, node.state] = states.get((node.role, node.state), 0) + 1
    rows = [("", {"role": r, "state": s}, c) for (r, s), c in sorted(states.items())]
    out.family("kvrelay_nodes", "gauge", "Registered workers by role and state.", rows)
    return "\n".join(out.lines) + "\n"
