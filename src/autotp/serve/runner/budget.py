"""The server's budgets at start-up: what one cached token costs on each rank, and how many fit.

A token's cache bytes are measured, not derived from the config, so per-rank KV heads (replicated where
KV heads < tp), multi-query, sliding windows (counted as if full) and the dtype are all what the model
really stores: the probe forward (probe.py) records every layer's keys.

Without `--kv-cache-memory`, the cache may use a fraction of what this rank has free once the weights
are loaded (most of a GPU's free memory; on CPU a share of the host's available memory, split between
the ranks on the host), and never more than `max_num_seqs` full-context rows need.
"""

from __future__ import annotations

import os

import torch

from autotp.errors import AutotpError

GPU_FRACTION = 0.9  # of the free GPU memory after loading (vLLM's default utilisation)
CPU_FRACTION = 0.5  # of MemAvailable, shared by the host's ranks: activations and the OS need the rest


def free_bytes(device: torch.device) -> int:
    """What this rank may give its cache, by the fractions above."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0] * GPU_FRACTION)
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return int(available * CPU_FRACTION / ranks_here)


def kv_tokens(per_token: int, budget: int | None, free: int, max_num_seqs: int, max_model_len: int | None) -> int:
    """Cache slots per rank: budget (bytes) when given, else what is free, capped by what the rows can use."""
    if budget is not None:
        return budget // per_token
    tokens = free // per_token
    return tokens if max_model_len is None else min(tokens, max_num_seqs * max_model_len)


def check_fits(tokens: int, per_token: int, budget: int | None, block_size: int) -> None:
    """tokens: what the budget holds, before rounding down to whole blocks."""
    if tokens < max(2, block_size):
        where = f"--kv-cache-memory {budget} bytes" if budget is not None else "the memory left after loading"
        why = ("a request needs at least 2 (a prompt token and a generated one)" if tokens < 2
               else f"the paged cache needs at least one block of {block_size} (--block-size)")
        raise AutotpError(f"{where} holds {tokens} cached tokens at {per_token} bytes each: {why}")
