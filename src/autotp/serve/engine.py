"""Continuous batching in rank lockstep: rank 0's `Engine` decides every step, the other ranks `follow`.

Each step rank 0 (the main thread of `autotp serve`):
1. takes new jobs from the HTTP thread into the waiting queue (bounded: past `max_queue`, `submit` says
   "full" and the client gets 429);
2. plans the step (scheduler.py): rows that leave (finished, failed, cancelled by a client that went
   away), the running rows' next tokens, a new prefill group when there is room, the prefill chunk;
3. sends it (wire.py: one broadcast) and runs it on its own `Batch` as every rank does (state.py);
4. samples the rows whose logits came back (sampler.py, each row with its own seeded generator),
   streams their text, and marks the rows that finished, which leave at the next step.

So a request never waits for another one to finish: it joins at the next step that has room, and its
first token comes out of its own prefill. The ranks never decide anything: they apply rank 0's steps.
A forward that raises on every rank alike (the same error text) fails the rows it ran with 500 and the
server goes on; any disagreement, a failed collective or a dead rank ends lockstep: rank 0 answers
every job 503 and returns 1. Nothing here knows HTTP; jobs carry an `emit` callback.
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from autotp.generate import pad_token_id
from autotp.sampler import RowSampler, SampleError, SamplingParams
from autotp.serve.metrics import Metrics
from autotp.serve.scheduler import Limits, Need, admit, chunk_size
from autotp.serve.state import Batch, Logits
from autotp.serve.text import TextStream, cut_at_stop, decode, first_stop
from autotp.serve.types import Piece, Result, Row, TokenLogprob, log
from autotp.serve.wire import Channel, Step

HEARTBEAT_S = 0.5  # an idle rank 0 sends an empty step this often, so a dead rank shows within seconds
GRACE_S = 5  # a signalled worker waits this long for rank 0's "stop" before leaving on its own


def describe(e: BaseException) -> str:
    """An exception as one line, the same on every rank for the same failure."""
    return f"{type(e).__name__}: {e}".splitlines()[0][:200]


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


@dataclass
class Active:
    """A job admitted to the batch: its sampler, the tokens generated so far, the token it feeds next."""

    job: Job
    sampler: RowSampler
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=lambda: [None])  # the first has none
    next: int | None = None
    done: bool = False  # finished, failed or answered: leaves at the next step
    last: float | None = None  # when its last token came out (metrics)

    def fail(self, status: int, message: str) -> None:
        """Answer the job with an error; the row leaves at the next step."""
        self.done = True
        self.job.fail(status, message)

    def need(self) -> Need:
        row = self.job.row
        return Need(len(row.ids) + len(self.tokens), row.max_tokens - len(self.tokens))


def eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos) if isinstance(eos, list) else {eos} if eos is not None else set()


class Engine:
    """Rank 0's scheduler: `submit` from any thread, `run` in the main thread until `stopping` is set."""

    def __init__(self, model, tokenizer, channel: Channel, stopping: StopFlag, limits: Limits, max_queue: int,
                 metrics: Metrics | None = None):
        self.batch = Batch(model, pad_token_id(model.generation_config))
        # a copy of its own: the parser thread encodes with the original, and HF fast tokenizers are not
        # meant to be used from two threads at once
        self.tokenizer = copy.deepcopy(tokenizer)
        self.channel, self.stopping, self.limits, self.max_queue = channel, stopping, limits, max_queue
        self.metrics = metrics
        self.eos = eos_ids(model)
        self.special = set(tokenizer.all_special_ids)
        self.inbox: queue.Queue[Job] = queue.Queue()
        self.waiting: deque[Job] = deque()
        self.active: dict[int, Active] = {}
        self.next_id = 0
        self.queued = 0  # jobs in inbox + waiting, under `lock`
        self.lock = threading.Lock()  # makes "accepting" and "queued" one step, so no job is lost at shutdown
        self.accepting = True
        self.error = ""  # how this rank's last step failed, sent with the next step
        self.failed: list[tuple[Job, str]] = []  # answered 500 once the next step reached every rank

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
        """Cache slots the rows hold now (the padded batch's rows x width, and the prefill's); any thread."""
        running, prefill = self.batch.running, self.batch.prefill
        used = running.mask.numel() if running is not None else 0
        return used + (prefill.batch.mask.numel() if prefill is not None else 0)

    def run(self) -> int:
        """Schedule until stopped and drained (0) or until the ranks can no longer run in lockstep (1)."""
        try:
            while not (self.stopping.is_set() and self._drained()):
                self.step()
            self.channel.send(Step(stop=True, error=self.error))
            self._answer_failed()
            return 0
        except Exception as e:  # noqa: BLE001 - a rank died or a collective failed: lockstep is lost
            log(f"tensor-parallel ranks failed, shutting down: {describe(e)}")
            message = "the tensor-parallel ranks failed while running this request; the server is exiting"
            for job in [a.job for a in self.active.values() if not a.done] + [j for j, _ in self.failed]:
                job.fail(503, message)
            return 1
        finally:
            with self.lock:
                self.accepting = False
            self._intake(block=False)
            for job in self.waiting:
                job.fail(503, "the server is shutting down")
            self.waiting.clear()

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
        self.channel.send(step)
        self._answer_failed()
        self.batch.apply(step)
        for row in step.drop:
            del self.active[row]
        if not (step.chunk or step.tokens):
            return
        try:
            logits = self.batch.run(step, prefilled=self._sample_prefill)
        except Exception as e:  # noqa: BLE001 - the next step tells every rank; they must have failed alike
            self.error = describe(e)
            lost = set(self.active) - set(self.batch.rows())
            log(f"a step of {len(lost)} rows failed; they get 500 and the server goes on: {self.error}")
            for row in lost:
                self.failed.append((self.active.pop(row).job, f"generation failed: {self.error}"))
            logits = None
        if logits is not None and logits.decode is not None:
            self._sample_or_fail(logits.decode_rows, lambda: self._sample_rows(logits.decode_rows, logits.decode))

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

    def _plan(self) -> Step:
        for a in self.active.values():
            if a.job.cancelled and not a.done:
                a.done = True
                log(f"{a.job.request} prompt {a.job.index} cancelled after {len(a.tokens)} of {a.job.row.max_tokens} "
                    f"tokens: the client went away")
        drop = tuple(r for r, a in self.active.items() if a.done)
        order = self.batch.order_after(drop)
        tokens = tuple(self.active[r].next for r in order)
        error, self.error = self.error, ""
        group = self.batch.prefill
        group_rows = [r for r in group.rows if r not in drop] if group is not None and not group.complete else []
        if group_rows:  # the prefill in progress goes on
            left = group.ids.shape[1] - group.done
            return Step(drop, tokens, chunk=chunk_size(len(group_rows), left, len(order), self.limits), error=error)
        if not self.waiting or self.stopping.is_set():
            return Step(drop, tokens, error=error)
        head = [j for _, j in zip(range(self.limits.max_num_seqs), self.waiting, strict=False)]
        count = admit([Need(len(j.row.ids), j.row.max_tokens) for j in head],
                      [self.active[r].need() for r in order], self.limits)
        admitted = []
        for _ in range(count):
            job = self._unqueue(self.waiting.popleft())
            row = job.row
            params = SamplingParams(row.temperature, row.top_p, row.top_k, row.seed)
            self.active[self.next_id] = Active(job, RowSampler(params, self.batch.device))
            admitted.append((self.next_id, row.ids))
            self.next_id += 1
        if not admitted:
            return Step(drop, tokens, error=error)
        width = max(len(ids) for _, ids in admitted)
        all_logits = any(self.active[r].job.row.prompt_logprobs for r, _ in admitted)
        return Step(drop, tokens, tuple(admitted), chunk_size(len(admitted), width, len(order), self.limits),
                    all_logits=all_logits, error=error)

    def _sample_prefill(self, logits: Logits) -> None:
        """Between the step's two forwards: a prompt that is now complete streams its first token while
        the running rows decode (their forward releases the GIL to the event loop that sends it)."""

        if self.batch.prefill is not None and self.batch.prefill.all_logits:
            asked = [r for r in logits.prefill_rows if self.active[r].job.row.prompt_logprobs]
            self._sample_or_fail(asked, lambda: self._prompt_logprobs(logits))
        if logits.first:
            self._sample_or_fail(logits.prefill_rows, lambda: self._sample_rows(logits.prefill_rows,
                                                                                  logits.prefill[:, -1]))

    def _sample_or_fail(self, rows: list[int], work) -> None:
        """Rank 0's own work on a forward's scores (sampling, log-probabilities: an allocation that fails, a
        bug): what it raises fails `rows` with 500 and nothing else. The ranks ran the same forwards, so they
        stay in lockstep, and the failed rows leave at the next step."""
        try:
            work()
        except Exception as e:  # noqa: BLE001 - one request must not take the server down
            log(f"rank 0's work on the scores of {len(rows)} rows failed; they get 500 and the server goes on: "
                f"{describe(e)}")
            for row in rows:
                a = self.active.get(row)
                if a is not None and not a.done:
                    a.fail(500, f"generation failed: {describe(e)}")

    def _sample_rows(self, rows: list[int], scores: torch.Tensor) -> None:
        """scores (rows, vocab): each row's next token, then its log-probabilities where it asked for them."""
        finite = torch.isfinite(scores.max(dim=-1).values).tolist()
        greedy = scores.argmax(dim=-1).tolist()  # what RowSampler.pick gives a greedy row, for all at once
        picked: dict[int, int] = {}
        for i, row in enumerate(rows):
            a = self.active[row]
            if a.done:  # failed earlier in this step (its prompt's log-probabilities)
                continue
            try:
                picked[i] = greedy[i] if finite[i] and a.sampler.generator is None else a.sampler.pick(scores[i])
            except SampleError as e:
                log(f"{a.job.request} prompt {a.job.index} failed: {e}")
                a.fail(500, str(e))
        want = [i for i in picked if self.active[rows[i]].job.row.logprobs is not None]
        logprobs: dict[int, TokenLogprob] = {}

        def compute() -> None:
            tops = [self.active[rows[i]].job.row.logprobs for i in want]
            logprobs.update(zip(want, token_logprobs(scores[want], [picked[i] for i in want], tops), strict=True))

        self._sample_or_fail([rows[i] for i in want], compute)
        for i, token in picked.items():
            if not self.active[rows[i]].done:
                self._advance(self.active[rows[i]], token, logprobs.get(i))

    def _prompt_logprobs(self, logits: Logits) -> None:
        """Each prompt token's log-probability given the ones before it, from this chunk's scores
        (rows, end - start, vocab): column j predicts column j + 1 of the left-padded prompt."""
        width = self.batch.prefill.ids.shape[1]
        for i, row in enumerate(logits.prefill_rows):
            a = self.active[row]
            if not a.job.row.prompt_logprobs:
                continue
            ids, first = a.job.row.ids, width - len(a.job.row.ids)  # the row's tokens fill [first, width)
            cols = range(max(logits.start, first), min(logits.end, width - 1))
            if cols:
                targets = [ids[j + 1 - first] for j in cols]
                picked = logits.prefill[i, cols.start - logits.start:cols.stop - logits.start]
                a.prompt_logprobs += token_logprobs(picked, targets, [a.job.row.logprobs or 0] * len(targets))

    def _advance(self, a: Active, token: int, logprob: TokenLogprob | None) -> None:
        """A row's new token: it finishes here (eos, stop string, budget) or feeds the next step."""
        a.tokens.append(token)
        if logprob is not None:
            a.logprobs.append(logprob)
        row, job = a.job.row, a.job
        if self.metrics is not None:
            a.last = self.metrics.token(job.arrived, a.last)
        try:
            watched = bool(row.stop) or job.stream is not None  # text needed at every token, not only the last
            text = decode(self.tokenizer, a.tokens) if watched else ""
            stopped_by = first_stop(text, row.stop) if row.stop else ""
            if token in self.eos or stopped_by:
                reason = "stop"
            elif len(a.tokens) >= row.max_tokens:
                reason = "length"
            else:
                a.next, reason = token, ""
            if reason:
                text = cut_at_stop(text if watched else decode(self.tokenizer, a.tokens), row.stop)[0]
            if job.stream is not None:
                delta = job.stream.delta(text, final=bool(reason))
                job.emit(("token", job.index, Piece(token, delta, token in self.special, logprob)))
            if reason:
                a.done = True
                if self.metrics is not None:
                    self.metrics.finished(job.arrived, reason, len(row.ids), len(a.tokens))
                job.emit(("done", job.index, Result(text, reason, len(a.tokens), tuple(a.tokens), tuple(a.logprobs),
                                                    tuple(a.prompt_logprobs), stopped_by)))
        except Exception as e:  # noqa: BLE001 - rank 0's decoding, between steps: this request only
            log(f"{job.request} prompt {job.index} failed after generating: {describe(e)}")
            a.fail(500, f"decoding the completion failed: {type(e).__name__}")


