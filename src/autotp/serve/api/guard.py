"""What `autotp serve` checks before a request reaches the API: Host, API key, media type, size, read time.

- Host: a server bound to loopback answers only Host headers that name loopback (localhost, 127.0.0.1,
  [::1], any port), so a web page whose domain resolves to 127.0.0.1 (DNS rebinding) cannot use it;
  `--allowed-hosts` replaces that list ("*": any). A server bound elsewhere accepts any Host.
- API key: with `--api-key` (or AUTOTP_API_KEY), /v1/*, TGI's generation routes, llama-server's (llama_api.py)
  and the routes SGLang's router reads (router_api.py) need `Authorization: Bearer <key>`, as OpenAI, Hugging
  Face and llama.cpp clients and the router send it; /health, /info, /props and /metrics stay open for probes
  and scrapers. Without a key, no header is read (llama.vim sends `Bearer ` with an empty key); bound beyond
  loopback without one, the server says at start-up that anyone who reaches it may use it (`open_to_all`).
- POST bodies must be `application/json` (a browser form or `text/plain` fetch cannot be one without a
  CORS preflight, which this server never grants), except POST /flush_cache, whose body is ignored and
  which the router sends with none (a web page can send it too: only an API key keeps it out), of at most
  `--max-body-bytes`: a declared
  Content-Length beyond it is refused without parsing, a chunked body once it grows beyond it. The body
  is read and discarded (up to DRAIN_BYTES) before the 413 is sent: a client that writes its whole body
  before reading (Python's http.client, requests) would otherwise see its connection reset, not the 413.
- Read time: a request's headers and body must arrive within `--read-timeout` seconds of its first
  byte (of the connection, for the first request), or the connection is closed. uvicorn's h11 protocol
  has a keep-alive timeout between requests but none while reading one, so slow clients (slowloris)
  could hold connections open forever.
Errors have the route's protocol's shape (OpenAI's, or TGI's on its routes); they close the connection.
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
from collections.abc import Callable

import h11
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from autotp.serve.api import llama_api, tgi_api
from autotp.serve.api.boundary import ApiError, clip
from autotp.serve.api.errors import shaped
from autotp.serve.types import log

DRAIN_BYTES = 2**26  # at most this much of a refused body is read (and dropped) so that the 413 arrives
KEYED = ("/v1/",)  # path prefixes that need the API key, beside TGI's generation routes and ROUTER_PATHS
ROUTER_PATHS = frozenset({"/server_info", "/get_server_info", "/model_info", "/get_model_info", "/get_load",
                          "/flush_cache"})  # router_api.py's
BODYLESS = frozenset({"/flush_cache"})  # POSTs that carry nothing, sent without a Content-Type

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def loopback(bind: str) -> bool:
    """Whether only this machine can reach `bind`: localhost, 127.0.0.0/8, ::1. Any other name, whatever it
    resolves to, may be reached from elsewhere."""
    try:
        return bind == "localhost" or ipaddress.ip_address(bind).is_loopback
    except ValueError:
        return False


def host_policy(bind: str, allowed: list[str] | None) -> frozenset[str] | None:
    """The Host names to answer (None: any): `allowed` as given, else loopback names when bound to loopback."""
    if allowed is not None:
        return None if "*" in allowed else frozenset(a.lower() for a in allowed)
    return LOOPBACK_NAMES if loopback(bind) else None


def open_to_all(bind: str, api_key: str | None) -> str | None:
    """The start-up warning for a server that anyone who reaches it may use (bound beyond loopback, no key), or
    None."""
    if api_key is not None or loopback(bind):
        return None
    return (f"warning: listening on {bind} without an API key: anyone who can reach this port can generate with the "
            f"model; set a key with AUTOTP_API_KEY=... (or --api-key), or listen on 127.0.0.1")


def host_name(header: str) -> str:
    """"127.0.0.1:8000" -> "127.0.0.1", "[::1]:8000" -> "::1", "LocalHost" -> "localhost"."""
    if header.startswith("["):
        return header[1:header.find("]")].lower()
    return header.rsplit(":", 1)[0].lower() if ":" in header else header.lower()


class Guard:
    """ASGI middleware in front of the app: refuses what the module docstring lists, before any body is read."""

    def __init__(self, app, allowed_hosts: frozenset[str] | None, api_key: str | None, max_body_bytes: int):
        self.app, self.allowed_hosts, self.api_key, self.max_body_bytes = app, allowed_hosts, api_key, max_body_bytes

    def _refusal(self, scope) -> ApiError | None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host")  # HTTP/1.0 may omit it; a browser never does
        if self.allowed_hosts is not None and host is not None and host_name(host) not in self.allowed_hosts:
            return ApiError(400, f"the Host header {host!r} is not allowed by this server (see --allowed-hosts)",
                            code="invalid_host")
        path = scope["path"]
        if self.api_key is not None and (path.startswith(KEYED) or path in ROUTER_PATHS or tgi_api.is_tgi(path)
                                         or llama_api.is_llama(path)):
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return ApiError(401, "missing or incorrect API key: send it as 'Authorization: Bearer <key>'",
                                code="invalid_api_key")
        if scope["method"] == "POST":
            media = headers.get("content-type", "").split(";")[0].strip().lower()
            if media != "application/json" and not (path in BODYLESS and not media):
                return ApiError(415, f"the request body must be application/json, got {media or 'no Content-Type'!r}",
                                code="unsupported_media_type")
            length = headers.get("content-length", "0")
            if length.isdigit() and int(length) > self.max_body_bytes:
                return too_large(self.max_body_bytes)
        return None

    async def __call__(self, scope, receive, send) -> None:
        refusal = self._refusal(scope) if scope["type"] == "http" else None
        if refusal is None and scope["type"] == "http" and scope["method"] == "POST":
            body, state = await self._read(receive)
            if state == "gone":  # the client left mid-body: nobody to answer
                return None
            if state == "whole":  # the app reads the body from here, then the connection's messages (its disconnect)
                return await self.app(scope, replay(body, receive), send)
            refusal = too_large(self.max_body_bytes)
        if refusal is None:
            return await self.app(scope, receive, send)
        log(f"refused {scope['method']} {clip(scope['path'])}: status={refusal.status} error={refusal.message!r}")
        response = closing_response(refusal, scope["path"])
        expects = dict(scope["headers"]).get(b"expect", b"").lower() == b"100-continue"
        if refusal.status != 413 or expects:  # a client that waits for "100 Continue" sends no body: none to read
            return await response(scope, receive, send)
        # the whole answer first, then the body the client is still writing, read and dropped, then the end:
        # a client that reads only once its body is written finds the 413 waiting instead of a reset
        await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body, "more_body": True})
        await drain(receive)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _read(self, receive) -> tuple[bytes, str]:
        """The body and "whole", "large" (reading stopped once it grew beyond the limit) or "gone"."""
        body = bytearray()
        while len(body) <= self.max_body_bytes:
            message = await receive()
            if message["type"] != "http.request":
                return bytes(body), "gone"
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        return bytes(body), "whole" if len(body) <= self.max_body_bytes else "large"


def replay(body: bytes, receive):
    """An ASGI receive that gives the body already read, then the connection's next messages."""
    sent = False

    async def inner():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return inner


