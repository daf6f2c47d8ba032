"""The ranks in lockstep: rank 0's executor (`Lockstep`), which broadcasts each step and runs it on its own runner,
and every other rank's loop (`follow`), which receives and runs the same steps. Neither decides anything.

The failure rules, the same on every rank:
- a forward that raises on every rank alike (the same exception type) fails its requests: rank 0's result says so
  (`StepResult.error`), and the next step carries rank 0's error so that every rank checks it failed the same way;
- a forward that raises on some ranks only leaves the others in one of its collectives: the store says so within
  seconds (watchdog.py), and rank 0 answers 503 and exits;
- a rank that died, a failed broadcast, a device that can run nothing more (an asynchronous CUDA error) or a
  disagreement about the last step ends lockstep: `LockstepLost`, with one line that says which.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from autotp import distributed
from autotp.errors import one_line
from autotp.serve.lockstep.step import LockstepLost, Step, StepResult
from autotp.serve.lockstep.watchdog import StepWatchdog, Watch
from autotp.serve.lockstep.wire import Channel
from autotp.serve.types import StopFlag

STOP_GRACE_S = 5  # a signalled worker waits this long for rank 0's "stop" before leaving on its own
ACCELERATOR_ERROR = getattr(torch, "AcceleratorError", ())  # what torch >= 2.8 raises for a CUDA error


def device_lost(e: BaseException) -> bool:
    """An asynchronous CUDA error (a device-side assert, an illegal address): it poisons the process's CUDA
    context, so every later step fails too and "a failing request fails alone" cannot hold. The rank that sees it
    exits (rank 0: every request 503, one line, exit 1). An out-of-memory error is not one: it is recoverable."""
    if isinstance(e, torch.OutOfMemoryError):
        return False
    return isinstance(e, ACCELERATOR_ERROR) or "CUDA error: " in str(e)  # (torch < 2.8: a RuntimeError)


def kind(failure: str) -> str:
    """The exception type of a failure's one line ("" for a step that ran): what the ranks must agree on."""
    return failure.split(":", 1)[0]


class Lockstep:
    """Rank 0's executor: `submit` broadcasts a step and runs it on `runner` (runner/model_runner.ModelRunner);
    `collect` gives its result. One step in flight (depth 1): the ranks run each step together."""

    depth = 1

    def __init__(self, runner, channel: Channel):
        self.runner, self.channel = runner, channel
        self.error = ""  # how this rank's last step failed, sent with the next step
        self.forwards = 0  # steps that ran a forward, numbered as every rank numbers them (watchdog.py)
        self.doing = "starting"  # what the ranks do now, for the line that says a rank died
        self.watch = Watch(0, distributed.world_size(), channel.tag())
        self.watchdog: StepWatchdog | None = None
        self.result: StepResult | None = None

    def watch_for(self, abandon: Callable[[str], None]) -> None:
        """Start the watchdog (with a process group): abandon(line) is called from its thread when a rank's forward
        failed while rank 0's waits in a collective; the process ends when it returns."""
        self.watchdog = StepWatchdog(self.watch, abandon)
        if self.watch.store is not None:
            self.watchdog.start()

    def submit(self, step: Step) -> None:
        step = replace(step, error=self.error)
        self.error = ""
        self.doing = f"receiving step {self.forwards + 1} from rank 0"
        try:
            self.channel.send(step)
        except Exception as e:
            raise LockstepLost(self.watch.died(e, self.doing) or one_line(e)) from e
        self.runner.apply(step)
        if not step.runs:
            return
        self.forwards += 1
        self.doing = f"running the forward of step {self.forwards} ({len(step.work)} rows)"
        self.watchdog.begin(self.forwards)
        try:
            self.result = self.runner.run(step)
        except Exception as e:  # noqa: BLE001 - the next step tells every rank; they must have failed alike
            self.watchdog.end()
            died = self.watch.died(e, self.doing)
            if died:  # no rank is left to compare with
                raise LockstepLost(died) from e
            failure = one_line(e, 200)
            self.watch.failed(self.forwards, failure)
            if device_lost(e):
                raise LockstepLost(f"the GPU can run nothing more, restart the server: {failure}") from e
            if not self.watch.alike(self.forwards):  # a rank that did not fail waits in a collective
                raise LockstepLost(f"rank 0's forward failed and another rank's did not: {failure}") from e
            self.error, self.result = failure, StepResult(error=failure)
            return
        self.watchdog.end()

    def collect(self) -> StepResult:
        result, self.result = self.result, None
        return result

    def stop(self) -> None:
        """Every rank returns (they check rank 0's last error first)."""
        self.channel.send(Step(stop=True, error=self.error))


def follow(runner, channel: Channel, stopping: StopFlag) -> int:
    """A rank other than 0: apply and run rank 0's steps on `runner` until "stop". Signalled alone (rank 0 still
    sends work), it leaves when idle after STOP_GRACE_S; rank 0 then sees the broken group and shuts down."""
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
        runner.apply(step)
        if step.runs:
            forwards += 1
            try:
                runner.run(step)
            except Exception as e:  # noqa: BLE001 - compared with rank 0's at the next step
                error = one_line(e, 200)
                watch.failed(forwards, error)
                if device_lost(e):
                    raise
        elif stopping.is_set() and stopping.age() > STOP_GRACE_S and not step.finished:
            return 0
