"""`autotp serve`'s engine without HTTP: jobs submitted at chosen steps, steps run until every job ends.

Runs in one process (tp 1) or on every rank of a pool (rank 0 drives, the others `follow`), so the
scheduling, the paged cache and the sampler are tested on every family without a server's start-up.
"""

from __future__ import annotations

import torch

from autotp.serve import server
from autotp.serve.engine.loop import Engine
from autotp.serve.engine.scheduler import Limits
from autotp.serve.lockstep.executor import follow
from autotp.serve.lockstep.step import Step
from autotp.serve.lockstep.wire import Channel
from autotp.serve.runner.probe import probe
from autotp.serve.server import parts
from autotp.serve.types import Event, Failed, Finished, Row, StopFlag, Token


class Job:
    """One row as a client sends it (its own request, named `client`) and the events it gets back."""

    def __init__(self, row: Row, stream: bool, client: str):
        self.row, self.stream, self.client = row, stream, client
        self.events: list[Event] = []
        self.cancelled = False  # its client went away (cancel)

    @property
    def ended(self) -> Finished | Failed | None:
        return next((e for e in self.events if isinstance(e, Finished | Failed)), None)

    @property
    def result(self):
        """Its answer (types.Result); fails the test where it ended otherwise."""
        assert isinstance(self.ended, Finished), self.ended
        return self.ended.result

    @property
    def streamed(self) -> str:
        return "".join(e.piece.text for e in self.events if isinstance(e, Token))

    def cancel(self, engine: Engine) -> None:
        self.cancelled = True
        engine.abort(self.client)


def job(ids, max_tokens: int, temperature: float = 0.0, seed: int = 0, stop: tuple[str, ...] = (),
        stream: bool = False, top_p: float = 1.0, top_k: int = 0, index: int = 0, logprobs: int | None = None,
        prompt_logprobs: bool = False) -> Job:
    row = Row(tuple(ids), max_tokens, temperature, top_p, seed, tuple(stop), top_k, logprobs, prompt_logprobs)
    return Job(row, stream, f"job{index}")


def drive(engine: Engine, arrivals: dict[int, list[Job]], max_steps: int = 10_000, on_step=None,
          metrics=None) -> int:
    """Submit arrivals[s] before step s; step until every job has ended or been cancelled (its client
    left: nobody is answered). Returns the steps taken. metrics: an api/metrics.Metrics that records each step."""
    jobs = [j for js in arrivals.values() for j in js]
    route = {j.client: j for j in jobs}
    assert len(route) == len(jobs), "each job is its own client: give each an index of its own"
    step = 0
    while any(j.ended is None and not j.cancelled for j in jobs):
        for j in arrivals.get(step, []):
            assert engine.submit(j.client, [j.row], j.stream) == "ok"
        if on_step is not None:
            on_step(step, engine)
        out = engine.step()
        if metrics is not None:
            metrics.record(out.stats)
        for event in out.events:
            route[event.client].events.append(event)
        step += 1
        assert step < max_steps, "the engine did not finish its jobs"
    return step


ROOMY = Limits(16, 2048, 100_000)


def tokens_of(ended: Finished | Failed | None) -> list[int]:
    """A row's generated ids, from its end event (which must be its answer)."""
    assert isinstance(ended, Finished), ended
    return list(ended.result.tokens)


def recorded(engine: Engine) -> list[Step]:
    """The steps the engine sends from now on, as it sends them."""
    sent: list[Step] = []
    channel = engine.executor.channel
    send = channel.send
    channel.send = lambda step: (sent.append(step), send(step))[-1]
    return sent


def a_long_prompt_beside_decoding_rows(engine: Engine) -> tuple[list[Job], Job]:
    """Three 4-token prompts decode 20 tokens each; a 45-token prompt (4 new tokens) arrives at step 3."""
    g = torch.Generator().manual_seed(1)
    short = [job(torch.randint(0, 101, (4,), generator=g).tolist(), 20, index=i) for i in range(3)]
    long = job(torch.randint(0, 101, (45,), generator=g).tolist(), 4, index=3)
    drive(engine, {0: short, 3: [long]})
    return short, long


