"""CacheServer's request checks, in process (loopback agent), and the token over tcp."""

import asyncio
import hashlib

import pytest

from kvrelay.cache.server import CacheServer, CacheServerConfig, ProtocolViolation
from kvrelay.transfer.wire import WIRE_VERSION, Connection

KEY = hashlib.sha256(b"k").digest()


def test_malformed_requests_are_refused():
    async def main():
        server = await CacheServer(
            CacheServerConfig(token="t", page_bytes=64, arena_bytes=4 * 64, backend="loopback")
        ).start()
        bad = [
            {"op": "nope"},
            {"op": "lookup", "keys": [b"short"]},
            {"op": "lookup", "keys": "abc"},
            {"op": "lookup", "keys": [KEY], "lease_s": 0},
            {"op": "lookup", "keys": [KEY], "lease_s": 10_000},
            {"op": "commit", "keys": [KEY], "runs": [[60, 8]]},
            {"op": "commit", "keys": [KEY], "runs": []},
            {"op": "handle", "lease": 12345, "count": 1, "runs": [[0, 64]], "ns": KEY},
            {"op": "reserve", "keys": [KEY], "ns": "not bytes"},
        ]
        for message in bad:
            with pytest.raises(ProtocolViolation):
                server.handle(message)
        reply = server.handle({"op": "reserve", "keys": [KEY], "lease_s": 5})
        lease = reply["lease"]
        assert reply["slots"] == [0]
        for count in (0, 2):
            with pytest.raises(ProtocolViolation):
                server.handle({"op": "handle", "lease": lease, "count": count,
                               "runs": [[0, 64]], "ns": KEY})  # fmt: skip
        assert server.handle({"op": "commit", "keys": [KEY], "runs": [[0, 64]]})["sealed"] == [True]
        assert server.handle({"op": "release", "lease": lease})["released"]
        looked = server.handle({"op": "lookup", "keys": [KEY]})
        assert looked["hits"] == 1
        assert server.handle({"op": "stats"})["tier"]["sealed_pages"] == 1
        with pytest.raises(ProtocolViolation):
            server.handle({"op": "flush", "ns": b"short"})
        assert server.handle({"op": "flush", "ns": hashlib.sha256(b"x").digest()})["dropped"] == 0
        assert server.handle({"op": "flush"})["dropped"] == 0  # pinned by the lookup
        server.handle({"op": "release", "lease": looked["lease"]})
        assert server.handle({"op": "flush"})["dropped"] == 1
        await server.close()

    asyncio.run(main())


def test_wrong_token_is_refused_over_tcp():
    async def main():
        server = await CacheServer(
            CacheServerConfig(token="t", page_bytes=64, arena_bytes=4 * 64)
        ).start()
        host, port = server.address.rsplit(":", 1)
        conn = await Connection.open(host, int(port))
        await conn.send({"op": "hello", "v": WIRE_VERSION, "token": "wrong"})
        reply = await asyncio.wait_for(conn.recv(), 5)
        assert not reply["ok"] and reply["error"] == "AuthError"
        conn.close()
        await server.close()

    asyncio.run(main())
