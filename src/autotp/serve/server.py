"""`serve()`, the entry of `autotp serve`: load the model on every rank, then serve until signalled.

Every rank loads its shard; rank 0 also runs the HTTP server (http.py) in a thread and the scheduler
(engine.Engine) in its main thread, the other ranks follow rank 0's steps. SIGINT/SIGTERM on any
rank set a flag: rank 0 stops taking requests, answers what is queued with 503, lets the admitted rows
run to their end and tells every rank to stop. Everything that can be checked (port, tokenizer, context) is
checked on every rank before the weights are read. Under torchrun every rank also stops when the
launcher dies (even by SIGKILL, which it cannot forward), instead of serving on as an orphan.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch.distributed as dist

import autotp
from autotp import distributed
from autotp.errors import AutotpError
from autotp.generate import context_limit
from autotp.hub import TOKENIZER_FILES, load_config, resolve_model_dir
from autotp.loading.checkpoint import Checkpoint
from autotp.serve.api import router_api
from autotp.serve.api.boundary import Served
from autotp.serve.api.guard import host_policy
from autotp.serve.api.http import HttpThread, build_app, listen
from autotp.serve.api.metrics import Metrics
from autotp.serve.engine.blocks import BlockPool
from autotp.serve.engine.loop import Engine, StopFlag, follow
from autotp.serve.engine.planner import Limits, PagedPlanner
from autotp.serve.lockstep.wire import Channel, Step
from autotp.serve.options import ServeOptions
from autotp.serve.runner import budget, flex, varlen, weight_form
from autotp.serve.runner.compiled import cache_dir
from autotp.serve.runner.model_runner import PagedBatch
from autotp.serve.runner.paged import KvPool
from autotp.serve.runner.probe import probe
from autotp.serve.types import log
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


def _size(n: int) -> str:
    return next(f"{n / 2**p:.1f} {unit}" for p, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB"), (0, "B")) if n >= 2**p
                or p == 0)


@dataclass
class Backend:
    """This rank's engine parts: its batch, and on rank 0 the block accounting."""

    limits: Limits
    batch: PagedBatch
    planner: PagedPlanner | None


def backend(model, shapes, limits: Limits, block_size: int = 16, caching: bool = True, rank0: bool = True,
            speculate: int = 0, attention: str = "sdpa") -> tuple[PagedBatch, PagedPlanner | None]:
    """This rank's batch and, on rank 0, its planner. shapes: probe.probe's; the pool holds limits.kv_tokens //
    block_size blocks; speculate: the longest draft, so decode and drafted rows share one attention call;
    attention: the backend, sdpa, flex or varlen, already chosen (flex.choose, varlen.choose)."""
    blocks = limits.kv_tokens // block_size
    batch = PagedBatch(model, KvPool(shapes, blocks, block_size, model.device), short=1 + speculate,
                       attention=attention)
    return batch, PagedPlanner(BlockPool(blocks, block_size, caching), limits) if rank0 else None


# (backend, on CUDA) -> what the start-up line says of it
HOW = {("sdpa", False): "at most two kernel calls per layer and step",
       ("sdpa", True): "at most two kernel calls per layer and step",
       ("flex", True): "one compiled flex_attention call per layer and step over the pool in place; compiled decode "
                       "steps keep sdpa",
       ("flex", False): "one eager flex_attention call per layer and step, which materializes scores against the "
                        "whole pool: a reference for small pools, slower than sdpa",
       ("varlen", True): "one paged FlashAttention-2 varlen_attn call per layer and step over the pool in place; "
                         "compiled decode steps keep sdpa"}


def _backend(net, channel: Channel, env, opts: ServeOptions, max_model_len: int | None) -> Backend:
    """Every rank measures its cache cost and free memory; the largest cost and smallest room decide. A model whose
    attention does not reach the pool is refused here (probe.py), on every rank alike."""
    needs: set[str] = set()
    shapes = probe(net, needs)
    if opts.attention == "varlen":
        varlen.refuse(needs, shapes)
    per_token = sum(2 * heads * dim * dtype.itemsize for heads, dim, dtype in shapes)
    peak = 0
    if opts.kv_cache_memory is None:
        peak = budget.step_peak(net, min(opts.max_num_batched_tokens, max_model_len or opts.max_num_batched_tokens))
    costs = channel.gather((per_token, budget.free_bytes(env.device, opts.gpu_memory_utilization, peak)))
    per_token, free = max(c for c, _ in costs), min(f for _, f in costs)
    tokens = budget.kv_tokens(per_token, opts.kv_cache_memory, free, opts.max_num_seqs, max_model_len)
    sized_by = budget.sized_by(opts.kv_cache_memory, free, per_token, opts.max_num_seqs, max_model_len, env.device,
                               opts.gpu_memory_utilization)
    budget.check_fits(tokens, per_token, opts.kv_cache_memory, opts.block_size)
    attention = opts.attention  # chosen in serve(), before the weights are read
    tokens -= tokens % opts.block_size  # whole blocks
    if env.rank == 0:
        short = (f", less than the context of {max_model_len}: longer requests are refused"
                 if max_model_len is not None and tokens < max_model_len else "")
        layout = (f"{tokens // opts.block_size} blocks of {opts.block_size}, prefix caching "
                  f"{'on' if opts.prefix_caching else 'off'}, speculation "
                  f"{f'up to {opts.speculate} tokens' if opts.speculate else 'off'}")
        log(f"KV cache: {tokens} tokens per rank ({_size(tokens * per_token)} at {per_token} bytes per token, "
            f"sized by {sized_by}; {layout}){short}")
        log(f"attention: {attention} on {env.device.type} ({HOW[attention, env.device.type == 'cuda']})")
    limits = Limits(opts.max_num_seqs, opts.max_num_batched_tokens, tokens)
    batch, planner = backend(net, shapes, limits, opts.block_size, opts.prefix_caching, env.rank == 0, opts.speculate,
                             attention)
    return Backend(limits, batch, planner)


