"""Rank 0's executor for a pipeline of stages (`Pipeline`), and every other rank's loop (`follow_stage`).

Rank 0 holds the engine and is the first rank of stage 0. `submit` hands a step to stage 0's other ranks (the stage's
channel: shared memory on one host), runs stage 0's layers on it and sends the step with its hidden states to stage
1 (links.py); each stage does the same for the next; the last stage's first rank samples and sends the step's result
back to rank 0, where `collect` takes it. Steps go through in order, and up to `depth` = pp of them are in flight, each
stage working on a different one (the engine's scheduler keeps their requests apart: one lane per stage).

Failures, on the rules of the lockstep executor (lockstep/executor.py), per stage:
- a forward that raises on every rank of a stage alike fails its requests: the stage hands the step on with its
  error, the later stages skip it, and its result says so (the engine answers 500 and goes on);
- one that raises on some ranks of a stage only leaves the others waiting in a collective: the rank that raised
  posts a fatal line (liveness.py), and every rank ends within a beat, rank 0 after answering every request 503;
- a rank whose process ended fails its peers' receives at once; a host that stopped answering is liveness.py's.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable

from autotp.errors import one_line
from autotp.parallel.stages import Stages
from autotp.serve.lockstep.executor import STOP_GRACE_S, device_lost
from autotp.serve.lockstep.step import LockstepLost, Step, StepResult
from autotp.serve.lockstep.watchdog import StepWatchdog, Watch
from autotp.serve.lockstep.wire import Channel
from autotp.serve.pipeline.links import EMPTY, Hop, Links, Lost
from autotp.serve.pipeline.liveness import Liveness
from autotp.serve.types import StopFlag

WAIT_S = 0.5  # how often a waiting rank looks up from its inbox (liveness is the liveness thread's)
STOPPED_S = 30.0  # how long rank 0 waits for the last stage to have stopped


def _pickled(step: Step) -> bytes:
    return pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)


class Pipeline:
    """Rank 0's executor: `submit`, `collect`, `stop`, `watch_for` (the engine's executor interface) over pp stages."""

    def __init__(self, runner, channel: Channel, links: Links, stages: Stages, tag: str):
        self.runner, self.channel, self.links, self.stages, self.tag = runner, channel, links, stages, tag
        self.depth = stages.pp
        self.results = links.listen(stages.sampler, hops=False)
        self.forwards = 0
        self.watch = Watch(0, stages.world, tag, stages.ranks(0))
        self.watchdog: StepWatchdog | None = None
        self.liveness: Liveness | None = None

    def watch_for(self, abandon: Callable[[str], None]) -> None:
        """abandon(line) answers every request; the process ends when it returns. Called on a stage-0 rank that
        raised alone (the step watchdog), and on a lost rank or host (liveness)."""

        def lost(line: str) -> None:
            abandon(line)
            os._exit(1)

        self.watchdog = StepWatchdog(self.watch, abandon)
        self.watchdog.start()
        self.liveness = Liveness(0, self.stages, self.tag, lost)
        self.liveness.start()

    def submit(self, step: Step) -> None:
        raw = _pickled(step)
        try:
            self.channel.send_raw(raw)
        except Exception as e:
            raise LockstepLost(self.watch.died(e, "receiving a step from rank 0") or one_line(e)) from e
        self.runner.apply(step)
        hidden, error = None, ""
        if step.runs:
            self.forwards += 1
            self.watchdog.begin(self.forwards)
            try:
                hidden = self.runner.run(step)
            except Exception as e:  # noqa: BLE001 - stage 0's ranks must have failed alike
                died = self.watch.died(e, f"running the forward of step {self.forwards}")
                if died:
                    raise LockstepLost(died) from e
                error = one_line(e, 200)
                self.watch.failed(self.forwards, error)
                if device_lost(e):
                    raise LockstepLost(f"the GPU can run nothing more, restart the server: {error}") from e
                if not self.watch.alike(self.forwards):
                    raise LockstepLost(f"rank 0's forward failed and another rank's of stage 0 did not: {error}") from e
            finally:
                self.watchdog.end()
        try:
            self.links.send(raw, error, hidden, self.runner.without(step))
        except Exception as e:
            raise LockstepLost(f"{self.liveness.who(self.stages.next_rank(0))} is gone: {one_line(e)}") from e

    def collect(self) -> StepResult:
        """The oldest step's result, from the sampling rank."""
        while True:
            got = self.results.get(WAIT_S)
            if got is EMPTY:
                continue
            if isinstance(got, Lost):
                raise LockstepLost(f"{self.liveness.who(self.stages.sampler)} is gone: {one_line(got.error)}")
            return got

    def stop(self) -> None:
        """Every rank returns: the stop goes down the pipeline, and the last stage says it stopped."""
        self.liveness.stop()
        raw = _pickled(Step(stop=True))
        self.channel.send_raw(raw)
        self.links.send(raw)
        while self.results.get(STOPPED_S) not in (None, EMPTY):
            pass
        self.links.flush()


def follow_stage(runner, channel: Channel, links: Links, stages: Stages, rank: int, tag: str,
                 stopping: StopFlag) -> int:
    """A rank other than 0: take each step from the stage before (stage 0: from rank 0), run this stage's part, hand
    it on (the last stage's first rank: its result back to rank 0), until "stop". Signalled alone (rank 0 still sends
    work), it leaves when idle after STOP_GRACE_S; rank 0 then sees the broken pipeline and shuts down."""
    stage, prev = stages.stage(rank), stages.prev_rank(rank)
    last, samples = stages.last(rank), rank == stages.sampler
    watch = Watch(rank, stages.world, tag, stages.ranks(stage))

    def lost(line: str) -> None:
        print(f"autotp: error on rank {rank}: {line}", file=sys.stderr, flush=True)
        os._exit(1)

    liveness = Liveness(rank, stages, tag, lost)
    liveness.start()
    inbox = None if prev is None else links.listen(prev, hops=True)
    forwards = 0
    while True:
        if inbox is None:
            raw = channel.recv_raw()
            hop = Hop(pickle.loads(raw), raw, "", None)
        else:
            hop = inbox.get(WAIT_S)
            if hop is EMPTY:
                continue
            if isinstance(hop, Lost):
                line = f"{liveness.who(prev)} is gone: {one_line(hop.error)}"
                liveness.fatal(line)
                raise LockstepLost(line) from liveness.exited(prev)  # an exit of this host: its launcher names it
        step, error, out = hop.step, hop.error, None
        if step.stop:
            liveness.stop()
            if not last:
                links.send(hop.raw)
            if samples:
                links.send_result(None)
            links.flush()
            return 0
        runner.apply(step)
        if step.runs:
            forwards += 1
            if error:  # a stage before this one failed it
                runner.fail(step)
            else:
                try:
                    out = runner.run(step, hop.hidden, hop.without)
                except Exception as e:  # noqa: BLE001 - the stage's other ranks must have failed alike
                    error = one_line(e, 200)
                    watch.failed(forwards, error)
                    if device_lost(e) or not watch.alike(forwards):
                        liveness.fatal(f"rank {rank}'s forward of a step failed and stage {stage}'s other ranks' "
                                       f"did not: {error}")
                        raise
        if not last:
            links.send(hop.raw, error, None if error else out, runner.without(step))
        elif samples and step.runs:
            links.send_result(StepResult(error=error) if error else out)
        if not step.runs and stopping.is_set() and stopping.age() > STOP_GRACE_S and not step.finished:
            return 0
