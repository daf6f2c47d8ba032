"""`autotp serve`: an OpenAI-compatible completions server on a tensor-parallel model.

The packages, by who may touch what:

api/ (rank 0's HTTP thread; no torch):
- guard.py: what is refused before a request reaches an API (Host, key, media type, size, read time).
- boundary.py: what every protocol checks (the JSON, the context limit, stops) and the served model's facts.
- openai_api.py, tgi_api.py: OpenAI's and TGI's protocols, checked into rows and answered.
- router_api.py: what SGLang's router reads from each replica (server and model facts, load, cache flush).
- metrics.py: `/metrics`, named as vLLM names them.
- http.py: the FastAPI app and the uvicorn thread.

engine/ (rank 0's decisions; never imports the runner):
- loop.py: the step loop (continuous batching), and the other ranks' `follow`.
- request.py: one prompt of one request, from arrival to its last token (`Request`).
- planner.py: who computes how many tokens in which blocks this step, under the budgets (`Limits`).
- blocks.py: the block pool and its prefix cache; no torch.
- lookup.py: prompt-lookup drafts (speculation).
- output.py: sampling, log-probabilities, streaming and answers from a step's scores.
- text.py: tokens to text, stop strings, streamed deltas.

runner/ (every rank; the only code that touches the batch's tensors):
- model_runner.py: one forward per step, and the step's description (attention.StepMeta) built once before it.
- attention.py: the paged attention every layer calls, at most two kernel calls per layer and step.
- paged.py: the KV pool, the cache object HF's forward writes through, the attention interface entry.
- adapters.py: paged attention for the families whose attention is inline (BLOOM, Falcon, MPT).
- probe.py: the start-up capability check and the pool's shapes.
- compiled.py: the decode step as one torch.compile graph (`--compile`).
- budget.py: the KV cache's size at start-up.

lockstep/ (between the ranks):
- wire.py: the `Step` rank 0 broadcasts, one message per step.
- watchdog.py: a step that failed on some ranks only, found within seconds.

types.py: the plain types the API and the engine share (Row, Piece, Result) and the log line; no torch.
options.py: the settings (`ServeOptions`), and the contradictions among them refused before loading; no torch.
server.py: `serve()` and `backend()`, the one place that imports them all and ties them together.

`serve` is imported on first use, so that the protocol modules of api/ import without torch.
"""

from __future__ import annotations

__all__ = ["serve"]


def __getattr__(name: str):
    if name == "serve":
        from autotp.serve.server import serve

        return serve
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
