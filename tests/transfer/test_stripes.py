"""Striped pulls: a pull of 8 MiB or more is split in two, over two UCX
workers for a same-host peer (`_ucx.split_rows`, the far half driven by a
kept thread) or over two TCP connections (`stripes.split_rows`, the
reference of the binding's). What lands is what the plan says, byte for
byte, between two real processes; the two halves never write the same
byte (a plan that writes a byte twice is split by columns, or not at all);
a dead owner fails a striped pull within its deadline and leaves nothing
held."""

import hashlib
import random

import numpy as np
import pytest

pytest.importorskip("kvrelay._ucx")

from kvrelay import _ucx
from kvrelay.transfer import BlockHandle, create_agent
from kvrelay.transfer.calibrate import CopyChoice, CopyPlan
from kvrelay.transfer.stripes import split_rows, two_cpus
from tests.transfer.conftest import pull_until_owner_killed
from tests.transfer.peer import NAMESPACE, TOKEN, pattern

RUN = 64 << 10


def _rows(triples) -> bytearray:
    return bytearray(np.asarray(triples, dtype=np.uint64).tobytes())


def _apply(rows, remote: np.ndarray, size: int) -> np.ndarray:
    """What a pull of `rows` (remote, local, length) leaves in a zeroed buffer."""
    out = np.zeros(size, dtype=np.uint8)
    for src, dst, n in np.frombuffer(bytes(rows), dtype=np.uint64).reshape(-1, 3).tolist():
        out[dst : dst + n] = remote[src : src + n]
    return out


def _disjoint_rows(count: int, seed: int, lengths=(4096, 65536, 12345, 100)) -> list:
    """Scattered remote runs into disjoint local runs listed in shuffled order."""
    rng = random.Random(seed)
    runs, at = [], 0
    for i in range(count):
        n = rng.choice(lengths)
        runs.append([rng.randrange(0, (1 << 20) - n), at, n])
        at += n + (i % 3) * 8  # some gaps between local runs
    rng.shuffle(runs)
    return runs


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_split_halves_move_exactly_what_the_plan_moves(seed):
    triples = _disjoint_rows(200, seed)
    rows = _rows(triples)
    remote = np.random.default_rng(seed).integers(0, 256, 1 << 20, dtype=np.uint8)
    size = max(at + n for _, at, n in triples)
    first, second = _ucx.split_rows(rows, 0)
    total = sum(n for _, _, n in triples)
    moved = [
        int(np.frombuffer(bytes(h), dtype=np.uint64).reshape(-1, 3)[:, 2].sum())
        for h in (first, second)
    ]
    assert moved[0] == total // 2 // 4096 * 4096 and moved[0] + moved[1] == total
    both = bytes(first) + bytes(second)
    assert np.array_equal(_apply(both, remote, size), _apply(rows, remote, size))


@pytest.mark.parametrize("seed", range(40))
def test_the_binding_splits_as_the_reference_does(seed):
    rng = random.Random(seed)
    rows, at = [], 0
    for _ in range(rng.randint(1, 60)):
        n = rng.choice([0, 1, 4096, 65536, 12345, 1 << 20, 8192])
        rows.append([rng.randrange(1 << 30), at, n])
        at += n + rng.choice([0, 0, 16])
    rng.shuffle(rows)
    if seed % 5 == 0:
        rows.append(list(rows[0]))  # a local range written twice, from the same bytes
    if seed % 5 == 1:
        rows.append([rows[0][0] + 8, rows[0][1], rows[0][2]])  # ... from other bytes
    if seed % 5 == 2:
        rows.append([rows[0][0], rows[0][1] + 8192, 8192])  # a remote range read twice
    triples = np.array(rows, dtype=np.uint64)
    for read in (True, False):
        compiled = _ucx.split_rows(_rows(rows), 0, read)
        reference = split_rows(triples, 0, read)
        assert (compiled is None) == (reference is None)
        for got, want in zip(compiled or (), reference or (), strict=True):
            got = np.frombuffer(bytes(got), dtype=np.uint64).reshape(-1, 3)
            assert got.tolist() == want.tolist()


def test_a_single_run_is_cut_in_two():
    first, second = _ucx.split_rows(_rows([[4096, 0, 10 << 20]]), 8 << 20)
    assert np.frombuffer(bytes(first), dtype=np.uint64).tolist() == [4096, 0, 5 << 20]
    assert np.frombuffer(bytes(second), dtype=np.uint64).tolist() == [
        4096 + (5 << 20),
        5 << 20,
        5 << 20,
    ]


def test_small_plans_are_not_split():
    assert _ucx.split_rows(_rows([[0, 0, 4 << 20]]), 8 << 20) is None
    assert _ucx.split_rows(_rows([[0, 0, 4096]]), 0) is None  # under two 4 KiB pieces


