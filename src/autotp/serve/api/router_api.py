"""The routes SGLang's router (PyPI `sglang-router`) reads from each worker, answered by `autotp serve`.

Several `autotp serve` replicas behind `python -m sglang_router.launch_router --policy cache_aware` keep each user
on the replica that holds their prefix; the router asks each worker for (sgl-model-gateway's
`discover_metadata.rs`, `worker_manager.rs`):

- `GET /server_info` (and the older `/get_server_info`) at registration: `served_model_name` (the router's model
  id for the worker; without it, "unknown"), `model_path` (where the router loads a tokenizer from), `tp_size`,
  `dp_size`, and the budgets SGLang's server reports under its names (`max_running_requests`,
  `max_total_tokens`, `max_prefill_tokens`, `context_length`);
- `GET /model_info` (`/get_model_info`): `model_path`, `tokenizer_path`, `is_generation`, `model_type`,
  `architectures`;
- `GET /get_load` (`power_of_two`, every few seconds): one entry per data-parallel rank (autotp has one),
  `{dp_rank, num_reqs, num_waiting_reqs, num_tokens}`; the router sums `num_tokens`. Counted as SGLang's
  scheduler counts them: the KV slots running rows hold plus the tokens of the prompts waiting;
- `POST /flush_cache` (no body): empties the prefix cache, or is refused with 400 while requests run or wait,
  as SGLang refuses it (engine/loop.Engine.flush_cache).

No torch and no HTTP framework here: http.py serves these bodies, behind the same API key as /v1/*.
"""

from __future__ import annotations

from dataclasses import dataclass

import autotp
from autotp.serve.api.boundary import ApiError, Served
from autotp.serve.engine.stats import Load


@dataclass(frozen=True)
class Facts:
    """What start-up knows about this server that the router asks for (server.py fills it in)."""

    model_path: str  # --model as given: a hub id, or a directory's absolute path
    tokenizer_path: str | None  # the local directory the tokenizer was read from
    model_type: str
    architectures: tuple[str, ...]
    tp_size: int
    pp_size: int
    max_running_requests: int  # --max-num-seqs
    max_prefill_tokens: int  # --max-num-batched-tokens


def server_info(served: Served, facts: Facts, max_queue: int) -> dict:
    return {"served_model_name": served.model_id, "model_path": facts.model_path,
            "tokenizer_path": facts.tokenizer_path, "tp_size": facts.tp_size, "pp_size": facts.pp_size, "dp_size": 1,
            "context_length": served.max_model_len, "max_total_tokens": served.kv_tokens,
            "max_running_requests": facts.max_running_requests, "max_prefill_tokens": facts.max_prefill_tokens,
            "max_queued_requests": max_queue, "version": autotp.__version__, "server": "autotp"}


def model_info(served: Served, facts: Facts) -> dict:
    return {"model_path": facts.model_path, "tokenizer_path": facts.tokenizer_path, "is_generation": True,
            "model_type": facts.model_type, "architectures": list(facts.architectures),
            "served_model_name": served.model_id, "max_context_length": served.max_model_len}


def load(now: Load) -> list[dict]:
    """SGLang's load report from the engine's Load: every request it holds, running or waiting, and the KV slots
    the running ones hold plus the waiting prompts' tokens."""
    return [{"dp_rank": 0, "num_reqs": now.running + now.waiting, "num_waiting_reqs": now.waiting,
             "num_tokens": now.kv_used + now.waiting_tokens}]


def flushed(blocks: int | None) -> dict:
    """The answer to POST /flush_cache: blocks forgotten, or None when requests were running (400, SGLang's
    status for a flush it did not do)."""
    if blocks is None:
        raise ApiError(400, "the prefix cache was not flushed: requests are running or waiting; retry when the "
                            "server is idle", code="server_busy")
    return {"flushed": True, "blocks": blocks}
