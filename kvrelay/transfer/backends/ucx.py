"""UCX backend: one-sided GET/PUT through kvrelay's own libucp binding.

One context and one worker per agent, and a second worker (with a thread
kept to drive it) for striped pulls: a same-host pull of STRIPE_MIN_BYTES or
more, where the host's calibration found two kernel copies faster than one,
goes half through each at once. A peer's endpoint is created from the
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
from kvrelay.transfer.stripes import STRIPE_MIN_BYTES, two_cpus

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
# be seen within a few ms.
UCX_DEFAULTS = {"CMA_SEG_SIZE": "64M"}
_FAR_BLOCK_S = 0.004  # how long the loop's thread waits for the far half before yielding


@dataclass(slots=True)
class _PeerState:
    endpoint: object
    rkeys: dict[int, object] = field(default_factory=dict)
    # The stripe worker's endpoint and rkeys (UCX rkeys are per endpoint).
    stripe_endpoint: object | None = None
    stripe_rkeys: dict[int, object] = field(default_factory=dict)


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
        self.stripes = 1  # set by tune()
        # A second worker and the thread kept to drive it, made on the first striped pull.
        self._stripe_worker = None
        self._driver = None
        self._inline = InlineBudget()
        self._stop = threading.Event()
        self._progress = threading.Thread(target=self._progress_loop, daemon=True)
        self._progress.start()
        _LIVE.add(self)

    def stop_progress(self) -> None:
        """Ends the progress thread and the stripe driver's (at close, or at
        exit for an agent never closed)."""
        self._stop.set()
        self._progress.join(timeout=5)
        if self._driver is not None:
            self._driver.stop()

    def _progress_loop(self) -> None:
        while not self._stop.is_set():
            self.worker.progress_for(0.25)

    def wants_copy_plan(self, config) -> bool:
        return config.stripes == 0

    def tune(self, config, plan) -> None:
        if not two_cpus():
            self.stripes = 1  # two copies would share one CPU
        elif config.stripes:
            self.stripes = config.stripes
        else:
            self.stripes = plan.kernel_copy_threads() if plan is not None else 1

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
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        inline = min(_INLINE_DRIVE_S, max(0.0, deadline - loop.time()))
        batches: list = []  # what was posted, for the failure paths below
        try:
            far_fd = self._post(peer, handle, region, rows, read, watch, inline, batches)
            near = batches[-1]
            done_inline = near.result()
            if not done_inline and not await _wait_on_thread(near, peer, loop, deadline):
                raise PeerError(f"transfer from {peer.address} did not complete")
            if far_fd >= 0 and not await self._wait_far(batches[0], far_fd, peer, loop, deadline):
                raise PeerError(f"transfer from {peer.address} did not complete")
            # Done inline: the loop gets its turn once such pulls add up.
            if done_inline and self._inline.used_up(time.perf_counter() - started):
                await asyncio.sleep(0)
        except _ucx.UcxError as exc:
            self.drop_peer(peer)
            raise PeerError(f"transfer from {peer.address} failed: {exc}") from None
        except BaseException:
            if batches:
                # Timeout, cancellation or a dead peer: stop the batches and
                # close the endpoints, so nothing writes into `local` after
                # this returns.
                for batch in batches:
                    batch.abort()
                self.drop_peer(peer)
            raise
        finally:
            for batch in batches:
                batch.release()

    def _post(self, peer, handle, region, rows, read, watch, inline, batches) -> int:
        """Posts the pull, appending each batch to `batches` as it goes: the
        near one (on the agent's worker, progressed for up to `inline` in
        the same call), and first, for a split pull, the far one on the
        stripe worker. The far batch's eventfd, or -1 when not split."""
        state = self._state(peer)
        rkey = self._rkey(state.rkeys, state.endpoint, handle)
        halves = None
        if self.stripes > 1 and peer.on_host:
            halves = _ucx.split_rows(rows, STRIPE_MIN_BYTES, read)
        far_fd = -1
        try:
            if halves is not None:
                # The second half first, posted and driven by the stripe
                # worker's kept thread while this thread does the first.
                far_rkey = self._stripe_rkey(peer, state, handle)
                far = _ucx.Batch(far_rkey, region, read, halves[1], handle.base, 0.0, watch, True)
                batches.append(far)
                far_fd = far.start_on(self._driver, _WAIT_LIMIT)
                rows = halves[0]
            # Posted and progressed for up to `inline` in one call: cma GETs
            # are deferred to progress and done within a few ms, and a waiter
            # thread and an eventfd wake-up cost more than that saves.
            batches.append(_ucx.Batch(rkey, region, read, rows, handle.base, inline, watch))
        except _ucx.PeerClosed:
            raise PeerError(f"agent {peer.address} closed its control connection") from None
        except _ucx.UcxError as exc:
            raise PeerError(f"posting to {peer.address} failed: {exc}") from None
        return far_fd

    async def _wait_far(self, far, fd, peer, loop, deadline) -> bool:
        """The stripe worker's half, which started with the near one and is
        about as long: blocking briefly beats a loop round trip (a few
        hundred us from a cold cache, a tenth of a 16 MiB pull)."""
        if far.done_within(min(_FAR_BLOCK_S, max(0.0, deadline - loop.time()))):
            return far.result()
        return await _wait_on_thread(far, peer, loop, deadline, fd)

    def _rkey(self, rkeys: dict, endpoint, handle):
        rkey = rkeys.get(handle.arena_id)
        if rkey is None:
            rkey = rkeys[handle.arena_id] = _ucx.RemoteKey(endpoint, handle.rkey)
        return rkey

    def _stripe_rkey(self, peer, state: _PeerState, handle):
        try:
            if self._stripe_worker is None:
                self._stripe_worker = _ucx.Worker(self.context)
                self._driver = _ucx.Driver()
            if state.stripe_endpoint is None:
                state.stripe_endpoint = _ucx.Endpoint(
                    self._stripe_worker, peer.hello.ucx_address, not peer.on_host
                )
        except _ucx.UcxError as exc:
            raise PeerError(f"cannot reach agent {peer.address} over UCX: {exc}") from None
        return self._rkey(state.stripe_rkeys, state.stripe_endpoint, handle)

    def drop_peer(self, peer) -> None:
        state: _PeerState | None = peer.state
        if state is None:
            return
        peer.state = None
        for rkey in (*state.rkeys.values(), *state.stripe_rkeys.values()):
            rkey.destroy()
        state.rkeys.clear()
        state.stripe_rkeys.clear()
        for endpoint in (state.endpoint, state.stripe_endpoint):
            if endpoint is not None:
                with contextlib.suppress(_ucx.UcxError):  # else the worker frees it at teardown
                    endpoint.close(True, _CLOSE_TIMEOUT)
        if state in self._states:
            self._states.remove(state)

    def stats(self) -> dict:
        return {
            "ucx_endpoints": len(self._states),
            "ucx_rkeys": sum(len(s.rkeys) + len(s.stripe_rkeys) for s in self._states),
            "ucx_regions": len(self._regions),
            "ucx_stripes": self.stripes,
        }

    def close(self) -> None:
        """rkeys and endpoints (peers dropped by the agent), regions, worker, context."""
        self.stop_progress()
        for region in self._regions.values():
            region.unmap()
        self._regions.clear()
        if self._stripe_worker is not None:
            self._stripe_worker.close()
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


async def _wait_on_thread(batch, peer, loop, deadline, fd: int = -1) -> bool:
    """Waits for a batch that was not done inline: it is driven on a thread
    of its own, which signals an eventfd (no executor hop and no GIL handoff
    per batch), `fd` if the caller started it already. Bounded by the
    deadline; a dead peer is noticed here too. The batch's result() once it
    is done."""
    if fd < 0:
        fd = batch.start(_WAIT_LIMIT)
    done = loop.create_future()
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
