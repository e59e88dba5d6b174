"""A TCP relay between one worker and control, for the fault "heartbeats
stop while the process lives": each chaos worker is given its own gate's
address as `--control`, so only its registration and heartbeats pass here
(control reaches the worker directly, and clients talk to control
directly). `close()` drops the relay's connections and refuses new ones
until `open()`: the worker stays alive and keeps serving what reaches it,
but control hears nothing from it."""

from __future__ import annotations

import asyncio
import contextlib
import threading


class Gate:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = 0
        self.closed = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Gate:
        self._thread.start()
        self._server = self._call(asyncio.start_server(self._relay, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def _call(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def close(self) -> None:
        """Heartbeats stop: every relayed connection dropped, new ones refused."""

        async def drop() -> None:
            self.closed = True
            for writer in list(self._writers):
                writer.close()

        self._call(drop())

    def open(self) -> None:
        async def reopen() -> None:
            self.closed = False

        self._call(reopen())

    def stop(self) -> None:
        async def shut() -> None:
            self._server.close()
            for writer in list(self._writers):
                writer.close()

        with contextlib.suppress(Exception):
            self._call(shut())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.closed:
            writer.close()
            return
        try:
            connecting = asyncio.open_connection(*self.upstream)
            up_reader, up_writer = await asyncio.wait_for(connecting, 5)
        except (OSError, TimeoutError):
            writer.close()
            return
        self._writers |= {writer, up_writer}
        try:
            await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
        finally:
            self._writers -= {writer, up_writer}
            writer.close()
            up_writer.close()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (OSError, RuntimeError):
        pass
    finally:
        writer.close()
