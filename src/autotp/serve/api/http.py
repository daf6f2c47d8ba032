"""Rank 0's HTTP side of `autotp serve`: the FastAPI app and the uvicorn thread that runs it.

Endpoints: OpenAI's POST /v1/completions and /v1/chat/completions, GET /v1/models; TGI's POST /generate,
/generate_stream and / and GET /info (tgi_api.py); llama-server's POST /infill, /completion, /tokenize and
/detokenize and GET /props (llama_api.py, llama_info.py); what SGLang's router reads from its workers, GET /server_info,
/model_info, /get_load and POST /flush_cache (router_api.py); GET /health and GET /metrics (Prometheus). guard.py
refuses what must not reach them (Host, key, media type, size, slow reads). A request is checked by its
protocol module in a worker thread (tokenizing a long prompt takes seconds that /health must not wait
for) into rows, which go to the engine under the request's id (`Engine.submit`). The engine hands back each step's
events and stats as data; `Frontend.deliver` records the stats and moves the events into the event loop (one
`call_soon_threadsafe` per step), where each goes to the request it names. A client that goes away aborts its rows
(`Engine.abort`), which end at the next step. One log line per request, on stderr.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

import autotp
from autotp.serve.api import errors, llama_api, llama_info, openai_api, router_api, tgi_api
from autotp.serve.api.boundary import ApiError, Parsed, Served, clip, engine_error
from autotp.serve.api.guard import Guard, ReadTimeoutH11, closing_response, read_body
from autotp.serve.api.llama_api import compact
from autotp.serve.api.metrics import CONTENT_TYPE, Metrics
from autotp.serve.engine.loop import Engine, EngineOutput
from autotp.serve.types import Event, Failed, Finished, Result, log

RETRY_AFTER_S = 1  # what a 429 asks a client to wait: rows leave every step, so room comes back quickly
FLUSH_WAIT_S = 10  # a flush is answered at the engine's next step (at most engine.HEARTBEAT_S when idle)


def _sse(item: dict | str) -> str:
    """A server-sent event, its JSON compact as llama-server writes it (llama.vim drops a `"content": ` with a
    space); OpenAI's and TGI's clients read any JSON."""
    return f"data: {item if isinstance(item, str) else compact(item)}\n\n"


class Call:
    """One request in flight: its rows' results as the engine's events bring them, and its log line."""

    def __init__(self, cid: str, start: float, parsed: Parsed, path: str):
        self.cid, self.start, self.parsed, self.path = cid, start, parsed, path
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.results: dict[int, Result] = {}

    def ordered(self) -> list[Result]:
        return [self.results[i] for i in range(len(self.parsed.rows))]

    def complete(self) -> bool:
        return len(self.results) == len(self.parsed.rows)

    def log(self, status: int, error: str = "") -> None:
        log_request(self.cid, status, self.start, self.parsed.prompt_tokens, list(self.results.values()), error)

    def refuse(self, error: ApiError) -> ApiError:
        """Log the error under the status its protocol answers it with (TGI: 422, 424), and return it."""
        self.log(errors.status(error, self.path), error.message)
        return error


class Frontend:
    """Where the engine's output goes (`deliver`, from the engine's thread): each step's stats into the metrics, its
    events into the event loop, each to the request in flight it names."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.calls: dict[str, Call] = {}  # the requests in flight, by id (event loop only)
        self.loop: asyncio.AbstractEventLoop | None = None

    def open(self, call: Call) -> None:
        self.loop = asyncio.get_running_loop()
        self.calls[call.cid] = call

    def close(self, call: Call) -> None:
        self.calls.pop(call.cid, None)

    def deliver(self, output: EngineOutput) -> None:
        self.metrics.record(output.stats)
        if output.events and self.loop is not None:
            try:
                self.loop.call_soon_threadsafe(self._route, output.events)
            except RuntimeError:  # the event loop is gone (shutdown): nobody is waiting any more
                pass

    def _route(self, events: list[Event]) -> None:
        for event in events:
            call = self.calls.get(event.client)
            if call is not None:
                call.events.put_nowait(event)


def log_request(cid: str, status: int, start: float, prompt_tokens: int = 0, results=(), error: str = "") -> None:
    generated = sum(r.completion_tokens for r in results)
    line = (f"{cid} status={status} prompt_tokens={prompt_tokens} generated_tokens={generated} "
            f"latency={time.monotonic() - start:.3f}s")
    log(f"{line} error={clip(error)!r}" if error else line)


def bug(exc: Exception, method: str, path: str) -> ApiError:
    """A bug of ours, as the 500 its client gets (in its protocol's shape), and one log line that says where it was
    raised, instead of a traceback."""
    message = clip(f"{type(exc).__name__}: {exc}".splitlines()[0])
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    log(f"internal error on {method} {clip(path)}{where}: {message}")
    return ApiError(500, message, type="server_error")


