"""Rank 0's scheduler: the waiting and running requests and their blocks; `schedule()` hands out a step, `update()`
takes it back once its tokens are in.

vLLM v1's rule: every running request computes `num_tokens - computed` tokens (one for a decoding request, a chunk of
its prompt for a prefilling one), decoding requests first, within `max_num_batched_tokens`; then waiting requests
are admitted first come, first served while a request slot, a token of the step's budget and room for their whole
life in blocks are left. A new request starts from the longest cached run of its prompt's full blocks
(blocks.BlockPool), then from the known block after them that shares the most of its next tokens (copied into a
block of its own: Work.copy), and computes only the rest; it always computes at least its last prompt token, whose
scores give its first generated one. A row whose prompt begins with full blocks a sibling (another row of the same
client request) is computing right now waits until they are cached, so that the n completions of one prompt
compute it once; rows of other requests never wait for one another. A decoding request may add a prompt-lookup
draft (lookup.py) after its last token, every position scored, within the budget.

More than one step may be in flight (a pipeline of P stages keeps P of them moving), and `update` takes each step
back by its requests' ids as it lands, in order. So that P steps are in flight at all, the running requests are kept
in P lanes (vLLM's virtual engines): the engine asks for each lane's step in turn, and a request admitted in a lane's
step stays in it; a lane admits up to its share of the requests running and waiting, so the lanes stay even. A
request whose step has not come back waits, with one exception: a prompt's next chunk goes into the next step, of
whichever lane, while its earlier chunks are still in flight (none of them samples, and every stage runs steps in
order, so a chunk finds the keys and values of those before it written), so that the stages work on one long prompt
at once instead of one after the other. Pure bookkeeping (no torch): the runners (runner/model_runner.py) do the
work.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from autotp.sampling.rules import SamplingParams
from autotp.serve.engine import lookup
from autotp.serve.engine.blocks import BlockPool
from autotp.serve.engine.request import Request, Status
from autotp.serve.engine.stats import StepStats
from autotp.serve.lockstep.step import NewRequest, Step, Work
from autotp.serve.types import kv_slots


@dataclass(frozen=True)
class Limits:
    """The engine's budgets, in vLLM's terms. max_num_seqs: requests holding blocks at once (decoding, or being
    prefilled); max_num_batched_tokens: tokens one step computes, the decoding requests' one each plus prompt chunks
    and drafts, so a long prompt delays the running requests by at most one chunk's forward; kv_tokens: cache slots
    per rank (every request's kv_slots fits alone: checked when requests arrive)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    kv_tokens: int


def blocks_for(tokens: int, size: int) -> int:
    return -(-tokens // size)


class Scheduler:
    """pool: the blocks of every rank's KV pool (the same ids everywhere); speculate: the longest draft per
    decoding request and step (0: off)."""

    def __init__(self, pool: BlockPool, limits: Limits, speculate: int = 0, lanes: int = 1):
        self.pool, self.limits, self.speculate, self.lanes = pool, limits, speculate, lanes
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # by id, in the order they were admitted
        self.ended: list[int] = []  # requests freed since the last step: the runners forget them with the next one

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def kv_used(self) -> int:
        """Token slots in blocks that requests hold now (idle cached blocks are free room)."""
        return self.pool.used() * self.pool.block_size

    def idle(self) -> bool:
        return not self.running and not self.waiting

    def schedule(self, stats: StepStats, admit: bool = True, lane: int = 0) -> Step:
        """Lane `lane`'s next step: what each of its running requests that is not in flight computes, then the
        requests admitted from the head of the queue (none where `admit` is off: the server is stopping). Its requests
        are in flight until `update`."""
        budget = self.limits.max_num_batched_tokens
        work, new = [], []
        ready = [r for r in self.running.values() if (not r.in_flight and r.lane == lane)
                 or (r.in_flight and r.scheduled < len(r.prompt))]  # a prompt's next chunk
        ready.sort(key=lambda r: r.computed < len(r.prompt))  # decoding first, then prompts, each in arrival order
        for r in ready:
            n = min(r.num_tokens - r.scheduled, budget)
            if n <= 0:
                continue
            r.draft = self._draft(r, budget - n) if n == 1 and r.output and not r.in_flight else ()
            budget -= n + len(r.draft)
            work.append(self._work(r, n))
        share = -(-(len(self.running) + len(self.waiting)) // self.lanes)
        in_lane = sum(r.lane == lane for r in self.running.values())
        while (admit and self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs
               and in_lane < share):
            r = self.waiting[0]
            copy = self._admit(r, stats)
            if copy is None:
                break  # first come, first served: the head waits for room, nobody overtakes it
            r.lane, in_lane = lane, in_lane + 1
            n = min(len(r.prompt) - r.scheduled, budget)
            budget -= n
            new.append(NewRequest(id=r.id, sampling=SamplingParams(r.row.temperature, r.row.top_p, r.row.top_k,
                                                                   r.row.seed, r.row.infill,
                                                                   r.row.infill_scaled),
                                  logprobs=r.row.logprobs, prompt=r.prompt if r.row.prompt_logprobs else ()))
            work.append(self._work(r, n, admitted=len(r.blocks), copy=copy))
        for w in work:
            self.running[w.id].in_flight += 1
        step = Step(new=tuple(new), work=tuple(work), finished=tuple(self.ended))
        self.ended.clear()
        return step

    def _admit(self, r: Request, stats: StepStats) -> tuple[int, int] | None:
        """The head of the queue takes its cached prefix and reserves its life's blocks, if they fit (None where
        not, or where a sibling is computing blocks it would take from the cache). Returns (block, m): the
        known block whose first m keys and values its next block copies."""
        size, prompt = self.pool.block_size, r.prompt
        if self.pool.caching and not r.no_cache and any(self._computing(o, prompt) for o in self.running.values()
                                                        if o.client == r.client):
            return None
        hits = [] if r.no_cache else self.pool.match(prompt, (len(prompt) - 1) // size)
        source, m = (-1, 0) if r.no_cache else self.pool.extend(prompt, hits, len(prompt) - 1)
        life = blocks_for(kv_slots(len(prompt), r.row.max_tokens), size) - len(hits)
        idle = sum(self.pool.refs[b] == 0 for b, _ in hits)  # idle cached blocks it holds are room it takes too
        if life + idle > self.pool.available():
            return None
        self.waiting.popleft()
        for block, _ in hits:
            self.pool.hold(block)
        self.pool.reserve(life)
        r.status, r.admitted = Status.RUNNING, time.monotonic()
        r.blocks, r.keys, r.reserved = [b for b, _ in hits], [k for _, k in hits], life
        r.computed = r.scheduled = r.cached = len(hits) * size + m
        self.running[r.id] = r
        if not r.no_cache:
            stats.prefix_queried += len(prompt)
            stats.prefix_hit += r.cached
        return source, m

    def _computing(self, other: Request, prompt: tuple[int, ...]) -> bool:
        """Whether `other` has yet to compute (or has in flight) a full block of its prompt that `prompt` begins with
        too, and would take from the cache once it is computed."""
        end = (other.computed // self.pool.block_size + 1) * self.pool.block_size  # through its first block to come
        matchable = (len(prompt) - 1) // self.pool.block_size * self.pool.block_size  # as _admit's match
        return end <= min(matchable, len(other.prompt)) and prompt[:end] == other.prompt[:end]

    def _draft(self, r: Request, budget: int) -> tuple[int, ...]:
        """A decoding request's prompt-lookup draft, no longer than the step's budget or its own leave room for."""
        room = min(self.speculate, r.row.max_tokens - len(r.output) - 1, budget)
        if room <= 0:
            return ()
        if r.history is None:
            r.history = np.asarray(r.prompt, dtype=np.int64)
        return lookup.draft(np.concatenate((r.history, np.asarray(r.output, dtype=np.int64))), room)

    def _work(self, r: Request, n: int, admitted: int | None = None, copy: tuple[int, int] = (-1, 0)) -> Work:
        """This step's entry for a request computing its tokens scheduled .. scheduled + n - 1 and its draft, taking
        the blocks that needs; admitted: a new request, whose first `admitted` blocks (its cached prefix) are new to
        the runners too, and whose `copy` (block, m) fills the first m slots of the block after them."""
        start, size = r.scheduled, self.pool.block_size
        r.scheduled = start + n
        added = list(r.blocks) if admitted is not None else []
        while len(r.blocks) * size < start + n + len(r.draft):
            block = self.pool.take()
            r.reserved -= 1
            r.blocks.append(block)
            added.append(block)
        source, m = copy
        return Work(id=r.id, tokens=r.span(start, start + n) + r.draft, start=start, blocks=tuple(added),
                    sample=start + n == r.num_tokens, every=bool(r.draft) or (r.no_cache and start < len(r.prompt)),
                    draft=len(r.draft), copy=(source, r.blocks[admitted], m) if m else ())

    def update(self, step: Step, ran: bool = True) -> None:
        """The step came back and its tokens are in (output.py appended them, and set the status of the requests that
        finished): each request's computed tokens and the blocks they filled are cached, and finished requests are
        freed. A drafted request's tokens stand up to the last one its sampler kept: its keys and values after them
        are stale and computed again. ran False: the forward failed, its requests are freed with what they had."""
        size = self.pool.block_size
        for w in step.work:
            r = self.running.get(w.id)
            if r is None:
                continue
            r.in_flight -= 1
            if ran and r.status is not Status.FAILED:  # (an earlier chunk's forward failed: nothing of it is cached)
                # every token but the newest has its keys and values now (the newest, sampled this step, has not)
                r.computed = min(w.start + len(w.tokens), r.num_tokens - 1)
                if not r.in_flight:  # a draft's rejected tokens are handed out again
                    r.scheduled = r.computed
                while (len(r.keys) + 1) * size <= r.computed:
                    i = len(r.keys)
                    parent = r.keys[-1] if r.keys else None
                    r.keys.append(self.pool.register(r.blocks[i], parent, r.span(i * size, (i + 1) * size)))
            if (r.status.finished or not ran) and not r.in_flight:  # a later chunk still out holds its blocks
                self.free(r)

    def abort(self, r: Request, status: Status) -> None:
        """A request ends before its answer (its client went away, the server stops): a waiting one leaves the queue,
        a running one is freed now, or when its step in flight comes back."""
        r.status = status
        if r in self.waiting:
            self.waiting.remove(r)
        elif r.id in self.running and not r.in_flight:
            self.free(r)

    def free(self, r: Request) -> None:
        """A request leaves: its blocks go idle-cached or free. Its partly filled block's computed tokens are indexed
        for later prompts (blocks.BlockPool.release)."""
        self.pool.unreserve(r.reserved)
        r.reserved = 0
        start = len(r.keys) * self.pool.block_size
        for i, block in enumerate(r.blocks):
            tail = (r.keys[-1] if r.keys else None, r.span(start, r.computed)) if i == len(r.keys) else None
            self.pool.release(block, tail)
        del self.running[r.id]
        self.ended.append(r.id)
