"""Fake prefill and decode workers speaking docs/serving-protocol.md, for the
control endpoint's tests. Their "model" is trivial: the next token is the
previous one plus one (mod the vocabulary), so every answer is predictable.

Framing is written here independently of kvrelay.rpc (4-byte big-endian
length + msgpack map tagged by `op`, token ids packed little-endian uint32),
so the tests also pin the wire format (version 2).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import sys

import httpx
import msgpack

from kvrelay.rpc.framing import FRAME_HEADER

TOKEN = "control-test"
NAMESPACE = bytes(range(32))


def next_token(token: int, vocab: int) -> int:
    return (token + 1) % vocab


def expected_answer(prompt: list[int], max_tokens: int, vocab: int, stop=()) -> list[int]:
    out, prev = [], prompt[-1]
    while len(out) < max_tokens:
        prev = next_token(prev, vocab)
        out.append(prev)
        if prev in stop:
            break
    return out


async def read_frame(reader: asyncio.StreamReader) -> dict:
    (length,) = FRAME_HEADER.unpack(await reader.readexactly(FRAME_HEADER.size))
    return msgpack.unpackb(await reader.readexactly(length), raw=False)


def write_frame(writer: asyncio.StreamWriter, message: dict) -> None:
    body = msgpack.packb(message, use_bin_type=True)
    writer.write(FRAME_HEADER.pack(len(body)) + body)


def unpack(tokens: bytes) -> list[int]:
    ids = array.array("I", tokens)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tolist()


def pack(tokens: list[int]) -> bytes:
    ids = array.array("I", tokens)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tobytes()


def error(name: str, message: str) -> dict:
    return {"op": "error", "error": name, "message": message, "rid": None, "ok": False}


class FakeWorker:
    """One worker: a msgpack listener, registration and heartbeats over real HTTP.

    `mode` decides how the next prefill/decode requests go: ok, busy, fault
    (an error reply), late_fault (one after `delay`), request_error,
    pool_exhausted, garbage (a reply missing its fields), mute (never answers
    the hello), drop (close without a reply), die (close the listener and the
    connection: the process died), slow (sleep `delay` before each reply or
    token batch), drop_after (decode: one batch, then close), pull_failed_once
    (decode: `PullFailed` once, then ok).
    """

    def __init__(self, role: str, control_url: str, *, model="fake", vocab=512, page_size=4,
                 num_pages=64, namespace=NAMESPACE, token=TOKEN, batch=2,
                 model_dir="") -> None:  # fmt: skip
        self.role = role
        self.control_url = control_url
        self.model, self.vocab, self.page_size = model, vocab, page_size
        self.num_pages, self.namespace, self.token = num_pages, namespace, token
        self.batch = batch  # tokens per decode frame
        self.model_dir = model_dir
        self.mode = "ok"
        self.delay = 0.0
        self.queued = 0
        self.heartbeating = True
        self.heartbeats = 0  # answered by control
        self.requests: list[dict] = []  # prefill/decode messages, in arrival order
        self.ops: list[str] = []  # other ops (flush, drain, stats)
        self.cancelled: list[str] = []  # rids whose connection control closed mid-answer
        self.registrations = 0
        self.node_id: str | None = None
        self.heartbeat_s = 0.5
        self.seen_pages: set[tuple[int, ...]] = set()
        self.counters = {"requests": 0, "bytes_from_tier": 0, "bytes_to_tier": 0,
                         "bytes_from_prefill": 0}  # fmt: skip
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self._http: httpx.AsyncClient | None = None

    async def start(self) -> FakeWorker:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        self._http = httpx.AsyncClient(
            base_url=self.control_url, headers={"Authorization": f"Bearer {self.token}"},
            timeout=10,
        )  # fmt: skip
        await self.register()
        self._spawn(self._heartbeats())
        return self

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def register(self) -> None:
        reply = await self._http.post("/v1/nodes", json={
            "role": self.role, "address": self.address, "model": self.model,
            "namespace": self.namespace.hex(), "page_size": self.page_size,
            "vocab_size": self.vocab, "tp": 1, "pp": 1, "num_pages": self.num_pages,
            "cache": False, "model_dir": self.model_dir,
        })  # fmt: skip
        reply.raise_for_status()
        self.node_id = reply.json()["node_id"]
        self.heartbeat_s = reply.json()["heartbeat_s"]
        self.registrations += 1

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            if not self.heartbeating:
                continue
            with contextlib.suppress(httpx.HTTPError):
                reply = await self._http.post(f"/v1/nodes/{self.node_id}/heartbeat", json={
                    "queued": self.queued, "active": 0, "free_pages": self.num_pages,
                    "stats": self.counters,
                })  # fmt: skip
                self.heartbeats += 1
                if reply.status_code == 404:
                    await self.register()

    async def die(self) -> None:
        """The process is gone: no listener, no heartbeats."""
        self.heartbeating = False
        if self._server is not None:
            self._server.close()

    async def stop(self) -> None:
        await self.die()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._http is not None:
            await self._http.aclose()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = await read_frame(reader)
            if self.mode == "mute":  # accepts, never answers: a hung process
                await reader.read(1)
                self.cancelled.append("hello")
                return
            if hello.get("op") != "hello" or hello.get("token") != self.token:
                write_frame(writer, error("AuthError", "bad token"))
                return
            write_frame(writer, {"op": "worker", "role": self.role})
            message = await read_frame(reader)
            op = message.get("op")
            if op in ("prefill", "decode"):
                message["tokens"] = unpack(message["tokens"])
                self.requests.append(message)
                self.counters["requests"] += 1
                if await self._failure(message, reader, writer):
                    return
                if op == "prefill":
                    write_frame(writer, self._prefill(message))
                else:
                    await self._decode(message, reader, writer)
            else:
                self.ops.append(op)
                if op == "drain":
                    self.mode = "busy"
                if op == "flush":
                    self.seen_pages.clear()
                reply = {"op": "ok"}
                if op == "stats":
                    reply = {"op": "stats_reply", "stats": dict(self.counters)}
                write_frame(writer, reply)
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _failure(self, message, reader, writer) -> bool:
        """Acts out `mode`; True when the request ends here."""
        mode = self.mode
        errors = {"busy": "Busy", "fault": "RuntimeError", "request_error": "RequestError",
                  "pool_exhausted": "PoolExhausted"}  # fmt: skip
        if mode in errors:
            write_frame(writer, error(errors[mode], f"fake {mode}"))
            return True
        if mode == "drop":
            return True
        if mode == "pull_failed_once" and message["op"] == "decode":
            self.mode = "ok"  # the next request's handles are fine
            write_frame(writer, error("PullFailed", "fake: the prefill's agent died"))
            return True
        if mode == "garbage":  # a well-framed answer without the fields control needs
            write_frame(writer, {"op": "prefill_reply", "rid": message["rid"], "tokens": "many"})
            return True
        if mode == "die":
            await self.die()
            return True
        if mode == "late_fault":
            await asyncio.sleep(self.delay)
            write_frame(writer, error("RuntimeError", "late"))
            return True
        if (
            mode == "slow"
            and message["op"] == "prefill"
            and await self._wait_or_eof(reader, self.delay)
        ):
            self.cancelled.append(message["rid"])
            return True
        return False

    async def _wait_or_eof(self, reader, seconds: float) -> bool:
        """Sleep; True if control closed the connection meanwhile."""
        try:
            data = await asyncio.wait_for(reader.read(1), seconds)
        except TimeoutError:
            return False
        return data == b""

    def _prefill(self, message: dict) -> dict:
        tokens, params = message["tokens"], message["params"]
        ps = self.page_size
        local = 0
        while local + ps <= len(tokens) and tuple(tokens[: local + ps]) in self.seen_pages:
            local += ps
        for end in range(ps, len(tokens) + 1, ps):
            self.seen_pages.add(tuple(tokens[:end]))
        first = next_token(tokens[-1], self.vocab)
        finish = None
        if first in params["stop_token_ids"]:
            finish = "stop"
        elif params["max_new_tokens"] <= 1:
            finish = "length"
        pages = -(-len(tokens) // ps)
        handles = [] if finish else [{"handle": b"H:" + message["rid"].encode(),
                                      "runs": [[0, 16]]}]  # fmt: skip
        return {"op": "prefill_reply", "rid": message["rid"], "first_token": first,
                "finish_reason": finish, "prompt_tokens": len(tokens),
                "cached_tokens": {"local": local, "tier": 0}, "tier_pages": 0,
                "pages": pages, "spec": {"tp": 1, "pp": 1}, "handles": handles,
                "timings": {"queue_s": 0.0, "lookup_s": 0.0, "compute_s": 0.0,
                            "publish_s": 0.0}}  # fmt: skip

    async def _decode(self, message: dict, reader, writer) -> None:
        params = message["params"]
        assert message["handles"] and message["pages"] >= 1, message
        prev, left = message["first_token"], params["max_new_tokens"] - 1
        finish = "length"
        sent_batches = 0
        stops = set(params["stop_token_ids"])
        while left > 0:
            batch = []
            while left > 0 and len(batch) < self.batch:
                prev = next_token(prev, self.vocab)
                batch.append(prev)
                left -= 1
                if prev in stops:
                    left, finish = 0, "stop"
            if self.mode == "slow" and await self._wait_or_eof(reader, self.delay):
                self.cancelled.append(message["rid"])
                return
            write_frame(writer, {"op": "tokens", "rid": message["rid"], "tokens": pack(batch)})
            await writer.drain()
            sent_batches += 1
            if self.mode == "drop_after":
                return
        write_frame(writer, {"op": "done", "rid": message["rid"],
                             "finish_reason": finish, "written_back_pages": 0,
                             "pulled": {"local_pages": 0, "tier_pages": 0,
                                        "prefill_pages": message["pages"]}})  # fmt: skip
