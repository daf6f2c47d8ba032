"""`autotp serve`'s engine without HTTP: jobs submitted at chosen steps, steps run until every job ends.

Runs in one process (tp 1) or on every rank of a pool (rank 0 drives, the others `follow`), so the
scheduling, the padded cache and the sampler are tested on every family without a server's start-up.
"""

from __future__ import annotations

import torch

from autotp.serve.engine import Engine, Job, StopFlag, follow
from autotp.serve.scheduler import Limits
from autotp.serve.text import TextStream
from autotp.serve.types import Row
from autotp.serve.wire import Channel, Step


class Recorder:
    """The events of one job, as the HTTP side would receive them."""

    def __init__(self):
        self.events: list[tuple] = []

    def __call__(self, event: tuple) -> None:
        self.events.append(event)

    @property
    def ended(self) -> tuple | None:
        return next((e for e in self.events if e[0] in ("done", "error")), None)

    @property
    def streamed(self) -> str:
        return "".join(e[2] for e in self.events if e[0] == "text")


def job(ids, max_tokens: int, temperature: float = 0.0, seed: int = 0, stop: tuple[str, ...] = (),
        stream: bool = False, top_p: float = 1.0, top_k: int = 0, index: int = 0) -> Job:
    row = Row(tuple(ids), max_tokens, temperature, top_p, seed, tuple(stop), top_k)
    return Job(row, index, Recorder(), TextStream(row.stop) if stream else None, f"job{index}")


def drive(engine: Engine, arrivals: dict[int, list[Job]], max_steps: int = 10_000,
          on_step=None) -> int:
    """Submit arrivals[s] before step s; step until every job has ended. Returns the steps taken."""
    jobs = [j for js in arrivals.values() for j in js]
    step = 0
    while any(j.emit.ended is None for j in jobs):
        for j in arrivals.get(step, []):
            assert engine.submit([j]) == "ok"
        if on_step is not None:
            on_step(step, engine)
        engine.step()
        step += 1
        assert step < max_steps, "the engine did not finish its jobs"
    return step


ROOMY = Limits(16, 2048, 100_000)


def engine_for(model, tokenizer, limits: Limits = ROOMY, max_queue: int = 256) -> Engine:
    return Engine(model, tokenizer, Channel(), StopFlag(), limits, max_queue)


def run_on_ranks(model, tokenizer, make_arrivals, limits: Limits = ROOMY) -> list | None:
    """On every rank of a process group: rank 0 drives make_arrivals() and returns each job's end event
    (with its streamed text); the others follow and return None."""
    import torch.distributed as dist

    channel = Channel()
    if dist.get_rank() != 0:
        assert follow(model, channel, StopFlag()) == 0
        return None
    engine = Engine(model, tokenizer, channel, StopFlag(), limits, 256)
    arrivals = make_arrivals()
    with torch.inference_mode():
        drive(engine, arrivals)
    channel.send(Step(stop=True))
    return [(j.emit.ended, j.emit.streamed) for js in arrivals.values() for j in js]
