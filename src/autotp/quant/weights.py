"""Weight-only int8 and int4 quantization of linear layers: the arithmetic and the module that runs it.

int8: symmetric, one scale per output channel: s = max|w[o, :]| / 127, q = round(w / s) in [-127, 127].
int4: asymmetric groups of `group_size` input features per output channel (the format of torch's int4
      kernels, as gpt-fast uses them): s = (max - min) / 15, q = round((w - min) / s) in [0, 15], so
      w ~= q * s + min; the kernel takes (s, zero) with zero = min + 8 s.
Scales and zeros are kept in the model dtype; activations stay in it too (weight-only).

Tensor parallelism stays exact: a rank's quantized slice is the same slice of the unsharded quantized
weight, bit for bit. Output rows (column-parallel) carry their own scales; for input columns
(row-parallel), int4 groups never straddle two ranks (`layout` refuses a tp that would split one) and
int8's per-row maximum is all-reduced (MAX) over the ranks while loading (`quant_load`).

Kernels (`QuantizedWeight.linear`): on CPU `torch._weight_int8pack_mm` and
`torch._weight_int4pack_mm_for_cpu`; on CUDA int8 as gpt-fast does it (the int8 weight cast in the matmul,
the scale after) and `torch._weight_int4pack_mm` (bfloat16, compute capability >= 8.0). int8 inputs of many
rows (prefill, big batches) dequantize instead, where the CPU kernel is slower than the model dtype's matmul.
int4 packs with torch >= 2.5's layout (uint8 pairs on CUDA, the `_for_cpu` ops on CPU): older torch is
refused before loading.

int8 on CUDA in eager mode therefore writes the layer's whole weight in the model dtype on every call (gpt-fast
meant it for torch.compile, where inductor fuses the cast into the matmul): expect it slower than bf16 there,
and smaller. torch 2.13 does have a CUDA `_weight_int8pack_mm`, but it is a one-thread-per-output float32 loop
over the input features (aten/src/ATen/native/cuda/int8mm.cu: at one decode row 15 of each block's 16 thread
rows idle), and `torch._int_mm` needs more than 16 input rows and quantizes the activations, so neither is used
unmeasured. No GPU has run either path yet.
"""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autotp.errors import AutotpError

KINDS = ("int8", "int4")
INT4_GROUPS = (32, 64, 128, 256)  # the group sizes torch's int4 kernels take
INT4_GROUP = 128  # input features per int4 group: StarCoder's dims and every even split of them at tp <= 4
# int8 on CPU: from this many input rows on, dequantizing and calling F.linear beats torch._weight_int8pack_mm.
# benchmarks/quant_kernels.py, StarCoder-1b/15b layer shapes, 1 thread: the kernel wins at 8-48 rows on most
# shapes (dequantizing takes 1.0-10x its time at 8 and 16 rows), dequantizing wins at 64 (0.48-0.94x) and 512
# (0.33-0.46x). Either is slower than bf16 from 16 rows on.
INT8_DEQUANT_ROWS = 64
INT4_TORCH = "2.5"  # the int4 packing this module does: uint8 pairs on CUDA, the _for_cpu ops on CPU
INT4_CAPABILITY = "8.0"  # torch's CUDA int4 kernel (tensor-core mma of Ampere and later)


def torch_release(version: str) -> tuple[int, int]:
    """"2.4.1+cu121" -> (2, 4), "8.0" -> (8, 0); a pre-release ("2.5.0a0+git...") counts as its release."""
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


@dataclass(frozen=True)
class Quant:
    kind: str  # "int8" or "int4"
    group_size: int = INT4_GROUP  # int4 only

    @staticmethod
    def parse(kind: str | None, group_size: int = INT4_GROUP) -> Quant | None:
        """`quantize=` and `group_size=` as the entry points take them, checked: types first (32.0 would
        pass `in INT4_GROUPS` and fail deep in the loader; True is an int to Python), then values."""
        if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral):
            raise AutotpError(f"group_size must be an int, got {type(group_size).__name__} {group_size!r}")
        if kind is None:
            return None
        if not isinstance(kind, str) or kind not in KINDS:
            raise AutotpError(f"unknown quantization {kind!r}: choose one of {', '.join(KINDS)}")
        group_size = int(group_size)
        if kind == "int4" and group_size not in INT4_GROUPS:
            raise AutotpError(f"int4 group size {group_size} is not one torch's int4 kernel takes: "
                              f"{', '.join(map(str, INT4_GROUPS))}")
        return Quant(kind, group_size)

    def nbytes(self, out_features: int, in_features: int, dtype: torch.dtype) -> int:
        """Bytes of a quantized (out, in) weight with its scales (and zeros) in `dtype`."""
        if self.kind == "int8":
            return out_features * in_features + out_features * dtype.itemsize
        return out_features * in_features // 2 + 2 * (in_features // self.group_size) * out_features * dtype.itemsize


