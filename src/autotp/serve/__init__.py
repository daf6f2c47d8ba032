"""`autotp serve`: an OpenAI-compatible completions server on a tensor-parallel model.

The modules, each depending only on those listed before it:

- types.py: plain shared types (Row, Outcome, Result) and the log line; no torch.
- api.py: the OpenAI protocol at the boundary (request checking, error and response bodies); no torch.
- batch.py: one batch of rows through HF `generate`, identically on every rank.
- engine.py: rank 0's scheduler and the other ranks' command loop, in lockstep.
- guard.py: what is refused before a request reaches the API (Host, key, media type, size, read time).
- http.py: the FastAPI app and the uvicorn thread on rank 0.
- server.py: `serve()`, which loads the model and ties the above together.

`serve` is imported on first use, so that `autotp.serve.api` can be imported without torch.
"""

from __future__ import annotations

__all__ = ["serve"]


def __getattr__(name: str):
    if name == "serve":
        from autotp.serve.server import serve

        return serve
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
