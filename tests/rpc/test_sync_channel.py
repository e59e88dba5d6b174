"""`SyncChannel`: the blocking twin of `Channel`, driven from a thread of its own
against a real RPC server on the test's loop."""

import asyncio
import time

import pytest

from kvrelay import rpc
from kvrelay.rpc.sync_channel import SyncChannel
from tests.rpc.test_rpc import TOKEN, Echo, Echoed, Welcome, _server


@pytest.mark.asyncio
async def test_calls_and_posts_stay_paired_and_refusals_are_unavailable():
    server = await _server()
    channel = SyncChannel(server.address, TOKEN, Welcome, 5)
    call = asyncio.to_thread
    try:
        assert not await call(channel.post, Echo("early"), Echoed)  # not connected: not sent
        assert (await call(channel.call, Echo("a"), Echoed)).text == "a"
        assert channel.welcome_reply == Welcome("echo")
        assert await call(channel.post, Echo("posted"), Echoed)
        assert await call(channel.post, Echo("fail"), Echoed)  # its Error reply is dropped too
        assert (await call(channel.call, Echo("b"), Echoed)).text == "b"
        assert await call(channel.post, Echo("slow", sleep_s=0.05), Echoed)
        assert (await call(channel.call, Echo("c"), Echoed)).text == "c"
        with pytest.raises(rpc.Unavailable, match="refused"):
            await call(channel.call, Echo("fail"), Echoed)
        assert (await call(channel.call, Echo("d"), Echoed)).text == "d"  # still connected
        # settle: the posted requests' answers read now, so the server handled them.
        assert await call(channel.post, Echo("slow", sleep_s=0.2), Echoed)
        assert await call(channel.post, Echo("fail"), Echoed)
        start = time.monotonic()
        await call(channel.settle)
        assert time.monotonic() - start >= 0.15
        start = time.monotonic()
        await call(channel.settle)  # nothing posted: nothing to wait for
        assert time.monotonic() - start < 0.1
        assert (await call(channel.call, Echo("e"), Echoed)).text == "e"  # still paired
    finally:
        channel.close()
        await server.close()
    await call(channel.settle)  # a closed channel: nothing to read


@pytest.mark.asyncio
async def test_a_deadline_bounds_the_call_and_the_next_call_reconnects():
    server = await _server()
    channel = SyncChannel(server.address, TOKEN, Welcome, 0.3)
    try:
        start = time.monotonic()
        with pytest.raises(rpc.Unavailable):
            await asyncio.to_thread(channel.call, Echo("slow", sleep_s=2), Echoed)
        assert time.monotonic() - start < 1.5
        assert (await asyncio.to_thread(channel.call, Echo("next"), Echoed)).text == "next"
    finally:
        channel.close()
        await server.close()


@pytest.mark.asyncio
async def test_a_restarted_peer_is_reconnected_and_a_wrong_token_refused():
    server = await _server()
    channel = SyncChannel(server.address, TOKEN, Welcome, 5)
    assert (await asyncio.to_thread(channel.call, Echo("first"), Echoed)).text == "first"
    port = int(server.address.rsplit(":", 1)[1])
    await server.close()
    await asyncio.sleep(0.1)  # the close reaches the channel's socket
    again = await _server(port=port)
    try:
        assert (await asyncio.to_thread(channel.call, Echo("second"), Echoed)).text == "second"
        stranger = SyncChannel(again.address, "not-the-token", Welcome, 5)
        with pytest.raises(rpc.Unavailable):
            await asyncio.to_thread(stranger.call, Echo("x"), Echoed)
        checked = SyncChannel(again.address, TOKEN, Welcome, 5, check=lambda w: "wrong service")
        with pytest.raises(rpc.Unavailable, match="wrong service"):
            await asyncio.to_thread(checked.connect)
    finally:
        channel.close()
        await again.close()
