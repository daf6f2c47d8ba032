"""Sliced safetensors reading: each rank reads only its slice of each tensor (ranges along any one dim).

`Checkpoint` knows a model directory's safetensors file(s) by their headers alone (names, dtypes,
shapes), which is enough to validate a checkpoint against a model before a byte of weight is read.
`Checkpoint.read` then opens the tensor's file, reads the shard's ranges with safetensors' lazy
slicing (`safe_open(...).get_slice(name)[a:b]`) and closes it again: a handle held open for the whole
load keeps every touched page of the memory map resident, opening per tensor lets them go.
`Checkpoint.assemble` builds one tensor out of slices of several (a fused experts tensor from the
per-expert tensors the hub stores). Which tensor holds which parameter is the layout's business
(`autotp.parallel.layout`): this module depends on nothing but errors and slice arithmetic.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from autotp.errors import AutotpError
from autotp.parallel.slices import TensorShard

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header
BLOCK_BYTES = 8 * 1024 * 1024  # rows read per file opening: bounds the memory-map pages resident at once


@dataclass(frozen=True)
class Piece:
    """One read of `Checkpoint.assemble`: `shard` of tensor `key`, written at row `row` of `out[index]`."""

    key: str
    shard: TensorShard
    index: int
    row: int


@dataclass(frozen=True)
class Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, Entry]:
    """Tensor name -> Entry from one safetensors file's header, with a clear error for a corrupt one.

    Everything the loader will later rely on is checked here, before a weight is read: the header is a
    JSON object, each entry has a known dtype and integer shape, and its byte range lies in the file and
    holds exactly numel * itemsize bytes (safetensors itself would fail at read time, naming no tensor).
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER or 8 + n > size:
                raise ValueError(f"header length {n} does not fit the file's {size} bytes")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError(f"the header is a JSON {type(header).__name__}, not an object")
        entries = {}
        for name, info in header.items():
            if name != "__metadata__":
                entries[name] = _entry(path, name, info, size - 8 - n)
        return entries
    except FileNotFoundError:
        raise AutotpError(f"checkpoint file {path} is missing") from None
    except OSError as e:
        raise AutotpError(f"cannot read checkpoint file {path}: {e.strerror}") from None
    except (ValueError, struct.error) as e:
        raise AutotpError(f"corrupt safetensors header in {path}: {e}") from None


