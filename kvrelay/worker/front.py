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
from pathlib import Path

from kvrelay import rpc
from kvrelay.model.errors import RequestError
from kvrelay.model.loader import load_config
from kvrelay.model.parallel import ParallelEngine
from kvrelay.rpc.worker_ops import (
    Decode,
    Drain,
    FlushPool,
    Prefill,
    Role,
    StatsReply,
    WorkerRequest,
    WorkerStats,
    WorkerWelcome,
)
from kvrelay.worker import rank_ops
from kvrelay.worker.config import WorkerConfig
from kvrelay.worker.protocol import WorkerCounters
from kvrelay.worker.registration import Registrar

log = logging.getLogger("kvrelay.worker")


class WorkerFront:
    role: Role
    request_type: type[Prefill | Decode]

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
        self._server: rpc.Server | None = None
        self._inflight = 0
        self._last_status: dict | None = None

    # -- lifecycle -------------------------------------------------------------
    async def start(self) -> WorkerFront:
        c = self.config
        # Started from the main thread: the ranks ask to die with this thread.
        self.engine = ParallelEngine(
            c.model_dir,
            tp=c.tp,
            pp=c.pp,
            cp=c.cp,
            dtype=c.dtype,
            page_size=c.page_size,
            num_pages=c.num_pages,
            device=c.device,
            speculative=c.speculative,
            key_scheme=c.key_scheme,
            batch_invariant_attention=c.batch_invariant_attention,
            max_prefill_tokens=c.max_prefill_tokens,
            timeout_s=c.rank_timeout_s,
            attention_chunk_tokens=c.attention_chunk_tokens,
            rank_setup=functools.partial(self._rank_setup, c.rank_options()),
        )
        self.spec = self.engine.spec
        self.vocab = load_config(c.model_dir).vocab_size
        self._lock = asyncio.Lock()
        host, port = rpc.split_address(c.listen)
        self._server = rpc.Server(
            token=c.token,
            requests=WorkerRequest,
            handler=self._handle,
            welcome=lambda: WorkerWelcome(self.role),
            host=host,
            port=port,
            hello_timeout_s=c.hello_timeout_s,
        )
        await self._server.start()
        self.address = self._server.address
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
            "key_scheme": self.spec.key_scheme,
            "page_size": c.page_size,
            "vocab_size": self.vocab,
            "tp": c.tp,
            "pp": c.pp,
            "cp": c.cp,
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
        if self._server is not None:
            await self._server.stop_accepting()
        if self.registrar is not None:
            await self.registrar.deregister()
        loop = asyncio.get_running_loop()
        end = loop.time() + self.config.drain_timeout_s
        while self._inflight and loop.time() < end:
            await asyncio.sleep(0.05)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.close()
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
    async def ranks(self, message: rank_ops.RankMessage) -> list:
        """Runs a command on every rank (one command at a time); their
        replies, in rank order, each validated as the command's reply type."""
        payload = rank_ops.encode(message)
        async with self._lock:
            replies = await asyncio.to_thread(self.engine.ask, payload)
        return [rank_ops.decode_reply(message, reply) for reply in replies]

    async def status(self, fresh: bool = True) -> dict:
        if not fresh and self._lock.locked() and self._last_status is not None:
            # The ranks are busy (a long batch): a heartbeat must not wait for them.
            return self._last_status | {"queued": self.queued(), "active": self.active()}
        counters = await self.ranks(rank_ops.Counters())
        self._last_status = {
            "queued": self.queued(),
            "active": self.active(),
            "free_pages": min(c.free_pages for c in counters),
            "staging_free": min(c.staging_free for c in counters),
            "bytes_from_tier": sum(c.bytes_from_tier for c in counters),
            "bytes_to_tier": sum(c.bytes_to_tier for c in counters),
            "writeback_skipped_pages": max(c.writeback_skipped_pages for c in counters),
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

    # -- requests ------------------------------------------------------------------------
    async def _handle(self, conn: rpc.Connection, request) -> rpc.Message | None:
        if isinstance(request, WorkerStats):
            return StatsReply(self._stats(await self.status()))
        if isinstance(request, FlushPool):
            await self.ranks(rank_ops.ClearCache())
            return rpc.Ok()
        if isinstance(request, Drain):
            self.draining = True
            return rpc.Ok()
        if not isinstance(request, self.request_type):
            raise RequestError(f"a {self.role} worker does not serve {type(request).__name__}")
        self._inflight += 1
        try:
            await self.handle(conn, request)
        finally:
            self._inflight -= 1
        return None

    # -- the role ------------------------------------------------------------------------
    async def handle(self, conn: rpc.Connection, request) -> None:
        """Answers one request of the role on `conn` (a RequestError raised
        here is sent as the error reply)."""
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
