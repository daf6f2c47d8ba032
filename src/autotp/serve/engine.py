"""Continuous batching in rank lockstep: rank 0's `Engine` decides every step, the other ranks `follow`.

Each step rank 0 (the main thread of `autotp serve`):
1. takes new jobs from the HTTP thread into the waiting queue (bounded: past `max_queue`, `submit` says
   "full" and the client gets 429);
2. plans the step: rows that leave (finished, failed, cancelled by a client that went away), and what each
   row computes. The paged engine (planner.py, runner.py): one forward over every row's new tokens, prompts
   starting from their longest cached prefix. The padded engine, for models whose attention does not reach
   transformers' AttentionInterface (scheduler.py, state.py): a prefill forward and a decode forward;
3. sends it (wire.py: one broadcast) and runs it on its own batch as every rank does;
4. hands the scores to output.py, which samples, streams and answers the rows.

So a request never waits for another one to finish: it joins at the next step that has room. The ranks
never decide anything: they apply rank 0's steps. A forward that raises on every rank alike (the same
exception type) fails the rows it ran with 500 and the server goes on; any disagreement, a failed
collective or a dead rank ends lockstep: rank 0 answers every job 503 and returns 1. A forward that raises
on some ranks only leaves the others in one of its collectives; the store says so within seconds
(watchdog.py), and rank 0 answers 503 and exits. Nothing here knows HTTP; jobs carry an `emit` callback.
"""

from __future__ import annotations

import copy
import dataclasses
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice

import numpy as np

from autotp import distributed
from autotp.generate import pad_token_id
from autotp.sampler import RowSampler, SamplingParams
from autotp.serve import lookup
from autotp.serve.blocks import BlockPool
from autotp.serve.metrics import Metrics
from autotp.serve.output import Active, Output, describe, eos_ids
from autotp.serve.paged import KvPool
from autotp.serve.planner import PagedPlanner
from autotp.serve.runner import PagedBatch
from autotp.serve.scheduler import Limits, Need, plan_padded
from autotp.serve.state import Batch
from autotp.serve.text import TextStream
from autotp.serve.types import Row, log
from autotp.serve.watchdog import StepWatchdog, Watch
from autotp.serve.wire import Channel, Step

HEARTBEAT_S = 0.5  # an idle rank 0 sends an empty step this often, so a dead rank shows within seconds
GRACE_S = 5  # a signalled worker waits this long for rank 0's "stop" before leaving on its own


def kind(description: str) -> str:
    """The exception type of a `describe` line ("" for a step that ran): what the ranks must agree on."""
    return description.split(":", 1)[0]


class StopFlag:
    """Set from a SIGINT/SIGTERM handler (one assignment, safe there); remembers when."""

    def __init__(self):
        self.at: float | None = None

    def set(self) -> None:
        if self.at is None:
            self.at = time.monotonic()

    def is_set(self) -> bool:
        return self.at is not None

    def age(self) -> float:
        return 0.0 if self.at is None else time.monotonic() - self.at


@dataclass
class Job:
    """One prompt of one request, as rank 0 tracks it. emit(event) must be thread-safe; events are
    ("token", index, Piece) per generated token when streaming, then ("done", index, Result) or
    ("error", index, (status, message))."""

    row: Row
    index: int
    emit: Callable[[tuple], None]
    stream: TextStream | None = None
    request: str = ""  # the request's id, for the log
    cancelled: bool = False  # set from the HTTP thread when the client goes away; read at each step
    arrived: float = field(default_factory=time.monotonic)  # when the request came in, for the metrics

    def fail(self, status: int, message: str) -> None:
        self.emit(("error", self.index, (status, message)))


def backend(model, shapes, limits: Limits, block_size: int = 16, caching: bool = True,
            rank0: bool = True) -> tuple[PagedBatch | Batch, PagedPlanner | None]:
    """This rank's batch and, on rank 0 of the paged engine, its planner. shapes: paged.probe's (None: the
    model's attention does not reach the pool, and the padded engine serves it); the pool holds
    limits.kv_tokens // block_size blocks."""
    if shapes is None:
        return Batch(model, pad_token_id(model.generation_config)), None
    blocks = limits.kv_tokens // block_size
    batch = PagedBatch(model, KvPool(shapes, blocks, block_size, model.device))
    return batch, PagedPlanner(BlockPool(blocks, block_size, caching), limits) if rank0 else None


