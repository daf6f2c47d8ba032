"""The one sampler against an oracle outside autotp: transformers' own logits warpers.

`RowSampler.warp` must give, on the same scores, exactly the logits that HF `generate` samples from with
TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper in that order (its `do_sample=True` path):
the same tokens excluded, the same values bit for bit. Scores with ties (equal logits across the top-k
and top-p cuts) and top-p values that fall exactly on a cumulative probability are included, since
that is where two implementations of "the same rule" part.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from autotp.sampling.rules import SamplingParams
from autotp.sampling.sampler import RowSampler


def hf(scores: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers(torch.zeros(1, 1, dtype=torch.long), scores.float()[None].clone())[0]


def scores_cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    cases = [torch.randn(101, generator=g) * s for s in (0.5, 2.0, 8.0)]
    cases.append(torch.tensor([2.0, 2.0, 2.0, 1.0, 1.0, 1.0, 0.0, 0.0]))  # ties across every cut
    cases.append(torch.log(torch.tensor([0.5, 0.25, 0.125, 0.125])))  # cumulative 0.5, 0.75, 0.875, 1: exact cuts
    cases.append(torch.full((16,), 3.0))  # all equal
    cases.append(torch.randn(49152, generator=g).to(torch.bfloat16))  # a StarCoder vocabulary, bf16 scores
    return cases


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
@pytest.mark.parametrize("top_k", [0, 1, 3, 7, 200])
@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.75, 0.5, 0.125, 1e-9])
def test_the_sampler_warps_scores_as_transformers_does(temperature, top_k, top_p):
    for scores in scores_cases():
        mine = RowSampler(SamplingParams(temperature, top_p, top_k, seed=0)).warp(scores)
        theirs = hf(scores, temperature, top_k, top_p)
        assert torch.equal(torch.isinf(mine), torch.isinf(theirs)), (scores[:8], mine[:8], theirs[:8])
        assert torch.equal(mine, theirs)


def test_draws_follow_the_warped_distribution():
    """pick() draws from softmax(warp(scores)): over many seeded draws, no excluded token ever comes out and
    the frequencies match the probabilities (a 0.25-probability token: 4000 draws, within 4 %)."""
    scores = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625]))
    counts = torch.zeros(5)
    for seed in range(4000):
        counts[RowSampler(SamplingParams(1.0, 0.8, 0, seed)).pick(scores)] += 1
    # top_p 0.8: 0.5 + 0.25 = 0.75 < 0.8, so the third token (0.125) is kept too; renormalized over 0.875
    assert counts[3:].sum() == 0
    assert counts[:3] / 4000 == pytest.approx(torch.tensor([0.5, 0.25, 0.125]) / 0.875, abs=0.04)
