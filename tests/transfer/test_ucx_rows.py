"""`_ucx.Batch` takes the planner's rows as a plain buffer (bytes, bytearray
or a uint64 array): what lands is what the rows say, byte for byte, and a
buffer that is not contiguous native uint64 triples is refused before any
operation is posted. In one process, over UCX's self transport."""

import socket

import numpy as np
import pytest

pytest.importorskip("kvrelay._ucx")

from kvrelay import _ucx
from kvrelay.transfer.handle import plan_rows, rows_array

SIZE = 1 << 16


@pytest.fixture(scope="module")
def pair():
    context = _ucx.Context({})
    worker = _ucx.Worker(context)
    endpoint = _ucx.Endpoint(worker, worker.address(), False)
    remote = np.arange(SIZE, dtype=np.uint8) * np.uint8(7)
    local = np.zeros(SIZE, dtype=np.uint8)
    remote_region = _ucx.MemRegion(context, remote.ctypes.data, SIZE)
    local_region = _ucx.MemRegion(context, local.ctypes.data, SIZE)
    rkey = _ucx.RemoteKey(endpoint, remote_region.pack_rkey())
    yield rkey, local_region, remote, local
    rkey.destroy()
    for region in (local_region, remote_region):
        region.unmap()
    endpoint.close(False, 1.0)
    worker.close()
    context.close()


def _pull(pair, rows) -> np.ndarray:
    rkey, local_region, remote, local = pair
    local[:] = 0
    batch = _ucx.Batch(rkey, local_region, True, rows, remote.ctypes.data)
    assert batch.wait(10.0)
    batch.release()
    return local.copy()


RUNS = [(4096, 100), (0, 64), (30000, 999)]
OFFSETS = [0, 200, 8192]


def _expected(remote) -> np.ndarray:
    want = np.zeros(SIZE, dtype=np.uint8)
    for (offset, length), at in zip(RUNS, OFFSETS, strict=True):
        want[at : at + length] = remote[offset : offset + length]
    return want


@pytest.mark.parametrize("form", ["bytearray", "bytes", "array (k, 3)", "array (3k,)"])
def test_rows_in_any_buffer_form_land_byte_for_byte(pair, form):
    packed = np.array(RUNS, dtype=np.uint64).tobytes()
    rows, nbytes = plan_rows(packed, OFFSETS, SIZE, SIZE)
    assert nbytes == sum(n for _, n in RUNS)
    given = {
        "bytearray": rows,
        "bytes": bytes(rows),
        "array (k, 3)": rows_array(rows).copy(),
        "array (3k,)": rows_array(rows).reshape(-1).copy(),
    }[form]
    assert np.array_equal(_pull(pair, given), _expected(pair[2]))


_GOOD = np.array([[0, 0, 8]], dtype=np.uint64)
_NOT_TRIPLES = {
    "float64": _GOOD.astype(np.float64),
    "int32": _GOOD.astype(np.int32),
    "not a multiple of 24 bytes": bytes(16),
    "(k, 2) rows": np.zeros((3, 2), dtype=np.uint64),
    "strided": np.zeros((2, 6), dtype=np.uint64)[:, ::2],
    "misaligned": memoryview(bytearray(25))[1:],
}


@pytest.mark.parametrize("name", list(_NOT_TRIPLES))
def test_rows_that_are_not_uint64_triples_are_refused(pair, name):
    rkey, local_region, remote, _ = pair
    with pytest.raises(ValueError, match="rows must"):
        _ucx.Batch(rkey, local_region, True, _NOT_TRIPLES[name], remote.ctypes.data)


def test_a_local_run_outside_the_region_is_refused(pair):
    rkey, local_region, remote, _ = pair
    rows = np.array([[0, SIZE - 8, 16]], dtype=np.uint64)
    with pytest.raises(IndexError, match="local run 0"):
        _ucx.Batch(rkey, local_region, True, rows, remote.ctypes.data)


def _planned() -> bytearray:
    return plan_rows(np.array(RUNS, dtype=np.uint64).tobytes(), OFFSETS, SIZE, SIZE)[0]


def test_a_batch_driven_while_posted_is_done_without_a_wait(pair):
    rkey, local_region, remote, local = pair
    rows = _planned()
    local[:] = 0
    batch = _ucx.Batch(rkey, local_region, True, rows, remote.ctypes.data, drive_for=10.0)
    assert batch.pending == 0
    assert batch.result()
    batch.release()
    assert np.array_equal(local, _expected(remote))


def test_a_watched_connection_that_is_open_lets_the_batch_run(pair):
    rkey, local_region, remote, local = pair
    rows = _planned()
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(b"unread bytes are not a close")
        local[:] = 0
        batch = _ucx.Batch(rkey, local_region, True, rows, remote.ctypes.data, 10.0, ours.fileno())
        assert batch.result()
        batch.release()
    assert np.array_equal(local, _expected(remote))


@pytest.mark.parametrize("how", ["closed", "shut down for writing"])
def test_a_watched_connection_the_peer_closed_posts_nothing(pair, how):
    rkey, local_region, remote, local = pair
    rows = _planned()
    ours, theirs = socket.socketpair()
    with ours, theirs:
        if how == "closed":
            theirs.close()
        else:
            theirs.shutdown(socket.SHUT_WR)
        local[:] = 0
        with pytest.raises(_ucx.PeerClosed, match="closed its control connection"):
            _ucx.Batch(rkey, local_region, True, rows, remote.ctypes.data, 10.0, ours.fileno())
    assert not local.any()
    assert issubclass(_ucx.PeerClosed, _ucx.UcxError)


def test_a_batch_posted_on_start_moves_only_once_its_driver_runs_it(pair):
    """post_on_start: the rows are checked at once and posted by the thread
    start_on() hands the batch to (a striped pull's far half)."""
    rkey, local_region, remote, local = pair
    local[:] = 0
    batch = _ucx.Batch(rkey, local_region, True, _planned(), remote.ctypes.data, 0.0, -1, True)
    assert batch.pending == 0 and not local.any()  # nothing posted yet
    driver = _ucx.Driver()
    try:
        batch.start_on(driver, 10.0)
        assert batch.done_within(10.0)
        assert batch.result()
        batch.release()
    finally:
        driver.stop()
    assert np.array_equal(local, _expected(remote))


def test_a_batch_posted_on_start_and_aborted_first_moves_nothing_and_is_not_done(pair):
    rkey, local_region, remote, local = pair
    local[:] = 0
    batch = _ucx.Batch(rkey, local_region, True, _planned(), remote.ctypes.data, 0.0, -1, True)
    batch.abort()
    driver = _ucx.Driver()
    try:
        batch.start_on(driver, 10.0)
        assert batch.done_within(10.0)
        assert not batch.result()
        batch.release()
    finally:
        driver.stop()
    assert not local.any()


def test_a_stopped_driver_refuses_work_and_the_batch_can_still_be_released(pair):
    rkey, local_region, remote, _ = pair
    driver = _ucx.Driver()
    driver.stop()
    batch = _ucx.Batch(rkey, local_region, True, _planned(), remote.ctypes.data, 0.0, -1, True)
    with pytest.raises(_ucx.UcxError, match="stopped"):
        batch.start_on(driver, 10.0)
    batch.release()  # returns at once: nothing was handed to the driver
