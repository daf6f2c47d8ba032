"""The model runner: one forward per step over every row's new tokens, and the step's description it reads.

Every rank keeps the block tables of the rows it runs, changed only by the steps rank 0 broadcasts (`apply`),
and runs each step the same way (`run`): the rows' new tokens flattened into one (1, tokens) input with their
positions, and the step's description (attention.StepMeta) built once, here, before the forward: each new
token's slot, and the rows in at most two attention groups, short queries and long ones (attention.py). Only
the positions rank 0 asked for reach the LM head (`logits_to_keep`): a sampling row's last one, every one of a
row that wants its prompt's log-probabilities or verifies a draft.

The index arithmetic is done on the host in numpy, and the step's index arrays cross to the device in one copy.
Nothing here decides anything; a forward that raises leaves the rows' new slots half written, so rank 0 fails
those rows on every rank alike and their blocks are never cached.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from autotp.serve.lockstep.wire import Step, Work
from autotp.serve.runner import adapters, flex, varlen
from autotp.serve.runner.attention import Group, StepMeta
from autotp.serve.runner.compiled import CompiledDecode, decode_meta
from autotp.serve.runner.paged import KvPool, PagedCache
from autotp.serve.runner.probe import Implementation


class Span(NamedTuple):
    """A row's kept columns in a step's scores: logits[a:b], the first at position `position`; sample: the last
    gives the row's next token; draft: how many of its tokens were a draft to verify."""

    row: int
    position: int
    a: int
    b: int
    sample: bool
    draft: int = 0


class Scores(NamedTuple):
    """What a step's forward scored: logits (kept, vocab) and the rows' spans in it."""

    logits: torch.Tensor
    spans: list[Span]

    def sampled(self, spans: list[Span]) -> torch.Tensor:
        """The last column's scores of each of `spans` (rows, vocab)."""
        index = torch.tensor([s.b - 1 for s in spans], device=self.logits.device, dtype=torch.long)
        return self.logits.index_select(0, index)


def ship(arrays: list[np.ndarray], device) -> list[torch.Tensor]:
    """Host int64 arrays -> tensors on `device` in one copy (on CUDA from a pinned buffer, without a host sync):
    a step's index arrays cross to the GPU once, not one synchronous copy each."""
    flat = torch.from_numpy(np.concatenate([a.reshape(-1).astype(np.int64, copy=False) for a in arrays]))
    if torch.device(device).type != "cpu":
        flat = flat.pin_memory().to(device, non_blocking=True)
    out, at = [], 0
    for a in arrays:
        out.append(flat[at:at + a.size].view(a.shape))
        at += a.size
    return out


