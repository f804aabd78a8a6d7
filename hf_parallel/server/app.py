"""The HTTP server: OpenAI's API over one `Engine`, on FastAPI and uvicorn.

    GET  /health                200 while the engine runs; 503 once it failed, or while the server drains
    GET  /v1/models             the one model served
    POST /v1/completions        prompts (strings or token ids) completed, streamed as server-sent events or not
    POST /v1/chat/completions   messages through the tokenizer's chat template
    GET  /metrics               the engine's counters in Prometheus' text format

Every request becomes streams of the engine's live row, so requests that share a document or a
system prompt share its computation.  A refusal is OpenAI's error object with a 4xx status: a body
`protocol.parse` refuses (400, or 404 for another model), a missing or wrong API key (401, compared in
constant time), a body past `max_body` bytes (413, refused by its Content-Length before it is read, or
once a chunked body passes the limit), a full queue (429, with `Retry-After`).  A request that fails in
the engine fails alone (500).  A client that goes away has its streams taken out of the row.

`app.state.draining` set (by `draining.DrainingServer` on SIGTERM) makes /health and new requests answer
503 while the requests in flight finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import traceback

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from ..frontends.serving import Closed, Engine, QueueFull
from .protocol import Answer, ApiError, Work, answer_eos, engine_error, parse

MAX_N = 16  # most choices per request, by default
MAX_BODY = 4 * 2**20  # most bytes of a request body, by default: about a million tokens of English text
RETRY_AFTER = 1  # seconds a client told the queue is full waits


def create_app(
    engine: Engine, tokenizer, name: str, api_key: str | None = None, max_n: int = MAX_N, max_body: int = MAX_BODY
) -> FastAPI:
    """The app serving `engine`'s model as `name`, with `tokenizer`; with `api_key`, /v1/ needs it as a bearer
    token; a request body may hold at most `max_body` bytes."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(engine.close, 10)

    app = FastAPI(title="hf-parallel", lifespan=lifespan)
    app.state.draining = False
    eos = answer_eos(engine.model, tokenizer)
    expected = None if api_key is None else f"Bearer {api_key}".encode()

    def authorize(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if expected is not None and not secrets.compare_digest(given, expected):
            raise ApiError(401, "a missing or wrong API key (Authorization: Bearer KEY)", code="invalid_api_key")

    keyed = [Depends(authorize)]

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return _error_response(error)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        return _error_response(ApiError(error.status_code, str(error.detail), code=None))

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception):
        traceback.print_exception(error)
        return _error_response(ApiError(500, f"internal error: {type(error).__name__}"))

    @app.get("/health")
    async def health():
        if engine.failure is not None:
            return JSONResponse({"status": "failed", "error": str(engine.failure)}, status_code=503)
        if app.state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=keyed)
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "hf-parallel"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus(engine), media_type="text/plain; version=0.0.4")

    async def answer(request: Request, kind: str):
        if app.state.draining:
            raise ApiError(503, "the server is shutting down", code="unavailable", kind="server_error")
        body = await _json(request, max_body)
        work = parse(kind, body, tokenizer, name, max_n)
        run = Run(engine, work, tokenizer, eos)
        await run.accepted()
        if work.stream:
            return EventStream(run)
        return JSONResponse(await run.whole(request))

    @app.post("/v1/completions", dependencies=keyed)
    async def completions(request: Request):
        return await answer(request, "completions")

    @app.post("/v1/chat/completions", dependencies=keyed)
    async def chat(request: Request):
        return await answer(request, "chat")

    return app


class EventStream(StreamingResponse):
    """A run's server-sent events; however the response ends (a client gone included), the run's streams that are
    still open are cancelled."""

    def __init__(self, run: Run):
        super().__init__(run.events(), media_type="text/event-stream")
        self.run = run

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.run.answer.open:
                self.run.cancel()


