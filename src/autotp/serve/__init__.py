"""`autotp serve`: an OpenAI-compatible completions server on a tensor-parallel model.

The modules, each depending only on those listed before it:

- types.py: plain shared types (Row, Result) and the log line; no torch.
- api.py: the OpenAI protocol at the boundary (request checking, error and response bodies); no torch.
- text.py: tokens to text: decoding, stop strings, streamed deltas.
- scheduler.py: rank 0's admission and chunk rules under the budgets; no torch.
- wire.py: the `Step` rank 0 broadcasts, one message per step.
- kv.py: the padded HF cache that rows join and leave.
- state.py: the continuous batch every rank holds, and the forwards of one step.
- budget.py: the KV cache's size, measured at start-up.
- engine.py: rank 0's step loop (continuous batching) and the other ranks' `follow`, in lockstep.
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
