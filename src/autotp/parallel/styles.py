"""Parallel styles: the vocabulary a plan is written in, and the slice of each weight a style gives a rank.

Every style has the two methods of `Style`: `shards()` gives the `TensorShard` of each parameter (which
rows or columns of the checkpoint tensor a rank holds) and `build()` makes the per-rank module from those
shards, as the layout resolved them (its sizes are read off the shards, never worked out again).
Styles know layouts (`[Q | K | V]` blocks, per-head interleaving) but no model: the plans in `plans/` say
which module gets which style.

`nn.Linear.weight` is `(out_features, in_features)`: colwise slices dim 0 (rows), rowwise slices dim 1. HF's
`Conv1D` (GPT-2) stores the transpose, `(in, out)`: the same styles slice the other dim for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from autotp.errors import AutotpError
from autotp.parallel import layers
from autotp.parallel.partition import HeadShard, even_split
from autotp.parallel.slices import REPLICATED, Range, TensorShard


@dataclass(frozen=True)
class RankContext:
    """What a style needs to know about the rank it is slicing for."""

    rank: int
    tp: int
    heads: HeadShard | None  # None for plans without attention heads to split


@dataclass(frozen=True)
class Geometry:
    """Where a linear layer keeps its outputs and inputs; the one place that knows HF's `Conv1D`.

    `nn.Linear.weight` is (out, in): outputs along dim 0. HF's `Conv1D` (GPT-2) stores (in, out): outputs
    along dim 1. Biases are (out,) either way.
    """

    out_features: int
    in_features: int
    conv1d: bool

    @property
    def out_dim(self) -> int:
        """The weight dim that holds the outputs."""
        return 1 if self.conv1d else 0

    @staticmethod
    def of(module: nn.Module) -> Geometry:
        if isinstance(module, Conv1D):
            return Geometry(module.nf, module.nx, True)
        return Geometry(module.out_features, module.in_features, False)

    def outputs(self, ranges: list[Range]) -> TensorShard:
        """The weight rows (Linear) or columns (Conv1D) of these output features."""
        return TensorShard.along(1 if self.conv1d else 0, ranges)

    def inputs(self, ranges: list[Range]) -> TensorShard:
        """The weight columns (Linear) or rows (Conv1D) of these input features."""
        return TensorShard.along(0 if self.conv1d else 1, ranges)


class Style(Protocol):
    """How one module is partitioned: the part of each parameter a rank holds, and the module it runs.
    A style whose module can run a `quant.QuantizedWeight` says so with a class attribute
    `quantizable = True`; `--quantize` leaves every other style's weights in the model dtype."""

    def shards(self, module: nn.Module, ctx: RankContext) -> dict[str, TensorShard]:
        """Parameter name -> the rank's part of it; a parameter left out is replicated."""

    def build(self, module: nn.Module, shards: Shards, ctx: RankContext, group) -> nn.Module:
        """The rank's replacement for `module`, parameters on meta at their per-rank shapes; `shards` is
        `shards()` as resolved for every rank: parameter name -> (rank 0's part, rank 1's, ...)."""


# parameter name -> every rank's TensorShard of it, as the layout resolved them
Shards = dict[str, tuple[TensorShard, ...]]


def local_size(module: nn.Module, shards: Shards, rank: int, dim: int) -> int:
    """The rank's size along `dim` of `module.weight`, from its resolved shard."""
    return shards["weight"][rank].local_shape(tuple(module.weight.shape))[dim]


class _ColumnParallel:
    """Output features split across ranks, `out_ranges` saying which; the output stays sharded (no comms)."""

    quantizable: ClassVar[bool] = True  # builds a ColwiseLinear, which runs a quantized weight too

    def out_ranges(self, out_features: int, ctx: RankContext) -> list[Range]:
        raise NotImplementedError

    def shards(self, module: nn.Module, ctx: RankContext) -> dict[str, TensorShard]:
        geometry = Geometry.of(module)
        ranges = self.out_ranges(geometry.out_features, ctx)
        return {"weight": geometry.outputs(ranges), "bias": TensorShard.along(0, ranges)}

    def build(self, module: nn.Module, shards: Shards, ctx: RankContext, group) -> nn.Module:
        g = Geometry.of(module)
        out_per_rank = local_size(module, shards, ctx.rank, g.out_dim)
        cls = layers.ColwiseConv1D if g.conv1d else layers.ColwiseLinear
        return cls(g.in_features, out_per_rank, g.out_features, module.bias is not None, module.weight.dtype)