class Run:
    """One HTTP request's engine requests (one per prompt) and their events, as an `Answer`."""

    def __init__(self, engine: Engine, work: Work, tokenizer, eos: set[int]):
        self.engine, self.work = engine, work
        self.queue: asyncio.Queue = asyncio.Queue()
        self.buffer: list[tuple] = []
        self.requests = []
        loop = asyncio.get_running_loop()
        for p, prompt in enumerate(work.prompts):

            def on_event(kind, value, p=p):
                loop.call_soon_threadsafe(self.queue.put_nowait, (p, kind, value))

            try:
                self.requests.append(engine.submit(prompt, work.options, work.n, on_event, work.priority))
            except QueueFull as err:
                self.cancel()
                raise ApiError(429, f"the server is busy: {err}", code="queue_full", kind="rate_limit_error") from err
            except Closed as err:
                self.cancel()
                raise ApiError(503, str(err), code="unavailable", kind="server_error") from err
        self.answer = Answer(work, tokenizer, eos, [0] * len(work.prompts))

    def cancel(self) -> None:
        for request in self.requests:
            request.cancel()
        self.engine.wake()

    async def accepted(self) -> None:
        """Wait until the engine has checked every prompt; `ApiError` where it refused one."""
        waiting = len(self.requests)
        while waiting:
            event = await self.queue.get()
            if event[1] == "accepted":
                waiting -= 1
            elif event[1] == "error":
                self.cancel()
                raise engine_error(event[2], self.work.kind)
            else:
                self.buffer.append(event)
        self.answer.limits = [r.max_new_tokens for r in self.requests]

    async def events(self):
        """The response as server-sent events; the client gone (the generator closed), its streams are cancelled."""
        answer, chat = self.answer, self.work.kind == "chat"
        try:
            if chat:
                for i in range(len(answer.choices)):
                    yield _sse(answer.chunk(i, {"role": "assistant", "content": ""}, None))
            while answer.open:
                p, kind, value = self.buffer.pop(0) if self.buffer else await self.queue.get()
                if kind == "error":
                    self.cancel()
                    yield _sse(engine_error(value, self.work.kind).body())
                    return
                for i, text, reason in answer.apply(p, kind, value):
                    if text or reason:
                        yield _sse(answer.chunk(i, ({"content": text} if text else {}) if chat else text, reason))
            if self.work.include_usage:
                yield _sse({**answer.head(), "choices": [], "usage": answer.usage()})
            yield "data: [DONE]\n\n"
        finally:
            if answer.open:
                self.cancel()

    async def whole(self, request: Request) -> dict:
        """The complete response; a client gone before it is ready has its streams cancelled."""
        answer = self.answer
        while answer.open:
            try:
                p, kind, value = self.buffer.pop(0) if self.buffer else await asyncio.wait_for(self.queue.get(), 1.0)
            except TimeoutError:
                if await request.is_disconnected():
                    self.cancel()
                    raise ApiError(499, "the client closed the request") from None
                continue
            if kind == "error":
                self.cancel()
                raise engine_error(value, self.work.kind)
            answer.apply(p, kind, value)
        return answer.body()


def prometheus(engine: Engine) -> str:
    """The engine's counters in Prometheus' text exposition format."""
    c = engine.counters
    rows = [
        ("requests_total", "counter", "requests accepted", c.requests),
        ("requests_failed_total", "counter", "requests that failed", c.failed),
        ("requests_cancelled_total", "counter", "requests cancelled (clients gone)", c.cancelled),
        (
            "prompt_tokens_total",
            "counter",
            "prompt tokens of admitted requests, each counted as if alone",
            c.prompt_tokens,
        ),
        (
            "prompt_tokens_computed_total",
            "counter",
            "prompt tokens the row computed (the rest were resident)",
            c.computed_tokens,
        ),
        ("generated_tokens_total", "counter", "tokens generated", c.generated_tokens),
        ("rounds_total", "counter", "forwards of the live row", c.rounds),
        ("live_streams", "gauge", "streams decoding now", c.live_streams),
        ("queued_requests", "gauge", "requests waiting for the engine or for room", c.queued),
        ("row_slots_used", "gauge", "K/V slots held by resident prompts and answers", c.resident_slots),
        ("row_slots_retained", "gauge", "of which prefixes kept for later requests", c.retained_slots),
        ("row_slots_capacity", "gauge", "K/V slots of the row", c.capacity),
        ("max_streams", "gauge", "most live streams", c.max_streams),
    ]
    lines = []
    for metric, kind, help_text, value in rows:
        name = f"hf_parallel_{metric}"
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
    return "\n".join(lines) + "\n"


async def _json(request: Request, max_body: int):
    """The body as JSON; 413 past `max_body` bytes, by its Content-Length before it is read, else (chunked) as soon
    as what has come passes it."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_body:
        raise _too_large(max_body)
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > max_body:
            raise _too_large(max_body)
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the body is not valid JSON: {err}", code="invalid_json") from err


def _too_large(max_body: int) -> ApiError:
    return ApiError(
        413, f"the request body is larger than this server takes ({max_body} bytes: --max-body)", code="body_too_large"
    )


def _error_response(error: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER)} if error.status == 429 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
