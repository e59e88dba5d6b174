"""A minimal stand-in for control: the registration endpoint (HTTP) and a
msgpack client that drives prefill then decode as docs/serving-protocol.md
says. The real control lives in kvrelay/control (built separately)."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvrelay.rpc import WIRE_VERSION, Connection, pack_tokens, unpack_tokens

TOKEN = "serving-test"


class FakeControl:
    """POST /v1/nodes, POST /v1/nodes/{id}/heartbeat, DELETE /v1/nodes/{id}."""

    def __init__(self, token: str = TOKEN) -> None:
        self.token = token
        self.nodes: dict[str, dict] = {}
        self.heartbeats: dict[str, dict] = {}
        self.deleted: list[str] = []
        self.lock = threading.Lock()
        ids = itertools.count(1)
        control = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def _reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                if self.headers.get("Authorization") != f"Bearer {control.token}":
                    self._reply(401, {"detail": "bad token"})
                    return False
                return True

            def _body(self) -> dict:
                length = int(self.headers.get("Content-Length", 0))
                return json.loads(self.rfile.read(length) or b"{}")

            def do_POST(self):
                if not self._authorized():
                    return
                parts = self.path.strip("/").split("/")
                body = self._body()
                with control.lock:
                    if parts == ["v1", "nodes"]:
                        node_id = f"node-{next(ids)}"
                        control.nodes[node_id] = body
                        self._reply(200, {"node_id": node_id, "heartbeat_s": 0.5})
                    elif len(parts) == 4 and parts[3] == "heartbeat":
                        if parts[2] not in control.nodes:
                            self._reply(404, {"detail": "unknown node"})
                        else:
                            control.heartbeats[parts[2]] = body
                            self._reply(200, {})
                    else:
                        self._reply(404, {"detail": "no route"})

            def do_DELETE(self):
                if not self._authorized():
                    return
                node_id = self.path.strip("/").split("/")[-1]
                with control.lock:
                    control.nodes.pop(node_id, None)
                    control.deleted.append(node_id)
                self._reply(200, {})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# -- the msgpack side ---------------------------------------------------------------
class WorkerConn:
    """A raw connection speaking the wire's maps, so tests can send what they
    like: lists of token ids go out packed; replies come back as maps with
    `ok` (not an error reply), `done` (decode's last frame) and the token
    ids unpacked."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    async def send(self, message: dict) -> None:
        message = dict(message)
        if isinstance(message.get("tokens"), list):
            message["tokens"] = pack_tokens(message["tokens"])
        await self.conn.send(message)

    async def recv(self) -> dict:
        frame = await self.conn.recv()
        frame["ok"] = frame.get("op") != "error"
        if frame.get("op") == "done":
            frame["done"] = True
        if isinstance(frame.get("tokens"), bytes):
            frame["tokens"] = unpack_tokens(frame["tokens"])
        return frame

    def close(self) -> None:
        self.conn.close()


async def open_worker(address: str, token: str = TOKEN) -> WorkerConn:
    host, port = address.rsplit(":", 1)
    conn = await Connection.open(host, int(port))
    await conn.send({"op": "hello", "v": WIRE_VERSION, "token": token})
    reply = await conn.recv()
    if reply.get("op") != "worker":
        conn.close()
        raise RuntimeError(f"hello refused: {reply}")
    return WorkerConn(conn)


async def call(address: str, message: dict, timeout: float = 60.0) -> dict:
    """One request, one answer frame."""
    async with asyncio.timeout(timeout):
        conn = await open_worker(address)
        try:
            await conn.send(message)
            return await conn.recv()
        finally:
            conn.close()


def addr(process) -> str:
    """A launched worker's msgpack address."""
    return process.info["address"]


async def stats(process) -> dict:
    reply = await call(addr(process), {"op": "stats"})
    assert reply["ok"], reply
    return reply["stats"]


def sampling_params(sampling: dict):
    """The `params` dict as the engine's SamplingParams (a missing seed is 0,
    as the workers read it)."""
    from kvrelay.model import SamplingParams

    return SamplingParams(
        max_new_tokens=sampling["max_new_tokens"], temperature=sampling["temperature"],
        top_k=sampling["top_k"], top_p=sampling["top_p"], seed=sampling["seed"] or 0,
        stop_token_ids=tuple(sampling["stop_token_ids"]),
    )  # fmt: skip


def params(max_new_tokens=8, temperature=0.0, top_k=0, top_p=1.0, seed=None, stop=()):
    return {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k,
            "top_p": top_p, "seed": seed, "stop_token_ids": list(stop)}  # fmt: skip


async def prefill(address: str, rid: str, tokens, sampling: dict, lease_s=30.0) -> dict:
    return await call(
        address,
        {"op": "prefill", "rid": rid, "tokens": list(tokens), "params": sampling,
         "lease_s": lease_s},
    )  # fmt: skip


async def decode(address: str, rid: str, tokens, sampling: dict, answer: dict,
                 timeout: float = 120.0) -> dict:  # fmt: skip
    """Streams a decode; returns {tokens: first + streamed, done: last frame}
    or the error frame."""
    message = {
        "op": "decode", "rid": rid, "tokens": list(tokens), "first_token": answer["first_token"],
        "params": sampling, "tier_pages": answer["tier_pages"], "pages": answer["pages"],
        "handles": answer["handles"],
    }  # fmt: skip
    out = [answer["first_token"]]
    async with asyncio.timeout(timeout):
        conn = await open_worker(address)
        try:
            await conn.send(message)
            while True:
                frame = await conn.recv()
                if not frame.get("ok"):
                    return frame
                if frame.get("done"):
                    return {"ok": True, "tokens": out, "done": frame}
                assert frame["rid"] == rid
                out.extend(frame["tokens"])
        finally:
            conn.close()


async def serve(prefill_address, decode_address, rid, tokens, sampling) -> dict:
    """prefill, then decode unless prefill's first token finished it."""
    answer = await prefill(prefill_address, rid, tokens, sampling)
    assert answer["ok"], answer
    if answer["finish_reason"]:
        return {"ok": True, "tokens": [answer["first_token"]], "prefill": answer}
    result = await decode(decode_address, rid, tokens, sampling, answer)
    result["prefill"] = answer
    return result