def engine_for(model, tokenizer, limits: Limits = ROOMY, max_queue: int = 256, caching: bool = True,
               block_size: int = 4, speculate: int = 0, attention: str = "sdpa") -> Engine:
    """tp 1: the engine `autotp serve` runs for this model."""
    runner, scheduler = parts(model, probe(model), limits, block_size, caching, speculate=speculate,
                              attention=attention)
    return server.engine(model, tokenizer, runner, scheduler, Channel(), max_queue)


def run_on_ranks(model, tokenizer, make_arrivals, limits: Limits = ROOMY, speculate: int = 0,
                 compile: bool = False) -> list | None:
    """On every rank of a process group: rank 0 drives make_arrivals() and returns each job's end event
    (with its streamed text); the others follow and return None. compile: every rank compiles the decode
    step first, as `autotp serve --compile` does."""
    import torch.distributed as dist

    channel = Channel()
    try:
        runner, scheduler = parts(model, probe(model), limits, 4, rank0=dist.get_rank() == 0, speculate=speculate)
        if compile:
            runner.compile()
            runner.use_graph()
        if dist.get_rank() != 0:
            assert follow(runner, channel, StopFlag()) == 0
            return None
        engine = server.engine(model, tokenizer, runner, scheduler, channel)
        arrivals = make_arrivals()
        with torch.inference_mode():
            drive(engine, arrivals)
        engine.executor.stop()
        return [(j.ended, j.streamed) for js in arrivals.values() for j in js]
    finally:
        channel.close()


def serve_rows(model_dir: str, tokenizer_dir: str, prompts: list[list[int]], spec: list[tuple],
               limits: Limits, quantize: str | None = None, group_size: int = 128) -> list | None:
    """A pool task: this rank's shard of model_dir, then run_on_ranks over spec's rows (see test_continuous)."""
    from transformers import AutoTokenizer

    import autotp

    model = autotp.from_pretrained(model_dir, check_inputs=False, quantize=quantize, group_size=group_size)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)

    def arrivals() -> dict[int, list[Job]]:
        out: dict[int, list[Job]] = {}
        for i, (ids, (_, n, t, p, k, seed, at)) in enumerate(zip(prompts, spec, strict=True)):
            out.setdefault(at, []).append(job(ids, n, t, seed, top_p=p, top_k=k, index=i))
        return out

    ended = run_on_ranks(model, tokenizer, arrivals, limits)
    return None if ended is None else [e for e, _ in ended]


