"""Rank 0's HTTP side of `autotp serve`: the FastAPI app and the uvicorn thread that runs it.

Endpoints: POST /v1/completions (JSON or server-sent events), GET /v1/models, GET /health. guard.py
refuses what must not reach them (Host, key, media type, size, slow reads). A request is checked by
api.py in a worker thread (tokenizing a long prompt takes seconds that /health must not wait for),
split into one Job per prompt and handed to the Engine; the engine's thread sends results back into the
event loop with `call_soon_threadsafe`. A client that goes away marks its jobs cancelled, and the engine
ends their rows at the next step. One log line per request, on stderr.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from autotp.serve.api import (
    ApiError,
    Completion,
    Served,
    choice,
    clip,
    completion_chunk,
    models_list,
    parse_completion,
    usage_of,
)
from autotp.serve.engine import Engine, Job
from autotp.serve.guard import Guard, ReadTimeoutH11, closing_response, read_body
from autotp.serve.text import TextStream
from autotp.serve.types import Result, log

RETRY_AFTER_S = 1  # what a 429 asks a client to wait: rows leave every step, so room comes back quickly


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _log_request(cid: str, status: int, start: float, prompt_tokens: int = 0, results=(), error: str = "") -> None:
    generated = sum(r.completion_tokens for r in results)
    line = (f"{cid} status={status} prompt_tokens={prompt_tokens} generated_tokens={generated} "
            f"latency={time.monotonic() - start:.3f}s")
    log(f"{line} error={clip(error)!r}" if error else line)


def _cancel_unfinished(jobs: list[Job], results: dict) -> None:
    """The request ended without all its prompts (the client left, or one prompt failed): stop the others."""
    for job in jobs:
        job.cancelled = job.index not in results


async def _watch_disconnect(request: Request, jobs: list[Job]) -> None:
    """Cancel the jobs when the client goes away (to be cancelled itself before the response is sent:
    once the body is read, the next message uvicorn delivers is the disconnect)."""
    if (await request.receive())["type"] == "http.disconnect":
        for job in jobs:
            job.cancelled = True


def build_app(served: Served, engine: Engine, max_body_bytes: int, allowed_hosts: frozenset[str] | None,
              api_key: str | None) -> FastAPI:
    app = FastAPI(title="autotp serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, allowed_hosts=allowed_hosts, api_key=api_key, max_body_bytes=max_body_bytes)
    # one thread: requests are parsed in arrival order, and HF fast tokenizers are not meant for
    # concurrent calls ("Already borrowed"); the engine's decoding on its own thread only reads
    parser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="autotp-parse")
    app.state.parser = parser  # shut down with the server (HttpThread.stop)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        if exc.status == 413:
            return closing_response(exc)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(Exception)  # a bug of ours: still OpenAI-shaped, in one log line
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        message = clip(f"{type(exc).__name__}: {exc}".splitlines()[0])
        log(f"internal error on {request.method} {clip(request.url.path)}: {message}")
        return JSONResponse(ApiError(500, message, type="server_error").body(), status_code=500)

    @app.exception_handler(HTTPException)  # unknown paths and methods, in the same error shape
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    @app.get("/health")
    async def health() -> dict:
        if not engine.accepting:
            raise ApiError(503, "the server is shutting down", type="server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return models_list(served)

    @app.post("/v1/completions")
    async def completions(request: Request):
        cid, start = f"cmpl-{uuid.uuid4().hex[:24]}", time.monotonic()
        try:
            raw = await read_body(request, max_body_bytes)
            req = await asyncio.get_running_loop().run_in_executor(parser, parse_completion, raw, served)
        except ApiError as e:
            _log_request(cid, e.status, start, error=e.message)
            raise
        events: asyncio.Queue[tuple] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def emit(event: tuple) -> None:  # from the engine's thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the event loop is gone (shutdown): nobody is waiting any more
                pass

        jobs = [Job(row, i, emit, TextStream(row.stop) if req.stream else None, cid)
                for i, row in enumerate(req.rows)]
        if len(jobs) > engine.max_queue:
            _log_request(cid, 400, start, req.prompt_tokens, error="more prompts than the queue holds")
            raise ApiError(400, f"{len(jobs)} prompts in one request exceed the queue of {engine.max_queue} "
                                f"(--max-queue)", param="prompt")
        admitted = engine.submit(jobs)
        if admitted == "full":
            _log_request(cid, 429, start, req.prompt_tokens, error="queue full")
            raise ApiError(429, f"the server is busy: {engine.max_queue} prompts are waiting already (--max-queue); "
                                f"retry later", type="requests", code="rate_limit_exceeded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        if admitted == "closed":
            _log_request(cid, 503, start, req.prompt_tokens, error="shutting down")
            raise ApiError(503, "the server is shutting down", type="server_error")
        if req.stream:
            return StreamingResponse(_stream(cid, served, req, jobs, events, start), media_type="text/event-stream")
        results: dict[int, Result] = {}
        watcher = asyncio.create_task(_watch_disconnect(request, jobs))
        try:
            while len(results) < len(jobs):
                kind, index, payload = await events.get()
                if kind == "error":
                    _log_request(cid, payload[0], start, req.prompt_tokens, results.values(), payload[1])
                    raise ApiError(*payload, type="server_error")
                if kind == "done":
                    results[index] = payload
        finally:
            watcher.cancel()
            if len(results) < len(jobs):
                _cancel_unfinished(jobs, results)
        ordered = [results[i] for i in range(len(jobs))]
        _log_request(cid, 200, start, req.prompt_tokens, ordered)
        return completion_chunk(cid, served, [choice(i, r.text, r.finish_reason) for i, r in enumerate(ordered)],
                                usage_of(req.prompt_tokens, ordered))

    return app


async def _stream(cid: str, served: Served, req: Completion, jobs: list[Job], events: asyncio.Queue, start: float):
    """Server-sent events as OpenAI sends them: text chunks, one finishing chunk per prompt, [DONE].
    Starlette closes this generator when the client disconnects: its unfinished jobs are cancelled."""
    results: dict[int, Result] = {}
    status, error = 499, "the client went away"  # nginx's code for it, until the stream is complete
    try:
        while len(results) < len(req.rows):
            kind, index, payload = await events.get()
            if kind == "text":
                yield _sse(completion_chunk(cid, served, [choice(index, payload, None)]))
            elif kind == "done":
                results[index] = payload
                yield _sse(completion_chunk(cid, served, [choice(index, "", payload.finish_reason)]))
            else:  # the status line is sent already: the error travels as an event, as OpenAI's does
                status, error = payload
                yield _sse(ApiError(status, error, type="server_error").body())
                return
        if req.include_usage:
            yield _sse(completion_chunk(cid, served, [], usage_of(req.prompt_tokens, list(results.values()))))
        yield "data: [DONE]\n\n"
        status, error = 200, ""
    finally:
        if status != 200:
            _cancel_unfinished(jobs, results)
        _log_request(cid, status, start, req.prompt_tokens, results.values(), error)


def listen(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: any free one), bound before the model loads so a busy port fails fast."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


class HttpThread:
    """uvicorn in a daemon thread (the main thread belongs to the engine and the signal handlers)."""

    def __init__(self, app: FastAPI, sock: socket.socket, read_timeout: float):
        protocol = type("H11", (ReadTimeoutH11,), {"read_timeout": read_timeout})
        config = uvicorn.Config(app, http=protocol, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True,
                                       name="autotp-http")

    def start(self, timeout: float = 60) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        """Finish open responses (up to uvicorn's graceful timeout), then close, parser thread included."""
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.server.config.app.state.parser.shutdown(wait=False, cancel_futures=True)
