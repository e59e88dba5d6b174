"""SIGKILLs timed to a moment of a request, each observed before it strikes.

How precise each is (the moment is observed, then the kill follows at once;
a moment not seen within `MOMENT_S` is struck anyway and not counted as
`at_moment`):

- `kill_prefill_computing`: control has a request open on the prefill and
  one of its rank processes is on a CPU (/proc state R); the kill follows
  within one /proc read (a rank also runs briefly for a heartbeat's
  counters: that ambiguity is the margin).
- `kill_prefill_queued`: the same moment, then the ranks are frozen
  (SIGSTOP) mid-batch and the front is sent one more request (frame level);
  once the front has read it (nothing unread on the socket) and not
  answered, it can only be in the front's queue: then the kill (exact).
- `kill_decode_mid_pull`: driven at the frame level: a prefill answers with
  handles and is frozen; the decode is sent the handles and killed once
  its pull request sits unread in the prefill's socket (exact).
- `kill_decode_mid_generation`: the same, the prefill not frozen; killed
  after its second streamed token frame, before its last (exact).
- `kill_cache_mid_lookup` / `kill_cache_mid_write`: the cache server is
  frozen; it is killed once a prefill's (or control's) request sits unread
  in its listener (a lookup, or the handle/release of its hit), or once a
  decode's request or bytes sit unread in its listener or agent (its
  write-back's reserve, page bytes or commit; a decode also looks the tier
  up, but only for pages prefill found there, rare with each round's fresh
  prompts). Exact as to the client and the server, not the op; the freeze
  lasts at most `MOMENT_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time

import httpx

from kvrelay.chaos import frames
from kvrelay.chaos.cluster import ChaosCluster
from kvrelay.chaos.procs import group_pids, rank_pids, running, unread_bytes
from kvrelay.chaos.targets import WORKER_PARAMS
from kvrelay.demo.cluster import Process

POLL_S = 0.01
MOMENT_S = 6.0  # how long a fault waits for its moment before it strikes anyway

TIMED = ("kill_prefill_computing", "kill_prefill_queued", "kill_decode_mid_pull",
         "kill_decode_mid_generation", "kill_cache_mid_lookup", "kill_cache_mid_write")  # fmt: skip


def signal_group(process: Process, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.popen.pid, sig)


def signal_pids(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


async def until(predicate, timeout_s: float = MOMENT_S) -> bool:
    """Polls `predicate` (sync or async) until true (True) or the deadline (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return True
        await asyncio.sleep(POLL_S)
    return False


def params(max_new: int) -> dict:
    """Greedy sampling params of a frame-level request (the fuzzers' valid ones)."""
    return dict(WORKER_PARAMS, max_new_tokens=max_new)


class Moments:
    """The timed kills on one cluster; `strike(name)` -> (victim, at_moment)."""

    def __init__(self, cluster: ChaosCluster, rng: random.Random) -> None:
        self.cluster, self.rng = cluster, rng
        self._client = httpx.AsyncClient(base_url=cluster.control_url, timeout=5)
        self._stream: asyncio.Task | None = None

    async def strike(self, name: str) -> tuple[Process, bool]:
        if name.startswith("kill_prefill"):
            return await self._prefill(queued=name.endswith("queued"))
        if name.startswith("kill_decode"):
            return await self._decode(mid_pull=name.endswith("pull"))
        return await self._cache(write=name.endswith("write"))

    async def settle(self) -> None:
        """Waits for the frame-level request of the last strike (bounded)."""
        stream, self._stream = self._stream, None
        if stream is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(stream, 40)

    async def close(self) -> None:
        await self.settle()
        await self._client.aclose()

    async def _inflight(self, process: Process) -> int:
        """Requests control has open on the worker (found by address: a worker
        that missed heartbeats registered again under a new node id)."""
        try:
            nodes = (await self._client.get("/stats")).json()["nodes"]
        except (httpx.HTTPError, ValueError, KeyError):
            return 0
        address = process.ready["address"]
        return sum(n.get("inflight", 0) for n in nodes if n.get("address") == address)

    async def _prefill(self, queued: bool) -> tuple[Process, bool]:
        victim = self.rng.choice(self.cluster.ready("prefill"))
        ranks = rank_pids(victim.popen.pid)

        async def computing() -> bool:
            return await self._inflight(victim) > 0 and any(running(r) for r in ranks)

        at = await until(computing)
        if queued and at:
            signal_pids(ranks, signal.SIGSTOP)  # mid-batch: an arrival now queues
            at = await self._queue_one(victim)
        signal_group(victim, signal.SIGKILL)
        return victim, at

    async def _queue_one(self, victim: Process) -> bool:
        """Sends the frozen prefill one more request; True once its front has
        read it (nothing unread on our socket) and not answered: it is queued."""
        page = self.cluster.config.page_size
        prompt = [self.rng.randrange(1, 256) for _ in range(2 * page)]
        request = {"op": "prefill", "rid": "queued", "tokens": frames.tokens(prompt),
                   "params": params(4), "lease_s": 5.0}  # fmt: skip
        token = self.cluster.config.token
        self._stream = asyncio.create_task(
            frames.call(victim.ready["address"], request, token, timeout=20))  # fmt: skip
        await asyncio.sleep(0.3)
        unread = unread_bytes(group_pids(victim.popen.pid), [os.getpid()])
        return not self._stream.done() and unread == 0

    async def _published(self, prefill: Process, max_new: int) -> tuple[list[int], dict | None]:
        page = self.cluster.config.page_size
        prompt = [self.rng.randrange(1, 256) for _ in range(3 * page + 5)]
        request = {"op": "prefill", "rid": "chaos", "tokens": frames.tokens(prompt),
                   "params": params(max_new), "lease_s": 5.0}  # fmt: skip
        try:
            answer = await frames.call(prefill.ready["address"], request,
                                       self.cluster.config.token, timeout=20)  # fmt: skip
        except (OSError, TimeoutError):
            return prompt, None
        ok = frames.accepted(answer) and answer.get("handles")
        return prompt, answer if ok else None

    async def _decode(self, mid_pull: bool) -> tuple[Process, bool]:
        prefill = self.rng.choice(self.cluster.ready("prefill"))
        victim = self.rng.choice(self.cluster.ready("decode"))
        max_new = 8 if mid_pull else 64
        prompt, answer = await self._published(prefill, max_new)
        if answer is None:  # no handles to pull: strike anyway
            signal_group(victim, signal.SIGKILL)
            return victim, False
        message = {"op": "decode", "rid": "chaos", "tokens": frames.tokens(prompt),
                   "params": params(max_new), "first_token": answer["first_token"],
                   "tier_pages": answer["tier_pages"], "pages": answer["pages"],
                   "handles": answer["handles"]}  # fmt: skip
        if not mid_pull:
            at = await self._kill_after_tokens(victim, message, tokens=2)
            return victim, at
        signal_group(prefill, signal.SIGSTOP)
        try:
            token = self.cluster.config.token
            pull = frames.call(victim.ready["address"], message, token, timeout=30)
            self._stream = asyncio.create_task(pull)
            server, client = group_pids(prefill.popen.pid), group_pids(victim.popen.pid)
            at = await until(lambda: unread_bytes(server, client) > 0)
            signal_group(victim, signal.SIGKILL)
        finally:
            signal_group(prefill, signal.SIGCONT)
        return victim, at

    async def _kill_after_tokens(self, victim: Process, message: dict, tokens: int) -> bool:
        host, port = victim.ready["address"].rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        seen, at = 0, False
        try:
            async with asyncio.timeout(MOMENT_S * 3):
                writer.write(frames.hello(self.cluster.config.token) + frames.frame(message))
                await frames.read_frame(reader)  # the welcome
                while seen < tokens:
                    reply = await frames.read_frame(reader)
                    if reply is None or reply.get("op") != "tokens":
                        break  # done early, or an error: not the moment
                    seen += 1
                at = seen == tokens
        except (TimeoutError, OSError):
            pass
        finally:
            signal_group(victim, signal.SIGKILL)
            writer.close()
        return at

    async def _cache(self, write: bool) -> tuple[Process, bool]:
        i = self.rng.randrange(len(self.cluster.cache_addresses))
        victim = self.cluster.find(f"cache{i}")
        server = group_pids(victim.popen.pid)
        rpc_port = int(self.cluster.cache_addresses[i].rsplit(":", 1)[1])
        if write:
            clients = [p for d in self.cluster.ready("decode") for p in group_pids(d.popen.pid)]
            ports = None  # its listener (reserve, commit) or its agent (page bytes)
        else:
            clients = [p for w in [*self.cluster.ready("prefill"), self.cluster.find("control")]
                       for p in group_pids(w.popen.pid)]  # fmt: skip
            ports = {rpc_port}
        signal_group(victim, signal.SIGSTOP)
        at = await until(lambda: unread_bytes(server, clients, ports) > 0)
        signal_group(victim, signal.SIGKILL)
        return victim, at
