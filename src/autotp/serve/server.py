"""`serve()`, the entry of `autotp serve`: load the model on every rank, then serve until signalled.

Every rank loads its shard; rank 0 also runs the HTTP server (api/http.py) in a thread and the engine
(engine/loop.Engine) in its main thread, the other ranks follow rank 0's steps (lockstep/executor.follow).
SIGINT/SIGTERM/SIGHUP on any rank set a flag: rank 0 stops taking requests, answers what is queued with 503, lets
the admitted rows run to their end and tells every rank to stop. Everything that can be checked (port, tokenizer,
context) is checked on every rank before the weights are read. Under torchrun every rank also stops when the
launcher dies (even by SIGKILL, which it cannot forward), instead of serving on as an orphan.
"""

from __future__ import annotations

import copy
import ctypes
import gc
import os
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist

import autotp
from autotp import distributed, hosts
from autotp.context import context_limit
from autotp.errors import AutotpError, one_line
from autotp.hub import TOKENIZER_FILES, load_config, resolve_model_dir
from autotp.loading.checkpoint import Checkpoint
from autotp.serve.api import router_api
from autotp.serve.api.boundary import Served
from autotp.serve.api.guard import host_policy, open_to_all
from autotp.serve.api.http import Frontend, HttpThread, build_app
from autotp.serve.api.metrics import Metrics
from autotp.serve.engine.blocks import BlockPool
from autotp.serve.engine.loop import Engine
from autotp.serve.engine.output import OutputProcessor
from autotp.serve.engine.scheduler import Limits, Scheduler
from autotp.serve.lockstep.executor import Lockstep, follow
from autotp.serve.lockstep.step import Step
from autotp.serve.lockstep.wire import Channel
from autotp.serve.options import ServeOptions
from autotp.serve.pipeline.executor import Pipeline, follow_stage
from autotp.serve.pipeline.links import Links
from autotp.serve.preflight import NO_TOKENIZER, listen, refusal
from autotp.serve.runner.attention.backends import BACKENDS, choose
from autotp.serve.runner.compiled import cache_dir
from autotp.serve.runner.kv_cache import KvPool
from autotp.serve.runner.model_runner import ModelRunner
from autotp.serve.runner.probe import first_layer
from autotp.serve.startup import budget, weight_form
from autotp.serve.types import StopFlag, log
from autotp.tokenizer import load_tokenizer

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _stop_with_launcher() -> None:
    """SIGTERM this rank when its parent dies. torchrun's workers are its children (Popen from its main
    thread, and the signal follows the thread that forked), so its death, by any signal, stops them;
    SIGTERM takes the usual graceful path. Only under torchrun: a server started from a shell must
    outlive it (nohup)."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # the launcher died before prctl: nobody will send the signal
        os.kill(os.getpid(), signal.SIGTERM)


def public_name(model: str) -> str:
    """What /v1/models shows and clients send: a directory's name, not its path; a hub id as given."""
    path = Path(model)
    return path.resolve().name if path.is_dir() else model


def parts(model, shapes, limits: Limits, block_size: int = 16, caching: bool = True, rank0: bool = True,
          speculate: int = 0, attention: str = "sdpa", samples: bool | None = None,
          lanes: int = 1) -> tuple[ModelRunner, Scheduler | None]:
    """This rank's model runner and, on rank 0, the scheduler. shapes: probe.probe's (the layers from
    probe.first_layer on); the pool holds limits.kv_tokens // block_size blocks; speculate: the longest draft, so
    decoding and drafted requests share one sdpa call; attention: the backend's name, already chosen
    (backends.choose); samples: this rank turns scores into tokens (default: rank 0; a pipeline's last stage's first
    rank); lanes: steps in flight (a pipeline's stages)."""
    blocks = limits.kv_tokens // block_size
    pool = KvPool(shapes, blocks, block_size, model.device, first_layer(model))
    runner = ModelRunner(model, pool, BACKENDS[attention](1 + speculate), samples=rank0 if samples is None else samples)
    return runner, Scheduler(BlockPool(blocks, block_size, caching), limits, speculate, lanes) if rank0 else None


