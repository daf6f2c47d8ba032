"""The model runner of the paged engine: one forward per step over every row's new tokens.

Every rank keeps the block tables of the rows it runs, changed only by the steps rank 0 broadcasts
(`apply`), and runs each step the same way (`run`): the rows' new tokens flattened into one (1, tokens)
input with their positions, each token's slot from its row's table, and the step's attention layout
(paged.Layout). Only the positions rank 0 asked for reach the LM head (`logits_to_keep`): a sampling
row's last one, every one of a row that wants its prompt's log-probabilities.

Nothing here decides anything; a forward that raises leaves the rows' new slots half written, so rank 0
fails those rows on every rank alike and their blocks are never cached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autotp.serve.compiled import CompiledDecode, decode_layout
from autotp.serve.paged import ATTENTION, KvPool, Layout, PagedCache
from autotp.serve.wire import Step


@dataclass
class Scores:
    """What a step's forward scored. logits (kept, vocab); per row that kept any, a span: (row, position
    of its first kept column, a, b, sample) with its columns at logits[a:b]; `sample`: the last of them
    gives the row's next token."""

    logits: torch.Tensor
    spans: list[tuple[int, int, int, int, bool]]

    def sampled(self, spans: list[tuple]) -> tuple[list[int], torch.Tensor]:
        """The rows of `spans` (some of `self.spans` that sample), and their last column's scores (rows, vocab)."""
        picks = [(s[0], s[3] - 1) for s in spans]
        index = torch.tensor([i for _, i in picks], device=self.logits.device, dtype=torch.long)
        return [r for r, _ in picks], self.logits.index_select(0, index)


class PagedBatch:
    """One rank's rows of the paged engine: their block tables (see the module docstring)."""

    def __init__(self, model, pool: KvPool):
        self.model, self.pool = model, pool
        self.device = model.device
        self.tables: dict[int, list[int]] = {}
        self.graph: CompiledDecode | None = None  # compile()
        self.compiled: CompiledDecode | None = None  # the graph, once every rank has one (server._compile)

    def compile(self) -> float:
        """Compile the decode step (compiled.py); the seconds warm-up took. Every rank calls it at once; raises
        what the compiler raised. Later decode steps take the graph once `compiled` is set (server.py)."""
        self.graph = CompiledDecode(self._forward, self.device)
        return self.graph.warm_up(self.pool, self.device)

    def rows(self) -> list[int]:
        return list(self.tables)

    def apply(self, step: Step) -> None:
        for row in step.drop:
            self.tables.pop(row, None)
        for row, _, _, blocks, _, _ in step.work:
            self.tables.setdefault(row, []).extend(blocks)

    def discard(self, rows) -> None:
        for row in rows:
            self.tables.pop(row, None)

    def run(self, step: Step, prefilled=None) -> Scores:
        """The step's forward. Raises what it raised, with its rows' tables already gone. prefilled: the
        padded engine's early look at its prefill's scores (state.Batch.run); one forward has none."""
        try:
            return self._run(step)
        except BaseException:
            self.discard([w[0] for w in step.work])
            raise

    def _slots(self, row: int, end: int) -> torch.Tensor:
        """(end,) the slots of a row's positions 0 .. end - 1."""
        size = self.pool.block_size
        table = torch.tensor(self.tables[row][:-(-end // size)], device=self.device)
        return (table[:, None] * size + torch.arange(size, device=self.device)).flatten()[:end]

    def _decode_slots(self, rows: list[int], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows computing one token each, at positions `starts`: their context slots (rows, longest), the zero
        slot where a row is shorter, and its mask (rows, longest); built at once from their block tables."""
        size, device = self.pool.block_size, self.device
        blocks = max(starts) // size + 1
        table = torch.tensor([(self.tables[r][:blocks] + [0] * blocks)[:blocks] for r in rows], device=device)
        longest = max(starts) + 1
        slots = (table[:, :, None] * size + torch.arange(size, device=device)).flatten(1)[:, :longest]
        mask = torch.arange(longest, device=device)[None] <= torch.tensor(starts, device=device)[:, None]
        return slots.masked_fill(~mask, self.pool.slots), mask

    def _decode(self, step: Step) -> Scores | None:
        """A step whose rows each sample one token, through the compiled graph; None for any other step."""
        if self.compiled is None or not all(len(w[1]) == 1 and w[4] and not w[5] for w in step.work):
            return None
        layout, rows = decode_layout(self.pool, [self.tables[w[0]] for w in step.work], [w[2] for w in step.work],
                                     self.device)
        ids = torch.tensor([[w[1][0] for w in step.work] + [0] * (rows - len(step.work))], device=self.device)
        logits = self.compiled(ids, layout)
        return Scores(logits, [(w[0], w[2], i, i + 1, True) for i, w in enumerate(step.work)])

    def _run(self, step: Step) -> Scores:
        scores = self._decode(step)
        if scores is not None:
            return scores
        ids, positions, keep, spans, prefill = [], [], [], [], []
        decode, decode_rows, starts = [], [], []  # the rows that compute one token: its index in ids, ...
        for row, tokens, start, _, sample, every in step.work:
            a, n = len(ids), len(tokens)
            ids += tokens
            positions += range(start, start + n)
            if n == 1:
                decode.append(a)
                decode_rows.append(row)
                starts.append(start)
            else:
                prefill.append((a, a + n, self._slots(row, start + n), start))
            if every or sample:
                first = a if every else a + n - 1
                spans.append((row, positions[first], len(keep), len(keep) + a + n - first, sample))
                keep += range(first, a + n)
        write = torch.empty(len(ids), dtype=torch.long, device=self.device)  # each new token's slot
        for a, b, slots, start in prefill:
            write[a:b] = slots[start:]
        layout = Layout(write, torch.tensor(positions, device=self.device), None, None, None, prefill)
        if decode:
            slots, mask = self._decode_slots(decode_rows, starts)
            layout.decode = torch.tensor(decode, device=self.device)
            at = torch.tensor(starts, device=self.device)
            write[layout.decode] = slots[torch.arange(len(decode), device=self.device), at]
            layout.decode_slots, layout.decode_mask = slots, mask[:, None, None, :]
        keep = torch.tensor(keep, device=self.device, dtype=torch.long)
        with torch.inference_mode():
            return Scores(self._forward(torch.tensor([ids], device=self.device), layout, keep), spans)

    def _forward(self, ids: torch.Tensor, layout: Layout, keep: torch.Tensor | int = 0) -> torch.Tensor:
        """ids (1, tokens) -> the scores (kept, vocab) of the positions `keep` (0: every position). The caller
        chooses the grad mode: inference_mode eager, no_grad compiled (inductor refuses inference tensors)."""
        config = self.model.config
        previous, config._attn_implementation = config._attn_implementation, ATTENTION  # for this forward only
        try:
            out = self.model(input_ids=ids, position_ids=layout.positions[None], cache=PagedCache(self.pool, layout),
                             use_cache=True, logits_to_keep=keep, paged=(self.pool, layout))
        finally:
            config._attn_implementation = previous
        return out.logits[0]