@dataclass(frozen=True)
class Colwise(_ColumnParallel):
    """Output features split across ranks.

    split: "even" for MLP-style dimensions, "q_heads"/"kv_heads" to follow the rank's attention heads.
    blocks: with "even", the outputs are `blocks` equal fused blocks (Phi-3's gate_up_proj is
    [gate (I) | up (I)], blocks=2), each split evenly; a rank keeps its piece of every block, in order,
    so HF's `chunk(blocks, dim=-1)` of the per-rank output still yields [gate_local | up_local].
    """

    split: Literal["even", "q_heads", "kv_heads"] = "even"
    blocks: int = 1

    def out_ranges(self, out_features: int, ctx: RankContext) -> list[Range]:
        if self.split == "even":
            if out_features % self.blocks:
                raise AutotpError(f"{out_features} output features do not form {self.blocks} equal fused blocks")
            size = out_features // self.blocks
            a, b = even_split(size, ctx.tp)[ctx.rank]
            return [(k * size + a, k * size + b) for k in range(self.blocks)]
        h = ctx.heads
        if self.split == "q_heads":
            return [(h.q_start * h.head_dim, h.q_stop * h.head_dim)]
        return [(h.kv_start * h.head_dim, h.kv_stop * h.head_dim)]


@dataclass(frozen=True)
class FusedQKV(_ColumnParallel):
    """A fused query/key/value projection; each rank keeps its query heads with the KV heads they use.

    layout "blocks":   outputs are [Q (heads*d) | K (kv_heads*d) | V (kv_heads*d)] (GPT-BigCode multi-query,
                       Phi-3's qkv_proj, GPT-2's c_attn with kv_heads == heads, Falcon multi_query).
                       KV heads that several ranks need are read by each of them.
    layout "grouped":  outputs are (kv_heads, heads/kv_heads + 2, d): each KV group's query heads, then its
                       K and V (GPT-BigCode multi_query=False, Falcon's new_decoder_architecture, and
                       GPT-NeoX / BLOOM, where the group is 1 query head: (heads, 3, d)).
    """

    layout: Literal["blocks", "grouped"] = "blocks"

    def out_ranges(self, out_features: int, ctx: RankContext) -> list[Range]:
        return self.row_ranges(ctx.heads)

    def row_ranges(self, h: HeadShard) -> list[Range]:
        """The output rows of the query heads of `h` and of the KV heads they use, in the fused order."""
        d = h.head_dim
        if self.layout == "blocks":
            q_rows = h.total_q_heads * d
            kv_rows = h.total_kv_heads * d
            return [
                (h.q_start * d, h.q_stop * d),
                (q_rows + h.kv_start * d, q_rows + h.kv_stop * d),
                (q_rows + kv_rows + h.kv_start * d, q_rows + kv_rows + h.kv_stop * d),
            ]
        group = h.total_q_heads // h.total_kv_heads
        ranges = []
        for kv in range(h.kv_start, h.kv_stop):
            base = kv * (group + 2) * d
            q0, q1 = max(h.q_start, kv * group) - kv * group, min(h.q_stop, (kv + 1) * group) - kv * group
            ranges += [(base + q0 * d, base + q1 * d), (base + group * d, base + (group + 2) * d)]
        return ranges


@dataclass(frozen=True)
class Rowwise:
    """Input features split across ranks; partial outputs are all-reduced and the bias added once after."""

    split: Literal["even", "q_heads"] = "even"
    quantizable: ClassVar[bool] = True  # builds a RowwiseLinear, which runs a quantized weight too

    def in_range(self, in_features: int, ctx: RankContext) -> Range:
        if self.split == "even":
            return even_split(in_features, ctx.tp)[ctx.rank]
        h = ctx.heads
        return h.q_start * h.head_dim, h.q_stop * h.head_dim

    def shards(self, module: nn.Module, ctx: RankContext) -> dict[str, TensorShard]:
        geometry = Geometry.of(module)
        return {"weight": geometry.inputs([self.in_range(geometry.in_features, ctx)]), "bias": REPLICATED}

    def build(self, module: nn.Module, shards: Shards, ctx: RankContext, group) -> nn.Module:
        g = Geometry.of(module)
        in_per_rank = local_size(module, shards, ctx.rank, 1 - g.out_dim)
        cls = layers.RowwiseConv1D if g.conv1d else layers.RowwiseLinear
        return cls(in_per_rank, g.out_features, g.in_features, module.bias is not None, module.weight.dtype, group)