def engine(model, tokenizer, runner: ModelRunner, scheduler: Scheduler, channel: Channel, max_queue: int = 256,
           stopping: StopFlag | None = None, pipeline: Pipeline | None = None) -> Engine:
    """Rank 0's engine over this rank's runner and the scheduler (`parts`), its steps sent on `channel` (or through
    `pipeline`, the executor of a pipeline of stages). The engine decodes with a copy of the tokenizer of its own: the
    API's thread tokenizes with the original, and HF fast tokenizers are not meant to be used from two threads at
    once."""
    executor = pipeline or Lockstep(runner, channel)
    return Engine(scheduler, executor, OutputProcessor(copy.deepcopy(tokenizer), eos_ids(model)), max_queue, stopping)


def eos_ids(model) -> frozenset[int]:
    """The ids that end a row: the model's generation config's eos (one or several)."""
    eos = model.generation_config.eos_token_id
    return frozenset(eos if isinstance(eos, list) else () if eos is None else (eos,))


def _compile(runner: ModelRunner, channel: Channel, rank: int) -> None:
    """The compiled decode step on every rank, or on none: rank 0 says how long warm-up took (the slowest
    rank's), or in one line why every step stays eager."""
    try:
        seconds, why = runner.compile(), ""
    except Exception as e:  # noqa: BLE001 - a model or device the compiler cannot take is served eager
        seconds, why = 0.0, one_line(e)
    results = channel.gather((seconds, why))
    failed = next((f"rank {r}: {w}" for r, (_, w) in enumerate(results) if w), "")
    if not failed:
        runner.use_graph()
    if rank == 0:
        log(f"warning: the decode step did not compile, every step runs eager ({failed})" if failed else
            f"compiled the decode step in {max(s for s, _ in results):.1f} s (torch.compile, cached for restarts "
            f"in {cache_dir()})")