def failing_alike(model_dir: str, tokenizer_dir: str) -> list | None:
    """A pool task: the two-row decode forward raises once on every rank, each rank's message its own (as a CUDA
    out-of-memory error names its GPU); a third row arrives later. Returns rank 0's end events."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    import autotp

    model = autotp.from_pretrained(model_dir, check_inputs=False)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    armed = {"on": True}

    def raise_once(module, args, kwargs):
        if armed["on"] and kwargs["input_ids"].shape == (1, 2):  # the paged engine's two-row decode
            armed["on"] = False
            raise RuntimeError(f"out of memory on GPU {dist.get_rank()}")

    model.model.register_forward_pre_hook(raise_once, with_kwargs=True)

    def arrivals() -> dict[int, list[Job]]:
        return {0: [job([5, 6, 7], 10, index=0), job([8, 9], 10, index=1)], 8: [job([5, 6, 7], 10, index=2)]}

    ended = run_on_ranks(model, tokenizer, arrivals)
    return None if ended is None else [e for e, _ in ended]


class CollectiveCounter:
    """Counts this rank's collectives by kind while active (the model's and the engine's), through gloo or
    through shared memory (parallel/shm.py)."""

    def __init__(self):
        import autotp.parallel.collectives as collectives
        from autotp.parallel.shm import ShmGroup

        self.counts: dict[str, int] = {}
        self.patched = [(dist_module(), "broadcast", "broadcast"), (dist_module(), "all_reduce", "all_reduce"),
                        (collectives, "_all_gather_single", "all_gather"), (ShmGroup, "all_reduce", "all_reduce"),
                        (ShmGroup, "all_gather", "all_gather"), (ShmGroup, "broadcast", "broadcast")]

    def __enter__(self):
        self.saved = [getattr(m, name) for m, name, _ in self.patched]
        for (module, name, kind), original in zip(self.patched, self.saved, strict=True):
            setattr(module, name, self._counting(kind, original))
        return self

    def __exit__(self, *exc):
        for (module, name, _), original in zip(self.patched, self.saved, strict=True):
            setattr(module, name, original)

    def _counting(self, kind: str, fn):
        def call(*args, **kwargs):
            self.counts[kind] = self.counts.get(kind, 0) + 1
            return fn(*args, **kwargs)
        return call

    def take(self) -> dict[str, int]:
        out, self.counts = self.counts, {}
        return out


def dist_module():
    import torch.distributed as dist

    return dist


def step_collectives(model_dir: str, tokenizer_dir: str) -> dict | None:
    """A pool task: the collectives of one bare decode forward, and of each engine step with the rows'
    work it ran (lockstep/step.Step.work)."""
    from transformers import AutoTokenizer, DynamicCache

    import autotp

    model = autotp.from_pretrained(model_dir, check_inputs=False)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(torch.tensor([[1, 2], [3, 4]]), cache=cache)
        with CollectiveCounter() as counter:
            model(torch.tensor([[5], [6]]), cache=cache)
        forward = counter.take()
    channel = Channel()
    runner, scheduler = parts(model, probe(model), ROOMY, 4, rank0=dist_module().get_rank() == 0)
    if dist_module().get_rank() != 0:
        assert follow(runner, channel, StopFlag()) == 0
        channel.close()
        return None
    engine = server.engine(model, tokenizer, runner, scheduler, channel)
    sent = recorded(engine)
    jobs = [job([1, 2, 3], 12, index=0), job([4, 5], 12, index=1), job([6, 7, 8, 9], 6, index=2)]
    steps, route = [], {j.client: j for j in jobs}

    def step() -> None:
        for event in engine.step().events:
            route[event.client].events.append(event)
        steps.append((sent[-1].work, counter.take()))

    with torch.inference_mode(), CollectiveCounter() as counter:
        for i, j in enumerate(jobs):
            if i == 2:  # arrives while the first two decode: its step prefills and decodes
                step()
            engine.submit(j.client, [j.row])
        while any(j.ended is None for j in jobs):
            step()
    engine.executor.stop()
    channel.close()
    return {"forward": forward, "steps": steps}


def run_on_pipeline(model_dir: str, tokenizer_dir: str, make_arrivals, pp: int, limits: Limits = ROOMY,
                    speculate: int = 0, pp_layers: tuple[int, ...] | None = None, block_size: int = 4,
                    dtype: str | None = None, on_model=None, device: str | None = None) -> list | None:
    """A pool task, as `autotp serve --pp PP` runs it: every rank loads its stage of model_dir (tp = world / pp), rank
    0 drives make_arrivals() through the pipeline and returns each job's end event (with its streamed text); the
    others follow their stage and return None. on_model(model): a test's change to each rank's stage once loaded."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    import autotp
    from autotp.serve.pipeline.executor import Pipeline, follow_stage
    from autotp.serve.pipeline.links import Links

    model = autotp.from_pretrained(model_dir, check_inputs=False, pp_size=pp, pp_layers=pp_layers, dtype=dtype,
                                   device=device)
    if on_model is not None:  # a test's hook, before the start-up forward
        on_model(model)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    stages, rank = model.autotp.stages, dist.get_rank()
    channel = Channel()
    runner, scheduler = parts(model, probe(model), limits, block_size, rank0=rank == 0, speculate=speculate,
                              samples=rank == stages.sampler, lanes=pp)
    stage0 = Channel(stages.ranks(0))
    links = Links(rank, stages.next_rank(rank), stages.prev_rank(rank), stages.sampler)
    if rank != 0:
        with torch.inference_mode():
            assert follow_stage(runner, stage0, links, stages, rank, channel.tag(), StopFlag()) == 0
        return None
    engine = server.engine(model, tokenizer, runner, scheduler, channel,
                           pipeline=Pipeline(runner, stage0, links, stages, channel.tag()))
    arrivals = make_arrivals()
    with torch.inference_mode():
        drive(engine, arrivals)
    engine.executor.stop()
    return [(j.ended, j.streamed) for js in arrivals.values() for j in js]


