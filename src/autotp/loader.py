"""Sliced safetensors reading: each rank reads only its slice of each tensor (ranges along any one dim).

`Checkpoint` knows a model directory's safetensors file(s) by their headers alone (names, dtypes,
shapes), which is enough to validate a checkpoint against a model before a byte of weight is read.
`Checkpoint.read` then opens the tensor's file, reads the shard's ranges with safetensors' lazy
slicing (`safe_open(...).get_slice(name)[a:b]`) and closes it again: a handle held open for the whole
load keeps every touched page of the memory map resident, opening per tensor lets them go. A fused
experts tensor the checkpoint stores one tensor per expert (`ExpertKeys`) is assembled from the rank's
slice of each.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from autotp.errors import AutotpError
from autotp.styles import REPLICATED, TensorShard

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


@dataclass(frozen=True)
class ExpertKeys:
    """A fused experts tensor (experts, rows, cols) stored the hub's way: keys[e][p] holds rows
    p*h:(p+1)*h of expert e's matrix, (h, cols) with h = rows / parts (plans.plan.FusedSource)."""

    shape: tuple[int, ...]  # the fused tensor's, global
    keys: tuple[tuple[str, ...], ...]  # [expert][part]

    def part_shape(self) -> tuple[int, int]:
        return self.shape[1] // len(self.keys[0]), self.shape[2]

    def reads(self, shard: TensorShard) -> list[tuple[str, TensorShard, int, int]]:
        """`shard` of the fused tensor as reads of the parts: (key, shard of that part, the rank's expert index,
        its first row in that expert's local matrix). A row slice (dim 1, e.g. gate rows a:b and up rows
        I+a:I+b) reads rows of the parts it spans, a column slice (dim 2) the same columns of every part,
        an expert slice (dim 0) only those experts' parts, whole."""
        rows, h = self.shape[1], self.part_shape()[0]
        experts = [e for a, b in shard.ranges for e in range(a, b)] if shard.dim == 0 else range(self.shape[0])
        spans = shard.ranges if shard.dim == 1 else ((0, rows),)
        out = []
        for local, e in enumerate(experts):
            row = 0
            for a, b in spans:
                for p in range(a // h, (b - 1) // h + 1):
                    a_p, b_p = max(a, p * h) - p * h, min(b, (p + 1) * h) - p * h
                    part = (TensorShard.along(0, [(a_p, b_p)]) if shard.dim == 1
                            else TensorShard.along(1, list(shard.ranges)) if shard.dim == 2 else REPLICATED)
                    out.append((self.keys[e][p], part, local, row))
                    row += b_p - a_p
        return out


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
            raise AutotpError(f"no {SINGLE} or {INDEX} in {self.directory}: autotp reads safetensors checkpoints")
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

    def validate(self, expected: dict[str, list[str]], params: dict[str, torch.Tensor],
                 ignored: list[str] = (), per_expert: dict[str, ExpertKeys] | None = None
                 ) -> dict[str, str | ExpertKeys]:
        """Match the model's parameters to checkpoint keys before loading; return first name -> key.

        expected: first name -> every name of that parameter (tied weights); params: first name -> the
        model's (meta) parameter, for the global shape and the kind of dtype it wants. per_expert: first
        name -> the per-expert tensors that may hold a fused experts parameter instead (its key is then
        that ExpertKeys). Missing, unused and mis-shaped tensors are errors, and so is integer data for a
        floating-point parameter or the reverse (`read` converts between floating dtypes only); `ignored`
        are regexes of checkpoint keys the model declares it does not load (HF's
        `_keys_to_ignore_on_load_unexpected`).
        """
        keys, missing, claimed = {}, [], set()
        for first, names in expected.items():
            present = [n for n in names if n in self.entries]
            split = (per_expert or {}).get(first)
            if not present and split is not None and any(k in self.entries for ks in split.keys for k in ks):
                absent = [k for ks in split.keys for k in ks if k not in self.entries]
                missing.extend(absent)
                claimed.update(k for ks in split.keys for k in ks)
                if not absent:
                    keys[first] = split
                    for k in (k for ks in split.keys for k in ks):
                        self._check(k, split.part_shape(), params[first], first,
                                    f" (one expert's part of {first} {split.shape})")
                continue
            if not present:
                missing.append(first)
                continue
            claimed.update(present)
            keys[first] = present[0]
            self._check(present[0], tuple(params[first].shape), params[first], first)
        if missing:
            raise AutotpError(f"checkpoint in {self.directory} lacks {len(missing)} tensors the model needs: "
                              f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        unused = [k for k in self.entries if k not in claimed and not any(re.search(p, k) for p in ignored)]
        if unused:
            raise AutotpError(f"checkpoint in {self.directory} has {len(unused)} tensors the model does not use: "
                              f"{', '.join(sorted(unused)[:5])}{' ...' if len(unused) > 5 else ''}")
        return keys

    def _check(self, key: str, shape: tuple[int, ...], want: torch.Tensor, first: str, note: str = "") -> None:
        """Tensor `key` has `shape` and the kind of dtype (floating or not) of the model's parameter `first`."""
        entry = self.entries[key]
        if entry.shape != shape:
            raise AutotpError(f"checkpoint tensor {key} has shape {entry.shape} but the config gives {shape}{note}")
        if entry.dtype.is_floating_point != want.dtype.is_floating_point:
            raise AutotpError(f"checkpoint tensor {key} in {entry.file} is stored as {DTYPE_NAMES[entry.dtype]}, "
                              f"but the model's {first} is {str(want.dtype).removeprefix('torch.')}")

    def read(self, key: str | ExpertKeys, shard: TensorShard, dtype: torch.dtype | None) -> torch.Tensor:
        """Read only `shard` of tensor `key` into a new tensor, converting floating-point data to `dtype`; a
        fused experts tensor stored per expert is assembled from each part's slice, each read in blocks."""
        if isinstance(key, ExpertKeys):
            return self._read_experts(key, shard, dtype)
        entry = self.entries[key]
        target = dtype if dtype is not None and entry.dtype.is_floating_point else entry.dtype
        out = torch.empty(shard.local_shape(entry.shape), dtype=target)
        for where, block in self.blocks(key, shard, dtype):
            out[where] = block
        return out

    def _read_experts(self, key: ExpertKeys, shard: TensorShard, dtype: torch.dtype | None) -> torch.Tensor:
        first = self.entries[key.keys[0][0]]
        target = dtype if dtype is not None and first.dtype.is_floating_point else first.dtype
        out = torch.empty(shard.local_shape(key.shape), dtype=target)
        for part_key, part, expert, row in key.reads(shard):
            dest = out[expert].narrow(0, row, part.local_shape(key.part_shape())[0])
            for where, block in self.blocks(part_key, part, dtype):
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
