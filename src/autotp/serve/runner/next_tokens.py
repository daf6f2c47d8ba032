"""Each request's next tokens from a step's scores, on the rank that samples: draws, drafts verified, log-probabilities.

The runner keeps the logits; here they become token ids (lockstep/step.Sampled), so nothing above the runner ever
touches a tensor. Per step:

- a plain sampling request (its last column): one draw from its own seeded sampler (sampling/sampler.py);
- a request that ran a draft d1 .. dm after its last token: column i scores the token after d_i (d_0 its last token).
  Its sampler draws at each column in turn, exactly as it would have one step at a time, and the tokens it keeps run
  to the first one that differs from the draft, which is kept too: the text is the text without a draft, and the
  draft only saves the forwards of the tokens it guessed. A sampling request's generator is put back to its state
  after the last column it keeps, as if the others had never been drawn;
- log-probabilities (the model's own: log-softmax of its scores, before any sampling parameter) of each token drawn,
  and of prompt tokens where a request asked for them (the column at position j scores the prompt's token j + 1).

Everything is computed on the device and read back in one host sync per step (on CUDA a `.tolist()` waits for the
device: one wait, not one per row), but for a request with llama.cpp's infill sampler in its chain (llama.vim's):
its candidates are read back to the host, one more wait per such request and step (sampler.RowSampler.draw_infill).
The index arrays it needs cross to the device with the step's own (`plan`, before the forward). What one group of
requests raises here (an allocation for a long prompt's scores) fails those requests only, with their error in their
`Sampled`; the ranks ran the same forward, so they stay in lockstep.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from autotp.errors import one_line
from autotp.sampling import infill
from autotp.sampling.sampler import RowSampler, SampleError, draws, read
from autotp.serve.lockstep.step import NewRequest, Sampled, StepResult
from autotp.serve.types import TokenLogprob


class Span(NamedTuple):
    """A request's kept columns in a step's scores: logits[a:b], the first at position `position`; sample: the last
    gives its next token; draft: its last tokens that were a draft to verify."""

    id: int
    position: int
    a: int
    b: int
    sample: bool
    draft: tuple[int, ...] = ()


@dataclass
class Sampling:
    """What a request samples with: its sampler, the alternatives it wants per token (None: no log-probabilities),
    its prompt where it asked for the prompt's log-probabilities, and how many prompt positions are scored so far."""

    sampler: RowSampler
    logprobs: int | None
    prompt: tuple[int, ...] = ()
    scored: int = 0


def logprob_rows(scores: torch.Tensor, tokens: torch.Tensor, k: int) -> list[torch.Tensor]:
    """scores (n, vocab) and the token taken at each (n,), on the device -> [chosen (n,), top values (n, k), top ids
    (n, k)]: each token's log-probability and the k likeliest alternatives'."""
    lp = torch.log_softmax(scores.float(), dim=-1)
    chosen = lp.gather(1, tokens[:, None])[:, 0]
    values, ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    return [chosen, values, ids]


def read_logprobs(values: list[float], tokens: list[int], tops: list[int], k: int) -> list[TokenLogprob]:
    """logprob_rows' tensors, read back flat (chosen, then values, then ids) -> a TokenLogprob per token with its
    tops[i] alternatives."""
    n = len(tokens)
    chosen, top, ids = values[:n], values[n:n + n * k], values[n + n * k:n + 2 * n * k]
    return [TokenLogprob(t, chosen[i], tuple(zip(map(int, ids[i * k:i * k + tops[i]]), top[i * k:i * k + tops[i]],
                                                 strict=True)))
            for i, t in enumerate(tokens)]


@dataclass
class Plan:
    """A step's sampling work, fixed on the host before the forward: the spans that draw plainly (`plain`; `want`:
    the indices into it of those with log-probabilities), those that verify a draft (`drafted`), and the prompt
    positions to score (`scoring`: each span and its positions; `targets`: the prompt token each position scores)."""

    plain: list[Span] = field(default_factory=list)
    want: list[int] = field(default_factory=list)
    drafted: list[Span] = field(default_factory=list)
    scoring: list[tuple[Span, range]] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)

    def arrays(self) -> list[np.ndarray]:
        """What take() reads on the device, as host arrays for the step's one copy: [each plain span's last column,
        want, each scored position's column, its target]."""
        columns = [s.a + j - s.position for s, positions in self.scoring for j in positions]
        return [np.array([s.b - 1 for s in self.plain], dtype=np.int64), np.array(self.want, dtype=np.int64),
                np.array(columns, dtype=np.int64), np.array(self.targets, dtype=np.int64)]