def int8_scales(row_max: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(out,) max |w| of each output channel -> its scale, in `dtype` (an all-zero row gets scale 1)."""
    scales = (row_max.float() / 127).to(dtype)
    return torch.where(scales == 0, torch.ones_like(scales), scales)


def quantize_int8(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """w (rows, in) of the output channels whose `scales` (rows,) are given -> int8 (rows, in)."""
    return torch.round(w.float() / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)


def quantize_int4(w: torch.Tensor, group_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """w (rows, in) -> (q uint8 (rows, in) in [0, 15], scales_and_zeros (in / group, rows, 2) in `dtype`).

    The kernel computes (q - 8) * scale + zero with scale and zero as stored (rounded to `dtype`), so q is
    taken against those rounded values: w ~= (q - 8) * s + z, z ~= min + 8 s."""
    rows, inp = w.shape
    groups = w.float().reshape(rows, inp // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = ((high - low) / 15).to(dtype).float()
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    zeros = (low + 8 * scales).to(dtype).float()
    q = (torch.round((groups - zeros[..., None]) / scales[..., None]) + 8).clamp(0, 15).to(torch.uint8)
    return q.reshape(rows, inp), torch.stack([scales, zeros], -1).transpose(0, 1).to(dtype).contiguous()


def pack_int4(q: torch.Tensor, device: torch.device) -> torch.Tensor:
    """q uint8 (out, in) in [0, 15] -> the weight as the device's int4 kernel takes it, on the device.

    CPU: torch packs 64 output rows at a time (a (in, 32) byte block each), so packing in chunks of 64
    rows gives the same bytes as packing the whole, with an int32 transient of 64 rows only. CUDA: two
    4-bit values per byte, made here, then torch's tiled layout (inner k tiles 8) on the device."""
    if device.type == "cpu":
        return torch.cat([torch._convert_weight_to_int4pack_for_cpu(q[r:r + 64].to(torch.int32), 1)
                          for r in range(0, q.shape[0], 64)])
    pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(device)
    return torch._convert_weight_to_int4pack(pairs, 8)


def kernel_fits(kind: str, out_features: int, in_features: int, group_size: int, dtype: torch.dtype,
                device_type: str = "cpu") -> str | None:
    """Why the device's kernel cannot take this weight shape (None when it can). On CPU, found by probing
    torch 2.13: int4 packing wants out % 16 and in % 32 (and 16 x 32 itself fails); int8 with bfloat16
    inputs crashes the process for in % 8 != 0, so that is refused before any call. CUDA's int4 layout
    (inner k tiles 8) wants in % 128 and out % 8, as gpt-fast checks."""
    if kind == "int8":
        if device_type == "cpu" and dtype == torch.bfloat16 and in_features % 8:
            return f"{in_features} input features are not a multiple of 8 (the bfloat16 int8 kernel's)"
        return None
    if in_features % group_size:
        return f"{in_features} input features do not form whole groups of {group_size}"
    if device_type == "cuda":
        if in_features % 128 or out_features % 8:
            return f"({out_features}, {in_features}) is not a weight CUDA's int4 kernel packs (out % 8, in % 128)"
        return None
    if out_features % 16 or in_features % 32 or out_features * in_features <= 512:
        return (f"({out_features}, {in_features}) is not a weight torch's CPU int4 kernel packs "
                "(out % 16 and in % 32 must be 0)")
    return None


def check_kernel(kind: str, device_type: str, dtype: torch.dtype, what: str | None = None) -> None:
    """A clear error, before loading, for a device and dtype with no kernel: a silent dequantized model
    would be slower than the unquantized one and hold both. `what` names what asks for the kernel (default:
    `--quantize KIND`)."""
    what = what or f"--quantize {kind}"
    if device_type not in ("cpu", "cuda"):
        raise AutotpError(f"{what} has kernels for cpu and cuda, not {device_type}")
    if kind == "int4" and torch_release(torch.__version__) < torch_release(INT4_TORCH):
        raise AutotpError(f"{what} needs torch >= {INT4_TORCH} (its int4 packing ops), this is torch "
                          f"{torch.__version__}: upgrade torch, or use --quantize int8")
    if device_type == "cpu" or kind != "int4":
        return
    if dtype != torch.bfloat16:
        raise AutotpError(f"{what} on CUDA needs --dtype bfloat16 (torch's int4 kernel), got "
                          f"{str(dtype).removeprefix('torch.')}")
    if torch.cuda.is_available():  # `autotp plan --device cuda` may run where there is no GPU
        capability = torch.cuda.get_device_capability()
        if capability < torch_release(INT4_CAPABILITY):
            raise AutotpError(f"{what} on CUDA needs a GPU of compute capability {INT4_CAPABILITY} or newer (torch's "
                              f"int4 kernel); {torch.cuda.get_device_name()} is {capability[0]}.{capability[1]}: "
                              "use --quantize int8")


class QuantizedWeight(nn.Module):
    """A linear layer's quantized weight, (out, in) whatever the checkpoint stored; `linear(x)` = x @ W.T.

    int8: qweight int8 (out, in), scales (out,). int4: qweight as the kernel packs it, scales_and_zeros
    (in / group, out, 2). Buffers, not parameters: nothing here is trained, and `named_parameters` of a
    sharded model keeps listing only what the layout knows.
    """

    def __init__(self, quant: Quant, out_features: int, in_features: int, qweight: torch.Tensor,
                 scales: torch.Tensor):
        super().__init__()
        self.quant, self.out_features, self.in_features = quant, out_features, in_features
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) in the model dtype -> (..., out)."""
        lead, x2 = x.shape[:-1], x.reshape(-1, x.shape[-1])
        if self.quant.kind == "int8":
            if x.device.type != "cpu" or x2.shape[0] >= INT8_DEQUANT_ROWS:
                y = F.linear(x2, self.qweight.to(x.dtype)) * self.scales
            else:
                y = torch._weight_int8pack_mm(x2.contiguous(), self.qweight, self.scales)
        elif x.device.type == "cpu":
            y = torch._weight_int4pack_mm_for_cpu(x2.contiguous(), self.qweight, self.quant.group_size, self.scales)
        else:
            y = torch._weight_int4pack_mm(x2.contiguous(), self.qweight, self.quant.group_size, self.scales)
        return y.reshape(*lead, self.out_features)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales))

    def extra_repr(self) -> str:
        group = f", group_size={self.quant.group_size}" if self.quant.kind == "int4" else ""
        return f"{self.quant.kind}, out={self.out_features}, in={self.in_features}{group}"
