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
from kvrelay.control.events import Done, FirstToken
from kvrelay.control.registry import Registry
from kvrelay.control.schemas import ChatCompletionRequest, CompletionRequest
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

    def __init__(self, stops: list[str], decoder) -> None:
        self.decoder = decoder  # feed(tokens) -> text, flush() -> the rest
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


class TextShape:
    """`/v1/completions` answers."""

    object = chunk_object = "text_completion"

    @staticmethod
    def choice(text: str, tokens: list[int], finish: str | None) -> dict:
        return {"index": 0, "text": text, "token_ids": tokens, "finish_reason": finish}

    @staticmethod
    def delta(text: str, tokens: list[int], finish: str | None, first: bool) -> dict:
        return TextShape.choice(text, tokens, finish)


class ChatShape:
    """`/v1/chat/completions` answers: a message, or deltas when streaming."""

    object, chunk_object = "chat.completion", "chat.completion.chunk"

    @staticmethod
    def choice(text: str, tokens: list[int], finish: str | None) -> dict:
        return {"index": 0, "message": {"role": "assistant", "content": text},
                "token_ids": tokens, "finish_reason": finish}  # fmt: skip

    @staticmethod
    def delta(text: str, tokens: list[int], finish: str | None, first: bool) -> dict:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": 0, "delta": delta if text or first else {}, "token_ids": tokens,
                "finish_reason": finish}  # fmt: skip


def error_body(status: int, message: str) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "code": status}, "detail": message}


class CompletionRunner:
    def __init__(self, dispatcher: Dispatcher, registry: Registry, stats: ControlStats) -> None:
        self.dispatcher = dispatcher
        self.registry = registry
        self.stats = stats
        self.codecs = tokenizer.Codecs()

    def _model(self, body: CompletionRequest | ChatCompletionRequest) -> tuple[str, dict]:
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
        return model, models[model]

    def _job(self, body: CompletionRequest | ChatCompletionRequest):
        """The job, and the decoder of its answer's text."""
        model, served = self._model(body)
        vocab = served["vocab_size"]
        try:
            codec = self.codecs.for_model(model, served["model_dir"], vocab)
        except tokenizer.TokenizerError as exc:
            if isinstance(body, ChatCompletionRequest) or isinstance(body.prompt, str):
                raise DispatchError(400, str(exc)) from exc
            codec = tokenizer.ByteCodec(vocab, model)  # ids in; text out as for no tokenizer
        try:
            if isinstance(body, ChatCompletionRequest):
                tokens = codec.encode(self._chat_prompt(codec, model, body))
            elif isinstance(body.prompt, str):
                tokens = codec.encode(body.prompt)
            else:
                tokens = list(body.prompt)
        except tokenizer.TokenizerError as exc:
            raise DispatchError(400, str(exc)) from exc
        if not tokens:
            raise DispatchError(400, "the prompt encodes to no tokens")
        for name, ids in (("prompt", tokens), ("stop_token_ids", body.stop_token_ids)):
            if not ids or (min(ids) >= 0 and max(ids) < vocab):  # in C; the list only if needed
                continue
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
        prefix = "chatcmpl" if isinstance(body, ChatCompletionRequest) else "cmpl"
        job = Job(rid=f"{prefix}-{secrets.token_hex(8)}", model=model, tokens=tokens,
                  params=params)  # fmt: skip
        return job, codec

    @staticmethod
    def _chat_prompt(codec, model: str, body: ChatCompletionRequest) -> str:
        if codec.chat_template is None:
            raise tokenizer.TokenizerError(
                f"{model} has no chat template (no tokenizer_config.json with a chat_template "
                f"in its directory): use /v1/completions with the prompt formatted by you"
            )
        return codec.render_chat([m.model_dump() for m in body.messages])

    def _failed(self, exc: DispatchError) -> JSONResponse:
        self.stats.errors += 1
        self.stats.client_errors += exc.status < 500
        return JSONResponse(error_body(exc.status, exc.message), status_code=exc.status)

    async def handle(self, body: CompletionRequest | ChatCompletionRequest, request: Request):
        self.stats.requests += 1
        shape = ChatShape if isinstance(body, ChatCompletionRequest) else TextShape
        try:
            job, codec = self._job(body)
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
        answer = Answer(body.stop_strings(), codec.stream())
        if body.stream:
            return StreamingResponse(self._sse(job, first, queue, producer, answer, shape),
                                     media_type="text/event-stream")  # fmt: skip
        try:
            return await self._collect(job, first, queue, request, producer, answer, shape)
        except ClientGone:
            await self._cancel(producer)
            return JSONResponse(error_body(499, "client went away"), status_code=499)

    async def _collect(self, job: Job, first: FirstToken, queue: asyncio.Queue, request: Request,
                       producer: asyncio.Task, answer: Answer, shape):  # fmt: skip
        """A whole answer as one JSON document."""
        event, text = first, []
        while not isinstance(event, Done):
            text.append(answer.add(event.tokens))
            if answer.stopped:  # a stop string: the worker's request ends here
                await self._cancel(producer)
                event = Done("stop", event.decode)
                break
            event = await self._next(queue, request)
            if isinstance(event, DispatchError):
                return self._failed(event)
        text.append(answer.finish())
        self._finished(answer.tokens)
        return {
            "id": job.rid, "object": shape.object, "created": int(time.time()),
            "model": job.model,
            "choices": [shape.choice("".join(text), answer.tokens, event.finish_reason)],
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
    def _info(first: FirstToken, done: Done) -> dict:
        return {"prefill_node": first.prefill, "decode_node": done.decode,
                "cached_tokens": first.cached, "ttft_s": first.ttft_s,
                "prefill_timings": first.prefill_timings,
                "decode_first_s": done.decode_first_s}  # fmt: skip

    async def _sse(self, job: Job, first: FirstToken, queue: asyncio.Queue, producer: asyncio.Task,
                   answer: Answer, shape):  # fmt: skip
        created = int(time.time())
        sent = [0]

        def chunk(text: str, batch: list[int], finish_reason=None, **extra) -> str:
            choice = shape.delta(text, batch, finish_reason, first=sent[0] == 0)
            sent[0] += 1
            data = {"id": job.rid, "object": shape.chunk_object, "created": created,
                    "model": job.model, "choices": [choice]} | extra  # fmt: skip
            return f"data: {json.dumps(data)}\n\n"

        def last(event: Done) -> str:
            self._finished(answer.tokens)
            return chunk(answer.finish(), [], event.finish_reason,
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
                if isinstance(event, Done):
                    yield last(event)
                    yield "data: [DONE]\n\n"
                    return
                yield chunk(answer.add(event.tokens), event.tokens)
                if answer.stopped:  # a stop string: the worker's request ends here
                    await self._cancel(producer)
                    yield last(Done("stop", event.decode))
                    yield "data: [DONE]\n\n"
                    return
                event = await queue.get()
        finally:
            # Client gone or stream over: the job (and its worker connection) ends too.
            await self._cancel(producer)
