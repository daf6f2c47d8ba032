"""Rank 0's engine: continuous batching, `schedule()` -> the executor -> the output processor -> `update()`.

Each iteration (`step`), in rank 0's main thread:
1. new requests come from the HTTP thread (`submit`: bounded, past `max_queue` it says "full" and the client gets
   429), and the ones whose clients went away leave (`abort`);
2. the scheduler (scheduler.py) hands out the next step: what each running request computes, the prompts admitted;
3. the executor (lockstep/executor.py) sends it to every rank and runs it; an idle engine sends an empty step after
   up to HEARTBEAT_S (a heartbeat, so a dead rank shows within seconds);
4. a step whose tokens are in goes through the output processor (output.py: text, stops, answers) and back to the
   scheduler (`update`: blocks cached, finished requests freed).

So a request never waits for another one to finish: it joins at the next step that has room. Up to `executor.depth`
steps are in flight at once (1 with tensor parallelism alone; a pipeline keeps one per stage), each request in one of
them at most. The engine hands back data: each step's events (types.Token, Finished, Failed) for the clients, and
its StepStats (stats.py) for the metrics; `run` passes them to whoever serves them. No torch, no HTTP.

Failures: a forward that raised on every rank alike fails its requests with 500 (answered once the next step has
reached every rank) and the server goes on; anything that breaks lockstep (executor.py says which) answers every
request 503 and ends the loop with 1.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from autotp.errors import one_line
from autotp.serve.engine.output import OutputProcessor
from autotp.serve.engine.request import Request, Status
from autotp.serve.engine.scheduler import Scheduler
from autotp.serve.engine.stats import Load, StepStats
from autotp.serve.lockstep.step import LockstepLost, Step, StepResult
from autotp.serve.types import Event, Failed, Row, StopFlag, log

HEARTBEAT_S = 0.5  # an idle engine sends an empty step this often, so a dead rank shows within seconds
SHUTTING_DOWN = "the server is shutting down"
LOST = "the model's ranks failed while running this request; the server is exiting"


@dataclass
class EngineOutput:
    """What one iteration hands back: its events, oldest first, and its stats."""

    events: list[Event] = field(default_factory=list)
    stats: StepStats = field(default_factory=StepStats)


class Engine:
    """`submit`, `abort`, `flush_cache` and `load` from any thread; `step` (or `run`) in rank 0's main thread.

    executor: runs the steps on every rank (lockstep/executor.Lockstep: `depth`, `submit`, `collect`, `stop`,
    `watch_for`); output: the output processor."""

    def __init__(self, scheduler: Scheduler, executor, output: OutputProcessor, max_queue: int,
                 stopping: StopFlag | None = None):
        self.scheduler, self.executor, self.output = scheduler, executor, output
        self.max_queue, self.stopping = max_queue, stopping or StopFlag()
        self.requests: dict[int, Request] = {}  # every request the engine holds, waiting or running (engine thread)
        self.clients: dict[str, list[Request]] = {}  # the same, by their client's id
        self.inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self.aborts: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.flushes: queue.SimpleQueue[Future] = queue.SimpleQueue()  # POST /flush_cache, answered between steps
        self.in_flight: deque[Step] = deque()
        self.lane = 0  # whose step is next (scheduler.py: one lane per step in flight)
        self.pending: list[Event] = []  # a failed step's answers, sent once the next step has reached every rank
        self.lock = threading.Lock()  # makes "accepting" and "queued" one step, so no request is lost at shutdown
        self.accepting = True
        self.next_id = 0
        self.queued = self.queued_tokens = 0  # requests submitted and not yet admitted, and their prompts' tokens
        self.running = self.kv_used = 0  # as of the last step, for `load`
        self.deliver: Callable[[EngineOutput], None] = lambda output: None
        executor.watch_for(self._abandon)

    # --- any thread ---

    def submit(self, client: str, rows: list[Row], stream: bool = False, arrived: float | None = None) -> str:
        """Queue a client's rows together: "ok", "full" (the queue holds max_queue rows) or "closed". Their events
        name `client` and each row's index in `rows`."""
        arrived = time.monotonic() if arrived is None else arrived
        with self.lock:
            if not self.accepting:
                return "closed"
            if self.queued + len(rows) > self.max_queue:
                return "full"
            self.queued += len(rows)
            self.queued_tokens += sum(len(row.ids) for row in rows)
            for index, row in enumerate(rows):
                self.inbox.put(Request(self.next_id, client, index, row, stream, arrived))
                self.next_id += 1
        return "ok"

    def abort(self, client: str) -> None:
        """The client went away: its rows end at the next step, unanswered."""
        self.aborts.put(client)

    def flush_cache(self) -> Future:
        """Empty the prefix cache on the engine's thread, between two steps (any thread may ask). The future's
        result: the cached blocks forgotten (0 without prefix caching), or None while requests run or wait: nothing
        is flushed then, as SGLang refuses, since running requests would cache their blocks again."""
        future: Future = Future()
        self.flushes.put(future)
        return future

    def load(self) -> Load:
        """Rows running and waiting, the KV slots the running ones hold, the waiting prompts' tokens."""
        with self.lock:
            return Load(self.running, self.queued, self.kv_used, self.scheduler.limits.kv_tokens, self.queued_tokens)

    # --- rank 0's main thread ---

    def run(self, deliver: Callable[[EngineOutput], None]) -> int:
        """Step until stopped and drained (0) or until the ranks can no longer run in lockstep (1); each iteration's
        output goes to `deliver`."""
        self.deliver = deliver
        try:
            while True:
                if self.stopping.is_set():  # queued requests are answered 503 at once, admitted ones run to their end
                    deliver(EngineOutput(self._refuse_queued()))
                    if not self.scheduler.running and not self.in_flight:
                        break
                deliver(self.step())
            self.executor.stop()
            deliver(EngineOutput(self._take_pending()))
            return 0
        except Exception as e:  # noqa: BLE001 - a rank died or a collective failed: lockstep is lost
            self._lost(str(e) if isinstance(e, LockstepLost) else one_line(e))
            return 1
        finally:
            deliver(EngineOutput(self._refuse_queued()))

    def step(self) -> EngineOutput:
        """One iteration (see the module docstring)."""
        out = EngineOutput()
        self._intake(block=self.scheduler.idle() and not self.in_flight)
        if not self.in_flight:
            self._answer_flushes()
        step = self.scheduler.schedule(out.stats, admit=not self.stopping.is_set(), lane=self.lane)
        self.lane = (self.lane + 1) % self.executor.depth
        if step.new:
            with self.lock:
                self.queued -= len(step.new)
                self.queued_tokens -= sum(len(self.requests[n.id].prompt) for n in step.new)
        self.executor.submit(step)
        out.events += self._take_pending()  # the step reached every rank: the failures before it are answered
        if step.runs:
            self.in_flight.append(step)
        if self.in_flight and (len(self.in_flight) >= self.executor.depth or not step.runs):
            out.events += self._land(self.in_flight.popleft(), self.executor.collect(), out.stats)
        with self.lock:
            self.running, self.kv_used = len(self.scheduler.running), self.scheduler.kv_used()
        return out

    def _land(self, step: Step, result: StepResult, stats) -> list[Event]:
        """A step's result: its tokens into their rows and its requests back to the scheduler."""
        events: list[Event] = []
        if result.error:  # the forward failed on every rank alike
            failed = [r for w in step.work if (r := self.requests.get(w.id)) is not None and not r.status.finished]
            log(f"a step of {len(step.work)} rows failed; they get 500 and the server goes on: {result.error}")
            self.pending += [self.output.fail(r, 500, f"generation failed: {result.error}") for r in failed]
            self.scheduler.update(step, ran=False)
        else:
            events = self.output.process(self.requests, result, stats)
            self.scheduler.update(step)
        for w in step.work:
            r = self.requests.get(w.id)
            if r is not None and r.status.finished and not r.in_flight:  # (a prompt's later chunk may be out)
                self._forget(r)
        return events

    def _intake(self, block: bool) -> None:
        """New requests into the scheduler's queue (waiting up to HEARTBEAT_S for one when idle), then the aborts."""
        try:
            while True:
                r = self.inbox.get(timeout=HEARTBEAT_S) if block else self.inbox.get_nowait()
                block = False
                self.requests[r.id] = r
                self.clients.setdefault(r.client, []).append(r)
                self.scheduler.add(r)
        except queue.Empty:
            pass
        while not self.aborts.empty():
            for r in list(self.clients.get(self.aborts.get_nowait(), ())):
                self._abort(r)

    def _abort(self, r: Request) -> None:
        if r.status is Status.WAITING:
            with self.lock:
                self.queued -= 1
                self.queued_tokens -= len(r.prompt)
        elif not r.status.finished:
            log(f"{r.client} prompt {r.index} cancelled after {len(r.output)} of {r.row.max_tokens} tokens: the "
                f"client went away")
        self.scheduler.abort(r, Status.ABORTED)
        if not r.in_flight:
            self._forget(r)

    def _forget(self, r: Request) -> None:
        self.requests.pop(r.id, None)
        rows = self.clients.get(r.client, [])
        if r in rows:
            rows.remove(r)
        if not rows:
            self.clients.pop(r.client, None)

    def _answer_flushes(self) -> None:
        while not self.flushes.empty():
            future = self.flushes.get_nowait()
            with self.lock:
                busy = bool(self.requests or self.queued)
            future.set_result(None if busy else self.scheduler.pool.flush())

    def _take_pending(self) -> list[Event]:
        pending, self.pending = self.pending, []
        return pending

    def _refuse_queued(self) -> list[Event]:
        """No request is taken any more, and the queued ones are answered 503."""
        with self.lock:
            self.accepting = False
        self._intake(block=False)
        events: list[Event] = []
        for r in list(self.scheduler.waiting):
            self._abort(r)
            events.append(self.output.fail(r, 503, SHUTTING_DOWN))
        while not self.flushes.empty():
            self.flushes.get_nowait().set_exception(RuntimeError(SHUTTING_DOWN))
        return events

    def _lost(self, why: str) -> None:
        """Lockstep is lost (a rank died, a collective failed, a forward failed on some ranks only): every admitted
        request is answered 503 (run() then refuses the queued ones)."""
        log(f"the model's ranks failed, shutting down: {why}")
        events: list[Event] = [self.output.fail(r, 503, LOST) for r in list(self.scheduler.running.values())
                               if not r.status.finished]
        events += [Failed(e.client, e.index, 503, LOST) for e in self._take_pending()]
        self.deliver(EngineOutput(events))

    def _abandon(self, why: str) -> None:
        """_lost from the executor's watchdog, while the main thread waits in a collective that will never end: the
        queued requests are refused here too, and the watchdog ends the process once this returns."""
        self._lost(why)
        self.deliver(EngineOutput(self._refuse_queued()))
        time.sleep(1.0)  # the HTTP thread writes the answers before the process ends
