"""The rank-lockstep scheduler behind `autotp serve`.

Rank 0's main thread runs `Engine.run`: it takes waiting jobs (from the HTTP thread) into a batch,
broadcasts a command on a gloo control group, runs the batch itself and hands each job its text. The
other ranks run `follow`: receive a command, run the same batch, repeat. Commands are

    ("generate", [Row, ...])   every rank runs batch.run_batch on these rows
    ("idle",)                  sent every HEARTBEAT_S with no work, so a dead rank shows within seconds
    ("stop",)                  every rank returns

Because only rank 0 decides and every rank executes the same command list, ranks cannot drift apart.
After each batch the ranks gather each other's outcome (ok, or the error it raised). The same error on
every rank is a deterministic failure of the batch's input (every rank ran the same rows on the same
logits): its jobs get 500 and the server goes on. A failed collective, a dead rank or ranks that
disagree are not recoverable: the engine answers every job 503 and returns 1. During a batch, rank 0
broadcasts one flag per row and step saying which clients went away (see `Control.flags`). Nothing here
knows HTTP; jobs carry an `emit` callback.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

from autotp.serve.batch import cut_at_stop, decode, run_batch
from autotp.serve.types import Outcome, Result, Row, log

HEARTBEAT_S = 0.5
CONTROL_TIMEOUT_S = 60  # no broadcast waits longer than a heartbeat plus one batch's finishing step
GRACE_S = 5  # a signalled worker waits this long for rank 0's "stop" before leaving on its own


class Control:
    """Command broadcast from rank 0 over a gloo group of its own (NCCL runs keep NCCL for the model)."""

    def __init__(self):
        self.group = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=CONTROL_TIMEOUT_S))

    def share(self, value):
        """rank 0's value on every rank."""
        if self.group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, value) -> list:
        """Every rank's value, on every rank."""
        if self.group is None:
            return [value]
        out = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, value, group=self.group)
        return out

    def flags(self, flags: list[bool]) -> list[bool]:
        """rank 0's per-row flags on every rank, called once per generated token by every rank.

        This is how a disconnected client's row stops in lockstep: only rank 0 knows which clients left,
        and every rank must end the row in the same step. One broadcast of a few bytes per step on the
        gloo group (tens of microseconds on one host) is cheaper than any scheme that lets ranks drift
        and reconcile, and it needs no second decision rule."""
        if self.group is None:
            return flags
        box = torch.tensor(flags, dtype=torch.uint8)
        dist.broadcast(box, src=0, group=self.group)
        return box.bool().tolist()


def run_agreed(control: Control, work: Callable[[], list[Outcome]]) -> tuple[list[Outcome] | None, str]:
    """Run one batch on this rank and agree with the others on its fate: (outcomes, "") or (None, error).

    Raises when the ranks can no longer run in lockstep: a collective failed (DistError) or the ranks
    disagree (one failed where another did not, so they left `generate` at different steps)."""
    outcomes, error = None, ""
    try:
        outcomes = work()
    except dist.DistError:
        raise
    except Exception as e:  # noqa: BLE001 - decided below: the same on every rank is this batch's failure
        error = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    errors = control.gather(error)
    if len(set(errors)) > 1:
        raise RuntimeError(f"the ranks disagree on a batch: {errors}")
    return outcomes, error


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


class TextStream:
    """Streamed text of one job: deltas that never need taking back.

    Held back: trailing U+FFFD (a multi-byte character whose bytes are not all generated yet) and the
    last len(longest stop) - 1 characters (they may begin a stop string, which is never sent)."""

    def __init__(self, stop: tuple[str, ...]):
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = ""

    def delta(self, text: str, final: bool = False) -> str:
        if not final:
            text = text.rstrip("\ufffd")
            text = text[:len(text) - self.hold]
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        new, self.sent = text[len(self.sent):], text
        return new


@dataclass
class Job:
    """One prompt of one request, as rank 0 tracks it. emit(event) must be thread-safe; events are
    ("text", index, delta) when streaming, then ("done", index, Result) or ("error", index, (status, message))."""

    row: Row
    index: int
    emit: Callable[[tuple], None]
    stream: TextStream | None = None
    request: str = ""  # the request's id, for the log
    cancelled: bool = False  # set from the HTTP thread when the client goes away; read at each step

    def fail(self, status: int, message: str) -> None:
        self.emit(("error", self.index, (status, message)))


