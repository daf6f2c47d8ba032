"""Quantizing a rank's slice of a linear weight while it is read, block by block.

The full-precision weight of a layer never exists on a rank: the checkpoint slice arrives in blocks of
rows (`Checkpoint.row_blocks`), each block is quantized and dropped. What stays is the quantized slice
(and, for int4, its unpacked 4-bit values, one byte each, until they are packed for the kernel).

A weight is stored (out, in) by nn.Linear and (in, out) by HF's Conv1D (GPT-2): `QuantTarget.conv1d` says
which, and the quantized weight is always (out, in). int8 needs each output channel's max |w| over the
whole row before it can quantize it, so it reads the slice twice: first the maxima (all-reduced over the
ranks when the slice splits the inputs, so every rank uses the unsharded scale), then the values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from autotp.quant.weights import Quant, QuantizedWeight, int8_scales, pack_int4, quantize_int4, quantize_int8

# (first local row, block of rows) in the checkpoint's layout, in order, covering the rank's slice
Blocks = Callable[[int | None], Iterable[tuple[int, torch.Tensor]]]
PACK_ROWS = 64  # rows per block of an int4 nn.Linear weight (any count works; 64 is the CPU packing's unit)


@dataclass(frozen=True)
class QuantTarget:
    """What the layout knows about a weight to quantize."""

    quant: Quant
    conv1d: bool  # stored (in, out)
    splits_inputs: bool  # row-parallel: this rank holds some of the input features
    gptq: bool = False  # stored GPTQ-quantized (autotp.quant.gptq) rather than quantized while it is read


def quantize_slice(blocks: Blocks, target: QuantTarget, local_shape: tuple[int, ...], dtype: torch.dtype,
                   device: torch.device, reduce_max: Callable[[torch.Tensor], None],
                   row_max: torch.Tensor | None = None) -> QuantizedWeight:
    """The rank's slice, whose stored shape is `local_shape`, quantized. `blocks(rows)` reads it (rows=None:
    the reader's own block size); `reduce_max` all-reduces a tensor with MAX over the ranks in place.
    `row_max`, when the caller has the whole weight, is each local output channel's max over the full row."""
    out_features, in_features = (local_shape[1], local_shape[0]) if target.conv1d else local_shape
    if target.quant.kind == "int8":
        return _int8(blocks, target, out_features, in_features, dtype, device, reduce_max, row_max)
    return _int4(blocks, target, out_features, in_features, dtype, device)


def _int8(blocks: Blocks, target: QuantTarget, out_features: int, in_features: int, dtype, device, reduce_max,
          row_max) -> QuantizedWeight:
    if row_max is None and not target.conv1d and not target.splits_inputs:
        return _int8_whole_rows(blocks, target, out_features, in_features, dtype, device)
    if row_max is None:
        row_max = torch.zeros(out_features)
        for start, block in blocks(None):
            if target.conv1d:  # block: (in rows, out): each column's max over these input rows
                torch.maximum(row_max, block.float().abs().amax(0), out=row_max)
            else:  # block: (out rows, in)
                row_max[start:start + block.shape[0]] = block.float().abs().amax(1)
        if target.splits_inputs:
            reduce_max(row_max)
    scales = int8_scales(row_max, dtype)
    q = torch.empty(out_features, in_features, dtype=torch.int8)
    for start, block in blocks(None):
        if target.conv1d:
            q[:, start:start + block.shape[0]] = quantize_int8(block.t(), scales)
        else:
            q[start:start + block.shape[0]] = quantize_int8(block, scales[start:start + block.shape[0]])
    return QuantizedWeight(target.quant, out_features, in_features, q.to(device), scales.to(device))


def _int8_whole_rows(blocks: Blocks, target: QuantTarget, out_features: int, in_features: int, dtype,
                     device) -> QuantizedWeight:
    """Column-parallel nn.Linear: every block holds whole rows, so each row's scale comes from its block and
    the slice is read once."""
    q = torch.empty(out_features, in_features, dtype=torch.int8)
    scales = torch.empty(out_features, dtype=dtype)
    for start, block in blocks(None):
        rows = slice(start, start + block.shape[0])
        scales[rows] = int8_scales(block.float().abs().amax(1), dtype)
        q[rows] = quantize_int8(block, scales[rows])
    return QuantizedWeight(target.quant, out_features, in_features, q.to(device), scales.to(device))


def _int4(blocks: Blocks, target: QuantTarget, out_features: int, in_features: int, dtype,
          device) -> QuantizedWeight:
    group = target.quant.group_size
    q = torch.empty(out_features, in_features, dtype=torch.uint8)
    scales_and_zeros = torch.empty(in_features // group, out_features, 2, dtype=dtype)
    # Conv1D blocks are input rows: whole groups of them (the layout keeps a rank's inputs group-aligned)
    for start, block in blocks(group * PACK_ROWS if target.conv1d else PACK_ROWS):
        if target.conv1d:
            values, sz = quantize_int4(block.t(), group, dtype)
            q[:, start:start + block.shape[0]] = values
            scales_and_zeros[start // group:(start + block.shape[0]) // group] = sz
        else:
            values, sz = quantize_int4(block, group, dtype)
            q[start:start + block.shape[0]] = values
            scales_and_zeros[:, start:start + block.shape[0]] = sz
    return QuantizedWeight(target.quant, out_features, in_features, pack_int4(q, device), scales_and_zeros.to(device))


def quantize_loaded(full: torch.Tensor, shard, target: QuantTarget, dtype: torch.dtype,
                    device: torch.device) -> QuantizedWeight:
    """`init_inference`'s way: the rank's part of a weight the process already holds whole. int8 scales come
    from the whole rows here, so no collective is needed."""
    part = shard.take(full)
    row_max = None
    if target.quant.kind == "int8":
        whole = full.t() if target.conv1d else full  # (out, in)
        row_max = whole.float().abs().amax(1)
        if not target.splits_inputs:  # the rank's output channels: the rows (or columns) it took
            out_dim = 1 if target.conv1d else 0
            rows = torch.cat([torch.arange(a, b) for a, b in shard.reads()]) if shard.dim == out_dim else None
            row_max = row_max if rows is None else row_max[rows]

    def blocks(rows: int | None):
        step = part.shape[0] if rows is None else rows
        return ((r, part[r:r + step]) for r in range(0, part.shape[0], step))

    return quantize_slice(blocks, target, tuple(part.shape), dtype, device, lambda t: None, row_max)
