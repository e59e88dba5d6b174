"""Copies straight into a same-host peer's arena, for callers with their own copy.

An engine whose compiled gather or scatter can use a cache server's arena as
its page rows moves a page once where a transfer into a local arena and a
copy from it would move it twice. These `Agent` methods hand such a caller
the owner's arena mapped here, after the checks a transfer makes
(namespace, lease, rkey, every run in bounds).
"""

from __future__ import annotations

import asyncio

from kvrelay.rpc.agent_ops import ArenaInfo
from kvrelay.rpc.errors import AuthError, PeerError, ProtocolError
from kvrelay.transfer.errors import TransferTimeout
from kvrelay.transfer.fastpath import mapping
from kvrelay.transfer.handle import BlockHandle, check_runs


class MappedCopies:
    """Mixed into `Agent` (its peers, `_peer_arena`, `_drop_peer` and config)."""

    async def copy_mapped(self, handle, fn, *, namespace, timeout=None) -> bool:
        """Calls `fn(arena)` with the owner's whole arena behind `handle` mapped
        here (a uint8 tensor), when the owner is a same-host agent and the
        arena a memfd; False, calling nothing, otherwise (move the bytes with
        `read` / `write`). For a caller whose own copy goes straight between
        its memory and the runs (a gather or scatter with the owner's pages
        as its rows): one copy where `read` would make a second. Checked like
        a transfer first (namespace, lease, rkey, every run in bounds); `fn`
        must touch the handle's runs only, and runs synchronously, so the
        mapping cannot go while it copies."""
        if not isinstance(handle, BlockHandle):
            handle = BlockHandle.from_bytes(handle)
        handle.check(namespace)
        timeout = self.config.timeout if timeout is None else timeout
        deadline = asyncio.get_running_loop().time() + timeout
        peer = None
        try:
            peer, info = await self._peer_arena(handle, deadline)
            if not (peer.same_host and info.shm):
                return False
            check_runs(handle.runs, info.size, "remote")
            fn(mapping(peer, info).tensor())
        except TimeoutError:
            if peer is not None:
                self._drop_peer(peer)
            raise TransferTimeout(f"{handle.agent} did not answer within {timeout} s") from None
        except (PeerError, ProtocolError, AuthError, asyncio.CancelledError):
            if peer is not None:
                self._drop_peer(peer)
            raise
        # A mapping outlives its owner; a dead owner cannot honour its lease.
        if peer.conn.closed_by_peer():
            self._drop_peer(peer)
            raise PeerError(f"agent {peer.address} died during the copy")
        return True

    def peer_is_shared(self, address: str) -> bool | None:
        """Whether the agent at `address` is a same-host peer whose arenas map
        here; None where this agent has not met it yet. Never waits."""
        peer = self._peers.get(address)
        if peer is None or not peer.arenas:
            return None
        return peer.same_host and any(info.shm for info in peer.arenas.values())

    def known_shared_arena(self, handle: BlockHandle, namespace: bytes) -> ArenaInfo | None:
        """The handle's arena where this agent already knows it as a same-host
        peer's memfd, checked like a transfer (namespace, lease, rkey, every
        run in bounds); None where it has not met that peer and arena yet
        (`copy_mapped` meets them) or the arena cannot be mapped. Never waits
        and never connects: for a caller on another thread, which maps the
        arena itself (`RemoteMapping`) so that no peer drop here unmaps it
        under a copy there."""
        handle.check(namespace)
        peer = self._peers.get(handle.agent)  # dict reads: safe beside the loop
        info = peer.arenas.get(handle.arena_id) if peer is not None else None
        if info is None or peer.agent_id != handle.agent_id:
            return None
        if not (peer.same_host and info.shm):
            return None
        handle.check_key(info)
        check_runs(handle.runs, info.size, "remote")
        return info
