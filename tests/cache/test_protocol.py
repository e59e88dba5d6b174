"""CacheServer's request checks, in process (loopback agent), and the hello over tcp."""

import asyncio
import hashlib

import pytest

from kvrelay.cache.server import CacheServer, CacheServerConfig
from kvrelay.rpc import WIRE_VERSION, Connection, MalformedMessage
from kvrelay.rpc.cache_ops import CacheRequest
from kvrelay.rpc.framing import decode, encode

KEY = hashlib.sha256(b"k").digest()


def request(message: dict):
    """A map as the server decodes it off the wire."""
    return decode(encode(message), CacheRequest)


@pytest.mark.asyncio
async def test_malformed_requests_are_refused():
    server = await CacheServer(
        CacheServerConfig(token="t", page_bytes=64, arena_bytes=4 * 64, backend="loopback")
    ).start()
    bad = [
        {"op": "nope"},
        {"op": "lookup", "keys": [b"short"]},
        {"op": "lookup", "keys": "abc"},
        {"op": "lookup", "keys": [KEY], "lease_s": 0},
        {"op": "lookup", "keys": [KEY], "lease_s": 10_000},
        {"op": "lookup", "keys": [KEY], "surprise": 1},
        {"op": "commit", "keys": [KEY], "runs": [[60, 8]]},
        {"op": "commit", "keys": [KEY], "runs": []},
        {"op": "handle", "lease": 12345, "count": 1, "runs": [[0, 64]], "ns": KEY},
        {"op": "reserve", "keys": [KEY], "ns": "not bytes"},
        {"op": "flush", "ns": b"short"},
    ]
    for message in bad:
        with pytest.raises(MalformedMessage):
            server.handle(request(message))
    reply = server.handle(request({"op": "reserve", "keys": [KEY], "lease_s": 5, "ns": KEY}))
    lease = reply.lease
    assert reply.slots == [0]
    for count in (0, 2):
        with pytest.raises(MalformedMessage):
            server.handle(request({"op": "handle", "lease": lease, "count": count,
                                   "runs": [[0, 64]], "ns": KEY}))  # fmt: skip
    commit = request({"op": "commit", "keys": [KEY], "runs": [[0, 64]], "ns": KEY})
    assert server.handle(commit).sealed == [True]
    assert server.handle(request({"op": "release", "lease": lease})).released
    looked = server.handle(request({"op": "lookup", "keys": [KEY], "ns": KEY}))
    assert looked.hits == 1
    assert server.handle(request({"op": "stats"})).tier["sealed_pages"] == 1
    other = hashlib.sha256(b"x").digest()
    assert server.handle(request({"op": "flush", "ns": other})).dropped == 0
    assert server.handle(request({"op": "flush"})).dropped == 0  # pinned by the lookup
    server.handle(request({"op": "release", "lease": looked.lease}))
    assert server.handle(request({"op": "flush"})).dropped == 1
    await server.close()


async def _hello(server: CacheServer, hello: dict) -> dict:
    host, port = server.address.rsplit(":", 1)
    conn = await Connection.open(host, int(port))
    try:
        await conn.send(hello)
        return await asyncio.wait_for(conn.recv(), 5)
    finally:
        conn.close()


@pytest.mark.asyncio
async def test_wrong_token_and_old_wire_version_are_refused_over_tcp():
    server = await CacheServer(
        CacheServerConfig(token="t", page_bytes=64, arena_bytes=4 * 64)
    ).start()
    reply = await _hello(server, {"op": "hello", "v": WIRE_VERSION, "token": "wrong"})
    assert reply["op"] == "error" and reply["error"] == "AuthError"
    # A peer of wire version 1 reads `ok` and `message`: it sees why.
    reply = await _hello(server, {"op": "hello", "v": 1, "token": "t"})
    assert reply["ok"] is False and reply["error"] == "WireVersionError"
    assert f"wire version {WIRE_VERSION}" in reply["message"] and "says 1" in reply["message"]
    reply = await _hello(server, {"op": "lookup", "keys": [KEY]})  # no hello first
    assert reply["error"] == "AuthError"
    await server.close()


@pytest.mark.asyncio
async def test_lookups_and_reservations_that_name_runs_carry_their_handle():
    """One round trip per read or write: the handle comes with the lookup or
    reservation, and the commit releases the reservation."""
    from kvrelay.transfer import BlockHandle

    server = await CacheServer(
        CacheServerConfig(token="t", page_bytes=64, arena_bytes=4 * 64, backend="loopback")
    ).start()
    keys = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
    runs = [[16, 32]]
    reserve = {"op": "reserve", "keys": keys, "lease_s": 5, "ns": KEY, "runs": runs}
    reply = server.handle(request(reserve))
    handle = BlockHandle.from_bytes(reply.handle)
    assert [tuple(r) for r in handle.runs] == [(s * 64 + 16, 32) for s in reply.slots]
    commit = {"op": "commit", "keys": keys, "runs": [[0, 64]], "ns": KEY, "release": reply.lease}
    assert server.handle(request(commit)).sealed == [True] * 3
    assert server.tier.index.lease(reply.lease) is None  # released by the commit
    assert not server.agent.leases.get(handle.lease_id)  # and its handle's lease with it
    # A sealed page needs no slot: nothing to publish.
    again = server.handle(request(reserve))
    assert again.slots == [None] * 3 and again.handle is None
    looked = server.handle(request({"op": "lookup", "keys": keys[:2], "ns": KEY, "runs": runs}))
    assert looked.hits == 2
    runs_of = [tuple(r) for r in BlockHandle.from_bytes(looked.handle).runs]
    assert runs_of == [tuple(r) for r in handle.runs[:2]]
    miss = hashlib.sha256(b"miss").digest()
    looked = server.handle(request({"op": "lookup", "keys": [miss], "ns": KEY, "runs": runs}))
    assert looked.hits == 0 and looked.handle is None
    for bad in (
        {"op": "lookup", "keys": keys, "runs": runs},  # a handle needs the namespace
        {"op": "lookup", "keys": keys, "ns": KEY, "runs": [[60, 8]]},  # past the page
        {"op": "reserve", "keys": keys, "ns": KEY, "runs": []},
    ):
        with pytest.raises(MalformedMessage):
            server.handle(request(bad))
    await server.close()