# Draft positions per step. A row with a draft computes several tokens, so its attention leaves the batched decode
# path for one of its own (paged.py), and a draft costs compute whether it stands or not. serve_bench, demo model,
# K = 4, tokens/s against no speculation, medians of 5 runs: uncapped 1.26x at 8 rows, 0.96x at 32; capped at 32
# positions, 1.47x and 0.99x.
DRAFT_POSITIONS = 32


class Engine:
    """Rank 0's scheduler: `submit` from any thread, `run` in the main thread until `stopping` is set.

    batch: this rank's rows (runner.PagedBatch, or state.Batch for the padded engine); planner: the paged
    engine's block accounting (None: the padded engine); speculate: up to this many prompt-lookup draft
    tokens verified per decoding row and step (the paged engine only)."""

    def __init__(self, batch, tokenizer, channel: Channel, stopping: StopFlag, limits: Limits, max_queue: int,
                 metrics: Metrics | None = None, planner: PagedPlanner | None = None, speculate: int = 0):
        self.batch, self.planner = batch, planner
        self.speculate = speculate if planner is not None else 0  # draft tokens per row per step (lookup.py)
        self.channel, self.stopping, self.limits, self.max_queue = channel, stopping, limits, max_queue
        self.active: dict[int, Active] = {}
        # a copy of its own: the parser thread encodes with the original, and HF fast tokenizers are not
        # meant to be used from two threads at once
        self.output = Output(copy.deepcopy(tokenizer), eos_ids(batch.model), self.active)
        self.metrics = metrics
        self.inbox: queue.Queue[Job] = queue.Queue()
        self.waiting: deque[Job] = deque()
        self.next_id = 0
        self.queued = 0  # jobs in inbox + waiting, under `lock`
        self.lock = threading.Lock()  # makes "accepting" and "queued" one step, so no job is lost at shutdown
        self.accepting = True
        self.error = ""  # how this rank's last step failed, sent with the next step
        self.failed: list[tuple[Job, str]] = []  # answered 500 once the next step reached every rank
        self.forwards = 0  # steps that ran a forward, numbered as every rank numbers them (watchdog.py)
        self.doing = "starting"  # what the ranks do now, for the line that says a rank died
        self.watch = Watch(0, distributed.world_size(), channel.tag())
        self.watchdog = StepWatchdog(self.watch, self._lost)

    @property
    def metrics(self) -> Metrics | None:
        return self.output.metrics

    @metrics.setter
    def metrics(self, metrics: Metrics | None) -> None:
        self.output.metrics = metrics
        if self.planner is not None:
            self.planner.metrics = metrics

    def submit(self, jobs: list[Job]) -> str:
        """Queue a request's jobs together: "ok", "full" (the queue holds max_queue jobs) or "closed"."""
        with self.lock:
            if not self.accepting:
                return "closed"
            if self.queued + len(jobs) > self.max_queue:
                return "full"
            self.queued += len(jobs)
            for job in jobs:
                self.inbox.put(job)
        return "ok"

    def counts(self) -> tuple[int, int]:
        """(rows running or prefilling, jobs waiting), for the metrics; any thread. A row that has its answer
        (done) no longer counts, though its memory goes at the next step."""
        with self.lock:
            return sum(not a.done for a in list(self.active.values())), self.queued

    def kv_used(self) -> int:
        """Cache slots the rows hold now; any thread. Paged: the blocks rows hold (idle cached blocks are
        free room); padded: the padded batch's rows x width, and the prefill's."""
        if self.planner is not None:
            return self.planner.kv_used()
        running, prefill = self.batch.running, self.batch.prefill
        used = running.mask.numel() if running is not None else 0
        return used + (prefill.batch.mask.numel() if prefill is not None else 0)

    def run(self) -> int:
        """Schedule until stopped and drained (0) or until the ranks can no longer run in lockstep (1)."""
        if self.watch.store is not None:
            self.watchdog.start()
        try:
            while not (self.stopping.is_set() and self._drained()):
                self.step()
            self.channel.send(Step(stop=True, error=self.error))
            self._answer_failed()
            return 0
        except Exception as e:  # noqa: BLE001 - a rank died or a collective failed: lockstep is lost
            self._lost(self.watch.died(e, self.doing) or describe(e))
            return 1
        finally:
            self._refuse_queued()

    def _refuse_queued(self) -> None:
        """No job is taken any more, and the queued ones are answered 503."""
        with self.lock:
            self.accepting = False
        self._intake(block=False)
        for job in self.waiting:
            job.fail(503, "the server is shutting down")
        self.waiting.clear()

    def _lost(self, why: str) -> None:
        """Lockstep is lost (a rank died, a collective failed, a forward failed on some ranks only): every
        admitted request is answered 503 and no new one is taken. From the main thread, or from the watchdog's
        while the main thread waits in a collective that will never end (it then ends the process)."""
        log(f"tensor-parallel ranks failed, shutting down: {why}")
        message = "the tensor-parallel ranks failed while running this request; the server is exiting"
        for job in [a.job for a in self.active.values() if not a.done] + [j for j, _ in self.failed]:
            job.fail(503, message)
        if threading.current_thread() is self.watchdog:
            self._refuse_queued()
            time.sleep(1.0)  # the HTTP thread writes the answers before the process ends

    def _drained(self) -> bool:
        """Stopping: queued jobs are answered 503 at once, admitted ones run to their end."""
        with self.lock:
            self.accepting = False
        self._intake(block=False)
        while self.waiting:
            self._unqueue(self.waiting.popleft()).fail(503, "the server is shutting down")
        return not self.active

    def step(self) -> None:
        """One iteration: plan, send, run, sample. An idle one sends a heartbeat after up to HEARTBEAT_S."""
        self._intake(block=not self.active)
        step = self._plan()
        self.doing = f"receiving step {self.forwards + 1} from rank 0"
        self.channel.send(step)
        self._answer_failed()
        self.batch.apply(step)
        for row in step.drop:
            del self.active[row]
        if not step.runs:
            return
        self.forwards += 1
        self.doing = f"running the forward of step {self.forwards} ({len(self.active)} rows)"
        self.watchdog.begin(self.forwards)
        try:
            scores = self.batch.run(step, prefilled=self.output.take)
        except Exception as e:  # noqa: BLE001 - the next step tells every rank; they must have failed alike
            self.watchdog.end()
            if self.watch.died(e, self.doing):  # no rank is left to compare with: run() says which one died
                raise
            self.watch.failed(self.forwards, describe(e))
            if not self.watch.alike(self.forwards):  # a rank that did not fail waits in a collective
                raise RuntimeError(f"rank 0's forward failed and another rank's did not: {describe(e)}") from e
            self.error = describe(e)
            lost = set(self.active) - set(self.batch.rows())
            log(f"a step of {len(lost)} rows failed; they get 500 and the server goes on: {self.error}")
            for row in lost:
                self.failed.append((self.active.pop(row).job, f"generation failed: {self.error}"))
                if self.planner is not None:
                    self.planner.release(row)
            return
        self.watchdog.end()
        kept = self.output.take(scores)
        if self.planner is not None:
            self.planner.ran(step, {w[0]: self._tokens(w[0]) for w in step.work}, kept)

    def _tokens(self, row: int) -> tuple[tuple[int, ...], list[int]]:
        """A row's prompt and generated tokens (the planner reads the spans it needs, copying neither)."""
        a = self.active[row]
        return a.job.row.ids, a.tokens

    def _drafts(self) -> dict[int, tuple[int, ...]]:
        """Each decoding row's prompt-lookup draft (lookup.py), no longer than its budget leaves room for; past
        DRAFT_POSITIONS in all, the longest drafts (then the oldest rows) keep theirs and the others have none."""
        drafts = {}
        for row, a in self.active.items():
            room = min(self.speculate, a.job.row.max_tokens - len(a.tokens) - 1)
            a.draft = ()
            if a.done or not a.tokens or room <= 0:
                continue
            if a.prompt is None:
                a.prompt = np.asarray(a.job.row.ids, dtype=np.int64)
            a.draft = lookup.draft(np.concatenate((a.prompt, np.asarray(a.tokens, dtype=np.int64))), room)
            if a.draft:
                drafts[row] = a.draft
        left = DRAFT_POSITIONS
        for row in sorted(drafts, key=lambda r: -len(drafts[r])):  # stable: the oldest first among equals
            if len(drafts[row]) > left:
                self.active[row].draft = ()
                del drafts[row]
            else:
                left -= len(drafts[row])
        return drafts

    def _unqueue(self, job: Job) -> Job:
        with self.lock:
            self.queued -= 1
        return job

    def _intake(self, block: bool) -> None:
        if block and not self.waiting:
            try:
                self.waiting.append(self.inbox.get(timeout=HEARTBEAT_S))
            except queue.Empty:
                pass
        while not self.inbox.empty():
            self.waiting.append(self.inbox.get_nowait())
        if any(j.cancelled for j in self.waiting):  # their clients left before they started
            for job in [j for j in self.waiting if j.cancelled]:
                self.waiting.remove(self._unqueue(job))

    def _answer_failed(self) -> None:
        for job, message in self.failed:
            job.fail(500, message)
        self.failed.clear()

    def _admit(self) -> int:
        """The head of the queue joins the batch; returns its row id."""
        job = self._unqueue(self.waiting.popleft())
        row = job.row
        params = SamplingParams(row.temperature, row.top_p, row.top_k, row.seed)
        self.active[self.next_id] = Active(job, RowSampler(params, self.batch.device))
        self.next_id += 1
        return self.next_id - 1

    def _plan(self) -> Step:
        for a in self.active.values():
            if a.job.cancelled and not a.done:
                a.done = True
                log(f"{a.job.request} prompt {a.job.index} cancelled after {len(a.tokens)} of {a.job.row.max_tokens} "
                    f"tokens: the client went away")
        drop = tuple(r for r, a in self.active.items() if a.done)
        error, self.error = self.error, ""
        head = [] if self.stopping.is_set() else list(islice(self.waiting, self.limits.max_num_seqs))
        if self.planner is not None:
            rows = {r: self._tokens(r) for r, a in self.active.items() if not a.done}
            step = self.planner.plan(rows, drop, [(j.row.ids, j.row.max_tokens, j.row.prompt_logprobs) for j in head],
                                     lambda _: self._admit(), self._drafts() if self.speculate else None)
        else:
            order = self.batch.order_after(drop)
            needs = [Need(len(self.active[r].job.row.ids) + len(self.active[r].tokens),
                          self.active[r].job.row.max_tokens - len(self.active[r].tokens)) for r in order]
            step = plan_padded(self.batch, drop, [self.active[r].next for r in order], needs,
                               [(j.row.ids, j.row.max_tokens, j.row.prompt_logprobs) for j in head], self.limits,
                               lambda _: self._admit())
        return dataclasses.replace(step, error=error)


def follow(batch, channel: Channel, stopping: StopFlag) -> int:
    """A worker rank: apply and run rank 0's steps on its batch (as Engine's) until "stop". Signalled alone
    (rank 0 still sends work), it leaves when idle after GRACE_S; rank 0 then sees the broken group and
    shuts down."""
    error, forwards = "", 0
    watch = Watch(distributed.rank(), distributed.world_size(), channel.tag())
    while True:
        step = channel.recv()
        if kind(step.error) != kind(error):  # the messages may differ by rank (a CUDA OOM names its GPU)
            raise RuntimeError(f"the tensor-parallel ranks disagree on the last step: rank 0 "
                               f"{step.error or 'ran it'!r}, this rank {error or 'ran it'!r}")
        if step.stop:
            return 0
        error = ""
        batch.apply(step)
        if step.runs:
            forwards += 1
            try:
                batch.run(step)
            except Exception as e:  # noqa: BLE001 - compared with rank 0's at the next step
                error = describe(e)
                watch.failed(forwards, error)
        elif stopping.is_set() and stopping.age() > GRACE_S and not step.drop and not step.admit:
            return 0
