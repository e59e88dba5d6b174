"""A worker's front process: the msgpack listener control talks to, the
registration with control, and the one path to the rank processes.

The ranks (`ParallelEngine`, one spawned process per rank) run one command
at a time, all of them the same command; the front serialises its calls
with a lock and runs each in a thread, so the asyncio loop keeps serving
connections and heartbeats while the ranks compute.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import socket
from dataclasses import dataclass
from pathlib import Path
from reprlib import repr as brief

from kvrelay.model.config import ModelConfig
from kvrelay.model.errors import RequestError
from kvrelay.model.parallel import ParallelEngine
from kvrelay.transfer import ProtocolError, TransferError
from kvrelay.transfer.wire import (
    MAX_HELLO_FRAME,
    WIRE_VERSION,
    Connection,
    listen_socket,
    refuse,
    token_ok,
)
from kvrelay.worker.protocol import WorkerCounters, error_reply
from kvrelay.worker.rank import RankOptions
from kvrelay.worker.registration import Registrar

log = logging.getLogger("kvrelay.worker")


@dataclass(slots=True)
class WorkerConfig:
    model_dir: str
    token: str
    tp: int = 1
    pp: int = 1
    control: str = ""  # control's base URL; "" runs unregistered
    cache: tuple[str, ...] = ()
    backend: str = "tcp"
    listen: str = "127.0.0.1:0"
    num_pages: int = 256
    page_size: int = 64
    dtype: str = "float32"
    device: str = "cpu"  # the first rank's; see kvrelay.model.device
    staging: str = "device"  # GPU pools: "device" (GPU memory) or "pinned" (host)
    local_cache: bool = True
    max_batch: int = 8
    max_queue: int = 64
    write_back: bool = False
    staging_pages: int = 0  # 0: as many as the pool has pages
    transfer_timeout_s: float = 10.0
    hello_timeout_s: float = 10.0
    drain_timeout_s: float = 30.0

    def rank_options(self) -> RankOptions:
        return RankOptions(
            token=self.token,
            backend=self.backend,
            cache=tuple(self.cache),
            staging_pages=self.staging_pages or self.num_pages,
            staging=self.staging,
            transfer_timeout_s=self.transfer_timeout_s,
            local_cache=self.local_cache,
            write_back=self.write_back,
        )


class WorkerFront:
    role = ""

    def __init__(self, config: WorkerConfig, rank_setup) -> None:
        self.config = config
        self._rank_setup = rank_setup
        self.counters = WorkerCounters()
        self.draining = False
        self.engine: ParallelEngine | None = None
        self.registrar: Registrar | None = None
        self.address = ""
        self._lock: asyncio.Lock | None = None
        self._tasks: set[asyncio.Task] = set()
        self._listener: socket.socket | None = None
        self._inflight = 0
        self._last_status: dict | None = None
        self._accept_task: asyncio.Task | None = None

    # -- lifecycle -------------------------------------------------------------
    async def start(self) -> WorkerFront:
        c = self.config
        # Started from the main thread: the ranks ask to die with this thread.
        self.engine = ParallelEngine(
            c.model_dir,
            tp=c.tp,
            pp=c.pp,
            dtype=c.dtype,
            page_size=c.page_size,
            num_pages=c.num_pages,
            device=c.device,
            rank_setup=functools.partial(self._rank_setup, c.rank_options()),
        )
        self.spec = self.engine.spec
        self.vocab = ModelConfig.from_dir(c.model_dir).vocab_size
        self._lock = asyncio.Lock()
        host, port = c.listen.rsplit(":", 1)
        self._listener, self.address = listen_socket(host, int(port), backlog=128)
        self._accept_task = self._spawn(self._accept_loop())
        self._spawn(self.scheduler())
        if c.control:
            self.registrar = Registrar(c.control, c.token, self.registration(), self.heartbeat)
            await self.registrar.register()
            self._spawn(self.registrar.heartbeats())
        return self

    def registration(self) -> dict:
        c = self.config
        return {
            "role": self.role,
            "address": self.address,
            "model": self.spec.model_id,
            "namespace": self.spec.namespace().hex(),
            "page_size": c.page_size,
            "vocab_size": self.vocab,
            "tp": c.tp,
            "pp": c.pp,
            "num_pages": c.num_pages,
            "cache": bool(c.cache),
            "model_dir": str(Path(c.model_dir).resolve()),  # control reads the tokenizer
        }

    def ready_line(self) -> str:
        node_id = self.registrar.node_id if self.registrar else None
        return json.dumps({"role": self.role, "address": self.address, "node_id": node_id})

    async def stop(self) -> None:
        """Deregister, refuse new requests, let in-flight ones finish (or fail
        them at the drain deadline), stop the ranks."""
        self.draining = True
        if self._listener is not None and self._accept_task is not None:
            # Stop accepting first: closing a socket the loop still watches
            # would hand its fd number, still registered, to the next socket.
            self._accept_task.cancel()
            await asyncio.gather(self._accept_task, return_exceptions=True)
            self._listener.close()
        if self.registrar is not None:
            await self.registrar.deregister()
        loop = asyncio.get_running_loop()
        end = loop.time() + self.config.drain_timeout_s
        while self._inflight and loop.time() < end:
            await asyncio.sleep(0.05)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.registrar is not None:
            await self.registrar.close()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.close)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- the ranks -------------------------------------------------------------------
    async def ranks(self, name: str, *args) -> list:
        """Runs a command on every rank (one at a time); their answers."""
        async with self._lock:
            return await asyncio.to_thread(self.engine.call, name, *args)

    async def status(self, fresh: bool = True) -> dict:
        if not fresh and self._lock.locked() and self._last_status is not None:
            # The ranks are busy (a long batch): a heartbeat must not wait for them.
            return self._last_status | {"queued": self.queued(), "active": self.active()}
        counters = await self.ranks("counters")
        self._last_status = {
            "queued": self.queued(),
            "active": self.active(),
            "free_pages": min(c["free_pages"] for c in counters),
            "staging_free": min(c["staging_free"] for c in counters),
            "bytes_from_tier": sum(c["bytes_from_tier"] for c in counters),
            "bytes_to_tier": sum(c["bytes_to_tier"] for c in counters),
            "writeback_skipped_pages": max(c.get("writeback_skipped_pages", 0) for c in counters),
        }
        return self._last_status

    async def heartbeat(self) -> dict:
        s = await self.status(fresh=False)
        stats = self._stats(s)
        return {k: s[k] for k in ("queued", "active", "free_pages")} | {"stats": stats}

    def _stats(self, status: dict) -> dict:
        self.counters.bytes_from_tier = status["bytes_from_tier"]
        self.counters.bytes_to_tier = status["bytes_to_tier"]
        self.counters.writeback_skipped_pages = status["writeback_skipped_pages"]
        return self.counters.as_dict() | {
            k: status[k] for k in ("queued", "active", "free_pages", "staging_free")
        }

    # -- connections -------------------------------------------------------------------
    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(self._listener)
            self._spawn(self._serve(Connection(sock)))

    async def _serve(self, conn: Connection) -> None:
        try:
            async with asyncio.timeout(self.config.hello_timeout_s):
                hello = await conn.recv(MAX_HELLO_FRAME)
                ok = hello.get("op") == "hello" and token_ok(hello.get("token"), self.config.token)
                if not ok or hello.get("v") != WIRE_VERSION:
                    await conn.send({"ok": False, "error": "AuthError", "message": "bad hello"})
                    return
                await conn.send({"ok": True, "role": self.role})
                message = await conn.recv()
            await self._dispatch(conn, message)
        except ProtocolError as exc:
            await refuse(conn, exc)
        except (TransferError, TimeoutError, OSError):
            pass  # control went away or spoke garbage
        finally:
            conn.close()

    async def _dispatch(self, conn: Connection, message: dict) -> None:
        op = message.get("op")
        if op == "stats":
            await conn.send({"ok": True, "stats": self._stats(await self.status())})
        elif op == "flush":
            await self.ranks("clear_cache")
            await conn.send({"ok": True})
        elif op == "drain":
            self.draining = True
            await conn.send({"ok": True})
        elif op == self.role:
            self._inflight += 1
            try:
                await self.handle(conn, message)
            except RequestError as exc:
                await conn.send(error_reply(exc, message.get("rid")))
            finally:
                self._inflight -= 1
        else:
            await conn.send(error_reply(RequestError(f"unknown op {brief(op)} for a {self.role}")))

    # -- the role ------------------------------------------------------------------------
    async def handle(self, conn: Connection, message: dict) -> None:
        raise NotImplementedError

    async def scheduler(self) -> None:
        raise NotImplementedError

    def queued(self) -> int:
        return 0

    def active(self) -> int:
        return 0


async def serve_until_signal(front: WorkerFront) -> None:
    """Start, print the ready line, run until SIGTERM/SIGINT, stop cleanly."""
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await front.start()
        print(front.ready_line(), flush=True)
        await stop.wait()
    finally:
        with contextlib.suppress(Exception):
            await front.stop()
