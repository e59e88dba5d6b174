"""UCX backend: one-sided GET/PUT through kvrelay's own libucp binding.

One context and one worker per agent. A peer's endpoint is created from the
worker address in its hello, with error handling off (with it on, UCX drops
the shared-memory and cma lanes); its packed rkeys are unpacked once per
arena and checked byte for byte against the peer's arena table first, so a
forged rkey never reaches ucp_ep_rkey_unpack. A daemon thread progresses the
worker so that peers whose RMA UCX emulates with messages (tcp) are served.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import threading
import time
import weakref
from dataclasses import dataclass, field

from kvrelay.transfer.base import Peer, Transport
from kvrelay.transfer.errors import BackendUnavailable, PeerError, TransferError
from kvrelay.transfer.inline import InlineBudget

try:
    import torch  # noqa: F401  (loads libc10/libtorch, which _ucx links against)

    from kvrelay import _ucx
except ImportError as exc:  # pragma: no cover - depends on the build
    raise BackendUnavailable(
        "the ucx backend needs kvrelay._ucx, which was not built: install the UCX wheel "
        "(pip install libucx-cu12==1.22.0) or set UCX_HOME to a UCX install with "
        f"include/ucp/api/ucp.h and lib/libucp.so, then reinstall kvrelay ({exc})"
    ) from exc

_CLOSE_TIMEOUT = 1.0
# How long a batch is progressed on the loop's thread (GIL released) before
# it moves to a waiter thread; about as long as the fast path's inline copies
# (up to 64 MiB). At 4 ms a 32 MiB cma batch (6-8 ms here) always paid the
# hand-off to the waiter thread and the eventfd wake-up of the loop.
_INLINE_DRIVE_S = 0.016
_WAIT_LIMIT = 24 * 3600.0  # a batch's own bound; the caller's deadline aborts it first
# UCX settings kvrelay applies unless a UCX_* variable sets them. cma copies
# a GET in segments of UCX_CMA_SEG_SIZE (512 KiB by default), one
# process_vm_readv and one progress call each: a 16 MiB GET took 32. One
# segment up to 64 MiB keeps a segment's copy short enough for an abort to
# be seen within a few ms (measured in issue 14: docs/architecture.md).
UCX_DEFAULTS = {"CMA_SEG_SIZE": "64M"}


@dataclass(slots=True)
class _PeerState:
    endpoint: object
    rkeys: dict[int, object] = field(default_factory=dict)


class UcxTransport(Transport):
    name = "ucx"
    device_memory = True  # ucp_mem_map detects CUDA memory (the wheel is built with CUDA)

    def __init__(self) -> None:
        try:
            self.context = _ucx.Context(UCX_DEFAULTS)
            self.worker = _ucx.Worker(self.context)
        except _ucx.UcxError as exc:
            raise BackendUnavailable(f"UCX failed to start: {exc}") from exc
        self._regions: dict[int, object] = {}
        self._states: list[_PeerState] = []
        self._inline = InlineBudget()
        self._stop = threading.Event()
        self._progress = threading.Thread(target=self._progress_loop, daemon=True)
        self._progress.start()
        _LIVE.add(self)

    def stop_progress(self) -> None:
        self._stop.set()
        self._progress.join(timeout=5)

    def _progress_loop(self) -> None:
        while not self._stop.is_set():
            self.worker.progress_for(0.25)

    def hello_fields(self) -> dict:
        return {"ucx_address": self.worker.address()}

    def register(self, arena) -> bytes:
        region = _ucx.MemRegion(self.context, arena.address, arena.size)
        self._regions[arena.arena_id] = region
        return region.pack_rkey()

    def deregister(self, arena) -> None:
        region = self._regions.pop(arena.arena_id, None)
        if region is not None:
            region.unmap()

    def _state(self, peer: Peer) -> _PeerState:
        if peer.state is None:
            address = peer.hello.ucx_address
            if address is None:
                raise PeerError(f"agent {peer.address} is not a ucx agent")
            try:
                # Error handling off on one host, or UCX drops the shm/cma lanes.
                endpoint = _ucx.Endpoint(self.worker, address, not peer.on_host)
                peer.state = _PeerState(endpoint)
            except _ucx.UcxError as exc:
                raise PeerError(f"cannot reach agent {peer.address} over UCX: {exc}") from None
            self._states.append(peer.state)
        return peer.state

    async def move(self, peer, handle, local, rows, read, deadline) -> None:
        region = self._regions.get(local.arena_id)
        if region is None:
            raise TransferError(f"local arena {local.arena_id} is not registered with ucx")
        # The binding checks the peer's control connection for a hang-up
        # before posting (on one host a dead peer is seen only there).
        watch = -1 if peer.conn is None else peer.conn.sock.fileno()
        if watch < 0 and peer.conn is not None:
            raise PeerError(f"agent {peer.address} closed its control connection")
        state = self._state(peer)
        rkey = state.rkeys.get(handle.arena_id)
        if rkey is None:
            rkey = _ucx.RemoteKey(state.endpoint, handle.rkey)
            state.rkeys[handle.arena_id] = rkey
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        inline = min(_INLINE_DRIVE_S, max(0.0, deadline - loop.time()))
        try:
            # Posted and progressed for up to `inline` in one call: cma GETs
            # are deferred to progress and done within a few ms, and a waiter
            # thread and an eventfd wake-up cost more than that saves.
            batch = _ucx.Batch(rkey, region, read, rows, handle.base, inline, watch)
        except _ucx.PeerClosed:
            raise PeerError(f"agent {peer.address} closed its control connection") from None
        except _ucx.UcxError as exc:
            raise PeerError(f"posting to {peer.address} failed: {exc}") from None
        try:
            if batch.result():
                # Done inline: the loop gets its turn once such pulls add up.
                if self._inline.used_up(time.perf_counter() - started):
                    await asyncio.sleep(0)
            elif not await _wait_on_thread(batch, peer, loop, deadline):
                raise PeerError(f"transfer from {peer.address} did not complete")
        except _ucx.UcxError as exc:
            self.drop_peer(peer)
            raise PeerError(f"transfer from {peer.address} failed: {exc}") from None
        except BaseException:
            # Timeout, cancellation or a dead peer: stop the batch and close
            # the endpoint, so nothing writes into `local` after this returns.
            batch.abort()
            self.drop_peer(peer)
            raise
        finally:
            batch.release()

    def drop_peer(self, peer) -> None:
        state: _PeerState | None = peer.state
        if state is None:
            return
        peer.state = None
        for rkey in state.rkeys.values():
            rkey.destroy()
        state.rkeys.clear()
        with contextlib.suppress(_ucx.UcxError):  # else the worker frees it at teardown
            state.endpoint.close(True, _CLOSE_TIMEOUT)
        if state in self._states:
            self._states.remove(state)

    def stats(self) -> dict:
        return {
            "ucx_endpoints": len(self._states),
            "ucx_rkeys": sum(len(s.rkeys) for s in self._states),
            "ucx_regions": len(self._regions),
        }

    def close(self) -> None:
        """rkeys and endpoints (peers dropped by the agent), regions, worker, context."""
        self.stop_progress()
        for region in self._regions.values():
            region.unmap()
        self._regions.clear()
        self.worker.close()
        self.context.close()


_LIVE: weakref.WeakSet[UcxTransport] = weakref.WeakSet()


@atexit.register
def _stop_progress_threads() -> None:
    # A daemon thread still inside the binding when the interpreter finalizes
    # is ended with a forced unwind through C++ frames, which aborts the
    # process; stop them first for agents that were never closed.
    for transport in list(_LIVE):
        transport.stop_progress()


def _peer_gone(peer) -> bool:
    return peer.conn.closed_by_peer()


async def _wait_on_thread(batch, peer, loop, deadline) -> bool:
    """Waits for a batch that was not done inline: it is driven on a thread
    of its own, which signals an eventfd (no executor hop and no GIL handoff
    per batch). Bounded by the deadline; a dead peer is noticed here too.
    The batch's result() once it is done."""
    done = loop.create_future()
    fd = batch.start(_WAIT_LIMIT)
    loop.add_reader(fd, lambda: done.done() or done.set_result(None))
    try:
        while not done.done():
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError
            await asyncio.wait({done}, timeout=min(0.25, left))
            if not done.done() and peer.conn is not None and _peer_gone(peer):
                raise PeerError(f"agent {peer.address} died during the transfer")
    finally:
        loop.remove_reader(fd)
    return batch.result()
