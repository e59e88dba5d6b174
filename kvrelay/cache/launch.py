"""`kvrelay launch cache`: run one cache server until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal

from kvrelay.cache.server import CacheServer, CacheServerConfig

GIB = 1 << 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arena-gb", type=float, required=True, help="L2 host arena size")
    parser.add_argument(
        "--page-bytes", type=int, required=True, help="bytes of one unified page (a slot)"
    )
    parser.add_argument("--l3", default=None, help="file:DIR or valkey://HOST:PORT")
    parser.add_argument("--l3-gb", type=float, default=None, help="capacity of a file L3")
    parser.add_argument(
        "--l3-policy", default="write-back", choices=["write-back", "write-through"]
    )
    parser.add_argument("--listen", default="127.0.0.1:0", help="control address HOST:PORT")
    parser.add_argument("--backend", default="tcp", choices=["tcp", "ucx"])
    parser.add_argument("--timeout-s", type=float, default=10.0,
                        help="hello deadline, frame stall limit, transfer deadline")  # fmt: skip
    parser.add_argument(
        "--token", default=os.environ.get("KVRELAY_TOKEN"), help="cluster token ($KVRELAY_TOKEN)"
    )


def run(args: argparse.Namespace) -> None:
    if not args.token:
        raise SystemExit("kvrelay launch cache: give --token or set KVRELAY_TOKEN")
    host, port = args.listen.rsplit(":", 1)
    config = CacheServerConfig(
        token=args.token,
        page_bytes=args.page_bytes,
        arena_bytes=int(args.arena_gb * GIB),
        host=host,
        port=int(port),
        backend=args.backend,
        l3=args.l3,
        l3_capacity_bytes=None if args.l3_gb is None else int(args.l3_gb * GIB),
        l3_policy=args.l3_policy,
        timeout_s=args.timeout_s,
    )
    asyncio.run(_serve(config))


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
