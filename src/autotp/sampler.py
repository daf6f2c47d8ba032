"""The one per-row sampler: `autotp generate`, the library's `generate` helper and `autotp serve` draw here.

A row's draw depends only on its scores, its parameters and its own seeded generator, never on the other
rows of a batch, so the same prompt, parameters and seed give the same text through every front end
(the CLI and the helper run it as an HF logits processor, the server calls it in its own decode loop).
Order as in HF: temperature, then top-k, then top-p (nucleus), then one multinomial draw.

A row whose scores are NaN or +inf anywhere, or all -inf, cannot be sampled (nor argmax'ed meaningfully):
`pick` reports it as failed instead of raising, so one bad row never takes its batch down. The rules on
the parameters' ranges are autotp.sampling's; anything they let through is safe here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessor


class SampleError(Exception):
    """This row's scores cannot be sampled; the message says why (the same on every rank)."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int = 0


class RowSampler:
    """One row's draws: scores (vocab,) -> token id, from the row's own generator seeded once."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu"):
        self.params = params
        self.generator = None
        if params.temperature > 0:
            self.generator = torch.Generator(device=device).manual_seed(params.seed)

    def warp(self, scores: torch.Tensor) -> torch.Tensor:
        """scores (vocab,) -> the logits the draw's softmax takes, -inf where top-k or top-p exclude a token:
        transformers' TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper (min_tokens_to_keep 1),
        operation for operation, so the same scores give the same distribution bit for bit, ties and top-p
        boundaries included (tests/test_sampler_oracle.py). Temperatures below sampling.GREEDY_BELOW never
        reach here (greedy), so scores / temperature stays finite."""
        p = self.params
        logits = scores.float() / p.temperature
        if 0 < p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1:
            # nucleus: ascending, drop the tokens whose cumulative probability is <= 1 - top_p, keep the likeliest
            ordered, order = torch.sort(logits, descending=False)
            drop = ordered.softmax(dim=-1).cumsum(dim=-1) <= (1 - p.top_p)
            drop[-1] = False
            logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
        return logits

    def pick(self, scores: torch.Tensor) -> int:
        """The next token; SampleError when the scores cannot give one."""
        top = scores.max().float()  # NaN anywhere makes the max NaN
        if not torch.isfinite(top):
            raise SampleError(f"the model's scores for this prompt are not finite (max {top.item()})")
        if self.generator is None:
            return int(scores.argmax())
        probs = torch.softmax(self.warp(scores), dim=-1)
        try:
            return int(torch.multinomial(probs, 1, generator=self.generator))
        except RuntimeError as e:  # same scores, same error on every rank
            raise SampleError(f"sampling failed: {e}".splitlines()[0]) from None


class SamplerProcessor(LogitsProcessor):
    """RowSampler inside HF `generate` (run with do_sample=False): scores (batch, vocab) -> a one-hot of
    each row's draw, so HF's argmax picks exactly that token. A row that cannot be sampled raises."""

    def __init__(self, params: SamplingParams, batch: int, device: torch.device | str = "cpu"):
        self.rows = [RowSampler(params, device) for _ in range(batch)]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        out = torch.full_like(scores, float("-inf"))
        for i, row in enumerate(self.rows):
            out[i, row.pick(scores[i])] = 0
        return out
