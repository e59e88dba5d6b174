"""`/v1/completions`: validate against the served model, run the job, answer
as one JSON document or as server-sent events.

The job runs in its own task and hands events over a queue, so its
timeouts belong to one task whatever the HTTP side does; when the client
goes away the task is cancelled, which closes the worker connection (how
control cancels a request on a worker).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvrelay.control import tokenizer
from kvrelay.control.dispatch import Dispatcher, DispatchError, Job
from kvrelay.control.registry import Registry
from kvrelay.control.schemas import CompletionRequest
from kvrelay.control.stats import ControlStats
from kvrelay.control.stops import StopMatcher

log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.25
_END = object()


class ClientGone(Exception):
    pass


class Answer:
    """The text of an answer as its tokens arrive: decoded incrementally (a
    character split over batches comes out whole) and cut before the first
    stop string (`stopped` then; the stop string is not part of the text)."""

    def __init__(self, stops: list[str]) -> None:
        self.decoder = tokenizer.StreamDecoder()
        self.stops = StopMatcher(stops)
        self.tokens: list[int] = []

    @property
    def stopped(self) -> bool:
        return self.stops.stopped

    def add(self, batch: list[int]) -> str:
        """Text to emit for this batch (held back while it may begin a stop)."""
        self.tokens += batch
        return self.stops.feed(self.decoder.feed(batch))

    def finish(self) -> str:
        """The rest of the text once generation ended."""
        return self.stops.feed(self.decoder.flush()) + self.stops.flush()


def error_body(status: int, message: str) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "code": status}, "detail": message}


class CompletionRunner:
    def __init__(self, dispatcher: Dispatcher, registry: Registry, stats: ControlStats) -> None:
        self.dispatcher = dispatcher
        self.registry = registry
        self.stats = stats

    def _job(self, body: CompletionRequest) -> Job:
        models = self.registry.models()
        if not models:
            raise DispatchError(503, "no workers are registered")
        model = body.model
        if model is None:
            if len(models) > 1:
                raise DispatchError(400, f"model is required: serving {', '.join(sorted(models))}")
            model = next(iter(models))
        if model not in models:
            raise DispatchError(
                404, f"unknown model {model!r}; serving: {', '.join(sorted(models))}"
            )
        vocab = models[model]["vocab_size"]
        if isinstance(body.prompt, str):
            if vocab < tokenizer.BYTE_VOCAB:
                raise DispatchError(400, f"text prompts need a vocabulary of at least "
                                         f"{tokenizer.BYTE_VOCAB} (byte tokens); {model} has "
                                         f"{vocab}: send token ids")  # fmt: skip
            tokens = tokenizer.encode(body.prompt)
        else:
            tokens = list(body.prompt)
        for name, ids in (("prompt", tokens), ("stop_token_ids", body.stop_token_ids)):
            outside = [t for t in ids if not 0 <= t < vocab]
            if outside:
                raise DispatchError(
                    400, f"{name} has token ids outside the vocabulary [0, {vocab}) of "
                         f"{model}: {outside[:5]}",
                )  # fmt: skip
        params = {
            "max_new_tokens": body.max_tokens, "temperature": body.temperature,
            "top_k": body.top_k, "top_p": body.top_p, "seed": body.seed,
            "stop_token_ids": list(body.stop_token_ids),
        }  # fmt: skip
        return Job(rid=f"cmpl-{secrets.token_hex(8)}", model=model, tokens=tokens, params=params)

    def _failed(self, exc: DispatchError) -> JSONResponse:
        self.stats.errors += 1
        self.stats.client_errors += exc.status < 500
        return JSONResponse(error_body(exc.status, exc.message), status_code=exc.status)

    async def handle(self, body: CompletionRequest, request: Request):
        self.stats.requests += 1
        try:
            job = self._job(body)
        except DispatchError as exc:
            return self._failed(exc)
        queue: asyncio.Queue = asyncio.Queue()
        producer = asyncio.create_task(self._produce(job, queue))
        try:
            first = await self._next(queue, request)
        except ClientGone:
            await self._cancel(producer)
            return JSONResponse(error_body(499, "client went away"), status_code=499)
        if isinstance(first, DispatchError):
            return self._failed(first)
        answer = Answer(body.stop_strings())
        if body.stream:
            return StreamingResponse(self._sse(job, first, queue, producer, answer),
                                     media_type="text/event-stream")  # fmt: skip
        try:
            return await self._collect(job, first, queue, request, producer, answer)
        except ClientGone:
            await self._cancel(producer)
            return JSONResponse(error_body(499, "client went away"), status_code=499)

    async def _collect(self, job: Job, first: dict, queue: asyncio.Queue, request: Request,
                       producer: asyncio.Task, answer: Answer):  # fmt: skip
        """A whole answer as one JSON document."""
        event, text = first, []
        while event["type"] != "done":
            text.append(answer.add(event["tokens"]))
            if answer.stopped:  # a stop string: the worker's request ends here
                await self._cancel(producer)
                event = {"type": "done", "finish_reason": "stop", "decode": event.get("decode")}
                break
            event = await self._next(queue, request)
            if isinstance(event, DispatchError):
                return self._failed(event)
        text.append(answer.finish())
        self._finished(answer.tokens)
        return {
            "id": job.rid, "object": "text_completion", "created": int(time.time()),
            "model": job.model,
            "choices": [{"index": 0, "text": "".join(text), "token_ids": answer.tokens,
                         "finish_reason": event["finish_reason"]}],
            "usage": self._usage(job, answer.tokens), "kvrelay": self._info(first, event),
        }  # fmt: skip

    async def _produce(self, job: Job, queue: asyncio.Queue) -> None:
        try:
            async for event in self.dispatcher.run(job):
                queue.put_nowait(event)
        except DispatchError as exc:
            queue.put_nowait(exc)
        except Exception as exc:  # a bug here must still answer the client, never hang it
            log.exception("request %s failed inside control", job.rid)
            queue.put_nowait(DispatchError(502, f"control failed: {exc!r}"))
        finally:
            queue.put_nowait(_END)

    async def _next(self, queue: asyncio.Queue, request: Request):
        """The next event; watches the client while waiting (a non-streaming
        client that hangs up must not leave its request running)."""
        while True:
            try:
                event = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    self.stats.cancelled += 1
                    raise ClientGone() from None
                continue
            if event is _END:  # the job ended without done or an error: cannot happen
                return DispatchError(502, "the request ended without an answer")
            return event

    @staticmethod
    async def _cancel(task: asyncio.Task) -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    def _finished(self, tokens: list[int]) -> None:
        self.stats.completed += 1
        self.stats.completion_tokens += len(tokens)

    @staticmethod
    def _usage(job: Job, tokens: list[int]) -> dict:
        return {"prompt_tokens": len(job.tokens), "completion_tokens": len(tokens),
                "total_tokens": len(job.tokens) + len(tokens)}  # fmt: skip

    @staticmethod
    def _info(first: dict, done: dict | None) -> dict:
        return {"prefill_node": first["prefill"], "decode_node": done and done["decode"],
                "cached_tokens": first["cached"], "ttft_s": first["ttft_s"],
                "prefill_timings": first.get("prefill_timings", {})}  # fmt: skip

    async def _sse(self, job: Job, first: dict, queue: asyncio.Queue, producer: asyncio.Task,
                   answer: Answer):  # fmt: skip
        created = int(time.time())

        def chunk(text: str, batch: list[int], finish_reason=None, **extra) -> str:
            data = {"id": job.rid, "object": "text_completion", "created": created,
                    "model": job.model, "choices": [{"index": 0, "text": text,
                    "token_ids": batch, "finish_reason": finish_reason}]} | extra  # fmt: skip
            return f"data: {json.dumps(data)}\n\n"

        def last(event: dict) -> str:
            self._finished(answer.tokens)
            return chunk(answer.finish(), [], event["finish_reason"],
                         usage=self._usage(job, answer.tokens),
                         kvrelay=self._info(first, event))  # fmt: skip

        try:
            event = first
            while True:
                if isinstance(event, DispatchError):
                    self.stats.errors += 1
                    self.stats.client_errors += event.status < 500
                    error = json.dumps(error_body(event.status, event.message))
                    yield f"event: error\ndata: {error}\n\n"
                    return
                if event is _END:
                    return
                if event["type"] == "done":
                    yield last(event)
                    yield "data: [DONE]\n\n"
                    return
                yield chunk(answer.add(event["tokens"]), event["tokens"])
                if answer.stopped:  # a stop string: the worker's request ends here
                    await self._cancel(producer)
                    yield last({"finish_reason": "stop", "decode": event.get("decode")})
                    yield "data: [DONE]\n\n"
                    return
                event = await queue.get()
        finally:
            # Client gone or stream over: the job (and its worker connection) ends too.
            await self._cancel(producer)