def _compile(batch: PagedBatch, channel: Channel, env) -> None:
    """The compiled decode step on every rank, or on none: rank 0 says how long warm-up took (the slowest
    rank's), or in one line why every step stays eager."""
    try:
        seconds, why = batch.compile(), ""
    except Exception as e:  # noqa: BLE001 - a model or device the compiler cannot take is served eager
        seconds, why = 0.0, f"{type(e).__name__}: {e}".splitlines()[0][:300]
    results = channel.gather((seconds, why))
    failed = next((f"rank {r}: {w}" for r, (_, w) in enumerate(results) if w), "")
    if not failed:
        batch.use_graph()
    if env.rank == 0:
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
    attention = varlen.choose(flex.choose(opts.attention, env.device, opts.block_size), env.device, opts.block_size)
    opts = replace(opts, attention=attention)  # every rank alike
    channel = Channel()
    sock, error = None, None
    if env.rank == 0:
        try:
            sock = listen(opts.host, opts.port)
        except OSError as e:
            error = f"cannot listen on {opts.host}:{opts.port}: {e.strerror or e}"
    error = channel.share(error)
    if error:
        raise AutotpError(error)

    model_dir = resolve_model_dir(model, flag="--model")
    config = load_config(model_dir)
    checkpoint = Checkpoint(model_dir)  # a config without weights is named so, not as a missing tokenizer
    dtype, held = weight_form.choose_dtype(opts.dtype, checkpoint.floating_dtype(), env.device,
                                             opts.quantize)
    tokenizer_dir = resolve_model_dir(opts.tokenizer, TOKENIZER_FILES, flag="--tokenizer") if opts.tokenizer else None
    tokenizer = load_tokenizer(tokenizer_dir or model_dir,
                               missing="autotp serve needs a tokenizer, and none loads from {source} ({cause}): "
                                       "give --tokenizer")
    max_model_len, source = context_limit(config, tokenizer, opts.max_model_len)
    # the input guard's per-forward all-reduce has nothing to catch here: rank 0 sends every input itself
    net = autotp.from_pretrained(model_dir, dtype=dtype, device=opts.device, quantize=opts.quantize,
                                 group_size=opts.group_size, check_inputs=False)
    if env.group is not None:
        # ranks finish loading at different times: wait here under the process group's long timeout
        # (AUTOTP_TIMEOUT), not in the control group's first broadcast, whose timeout is short
        dist.barrier(group=env.group)
    parts = _backend(net, channel, env, opts, max_model_len)
    # after the budget's checks: a refused start-up says its error alone and leaves F.linear as it was
    said = weight_form.kernels(net, env.device)
    if env.rank == 0:
        log(f"weights: {held}" + (f"; {said}" if said else ""))
    if opts.compile:
        _compile(parts.batch, channel, env)
    limits = parts.limits
    if max_model_len is None:  # no learned position limit (ALiBi): what the KV cache holds bounds a request
        if env.rank == 0:
            log(f"no context limit ({source}): a request may use the {limits.kv_tokens} tokens of the KV cache; "
                f"--max-model-len sets a limit")
        max_model_len = limits.kv_tokens

    # what start-up made (torch, transformers, the model) is never garbage: out of the collector's sight. A full
    # collection over it took 135 ms (374k objects, demo model), a stall of every stream when one triggers.
    gc.collect()
    gc.freeze()
    stopping = StopFlag()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    if env.rank != 0:
        code = follow(parts.batch, channel, stopping)
        channel.close()  # every rank got "stop": the group is whole (a broken one is left to the exit)
        return code

    engine = Engine(parts.batch, tokenizer, channel, stopping, limits, opts.max_queue, parts.planner,
                    speculate=opts.speculate)
    engine.metrics = Metrics(lambda: engine.counts()[0], lambda: engine.counts()[1],
                             lambda: engine.kv_used() / limits.kv_tokens)
    served = Served(model_id, tokenizer, max_model_len, int(time.time()), limits.kv_tokens)
    facts = router_api.Facts(  # what SGLang's router asks each replica
        str(model_dir.resolve()) if model_dir == Path(model) else model,
        str(Path(tokenizer_dir or model_dir).resolve()), config.model_type, tuple(config.architectures or ()),
        env.world_size, limits.max_num_seqs, limits.max_num_batched_tokens)
    app = build_app(served, engine, engine.metrics, opts.max_body_bytes, host_policy(opts.host, opts.allowed_hosts),
                    opts.api_key, facts)
    http = HttpThread(app, sock, opts.read_timeout)
    try:
        http.start()
    except RuntimeError:
        channel.send(Step(stop=True))
        raise
    address = sock.getsockname()
    log(f"serving {model_id} (tp={env.world_size}, up to {limits.max_num_seqs} sequences and "
        f"{limits.max_num_batched_tokens} tokens per step, context {max_model_len}) on http://{opts.host}:{address[1]}")
    code = engine.run()
    http.stop()
    if code == 0:
        channel.close()
    log("stopped" if code == 0 else "exited after a rank failure")
    return code
