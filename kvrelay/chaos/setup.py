"""Targets built against live servers: the leases and handles a fuzzer
needs (a live one, released ones, expired ones) are real."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib

import msgpack

from kvrelay.chaos import frames
from kvrelay.chaos.targets import Target, agent_target, cache_target, worker_target

NS = hashlib.sha256(b"kvrelay chaos tenant").digest()


async def _session(address: str, token: str, messages: list[dict]) -> list[dict]:
    """Sends `messages` one after the other on one connection; their replies."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        async with asyncio.timeout(30):
            writer.write(frames.hello(token))
            replies = [await frames.read_frame(reader)]
            for message in messages:
                writer.write(frames.frame(message))
                replies.append(await frames.read_frame(reader))
            return replies
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def reserved_handle(cache: str, token: str, page_bytes: int, key: bytes,
                           lease_s: float) -> tuple[str, dict]:  # fmt: skip
    """(agent address, handle fields) of a reservation of `key` on the cache."""
    hello, reserved = await _session(
        cache, token, [{"op": "reserve", "keys": [key], "lease_s": lease_s, "ns": NS}]
    )
    lease = reserved["lease"]
    publish = {"op": "handle", "lease": lease, "count": 1, "runs": [[0, page_bytes]], "ns": NS}
    _, handle = await _session(cache, token, [publish])
    fields = msgpack.unpackb(handle["handle"], raw=False)
    return hello["agent"], fields | {"cache_lease": lease, "raw": handle["handle"]}


async def cache_targets(cache: str, token: str, page_bytes: int,
                        arena_bytes: int) -> tuple[Target, Target]:  # fmt: skip
    """The cache server's control listener and its transfer agent."""
    key = hashlib.sha256(b"chaos live").digest()
    agent, live = await reserved_handle(cache, token, page_bytes, key, 300)
    dead, dead_cache = [], []
    for i in range(2):  # one released, one left to expire
        k = hashlib.sha256(b"chaos dead %d" % i).digest()
        # The short lease must outlive its own publish on a loaded machine.
        _, fields = await reserved_handle(cache, token, page_bytes, k, 3.0 if i else 30)
        dead.append(fields["lease"])
        dead_cache.append(fields["cache_lease"])
        if not i:
            await _session(agent, token, [{"op": "release", "lease": fields["lease"]}])
            await _session(cache, token, [{"op": "release", "lease": fields["cache_lease"]}])
    await asyncio.sleep(3.2)
    return (
        cache_target(cache, token, page_bytes, NS, live["cache_lease"], dead_cache),
        agent_target(agent, token, live["arena"], arena_bytes, live["lease"], dead),
    )


async def worker_targets(prefill: str, decode: str, token: str, vocab: int, page_size: int,
                         handle: bytes) -> tuple[Target, Target]:  # fmt: skip
    return (
        worker_target("prefill", prefill, token, vocab, page_size, handle),
        worker_target("decode", decode, token, vocab, page_size, handle),
    )