def pipeline_rows(model_dir: str, tokenizer_dir: str, prompts: list[list[int]], spec: list[tuple], limits: Limits,
                  pp: int, speculate: int = 0, pp_layers: tuple[int, ...] | None = None) -> list | None:
    """A pool task: spec's rows (see test_continuous) through a pipeline of pp stages; rank 0's end events."""

    def arrivals() -> dict[int, list[Job]]:
        out: dict[int, list[Job]] = {}
        for i, (ids, (_, n, t, p, k, seed, at)) in enumerate(zip(prompts, spec, strict=True)):
            out.setdefault(at, []).append(job(ids, n, t, seed, top_p=p, top_k=k, index=i))
        return out

    ended = run_on_pipeline(model_dir, tokenizer_dir, arrivals, pp, limits, speculate, pp_layers)
    return None if ended is None else [e for e, _ in ended]


def drafted_and_cached(model_dir, tokenizer_dir, pp, pp_layers):
    """A pool task: a prompt that repeats itself (prompt lookup drafts), the same prompt again (its blocks from the
    cache) and one sharing half of it, with the prompt's and the tokens' log-probabilities."""
    words = [5, 6, 7, 8, 9, 10, 11, 12] * 3

    def arrivals():
        return {0: [job(words, 12, index=0, logprobs=2)], 14: [job(words, 12, index=1, logprobs=2),
                                                               job(words[:12] + [40, 41], 8, index=2)]}

    limits = Limits(max_num_seqs=4, max_num_batched_tokens=32, kv_tokens=10_000)
    ended = run_on_pipeline(model_dir, tokenizer_dir, arrivals, pp, limits, 4, pp_layers)
    return None if ended is None else [e.result for e, _ in ended]


def pipeline_failing(model_dir, tokenizer_dir, pp):
    """A pool task: through pp stages, a short row, then a 40-token prompt in chunks of 16, the chunks following one
    another into the pipeline; the last stage's forward of the prompt's second chunk raises on its ranks alike (as an
    out-of-memory error would) while the third is on its way; a third row arrives later. Rank 0's end events."""
    import torch.distributed as dist

    long = [(7 * i) % 97 for i in range(40)]
    seen = {"chunks": 0}

    def raise_on_second_chunk(module, args, kwargs):
        if kwargs.get("hidden_states", args[0] if args else None).shape[1] >= 12:
            seen["chunks"] += 1
            if seen["chunks"] == 2:
                raise RuntimeError(f"out of memory on rank {dist.get_rank()}")

    def hook(model) -> None:
        stage = model.autotp_stage
        if stage.last:
            model.transformer.h[stage.span.start].register_forward_pre_hook(raise_on_second_chunk, with_kwargs=True)

    def arrivals():
        return {0: [job([5, 6, 7], 3, index=0)], 6: [job(long, 6, index=1)], 14: [job([8, 9], 8, index=2)]}

    limits = Limits(max_num_seqs=4, max_num_batched_tokens=16, kv_tokens=10_000)
    ended = run_on_pipeline(model_dir, tokenizer_dir, arrivals, pp, limits, on_model=hook)
    return None if ended is None else [e for e, _ in ended]
