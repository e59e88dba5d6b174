"""Where a demo request's time to first token went, phase by phase.

A turn's record carries the prefill worker's own timings (queue, lookup,
tier pull, compute, stage, publish), the TTFT control measured and the one
the client measured, and decode's time from its request to its first token
batch. From them: `control` (control's TTFT less the prefill worker's
phases: tier probe, dispatch, the wire), the worker's phases, `first token`
(client TTFT less control's: the first token's way to the client), which sum
to the client's TTFT, and `decode pull` (decode's pull of the pages plus one
step: after the first token, beside the sum).
"""

from __future__ import annotations

import numpy as np

from kvrelay.control.stats import ttft_phases

PHASES = ("control", "queue", "lookup", "tier_pull", "compute", "stage", "publish",
          "first_token")  # fmt: skip
LABELS = {"control": "control", "queue": "queue", "lookup": "lookup", "tier_pull": "tier pull",
          "compute": "compute", "stage": "staging", "publish": "publish",
          "first_token": "first token", "decode_pull": "decode pull*"}  # fmt: skip


def record_phases(record) -> dict[str, float]:
    """One turn's TTFT by phase (PHASES, summing to its TTFT) and decode_pull."""
    control_ttft = record.control_ttft_s or record.ttft_s
    phases = ttft_phases(control_ttft, record.prefill_timings)
    phases["first_token"] = max(0.0, record.ttft_s - control_ttft)
    phases["decode_pull"] = record.decode_first_s or 0.0
    return phases


def breakdown(records) -> dict[str, float]:
    """Median seconds of each phase over the mode's successful turns."""
    rows = [record_phases(r) for r in records if r.error is None]
    if not rows:
        return {}
    return {name: float(np.median([row[name] for row in rows])) for name in rows[0]}


def table(modes: dict[str, dict[str, float]], labels: dict[str, str]) -> str:
    names = [*PHASES, "decode_pull"]
    head = "| mode | " + " | ".join(LABELS[n] for n in names) + " |"
    lines = [head, "|" + "---|" * (len(names) + 1)]
    for mode, phases in modes.items():
        cells = " | ".join(f"{phases.get(n, float('nan')):.3f}" for n in names)
        lines.append(f"| {labels.get(mode, mode)} | {cells} |")
    lines.append("median seconds per turn; * after the first token (the pages' pull "
                 "and decode's first step), not part of TTFT")  # fmt: skip
    return "\n".join(lines)
