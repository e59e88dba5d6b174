import os
import time

import numpy as np
import pytest
import torch

from kvrelay.layout import ModelKVSpec, ParallelConfig, rank_rectangle
from kvrelay.transfer import BlockHandle, MalformedHandle, coalesce
from kvrelay.transfer.arena import copy_runs_reference, owner_pid, readv_runs_reference
from kvrelay.transfer.errors import RunOutOfBounds
from kvrelay.transfer.handle import (
    plan,
    plan_checked,
    plan_rows,
    plan_runs_reference,
    rows_array,
)
from kvrelay.transfer.lease import LeaseTable

SPEC = ModelKVSpec(
    "m",
    "w",
    num_layers=4,
    num_kv_heads=4,
    k_head_dim=8,
    v_head_dim=8,
    kv_dtype="float16",
    page_size=16,
)


def make_handle(**changes):
    fields = dict(
        backend="tcp",
        agent="127.0.0.1:1",
        agent_id=b"a" * 16,
        arena_id=1,
        rkey=b"rk",
        base=4096,
        runs=((0, 10), (64, 5)),
        lease_id=3,
        lease_expiry=time.time() + 10,
        namespace=SPEC.namespace(),
    )
    return BlockHandle(**(fields | changes))


def test_handle_round_trips_through_msgpack():
    handle = make_handle()
    assert BlockHandle.from_bytes(handle.to_bytes()) == handle
    assert handle.nbytes == 15


def test_a_decoded_handle_behaves_like_one_built_from_tuples():
    handle = make_handle(runs=((0, 10), (64, 5), (200, 7)))
    decoded = BlockHandle.from_bytes(handle.to_bytes())
    assert decoded == handle and handle == decoded and hash(decoded) == hash(handle)
    assert len(decoded.runs) == 3 and decoded.runs[1] == (64, 5) and decoded.runs[-1] == (200, 7)
    assert list(decoded.runs) == [(0, 10), (64, 5), (200, 7)]
    assert decoded.runs[1:] == ((64, 5), (200, 7))
    assert decoded != make_handle(runs=((0, 10), (64, 5), (200, 8)))
    assert decoded.narrow([(66, 2)]).runs == ((66, 2),)


def test_plan_coalesces_and_refuses_a_wrong_number_of_local_offsets():
    assert plan([(0, 10), (10, 5), (100, 4)], [0, 10, 15]).tolist() == [[0, 0, 15], [100, 15, 4]]
    assert plan([(0, 10), (50, 5)], [0, 10]).tolist() == [[0, 0, 10], [50, 10, 5]]
    with pytest.raises(ValueError, match="1 local offsets for 2 runs"):
        plan([(0, 10), (10, 5)], [0])
    with pytest.raises(OverflowError):
        plan([(0, 10)], [-1])


def _both_planners(*args):
    """(compiled result or exception, reference result or exception)."""
    compiled = pytest.importorskip("kvrelay.transfer._runcopy").plan_runs
    out = []
    for planner in (compiled, plan_runs_reference):
        try:
            out.append(planner(*args))
        except (ValueError, TypeError, IndexError, OverflowError) as exc:
            out.append((type(exc), str(exc)))
    return out


def test_compiled_planner_matches_the_reference_on_random_batches():
    rng = np.random.default_rng(7)
    for trial in range(300):
        n = int(rng.integers(0, 40))
        lengths = rng.integers(1, 50, n).astype(np.uint64)
        # Mostly contiguous on both sides (so rows merge), sometimes a jump.
        jumps = rng.integers(0, 3, n).astype(np.uint64) * (rng.random(n) < 0.3)
        remote = np.stack([np.cumsum(lengths + jumps) - lengths, lengths], axis=1)
        local = np.cumsum(lengths + (rng.random(n) < 0.2)) - lengths
        remote_size = int(remote[:, 0].max() + remote[:, 1].max()) if n else 1
        remote_size += int(rng.integers(-40, 10))
        local_size = int(local.max() + lengths.max()) + int(rng.integers(-40, 10)) if n else 1
        offsets = local.astype(np.uint64) if trial % 2 else [int(x) for x in local]
        compiled, reference = _both_planners(
            remote.astype(np.uint64).tobytes(), offsets, max(remote_size, 0), max(local_size, 0)
        )
        assert compiled == reference


@pytest.mark.parametrize(
    "remote, offsets",
    [
        ([(0, 10), (10, 5)], [0]),  # wrong count
        ([(0, 10)], [-1]),  # negative
        ([(0, 10)], [1.5]),  # not an int
        ([(0, 10)], [1 << 64]),  # too large
        ([(0, 0)], [0]),  # empty run
        ([(95, 10)], [0]),  # remote past the end
        ([(0, 10)], [95]),  # local past the end
        ([((1 << 64) - 1, 2)], [0]),  # wraps around
    ],
)
def test_compiled_planner_refuses_what_the_reference_refuses(remote, offsets):
    compiled, reference = _both_planners(
        np.array(remote, dtype=np.uint64).tobytes(), offsets, 100, 100
    )
    assert compiled == reference and isinstance(compiled[0], type)


