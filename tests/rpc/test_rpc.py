"""The RPC layer on its own: the hello (token, wire version both ways),
typed error replies, malformed and oversized frames, deadlines."""

import asyncio
import struct

import msgpack
import pytest

from kvrelay import rpc
from kvrelay.rpc.framing import MAX_FRAME

TOKEN = "rpc-test"


class Echo(rpc.Message, tag="echo"):
    text: str
    sleep_s: float = 0.0


class Echoed(rpc.Message, tag="echoed"):
    text: str


class Welcome(rpc.Message, tag="test_welcome"):
    name: str


async def _handler(conn, request: Echo):
    if request.text == "fail":
        raise ValueError("asked to fail")
    await asyncio.sleep(request.sleep_s)
    return Echoed(request.text)


async def _server(**kwargs) -> rpc.Server:
    server = rpc.Server(token=TOKEN, requests=Echo, handler=_handler,
                        welcome=lambda: Welcome("echo"), **kwargs)  # fmt: skip
    return await server.start()


@pytest.mark.asyncio
async def test_calls_errors_and_a_malformed_request_keep_the_connection():
    server = await _server()
    conn, welcome = await rpc.connect(server.address, TOKEN, Welcome, 5)
    assert welcome.name == "echo"
    assert (await rpc.call(conn, Echo("hi"), Echoed, 5)).text == "hi"
    with pytest.raises(rpc.RemoteError) as refused:
        await rpc.call(conn, Echo("fail"), Echoed, 5)
    assert refused.value.error == "ValueError" and "asked to fail" in str(refused.value)
    await conn.send({"op": "echo", "text": 3})  # mistyped: answered, not dropped
    reply = await conn.recv()
    assert reply["op"] == "error" and reply["error"] == "MalformedMessage"
    assert "text" in reply["message"]
    assert (await rpc.call(conn, Echo("again"), Echoed, 5)).text == "again"
    with pytest.raises(rpc.RpcTimeout):
        await rpc.call(conn, Echo("slow", sleep_s=5), Echoed, 0.2)
    conn.close()
    await server.close()


@pytest.mark.asyncio
async def test_bad_token_and_no_hello_are_refused():
    server = await _server()
    with pytest.raises(rpc.AuthError):
        await rpc.connect(server.address, "wrong", Welcome, 5)
    conn = await rpc.Connection.open(*rpc.split_address(server.address))
    await conn.send(Echo("skip the hello"))
    assert (await conn.recv())["error"] == "AuthError"
    with pytest.raises(rpc.PeerError):  # and the server closed it
        await conn.recv()
    conn.close()
    await server.close()


@pytest.mark.asyncio
async def test_a_peer_of_the_old_wire_version_gets_a_clear_refusal():
    server = await _server()
    # A version-1 client: its hello, its way of reading the reply.
    conn = await rpc.Connection.open(*rpc.split_address(server.address))
    await conn.send({"op": "hello", "v": 1, "token": TOKEN})
    reply = await conn.recv()
    assert reply["ok"] is False and reply["error"] == "WireVersionError"
    assert reply["message"] == (
        f"this peer speaks wire version {rpc.WIRE_VERSION}, the hello says 1"
    )
    conn.close()
    await server.close()


