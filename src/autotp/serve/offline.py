"""`autotp generate --pp N`: one prompt through the serving engine and its pipeline of stages, without HTTP.

HF's `generate` cannot drive a model whose layers are split between processes, so with pipeline stages the prompt
takes the path a request to `autotp serve` takes: the same scheduler, stages and sampler (seeded per row), so the
same prompt, parameters and seed give the same tokens either way. The KV cache holds this one row's tokens.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable

import autotp
from autotp import distributed
from autotp.errors import AutotpError
from autotp.serve.engine.scheduler import Limits
from autotp.serve.lockstep.wire import Channel
from autotp.serve.pipeline.executor import Pipeline, follow_stage
from autotp.serve.pipeline.links import Links
from autotp.serve.runner.probe import probe
from autotp.serve.server import engine, parts
from autotp.serve.types import Failed, Finished, Row, StopFlag, Token

BLOCK = 16


def generate(model_dir, ids: list[int], tokenizer, max_new_tokens: int, temperature: float, top_p: float,
             top_k: int, seed: int | None, pp: int, pp_layers: tuple[int, ...] | None = None, dtype=None,
             device=None, quantize=None, group_size: int = 128,
             stream: Callable[[str], None] | None = None) -> list[int] | None:
    """The new token ids, on rank 0 (None on the others); stream(text) gets each piece of text as it comes."""
    distributed.init(device)
    net = autotp.from_pretrained(model_dir, dtype=dtype, device=device, quantize=quantize, group_size=group_size,
                                 check_inputs=False, pp_size=pp, pp_layers=pp_layers)
    stages, rank = net.autotp.stages, distributed.rank()
    channel = Channel()
    seed = channel.share(random.SystemRandom().randrange(2**31) if seed is None else seed)
    tokens = -(-(len(ids) + max_new_tokens) // BLOCK) * BLOCK
    limits = Limits(1, max(len(ids), 1), tokens)
    runner, scheduler = parts(net, probe(net), limits, BLOCK, caching=False, rank0=rank == 0,
                              samples=rank == stages.sampler, lanes=pp)
    stage0 = Channel(stages.ranks(0))
    links = Links(rank, stages.next_rank(rank), stages.prev_rank(rank), stages.sampler)
    if rank != 0:
        follow_stage(runner, stage0, links, stages, rank, channel.tag(), StopFlag())
        return None
    rank0 = engine(net, tokenizer, runner, scheduler, channel,
                   pipeline=Pipeline(runner, stage0, links, stages, channel.tag()))
    row = Row(tuple(ids), max_new_tokens, temperature, top_p, seed, top_k=top_k)
    if rank0.submit("generate", [row], stream=stream is not None) != "ok":
        raise AutotpError("the engine refused the prompt")
    ended = None
    while ended is None:
        for event in rank0.step().events:
            if isinstance(event, Token) and stream is not None:
                stream(event.piece.text)
            elif isinstance(event, Finished | Failed):
                ended = event
    rank0.executor.stop()
    if isinstance(ended, Failed):
        raise AutotpError(f"generation failed: {ended.message}")
    if stream is not None:
        sys.stdout.flush()
    return list(ended.result.tokens)