def test_plan_checked_raises_run_out_of_bounds_for_either_side():
    rows, nbytes = plan_checked([(0, 10), (10, 5), (50, 5)], [0, 10, 20], 100, 100)
    assert rows.tolist() == [[0, 0, 15], [50, 20, 5]] and nbytes == 20
    with pytest.raises(RunOutOfBounds, match="remote run 1"):
        plan_checked([(0, 10), (95, 10)], [0, 10], 100, 100)
    with pytest.raises(RunOutOfBounds, match="local run 0"):
        plan_checked([(0, 10)], [95], 100, 100)


def test_a_rank_rectangle_runs_make_a_handle():
    rect = rank_rectangle(SPEC, ParallelConfig(tp=2, pp=2, tp_rank=1, pp_rank=0))
    page = 5
    runs = tuple((page * SPEC.page_bytes + o, n) for o, n in rect.byte_runs(SPEC))
    handle = make_handle(runs=runs)
    assert BlockHandle.from_bytes(handle.to_bytes()).runs == runs
    handle.check(SPEC.namespace())


@pytest.mark.parametrize("blob", [b"", b"\x93\x01\x02", b"\x80", b"\xde\xad\xbe\xef", b"x" * 10])
def test_non_handles_are_malformed(blob):
    with pytest.raises(MalformedHandle):
        BlockHandle.from_bytes(blob)


def test_every_truncation_is_malformed():
    data = make_handle().to_bytes()
    for cut in range(len(data)):
        with pytest.raises(MalformedHandle):
            BlockHandle.from_bytes(data[:cut])


def test_coalesce_merges_runs_adjacent_on_both_sides_only():
    pairs = [(0, 100, 10), (10, 110, 5), (15, 200, 5), (20, 205, 1), (40, 206, 2)]
    assert coalesce(pairs) == [(0, 100, 15), (15, 200, 6), (40, 206, 2)]
    assert coalesce([]) == []


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
@pytest.mark.parametrize(("stream_min", "prefetch"), [(0, True), (0, False), (1 << 62, True)])
def test_compiled_run_copier_matches_the_reference_bit_for_bit(threads, stream_min, prefetch):
    compiled = pytest.importorskip("kvrelay.transfer._runcopy").copy_runs
    rng = np.random.default_rng(threads)
    src = torch.from_numpy(rng.integers(0, 256, 4 << 20, dtype=np.uint8))
    # Odd lengths and offsets (unaligned heads and tails), a zero-length row,
    # a run over 1 MiB that threads share in pieces, rows in no particular order.
    rows = np.array([[5, 17, 1000], [2000, 99, 0], [3001, 4000, 70001], [90000, 1, 3],
                     [100000, 300000, 600000], [80000, 700001, 9999],
                     [1100000, 1000003, 2500001]], dtype=np.uint64)  # fmt: skip
    expected = torch.zeros(4 << 20, dtype=torch.uint8)
    got = torch.zeros(4 << 20, dtype=torch.uint8)
    copy_runs_reference(expected.data_ptr(), src.data_ptr(), rows)
    compiled(got.data_ptr(), src.data_ptr(), rows, threads, stream_min, prefetch)
    assert torch.equal(got, expected)
    assert int(expected[5:1005].sum()) > 0


# Odd lengths and offsets, a zero-length row, runs over 1 MiB (cut for threads).
_KERNEL_ROWS = [[5, 17, 1000], [2000, 99, 0], [3001, 4000, 70001], [90000, 1, 3],
                [100000, 300000, 600000], [1100000, 1000003, 2500001]]  # fmt: skip


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("write", [False, True])
def test_kernel_run_copier_matches_the_reference_bit_for_bit(threads, write):
    """readv_runs (process_vm_readv / writev) against pread / pwrite of
    /proc/<pid>/mem, on this process (the multiprocess tests cover a peer)."""
    compiled = pytest.importorskip("kvrelay.transfer._runcopy").readv_runs
    rng = np.random.default_rng(threads)
    local = torch.from_numpy(rng.integers(0, 256, 4 << 20, dtype=np.uint8))
    rows = np.array(_KERNEL_ROWS, dtype=np.uint64)
    expected = torch.from_numpy(rng.integers(0, 256, 4 << 20, dtype=np.uint8))
    got = expected.clone()
    if write:  # local -> remote ("remote" is `expected` / `got` here)
        readv_runs_reference(os.getpid(), local.data_ptr(), expected.data_ptr(), rows, 1, True)
        compiled(os.getpid(), local.data_ptr(), got.data_ptr(), rows, threads, True)
    else:  # remote -> local: `local` is the remote side, read into expected / got
        readv_runs_reference(os.getpid(), expected.data_ptr(), local.data_ptr(), rows, 1, False)
        compiled(os.getpid(), got.data_ptr(), local.data_ptr(), rows, threads, False)
    assert torch.equal(got, expected)


