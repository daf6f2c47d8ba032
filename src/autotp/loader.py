"""Sliced safetensors reading: each rank reads only the rows or columns its plan gives it.

`Checkpoint` knows a model directory's safetensors file(s) by their headers alone (names, dtypes,
shapes), which is enough to validate a checkpoint against a model before a byte of weight is read.
`Checkpoint.read` then opens the tensor's file, reads the shard's ranges with safetensors' lazy
slicing (`safe_open(...).get_slice(name)[a:b]`) and closes it again: a handle held open for the whole
load keeps every touched page of the memory map resident, opening per tensor lets them go.
"""

from __future__ import annotations

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
from autotp.styles import TensorShard

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header
CHUNK_BYTES = 8 * 1024 * 1024  # rows read per file opening: bounds the memory-map pages resident at once


@dataclass(frozen=True)
class Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, Entry]:
    """Tensor name -> Entry from one safetensors file's header, with a clear error for a corrupt one."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER or 8 + n > size:
                raise ValueError(f"header length {n} does not fit the file's {size} bytes")
            header = json.loads(f.read(n))
        entries = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            shape = tuple(int(d) for d in info["shape"])
            if info["dtype"] not in DTYPES or not 0 <= begin <= end <= size - 8 - n:
                raise ValueError(f"tensor {name!r} has dtype {info['dtype']!r} or offsets out of the file")
            entries[name] = Entry(path, DTYPES[info["dtype"]], shape)
        return entries
    except FileNotFoundError:
        raise AutotpError(f"checkpoint file {path} is missing") from None
    except (ValueError, KeyError, TypeError, struct.error) as e:
        raise AutotpError(f"corrupt safetensors header in {path}: {e}") from None


class Checkpoint:
    """The safetensors weights of a model directory: a single `model.safetensors`, or the files listed
    by `model.safetensors.index.json`."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        index = self.directory / INDEX
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise AutotpError(f"corrupt checkpoint index {index}: {e}") from None
            files = sorted(set(weight_map.values()))
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

    def validate(self, expected: dict[str, list[str]], shapes: dict[str, tuple[int, ...]],
                 ignored: list[str] = ()) -> dict[str, str]:
        """Match the model's parameters to checkpoint keys before loading; return first name -> key.

        expected: first name -> every name of that parameter (tied weights); shapes: first name -> the
        global shape the model wants. Missing, unused and mis-shaped tensors are errors; `ignored` are
        regexes of checkpoint keys the model declares it does not load (HF's
        `_keys_to_ignore_on_load_unexpected`).
        """
        keys, missing, claimed = {}, [], set()
        for first, names in expected.items():
            present = [n for n in names if n in self.entries]
            if not present:
                missing.append(first)
                continue
            claimed.update(present)
            keys[first] = present[0]
            got = self.entries[present[0]].shape
            if got != tuple(shapes[first]):
                raise AutotpError(
                    f"checkpoint tensor {present[0]} has shape {got} but the config gives {tuple(shapes[first])}"
                )
        if missing:
            raise AutotpError(f"checkpoint in {self.directory} lacks {len(missing)} tensors the model needs: "
                              f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        unused = [k for k in self.entries if k not in claimed and not any(re.search(p, k) for p in ignored)]
        if unused:
            raise AutotpError(f"checkpoint in {self.directory} has {len(unused)} tensors the model does not use: "
                              f"{', '.join(sorted(unused)[:5])}{' ...' if len(unused) > 5 else ''}")
        return keys

    def read(self, key: str, shard: TensorShard, dtype: torch.dtype | None) -> torch.Tensor:
        """Read only `shard` of tensor `key` into a new tensor, converting floating-point data to `dtype`.

        safetensors' slices view its memory map, and every page they touch stays resident until the file
        is closed. So the shard is read in blocks of rows of at most CHUNK_BYTES, the file opened and
        closed per block, and each block copied (and converted) into a tensor of our own: the transient
        is one block, not one whole tensor (a replicated 8192 x 6144 bf16 wpe is 96 MiB).
        """
        entry = self.entries[key]
        target = dtype if dtype is not None and entry.dtype.is_floating_point else entry.dtype
        out = torch.empty(shard.local_shape(entry.shape), dtype=target)
        for source, dest in _blocks(shard, entry.shape, entry.dtype.itemsize):
            with safe_open(entry.file, framework="pt") as f:
                part = f.get_slice(key)[source] if entry.shape else f.get_tensor(key)
                out[dest].copy_(part)
                self.bytes_read += part.numel() * part.element_size()
                del part
        return out


def _blocks(shard: TensorShard, shape: tuple[int, ...], itemsize: int):
    """(index into the checkpoint tensor, index into the rank's tensor) for each block of rows to read."""
    if not shape:
        yield (), ()
        return
    if shard.dim not in (None, 0, 1):
        raise AutotpError(f"autotp slices along dims 0 and 1, not {shard.dim}")
    rows = max(1, CHUNK_BYTES // max(1, math.prod(shape[1:]) * itemsize))
    offset = 0
    for a, b in [(0, shape[0])] if shard.replicated else shard.reads():
        if shard.dim == 1:  # columns a:b of every row, into columns offset:offset+(b-a)
            for r0 in range(0, shape[0], rows):
                r1 = min(r0 + rows, shape[0])
                yield (slice(r0, r1), slice(a, b)), (slice(r0, r1), slice(offset, offset + b - a))
        else:  # rows a:b, into rows offset:offset+(b-a)
            for r0 in range(a, b, rows):
                r1 = min(r0 + rows, b)
                yield (slice(r0, r1),), (slice(offset + r0 - a, offset + r1 - a),)
        offset += b - a
