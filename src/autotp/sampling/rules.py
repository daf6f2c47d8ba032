"""The sampling parameters' rules, shared by `autotp generate` (flags) and `autotp serve` (request fields).

One place decides what a temperature, top_p, top_k, seed or token budget may be, so the CLI and the
server accept and refuse the same values. No torch in here: the server checks requests with it before
any row reaches the ranks, and anything it lets through must be safe to sample with on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

# torch.Generator.manual_seed takes exactly this range (a negative seed wraps modulo 2**64); one beyond it
# raises "Overflow when unpacking long long" inside the batch, on every rank.
SEED_MIN, SEED_MAX = -2**63, 2**64 - 1
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
# Temperatures below this are greedy (as in vLLM, whose _SAMPLING_EPS is the same 1e-5): dividing scores
# by 1e-40 overflows float32 to inf and the softmax to NaN; below 1e-5 sampling is argmax in all but ties.
GREEDY_BELOW = 1e-5


class SamplingError(ValueError):
    """A parameter outside its range: `param` is its request field name, the message names the value."""

    def __init__(self, param: str, rule: str, value: object):
        self.param, self.rule, self.value = param, rule, value
        super().__init__(f"{param} {rule}, got {value}")


@dataclass(frozen=True)
class SamplingParams:
    """One row's draw: what the sampler (sampler.py) needs, and what `autotp serve` sends its ranks with a new row."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int = 0
    # llama.cpp's infill sampler after top-k and top-p (infill.py): the ids that end the row, EOT first; () off
    infill: tuple[int, ...] = ()
    infill_scaled: bool = False  # temperature comes before infill in the chain: infill sees the scaled probabilities


@dataclass(frozen=True)
class Sampling:
    temperature: float  # 0: greedy (also for a requested temperature below GREEDY_BELOW)
    top_p: float
    top_k: int  # 0: no top-k
    seed: int | None
    max_tokens: int


def check_sampling(*, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                   max_tokens: int = 16) -> Sampling:
    """The normalized parameters, or SamplingError for the first one out of range. NaN fails every check."""
    if not 0 <= temperature <= MAX_TEMPERATURE:
        raise SamplingError("temperature", f"must be between 0 and {MAX_TEMPERATURE:g}", temperature)
    if not 0 < top_p <= 1:
        raise SamplingError("top_p", "must be in (0, 1]", top_p)
    if top_k < 0:
        raise SamplingError("top_k", "must be at least 0 (0: off)", top_k)
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
        raise SamplingError("seed", f"must be between {SEED_MIN} and {SEED_MAX}", seed)
    if max_tokens < 1:
        raise SamplingError("max_tokens", "must be at least 1", max_tokens)
    return Sampling(0.0 if temperature < GREEDY_BELOW else float(temperature), float(top_p), top_k, seed,
                    max_tokens)
