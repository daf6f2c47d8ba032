"""The pipeline's wires: each step's hop from a stage's rank to the next stage's rank of the same tensor-parallel
index, with the hidden states it computed, and each step's sampled tokens from the last stage back to rank 0.

A hop is the step (pickled once by rank 0 and handed on as those bytes, never pickled again), an error (the step's
forward failed on this stage, or on one before it: the later stages skip it) and the hidden states (tokens, hidden),
raw bytes in the model's dtype. On the wire: the step, the error and the hidden states' shape and dtype, framed as
lockstep/wire.py frames a step (a BUFFER-byte message that gives their length, and one of exactly that length where
they do not fit in it); then the hidden states. So a decode step's hop is two messages, a few hundred bytes and one
hidden state per token.

Everything goes through one gloo group of the whole world, point to point (CPU tensors: on GPUs the hidden states
cross through host memory). gloo's send completes only once the receiver has posted its receive, so:
- sends are posted without waiting (`isend`) and waited for only when more than MAX_PENDING are out, so a stage
  computes its next step while the next stage still computes the last one;
- every message is received by a thread of its own (`Inbox`) as soon as it is sent, so the wire time of a long
  prompt's hidden states overlaps the receiving stage's compute instead of following it.
A peer whose process ended fails the receive at once (the inbox hands the error on); a peer that stops answering
(its host died, its link is down) is liveness.py's to notice.
"""

from __future__ import annotations

import pickle
import queue
import threading
from collections import deque
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from autotp.serve.lockstep.step import Step, StepResult
from autotp.serve.lockstep.wire import BUFFER, frame, unframe

MAX_PENDING = 8  # sends posted and not yet taken: a stage runs at most this far ahead of the next
TIMEOUT_S = 600  # the group's: liveness.py, not gloo's timeout, bounds a wait for a peer that stopped answering


class Hop(NamedTuple):
    """One step as a stage hands it to the next."""

    step: Step
    raw: bytes  # the step as rank 0 pickled it
    error: str  # "" where every stage so far ran it
    hidden: torch.Tensor | None  # (tokens, hidden), on the CPU; None for a step that runs nothing or failed
    without: tuple[int, ...] = ()  # requests whose tokens `hidden` leaves out (their forward failed before)


EMPTY = object()  # Inbox.get: nothing arrived in time


class Lost(NamedTuple):
    """What an inbox hands on when its receive failed: the peer's process is gone (or the group was destroyed)."""

    error: BaseException


def _frame(payload: bytes) -> list[torch.Tensor]:
    """payload -> the messages that carry it (wire.frame), each its own tensor: a posted send reads it later."""
    head = torch.zeros(BUFFER, dtype=torch.uint8)
    rest = frame(payload, head)
    return [head] if rest is None else [head, rest]


class Links:
    """This rank's wires (every rank makes the group together). `send`: a hop to the next stage; `send_result`: the
    sampler's results to rank 0; what arrives is read from `inbox` (start it with `listen`)."""

    def __init__(self, rank: int, next_rank: int | None, prev_rank: int | None, sampler: int):
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT_S))
        self.rank, self.next, self.prev, self.sampler = rank, next_rank, prev_rank, sampler
        self.pending: deque = deque()  # (work, tensors it reads) of posted sends
        self.inbox: Inbox | None = None

    def _post(self, to: int, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            self.pending.append((dist.isend(t, to, group=self.group), t))
        while len(self.pending) > MAX_PENDING:
            self.pending.popleft()[0].wait()

    def send(self, hop_raw: bytes, error: str = "", hidden: torch.Tensor | None = None,
             without: tuple[int, ...] = ()) -> None:
        """The step (as pickled bytes) to the next stage, with what this stage made of it: the hidden states of its
        requests but those `without` (their forward failed on this stage or one before)."""
        shape = None if hidden is None else (tuple(hidden.shape), str(hidden.dtype).removeprefix("torch."))
        tensors = _frame(pickle.dumps((hop_raw, error, shape, without), protocol=pickle.HIGHEST_PROTOCOL))
        if hidden is not None:
            tensors.append(hidden.detach().to("cpu").contiguous().view(-1).view(torch.uint8))
        self._post(self.next, tensors)

    def send_result(self, result: StepResult | None) -> None:
        """A step's result, from the sampling rank (the last stage's first) to rank 0; None: the last (stop)."""
        self._post(0, _frame(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)))

    def listen(self, source: int, hops: bool) -> Inbox:
        """Start receiving from `source`: hops (from the stage before) or results (rank 0, from the sampler)."""
        self.inbox = Inbox(self.group, source, hops)
        self.inbox.start()
        return self.inbox

    def flush(self) -> None:
        """Wait until every posted send was taken (before this rank leaves: its peer must still read them)."""
        while self.pending:
            self.pending.popleft()[0].wait()

    def close(self) -> None:
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


class Inbox(threading.Thread):
    """Receives from one peer, message after message, into a queue, until the last (a stop): `get(timeout)` -> a Hop
    (hops=True) or a StepResult (None: the sampler stopped), Lost, or Empty when nothing came within `timeout`."""

    def __init__(self, group, source: int, hops: bool):
        super().__init__(name=f"autotp-inbox-{source}", daemon=True)
        self.group, self.source, self.hops = group, source, hops
        self.queue: queue.SimpleQueue = queue.SimpleQueue()

    def _recv(self, n: int) -> torch.Tensor:
        t = torch.empty(n, dtype=torch.uint8)
        dist.recv(t, self.source, group=self.group)
        return t

    def _payload(self) -> bytes:
        size, data = unframe(self._recv(BUFFER))
        return data if data is not None else self._recv(size).numpy().tobytes()

    def run(self) -> None:
        try:
            while True:
                payload = self._payload()
                if not self.hops:
                    result = pickle.loads(payload)
                    self.queue.put(result)
                    if result is None:  # the sampler stopped
                        return
                    continue
                raw, error, shape, without = pickle.loads(payload)
                step = pickle.loads(raw)
                hidden = None
                if shape is not None:
                    dims, dtype = shape
                    dtype = getattr(torch, dtype)
                    n = dtype.itemsize
                    for d in dims:
                        n *= d
                    hidden = self._recv(n).view(dtype).view(dims)
                self.queue.put(Hop(step, raw, error, hidden, without))
                if step.stop:
                    return
        except Exception as e:  # noqa: BLE001 - the peer is gone: whoever reads the queue says so
            self.queue.put(Lost(e))

    def get(self, timeout: float):
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            return EMPTY
