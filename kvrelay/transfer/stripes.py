"""Splitting a large pull in two, for two workers (ucx) or two connections
(tcp) to move at once.

On a host with two or more CPUs one copy engine leaves bytes on the table:
cma's copy runs on the reader's CPU (two threads of `process_vm_readv`
moved 1.5-1.6x one on the issue-14 VM), and a loopback TCP stream is
bound by one sender and one receiver thread (two streams moved 1.25-1.3x
one). `split_rows` is the reference of the binding's `_ucx.split_rows`
(tested bit for bit); the tcp backend uses it as it is.
"""

from __future__ import annotations

import os

import numpy as np

from kvrelay.transfer.handle import rows_array

# A pull is split only from this size: at 4 MiB (about 0.5 ms on cma) the
# second half's own cost (a second post, a wake-up, the wait) ate the gain;
# at 16 MiB two halves took 1 ms against 1.8 for the whole.
STRIPE_MIN_BYTES = 8 << 20
# The first half holds a multiple of this many bytes.
STRIPE_ALIGN = 4096


def writes_agree(triples: np.ndarray, dest: int) -> bool:
    """Whether any two (remote, local, length) rows that write a common byte
    copy the same source byte to it: their destination runs (column `dest`:
    1, local, for a pull; 0, remote, for a push) overlap only where the
    offset from source to destination is the same."""
    live = triples[triples[:, 2] > 0]
    if len(live) < 2:
        return True
    order = np.argsort(live[:, dest], kind="stable")
    starts = live[order, dest]
    reach = np.maximum.accumulate(starts + live[order, 2])
    shifts = live[order, 1] - live[order, 0]  # mod 2**64, as in C++
    # A cluster is a run of writes each overlapping what came before it.
    opens = np.ones(len(starts), dtype=bool)
    opens[1:] = starts[1:] >= reach[:-1]
    cluster = np.cumsum(opens) - 1
    return bool((shifts == shifts[np.flatnonzero(opens)][cluster]).all())


def split_rows(rows, min_bytes: int, read: bool = True):
    """Two (k, 3) uint64 row arrays that together move exactly `rows` (a
    buffer of native uint64 (remote, local, length) triples), for two
    workers to copy at once, such that a byte both write gets the same
    value from each; None when the rows move under `min_bytes` (or under
    two STRIPE_ALIGN pieces) or no such split was found. Rows that agree
    where they overlap (`writes_agree`: always so for apart destination
    runs, and for ucx_perftest's pattern, one run read again and again into
    one place) are cut in the middle of their bytes (the first half a
    multiple of STRIPE_ALIGN, the row across the middle cut in two); rows
    that write some byte from two different sources have every row cut in
    its middle instead (`_by_columns`), if that keeps the halves' written
    bytes apart."""
    triples = rows_array(rows)
    total = int(triples[:, 2].sum())
    if total < min_bytes or total < 2 * STRIPE_ALIGN:
        return None
    dest = 1 if read else 0
    if writes_agree(triples, dest):
        return _by_bytes(triples, total)
    first, second = _by_columns(triples)
    if not len(second) or _meet(_merged(first, dest), _merged(second, dest)):
        return None
    return first, second


def _by_bytes(triples: np.ndarray, total: int) -> tuple[np.ndarray, np.ndarray]:
    half = total // 2 // STRIPE_ALIGN * STRIPE_ALIGN
    ends = np.cumsum(triples[:, 2], dtype=np.uint64)
    starts = ends - triples[:, 2]
    # The first row that does not go wholly first: it ends past the middle
    # or starts at it (an empty row at the middle goes second, as in C++).
    at = min(int(np.searchsorted(ends, half, "right")), int(np.searchsorted(starts, half, "left")))
    if int(starts[at]) >= half:
        return triples[:at].copy(), triples[at:].copy()
    cut = np.uint64(half - int(starts[at]))  # 0 < cut < the row's length
    first, second = triples[: at + 1].copy(), triples[at:].copy()
    first[-1, 2] = cut
    second[0] += np.array([cut, cut, 0], dtype=np.uint64)
    second[0, 2] -= cut
    return first, second


def _by_columns(triples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every row cut at its middle (a multiple of STRIPE_ALIGN first; rows
    too short to cut go first whole), in the rows' order."""
    cuts = triples[:, 2] // np.uint64(2 * STRIPE_ALIGN) * np.uint64(STRIPE_ALIGN)
    first = triples.copy()
    first[:, 2] = np.where(cuts > 0, cuts, triples[:, 2])
    cut_rows = triples[cuts > 0]
    second = cut_rows.copy()
    moved = cuts[cuts > 0]
    second[:, 0] += moved
    second[:, 1] += moved
    second[:, 2] -= moved
    return first, second


def _merged(triples: np.ndarray, dest: int) -> np.ndarray:
    """The rows' non-empty destination runs (column `dest`) as sorted,
    merged (start, end) rows."""
    live = triples[triples[:, 2] > 0]
    order = np.argsort(live[:, dest], kind="stable")
    starts = live[order, dest]
    ends = starts + live[order, 2]
    reach = np.maximum.accumulate(ends) if len(ends) else ends
    new = np.ones(len(starts), dtype=bool)
    new[1:] = starts[1:] >= reach[:-1]
    groups = np.flatnonzero(new)
    return (
        np.stack([starts[groups], np.maximum.reduceat(ends, groups)], axis=1)
        if len(groups)
        else np.empty((0, 2), dtype=np.uint64)
    )


def _meet(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two sorted, merged span arrays share a byte."""
    if not len(a) or not len(b):
        return False
    # For each span of b, the last span of a that starts before it ends.
    last = np.searchsorted(a[:, 0], b[:, 1], "left") - 1
    hit = last >= 0
    return bool((a[last[hit], 1] > b[hit, 0]).any())


def two_cpus() -> bool:
    """Whether this process may run on two CPUs (else two halves would share one)."""
    return len(os.sched_getaffinity(0)) > 1


def stripe_choice(plan) -> dict:
    """What a large pull is split over on this host by default (`stripes`
    0), from the calibration `plan`: for `kvrelay info` and the bench."""
    two = two_cpus()
    ratios = {shape: round(r, 2) for shape, r in plan.kernel_copy_ratios().items()}
    return {
        "min_bytes": STRIPE_MIN_BYTES,
        "ucx_same_host_workers": plan.kernel_copy_threads() if two else 1,
        "kernel_copy_two_threads_x_one": ratios,
        "tcp_connections": 2 if two else 1,
    }


def stripe_line(plan) -> str:
    choice = stripe_choice(plan)
    ratios = ", ".join(f"{k} {v:.2f}x" for k, v in choice["kernel_copy_two_threads_x_one"].items())
    return (
        f"pulls of {choice['min_bytes'] >> 20} MiB or more: ucx same-host over "
        f"{choice['ucx_same_host_workers']} worker(s) (two kernel copies against one: "
        f"{ratios or 'not measured'}), tcp over {choice['tcp_connections']} connection(s)"
    )
