"""`kvrelay launch cache`: run one cache server until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal

from kvrelay import options
from kvrelay.cache.server import CacheServer, CacheServerConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_arguments(parser, CacheServerConfig)


def run(args: argparse.Namespace) -> None:
    asyncio.run(_serve(options.from_args(CacheServerConfig, args)))


async def _serve(config: CacheServerConfig) -> None:
    server = await CacheServer(config).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # One JSON line tells whoever started the server where it listens.
    print(json.dumps({"listen": server.address, "agent": server.agent.address}), flush=True)
    try:
        await stop.wait()
    finally:
        await server.close()
