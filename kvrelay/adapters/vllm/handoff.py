"""The P/D handoff between vLLM engines, worker side.

A prefill engine keeps a finished request's blocks (its scheduler returned
"free later" and the `kv_transfer_params` that name them) and serves them
from a `HandoffService`, one per rank: a decode rank asks for the blocks,
gets a block handle over the prefill's own KV cache memory under a lease,
pulls the bytes one-sided with kvrelay's transfer agent straight into its
own blocks, and releases the lease. The prefill reports the request
finished sending when the lease is released or the hold expires; vLLM then
frees the blocks.

Blocks move as they are (no conversion), so both ranks must tile a block the
same way: the layout fingerprint (dtype, block shape, the tiling probed from
vLLM's cache write) must match, else the decode recomputes. Pages across
different parallel configurations go through the tier instead.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvrelay import rpc
from kvrelay.adapters.vllm.blocks import BlockLayoutError, block_axes_dense
from kvrelay.rpc.handoff_ops import HandoffGrant, HandoffPull, HandoffWelcome
from kvrelay.transfer.arena import collapse_to_huge_pages
from kvrelay.transfer.errors import LeaseExpired
from kvrelay.transfer.handle import BlockHandle, coalesce

log = logging.getLogger("kvrelay.adapters.vllm")

# A decode may ask before the prefill's workers heard of the hold (the
# scheduler tells them in its next step, milliseconds after the reply).
HOLD_WAIT_S = 5.0
# A pull must end this long before its lease: after the lease the prefill
# may hand the blocks to another request.
LEASE_MARGIN_S = 0.05
# The release is awaited inside the pull, whose caller bounds the whole pull
# by the same timeout as the read: a slow release must not use that up and
# turn blocks already in into a failed load (the hold's end frees them).
RELEASE_BOUND_S = 1.0


def layout_fingerprint(perm: torch.Tensor, cache: torch.Tensor) -> str:
    """Dtype, block shape, axis order and in-block tiling: equal ones make a
    block's bytes portable (the device is not in it: UCX moves between host
    and GPU memory alike)."""
    _, heads, block_size, fused = cache.shape
    digest = hashlib.sha256(perm.to(torch.int64).cpu().numpy().tobytes()).hexdigest()[:16]
    order = "".join("htc"[axis] for axis in axis_order(cache))
    return f"{cache.dtype}:{heads}x{block_size}x{fused}:{order}:{digest}"


def axis_order(cache: torch.Tensor) -> list[int]:
    """A block's [heads, tokens, content] axes, outermost first in memory."""
    return sorted(range(3), key=lambda axis: -cache.stride(axis + 1))


class KvMemory:
    """vLLM's layer caches registered with a transfer agent as one arena.

    vLLM views every layer's cache in one backing allocation; block `b` of
    layer `l` is the `block_bytes` at `layer_offsets[l] + b * block_stride`.
    """

    def __init__(
        self, agent, caches: Sequence[torch.Tensor], layout: str, huge_pages: bool = False
    ) -> None:
        storage = caches[0].untyped_storage()
        if any(c.untyped_storage().data_ptr() != storage.data_ptr() for c in caches):
            raise BlockLayoutError("vLLM's layer caches are not views of one allocation")
        first = caches[0]
        num_blocks, heads, block_size, fused = first.shape
        itemsize = first.element_size()
        if (
            any(not block_axes_dense(c) or c.stride() != first.stride() for c in caches)
            or first.stride(0) < heads * block_size * fused
        ):
            raise BlockLayoutError("a layer's block is not one contiguous run")
        whole = torch.empty(0, dtype=torch.uint8, device=first.device)
        whole.set_(storage, 0, (storage.nbytes(),), (1,))
        on_host = first.device.type == "cpu"
        self.huge_page_bytes = collapse_to_huge_pages(whole) if huge_pages and on_host else 0
        self.arena = agent.register_tensor(whole)
        base = storage.data_ptr()
        self.layout = layout
        self.num_blocks = num_blocks
        self.layer_offsets = [c.data_ptr() - base for c in caches]
        self.block_stride = first.stride(0) * itemsize
        self.block_bytes = heads * block_size * fused * itemsize

    def welcome(self) -> HandoffWelcome:
        return HandoffWelcome(self.layout, self.layer_offsets, self.block_stride, self.block_bytes)

    def runs(self, block_ids: Sequence[int]) -> list[tuple[int, int]]:
        """The blocks' bytes in every layer, adjacent runs joined."""
        if any(not 0 <= b < self.num_blocks for b in block_ids):
            raise IndexError(f"block ids must lie in [0, {self.num_blocks})")
        starts = sorted(o + b * self.block_stride for b in block_ids for o in self.layer_offsets)
        runs: list[list[int]] = []
        for start in starts:
            if runs and runs[-1][0] + runs[-1][1] == start:
                runs[-1][1] += self.block_bytes
            else:
                runs.append([start, self.block_bytes])
        return [(o, n) for o, n in runs]