class Group:
    """Some requests' device work, read back at the step's one sync (`values`), or why it failed (`failed`)."""

    def __init__(self, ids: list[int]):
        self.ids, self.tensors, self.failed, self.values, self.k = ids, [], "", [], 0
        self.scores: torch.Tensor | None = None  # a plain group's: its rows' scores
        self.states: list = []  # a drafted group's: its generator's state before each column and after the last

    def size(self) -> int:
        return sum(t.numel() for t in self.tensors)


class NextTokens:
    """The sampling rank's requests (`add` when new, `drop` when they end) and their next tokens (`plan`, `take`)."""

    def __init__(self, device: torch.device, tokenizer=None):
        self.device = device
        self.requests: dict[int, Sampling] = {}
        self.tokenizer = tokenizer  # the infill sampler's token texts come from it, once, when a request first asks
        self.pieces: list[bytes] | None = None

    def add(self, new: NewRequest) -> None:
        if new.sampling.infill and self.pieces is None and self.tokenizer is not None:
            self.pieces = infill.token_bytes(self.tokenizer)
        self.requests[new.id] = Sampling(RowSampler(new.sampling, self.device, self.pieces), new.logprobs, new.prompt)

    def drop(self, request: int) -> None:
        self.requests.pop(request, None)

    def plan(self, spans: list[Span]) -> Plan:
        plan = Plan()
        for s in spans:
            r = self.requests[s.id]
            if s.sample and s.draft:
                plan.drafted.append(s)
            elif s.sample:
                if r.logprobs is not None:
                    plan.want.append(len(plan.plain))
                plan.plain.append(s)
            if r.prompt:
                positions = range(max(s.position, r.scored), min(s.position + s.b - s.a, len(r.prompt) - 1))
                if positions:
                    plan.scoring.append((s, positions))
                    plan.targets += [r.prompt[j + 1] for j in positions]
        return plan

    def take(self, logits: torch.Tensor, plan: Plan, last: torch.Tensor, want: torch.Tensor, columns: torch.Tensor,
             targets: torch.Tensor) -> StepResult:
        """logits (kept, vocab); last, want, columns, targets: plan.arrays() on the device. -> each request's
        Sampled, read back in one host sync."""
        groups = [self._group([s.id for s, _ in plan.scoring],
                              lambda g: self._prompt(g, logits, plan, columns, targets))]
        groups.append(self._group([s.id for s in plan.plain], lambda g: self._plain(g, logits, plan, last)))
        groups.append(self._group([plan.plain[i].id for i in plan.want],
                                  lambda g: self._plain_logprobs(g, groups[1], plan, want)))
        groups += [self._group([s.id], lambda g, s=s: self._drafted(g, logits, s)) for s in plan.drafted]
        live = [g for g in groups if not g.failed and g.tensors]
        flat = torch.cat([t.double().reshape(-1) for g in live for t in g.tensors]).tolist() if live else []
        out: dict[int, Sampled] = {}
        at = 0
        for g in live:
            g.values, at = flat[at:at + g.size()], at + g.size()
        self._read_prompt(groups[0], plan, out)
        self._read_plain(groups[1], groups[2], plan, out)
        for g, s in zip(groups[3:], plan.drafted, strict=True):
            self._read_drafted(g, s, out)
        return StepResult(out)

    @staticmethod
    def _group(ids: list[int], build) -> Group:
        """A group of requests' device work, built now: what it raises is its requests' failure alone."""
        group = Group(ids)
        if ids:
            try:
                build(group)
            except Exception as e:  # noqa: BLE001 - one request must not take the server down
                group.failed = f"generation failed: {one_line(e, 200)}"
        return group

    def _prompt(self, group: Group, logits: torch.Tensor, plan: Plan, columns: torch.Tensor,
                targets: torch.Tensor) -> None:
        group.k = max(self.requests[s.id].logprobs or 0 for s, _ in plan.scoring)
        group.tensors = logprob_rows(logits.index_select(0, columns), targets, group.k)

    def _plain(self, group: Group, logits: torch.Tensor, plan: Plan, last: torch.Tensor) -> None:
        samplers = [self.requests[s.id].sampler for s in plan.plain]
        group.scores = logits.index_select(0, last)
        group.tensors = [draws(samplers, group.scores)]

    def _plain_logprobs(self, group: Group, plain: Group, plan: Plan, want: torch.Tensor) -> None:
        if plain.failed:
            return
        k = max(self.requests[plan.plain[i].id].logprobs for i in plan.want)
        tokens = plain.tensors[0][:, 0].long().index_select(0, want)
        group.tensors, group.k = logprob_rows(plain.scores.index_select(0, want), tokens, k), k

    def _drafted(self, group: Group, logits: torch.Tensor, span: Span) -> None:
        r = self.requests[span.id]
        scores = logits[span.a:span.b]
        generator = r.sampler.generator
        if generator is None:
            drawn = draws([r.sampler] * (span.b - span.a), scores)
        else:  # column by column, each generator state kept (on CUDA: its seed and offset, no sync)
            group.states, columns = [generator.get_state()], []
            for i in range(span.b - span.a):
                columns.append(draws([r.sampler], scores[i:i + 1]))
                group.states.append(generator.get_state())
            drawn = torch.cat(columns)
        group.tensors = [drawn]
        if r.logprobs is not None:
            group.tensors += logprob_rows(scores, drawn[:, 0].long(), r.logprobs)

    def _read_prompt(self, group: Group, plan: Plan, out: dict[int, Sampled]) -> None:
        if not plan.scoring:
            return
        if group.failed:
            out.update((s.id, Sampled(s.id, (), error=group.failed)) for s, _ in plan.scoring)
            return
        tops = [self.requests[s.id].logprobs or 0 for s, positions in plan.scoring for _ in positions]
        entries = iter(read_logprobs(group.values, plan.targets, tops, group.k))
        for s, positions in plan.scoring:
            out[s.id] = Sampled(s.id, (), prompt_logprobs=tuple(next(entries) for _ in positions))
            self.requests[s.id].scored = positions.stop

    def _read_plain(self, group: Group, logprobs: Group, plan: Plan, out: dict[int, Sampled]) -> None:
        if not plan.plain:
            return
        picks = read([group.values[i:i + 4] for i in range(0, len(group.values), 4)]) if not group.failed else []
        tokens = {}
        for i, s in enumerate(plan.plain):
            pick = picks[i] if picks else None
            error = group.failed or (str(pick) if isinstance(pick, SampleError) else "")
            tokens[i] = None if error else pick
            prior = out.get(s.id, Sampled(s.id, ()))
            out[s.id] = prior._replace(error=prior.error or error)
        entries = {}
        if plan.want and not logprobs.failed and not group.failed:
            chosen = [tokens[i] if tokens[i] is not None else 0 for i in plan.want]
            tops = [self.requests[plan.plain[i].id].logprobs for i in plan.want]
            entries = dict(zip(plan.want, read_logprobs(logprobs.values, chosen, tops, logprobs.k), strict=True))
        for i, s in enumerate(plan.plain):
            prior = out[s.id]
            if prior.error or tokens[i] is None:
                continue
            if i in plan.want and logprobs.failed:
                out[s.id] = prior._replace(error=logprobs.failed)
                continue
            out[s.id] = prior._replace(tokens=(tokens[i],), logprobs=(entries[i],) if i in entries else ())

    def _read_drafted(self, group: Group, span: Span, out: dict[int, Sampled]) -> None:
        prior = out.get(span.id, Sampled(span.id, ()))
        if group.failed:
            out[span.id] = prior._replace(error=prior.error or group.failed)
            return
        r, n = self.requests[span.id], span.b - span.a
        drawn = read([group.values[i * 4:i * 4 + 4] for i in range(n)])
        used = 0
        for i, token in enumerate(drawn):  # to the first token that is not the draft's next one, included
            used = i + 1
            if isinstance(token, SampleError) or i == len(span.draft) or token != span.draft[i]:
                break
        if r.sampler.generator is not None:
            r.sampler.generator.set_state(group.states[used])
        tokens = [t for t in drawn[:used] if not isinstance(t, SampleError)]
        error = next((str(t) for t in drawn[:used] if isinstance(t, SampleError)), "")
        entries: tuple[TokenLogprob, ...] = ()
        if r.logprobs is not None and tokens:
            ids = tokens + [0] * (n - len(tokens))  # the columns past the kept ones are read and dropped
            entries = tuple(read_logprobs(group.values[n * 4:], ids, [r.logprobs] * n, r.logprobs)[:len(tokens)])
        out[span.id] = prior._replace(tokens=tuple(tokens), logprobs=entries, error=prior.error or error)
