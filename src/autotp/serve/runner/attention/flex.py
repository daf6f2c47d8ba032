"""The `flex` attention backend: one `flex_attention` call per layer and step, reading the KV pool in place.

The sdpa backend (sdpa.py) gathers each row's context out of the pool and pads rows into at most two
groups. Here nothing is gathered: one layer's whole pool is one long key sequence, (1, kv, slots, d), a view of
KvPool's (slots + 2, kv, d) tensor without its zero and scratch slots, and the step's tokens, every row's, are
one query sequence (1, heads, tokens, d). What a token may see is said twice, as vLLM v1's FlexAttention backend
says it:

- coarsely, by a `BlockMask` built on the host from the block tables: for each run of Q_BLOCK query tokens, the
  pool blocks (one flex KV block per cache block) of the rows those tokens belong to, up to the block of the
  last position among them (`kv_indices`). The kernel visits only those; a run that spans rows visits all their
  blocks (vLLM's over-fetch, bounded by Q_BLOCK rows per run);
- exactly, by a `mask_mod` over (query token, physical slot): the slot's block must be at its logical index in
  the token's own row (`table[row, logical[block]] == block`), and the key's position, logical * block_size +
  offset, at most the token's (causality; a sliding window bounds it from below).

`logical[block]`: the block's index in the block table of whichever of the step's rows holds it. A block two
rows share (a cached prefix) holds the same tokens at the same positions in both, so one index serves every row
(checked where the step is described). Blocks outside the step keep a stale index: no query visits them.

ALiBi and soft-capping are `score_mod`s; K/V keep their kv heads (`enable_gqa=True`: query head h reads kv head
h // (heads / kv), HF's `repeat_kv` order), never expanded. Scores are float32 inside flex; Gemma 2's eager
arithmetic caps them in the model's dtype first, so under bfloat16 the two agree within bfloat16's rounding.

The kernel: under torch.compile (CUDA; a compiled graph) flex lowers to a fused kernel. Outside a graph, on
CUDA, flex is called through its own compiled wrapper; on CPU eager flex materializes the scores of every token
against the whole pool, (1, heads, tokens, slots): a reference for small pools, not a fast path (torch 2.13's
CPU lowering takes no dynamic shapes: a C++ compile error, and it wants `kv_indices` as wide as the pool).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from autotp.errors import AutotpError
from autotp.serve.runner.attention.step import Alibi, StepLayout

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # torch before 2.5: the backend is refused by `Flex.refuse`
    BlockMask = flex_attention = None

Q_BLOCK = 16  # query tokens per BlockMask row: the smallest query tile flex's CUDA kernel takes (vLLM's choice)
_compiled = None  # flex_attention under torch.compile, made on first use


def kv_blocks(rows: np.ndarray, qpos: np.ndarray, table: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """rows, qpos (tokens,): each token's row and position; table (R, W): the rows' blocks (-1: none). ->
    kv_num_blocks (runs,) and kv_indices (runs, most): for each run of Q_BLOCK tokens, the blocks its tokens'
    rows hold up to the last position among them, left-packed, each once (padding: 0, never read)."""
    lists = []
    for a in range(0, len(rows), Q_BLOCK):
        run_rows, run_pos = rows[a:a + Q_BLOCK], qpos[a:a + Q_BLOCK]
        held = [table[r, :run_pos[run_rows == r].max() // size + 1] for r in np.unique(run_rows)]
        lists.append(np.unique(np.concatenate(held)))
    counts = np.array([len(x) for x in lists])
    indices = np.zeros((len(lists), counts.max()), dtype=np.int64)
    for i, x in enumerate(lists):
        indices[i, :len(x)] = x
    return counts, indices


def logical_index(table: np.ndarray, num_blocks: int) -> np.ndarray:
    """(num_blocks,): each of the step's blocks' index in its rows' tables (see the module docstring); raises
    where a block is held at two indices, which a prefix cache never does."""
    held = table >= 0
    cols = np.broadcast_to(np.arange(table.shape[1]), table.shape)[held]
    logical = np.zeros(num_blocks, dtype=np.int64)
    logical[table[held]] = cols
    if (logical[table[held]] != cols).any():
        raise AutotpError("a KV block is held at two positions of the step's block tables")
    return logical


@dataclass
class FlexStep:
    """One step as flex reads it (module docstring). rows, qpos (tokens,): each query token's row and position;
    table (R, W): the rows' blocks, -1 past a row's; logical (num_blocks,); kv_num_blocks (runs,), kv_indices
    (runs, most): the BlockMask's blocks; width: the longest context in the step (ALiBi tables are sized by it)."""

    rows: torch.Tensor
    qpos: torch.Tensor
    table: torch.Tensor
    logical: torch.Tensor
    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    block_size: int
    slots: int
    width: int
    masks: dict = field(default_factory=dict)

    def position(self, kv: torch.Tensor) -> torch.Tensor:
        """A physical slot's position in its block's rows."""
        return self.logical[kv // self.block_size] * self.block_size + kv % self.block_size

    def block_mask(self, window: int | None) -> BlockMask:
        """The step's BlockMask with the mask_mod of a layer whose sliding window is `window` (None: none); one per
        window and step, the block lists shared."""
        if window in self.masks:
            return self.masks[window]
        size = self.block_size

        def mask_mod(b, h, q, kv):
            block = kv // size
            own = self.table[self.rows[q], self.logical[block]] == block
            pos = self.position(kv)
            seen = own & (pos <= self.qpos[q])
            return seen if window is None else seen & (pos > self.qpos[q] - window)  # HF's sliding-window rule

        mask = BlockMask.from_kv_blocks(self.kv_num_blocks[None, None].to(torch.int32),
                                        self.kv_indices[None, None].to(torch.int32), BLOCK_SIZE=(Q_BLOCK, size),
                                        mask_mod=mask_mod, seq_lengths=(len(self.rows), self.slots),
                                        compute_q_blocks=False)  # inference only: no backward's transposed lists
        self.masks[window] = mask
        return mask

    def score_mod(self, softcap: float | None, alibi: Alibi | None):
        """The layer's score_mod (None: plain scores): soft-cap first, then the ALiBi bias, as HF's forwards do."""
        if softcap is None and alibi is None:
            return None

        def mod(score, b, h, q, kv):
            if softcap is not None:  # Gemma 2: tanh(s / cap) * cap
                score = torch.tanh(score / softcap) * softcap
            if alibi is not None:
                score = score + alibi.table[h, alibi.column(self.position(kv), self.qpos[q])] * alibi.scale
            return score

        return mod

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None,
               window: int | None, softcap: float | None, alibi: Alibi | None) -> torch.Tensor:
        """query (tokens, heads, d); keys and values: one layer's pool, (slots + 2, kv, d). -> (tokens, heads, d)."""
        q = query.transpose(0, 1)[None]  # (1, heads, tokens, d)
        k = keys[:self.slots].transpose(0, 1)[None]  # (1, kv, slots, d): the pool itself, a view
        v = values[:self.slots].transpose(0, 1)[None]
        out = _kernel(q)(q, k, v, score_mod=self.score_mod(softcap, alibi), block_mask=self.block_mask(window),
                         scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        return out[0].transpose(0, 1)


def _kernel(q: torch.Tensor):
    """flex_attention itself inside a graph being compiled, its compiled wrapper on CUDA, eager flex on CPU."""
    global _compiled
    if torch.compiler.is_compiling() or q.device.type != "cuda":
        return flex_attention
    if _compiled is None:
        _compiled = torch.compile(flex_attention, fullgraph=True)
    return _compiled


class Flex:
    """The backend's entry in the table (backends.py)."""

    name = "flex"

    def __init__(self, short: int = 1):
        pass  # every row is one query sequence: no groups to size

    @staticmethod
    def refuse(device: torch.device, block_size: int) -> str | None:
        """sdpa stays the default everywhere, CUDA included, until flex's compiled CUDA kernel has run on a GPU
        (benchmarks/gpu_decode.py --attention sdpa flex): an untried default that recompiled per step shape, or fell
        back to eager flex (scores against the whole pool), would cost a GPU user far more than sdpa's two calls."""
        if flex_attention is None:
            return (f"--attention flex needs torch.nn.attention.flex_attention, which torch {torch.__version__} lacks "
                    f"(2.5 or later): use --attention sdpa")
        if device.type == "cuda" and (block_size < 16 or block_size & (block_size - 1)):
            # flex's KV block is the cache block here, and its CUDA kernel tiles KV by a power of two >= 16
            return f"--attention flex on CUDA needs --block-size a power of two of at least 16, not {block_size}"
        return None

    @staticmethod
    def refuse_model(needs: set[str], shapes: list[tuple[int, int, torch.dtype]]) -> str | None:
        return None  # ALiBi and soft-capping are score_mods

    @staticmethod
    def how(device: torch.device) -> str:
        if device.type == "cuda":
            return "one compiled flex_attention call per layer and step over the pool in place; compiled decode " \
                   "steps keep sdpa"
        return "one eager flex_attention call per layer and step, which materializes scores against the whole " \
               "pool: a reference for small pools, slower than sdpa"

    @staticmethod
    def describe(layout: StepLayout) -> tuple[list[np.ndarray], Callable[[list[torch.Tensor]], FlexStep]]:
        """The host arrays of a FlexStep [rows, qpos, table, logical, kv_num_blocks, kv_indices], and what makes the
        step of them once they are on the device."""
        table = layout.table  # -1 past a row's blocks
        arrays = [layout.rows, layout.positions, table, logical_index(table, layout.num_blocks),
                  *kv_blocks(layout.rows, layout.positions, table, layout.block_size)]

        def build(tensors: list[torch.Tensor]) -> FlexStep:
            return FlexStep(*tensors, layout.block_size, layout.zero, layout.width)

        return arrays, build