class Engine:
    """Rank 0's scheduler: `submit` from any thread, `run` in the main thread until `stopping` is set."""

    def __init__(self, model, tokenizer, control: Control, stopping: StopFlag, max_batch_size: int,
                 max_model_len: int):
        self.model, self.tokenizer, self.control = model, tokenizer, control
        self.max_batch_size, self.max_model_len = max_batch_size, max_model_len
        self.inbox: queue.Queue[Job] = queue.Queue()
        self.waiting: list[Job] = []
        self.lock = threading.Lock()  # makes "accepting" and "queued" one step, so no job is lost at shutdown
        self.accepting = True
        self.stopping = stopping

    def submit(self, jobs: list[Job]) -> bool:
        """Queue a request's jobs together; False once the engine is stopping or dead."""
        with self.lock:
            if not self.accepting:
                return False
            for job in jobs:
                self.inbox.put(job)
        return True

    def run(self) -> int:
        """Schedule until stopped (0) or until the ranks can no longer run in lockstep (1)."""
        batch: list[Job] = []
        try:
            while not self.stopping.is_set():
                batch = self._next_batch()
                self.control.share(("generate", [j.row for j in batch]) if batch else ("idle",))
                if batch:
                    self._run(batch)
                batch = []
            self.control.share(("stop",))
            return 0
        except Exception as e:  # noqa: BLE001 - a rank died or a collective failed: lockstep is lost
            reason = f"{type(e).__name__}: {e}".splitlines()[0]
            log(f"tensor-parallel ranks failed, shutting down: {reason}")
            for job in batch:
                job.fail(503, "the tensor-parallel ranks failed while running this request; the server is exiting")
            return 1
        finally:
            with self.lock:
                self.accepting = False
            while not self.inbox.empty():
                self.waiting.append(self.inbox.get_nowait())
            for job in self.waiting:
                job.fail(503, "the server is shutting down")

    def _fits(self, batch: list[Job]) -> bool:
        # left padding makes every row as long as the longest prompt plus the largest budget
        longest = max(len(j.row.ids) for j in batch)
        return longest + max(j.row.max_tokens for j in batch) <= self.max_model_len

    def _next_batch(self) -> list[Job]:
        """Waiting jobs in arrival order, up to max_batch_size and the context; [] after a heartbeat of none."""
        if not self.waiting:
            try:
                self.waiting.append(self.inbox.get(timeout=HEARTBEAT_S))
            except queue.Empty:
                return []
        while not self.inbox.empty():
            self.waiting.append(self.inbox.get_nowait())
        self.waiting = [j for j in self.waiting if not j.cancelled]  # their clients left before they started
        if not self.waiting:
            return []
        size = 1  # the first job always fits alone: requests are checked against max_model_len
        while (size < min(self.max_batch_size, len(self.waiting)) and self._fits(self.waiting[:size + 1])):
            size += 1
        batch, self.waiting = self.waiting[:size], self.waiting[size:]
        return batch

    def _run(self, batch: list[Job]) -> None:
        def on_token(i: int, tokens: list[int]) -> None:
            # runs on rank 0 only, inside the step every rank takes together: nothing may escape from here,
            # or rank 0 would leave the step while the others wait in its collectives (a hang). A delta that
            # fails to decode (e.g. the tokenizer busy in the parser thread) is sent with the next one.
            job = batch[i]
            if job.stream is None:
                return
            try:
                delta = job.stream.delta(decode(self.tokenizer, tokens))
            except Exception as e:  # noqa: BLE001 - see above
                log(f"{job.request} prompt {job.index}: a streamed delta is deferred: {type(e).__name__}: {e}")
                return
            if delta:
                job.emit(("text", job.index, delta))

        outcomes, error = run_agreed(self.control, lambda: run_batch(
            self.model, self.tokenizer, [j.row for j in batch], on_token,
            lambda: self.control.flags([j.cancelled for j in batch])))
        if outcomes is None:
            log(f"a batch of {len(batch)} failed on every rank; the server goes on: {error}")
            for job in batch:
                job.fail(500, f"generation failed: {error}")
            return
        for job, out in zip(batch, outcomes, strict=True):
            if out.finish_reason == "error":
                log(f"{job.request} prompt {job.index} failed: {out.error}")
                job.fail(500, out.error)
            elif out.finish_reason == "cancelled":
                log(f"{job.request} prompt {job.index} cancelled after {len(out.tokens)} of {job.row.max_tokens} "
                    f"tokens: the client went away")
            else:
                try:
                    self._finish(job, out)
                except Exception as e:  # noqa: BLE001 - rank 0's decoding after the batch: this request only
                    log(f"{job.request} prompt {job.index} failed after generating: {type(e).__name__}: {e}")
                    job.fail(500, f"decoding the completion failed: {type(e).__name__}")

    def _finish(self, job: Job, out: Outcome) -> None:
        text, _ = cut_at_stop(decode(self.tokenizer, out.tokens), job.row.stop)
        if job.stream is not None:
            delta = job.stream.delta(text, final=True)
            if delta:
                job.emit(("text", job.index, delta))
        job.emit(("done", job.index, Result(text, out.finish_reason, len(out.tokens))))


def follow(model, tokenizer, control: Control, stopping: StopFlag) -> int:
    """A worker rank: run rank 0's commands until "stop". Signalled alone (rank 0 still sends work), it
    leaves between batches after GRACE_S; rank 0 then sees the broken group and shuts down."""
    while True:
        command = control.share(None)
        if command[0] == "stop":
            return 0
        if command[0] == "generate":
            rows = command[1]
            run_agreed(control, partial(run_batch, model, tokenizer, rows,
                                        cancelled=partial(control.flags, [False] * len(rows))))
        elif stopping.is_set() and stopping.age() > GRACE_S:
            return 0