@pytest.mark.asyncio
async def test_a_server_of_the_old_wire_version_is_named_as_such():
    """A version-1 server answers a hello it does not accept with an untagged map."""

    async def old_server(reader, writer):
        (length,) = struct.unpack(">I", await reader.readexactly(4))
        await reader.readexactly(length)
        body = msgpack.packb({"ok": False, "error": "ProtocolError", "message": "version"})
        writer.write(struct.pack(">I", len(body)) + body)
        await writer.drain()
        writer.close()

    listener = await asyncio.start_server(old_server, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    with pytest.raises(rpc.WireVersionError, match="another wire format"):
        await rpc.connect(f"127.0.0.1:{port}", TOKEN, Welcome, 5)
    listener.close()


@pytest.mark.asyncio
async def test_oversized_and_garbage_frames_are_refused_and_dropped():
    server = await _server()
    for raw in (struct.pack(">I", MAX_FRAME + 1), struct.pack(">I", 3) + b"\xc1\xc1\xc1"):
        conn, _ = await rpc.connect(server.address, TOKEN, Welcome, 5)
        await conn.send_bytes(raw)
        refusal = await asyncio.wait_for(conn.recv(), 5)  # why, then the close
        assert refusal["op"] == "error" and refusal["error"] == "ProtocolError"
        with pytest.raises(rpc.PeerError):
            await asyncio.wait_for(conn.recv(), 5)
        conn.close()
    with pytest.raises(rpc.ProtocolError):  # nor does a sender build one
        await conn.send(Echo("x" * (MAX_FRAME + 1)))
    await server.close()


@pytest.mark.asyncio
async def test_a_silent_peer_is_a_timeout_not_a_hang():
    async def silent(reader, writer):
        await reader.read()  # accepts, never answers
        writer.close()

    listener = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    with pytest.raises(rpc.RpcTimeout):
        await rpc.connect(f"127.0.0.1:{port}", TOKEN, Welcome, 0.3)
    listener.close()
    server = await _server(hello_timeout_s=0.3)
    conn = await rpc.Connection.open(*rpc.split_address(server.address))
    with pytest.raises(rpc.PeerError):  # the server gave up on our hello
        await asyncio.wait_for(conn.recv(), 10)
    conn.close()
    await server.close()


def test_tokens_travel_packed():
    ids = [0, 1, 2**31, 2**32 - 1]
    assert rpc.unpack_tokens(rpc.pack_tokens(ids)) == ids
    assert len(rpc.pack_tokens(ids)) == 16
    with pytest.raises(ValueError):
        rpc.pack_tokens([2**32])
    with pytest.raises(ValueError):
        rpc.unpack_tokens(b"\x00" * 5)


@pytest.mark.asyncio
async def test_a_channel_reconnects_to_a_restarted_peer_without_failing_a_call():
    """A peer restarted on its address (a cache server after a kill): the
    channel's old connection is closed by the peer, and the next call opens a
    new one instead of failing on the dead one (which cost every cache client
    a miss per server restart)."""
    server = await _server()
    channel = rpc.Channel(server.address, TOKEN, Welcome, 5)
    assert (await channel.call(Echo("first"), Echoed)).text == "first"
    port = int(server.address.rsplit(":", 1)[1])
    await server.close()
    await asyncio.sleep(0.1)  # the close reaches the channel's socket
    again = await _server(port=port)
    assert (await channel.call(Echo("second"), Echoed)).text == "second"
    channel.drop()
    await again.close()


@pytest.mark.asyncio
async def test_a_posted_request_costs_no_round_trip_and_keeps_replies_paired():
    """`Channel.post` sends and returns; the next call reads (and drops) the
    posted request's reply before its own, so each call gets its own answer."""
    server = await _server()
    channel = rpc.Channel(server.address, TOKEN, Welcome, 5)
    try:
        assert not await channel.post(Echo("early"), Echoed)  # not connected: not sent
        assert (await channel.call(Echo("a"), Echoed)).text == "a"
        assert await channel.post(Echo("posted"), Echoed)
        assert await channel.post(Echo("fail"), Echoed)  # its Error reply is dropped too
        assert (await channel.call(Echo("b"), Echoed)).text == "b"
        assert await channel.post(Echo("slow", sleep_s=0.05), Echoed)
        assert (await channel.call(Echo("c"), Echoed)).text == "c"
        assert await channel.post(Echo("lost"), Echoed)
        channel.drop()  # the posted reply goes with the connection
        assert (await channel.call(Echo("d"), Echoed)).text == "d"
    finally:
        channel.drop()
        await server.close()
