"""Each route's error, in its protocol's shape and status: OpenAI's `{"error": {message, type, param, code}}`,
TGI's `{"error", "error_type"}` (422 where OpenAI says 400, 424 for a failed generation) and llama-server's
`{"error": {code, message, type}}`, chosen by the route's path. The guard's refusals and the app's errors both
answer through here. No torch, no HTTP framework."""

from __future__ import annotations

from autotp.serve.api import llama_api, tgi_api
from autotp.serve.api.boundary import ApiError


def shaped(error: ApiError, path: str) -> tuple[dict, int]:
    """(body, status) of `error` answered on `path`."""
    if tgi_api.is_tgi(path):
        return tgi_api.error_body(error), tgi_api.status(error)
    if llama_api.is_llama(path):
        return llama_api.error_body(error), error.status
    return error.body(), error.status


def status(error: ApiError, path: str) -> int:
    """The status `error` is answered with on `path` (the log line's)."""
    return shaped(error, path)[1]
