"""The server's budgets at start-up: what one cached token costs on each rank, and how many fit.

A token's cache bytes are measured, not derived from the config, so per-rank KV heads (replicated where
KV heads < tp), multi-query, sliding windows (counted as if full) and the dtype are all what the model
really stores: the probe forward (runner/probe.py) records every layer's keys.

Without `--kv-cache-memory`, the cache holds what `max_num_seqs` full-context rows need, capped by memory:
- on CUDA, vLLM's `--gpu-memory-utilization` rule: that share of the GPU's total memory, less what is in use
  once the weights are loaded (the weights, the CUDA context, other processes) and less the activations' peak
  of the largest step, measured at start-up by a forward of `--max-num-batched-tokens` tokens (`step_peak`);
- on CPU, a share of what the host has available, split between the ranks on the host: MemAvailable, or less where
  a memory cgroup's limit leaves less (host_memory.py; the kernel kills a process of a cgroup at its limit).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autotp import hosts
from autotp.errors import AutotpError
from autotp.parallel import stage_io
from autotp.serve.lockstep.wire import Channel
from autotp.serve.options import GPU_MEMORY_UTILIZATION, ServeOptions
from autotp.serve.runner.attention.backends import check_model
from autotp.serve.runner.probe import probe
from autotp.serve.startup.host_memory import Room, room, size_text
from autotp.serve.types import log

CPU_FRACTION = 0.5  # of MemAvailable or a cgroup's room, shared by the host's ranks: activations, the OS need the rest


def step_peak(model, tokens: int) -> int:
    """CUDA: the bytes a forward of `tokens` prompt tokens allocates beyond what stays allocated (its
    activations' peak; logits of the last position only, as the engine keeps them), the headroom the
    cache must leave. 0 on CPU, without a forward. Every rank calls it together: it is a forward. The
    forward runs transformers' own attention over one row, not the paged one: an estimate of the largest step."""
    device = model.device
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        stage_io.forward(model, lambda: model(input_ids=torch.zeros((1, tokens), dtype=torch.long, device=device),
                                              use_cache=False, logits_to_keep=1))
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - base)


def free_bytes(device: torch.device, utilization: float = GPU_MEMORY_UTILIZATION, headroom: int = 0,
               ranks_here: int = 1, host: Room | None = None) -> int:
    """What this rank may give its cache (the module's rules). headroom: step_peak's bytes; ranks_here: the ranks on
    this host, which share its memory on CPU; host: what the host leaves this process (CPU; read when None)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(0, int(total * utilization) - (total - free) - headroom)
    return int((host or room()).bytes * CPU_FRACTION / ranks_here)


def kv_tokens(per_token: int, budget: int | None, free: int, max_num_seqs: int, max_model_len: int | None) -> int:
    """Cache slots per rank: budget (bytes) when given, else what is free, capped by what the rows can use."""
    if budget is not None:
        return budget // per_token
    tokens = free // per_token
    return tokens if max_model_len is None else min(tokens, max_num_seqs * max_model_len)


def sized_by(budget: int | None, free: int, per_token: int, max_num_seqs: int, max_model_len: int | None,
             device: torch.device, utilization: float, host: Room) -> str:
    """Which rule gave kv_tokens' number, for the start-up line. host: the room of the rank with the least (CPU)."""
    if budget is not None:
        return "--kv-cache-memory"
    memory = (f"{utilization:.0%} of the GPU's memory less what is in use and the largest step's activations"
              if device.type == "cuda" else f"half {host.what()}, shared by the host's ranks")
    if max_model_len is not None and max_num_seqs * max_model_len <= free // per_token:
        return f"{max_num_seqs} sequences (--max-num-seqs) x {max_model_len} tokens of context, within {memory}"
    return memory


def check_fits(tokens: int, per_token: int, budget: int | None, block_size: int) -> None:
    """tokens: what the budget holds, before rounding down to whole blocks."""
    if tokens < max(2, block_size):
        where = f"--kv-cache-memory {budget} bytes" if budget is not None else "the memory left after loading"
        why = ("a request needs at least 2 (a prompt token and a generated one)" if tokens < 2
               else f"the paged cache needs at least one block of {block_size} (--block-size)")
        raise AutotpError(f"{where} holds {tokens} cached tokens at {per_token} bytes each: {why}")


@dataclass(frozen=True)
class Budget:
    """The cache every rank allocates: `tokens` slots (whole blocks) of `per_token` bytes on each rank, laid out as
    `shapes` (each layer's kv_heads, head_dim, dtype on this rank)."""

    tokens: int
    per_token: int
    shapes: list[tuple[int, int, torch.dtype]]


def size(net, channel: Channel, rank: int, device: torch.device, opts: ServeOptions, max_model_len: int | None,
         attention: type) -> Budget:
    """Every rank measures its cache cost and free memory; the largest cost and the smallest room decide. A model
    whose attention does not reach the pool is refused here (probe.py), on every rank alike, and so is one the
    attention backend cannot run (its refuse_model). Rank 0 says the result in two lines."""
    needs: set[str] = set()
    shapes = probe(net, needs)
    check_model(attention, needs, shapes)
    per_token = sum(2 * heads * dim * dtype.itemsize for heads, dim, dtype in shapes)
    peak = 0
    if opts.kv_cache_memory is None:
        peak = step_peak(net, min(opts.max_num_batched_tokens, max_model_len or opts.max_num_batched_tokens))
    nodes = channel.gather(hosts.key())  # the ranks of one host share its memory (CPU)
    here = nodes.count(hosts.key())
    host = room() if device.type != "cuda" else Room(0)
    costs = channel.gather((per_token, free_bytes(device, opts.gpu_memory_utilization, peak, here, host), host))
    per_token = max(c for c, _, _ in costs)
    _, free, host = min(costs, key=lambda c: c[1])  # the rank with the least room sizes every rank's cache
    tokens = kv_tokens(per_token, opts.kv_cache_memory, free, opts.max_num_seqs, max_model_len)
    how = sized_by(opts.kv_cache_memory, free, per_token, opts.max_num_seqs, max_model_len, device,
                   opts.gpu_memory_utilization, host)
    check_fits(tokens, per_token, opts.kv_cache_memory, opts.block_size)
    tokens -= tokens % opts.block_size  # whole blocks
    if rank == 0:
        short = (f", less than the context of {max_model_len}: longer requests are refused"
                 if max_model_len is not None and tokens < max_model_len else "")
        layout = (f"{tokens // opts.block_size} blocks of {opts.block_size}, prefix caching "
                  f"{'on' if opts.prefix_caching else 'off'}, speculation "
                  f"{f'up to {opts.speculate} tokens' if opts.speculate else 'off'}")
        log(f"KV cache: {tokens} tokens per rank ({size_text(tokens * per_token)} at {per_token} bytes per token, "
            f"sized by {how}; {layout}){short}")
        log(f"attention: {attention.name} on {device.type} ({attention.how(device)})")
    return Budget(tokens, per_token, shapes)