class CountAnswers:
    """ASGI middleware: every response's status as it is sent, once (/metrics' request_errors_total counts
    the errors): the API's 4xx/5xx in each protocol's own code (TGI's 422 and 424), the guard's refusals
    (401, 400 Host, 413, 415), unknown paths, 499 for a client that left before its answer, and a bug of ours,
    answered 500 here: Starlette's handler for Exception answers outside every middleware, uncounted."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def counted(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.answered(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception as e:  # noqa: BLE001 - a bug of ours: still an answer in the protocol's shape
            error = bug(e, scope["method"], scope["path"])
            if not started:  # a stream answers its own (_stream): a second status line cannot follow the first
                body, status = errors.shaped(error, scope["path"])
                await JSONResponse(body, status_code=status)(scope, receive, counted)


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (to be cancelled before the response is sent: once the body is read, the
    next message uvicorn delivers is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(served: Served, engine: Engine, frontend: Frontend, max_body_bytes: int,
              allowed_hosts: frozenset[str] | None, api_key: str | None, facts: router_api.Facts) -> FastAPI:
    metrics = frontend.metrics
    app = FastAPI(title="autotp serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, allowed_hosts=allowed_hosts, api_key=api_key, max_body_bytes=max_body_bytes)
    app.add_middleware(CountAnswers, metrics=metrics)  # outside the guard: its refusals are answers too
    # one thread: requests are parsed in arrival order, and HF fast tokenizers are not meant for
    # concurrent calls ("Already borrowed"); the engine decodes with a copy of its own
    parser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="autotp-parse")
    app.state.parser = parser  # shut down with the server (HttpThread.stop)
    app.state.metrics = metrics  # which also counts uvicorn's own 400s (HttpThread)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        if exc.status == 413:
            return closing_response(exc, request.url.path)
        body, status = errors.shaped(exc, request.url.path)
        return JSONResponse(body, status_code=status, headers=exc.headers)

    @app.exception_handler(HTTPException)  # unknown paths and methods, in the same error shape
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return await api_error(request, ApiError(exc.status_code, str(exc.detail)))

    async def parse(request: Request, cid: str, start: float, parse_fn: Callable[[bytes, Served], Parsed]) -> Parsed:
        try:
            raw = await read_body(request)
            return await asyncio.get_running_loop().run_in_executor(parser, parse_fn, raw, served)
        except ApiError as e:
            log_request(cid, errors.status(e, request.url.path), start,
                        error=e.message)
            raise

    async def answer(request: Request, prefix: str, parse_fn):
        """Check the request, queue its rows, and answer: whole, or as server-sent events."""
        cid, start = f"{prefix}-{uuid.uuid4().hex[:24]}", time.monotonic()
        parsed = await parse(request, cid, start, parse_fn)
        call = Call(cid, start, parsed, request.url.path)
        if len(parsed.rows) > engine.max_queue:
            raise call.refuse(ApiError(400, f"{len(parsed.rows)} prompts and choices in one request exceed the queue "
                                            f"of {engine.max_queue} (--max-queue)", param="prompt"))
        frontend.open(call)
        admitted = engine.submit(cid, parsed.rows, parsed.stream, start)
        if admitted != "ok":
            frontend.close(call)
        if admitted == "full":
            raise call.refuse(ApiError(429, f"the server is busy: {engine.max_queue} prompts are waiting already "
                                            f"(--max-queue); retry later", type="requests", code="rate_limit_exceeded",
                                       headers={"Retry-After": str(RETRY_AFTER_S)}))
        if admitted == "closed":
            raise call.refuse(ApiError(503, "the server is shutting down", type="server_error"))
        if parsed.stream:
            return StreamingResponse(_stream(call, engine, frontend, metrics), media_type="text/event-stream")
        try:
            await _collect(request, call, engine)
        finally:
            frontend.close(call)
        p = call.parsed
        response = JSONResponse(p.answer.body(call.cid, p.rows, call.ordered(), p.prompt_tokens))
        call.log(200)
        return response

    @app.get("/health")
    async def health() -> dict:
        if not engine.accepting:
            raise ApiError(503, "the server is shutting down", type="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict:
        return openai_api.models_list(served)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, "cmpl", openai_api.parse_completion)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await answer(request, "chatcmpl", openai_api.parse_chat)

    @app.get("/info")
    async def info() -> dict:
        return tgi_api.info(served, engine.max_queue)

    @app.get("/server_info")
    @app.get("/get_server_info")  # the older name, which the router falls back to
    async def server_info() -> dict:
        return router_api.server_info(served, facts, engine.max_queue)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict:
        return router_api.model_info(served, facts)

    @app.get("/get_load")
    async def get_load() -> list[dict]:
        return router_api.load(engine.load())

    @app.post("/flush_cache")  # the router sends no body: guard.py lets this one POST come without a media type
    async def flush_cache() -> dict:
        if not engine.accepting:
            raise ApiError(503, "the server is shutting down", type="server_error")
        try:
            blocks = await asyncio.wait_for(asyncio.wrap_future(engine.flush_cache()), FLUSH_WAIT_S)
        except (asyncio.TimeoutError, RuntimeError):
            raise ApiError(503, "the server is shutting down", type="server_error") from None
        log("flush_cache: " + ("refused, requests are running or waiting" if blocks is None else
                               f"{blocks} cached blocks forgotten"))
        return router_api.flushed(blocks)

    @app.post("/generate")
    async def generate(request: Request):
        return await answer(request, "tgi", tgi_api.parse_generate)

    @app.post("/generate_stream")
    async def generate_stream(request: Request):
        return await answer(request, "tgi", tgi_api.parse_generate_stream)

    @app.post("/")
    async def compat(request: Request):  # TGI's route for the Inference API's clients: stream or not
        return await answer(request, "tgi", tgi_api.parse_compat)

    @app.post("/infill")
    async def infill(request: Request):
        return await answer(request, "infill", llama_api.parse_infill)

    @app.post("/completion")
    @app.post("/completions")  # llama-server's alias
    async def llama_completion(request: Request):
        return await answer(request, "cmpl", llama_api.parse_completion)

    @app.get("/props")
    async def props() -> dict:
        return llama_info.props(served, facts.max_running_requests, autotp.__version__)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        return await asyncio.get_running_loop().run_in_executor(parser, llama_info.tokenize, await read_body(request),
                                                                served)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        return await asyncio.get_running_loop().run_in_executor(parser, llama_info.detokenize,
                                                                await read_body(request), served)

    return app


async def _collect(request: Request, call: Call, engine: Engine) -> None:
    """Wait for every row's result; a row's error is the request's error. A client that goes away first
    (an editor cancelling on a keystroke) ends the wait: the engine drops its rows without a word."""
    watcher = asyncio.create_task(_disconnected(request))
    try:
        while not call.complete():
            event = asyncio.create_task(call.events.get())
            await asyncio.wait({event, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not event.done():  # the client went away
                event.cancel()
                call.log(499, "the client went away")
                raise ApiError(499, "the client went away", type="server_error")  # sent to nobody
            if isinstance(event.result(), Failed):
                raise call.refuse(engine_error(event.result().status, event.result().message))
            if isinstance(event.result(), Finished):
                call.results[event.result().index] = event.result().result
    finally:
        watcher.cancel()
        if not call.complete():
            engine.abort(call.cid)


async def _stream(call: Call, engine: Engine, frontend: Frontend, metrics: Metrics):
    """Server-sent events, as the request's protocol words them (openai_api, tgi_api, llama_api): per token, per
    finished row, at the end. Whatever fails once the 200 is sent (a row in the engine, a bug of ours in the answer's
    builder) ends the stream with the protocol's error end (`failure`), so a client never waits for an end that does
    not come. Starlette closes this generator when the client disconnects: its unfinished rows are aborted."""
    answer, status, error = call.parsed.answer, 499, "the client went away"  # nginx's code, until complete
    failure: ApiError | None = None
    try:
        try:
            for item in answer.start(call.cid, call.parsed.rows):
                yield _sse(item)
            while failure is None and not call.complete():
                event = await call.events.get()
                if isinstance(event, Finished):
                    call.results[event.index] = event.result
                    for item in answer.finish(call.cid, event.index, event.result):
                        yield _sse(item)
                elif isinstance(event, Failed):
                    failure = engine_error(event.status, event.message)
                else:
                    for item in answer.piece(call.cid, event.index, event.piece):
                        yield _sse(item)
            if failure is None:
                for item in answer.end(call.cid, call.ordered(), call.parsed.prompt_tokens):
                    yield _sse(item)
                status, error = 200, ""
        except Exception as e:  # noqa: BLE001 - a bug of ours, after the status line
            failure = bug(e, "POST", call.path)
        if failure is not None:  # the status line is sent already: the error travels as the stream's end
            status, error = errors.status(failure, call.path), failure.message
            for item in answer.failure(failure):
                yield _sse(item)
    finally:
        frontend.close(call)
        if status != 200:
            engine.abort(call.cid)
            metrics.answered(status)  # its 200 went out first: the stream's own end is what it got
        call.log(status, error)


class HttpThread:
    """uvicorn in a daemon thread (the main thread belongs to the engine and the signal handlers)."""

    def __init__(self, app: FastAPI, sock: socket.socket, read_timeout: float):
        protocol = type("H11", (ReadTimeoutH11,), {"read_timeout": read_timeout,
                                                   "answered": staticmethod(app.state.metrics.answered)})
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
