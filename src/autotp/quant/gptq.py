"""GPTQ checkpoints: the format read from config, each rank's slice of a layer's GPTQ tensors, and that slice
repacked into torch's int4 kernel format (`weights.QuantizedWeight`), never dequantized whole.

What GPTQ writers (GPTQModel, AutoGPTQ, transformers + optimum) store for a linear layer of `in` inputs and `out`
outputs, 4 bits, groups of G consecutive inputs (nn.Linear's weight is (out, in); GPTQ's tensors are input-major):

    qweight int32 (in/8, out)     q[i, o] = (qweight[i // 8, o] >> 4 (i % 8)) & 15   (8 inputs per word)
    qzeros  int32 (in/G, out/8)   z[g, o] = (qzeros[g, o // 8] >> 4 (o % 8)) & 15   (8 outputs per word)
    scales  fp16  (in/G, out)
    g_idx   int32 (in,)           the group of each input: i // G, unless act order (desc_act) scattered them
    W[o, i] = scales[g, o] * (q[i, o] - zero[g, o]),  g = g_idx[i]

The zero: checkpoint_format "gptq_v2" stores it; "gptq" (v1, also what a config without the field means: AutoGPTQ)
stores zero - 1, written by subtracting 0x11111111 from each whole word, so it is read back by adding 0x11111111 to
the word (int32, wrapping) before unpacking. Adding 1 per nibble instead is wrong wherever a zero is 0 (an
asymmetric group of all-positive weights): the writer's subtract borrowed from the next output's nibble.

torch's int4 kernel computes W = (q - 8) * S + Z per group, so the repacked weight keeps GPTQ's q and takes
S = scales, Z = scales * (8 - zero). Held in float32 both are exact (an fp16 scale times a 4-bit integer) and the
kernel's W is GPTQ's exactly; in float16 Z is rounded to float16 (at most half an fp16 ulp of |Z| <= 8 scales), in
bfloat16 (CUDA's kernel) S and Z are rounded to bfloat16.

A rank reads only its slice (`GptqSlice.of`): column-parallel, its output columns of qweight and scales, the words
of qzeros that hold its outputs (a range that starts or ends inside a word reads that word and drops the other
outputs' nibbles) and all of g_idx; row-parallel, its inputs, in whole groups (the layout refuses a tp that would
split one): qweight rows a/8:b/8, scales and qzeros rows a/G:b/G, g_idx a:b.

Act order (desc_act) is refused, before loading by the config's flag and while reading by any g_idx that is not
i // G: torch's kernel takes groups of consecutive inputs, and act order scatters each group's inputs over the
whole row, so a row-parallel rank's inputs hold parts of nearly every group. Running it would need a gather of
every layer's activations and, on a row-parallel rank, each partial group padded to whole kernel groups (about
twice the bytes at tp 4). GPTQModel's own default is desc_act=False with act_group_aware (which reorders the groups'
quantization, not the stored inputs), and desc_act with static_groups stores g_idx = i // G: both load.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from autotp.errors import AutotpError
from autotp.parallel.slices import REPLICATED, Range, TensorShard
from autotp.quant.weights import INT4_GROUPS, Quant, QuantizedWeight, pack_int4

VERSIONS = {"gptq": 1, "gptq_v2": 2}  # checkpoint_format -> how qzeros store the zero (see the module docstring)
V1_OFFSET = 0x11111111  # the 1 a v1 writer subtracted from every 4-bit zero of a word, as one word
UNPACK_BYTES = 1 << 20  # qweight bytes unpacked at a time: the int32 transient of a block stays this size


@dataclass(frozen=True)
class GptqFormat:
    """A GPTQ checkpoint's quantization, as autotp runs it: 4 bits, groups of `group_size` inputs."""

    group_size: int
    version: int  # 1: qzeros store zero - 1; 2: the zero
    sym: bool  # informative only: the zeros are read either way

    @property
    def quant(self) -> Quant:
        """The int4 weights it becomes, in torch's kernel format."""
        return Quant("int4", self.group_size)

    @staticmethod
    def of(config, directory: Path | None = None) -> GptqFormat | None:
        """The GPTQ format of a model from its config's `quantization_config` (or, for older AutoGPTQ
        checkpoints, `quantize_config.json` in `directory`); None for a model that is not quantized. Anything
        autotp cannot run is refused in one line here, before any weight is read."""
        fields = getattr(config, "quantization_config", None)
        where = "config.json's quantization_config"
        if fields is None and directory is not None and (directory / "quantize_config.json").exists():
            where = str(directory / "quantize_config.json")
            try:
                fields = json.loads((directory / "quantize_config.json").read_text())
            except ValueError as e:
                raise AutotpError(f"cannot read {where}: {e}") from None
            fields = {"quant_method": "gptq"} | (fields if isinstance(fields, dict) else {"bits": fields})
        if fields is None:
            return None
        if not isinstance(fields, dict):
            fields = fields.to_dict() if hasattr(fields, "to_dict") else {"quant_method": str(fields)}
        method = fields.get("quant_method")
        if method != "gptq":
            raise AutotpError(f"{where} says quant_method {method!r}: autotp loads GPTQ checkpoints and "
                              "unquantized ones")
        return _checked(fields, where)


