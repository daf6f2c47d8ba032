"""Continuous batching in rank lockstep: rank 0's `Engine` decides every step, the other ranks `follow`.

Each step rank 0 (the main thread of `autotp serve`):
1. takes new jobs from the HTTP thread into the waiting queue (bounded: past `max_queue`, `submit` says
   "full" and the client gets 429);
2. plans the step (planner.py): rows that leave (finished, failed, cancelled by a client that went away), and
   what each row computes, in one forward over every row's new tokens (runner/model_runner.py), prompts
   starting from their longest cached prefix, decoding rows with their speculative drafts;
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
from concurrent.futures import Future
from itertools import islice

import numpy as np
import torch

from autotp import distributed
from autotp.sampler import RowSampler, SamplingParams
from autotp.serve.api.metrics import Metrics
from autotp.serve.engine import lookup
from autotp.serve.engine.output import Output, describe, eos_ids
from autotp.serve.engine.planner import Limits, PagedPlanner
from autotp.serve.engine.request import Request
from autotp.serve.lockstep.watchdog import StepWatchdog, Watch
from autotp.serve.lockstep.wire import Channel, Step
from autotp.serve.types import log

HEARTBEAT_S = 0.5  # an idle rank 0 sends an empty step this often, so a dead rank shows within seconds
GRACE_S = 5  # a signalled worker waits this long for rank 0's "stop" before leaving on its own


def landed(logits) -> None:
    """Wait, inside the watchdog's window, until the device has run the step. On CUDA `batch.run` only queues the
    step's kernels and collectives: without this, a rank that dies or runs out of memory mid-step would leave rank
    0 blocked in output.take's first host sync, outside the window, until NCCL's timeout (10 minutes). It moves
    that sync here, adding none (the followers, which sample nothing, now wait for their device too)."""
    if logits.is_cuda:
        torch.cuda.synchronize(logits.device)


def device_lost(e: BaseException) -> bool:
    """An asynchronous CUDA error (a device-side assert, an illegal address): it poisons the process's CUDA
    context, so every later step fails too and "a failing row fails alone" cannot hold. The rank that sees it
    exits (rank 0: every request 503, one line, exit 1). An out-of-memory error is not one: it is recoverable."""
    if isinstance(e, torch.OutOfMemoryError):
        return False
    return isinstance(e, ACCELERATOR_ERROR) or "CUDA error: " in str(e)  # (torch < 2.8: a RuntimeError)


ACCELERATOR_ERROR = getattr(torch, "AcceleratorError", ())  # what torch >= 2.8 raises for a CUDA error


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


class Engine:
    """Rank 0's scheduler: `submit` from any thread, `run` in the main thread until `stopping` is set.

    batch: this rank's rows (runner/model_runner.PagedBatch, which the engine drives by its steps and never
    imports); planner: the block accounting; speculate: up to this many
    prompt-lookup draft tokens verified per decoding row and step."""

    def __init__(self, batch, tokenizer, channel: Channel, stopping: StopFlag, limits: Limits,
                 max_queue: int, planner: PagedPlanner, metrics: Metrics | None = None, speculate: int = 0):
        self.batch, self.planner = batch, planner
        self.speculate = speculate  # draft tokens per row per step (lookup.py)
        self.channel, self.stopping, self.limits, self.max_queue = channel, stopping, limits, max_queue
        self.active: dict[int, Request] = {}
        # a copy of its own: the parser thread encodes with the original, and HF fast tokenizers are not
        # meant to be used from two threads at once
        self.output = Output(copy.deepcopy(tokenizer), eos_ids(batch.model), self.active)
        self.metrics = metrics
        self.inbox: queue.Queue[Request] = queue.Queue()
        self.waiting: deque[Request] = deque()
        self.next_id = 0
        self.queued = 0  # jobs in inbox + waiting, under `lock`
        self.lock = threading.Lock()  # makes "accepting" and "queued" one step, so no job is lost at shutdown
        self.accepting = True
        self.error = ""  # how this rank's last step failed, sent with the next step
        self.failed: list[tuple[Request, str]] = []  # answered 500 once the next step reached every rank
        self.forwards = 0  # steps that ran a forward, numbered as every rank numbers them (watchdog.py)
        self.doing = "starting"  # what the ranks do now, for the line that says a rank died
        self.watch = Watch(0, distributed.world_size(), channel.tag())
        self.watchdog = StepWatchdog(self.watch, self._lost)
        self.flushes: queue.Queue[Future] = queue.Queue()  # POST /flush_cache, answered between two steps

    @property
    def metrics(self) -> Metrics | None:
        return self.output.metrics

    @metrics.setter
    def metrics(self, metrics: Metrics | None) -> None:
        self.output.metrics = metrics
        self.planner.metrics = metrics

    def submit(self, jobs: list[Request]) -> str:
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

    def flush_cache(self) -> Future:
        """Empty the prefix cache on the engine's thread, between two steps (any thread may ask). The future's
        result: the cached blocks forgotten (0 without prefix caching), or None while rows run or prompts wait:
        nothing is flushed then, as SGLang refuses, since running rows would cache their blocks again."""
        future: Future = Future()
        self.flushes.put(future)
        return future

    def _answer_flushes(self) -> None:
        while not self.flushes.empty():
            future = self.flushes.get_nowait()
            with self.lock:
                busy = bool(self.active or self.queued)
            future.set_result(None if busy else self.planner.pool.flush() if self.planner is not None else 0)

    def load(self) -> tuple[int, int, int]:
        """(rows running, prompts waiting, tokens): the KV slots rows hold plus the waiting prompts' tokens, as
        SGLang's /get_load counts them; any thread."""
        with self.lock:
            waiting = [j.row.ids for j in list(self.waiting)]
            running = sum(not a.done for a in list(self.active.values()))
            queued = self.queued
        return running, queued, self.kv_used() + sum(map(len, waiting))

    def counts(self) -> tuple[int, int]:
        """(rows running or prefilling, jobs waiting), for the metrics; any thread. A row that has its answer
        (done) no longer counts, though its memory goes at the next step."""
        with self.lock:
            return sum(not a.done for a in list(self.active.values())), self.queued

    def kv_used(self) -> int:
        """Cache slots in the blocks rows hold now (idle cached blocks are free room); any thread."""
        return self.planner.kv_used()

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
        while not self.flushes.empty():
            self.flushes.get_nowait().set_exception(RuntimeError("the server is shutting down"))

    def _lost(self, why: str) -> None:
        """Lockstep is lost (a rank died, a collective failed, a forward failed on some ranks only): every
        admitted request is answered 503 and no new one is taken. From the main thread, or from the watchdog's
        while the main thread waits in a collective that will never end (it then ends the process)."""
        log(f"tensor-parallel ranks failed, shutting down: {why}")
        message = "the tensor-parallel ranks failed while running this request; the server is exiting"
        for job in [a for a in self.active.values() if not a.done] + [j for j, _ in self.failed]:
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
        self._answer_flushes()
        if not step.runs:
            return
        self.forwards += 1
        self.doing = f"running the forward of step {self.forwards} ({len(self.active)} rows)"
        self.watchdog.begin(self.forwards)
        try:
            scores = self.batch.run(step)
            landed(scores.logits)
        except Exception as e:  # noqa: BLE001 - the next step tells every rank; they must have failed alike
            self.watchdog.end()
            if self.watch.died(e, self.doing):  # no rank is left to compare with: run() says which one died
                raise
            self.watch.failed(self.forwards, describe(e))
            if device_lost(e):
                raise RuntimeError(f"the GPU can run nothing more, restart the server: {describe(e)}") from e
            if not self.watch.alike(self.forwards):  # a rank that did not fail waits in a collective
                raise RuntimeError(f"rank 0's forward failed and another rank's did not: {describe(e)}") from e
            self.error = describe(e)
            lost = set(self.active) - set(self.batch.rows())
            log(f"a step of {len(lost)} rows failed; they get 500 and the server goes on: {self.error}")
            for row in lost:
                self.failed.append((self.active.pop(row), f"generation failed: {self.error}"))
                self.planner.release(row)
            return
        self.watchdog.end()
        kept = self.output.take(scores)
        self.planner.ran(step, {w.row: self._tokens(w.row) for w in step.work}, kept)

    def _tokens(self, row: int) -> tuple[tuple[int, ...], list[int]]:
        """A row's prompt and generated tokens (the planner reads the spans it needs, copying neither)."""
        a = self.active[row]
        return a.row.ids, a.tokens

    def _drafts(self) -> dict[int, tuple[int, ...]]:
        """Each decoding row's prompt-lookup draft (lookup.py), no longer than its budget leaves room for."""
        drafts = {}
        for row, a in self.active.items():
            room = min(self.speculate, a.row.max_tokens - len(a.tokens) - 1)
            a.draft = ()
            if a.done or not a.tokens or room <= 0:
                continue
            if a.prompt is None:
                a.prompt = np.asarray(a.row.ids, dtype=np.int64)
            a.draft = lookup.draft(np.concatenate((a.prompt, np.asarray(a.tokens, dtype=np.int64))), room)
            if a.draft:
                drafts[row] = a.draft
        return drafts

    def _unqueue(self, job: Request) -> Request:
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
        job.sampler = RowSampler(params, self.batch.device)
        self.active[self.next_id] = job
        self.next_id += 1
        return self.next_id - 1

    def _plan(self) -> Step:
        for a in self.active.values():
            if a.cancelled and not a.done:
                a.done = True
                log(f"{a.request_id} prompt {a.index} cancelled after {len(a.tokens)} of {a.row.max_tokens} "
                    f"tokens: the client went away")
        drop = tuple(r for r, a in self.active.items() if a.done)
        error, self.error = self.error, ""
        head = [] if self.stopping.is_set() else list(islice(self.waiting, self.limits.max_num_seqs))
        rows = {r: self._tokens(r) for r, a in self.active.items() if not a.done}
        step = self.planner.plan(rows, drop, [(j.row.ids, j.row.max_tokens, j.row.prompt_logprobs) for j in head],
                                 lambda _: self._admit(), self._drafts() if self.speculate else None)
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
                landed(batch.run(step).logits)
            except Exception as e:  # noqa: BLE001 - compared with rank 0's at the next step
                error = describe(e)
                watch.failed(forwards, error)
                if device_lost(e):
                    raise
        elif stopping.is_set() and stopping.age() > GRACE_S and not step.drop:
            return 0