def token_logprobs(scores: torch.Tensor, tokens: list[int], tops: list[int]) -> list[TokenLogprob]:
    """scores (n, vocab) and the token taken at each -> its log-probability and the tops[i] likeliest."""
    if not tokens:
        return []
    lp = torch.log_softmax(scores.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    k = max(tops)
    values, ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    values, ids = values.tolist(), ids.tolist()
    return [TokenLogprob(t, c, tuple(zip(ids[i][:tops[i]], values[i][:tops[i]], strict=True)))
            for i, (t, c) in enumerate(zip(tokens, chosen, strict=True))]


def follow(model, channel: Channel, stopping: StopFlag) -> int:
    """A worker rank: apply and run rank 0's steps until "stop". Signalled alone (rank 0 still sends
    work), it leaves when idle after GRACE_S; rank 0 then sees the broken group and shuts down."""
    batch = Batch(model, pad_token_id(model.generation_config))
    error = ""
    while True:
        step = channel.recv()
        if kind(step.error) != kind(error):  # the messages may differ by rank (a CUDA OOM names its GPU)
            raise RuntimeError(f"the tensor-parallel ranks disagree on the last step: rank 0 "
                               f"{step.error or 'ran it'!r}, this rank {error or 'ran it'!r}")
        if step.stop:
            return 0
        error = ""
        batch.apply(step)
        if step.chunk or step.tokens:
            try:
                batch.run(step)
            except Exception as e:  # noqa: BLE001 - compared with rank 0's at the next step
                error = describe(e)
        elif stopping.is_set() and stopping.age() > GRACE_S and not step.drop and not step.admit:
            return 0
