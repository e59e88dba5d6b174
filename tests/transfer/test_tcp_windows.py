"""The tcp backend's bulk move: runs merged where adjacent, moved in windows."""

import collections

import numpy as np

from kvrelay.transfer.backends import tcp


def test_tcp_moves_runs_in_windows_and_merges_adjacent_runs():
    runs = np.array([[0, 4], [4, 4], [16, 8], [24, 1], [40, 2]], dtype=np.uint64)
    assert tcp.merge_adjacent(runs) == [(0, 8), (16, 9), (40, 2)]
    assert tcp.merge_adjacent(runs[:0]) == []
    data = bytearray(range(20))
    pending = collections.deque(memoryview(data)[i : i + 5] for i in range(0, 20, 5))
    tcp._consume(pending, 7)
    assert [bytes(v) for v in pending] == [
        bytes(range(7, 10)),
        *(bytes(range(i, i + 5)) for i in (10, 15)),
    ]
    assert len(tcp._window(pending)) == 3  # under the window's bytes: every view
