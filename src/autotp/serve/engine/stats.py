"""What the engine reports, as data: each step's `StepStats` and, at any time, its `Load`. The serving layer turns
them into Prometheus (api/metrics.py) and into SGLang's load report (api/router_api.py); the engine never formats
them (vLLM's IterationStats and SchedulerStats)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Ended:
    """A row that finished with its answer."""

    reason: str  # "stop" or "length"
    prompt_tokens: int
    generation_tokens: int
    seconds: float  # from its arrival to its last token


@dataclass
class StepStats:
    """One step of the engine: the latencies of the tokens it produced, the rows it finished, and what its prefix
    cache and drafts saved."""

    first_tokens: list[float] = field(default_factory=list)  # a row's first token: seconds since its arrival
    inter_tokens: list[float] = field(default_factory=list)  # a later token: seconds since the row's previous one
    ended: list[Ended] = field(default_factory=list)
    prefix_queried: int = 0  # prompt tokens of rows admitted, looked up in the prefix cache
    prefix_hit: int = 0  # ... and found there (not computed again)
    drafted: int = 0  # prompt-lookup draft tokens verified
    accepted: int = 0  # ... that the rows' samplers drew too (each one a forward saved)


@dataclass(frozen=True)
class Load:
    """The engine now: rows running (decoding or being prefilled) and waiting, the KV slots the running rows hold,
    the slots per rank, and the waiting rows' prompt tokens."""

    running: int = 0
    waiting: int = 0
    kv_used: int = 0
    kv_tokens: int = 1
    waiting_tokens: int = 0