def _entry(path: Path, name: str, info, data_size: int) -> Entry:
    """One header entry, {"dtype": "F32", "shape": [rows, cols], "data_offsets": [begin, end]}, checked."""
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise ValueError(f"tensor {name!r} is not a {{dtype, shape, data_offsets}} object: {str(info)[:80]}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in DTYPES:
        raise ValueError(f"tensor {name!r} has dtype {str(dtype)[:20]!r}, not one of {', '.join(DTYPES)}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"tensor {name!r} has shape {str(shape)[:80]}, not a list of sizes")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_size):
        raise ValueError(f"tensor {name!r} has data_offsets {str(offsets)[:80]} outside the {data_size} data bytes")
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    if nbytes != offsets[1] - offsets[0]:
        raise ValueError(f"tensor {name!r} of shape {tuple(shape)} and dtype {dtype} needs {nbytes} bytes, but its "
                         f"data_offsets {offsets[0]}:{offsets[1]} hold {offsets[1] - offsets[0]}")
    return Entry(path, DTYPES[dtype], tuple(shape))


def _index_files(index: Path) -> list[str]:
    """The shard files an index's weight_map names: strings, each a path inside the index's directory.

    Only the names are checked, not where symlinks lead: the huggingface_hub cache stores every file as a
    symlink into its blobs folder, outside the snapshot directory.
    """
    try:
        weight_map = json.loads(index.read_text())
    except ValueError as e:
        raise AutotpError(f"corrupt checkpoint index {index}: {e}") from None
    if isinstance(weight_map, dict):
        weight_map = weight_map.get("weight_map")
    if not isinstance(weight_map, dict):
        raise AutotpError(f"corrupt checkpoint index {index}: it has no weight_map object")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file:
            raise AutotpError(f"corrupt checkpoint index {index}: tensor {name} maps to {str(file)[:80]}, "
                              "not a file name")
        if Path(file).is_absolute() or ".." in Path(file).parts:
            raise AutotpError(f"checkpoint index {index} maps tensor {name} to {file}, outside {index.parent}: "
                              "autotp reads only files inside the checkpoint directory")
    return sorted(set(weight_map.values()))


class Checkpoint:
    """The safetensors weights of a model directory: a single `model.safetensors`, or the files listed
    by `model.safetensors.index.json`.

    block_bytes bounds each read of `read` (see there); tests make it small to read in many blocks.
    """

    def __init__(self, directory: str | os.PathLike, block_bytes: int = BLOCK_BYTES):
        self.directory = Path(directory)
        self.block_bytes = block_bytes
        index = self.directory / INDEX
        if index.exists():
            files = _index_files(index)
        elif (self.directory / SINGLE).exists():
            files = [SINGLE]
        else:
            raise AutotpError(f"no weights in {self.directory}: no {SINGLE} or {INDEX} (autotp reads safetensors "
                              "checkpoints; `autotp plan` needs only config.json)")
        self.entries: dict[str, Entry] = {}
        for file in files:
            path = self.directory / file
            if not path.exists():
                raise AutotpError(f"checkpoint index {index} names {file}, which is missing from {self.directory}")
            self.entries.update(read_header(path))
        self.bytes_read = 0

    def floating_dtype(self) -> torch.dtype | None:
        """The dtype the checkpoint stores its floating-point weights in (the most common one)."""
        counts: dict[torch.dtype, int] = {}
        for e in self.entries.values():
            if e.dtype.is_floating_point:
                counts[e.dtype] = counts.get(e.dtype, 0) + 1
        return max(counts, key=counts.get) if counts else None

    def read(self, key: str, shard: TensorShard, dtype: torch.dtype | None) -> torch.Tensor:
        """Read only `shard` of tensor `key` into a new tensor, converting floating-point data to `dtype`."""
        entry = self.entries[key]
        target = dtype if dtype is not None and entry.dtype.is_floating_point else entry.dtype
        out = torch.empty(shard.local_shape(entry.shape), dtype=target)
        for where, block in self.blocks(key, shard, dtype):
            out[where] = block
        return out

    def assemble(self, shape: tuple[int, ...], pieces: list[Piece], dtype: torch.dtype | None) -> torch.Tensor:
        """A new tensor of `shape` made of slices of other tensors: each piece's `shard` of its `key` is written
        at `out[index].narrow(0, row, rows)` (a fused experts tensor from the per-expert tensors the hub
        stores, each read in blocks)."""
        first = self.entries[pieces[0].key]
        target = dtype if dtype is not None and first.dtype.is_floating_point else first.dtype
        out = torch.empty(shape, dtype=target)
        for piece in pieces:
            rows = piece.shard.local_shape(self.entries[piece.key].shape)[0]
            dest = out[piece.index].narrow(0, piece.row, rows)
            for where, block in self.blocks(piece.key, piece.shard, dtype):
                dest[where] = block
        return out

    def row_blocks(self, key: str, shard: TensorShard, dtype: torch.dtype | None, rows: int | None = None):
        """`shard` of a tensor of at most 2 dims (a linear weight) as consecutive blocks of the rank's whole
        rows: (first local row, block); `rows` rows per block, for readers that need blocks aligned to
        groups (see `blocks`)."""
        if len(self.entries[key].shape) > 2:
            raise AutotpError(f"row_blocks reads tensors of at most 2 dims, not {key} {self.entries[key].shape}")
        for where, block in self.blocks(key, shard, dtype, rows):
            yield (where[0].start if where else 0), block

    def blocks(self, key: str, shard: TensorShard, dtype: torch.dtype | None, rows: int | None = None):
        """`shard` of tensor `key` (sliced along any dim) as blocks: (where in the rank's tensor, block).

        safetensors' slices view its memory map, and every page they touch stays resident until the file
        is closed. So the shard is read in blocks of at most `block_bytes` of the file (or `rows` rows), the
        file opened and closed per block: the resident transient is one block, not one whole tensor (a
        replicated 8192 x 6144 bf16 wpe is 96 MiB; one Mixtral-8x7B expert's w1 is 224 MiB). A block is a
        view of the mapping (a copy only when converted to `dtype`), valid until the next block is asked
        for: the caller copies what it keeps. Copying every block into a tensor of its own first cost 1 GiB
        of RSS that stayed after loading the starcoderbase-1b shape at tp 1 (freed 8 MiB blocks fragment
        malloc's heap for the weights allocated after them). A block is consecutive indices of one
        "block dim" k with every later dim whole (within the shard); dims before k are taken one index at a
        time. k is the outermost dim whose rows fit `block_bytes`, but never the last one (a 2-D tensor is
        read in whole rows, a 3-D expert tensor whole when it fits, else expert by expert in row blocks).
        A 0-d tensor is one block.
        """
        entry = self.entries[key]
        target = dtype if dtype is not None and entry.dtype.is_floating_point else entry.dtype
        shape = entry.shape
        if shard.dim is not None and not 0 <= shard.dim < len(shape):
            raise AutotpError(f"cannot slice {key} {shape} along dim {shard.dim}")
        if not shape:
            with safe_open(entry.file, framework="pt") as f:
                tensor = f.get_tensor(key)
                self.bytes_read += tensor.element_size()
                yield (), tensor.to(target)
            return
        spans = [[(0, n)] for n in shape]  # per dim: the global ranges read, in order
        if shard.dim is not None:
            spans[shard.dim] = shard.reads()
        row_bytes = [math.prod(shape[d + 1:]) * entry.dtype.itemsize for d in range(len(shape))]
        k = 0
        while k < len(shape) - 2 and row_bytes[k] > self.block_bytes:
            k += 1
        rows = rows or max(1, self.block_bytes // max(1, row_bytes[k]))
        # (global index, local index) of every index of each dim before k
        outer = [[(g, local) for local, g in enumerate(i for a, b in spans[d] for i in range(a, b))] for d in range(k)]
        later = spans[shard.dim] if shard.dim is not None and shard.dim > k else [None]
        for index in itertools.product(*outer):
            fixed = tuple(slice(g, g + 1) for g, _ in index)
            local = 0
            for a, b in spans[k]:
                for r0 in range(a, b, rows):
                    r1 = min(r0 + rows, b)
                    where = tuple(slice(i, i + 1) for _, i in index) + (slice(local, local + r1 - r0),)
                    with safe_open(entry.file, framework="pt") as f:
                        source = f.get_slice(key)
                        parts = [source[self._index(fixed, r0, r1, shard.dim, c)] for c in later]
                        self.bytes_read += sum(p.numel() * p.element_size() for p in parts)
                        block = parts[0] if len(parts) == 1 else torch.cat(parts, dim=shard.dim)
                        yield where, block if block.dtype == target else block.to(target)
                    del source, parts, block
                    local += r1 - r0

    @staticmethod
    def _index(fixed: tuple[slice, ...], r0: int, r1: int, dim: int | None, columns: tuple[int, int] | None):
        """The safetensors index of one block: the fixed outer indices, rows r0:r1, `columns` along `dim`."""
        index = [*fixed, slice(r0, r1)]
        if columns is not None:
            index += [slice(None)] * (dim - len(index)) + [slice(*columns)]
        return tuple(index)