@dataclass(frozen=True)
class Vocab:
    """Embedding rows (the vocabulary) split evenly; lookups are masked per rank and all-reduced."""

    def shards(self, module: nn.Module, ctx: RankContext) -> dict[str, TensorShard]:
        return {"weight": TensorShard.along(0, [even_split(module.num_embeddings, ctx.tp)[ctx.rank]])}

    def build(self, module: nn.Module, shards: Shards, ctx: RankContext, group) -> nn.Module:
        # An embedding subclass with its own forward would lose it; the one such forward known is a scale.
        scale = getattr(module, "embed_scale", None)
        if type(module).forward is not nn.Embedding.forward and not isinstance(scale, torch.Tensor):
            raise AutotpError(f"{type(module).__name__} changes nn.Embedding's forward: the vocab style cannot "
                              "shard it")
        (start, stop), = shards["weight"][ctx.rank].ranges
        return layers.VocabParallelEmbedding(module.num_embeddings, module.embedding_dim, start, stop,
                                             module.padding_idx, module.weight.dtype, group, scale)


@dataclass(frozen=True)
class VocabHead:
    """Output-embedding rows split like `Vocab`; the logits are gathered so every rank sees the full vocab."""

    def shards(self, module: nn.Module, ctx: RankContext) -> dict[str, TensorShard]:
        rows = TensorShard.along(0, [even_split(module.out_features, ctx.tp)[ctx.rank]])
        return {"weight": rows, "bias": rows}

    def build(self, module: nn.Module, shards: Shards, ctx: RankContext, group) -> nn.Module:
        g = Geometry.of(module)
        sizes = [local_size(module, shards, rank, 0) for rank in range(ctx.tp)]
        return layers.VocabParallelLMHead(g.in_features, sizes, module.bias is not None, module.weight.dtype, group,
                                          ctx.rank)


@dataclass(frozen=True)
class BlockInterleavedQKV(_ColumnParallel):
    """A fused projection interleaved in `blocks` equal blocks, each `parts` equal parts (CodeGen's qkv_proj:
    4 blocks of [Q | V | K], each part heads*d/4 wide). Part p of every block, in block order, is that
    projection's heads*d outputs, head after head (a head may straddle two blocks).

    A rank keeps, for each of its query heads in order, the head's d rows of each part: its output is
    q_heads blocks of one head each, [part 0 | part 1 | ...] of d rows, so the forward reads the same heads
    when the attention's per-rank block count is its query head count (the plan sets it) and its width is
    q_heads*d. Exact: no head is split, any tp up to the head count works.
    """

    blocks: int = 4
    parts: int = 3

    def out_ranges(self, out_features: int, ctx: RankContext) -> list[Range]:
        h = ctx.heads
        width = h.total_q_heads * h.head_dim  # one part of all blocks
        if out_features != self.parts * width or width % self.blocks:
            raise AutotpError(f"{out_features} fused outputs are not {self.blocks} blocks of {self.parts} parts "
                              f"of {h.total_q_heads} heads x {h.head_dim} / {self.blocks}")
        part = width // self.blocks  # the rows of one part in one block
        ranges = []
        for head in range(h.q_start, h.q_stop):
            for p in range(self.parts):
                a, b = head * h.head_dim, (head + 1) * h.head_dim  # within part p, all blocks concatenated
                while a < b:  # split where the head crosses a block boundary
                    block, offset = divmod(a, part)
                    stop = min(b, (block + 1) * part)
                    start_row = block * self.parts * part + p * part + offset
                    ranges.append((start_row, start_row + stop - a))
                    a = stop
        return ranges


