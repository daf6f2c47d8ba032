"""Slice arithmetic: which part of a tensor a rank holds, as ranges along one dim.

Plain data with no knowledge of models, styles or files: the styles compute these, the layout keeps
them, the checkpoint reader reads them, `autotp plan` prints them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Range = tuple[int, int]


@dataclass(frozen=True)
class TensorShard:
    """The part of one tensor a rank holds: ranges [a, b) along `dim`, concatenated in order.

    `dim is None` means the whole tensor (replicated). The ranges keep their meaning (Q rows, K rows, V
    rows) for `describe`; `reads()` merges adjacent ones so a slice is read with as few reads as possible.
    """

    dim: int | None = None
    ranges: tuple[Range, ...] = ()

    @staticmethod
    def along(dim: int, ranges: list[Range]) -> TensorShard:
        return TensorShard(dim, tuple((a, b) for a, b in ranges if b > a))

    def reads(self) -> list[Range]:
        """The ranges with adjacent ones merged: what a reader should fetch."""
        merged: list[Range] = []
        for a, b in self.ranges:
            if merged and merged[-1][1] == a:
                merged[-1] = (merged[-1][0], b)
            else:
                merged.append((a, b))
        return merged

    @property
    def replicated(self) -> bool:
        return self.dim is None

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.dim is None:
            return tuple(shape)
        local = list(shape)
        local[self.dim] = sum(b - a for a, b in self.ranges)
        return tuple(local)

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full tensor, as a new tensor (pure indexing: bit-exact). Also when replicated:
        a tensor that views the caller's storage would keep it alive, e.g. a model's whole safetensors file
        mapping, every touched page of it resident, after init_inference has dropped the full weights."""
        if self.dim is None:
            return tensor.clone()
        parts = [tensor.narrow(self.dim, a, b - a) for a, b in self.reads()]
        return torch.cat(parts, dim=self.dim) if len(parts) != 1 else parts[0].clone()

    def describe(self, ndim: int = 2) -> str:
        """E.g. "rows 0:12 + 48:60"; rows and cols are the last two dims of an `ndim`-dim tensor (of each
        expert's matrix in a 3-D experts tensor), rows the only dim of a 1-D one."""
        if self.dim is None:
            return "replicated"
        what = {max(0, ndim - 2): "rows", ndim - 1: "cols"}.get(self.dim, f"dim {self.dim}") if ndim > 1 else "rows"
        return f"{what} " + " + ".join(f"{a}:{b}" for a, b in self.ranges)


REPLICATED = TensorShard()