def _checked(fields: dict, where: str) -> GptqFormat:
    bits, group = fields.get("bits"), fields.get("group_size")
    if bits != 4:
        raise AutotpError(f"{where} has {bits}-bit GPTQ weights: autotp runs 4-bit GPTQ only (torch's int4 kernel)")
    if group not in INT4_GROUPS:
        raise AutotpError(f"{where} has GPTQ group_size {group}: torch's int4 kernel takes groups of "
                          f"{', '.join(map(str, INT4_GROUPS))} input features")
    fmt = fields.get("checkpoint_format", "gptq")
    if fmt not in VERSIONS:
        raise AutotpError(f"{where} has GPTQ checkpoint_format {fmt!r}: autotp reads "
                          f"{' and '.join(map(repr, VERSIONS))}")
    if fields.get("pack_dtype", "int32") != "int32":
        raise AutotpError(f"{where} packs GPTQ weights in {fields['pack_dtype']}: autotp reads int32 packing only")
    if fields.get("lm_head"):
        raise AutotpError(f"{where} has a GPTQ-quantized lm_head: autotp keeps the output head in the model dtype")
    if fields.get("dynamic"):
        raise AutotpError(f"{where} has per-module GPTQ overrides (dynamic): autotp runs one bits/group size for "
                          "every layer")
    static = fields.get("static_groups", (fields.get("meta") or {}).get("static_groups", False))
    if fields.get("desc_act") and not static:
        raise AutotpError(f"{where} has desc_act (act order): its groups are scattered over each row's inputs, and "
                          "torch's int4 kernel takes groups of consecutive inputs; quantize with desc_act=False "
                          "(GPTQModel's default, with act_group_aware) or static_groups=True")
    return GptqFormat(group, VERSIONS[fmt], bool(fields.get("sym", True)))


