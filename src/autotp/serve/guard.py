"""What `autotp serve` checks before a request reaches the API: Host, API key, media type, size, read time.

- Host: a server bound to loopback answers only Host headers that name loopback (localhost, 127.0.0.1,
  [::1], any port), so a web page whose domain resolves to 127.0.0.1 (DNS rebinding) cannot use it;
  `--allowed-hosts` replaces that list ("*": any). A server bound elsewhere accepts any Host.
- API key: with `--api-key` (or AUTOTP_API_KEY), /v1/* needs `Authorization: Bearer <key>`, as OpenAI
  clients send it; /health stays open for probes.
- POST bodies must be `application/json` (a browser form or `text/plain` fetch cannot be one without a
  CORS preflight, which this server never grants), of at most `--max-body-bytes`: a declared
  Content-Length beyond it is refused before reading, a chunked body once it grows beyond it.
- Read time: a request's headers and body must arrive within `--read-timeout` seconds of its first
  byte (of the connection, for the first request), or the connection is closed. uvicorn's h11 protocol
  has a keep-alive timeout between requests but none while reading one, so slow clients (slowloris)
  could hold connections open forever.
Errors are OpenAI-shaped, like the API's own; the response closes the connection (the body is unread).
"""

from __future__ import annotations

import hmac
import ipaddress

import h11
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from autotp.serve.api import ApiError, clip
from autotp.serve.types import log

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def host_policy(bind: str, allowed: list[str] | None) -> frozenset[str] | None:
    """The Host names to answer (None: any): `allowed` as given, else loopback names when bound to loopback."""
    if allowed is not None:
        return None if "*" in allowed else frozenset(a.lower() for a in allowed)
    try:
        loopback = bind == "localhost" or ipaddress.ip_address(bind).is_loopback
    except ValueError:  # a name other than localhost: whatever it resolves to, clients may use it
        loopback = False
    return LOOPBACK_NAMES if loopback else None


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
        if self.api_key is not None and scope["path"].startswith("/v1/"):
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return ApiError(401, "missing or incorrect API key: send it as 'Authorization: Bearer <key>'",
                                code="invalid_api_key")
        if scope["method"] == "POST":
            media = headers.get("content-type", "").split(";")[0].strip().lower()
            if media != "application/json":
                return ApiError(415, f"the request body must be application/json, got {media or 'no Content-Type'!r}",
                                code="unsupported_media_type")
            length = headers.get("content-length", "0")
            if length.isdigit() and int(length) > self.max_body_bytes:
                return too_large(self.max_body_bytes)
        return None

    async def __call__(self, scope, receive, send) -> None:
        refusal = self._refusal(scope) if scope["type"] == "http" else None
        if refusal is None:
            return await self.app(scope, receive, send)
        log(f"refused {scope['method']} {clip(scope['path'])}: status={refusal.status} error={refusal.message!r}")
        await closing_response(refusal)(scope, receive, send)


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body exceeds the server's limit of {limit} bytes (--max-body-bytes)",
                    code="request_too_large")


def closing_response(error: ApiError) -> JSONResponse:
    """The error, closing the connection: a refused request's body is unread, and reading it costs more."""
    return JSONResponse(error.body(), status_code=error.status, headers={"connection": "close"})


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it grows beyond limit, whatever Content-Length said."""
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large(limit)
    except ClientDisconnect:
        raise ApiError(400, "the client disconnected before sending the whole body") from None
    return bytes(body)


class ReadTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol plus a deadline for reading each request (`read_timeout` seconds)."""

    read_timeout: float = 30.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.read_deadline = None
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
