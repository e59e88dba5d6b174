"""`kvrelay launch control`: the control endpoint under uvicorn until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import socket

from kvrelay import options
from kvrelay.control.app import create_app
from kvrelay.control.config import ControlConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_arguments(parser, ControlConfig)


def config_from_args(args: argparse.Namespace) -> ControlConfig:
    return options.from_args(ControlConfig, args)


def bind(listen: str) -> socket.socket:
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"kvrelay launch control: --listen must be HOST:PORT, got {listen!r}")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, int(port)))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"kvrelay launch control: cannot listen on {listen}: {exc}") from None
    sock.listen(512)
    return sock


def run(args: argparse.Namespace) -> None:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises a captured SIGTERM after its graceful shutdown,
        so the process would die of the signal; here the signal only asks
        for that shutdown and the process exits 0."""

        @contextlib.contextmanager
        def capture_signals(self):
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._stop)
            try:
                yield
            finally:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)

        def _stop(self) -> None:
            self.force_exit = self.should_exit  # a second signal: stop waiting
            self.should_exit = True

    config = config_from_args(args)
    sock = bind(config.listen)
    host, port = sock.getsockname()[:2]
    server = Server(
        uvicorn.Config(
            create_app(config),
            log_level=config.log_level,
            lifespan="on",
            timeout_graceful_shutdown=5,
        )
    )

    async def serve() -> None:
        # The JSON line goes out once uvicorn accepts connections.
        async def announce() -> None:
            while not server.started:
                if server.should_exit:
                    return
                await asyncio.sleep(0.02)
            print(json.dumps({"listen": f"{host}:{port}"}), flush=True)

        announcer = asyncio.create_task(announce())
        try:
            await server.serve(sockets=[sock])
        finally:
            announcer.cancel()

    asyncio.run(serve())
    if not server.started:
        raise SystemExit("kvrelay launch control: the server did not start")