def serve(model: str, model_id: str, opts: ServeOptions = ServeOptions()) -> int:
    """Serve until signalled (returns 0) or until a rank fails (returns 1). port 0 picks a free port.
    model_id: the name clients use (a directory's path is shown by its name only)."""
    _stop_with_launcher()
    model_id = public_name(model_id)
    opts.check()
    env = distributed.init(opts.device)
    attention = choose(opts.attention, env.device, opts.block_size)  # every rank alike
    channel = Channel()
    sock, error = None, None
    if env.rank == 0:
        try:
            sock = listen(opts.host, opts.port)
        except OSError as e:
            error = str(refusal(opts.host, opts.port, e))
        if sock is not None and (warning := open_to_all(opts.host, opts.api_key)):
            log(warning)
    error = channel.share(error)
    if error:
        raise AutotpError(error)

    model_dir = resolve_model_dir(model, flag="--model")
    config = load_config(model_dir)
    checkpoint = Checkpoint(model_dir)  # a config without weights is named so, not as a missing tokenizer
    dtype, held = weight_form.choose_dtype(opts.dtype, checkpoint.floating_dtype(), env.device, opts.quantize)
    tokenizer_dir = resolve_model_dir(opts.tokenizer, TOKENIZER_FILES, flag="--tokenizer") if opts.tokenizer else None
    tokenizer = load_tokenizer(tokenizer_dir or model_dir,
                               missing=NO_TOKENIZER)
    max_model_len, source = context_limit(config, tokenizer, opts.max_model_len)
    # the input guard's per-forward all-reduce has nothing to catch here: rank 0 sends every input itself
    net = autotp.from_pretrained(model_dir, dtype=dtype, device=opts.device, quantize=opts.quantize,
                                 group_size=opts.group_size, check_inputs=False, pp_size=opts.pp,
                                 pp_layers=opts.pp_layers)
    stages = net.autotp.stages
    if env.group is not None:
        # ranks finish loading at different times: wait here under the process group's long timeout
        # (AUTOTP_TIMEOUT), not in the control group's first broadcast, whose timeout is short
        dist.barrier(group=env.group)
    cache = budget.size(net, channel, env.rank, env.device, opts, max_model_len, attention)
    limits = Limits(opts.max_num_seqs, opts.max_num_batched_tokens, cache.tokens)
    runner, scheduler = parts(net, cache.shapes, limits, opts.block_size, opts.prefix_caching, env.rank == 0,
                              opts.speculate, attention.name, stages is None or env.rank == stages.sampler, opts.pp)
    if runner.next_tokens is not None:  # the infill sampler reads its token texts from it (sampling/infill.py)
        runner.next_tokens.tokenizer = tokenizer
    if stages is not None:  # every rank makes the pipeline's groups: stage 0's channel, the links between stages
        stage0 = Channel(stages.ranks(0))
        links = Links(env.rank, stages.next_rank(env.rank), stages.prev_rank(env.rank), stages.sampler)
    # after the budget's checks: a refused start-up says its error alone and leaves F.linear as it was
    said = weight_form.kernels(net, env.device)
    if env.rank == 0:
        log(f"weights: {held}" + (f"; {said}" if said else ""))
    if opts.compile:
        _compile(runner, channel, env.rank)
    if max_model_len is None:  # no learned position limit (ALiBi): what the KV cache holds bounds a request
        if env.rank == 0:
            log(f"no context limit ({source}): a request may use the {limits.kv_tokens} tokens of the KV cache; "
                f"--max-model-len sets a limit")
        max_model_len = limits.kv_tokens

    # what start-up made (torch, transformers, the model) is never garbage: out of the collector's sight. A full
    # collection over it took 135 ms (374k objects, demo model), a stall of every stream when one triggers.
    gc.collect()
    gc.freeze()
    hosts.WATCH.stop()  # every rank is up: a host lost from now on is the engine's to answer (pipeline/liveness.py)
    stopping = StopFlag()
    stopped_by: list[int] = []  # after a hang-up the server exits 129, as a shell reports one

    def stop(sig: int, _frame) -> None:
        stopped_by.append(sig)
        stopping.set()

    # SIGHUP (a closed terminal) drains too, unless it is ignored: under nohup the server outlives its terminal
    hangup = () if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else (signal.SIGHUP,)
    for sig in (signal.SIGINT, signal.SIGTERM, *hangup):
        signal.signal(sig, stop)
    if env.rank != 0:
        if stages is not None:
            return follow_stage(runner, stage0, links, stages, env.rank, channel.tag(), stopping)
        code = follow(runner, channel, stopping)
        channel.close()  # every rank got "stop": the group is whole (a broken one is left to the exit)
        return code

    pipeline = None if stages is None else Pipeline(runner, stage0, links, stages, channel.tag())
    rank0 = engine(net, tokenizer, runner, scheduler, channel, opts.max_queue, stopping, pipeline)
    metrics = Metrics(rank0.load)
    served = Served(model_id, tokenizer, max_model_len, int(time.time()), limits.kv_tokens,
                    min(len(tokenizer), config.vocab_size))
    facts = router_api.Facts(  # what SGLang's router asks each replica
        str(model_dir.resolve()) if model_dir == Path(model) else model,
        str(Path(tokenizer_dir or model_dir).resolve()), config.model_type, tuple(config.architectures or ()),
        env.world_size // opts.pp, opts.pp, limits.max_num_seqs, limits.max_num_batched_tokens)
    frontend = Frontend(metrics)
    app = build_app(served, rank0, frontend, opts.max_body_bytes, host_policy(opts.host, opts.allowed_hosts),
                    opts.api_key, facts)
    http = HttpThread(app, sock, opts.read_timeout)
    try:
        http.start()
    except RuntimeError:
        channel.send(Step(stop=True))
        raise
    address = sock.getsockname()
    shape = f"tp={env.world_size}" if stages is None else f"tp={stages.tp} pp={stages.pp}, layers {stages.layers}"
    log(f"serving {model_id} ({shape}, up to {limits.max_num_seqs} sequences and "
        f"{limits.max_num_batched_tokens} tokens per step, context {max_model_len}) on http://{opts.host}:{address[1]}")
    code = rank0.run(frontend.deliver)
    http.stop()
    if code == 0 and stages is None:
        channel.close()
    hung_up = code == 0 and stopped_by[:1] == [signal.SIGHUP]
    log("hung up (SIGHUP): stopped" if hung_up else "stopped" if code == 0 else "exited after a rank failure")
    return 128 + signal.SIGHUP if hung_up else code
