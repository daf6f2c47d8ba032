"""The one per-row sampler: `autotp generate`, the library's `generate` helper and `autotp serve` draw here.

A row's draw depends only on its scores, its parameters and its own seeded generator, never on the other
rows of a batch, so the same prompt, parameters and seed give the same text through every front end
(the CLI and the helper run it as an HF logits processor, the server calls it in its own decode loop).
Order as in HF: temperature, then top-k, then top-p (nucleus), then one multinomial draw; where a row asks for it,
llama.cpp's infill sampler (infill.py) decides after top-p which candidates stay (`RowSampler.draw_infill`).

A row whose scores are NaN or +inf anywhere, or all -inf, cannot be sampled (nor argmax'ed meaningfully):
`pick` reports it as failed instead of raising, so one bad row never takes its batch down. The rules on
the parameters' ranges are sampling/rules.py's; anything they let through is safe here.

On CUDA every `.item()` or `.tolist()` waits for the device. `sample` draws a batch of rows with one such wait
(each row's draw, its check and the greedy rows' argmax stay on the device until then), and never hands
multinomial a distribution it would refuse: on CUDA that is a device-side assert, which ends the process.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

from autotp.sampling import infill
from autotp.sampling.rules import SamplingParams


class SampleError(Exception):
    """This row's scores cannot be sampled; the message says why (the same on every rank)."""


class RowSampler:
    """One row's draws: scores (vocab,) -> token id, from the row's own generator seeded once."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu", pieces: list[bytes] | None = None):
        self.params = params
        self.pieces = pieces  # each id's text, for llama.cpp's infill sampler (infill.py) where params.infill asks
        self.generator = None
        if params.temperature > 0:
            self.generator = torch.Generator(device=device).manual_seed(params.seed)

    def warp(self, scores: torch.Tensor, temperature: float | None = None) -> torch.Tensor:
        """scores (vocab,) -> the logits the draw's softmax takes, -inf where top-k or top-p exclude a token:
        transformers' TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper (min_tokens_to_keep 1),
        operation for operation, so the same scores give the same distribution bit for bit, ties and top-p
        boundaries included (tests/test_sampler_oracle.py). Temperatures below sampling.GREEDY_BELOW never
        reach here (greedy; the infill sampler's candidates are top-k's and top-p's at `temperature` 1), so
        scores / temperature stays finite."""
        p = self.params
        logits = scores.float() / (p.temperature if temperature is None else temperature)
        if 0 < p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1:
            # nucleus: ascending, drop the tokens whose cumulative probability is <= 1 - top_p, keep the likeliest
            ordered, order = torch.sort(logits, descending=False)
            drop = ordered.softmax(dim=-1).cumsum(dim=-1) <= (1 - p.top_p)
            drop[-1:].zero_()  # the likeliest stays: a device op (a Python False written in would cross from the host)
            logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
        return logits

    def pick(self, scores: torch.Tensor) -> int:
        """The next token; SampleError when the scores cannot give one."""
        token = sample([self], scores[None])[0]
        if isinstance(token, SampleError):
            raise token
        return token

    def draw(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A sampling row's draw from scores (vocab,), on their device with no host sync: (token, ok). Where the
        warped distribution is not one multinomial takes (NaN or inf in it), it draws from a uniform one instead
        and ok is False (the row fails; CPU's multinomial would raise, CUDA's would assert on the device)."""
        probs = torch.softmax(self.warp(scores), dim=-1)
        ok = torch.isfinite(probs).all() & (probs >= 0).all()
        usable = torch.where(ok, probs, torch.ones_like(probs))
        return torch.multinomial(usable, 1, generator=self.generator)[0], ok

    def draw_infill(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A draw with llama.cpp's infill sampler after top-k and top-p (infill.py), or None where no score is
        finite (the plain draw reports the row's failure). It reads the candidates back to the host: one wait
        for the device per infill row and step. Which candidates stay is decided on their temperature-1
        probabilities (llama-server's chains put temperature after infill, llama.vim's has none), or on the row's
        temperature's where the chain put temperature first (`infill_scaled`); what stays is drawn from at the row's
        temperature, or, greedy, the likeliest is taken."""
        if self.pieces is None:
            raise RuntimeError("the infill sampler needs the tokenizer's token texts, which this runner was not given")
        greedy = self.generator is None
        warped = self.warp(scores, 1.0 if greedy else None)
        ids = torch.nonzero(torch.isfinite(warped))[:, 0]
        raw = (warped if self.params.infill_scaled else scores.float()).index_select(0, ids)
        values = raw.tolist()
        if not values:  # no finite score at all: the plain draw fails the row
            return None
        kept = infill.keep(ids.tolist(), values, self.params.infill, self.pieces)
        ok = torch.ones((), dtype=torch.bool, device=scores.device)
        if greedy or len(kept) == 1:  # kept is likeliest first; a lone EOT may be no candidate at all
            return torch.tensor(kept[0], device=scores.device), ok
        chosen = torch.tensor(kept, device=scores.device)
        logits = torch.full_like(warped, float("-inf")).index_copy(0, chosen, warped.index_select(0, chosen))
        return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=self.generator)[0], ok


INVALID = "probability tensor contains either `inf`, `nan` or element < 0"  # what CPU's multinomial says


def sample(rows: list[RowSampler], scores: torch.Tensor) -> list[int | SampleError]:
    """Each row's next token from its scores (rows, vocab), or the SampleError that fails it, with one host sync
    for the batch."""
    return read(draws(rows, scores).tolist())


def draws(rows: list[RowSampler], scores: torch.Tensor) -> torch.Tensor:
    """What `sample` reads, left on the device (no host sync): (rows, 4) float64 of token, finite, drawn and the
    scores' max. Greedy rows take the batch's argmax; sampling rows draw in turn, each from its own generator."""
    top = scores.max(dim=-1).values.float()  # NaN anywhere makes the max NaN
    tokens = scores.argmax(dim=-1)
    ok = torch.isfinite(top)
    drawn = ok.clone()
    for i, row in enumerate(rows):
        infilled = row.draw_infill(scores[i]) if row.params.infill else None
        if infilled is not None:
            tokens[i], drawn[i] = infilled
        elif row.generator is not None:
            tokens[i], drawn[i] = row.draw(scores[i])
    return torch.stack([tokens.double(), ok.double(), drawn.double(), top.double()], dim=1)


def read(picks: list[list[float]]) -> list[int | SampleError]:
    """`draws`' rows, once on the host -> each row's token or SampleError."""
    out: list[int | SampleError] = []
    for token, finite, drawn, best in picks:
        if not finite:
            out.append(SampleError(f"the model's scores for this prompt are not finite (max {best})"))
        elif not drawn:
            out.append(SampleError(f"sampling failed: {INVALID}"))
        else:
            out.append(int(token))
    return out


class SamplerProcessor(LogitsProcessor):
    """RowSampler inside HF `generate` (run with do_sample=False): scores (batch, vocab) -> a one-hot of
    each row's draw, so HF's argmax picks exactly that token. A row that cannot be sampled raises."""

    def __init__(self, params: SamplingParams, batch: int, device: torch.device | str = "cpu"):
        self.rows = [RowSampler(params, device) for _ in range(batch)]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        out = torch.full_like(scores, float("-inf"))
        tokens = sample(self.rows, scores)
        failed = next((t for t in tokens if isinstance(t, SampleError)), None)
        if failed is not None:
            raise failed
        out[torch.arange(len(tokens), device=out.device), torch.tensor(tokens, device=out.device)] = 0
        return out