@dataclass(frozen=True)
class GptqKeys:
    """The checkpoint tensors of one GPTQ layer, `prefix` + qweight, qzeros, scales, g_idx."""

    prefix: str  # e.g. "model.layers.0.mlp.down_proj."

    @staticmethod
    def of_weight(name: str) -> GptqKeys:
        """The GPTQ tensors that stand for the weight `name` ("...down_proj.weight")."""
        return GptqKeys(name.removesuffix("weight"))

    @property
    def qweight(self) -> str:
        return self.prefix + "qweight"

    @property
    def qzeros(self) -> str:
        return self.prefix + "qzeros"

    @property
    def scales(self) -> str:
        return self.prefix + "scales"

    @property
    def g_idx(self) -> str:
        return self.prefix + "g_idx"

    def all(self) -> tuple[str, str, str, str]:
        return self.qweight, self.qzeros, self.scales, self.g_idx

    def shapes(self, out_features: int, in_features: int, group: int) -> dict[str, tuple[int, ...]]:
        """Each tensor's global shape for an (out, in) weight: what the checkpoint must hold."""
        groups = math.ceil(in_features / group)
        return {self.qweight: (in_features // 8, out_features), self.qzeros: (groups, math.ceil(out_features / 8)),
                self.scales: (groups, out_features), self.g_idx: (in_features,)}


@dataclass(frozen=True)
class GptqRead:
    """One GPTQ tensor's part that a rank reads."""

    key: str
    shape: tuple[int, ...]  # global
    dtype: torch.dtype  # as stored (scales: float16, the rest int32)
    shard: TensorShard

    def nbytes(self) -> int:
        return math.prod(self.shard.local_shape(self.shape)) * self.dtype.itemsize


@dataclass(frozen=True)
class GptqSlice:
    """What one rank reads of one GPTQ layer and the part of the (out, in) weight it makes."""

    outputs: tuple[Range, ...]  # the rank's output features, in the order it holds them
    inputs: Range  # its input features
    group: int
    version: int
    reads: tuple[GptqRead, GptqRead, GptqRead, GptqRead]  # qweight, qzeros, scales, g_idx

    @staticmethod
    def of(keys: GptqKeys, out_features: int, in_features: int, fmt: GptqFormat, shard: TensorShard,
           out_dim: int, scales_dtype: torch.dtype = torch.float16) -> GptqSlice:
        """The slice a rank holding `shard` of the stored weight reads; `out_dim`: the weight dim that holds the
        outputs (0 for nn.Linear, 1 for Conv1D, whose GPTQ tensors are the same shape as a Linear's);
        `scales_dtype` as the checkpoint stores them (GPTQ writers: float16)."""
        outputs: tuple[Range, ...] = ((0, out_features),)
        inputs: Range = (0, in_features)
        if shard.dim == out_dim:
            outputs = shard.ranges
        elif shard.dim is not None:
            (inputs,) = shard.ranges
        g = fmt.group_size
        a, b = inputs
        if (a, b) == (0, in_features):  # every input: columns of each tensor, g_idx whole
            parts = (TensorShard.along(1, list(outputs)),
                     TensorShard.along(1, [(lo // 8, math.ceil(hi / 8)) for lo, hi in outputs]),
                     TensorShard.along(1, list(outputs)), REPLICATED)
        else:  # input rows, whole groups (layout._check_quantizable) and so whole words of 8 inputs
            parts = (TensorShard.along(0, [(a // 8, b // 8)]), TensorShard.along(0, [(a // g, b // g)]),
                     TensorShard.along(0, [(a // g, b // g)]), TensorShard.along(0, [(a, b)]))
        shapes = keys.shapes(out_features, in_features, g)
        dtypes = (torch.int32, torch.int32, scales_dtype, torch.int32)
        reads = tuple(GptqRead(k, shapes[k], dt, s) for k, dt, s in zip(keys.all(), dtypes, parts, strict=True))
        return GptqSlice(tuple(outputs), inputs, g, fmt.version, reads)

    @property
    def out_features(self) -> int:
        return sum(b - a for a, b in self.outputs)

    @property
    def in_features(self) -> int:
        return self.inputs[1] - self.inputs[0]


def unpack_zeros(words: torch.Tensor, version: int) -> torch.Tensor:
    """qzeros words int32 (groups, w) -> the zeros int64 (groups, 8 w), output 8 j + n in bits 4n..4n+3 of word j.
    v1: the word plus 0x11111111, wrapping at 32 bits (the writer subtracted it from the word)."""
    w = words.long() & 0xFFFFFFFF
    if version == 1:
        w = (w + V1_OFFSET) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4)
    return ((w.unsqueeze(-1) >> shifts) & 15).reshape(words.shape[0], -1)


def load_slice(checkpoint, piece: GptqSlice, dtype: torch.dtype, device: torch.device) -> QuantizedWeight:
    """The rank's GPTQ slice read from `checkpoint` (an `autotp.loading.checkpoint.Checkpoint`) and repacked for
    the device's int4 kernel, its scales and zeros in `dtype`; only the slice's tensors are ever unpacked."""
    qweight, qzeros, scales, g_idx = piece.reads
    a, b = piece.inputs
    held = checkpoint.read(g_idx.key, g_idx.shard, None).long()
    held = held[a:b] if g_idx.shard.replicated else held
    expected = torch.arange(a, b) // piece.group
    if not torch.equal(held, expected):
        i = int((held != expected).nonzero()[0, 0]) + a
        raise AutotpError(f"{g_idx.key} puts input {i} in group {int(held[i - a])}, not {i} // {piece.group} = "
                          f"{i // piece.group}: act order (desc_act) scatters GPTQ groups, which torch's int4 kernel "
                          "cannot run")
    s = checkpoint.read(scales.key, scales.shard, torch.float32)  # (groups, out): fp16 values, exact in float32
    zeros = _zeros(checkpoint.read(qzeros.key, qzeros.shard, None), piece, qzeros.shard)
    q = torch.empty(piece.out_features, piece.in_features, dtype=torch.uint8)
    rows = max(1, UNPACK_BYTES // (4 * piece.out_features))
    for start, block in checkpoint.row_blocks(qweight.key, qweight.shard, None, rows):  # (rows, out) int32
        for n in range(8):  # input 8 r + n of word row r: bits 4n..4n+3
            q[:, 8 * start + n:8 * (start + block.shape[0]):8] = ((block >> (4 * n)) & 15).to(torch.uint8).t()
    scales_and_zeros = torch.stack([s, s * (8 - zeros)], -1).to(dtype)  # (groups, out, 2): S, Z as the kernel takes
    return QuantizedWeight(Quant("int4", piece.group), piece.out_features, piece.in_features, pack_int4(q, device),
                           scales_and_zeros.to(device))


def _zeros(words: torch.Tensor, piece: GptqSlice, shard: TensorShard) -> torch.Tensor:
    """The zeros (groups, out) of the rank's outputs from the qzeros words it read: for each output range, the
    words that hold it, concatenated in order, minus the nibbles of outputs before or after it in those words."""
    unpacked = unpack_zeros(words, piece.version)
    if shard.dim == 0:  # input rows: every output
        return unpacked[:, :piece.out_features]
    parts, word = [], 0
    for (lo, hi), (w0, w1) in zip(piece.outputs, shard.ranges, strict=True):
        parts.append(unpacked[:, 8 * word + lo - 8 * w0:8 * word + hi - 8 * w0])
        word += w1 - w0
    return torch.cat(parts, 1)