@dataclass(frozen=True)
class FusedExperts:
    """transformers 5's fused experts module: every expert's weights in one 3-D tensor, each expert's
    intermediate features split evenly across ranks, all experts on every rank.

    gate_up_proj (experts, 2*I, hidden) = [gate (I) | up (I)] per expert (`is_concatenated`; interleaved
    [g0, u0, g1, u1, ...] otherwise; `up_proj` (experts, I, hidden) when there is no gate), down_proj
    (experts, hidden, I); `is_transposed` stores each expert's matrix the other way round, (hidden, 2*I)
    and (I, hidden). A rank keeps rows a:b of gate and of up (column-parallel, in the order the forward's
    `chunk(2)` splits them) and columns a:b of down (row-parallel), for every expert. The router is
    replicated, so every rank routes each token to the same experts; each rank's experts output is then a
    partial sum over its intermediate features, and one all-reduce of the combined output (after the
    routing weights and the sum over experts: `layers.SumOverRanks`) completes it.

    The module is the model's own, forward included (it dispatches to HF's eager, batched or grouped
    experts kernels, none of which reads a size): only its tensors become the rank's slices. Its
    `intermediate_dim` keeps the global size. Expert biases (a down bias would be added on every rank)
    and post-expert norms (nonlinear in a partial sum) are refused.

    Each rank's features are an even split in granules (`feature_range`). A checkpoint that stores one
    tensor per expert (the hub's layout) is assembled into these slices by the loader (`loader.ExpertKeys`,
    as the plan's `fused_sources` say).

    Expert parallelism (whole experts per rank) is left out: it splits evenly only when experts divide by
    tp, needs a token all-to-all (or a masked forward and an all-reduce over every expert) and balances
    work by routing luck; splitting every expert gives every rank the same bytes and FLOPs for any tp up to
    the intermediate size, with the same one all-reduce as a dense MLP.
    """

    def intermediate(self, module: nn.Module) -> int:
        unknown = {n for n, _ in module.named_parameters(recurse=False)} - {"gate_up_proj", "up_proj", "down_proj"}
        if unknown or getattr(module, "has_bias", False) or getattr(module, "has_post_expert_norm", False):
            what = ", ".join(sorted(unknown)) or "expert biases or post-expert norms"
            raise AutotpError(f"{type(module).__name__} has {what}: autotp splits experts with only gate_up_proj "
                              "(or up_proj) and down_proj")
        return module.down_proj.shape[1 if self._transposed(module) else 2]

    @staticmethod
    def _transposed(module: nn.Module) -> bool:
        return bool(getattr(module, "is_transposed", False))

    def shards(self, module: nn.Module, ctx: RankContext) -> dict[str, TensorShard]:
        size = self.intermediate(module)
        a, b = self.feature_range(size, ctx, type(module).__name__)
        out_dim, in_dim = (2, 1) if self._transposed(module) else (1, 2)  # of each expert's (out, in) matrix
        if not hasattr(module, "gate_up_proj"):
            return {"up_proj": TensorShard.along(out_dim, [(a, b)]), "down_proj": TensorShard.along(in_dim, [(a, b)])}
        fused = [(a, b), (size + a, size + b)] if getattr(module, "is_concatenated", True) else [(2 * a, 2 * b)]
        return {"gate_up_proj": TensorShard.along(out_dim, fused), "down_proj": TensorShard.along(in_dim, [(a, b)])}

    @staticmethod
    def feature_range(size: int, ctx: RankContext, what: str) -> Range:
        """The rank's intermediate features: an even split in granules of gcd(size, 8) features, so that a
        slice keeps the 16-byte row alignment `grouped_mm` (HF's default experts kernel) requires at 2-byte
        dtypes (8 features) whenever the full size has it; an odd slice (7 bf16 features) would fail there."""
        granule = math.gcd(size, 8)
        if size // granule < ctx.tp:
            raise AutotpError(f"tp_size {ctx.tp} exceeds the {size // granule} granules of {granule} intermediate "
                              f"features of each expert of {what}: at most {size // granule} ranks can share them")
        a, b = even_split(size // granule, ctx.tp)[ctx.rank]
        return a * granule, b * granule

    def build(self, module: nn.Module, shards: Shards, ctx: RankContext, group) -> nn.Module:
        module.register_forward_hook(layers.SumOverRanks(group))
        return module