def test_kernel_run_copier_raises_on_an_unmapped_remote_address():
    compiled = pytest.importorskip("kvrelay.transfer._runcopy").readv_runs
    buf = torch.zeros(4096, dtype=torch.uint8)
    rows = np.array([[0, 0, 4096]], dtype=np.uint64)
    with pytest.raises(OSError):
        compiled(os.getpid(), buf.data_ptr(), 4096, rows, 1, False)  # page 1 is never mapped
    with pytest.raises(ValueError):
        compiled(os.getpid(), buf.data_ptr(), buf.data_ptr(), np.zeros(4, dtype=np.uint64), 1, 0)


def test_owner_pid_reads_only_proc_fd_paths():
    assert owner_pid("/proc/123/fd/7") == 123
    assert owner_pid("") is None and owner_pid("/proc/self/fd/7") is None
    assert owner_pid("/dev/shm/x") is None


def test_compiled_run_copier_refuses_malformed_rows():
    compiled = pytest.importorskip("kvrelay.transfer._runcopy").copy_runs
    buf = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(ValueError):
        compiled(buf.data_ptr(), buf.data_ptr(), np.zeros(4, dtype=np.uint64), 1, 0)
    with pytest.raises(ValueError):
        compiled(buf.data_ptr(), buf.data_ptr(), np.zeros(3, dtype=np.uint64), 0, 0)


def test_leases_expire_and_release():
    table = LeaseTable()
    short = table.grant(1, [(0, 4)], 0.05)
    long = table.grant(1, [(4, 4)], 60)
    assert table.is_active(short.lease_id) and table.is_active(long.lease_id)
    assert table.sweep(now=time.time() + 1) == [short]
    assert not table.is_active(short.lease_id)
    assert table.release(long.lease_id) == long and len(table) == 0
    with pytest.raises(ValueError):
        table.grant(1, [], 0)


def test_narrow_keeps_sub_runs_of_the_handle():
    handle = make_handle(runs=((0, 10), (64, 5), (200, 100)))
    narrowed = handle.narrow([(2, 3), (64, 5), (250, 50), (200, 1)])
    assert narrowed.runs == ((2, 3), (64, 5), (250, 50), (200, 1))
    assert narrowed.lease_id == handle.lease_id and narrowed.agent_id == handle.agent_id
    assert BlockHandle.from_bytes(narrowed.to_bytes()) == narrowed
    # Overlapping original runs: a run inside the union of the first only is fine.
    overlapping = make_handle(runs=((0, 100), (10, 5)))
    assert overlapping.narrow([(20, 30)]).runs == ((20, 30),)


@pytest.mark.parametrize(
    "runs",
    [
        [(8, 3)],  # crosses the end of (0, 10)
        [(10, 1)],  # between runs
        [(60, 8)],  # starts before (64, 5)
        [(299, 2)],  # past the last run
        [(2, 0)],  # empty
        [],  # nothing
        [(-1, 2)],  # negative
    ],
)
def test_narrow_refuses_runs_outside_the_handle(runs):
    from kvrelay.transfer import RunOutOfBounds

    handle = make_handle(runs=((0, 10), (64, 5), (200, 100)))
    with pytest.raises(RunOutOfBounds):
        handle.narrow(runs)


def test_a_decoded_handle_plans_from_its_wire_bytes_as_from_tuples():
    runs = ((0, 10), (10, 6), (64, 5), (4096, 7))
    handle = make_handle(runs=runs)
    decoded = BlockHandle.from_bytes(handle.to_bytes())
    # The pull path hands the wire's bytes to the planner: no array is made.
    assert isinstance(decoded.runs_buffer, bytes) and len(decoded.runs) == 4
    assert decoded.runs.array() is not None  # (made on request only)
    offsets = [100, 110, 0, 2000]
    rows, nbytes = plan_rows(decoded.runs_buffer, offsets, 8192, 4096)
    want, want_bytes = plan_checked(runs, offsets, 8192, 4096)
    assert np.array_equal(rows_array(rows), want) and nbytes == want_bytes == 28
    # (0, 10) and (10, 6) continue each other on both sides: one row.
    assert rows_array(rows).tolist() == [[0, 100, 16], [64, 0, 5], [4096, 2000, 7]]
    assert np.array_equal(rows_array(plan_rows(handle.runs_buffer, offsets, 8192, 4096)[0]), want)
    with pytest.raises(RunOutOfBounds):
        plan_rows(decoded.runs_buffer, offsets, 4100, 4096)
