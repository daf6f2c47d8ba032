"""What every attention backend reads of a step: the rows as the block tables lay them out (`StepLayout`, on the
host), the step's description every layer reads (`StepMeta`, on the device), a family's ALiBi table (`Alibi`), and the
one copy that takes a step's index arrays to the device (`ship`).

`StepLayout` is the one place a new token's position and slot are computed: token i of a row that computes `count`
tokens from `start` sits at position start + i, in slot table[pos // block_size] * block_size + pos % block_size of
the pool. Every backend builds its own per-step object from it (sdpa.py, flex.py, varlen.py; compiled.py pads it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


@dataclass
class Alibi:
    """A family's ALiBi bias as its forward computed it: table (heads, width), the bias of key column c for
    each of this rank's heads; from_end: column `width - length + j` holds key j of a row of `length` keys
    (MPT's bias is relative to the last key), else column j does (BLOOM, Falcon); scale: multiplies it."""

    table: torch.Tensor
    from_end: bool = False
    scale: float = 1.0

    def column(self, key: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        """The table column of the key at position `key` seen from a query at position `query` (broadcasting),
        clamped into the table (a column out of it is masked anyway). MPT's bias is relative to the last key; taken
        relative to each query instead (the same softmax, by shift invariance), so the keys near a query keep their
        precision in bfloat16."""
        span = self.table.shape[1]
        return (span - 1 - query + key if self.from_end else key).clamp(0, span - 1)


class StepLayout:
    """A step's rows on the host: row r, whose block table is tables[r], computes counts[r] tokens from position
    starts[r], its first at index firsts[r] of the step's flattened tokens. block_size, num_blocks: the pool's;
    zero: the pool's zero slot, which padding reads."""

    def __init__(self, tables: list[list[int]], starts: np.ndarray, counts: np.ndarray, block_size: int,
                 num_blocks: int):
        self.tables, self.starts, self.counts = tables, starts, counts
        self.block_size, self.num_blocks, self.zero = block_size, num_blocks, num_blocks * block_size
        self.ends = starts + counts  # each row's context length after the step
        self.firsts = np.cumsum(counts) - counts
        self.rows = np.repeat(np.arange(len(tables)), counts)  # (tokens,): each new token's row
        self.positions = np.concatenate([np.arange(s, e) for s, e in zip(starts, self.ends, strict=True)])
        self.table = self.padded(-1)
        self.slots = self.table[self.rows, self.positions // block_size] * block_size + self.positions % block_size

    def padded(self, pad: int) -> np.ndarray:
        """(R, W): the blocks each row reads (its context's), `pad` past a row's."""
        need = -(-self.ends // self.block_size)
        table = np.full((len(self.tables), int(need.max())), pad, dtype=np.int64)
        for r, t in enumerate(self.tables):
            table[r, :need[r]] = t[:need[r]]
        return table

    @property
    def width(self) -> int:
        """The longest context in the step."""
        return int(self.ends.max())


class Attention(Protocol):
    """A backend's per-step object (sdpa.SdpaStep, flex.FlexStep, varlen.VarlenStep): how every layer attends."""

    @property
    def width(self) -> int: ...

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None,
               window: int | None, softcap: float | None, alibi: Alibi | None) -> torch.Tensor:
        """query (tokens, heads, d); keys and values: one layer's pool, (slots + 2, kv, d). -> (tokens, heads, d),
        each token attending to its own row's context."""


@dataclass
class StepMeta:
    """One step, as every layer reads it: slot_mapping (tokens,), where each new token's keys and values go;
    positions (tokens,); attention: the backend's description of the rows."""

    slot_mapping: torch.Tensor
    positions: torch.Tensor
    attention: Attention

    @property
    def width(self) -> int:
        """The longest context in the step (the ALiBi families size their bias tables by it)."""
        return self.attention.width


def ship(arrays: list[np.ndarray], device) -> list[torch.Tensor]:
    """Host int64 arrays -> tensors on `device` in one copy (on CUDA from a pinned buffer, without a host sync):
    a step's index arrays cross to the GPU once, not one synchronous copy each."""
    flat = torch.from_numpy(np.concatenate([a.reshape(-1).astype(np.int64, copy=False) for a in arrays]))
    if torch.device(device).type != "cpu":
        flat = flat.pin_memory().to(device, non_blocking=True)
    out, at = [], 0
    for a in arrays:
        out.append(flat[at:at + a.size].view(a.shape))
        at += a.size
    return out