def paired_runs(
    remote: HandoffWelcome, local: KvMemory, remote_blocks: Sequence[int], local_blocks
) -> tuple[list[tuple[int, int]], list[int]]:
    """(remote runs, local offsets) moving remote block i into local block i, every
    layer; a run continues while both sides stay contiguous."""
    if remote.block_bytes != local.block_bytes or len(remote.layer_offsets) != len(
        local.layer_offsets
    ):
        raise BlockLayoutError("the prefill's blocks are not shaped like the decode's")
    size = remote.block_bytes
    pairs = coalesce([
        (ro + rb * remote.block_stride, lo + lb * local.block_stride, size)
        for rb, lb in zip(remote_blocks, local_blocks, strict=True)
        for ro, lo in zip(remote.layer_offsets, local.layer_offsets, strict=True)
    ])  # fmt: skip
    return [(r, n) for r, _, n in pairs], [lc for _, lc, _ in pairs]


@dataclass(slots=True)
class Hold:
    block_ids: frozenset[int]
    deadline: float  # wall clock, as leases are
    leases: list[int] = field(default_factory=list)


class HoldBook:
    """Finished prefills whose blocks wait for their decode. Shared by the
    model runner's thread (holds arrive, finished ones leave) and the tier
    loop's (grants), hence the lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holds: dict[str, Hold] = {}
        self.ended: dict[str, float] = {}  # recently ended holds, for a clear refusal

    def add(self, request_id: str, block_ids: Sequence[int], deadline: float) -> None:
        with self.lock:
            self.holds[request_id] = Hold(frozenset(block_ids), deadline)

    def take_finished(self, lease_active: Callable[[int], bool]) -> set[str]:
        """Holds whose every granted lease is released, or whose time is up."""
        now = time.time()
        with self.lock:
            done = {
                rid
                for rid, hold in self.holds.items()
                if now >= hold.deadline or (hold.leases and not any(map(lease_active, hold.leases)))
            }
            for rid in done:
                del self.holds[rid]
                self.ended[rid] = now
            for rid in [r for r, t in self.ended.items() if now - t > 600]:
                del self.ended[rid]
        return done


class HandoffService:
    """A prefill rank's handoff service: grants leases over held requests' blocks."""

    def __init__(self, agent, memory: KvMemory, book: HoldBook, namespace: bytes, token: str):
        self.agent, self.memory, self.book = agent, memory, book
        self.namespace, self.token = namespace, token
        self.server: rpc.Server | None = None
        self.grants = 0

    async def start(self, host: str, port: int) -> HandoffService:
        self.server = rpc.Server(
            token=self.token, requests=HandoffPull, handler=self._handle,
            welcome=self.memory.welcome, host=host, port=port,
        )  # fmt: skip
        await self.server.start()
        return self

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()

    async def _handle(self, conn, request: HandoffPull) -> HandoffGrant:
        if request.layout != self.memory.layout:
            raise BlockLayoutError(
                f"the decode's block layout {request.layout} is not this prefill's "
                f"{self.memory.layout}"
            )
        deadline = time.monotonic() + HOLD_WAIT_S
        while True:
            with self.book.lock:
                hold = self.book.holds.get(request.request_id)
                if hold is not None:
                    return self._grant(request, hold)
                if request.request_id in self.book.ended:
                    raise LeaseExpired(f"request {request.request_id}'s blocks are released")
            if time.monotonic() >= deadline:
                raise KeyError(f"no finished prefill {request.request_id!r} holds blocks here")
            await asyncio.sleep(0.002)

    def _grant(self, request: HandoffPull, hold: Hold) -> HandoffGrant:
        """Under the book's lock: a lease over the blocks, until the hold's deadline."""
        stray = set(request.block_ids) - hold.block_ids
        if stray:
            raise ValueError(f"blocks {sorted(stray)[:8]} are not {request.request_id}'s")
        seconds = hold.deadline - time.time()
        if seconds <= LEASE_MARGIN_S:
            raise LeaseExpired(f"request {request.request_id}'s hold has expired")
        handle = self.agent.publish(
            self.memory.arena, self.memory.runs(request.block_ids), self.namespace, seconds
        )
        hold.leases.append(handle.lease_id)
        self.grants += 1
        return HandoffGrant(handle=handle.to_bytes())


class HandoffPuller:
    """A decode rank's side: pulls a held request's blocks into its own blocks."""

    def __init__(self, agent, memory: KvMemory, namespace: bytes, token: str, timeout_s: float):
        self.agent, self.memory = agent, memory
        self.namespace, self.token, self.timeout_s = namespace, token, timeout_s
        self._conns: dict[str, tuple[rpc.Connection, HandoffWelcome]] = {}

    async def close(self) -> None:
        for conn, _ in self._conns.values():
            conn.close()
        self._conns.clear()

    async def pull(
        self, address: str, request_id: str, remote_blocks: Sequence[int], local_blocks
    ) -> dict:
        """Moves the blocks and releases the lease; raises on any failure of the
        move (the caller recomputes; a failed release only logs: the blocks are
        in, and the prefill frees them at the hold's end). Returns the bytes
        moved and the seconds of the grant and of the read."""
        started = time.perf_counter()
        conn, welcome = await self._connect(address)
        try:
            grant = await rpc.call(
                conn, HandoffPull(request_id, list(remote_blocks), self.memory.layout),
                HandoffGrant, self.timeout_s,
            )  # fmt: skip
        except (rpc.RpcError, OSError):
            self._drop(address)
            raise
        granted = time.perf_counter()
        handle = BlockHandle.from_bytes(grant.handle)
        remote_runs, local_offsets = paired_runs(welcome, self.memory, remote_blocks, local_blocks)
        await self.agent.read(
            handle.narrow(remote_runs), self.memory.arena, local_offsets,
            namespace=self.namespace, timeout=self.timeout_s,
        )  # fmt: skip
        if time.time() >= handle.lease_expiry - LEASE_MARGIN_S:
            raise LeaseExpired(f"request {request_id}'s lease ended during the pull")
        # Released before the step's forward, not beside it: a prefill engine
        # holding blocks steps without pause until the release lands, and on
        # a host the two engines share those steps stall the decode's forward
        # (an OpenMP team of every core waits at each op for a displaced thread).
        await self._release(handle)
        return {"bytes": sum(n for _, n in remote_runs), "grant_s": granted - started,
                "read_s": time.perf_counter() - granted}  # fmt: skip

    async def _release(self, handle: BlockHandle) -> None:
        try:
            await self.agent.release_remote(handle, min(self.timeout_s, RELEASE_BOUND_S))
        except Exception as exc:  # the prefill frees the blocks at the hold's end
            log.info("kvrelay: releasing lease %d failed (%s)", handle.lease_id, exc)

    async def _connect(self, address: str) -> tuple[rpc.Connection, HandoffWelcome]:
        known = self._conns.get(address)
        if known is not None:
            return known
        conn, welcome = await rpc.connect(address, self.token, HandoffWelcome, self.timeout_s)
        if welcome.layout != self.memory.layout:
            conn.close()
            raise BlockLayoutError(
                f"the prefill at {address} tiles blocks as {welcome.layout}, this decode as "
                f"{self.memory.layout}"
            )
        self._conns[address] = (conn, welcome)
        return conn, welcome

    def _drop(self, address: str) -> None:
        known = self._conns.pop(address, None)
        if known is not None:
            known[0].close()
