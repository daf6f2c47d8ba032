"""`autotp serve`: an OpenAI-compatible completions server on a tensor-parallel (and pipeline-parallel) model.

The packages, by who may touch what (each imports only those listed after it, and types.py):

api/ (rank 0's HTTP thread; no torch):
- guard.py: what is refused before a request reaches an API (Host, key, media type, size, read time).
- boundary.py: what every protocol checks (the JSON, the context and cache room, stops) and the served model's facts.
- openai_api.py, tgi_api.py: OpenAI's and TGI's protocols, checked into rows and answered.
- router_api.py: what SGLang's router reads from each replica (server and model facts, load, cache flush).
- metrics.py: `/metrics`, named as vLLM names them, from the engine's stats.
- http.py: the FastAPI app, the uvicorn thread, and the engine's events routed to the requests they name.

engine/ (rank 0's decisions; no torch; never imports the runner):
- loop.py: the engine (continuous batching): schedule, the executor, the output processor, update.
- request.py: one row of a request from arrival to its last token, with a status (`Request`).
- scheduler.py: the waiting and running requests and their blocks; `schedule()` hands out a step, `update()` takes it
  back; the budgets (`Limits`).
- blocks.py: the block pool and its prefix cache.
- lookup.py: prompt-lookup drafts (speculation).
- output.py: a step's tokens into text, stop strings, ends and answers (the one place a row finishes).
- text.py: tokens to text, stop strings, streamed deltas, token texts for log-probabilities.
- stats.py: what the engine reports, as data.

lockstep/ (between the engine and the ranks):
- step.py: the messages, `Step` out and `StepResult` back, by request id; no torch.
- wire.py: the one broadcast per step.
- executor.py: rank 0's executor (send, run, the failure rules) and the other ranks' `follow`.
- watchdog.py: a step that failed on some ranks only, found within seconds.

pipeline/ (pipeline parallelism: stages of tensor-parallel ranks, each a run of the layers):
- links.py: each step's hop to the next stage with its hidden states, and the sampled tokens back to rank 0.
- executor.py: rank 0's executor (`Pipeline`: up to pp steps in flight) and every other rank's `follow_stage`.
- liveness.py: every rank's beat and watch across hosts: a host that died or lost its link named within seconds.

runner/ (every rank; the only code that touches the step's tensors; never imports the engine):
- model_runner.py: this rank's block tables and one forward per step, its description built once before it.
- next_tokens.py: the rank that samples: scores to token ids (draws, drafts verified, log-probabilities), one sync.
- attention/: step.py (the step's layout and description every backend reads), backends.py (the table),
  sdpa.py, flex.py, varlen.py (one backend each).
- kv_cache.py: the KV pool, the cache object HF's forward writes through, the attention interface entry.
- adapters.py: paged attention for the families whose attention is inline (BLOOM, Falcon, MPT).
- probe.py: the start-up capability check and the pool's shapes.
- compiled.py: the decode step as one torch.compile graph (`--compile`).

startup/ (every rank, once): budget.py (the KV cache's size), weight_form.py (the weights' dtype and kernel).

types.py: the plain types the API and the engine share (Row, Result, the events, StopFlag) and the log line; no torch.
options.py: the settings (`ServeOptions`), and the contradictions among them refused before loading; no torch.
preflight.py: what needs no model (the backend on this device, the port, the directories), refused before the
server's imports and before any rank starts.
server.py: `serve()`, the one place that imports them all and ties them together.
offline.py: `autotp generate --pp N`: one prompt through the engine and its stages, without HTTP.

`serve` is imported on first use, so that the protocol modules of api/ import without torch.
"""

from __future__ import annotations

__all__ = ["serve"]


def __getattr__(name: str):
    if name == "serve":
        from autotp.serve.server import serve

        return serve
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
