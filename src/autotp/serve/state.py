"""The padded engine's batch as every rank holds it, and the forwards one step runs on it: the engine of
models whose attention does not reach transformers' AttentionInterface (BLOOM, Falcon, MPT: ALiBi computed
inline), which the paged engine (runner.py) cannot serve.

Every rank keeps the same `Batch` and changes it only through `apply(step)` and `run(step)`, with the
`Step` rank 0 broadcast (wire.py), so the ranks stay in lockstep without deciding anything themselves:

- `running`: rows that decode, one token each per step, in one padded cache (kv.PaddedBatch);
- `prefill`: at most one group of admitted rows whose prompts are being prefilled, `step.chunk` columns
  per step, in a cache of its own; once complete it joins `running` at the next step.

Per step, `apply` first moves a complete prefill into `running`, removes `step.drop` (finished,
cancelled or failed rows, and their memory with them) and starts `step.admit` as the new prefill; `run`
then does at most one prefill forward and one decode forward and returns their last-position logits.
Sampling is not here: rank 0 samples (engine.py) and sends the tokens in the next step; it takes the
prefill's scores between the two forwards, so a new row's first token does not wait for the decode. A
forward that raises leaves its cache half-updated, so its rows are discarded on every rank alike (`discard`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from transformers import DynamicCache

from autotp.serve.kv import PaddedBatch
from autotp.serve.runner import Scores
from autotp.serve.wire import Step


class Prefill:
    """Admitted prompts, left-padded to one width: ids and mask (rows, width), run `chunk` columns at a time."""

    def __init__(self, rows: list[int], prompts: list[tuple[int, ...]], pad: int, config, device: torch.device,
                 all_logits: bool = False):
        width = max(map(len, prompts))
        self.all_logits = all_logits  # every column's scores come back, not only the last one's
        self.ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=device)
        self.mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        # HF's rule for left padding: positions count the row's own tokens; padding sits at position 0
        self.positions = (self.mask.cumsum(1) - 1).masked_fill(self.mask == 0, 0)
        self.done = 0  # columns prefilled so far
        self.batch = PaddedBatch(list(rows), DynamicCache(config=config), self.mask[:, :0])

    @property
    def rows(self) -> list[int]:
        return self.batch.rows

    @property
    def complete(self) -> bool:
        return self.done == self.ids.shape[1]

    def keep(self, rows: list[int]) -> None:
        """Drop the other rows; columns stay (the prompt matrix and the cache keep one coordinate system)."""
        index = torch.tensor([self.rows.index(r) for r in rows], device=self.ids.device)
        self.ids, self.mask, self.positions = (t.index_select(0, index) for t in (self.ids, self.mask, self.positions))
        self.batch.select(rows, trim=False)


class Batch:
    """One rank's copy of the continuous batch (see the module docstring)."""

    def __init__(self, model, pad: int):
        self.model, self.pad = model, pad
        self.device = model.device
        self.takes_positions = "position_ids" in inspect.signature(model.forward).parameters
        self.running: PaddedBatch | None = None
        self.prefill: Prefill | None = None

    def order_after(self, drop: tuple[int, ...]) -> list[int]:
        """The running rows after `apply` with this drop list, in batch order (rank 0 lists tokens by it)."""
        rows = list(self.running.rows) if self.running is not None else []
        if self.prefill is not None and self.prefill.complete:
            rows += self.prefill.rows
        return [r for r in rows if r not in drop]

    def rows(self) -> list[int]:
        """Every row this rank holds memory for."""
        return (self.running.rows if self.running else []) + (self.prefill.rows if self.prefill else [])

    def apply(self, step: Step) -> None:
        if self.prefill is not None and self.prefill.complete:
            if self.running is None:
                self.running = self.prefill.batch
            else:
                self.running.extend(self.prefill.batch)
            self.prefill = None
        drop = set(step.drop)
        if self.running is not None and drop & set(self.running.rows):
            keep = [r for r in self.running.rows if r not in drop]
            if keep:
                self.running.select(keep)
            else:
                self.running = None
        if self.prefill is not None and drop & set(self.prefill.rows):
            keep = [r for r in self.prefill.rows if r not in drop]
            if keep:
                self.prefill.keep(keep)
            else:
                self.prefill = None
        if step.admit:
            rows, prompts = zip(*step.admit, strict=True)
            self.prefill = Prefill(list(rows), list(prompts), self.pad, self.model.config, self.device, step.all_logits)

    def run(self, step: Step, prefilled: Callable[[Scores], None] | None = None) -> Scores:
        """This step's forwards: raises what a forward raised, with the rows it ran already discarded.
        `prefilled(scores)` sees the prefill's scores before the decode forward starts (rank 0 samples
        there); the decode's are returned."""
        if step.chunk:
            group = self.prefill
            try:
                logits = self._prefill(group, step.chunk)
            except BaseException:
                self.prefill = None
                raise
            if prefilled is not None:
                prefilled(self._prefill_scores(group, logits))
        out = Scores(torch.empty(0), [])
        if step.tokens:
            rows = list(self.running.rows)
            positions = self.running.lengths().tolist()
            try:
                out.logits = self._decode(step.tokens)
            except BaseException:
                self.running = None
                raise
            out.spans = [(row, p, i, i + 1, True) for i, (row, p) in enumerate(zip(rows, positions, strict=True))]
        return out

    @staticmethod
    def _prefill_scores(group: Prefill, logits: torch.Tensor) -> Scores:
        """A chunk's scores (rows, columns, vocab): the left-padded group's last `columns` columns (the
        chunk's, or its last column alone) as each row's span of its own positions (padding columns left out)."""
        columns = logits.shape[1]
        spans = []
        for i, row in enumerate(group.rows):
            first = int((group.mask[i] == 0).sum())  # the row's tokens fill columns [first, width)
            lo = max(group.done - columns, first)
            if lo < group.done and (group.all_logits or group.complete):
                a = i * columns + lo - (group.done - columns)
                spans.append((row, lo - first, a, (i + 1) * columns, group.complete))
        return Scores(logits.reshape(-1, logits.shape[-1]), spans)

    def discard(self) -> None:
        self.running = self.prefill = None

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache,
                 keep: int = 1) -> torch.Tensor:
        """(rows, columns) ids -> (rows, keep, vocab) scores of the last `keep` columns (0: all of them)."""
        kwargs = dict(position_ids=positions) if self.takes_positions else {}
        with torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=keep,
                             **kwargs)
        return out.logits

    def _prefill(self, group: Prefill, chunk: int) -> torch.Tensor:
        a, b = group.done, min(group.done + chunk, group.ids.shape[1])
        scores = self._forward(group.ids[:, a:b], group.mask[:, :b], group.positions[:, a:b], group.batch.cache,
                               keep=0 if group.all_logits else 1)
        group.batch.mask, group.done = group.mask[:, :b], b
        return scores

    def _decode(self, tokens: tuple[int, ...]) -> torch.Tensor:
        running = self.running
        if len(tokens) != len(running.rows):
            raise RuntimeError(f"step has {len(tokens)} tokens for {len(running.rows)} running rows")
        positions = running.lengths()[:, None]
        ids = torch.tensor(tokens, device=self.device)[:, None]
        return self._forward(ids, running.grow(1), positions, running.cache)[:, -1]
