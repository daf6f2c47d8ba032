"""The engine's budgets, and rank 0's decisions for the padded engine (state.py): who is admitted, how many
prompt tokens are prefilled. The paged engine plans with planner.py under the same `Limits`.

Pure bookkeeping (no torch, no collectives), so every rule is tested on its own. Budgets, in vLLM's terms:

- `max_num_seqs`: rows holding memory at once (decoding, or being prefilled);
- `max_num_batched_tokens`: tokens one step computes, the decode rows' one each plus the prefill chunk, so
  a long prompt delays the running rows by at most one chunk's forward;
- `kv_tokens`: cache slots per rank, the padded batch's rows x width (kv.py), checked against the worst
  case before a row is admitted: admission waits for room and never overcommits.

Admission is first come, first served: the head of the queue waits for room and nobody overtakes it. A
prompt longer than the chunk is prefilled alone, over several steps; shorter ones that arrive together
are prefilled together in one forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from autotp.serve.wire import Step


@dataclass(frozen=True)
class Limits:
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_tokens: int  # per rank; every row's prompt + max_tokens fits alone (checked when requests arrive)


@dataclass(frozen=True)
class Need:
    """A row's cache use: `length` tokens now, at most `remaining` more (its budget not yet generated)."""

    length: int
    remaining: int


def peak_kv(rows: list[Need]) -> int:
    """The most cache slots these rows can ever take together, in the padded layout.

    t steps from now every row that is still running is `length + t` long, and the batch is as wide as the
    longest of them (columns no running row uses are trimmed when rows leave). Between two rows' ends the
    count is fixed and the width grows, so the peak is at one of those ends: with the rows sorted by
    remaining budget, the rows alive at the i-th end are the first i."""
    ordered = sorted(rows, key=lambda r: r.remaining, reverse=True)
    peak = longest = 0
    for i, row in enumerate(ordered):
        longest = max(longest, row.length)
        if i + 1 == len(ordered) or ordered[i + 1].remaining < row.remaining:
            peak = max(peak, (i + 1) * (longest + row.remaining))
    return peak


@dataclass
class Group:
    """The prefill group being formed: its rows' needs and its padded width."""

    needs: list[Need]
    width: int = 0

    def tokens_with(self, length: int) -> int:
        return (len(self.needs) + 1) * max(self.width, length)


def admit(waiting: list[Need], running: list[Need], limits: Limits) -> int:
    """How many rows from the head of `waiting` start prefilling now, with `running` holding memory.

    The first row may be longer than this step's chunk (it is then prefilled alone, in chunks); the others
    join only while the whole group fits one chunk, so none of them waits for a long prompt's chunks."""
    budget = limits.max_num_batched_tokens - len(running)
    group = Group([])
    for need in waiting:
        if len(running) + len(group.needs) + 1 > limits.max_num_seqs:
            break
        if peak_kv(running + group.needs + [need]) > limits.kv_tokens:
            break
        if group.needs and group.tokens_with(need.length) > budget:
            break
        group.needs.append(need)
        group.width = max(group.width, need.length)
    return len(group.needs)


def chunk_size(rows: int, width_left: int, decode_rows: int, limits: Limits) -> int:
    """Prompt columns of a prefill group of `rows` to run this step, beside `decode_rows` decoding rows."""
    per_row = (limits.max_num_batched_tokens - decode_rows) // rows
    return max(1, min(width_left, per_row))


def plan_padded(batch, drop: tuple[int, ...], tokens: list[int], needs: list[Need], waiting: list[tuple],
                limits: Limits, join: Callable[[int], int]) -> Step:
    """The padded engine's step: the running rows (batch.order_after(drop)) decode `tokens`; the prefill
    group in progress goes on, or, when there is none, a new one is admitted from `waiting` ((prompt ids,
    max_tokens, prompt_logprobs) each, oldest first; join(i) admits the i-th and returns its row id)."""
    group = batch.prefill
    group_rows = [r for r in group.rows if r not in drop] if group is not None and not group.complete else []
    if group_rows:  # the prefill in progress goes on
        left = group.ids.shape[1] - group.done
        return Step(drop, tuple(tokens), chunk=chunk_size(len(group_rows), left, len(needs), limits))
    count = admit([Need(len(ids), n) for ids, n, _ in waiting], needs, limits) if waiting else 0
    admitted = [(join(i), waiting[i][0]) for i in range(count)]
    if not admitted:
        return Step(drop, tuple(tokens))
    width = max(len(ids) for _, ids in admitted)
    return Step(drop, tuple(tokens), tuple(admitted), chunk_size(len(admitted), width, len(needs), limits),
                all_logits=any(w[2] for w in waiting[:count]))
