"""Copies straight into a same-host peer's arena, for callers with their own copy.

An engine whose compiled gather or scatter can use a cache server's arena as
its page rows moves a page once where a transfer into a local arena and a
copy from it would move it twice. These `Agent` methods hand such a caller
the owner's arena mapped here, after the checks a transfer makes
(namespace, lease, rkey, every run in bounds).
"""

from __future__ import annotations

import asyncio

from kvrelay.rpc.errors import AuthError, PeerError, ProtocolError
from kvrelay.transfer.arena import RemoteMapping
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

    def peer_is_mapped(self, address: str) -> bool | None:
        """Whether this agent has mapped an arena of the agent at `address`
        (a same-host peer); False for a peer on another host, None where
        nothing is mapped yet. Never waits."""
        peer = self._peers.get(address)
        if peer is not None and not peer.same_host:
            return False
        return True if peer is not None and peer.mappings else None

    def known_mapping(self, handle: BlockHandle, namespace: bytes) -> RemoteMapping | None:
        """The handle's arena as this agent has mapped it (a same-host peer's
        memfd, mapped by a transfer or `copy_mapped`), checked like a
        transfer (namespace, lease, rkey, every run in bounds); None where
        it has not. Never waits, connects or maps: for a caller on another
        thread, which copies under the mapping's `lock` (a dropped peer's
        `close` waits for it) and finds `size` 0 once it is closed."""
        handle.check(namespace)
        peer = self._peers.get(handle.agent)  # dict reads: safe beside the loop
        info = peer.arenas.get(handle.arena_id) if peer is not None else None
        if info is None or peer.agent_id != handle.agent_id or not peer.same_host:
            return None
        mapped = peer.mappings.get(info.arena_id)
        if mapped is None:
            return None
        handle.check_key(info)
        check_runs(handle.runs, info.size, "remote")
        return mapped