def group(pool: KvPool, tables: list[list[int]], starts: np.ndarray, counts: np.ndarray,
          firsts: np.ndarray) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Rows computing counts[r] tokens from position starts[r], the first at index firsts[r] of the step's tokens,
    as one attention group, on the host: [index (R, Q), slots (R, L), qpos (R, Q), ends (R,), and where some
    queries are padding the flat indices of the real ones and their tokens] (attention.Group); also the new tokens'
    step indices and slots, for the slot mapping."""
    size, rows = pool.block_size, len(tables)
    q, ends = int(counts.max()), starts + counts
    width = int(ends.max())
    blocks = -(-width // size)
    table = np.zeros((rows, blocks), dtype=np.int64)
    for r, t in enumerate(tables):
        t = t[:blocks]
        table[r, :len(t)] = t
    cols = np.arange(width)
    slots = (table[:, :, None] * size + np.arange(size)).reshape(rows, -1)[:, :width]
    slots[cols[None] >= ends[:, None]] = pool.slots  # past a row's context: the zero slot
    real = np.arange(q)[None] < counts[:, None]  # (R, Q): not padding
    index = np.where(real, firsts[:, None] + np.arange(q)[None], firsts[:, None])
    qpos = np.where(real, starts[:, None] + np.arange(q)[None], 0)  # a padding query sees key 0 alone
    written = slots[np.nonzero(real)[0], qpos[real]]  # the new tokens' slots, in index[real] order
    arrays = [index, slots, qpos, ends]
    if not real.all():
        flat = np.flatnonzero(real)
        arrays += [flat, index.reshape(-1)[flat]]
    return arrays, index[real], written


def describe(pool: KvPool, tables: list[list[int]], work: tuple[Work, ...], short: int, device,
             extra: tuple[np.ndarray, ...] = (), backend: str = "sdpa") -> tuple[StepMeta, list[torch.Tensor]]:
    """The step's description: each new token's slot, and the rows (whose block tables are `tables`, in `work`'s
    order) in their groups: queries of at most `short` tokens, and longer ones; for the flex and varlen backends,
    the rows as their kernel reads them instead (flex.FlexStep, varlen.VarlenStep). `extra` host arrays cross to
    the device in the same copy, and come back as tensors."""
    counts = np.array([len(w.tokens) for w in work])
    starts = np.array([w.start for w in work])
    if backend == "flex":
        return _describe_flex(pool, tables, starts, counts, device, extra)
    if backend == "varlen":
        return _describe_varlen(pool, tables, starts, counts, device, extra)
    firsts = np.cumsum(counts) - counts
    slot_mapping = np.empty(int(counts.sum()), dtype=np.int64)
    parts = []
    for members in (counts <= short, counts > short):
        if members.any():
            rows = np.flatnonzero(members)
            arrays, tokens, slots = group(pool, [tables[r] for r in rows], starts[rows], counts[rows], firsts[rows])
            slot_mapping[tokens] = slots
            parts.append(arrays)
    positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, counts, strict=True)])
    shipped = ship([slot_mapping, positions, *[a for arrays in parts for a in arrays], *extra], device)
    slot_t, positions_t, rest = shipped[0], shipped[1], shipped[2:]
    groups = []
    for arrays in parts:
        (index, slots, qpos, ends, *padding), rest = rest[:len(arrays)], rest[len(arrays):]
        qpos = qpos[:, None, :, None]
        visible = torch.arange(slots.shape[1], device=slots.device) <= qpos  # (R, 1, Q, L)
        groups.append(Group(index, slots, visible, qpos, ends[:, None], *padding))
    return StepMeta(slot_t, positions_t, groups), rest


def _describe_flex(pool: KvPool, tables: list[list[int]], starts: np.ndarray, counts: np.ndarray, device,
                   extra: tuple[np.ndarray, ...]) -> tuple[StepMeta, list[torch.Tensor]]:
    """describe() for the flex backend: the tokens are in step order already, so positions are flex's qpos."""
    arrays, written, width = flex.describe(pool.block_size, pool.num_blocks, tables, starts, counts)
    shipped = ship([written, *arrays, *extra], device)
    slot_t, (rows, qpos, table, logical, kv_num_blocks, kv_indices), rest = shipped[0], shipped[1:7], shipped[7:]
    step = flex.FlexStep(rows, qpos, table, logical, kv_num_blocks, kv_indices, pool.block_size, pool.slots, width)
    return StepMeta(slot_t, qpos, [], step), rest


def _describe_varlen(pool: KvPool, tables: list[list[int]], starts: np.ndarray, counts: np.ndarray, device,
                     extra: tuple[np.ndarray, ...]) -> tuple[StepMeta, list[torch.Tensor]]:
    """describe() for the varlen backend: the kernel's index tensors are int32, the host's int64 until they land."""
    arrays, written, positions, max_q, max_k = varlen.describe(pool.block_size, tables, starts, counts)
    shipped = ship([written, positions, *arrays, *extra], device)
    cu_q, cu_k, used, table = (t.to(torch.int32) for t in shipped[2:6])
    step = varlen.VarlenStep(cu_q, cu_k, used, table, max_q, max_k, pool.block_size, pool.slots)
    return StepMeta(shipped[0], shipped[1], [], varlen=step), shipped[6:]


