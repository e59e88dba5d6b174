"""`kvrelay bench transfer`'s host report, one-process baselines and goals.

The host facts the fast path's speed depends on (kernel, transparent huge
pages for private and shared memory, cpu), the load average, the copy
calibration (`kvrelay.transfer.calibrate`, measured afresh by the bench and
cached, so the agents it starts use it), and two baselines of the same runs
inside one process, out of a shared arena like the owner's: the calibrated
user-space copy, and the kernel's copy (`process_vm_readv`, one call).
"""

from __future__ import annotations

import os

import numpy as np

from kvrelay.bench.stats import Summary, time_once

# The goals, checked on every run (steady state: the timed pulls).
GOAL_BEST_X_NIXL_BATCH = 1.4
GOAL_BEST_X_NIXL = 1.0
GOAL_UCX_X_NIXL = 1.0
GOAL_TCP_BATCH_GBS = 2.0
UCX_SHM = "ucx (shm/cma)"


def host_lines(plan) -> list[str]:
    """What to print before the table: load, host facts, warnings, the calibration."""
    from kvrelay.transfer.calibrate import host_warnings
    from kvrelay.transfer.stripes import stripe_line

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    facts = plan.host
    lines = [
        f"load average: {load}",
        "host: kernel {kernel}, cpu {cpu_model} x {cpus}, transparent huge pages {thp_enabled}, "
        "shmem huge pages {thp_shmem_enabled}, hugetlb pages {hugetlb_pages}, "
        "last-level cache {llc_mib} MiB".format(**facts, llc_mib=facts["llc_bytes"] >> 20),
    ]
    lines += [f"warning: {w}" for w in host_warnings(facts)]
    lines.append(
        f"fast path copy ({plan.source}, {plan.seconds:.2f} s): scattered runs -> "
        f"{plan.scattered.label}; contiguous runs -> {plan.contiguous.label}"
    )
    for shape, rates in plan.measured.items():
        cells = ", ".join(f"{label} {rate:.2f}" for label, rate in rates.items())
        lines.append(f"  calibration GB/s, {shape}: {cells}")
    lines.append(stripe_line(plan))
    return lines


def same_runs_baselines(source, run_list, local_offsets, runs: int, plan, sweep) -> dict:
    """Seconds per copy of the runs inside this process out of `source` (a
    shared arena, as the owner's): the calibrated user-space copy and the
    kernel's (process_vm_readv of this process, one call), interleaved,
    each from a cold cache."""
    from kvrelay.transfer.arena import private_tensor, readv_runs
    from kvrelay.transfer.calibrate import CopyChoice, run_copy

    nbytes = sum(n for _, n in run_list)
    dst = private_tensor(nbytes)
    dst.fill_(0)
    rows = np.zeros((len(run_list), 3), dtype=np.uint64)
    rows[:, 1:] = np.asarray(run_list, dtype=np.uint64)
    rows[:, 0] = local_offsets
    chosen = plan.choose(nbytes, len(run_list))
    # The calibrated copy as the fast path would run it out of a mapping.
    mapped = chosen if chosen.method == "map" else CopyChoice("map", chosen.threads)
    pid = os.getpid()
    copies = {
        "memcpy": lambda: run_copy(mapped, pid, dst.data_ptr(), source.address, rows, nbytes),
        "readv": lambda: readv_runs(pid, dst.data_ptr(), source.address, rows, 1, False),
    }
    times = {name: [] for name in copies}
    for i in range(runs + 1):
        for name, copy in copies.items():
            sweep.add_(1)  # from a cold cache, as the pulls are timed
            took = time_once(copy)
            if i:
                times[name].append(took)
    return {name: Summary.of(t) for name, t in times.items()} | {"copy": mapped.label}


def goals(results: list[dict]) -> dict:
    """The issue's goals against this run's medians (None where NIXL is absent)."""
    out = {"cases": {}}
    checks = []
    for entry in results:
        name, nbytes = entry["case"], entry["bytes"]
        modes = entry["modes"]
        ratios = entry.get("nixl_ucx_read", {}).get("x_nixl_by_mode", {})
        case = {}
        if ratios:
            best = max(ratios, key=ratios.get)
            need = GOAL_BEST_X_NIXL_BATCH if _is_batch(name) else GOAL_BEST_X_NIXL
            case |= {"best_mode": best, "best_x_nixl": ratios[best], "best_goal": need}
            checks.append(ratios[best] >= need)
            if UCX_SHM in ratios:
                case["ucx_shm_x_nixl"] = ratios[UCX_SHM]
                checks.append(ratios[UCX_SHM] >= GOAL_UCX_X_NIXL)
        if "tcp" in modes and _is_batch(name):
            rate = nbytes / modes["tcp"]["median"] / 1e9
            case["tcp_gb_per_s"] = rate
            checks.append(rate >= GOAL_TCP_BATCH_GBS)
        out["cases"][name] = case
    out["all_met"] = all(checks) if checks else None
    return out


def goal_lines(summary: dict) -> list[str]:
    lines = []
    for name, case in summary["cases"].items():
        parts = []
        if "best_mode" in case:
            parts.append(
                f"best {case['best_mode']} {case['best_x_nixl']:.2f}x NIXL "
                f"(goal {case['best_goal']:.1f})"
            )
        if "ucx_shm_x_nixl" in case:
            parts.append(f"{UCX_SHM} {case['ucx_shm_x_nixl']:.2f}x NIXL (goal 1.0)")
        if "tcp_gb_per_s" in case:
            parts.append(f"tcp {case['tcp_gb_per_s']:.2f} GB/s (goal {GOAL_TCP_BATCH_GBS:.1f})")
        if parts:
            lines.append(f"goal {name}: " + "; ".join(parts))
    met = summary["all_met"]
    lines.append("goals: " + {True: "all met", False: "NOT all met", None: "not checked"}[met])
    return lines


def _is_batch(name: str) -> bool:
    return name.startswith("batch") and not name.endswith("one run")
