"""The `varlen` attention backend (CUDA, opt-in): one `varlen_attn` call per layer and step, reading the pool in place.

`torch.nn.attention.varlen.varlen_attn` is FlashAttention-2's variable-length kernel; given a block table it reads
a paged KV cache itself (torch 2.13). So nothing is gathered and nothing is padded: one layer's pool without its
zero and scratch slots is (num_blocks, block_size, kv, d) pages, a view of KvPool's (slots + 2, kv, d) tensor; the
step's tokens, every row's in step order, are the queries (tokens, heads, d), row r's from cu_seq_q[r] to
cu_seq_q[r + 1]; row r's keys are the first seqused_k[r] slots of its pages in block-table order. Grouped-query
heads go in as they are (`enable_gqa`), never expanded.

Causality is the kernel's (window (-1, 0)), which aligns a row's queries with the end of its keys: a row's new
tokens are the last of its context, so token i of a row computing n tokens of a context of L sees keys up to
L - n + i, its position. A sliding window of W is (W - 1, 0): HF's rule, key positions > position - W.

What it cannot do is refused at start-up, never at a request: a torch whose varlen_attn takes no block table, a
device other than CUDA (ROCm included: its varlen path takes no `num_splits`), a GPU older than Ampere, weights
other than float16 or bfloat16 and heads that are not a multiple of 8 up to 256 (the kernel's), a family whose
attention adds a bias or caps scores (ALiBi, Gemma 2's soft-capping: the probe sees them, probe.probe's `needs`),
and a --block-size FlashAttention-2 does not page by (PAGE_MULTIPLE).

`num_splits=1`: with a block table, torch's FlashAttention-2 otherwise picks a split-KV count by heuristic, and
its merge of the splits writes every row of a variable-length batch to the first one's place (pytorch issue
194167, FlashAttention issue 1217: silently wrong for two rows or more). One split is also batch invariant.

This path has not run on a GPU yet (benchmarks/gpu_decode.py --attention varlen is the check); the tests hold its
step description against dense attention through an emulation of the kernel's contract, and FlashAttention-2's
rules above were read from its source (flash_api.cpp, mask.h), not seen.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from autotp.errors import AutotpError
from autotp.serve.runner.attention.step import StepLayout

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch before 2.9: the backend is refused by `Varlen.refuse`
    varlen_attn = None

# FlashAttention-2 pages a KV cache only in blocks of a multiple of 256 tokens ("Paged KV cache block size must be
# divisible by 256", flash_api.cpp; FA3 and vLLM's fork relax it)
PAGE_MULTIPLE = 256
PAGED = {"block_table", "seqused_k", "window_size", "num_splits"}  # the keywords this backend passes


@dataclass
class VarlenStep:
    """One step as varlen_attn reads it (module docstring). cu_seq_q, cu_seq_k (rows + 1,), seqused_k (rows,),
    block_table (rows, pages), all int32 on the device; max_q, max_k: host ints, the longest query and context
    (never read back from the device); width: max_k, what ALiBi tables would be sized by."""

    cu_seq_q: torch.Tensor
    cu_seq_k: torch.Tensor
    seqused_k: torch.Tensor
    block_table: torch.Tensor
    max_q: int
    max_k: int
    block_size: int
    slots: int

    @property
    def width(self) -> int:
        return self.max_k

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None,
               window: int | None, softcap: float | None, alibi) -> torch.Tensor:
        """query (tokens, heads, d); keys and values: one layer's pool, (slots + 2, kv, d). -> (tokens, heads, d)."""
        if softcap is not None or alibi is not None:  # refused at start-up (refuse_model); one that hid it fails here
            raise AutotpError("--attention varlen has no soft-capping or ALiBi")
        kv, dim = keys.shape[1:]
        k = keys[:self.slots].view(-1, self.block_size, kv, dim)  # (num_blocks, block_size, kv, d): the pool
        v = values[:self.slots].view(-1, self.block_size, kv, dim)
        return varlen_attn(query, k, v, self.cu_seq_q, self.cu_seq_k, self.max_q, self.max_k, scale=scale,
                           window_size=(-1, 0) if window is None else (window - 1, 0),
                           enable_gqa=query.shape[1] != kv, seqused_k=self.seqused_k, block_table=self.block_table,
                           num_splits=1)  # see the module docstring