def test_one_run_read_again_and_again_is_split_by_rows():
    """ucx_perftest's pattern, one run read again and again into one place:
    every row writes the same bytes there, so two workers may each take
    half of the rows (half the kernel calls each, where a cut of every row
    left each worker as many calls as the whole)."""
    first, second = (
        np.frombuffer(bytes(h), dtype=np.uint64).reshape(-1, 3).tolist()
        for h in _ucx.split_rows(_rows([[4096, 0, RUN]] * 512), 8 << 20)
    )
    assert first == second == [[4096, 0, RUN]] * 256


def test_overlapping_rows_from_one_source_are_split_by_bytes():
    # [0, 64K) and [32K, 96K) of local from the same remote offsets.
    triples = [[4096, 0, RUN], [4096 + RUN // 2, RUN // 2, RUN]]
    first, second = _ucx.split_rows(_rows(triples), 0)
    assert np.frombuffer(bytes(first), dtype=np.uint64).tolist() == [4096, 0, RUN]
    assert np.frombuffer(bytes(second), dtype=np.uint64).tolist() == triples[1]


def test_a_plan_writing_a_byte_from_two_sources_is_split_by_columns():
    """Two workers racing to write one byte from different sources would
    leave either value: every row is cut in its middle instead, first
    halves to one worker, second to the other, so each byte has one writer."""
    first, second = (
        np.frombuffer(bytes(h), dtype=np.uint64).reshape(-1, 3).tolist()
        for h in _ucx.split_rows(_rows([[4096, 0, RUN], [0, 0, RUN]] * 128), 8 << 20)
    )
    assert first == [[4096, 0, RUN // 2], [0, 0, RUN // 2]] * 128
    assert second == [[4096 + RUN // 2, RUN // 2, RUN // 2], [RUN // 2, RUN // 2, RUN // 2]] * 128


def test_a_push_is_checked_on_the_remote_bytes_it_writes():
    """Apart local runs pushed to one remote run from different bytes: a
    split by bytes would race on the remote run, so it is cut by columns."""
    triples = [[0, i * RUN, RUN] for i in range(4)]
    assert len(np.frombuffer(bytes(_ucx.split_rows(_rows(triples), 0)[0]), dtype=np.uint64)) == 6
    first, second = (
        np.frombuffer(bytes(h), dtype=np.uint64).reshape(-1, 3).tolist()
        for h in _ucx.split_rows(_rows(triples), 0, read=False)
    )
    assert first == [[0, i * RUN, RUN // 2] for i in range(4)]
    assert second == [[RUN // 2, i * RUN + RUN // 2, RUN // 2] for i in range(4)]


@pytest.mark.parametrize("seed", [4, 5])
def test_a_column_split_lands_what_the_plan_lands(seed):
    """Each local byte is written by one worker only, in the plan's order,
    so the last row to write it wins as in the whole plan."""
    rng = random.Random(seed)
    triples = [[rng.randrange(0, 1 << 19), rng.choice([0, 65536]), 65536] for _ in range(64)]
    remote = np.random.default_rng(seed).integers(0, 256, 1 << 20, dtype=np.uint8)
    first, second = _ucx.split_rows(_rows(triples), 0)
    together = _apply(bytes(first) + bytes(second), remote, 1 << 17)
    assert np.array_equal(together, _apply(_rows(triples), remote, 1 << 17))


def test_no_split_when_even_columns_would_share_bytes():
    # [0, 16K) and [8K, 24K): the first's second half and the second's first
    # half are the same bytes.
    assert _ucx.split_rows(_rows([[0, 0, 16384], [0, 8192, 16384]]), 0) is None


def test_split_refuses_what_is_not_rows():
    with pytest.raises(ValueError, match="triples"):
        _ucx.split_rows(bytes(16), 0)
    with pytest.raises(ValueError, match="triples"):
        _ucx.split_rows(np.zeros((2, 3), dtype=np.float64), 0)


def _plan(one: float, two: float, contiguous_two: float | None = None) -> CopyPlan:
    rates = {"readv, 1 thread": one, "readv, 2 threads": two}
    contiguous = {"readv, 1 thread": one, "readv, 2 threads": contiguous_two or two}
    choice = CopyChoice("map")
    return CopyPlan(choice, choice, {"scattered": rates, "contiguous": contiguous}, {})


def test_stripes_follow_what_the_host_measured():
    assert _plan(5.0, 8.0).kernel_copy_threads() == 2
    assert _plan(5.0, 5.5).kernel_copy_threads() == 2  # 1.10x: over the 1.05 margin
    assert _plan(5.0, 5.2).kernel_copy_threads() == 1  # 1.04x
    # On average over the shapes: 1.29x and 1.15x (an unlucky calibration).
    assert _plan(5.0, 6.45, 5.75).kernel_copy_threads() == 2
    assert _plan(5.0, 5.4, 5.0).kernel_copy_threads() == 1  # 1.08x and 1.0x
    assert CopyPlan(CopyChoice("map"), CopyChoice("map"), {}, {}).kernel_copy_threads() == 1


@pytest.mark.asyncio
async def test_stripes_is_validated():
    with pytest.raises(ValueError, match="stripes"):
        await create_agent("ucx", token=TOKEN, fast_path=False, stripes=3)


def _sha(tensor) -> bytes:
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).digest()


SIZE = 48 << 20


def _batch(count: int, seed: int) -> list:
    slots = random.Random(seed).sample(range(SIZE // RUN), count)
    return [(s * RUN, RUN) for s in slots]


TWO_CPUS = two_cpus()
MODES = ["ucx-shm", "tcp"]


def _striped(stats: dict, mode: str) -> bool:
    """Whether the agent holds what only a striped pull makes."""
    if mode == "tcp":
        return stats["tcp_second_connections"] == 1
    return stats["ucx_endpoints"] == 1 and stats["ucx_rkeys"] == 2  # an rkey per worker


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", MODES)
async def test_striped_pulls_and_pushes_land_byte_for_byte(mode, start_peer):
    single = [(4096, 24 << 20)]
    batch = _batch(192, seed=1)  # 12 MiB of 64 KiB runs
    again = [(5 * RUN, RUN)] * 160  # one run read 160 times (10 MiB): split by rows
    # Two runs read in turn into one place, 80 times each: split by columns,
    # and the last row's run is what stays.
    turns = [(5 * RUN, RUN), (7 * RUN, RUN)] * 80
    peer = start_peer(mode, SIZE, [single, batch, again, turns])
    expected = pattern(SIZE, 0).clone()
    backend = mode.split("-")[0]
    async with await create_agent(backend, token=TOKEN, fast_path=False, stripes=2) as agent:
        assert agent.stats()[f"{backend}_stripes"] == (2 if TWO_CPUS else 1)
        local = agent.allocate_arena(32 << 20, shared=False)
        await agent.read(peer.handles[0], local, [8192], namespace=NAMESPACE, timeout=30)
        assert _sha(local.tensor[8192 : 8192 + (24 << 20)]) == _sha(
            expected[4096 : 4096 + (24 << 20)]
        )
        # Local runs in another order than the remote ones.
        local.tensor.zero_()
        offsets = [i * RUN for i in random.Random(2).sample(range(len(batch)), len(batch))]
        handle = BlockHandle.from_bytes(peer.handles[1])
        await agent.read(handle, local, offsets, namespace=NAMESPACE, timeout=30)
        for at, (remote, n) in zip(offsets, batch, strict=True):
            assert _sha(local.tensor[at : at + n]) == _sha(expected[remote : remote + n])
        local.tensor.zero_()
        await agent.read(peer.handles[2], local, [RUN] * 160, namespace=NAMESPACE, timeout=30)
        assert _sha(local.tensor[RUN : 2 * RUN]) == _sha(expected[5 * RUN : 6 * RUN])
        assert not local.tensor[:RUN].any() and not local.tensor[2 * RUN :].any()
        await agent.read(peer.handles[3], local, [RUN] * 160, namespace=NAMESPACE, timeout=30)
        assert _sha(local.tensor[RUN : 2 * RUN]) == _sha(expected[7 * RUN : 8 * RUN])
        # A push of the batch: the stripe worker writes half of it.
        source = pattern(32 << 20, 9)
        local.tensor.copy_(source)
        await agent.write(handle, local, offsets, namespace=NAMESPACE, timeout=30)
        for at, (remote, n) in zip(offsets, batch, strict=True):
            expected[remote : remote + n] = source[at : at + n]
        assert _striped(agent.stats(), mode) == TWO_CPUS
    assert peer.digest() == hashlib.sha256(expected.numpy().tobytes()).digest()


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", MODES)
async def test_a_striped_reader_reads_a_restarted_peer(mode, start_peer):
    """The reader's stripe endpoint and rkeys (or second connection) were the
    first peer's; the new one (new pid, new arena, other bytes) is read
    right, twice."""
    single = [(0, 16 << 20)]
    backend = mode.split("-")[0]
    async with await create_agent(backend, token=TOKEN, fast_path=False, stripes=2) as agent:
        local = agent.allocate_arena(16 << 20, shared=False)
        for seed in (4, 5):
            peer = start_peer(mode, SIZE, [single], seed=seed)
            for _ in range(2):
                local.tensor.zero_()
                await agent.read(peer.handles[0], local, [0], namespace=NAMESPACE, timeout=30)
                assert _sha(local.tensor) == _sha(pattern(SIZE, seed)[: 16 << 20])
            peer.stop()


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", MODES)
async def test_a_striped_pull_from_a_killed_owner_fails_in_time_and_holds_nothing(mode, start_peer):
    batch = [(i * RUN, RUN) for i in range(512)]  # 32 MiB
    peer = start_peer(mode, SIZE, [batch])
    timeout = 5.0
    agent = await create_agent(mode.split("-")[0], token=TOKEN, fast_path=False, stripes=2)
    try:
        local = agent.allocate_arena(32 << 20, shared=False)
        offsets = [i * RUN for i in range(512)]
        stats = await pull_until_owner_killed(agent, peer, local, offsets, timeout)
        assert stats["peers"] == 0
        held = ("tcp_second_connections",) if mode == "tcp" else ("ucx_endpoints", "ucx_rkeys")
        assert all(stats[key] == 0 for key in held)
    finally:
        await agent.close()