class PagedBatch:
    """One rank's rows: their block tables (see the module docstring). short: the longest query the short
    attention group takes (1 + the draft length: decode and drafted rows share one call); attention: the backend
    its steps are described for, sdpa, flex or varlen (flex.choose, varlen.choose)."""

    def __init__(self, model, pool: KvPool, short: int = 1, attention: str = "sdpa"):
        self.model, self.pool, self.short, self.attention = model, pool, short, attention
        self.device = model.device
        adapters.install(model)  # BLOOM, Falcon, MPT: their attention modules' paged forward (once per model)
        self.implementation = Implementation(model)
        self.tables: dict[int, list[int]] = {}
        self.graph: CompiledDecode | None = None  # compile()
        self.compiled: CompiledDecode | None = None  # the graph, once every rank has one (use_graph)

    def compile(self) -> float:
        """Compile the decode step (compiled.py); the seconds warm-up took. Every rank calls it at once; raises
        what the compiler raised. Decode steps take the graph once every rank has it (`use_graph`)."""
        self.graph = CompiledDecode(self._forward, self.device)
        return self.graph.warm_up(self.pool, self.device)

    def use_graph(self) -> None:
        self.compiled = self.graph

    def rows(self) -> list[int]:
        return list(self.tables)

    def apply(self, step: Step) -> None:
        for row in step.drop:
            self.tables.pop(row, None)
        for w in step.work:
            self.tables.setdefault(w.row, []).extend(w.blocks)
        copies = [w.copy for w in step.work if w.copy]
        if copies:  # before the forward: a block another row takes this step is written only by the forward
            self.pool.copy(copies)

    def discard(self, rows) -> None:
        for row in rows:
            self.tables.pop(row, None)

    def run(self, step: Step) -> Scores:
        """The step's forward. Raises what it raised, with its rows' tables already gone."""
        try:
            return self._run(step.work)
        except BaseException:
            self.discard([w.row for w in step.work])
            raise

    def _decode(self, work: tuple[Work, ...]) -> Scores | None:
        """A step whose rows each sample one token, through the compiled graph; None for any other step."""
        if self.compiled is None or not all(len(w.tokens) == 1 and w.sample and not w.every for w in work):
            return None
        meta, rows = decode_meta(self.pool, [self.tables[w.row] for w in work], [w.start for w in work], self.device)
        ids = torch.tensor([[w.tokens[0] for w in work] + [0] * (rows - len(work))], device=self.device)
        logits = self.compiled(ids, meta)
        return Scores(logits, [Span(w.row, w.start, i, i + 1, True) for i, w in enumerate(work)])

    def _run(self, work: tuple[Work, ...]) -> Scores:
        scores = self._decode(work)
        if scores is not None:
            return scores
        ids, keep, spans = [], [], []
        for w in work:
            a, n = len(ids), len(w.tokens)
            ids += w.tokens
            if w.every or w.sample:
                first = a if w.every else a + n - 1
                spans.append(Span(w.row, w.start + first - a, len(keep), len(keep) + a + n - first, w.sample, w.draft))
                keep += range(first, a + n)
        meta, (ids_t, keep_t) = describe(self.pool, [self.tables[w.row] for w in work], work, self.short,
                                         self.device, (np.array([ids]), np.array(keep, dtype=np.int64)),
                                         self.attention)
        with torch.inference_mode():
            return Scores(self._forward(ids_t, meta, keep_t), spans)

    def _forward(self, ids: torch.Tensor, meta: StepMeta, keep: torch.Tensor | int = 0) -> torch.Tensor:
        """ids (1, tokens) -> the scores (kept, vocab) of the positions `keep` (0: every position). The caller
        chooses the grad mode: inference_mode eager, no_grad compiled (inductor refuses inference tensors)."""
        cache = PagedCache(self.pool, meta, ids.shape[1])
        self.implementation.set()  # for this forward only
        try:
            out = self.model(input_ids=ids, position_ids=meta.positions[None], cache=cache, use_cache=True,
                             logits_to_keep=keep, paged=cache)
        finally:
            self.implementation.restore()
        return out.logits[0]
