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