async def drain(receive, limit: int = DRAIN_BYTES) -> None:
    """Read and drop what is left of a request's body, up to limit bytes (bounded in time by the read timeout)."""
    while limit > 0:
        message = await receive()
        if message["type"] != "http.request":
            return
        limit -= len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body exceeds the server's limit of {limit} bytes (--max-body-bytes)",
                    code="request_too_large")


def closing_response(error: ApiError, path: str) -> JSONResponse:
    """The error in `path`'s protocol, closing the connection: a refused request's body is not worth reading
    further."""
    body, status = shaped(error, path)
    return JSONResponse(body, status_code=status, headers={"connection": "close"})


async def read_body(request: Request) -> bytes:
    """The body (Guard has checked its size already)."""
    try:
        return await request.body()
    except ClientDisconnect:
        raise ApiError(400, "the client disconnected before sending the whole body") from None


def no_delay(sock) -> None:
    """Send small writes at once (no Nagle): a stream's first chunk follows its headers within milliseconds,
    and with Nagle on it waited for the headers' ACK, which the client delays by 40 ms. asyncio sets this
    only on sockets made with proto IPPROTO_TCP, which `socket.create_server` (listen()) does not give.
    Measured with the openai client under benchmarks/serve_bench.py's mixed load at 1 rank: time to first
    token p99 0.047 s before (a third of the requests waited 30-40 ms), 0.019 s after."""
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class ReadTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol plus a deadline for reading each request (`read_timeout` seconds)."""

    read_timeout: float = 30.0
    answered: Callable[[int], None] = staticmethod(lambda status: None)  # /metrics' count (http.HttpThread's)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's own answer to bytes that are not an HTTP/1.1 request, counted as the app's answers are."""
        self.answered(400)
        super().send_400_response(msg)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.read_deadline = None
        no_delay(transport.get_extra_info("socket"))
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.read_deadline is None and self.conn.their_state is h11.IDLE:  # the next request begins
            self._arm()
        super().data_received(data)
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):  # read whole (or the connection is over)
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self.read_deadline = self.loop.call_later(self.read_timeout, self._expired)

    def _disarm(self) -> None:
        if self.read_deadline is not None:
            self.read_deadline.cancel()
            self.read_deadline = None

    def _expired(self) -> None:
        self.read_deadline = None
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            log(f"closed a connection from {self.client}: request not read within {self.read_timeout:g}s")
            self.transport.close()