class Varlen:
    """The backend's entry in the table (backends.py): what it refuses, before loading and once the probe has seen
    the model (see the module docstring), and the step it describes."""

    name = "varlen"

    def __init__(self, short: int = 1):
        pass  # every row is one query sequence: no groups to size

    @staticmethod
    def refuse(device: torch.device, block_size: int) -> str | None:
        if varlen_attn is None or not PAGED <= set(inspect.signature(varlen_attn).parameters):
            return (f"--attention varlen needs torch.nn.attention.varlen.varlen_attn with a paged KV cache "
                    f"({', '.join(sorted(PAGED))}), which torch {torch.__version__} lacks: use --attention sdpa")
        if device.type != "cuda" or torch.version.hip:
            return (f"--attention varlen runs on CUDA only (FlashAttention-2), not on "
                    f"{'ROCm' if torch.version.hip else device.type}: use --attention sdpa")
        if block_size % PAGE_MULTIPLE:
            return (f"--attention varlen needs --block-size a multiple of {PAGE_MULTIPLE} (FlashAttention-2's "
                    f"pages), not {block_size}")
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 0):
            return (f"--attention varlen needs a GPU of compute capability 8.0 or newer (FlashAttention-2), not "
                    f"{capability[0]}.{capability[1]}: use --attention sdpa")
        return None

    @staticmethod
    def refuse_model(needs: set[str], shapes: list[tuple[int, int, torch.dtype]]) -> str | None:
        """`needs` and `shapes` (each layer's kv_heads, head_dim, dtype) are probe.probe's."""
        if needs:
            return (f"--attention varlen has no {' or '.join(sorted(needs))}, which this model's attention uses: use "
                    f"--attention sdpa")
        other = sorted({str(dtype).removeprefix("torch.") for _, _, dtype in shapes} - {"float16", "bfloat16"})
        if other:
            return (f"--attention varlen needs float16 or bfloat16 weights, not {', '.join(other)}: add --dtype "
                    f"bfloat16, or use --attention sdpa")
        dims = sorted({dim for _, dim, _ in shapes if dim % 8 or dim > 256})
        if dims:
            return (f"--attention varlen needs heads of a multiple of 8 up to 256 (FlashAttention-2), not "
                    f"{', '.join(map(str, dims))}: use --attention sdpa")
        return None

    @staticmethod
    def how(device: torch.device) -> str:
        return "one paged FlashAttention-2 varlen_attn call per layer and step over the pool in place; compiled " \
               "decode steps keep sdpa"

    @staticmethod
    def describe(layout: StepLayout) -> tuple[list[np.ndarray], Callable[[list[torch.Tensor]], VarlenStep]]:
        """The host arrays of a VarlenStep [cu_seq_q, cu_seq_k, seqused_k, block_table], and what makes the step of
        them once they are on the device (the kernel's index tensors are int32; the host's int64 until they land)."""
        cu_q = np.concatenate([[0], np.cumsum(layout.counts)])
        cu_k = np.concatenate([[0], np.cumsum(layout.ends)])
        arrays = [cu_q, cu_k, layout.ends, layout.padded(0)]  # past a row's pages: never read
        max_q, max_k = int(layout.counts.max()), layout.width

        def build(tensors: list[torch.Tensor]) -> VarlenStep:
            cu_seq_q, cu_seq_k, used, table = (t.to(torch.int32) for t in tensors)
            return VarlenStep(cu_seq_q, cu_seq_k, used, table, max_q, max_k, layout.block_size, layout.zero)

        return arrays, build
