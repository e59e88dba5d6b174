"""`kvrelay launch control`: the control endpoint under uvicorn until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket

from kvrelay.control.app import ControlConfig, create_app


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default="127.0.0.1:8000", help="HTTP address HOST:PORT")
    parser.add_argument(
        "--token", default=os.environ.get("KVRELAY_TOKEN"), help="cluster token ($KVRELAY_TOKEN)"
    )
    parser.add_argument("--cache", default="", help="cache servers H:P[,H:P...] to probe")
    parser.add_argument("--heartbeat-s", type=float, default=1.0,
                        help="workers' heartbeat period; 3 missed take a node out")  # fmt: skip
    parser.add_argument("--request-timeout-s", type=float, default=300.0,
                        help="a request's whole budget, retries included")  # fmt: skip
    parser.add_argument("--attempt-timeout-s", type=float, default=60.0,
                        help="wait for a prefill reply or decode's first frame before "
                             "trying another worker")  # fmt: skip
    parser.add_argument("--lease-s", type=float, default=30.0,
                        help="how long prefill keeps a request's pages for decode")  # fmt: skip
    parser.add_argument("--max-retries", type=int, default=2,
                        help="attempts repeated after worker faults, per request")  # fmt: skip
    parser.add_argument("--log-level", default="warning", help="uvicorn log level")


def config_from_args(args: argparse.Namespace) -> ControlConfig:
    if not args.token:
        raise SystemExit("kvrelay launch control: give --token or set KVRELAY_TOKEN")
    for name in ("heartbeat_s", "request_timeout_s", "attempt_timeout_s", "lease_s"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"kvrelay launch control: --{name.replace('_', '-')} must be > 0")
    if args.max_retries < 0:
        raise SystemExit("kvrelay launch control: --max-retries must be >= 0")
    cache = tuple(a.strip() for a in args.cache.split(",") if a.strip())
    return ControlConfig(
        token=args.token, cache=cache, heartbeat_s=args.heartbeat_s,
        request_timeout_s=args.request_timeout_s, attempt_timeout_s=args.attempt_timeout_s,
        lease_s=args.lease_s,
        max_retries=args.max_retries,
    )  # fmt: skip


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
    sock = bind(args.listen)
    host, port = sock.getsockname()[:2]
    server = Server(
        uvicorn.Config(
            create_app(config), log_level=args.log_level, lifespan="on", timeout_graceful_shutdown=5
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
