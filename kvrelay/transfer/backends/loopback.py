"""In-process backend for unit tests of the layers above: a memmove per run.

A loopback agent is a full peer (the same control server, hello and arena
table as every backend); only its bytes move differently, by memmove, so
both agents must live in one process. Each arena's rkey is this process's
key: a handle published by another process carries another key (the agent
checked it against the owner's table), and is refused before any byte
moves instead of reading an address that means nothing here.
"""

from __future__ import annotations

import os

import numpy as np

from kvrelay.transfer.arena import copy_runs
from kvrelay.transfer.base import Transport
from kvrelay.transfer.errors import PeerError
from kvrelay.transfer.handle import rows_array

# Drawn once per process (a fork gets the parent's: re-drawn after one).
_PROCESS_KEY = os.urandom(16)


def _redraw_key() -> None:
    global _PROCESS_KEY
    _PROCESS_KEY = os.urandom(16)


os.register_at_fork(after_in_child=_redraw_key)


class LoopbackTransport(Transport):
    name = "loopback"

    def register(self, arena) -> bytes:
        return _PROCESS_KEY

    async def move(self, peer, handle, local, rows, read, deadline) -> None:
        triples = rows_array(rows)
        # One copy in this process, nothing to wait for: the deadline bounds nothing.
        if handle.rkey != _PROCESS_KEY:
            raise PeerError(
                f"agent {peer.address} is a loopback agent of another process: "
                "the loopback backend moves bytes within one process only"
            )
        # Runs were checked against the owner's arena table; the base is its address.
        remote = handle.base
        if read:
            rows = np.ascontiguousarray(triples[:, [1, 0, 2]], dtype=np.uint64)
            copy_runs(local.address, remote, rows, 1, 1 << 62)
        else:
            copy_runs(remote, local.address, np.ascontiguousarray(triples), 1, 1 << 62)
