"""Rank 0's decisions for the paged engine: which rows compute how many tokens this step, in which blocks.

vLLM v1's rule: every row computes `len(tokens) - computed` tokens (one for a decoding row, a chunk of its
prompt for a prefilling one), running rows first, within `max_num_batched_tokens`; then new rows are
admitted first come, first served while a row slot, a token of the step's budget and room for their whole
life in blocks are left. A new row starts from the longest cached run of its prompt's full blocks
(blocks.BlockPool), then from the known block after them that shares the most of its next tokens (copied into
a block of its own: Work.copy), and computes only the rest; it always computes at least its last prompt token,
whose scores give its first generated one. Pure bookkeeping (no torch): the runner (runner/model_runner.py)
does the work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from autotp.serve.engine.blocks import BlockPool, Key
from autotp.serve.lockstep.wire import Step, Work


@dataclass(frozen=True)
class Limits:
    """The engine's budgets, in vLLM's terms. max_num_seqs: rows holding blocks at once (decoding, or being
    prefilled); max_num_batched_tokens: tokens one step computes, the decode rows' one each plus prompt chunks and
    drafts, so a long prompt delays the running rows by at most one chunk's forward; kv_tokens: cache slots per
    rank (every row's prompt + max_tokens fits alone: checked when requests arrive)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    kv_tokens: int


@dataclass
class Seq:
    """A row's blocks as rank 0 holds them. computed: tokens whose keys and values are in its blocks;
    keys: the keys of its first len(keys) blocks, cached; reserved: blocks it may still take; tokens: its (prompt,
    generated tokens) as of its last step, whose span computed in block len(keys) (the partly filled one) is
    indexed for later prompts when the row leaves (a reference: the engine only appends to the generated list)."""

    blocks: list[int] = field(default_factory=list)
    keys: list[Key] = field(default_factory=list)
    computed: int = 0
    reserved: int = 0
    every: bool = False  # its prompt's every position is scored (prompt log-probabilities): no cache hits
    tokens: tuple[Sequence[int], Sequence[int]] = ((), ())


def blocks_for(tokens: int, size: int) -> int:
    return -(-tokens // size)


def span(prompt: Sequence[int], generated: Sequence[int], a: int, b: int) -> tuple[int, ...]:
    """Tokens a .. b - 1 of prompt + generated, without building the whole sequence (a long prompt, every step)."""
    p = len(prompt)
    return tuple(prompt[a:b]) + tuple(generated[max(0, a - p):max(0, b - p)])


class PagedPlanner:
    """limits: the engine's budgets; pool: the blocks of every rank's KV pool (the same ids everywhere)."""

    def __init__(self, pool: BlockPool, limits: Limits):
        self.pool, self.limits = pool, limits
        self.seqs: dict[int, Seq] = {}
        self.metrics = None  # metrics.Metrics: prompt tokens looked up in the prefix cache, and found there

    def kv_used(self) -> int:
        """Token slots in blocks that rows hold now."""
        return self.pool.used() * self.pool.block_size

    def fits_ever(self, prompt: int, max_tokens: int) -> bool:
        return blocks_for(prompt + max_tokens - 1, self.pool.block_size) <= self.pool.num_blocks

    def release(self, row: int) -> None:
        """A row leaves (finished, cancelled, failed): its blocks go idle-cached or free."""
        seq = self.seqs.pop(row)
        self.pool.unreserve(seq.reserved)
        start = len(seq.keys) * self.pool.block_size
        for i, block in enumerate(seq.blocks):
            tail = None
            if i == len(seq.keys):
                tail = (seq.keys[-1] if seq.keys else None, span(*seq.tokens, start, seq.computed))
            self.pool.release(block, tail)

    def plan(self, rows: dict[int, tuple[Sequence[int], Sequence[int]]], drop: tuple[int, ...], waiting, join,
             drafts: dict[int, tuple[int, ...]] | None = None) -> Step:
        """rows: each row still running -> (its prompt, its generated tokens);
        waiting: the queue's jobs, oldest first, as (prompt ids, max_tokens, no_cache) each; join(i)
        admits the i-th and returns its row id; drafts: a decoding row's guesses at its next tokens
        (lookup.py), computed after its last one within the step's budget, every position scored. Returns
        the step (its `error` left for the engine)."""
        for row in drop:
            self.release(row)
        budget = self.limits.max_num_batched_tokens
        work = []
        # running rows first, then the prompts still being prefilled, in the order they came
        order = sorted(rows, key=lambda r: len(rows[r][0]) > self.seqs[r].computed)
        for row in order:
            prompt, generated = rows[row]
            seq = self.seqs[row]
            n = min(len(prompt) + len(generated) - seq.computed, budget)
            if n <= 0:
                continue
            guess = (drafts or {}).get(row, ())[:budget - n] if n == 1 and generated else ()
            if guess:  # the draft's tokens as if generated: its blocks were reserved with the row's max_tokens
                generated, n = (*generated, *guess), n + len(guess)
            budget -= n
            work.append(self._work(row, seq, prompt, generated, n, draft=len(guess)))
        admitted = 0
        for prompt, max_tokens, no_cache in waiting:
            if budget <= 0 or len(rows) + admitted >= self.limits.max_num_seqs:
                break
            size = self.pool.block_size
            hits = [] if no_cache else self.pool.match(prompt, (len(prompt) - 1) // size)
            source, m = (-1, 0) if no_cache else self.pool.extend(prompt, hits, len(prompt) - 1)
            life = blocks_for(len(prompt) + max_tokens - 1, size) - len(hits)
            idle = sum(self.pool.refs[b] == 0 for b, _ in hits)
            if life + idle > self.pool.available():
                break  # first come, first served: the head waits for room, nobody overtakes it
            row = join(admitted)
            admitted += 1
            for block, _ in hits:
                self.pool.hold(block)
            self.pool.reserve(life)
            seq = self.seqs[row] = Seq([b for b, _ in hits], [k for _, k in hits], len(hits) * size + m, life,
                                       no_cache)
            if self.metrics is not None and not no_cache:
                self.metrics.prefix(len(prompt), seq.computed)
            n = min(len(prompt) - seq.computed, budget)
            budget -= n
            work.append(self._work(row, seq, prompt, (), n, new=[b for b, _ in hits], copy=(source, m)))
        return Step(drop=drop, work=tuple(work))

    def _work(self, row: int, seq: Seq, prompt: Sequence[int], generated: Sequence[int], n: int,
              new: list[int] | None = None, draft: int = 0, copy: tuple[int, int] = (-1, 0)) -> Work:
        """This step's entry for a row computing its tokens computed .. computed + n - 1, taking the blocks
        that needs (after `new`, its cached prefix, when it is admitted); draft: its last `draft` tokens are a
        guess, and each of its tokens is scored; copy: (block, m), the first m keys and values of its first block
        after `new` are that block's."""
        start = seq.computed
        added = list(new or [])
        while len(seq.blocks) * self.pool.block_size < start + n:
            block = self.pool.take()
            seq.reserved -= 1
            seq.blocks.append(block)
            added.append(block)
        sample = start + n == len(prompt) + len(generated)
        source, m = copy
        return Work(row, span(prompt, generated, start, start + n), start, tuple(added), sample,
                    bool(draft) or (seq.every and start < len(prompt)), draft,
                    (source, seq.blocks[len(new or [])], m) if m else ())

    def ran(self, step: Step, tokens: dict[int, tuple[Sequence[int], Sequence[int]]],
            kept: dict[int, int] | None = None) -> None:
        """The step ran on every rank: its rows' tokens are computed, and the blocks they filled are cached.
        tokens: each row's (prompt, generated tokens) after the step; kept: a row with a draft -> how many of
        its computed tokens stand (its last one and the drafted ones its sampler drew too); the keys and
        values after them are stale and computed again."""
        size = self.pool.block_size
        for row, ids, start, *_ in step.work:
            seq = self.seqs.get(row)
            if seq is None:
                continue
            seq.computed = start + (kept or {}).get(row, len(ids))
            prompt, generated = tokens[row]
            while (len(seq.keys) + 1) * size <= seq.computed:
                i = len(seq.keys)
                parent = seq.keys[-1] if seq.keys else None
                seq.keys.append(self.pool.register(seq.blocks[i], parent, span(prompt, generated, i * size,
                                                                               (i + 1) * size)))
            seq.tokens = tokens[row]
