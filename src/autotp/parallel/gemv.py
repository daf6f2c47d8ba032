"""float32 and bfloat16 linear layers of a few rows on CPU through gemv.c, where torch's kernels read weights at a
third to a half of the memory's speed; everything else through F.linear.

A decode step reads every weight once for one or a few rows: its cost is the bytes read. On the 2-core AMD EPYC
this was measured on (benchmarks/gemv_bench.py, RESULTS.md), a SmolLM2 decode step's 210 float32 layer products,
each weight read cold, took 70.4 ms through F.linear (6.0 GB/s, where a plain read ran at 20.8 GB/s) and 39.3 ms
through gemv.c (10.8 GB/s), its 113 MB LM head 19.7 ms against 8.5. F.linear is slower still at 2-16 rows
(92-116 ms), where gemv.c reads each weight row once for four rows of x: 2.6x faster at 4 rows, 1.3x at 16, 0.8x
at 32. Past ROWS rows (prefill chunks) F.linear: MKL's blocked GEMM, compute-bound there.

bfloat16 (a float32 checkpoint held in bfloat16 where the CPU multiplies it natively, serve/startup/weight_form.py),
where the CPU has AVX512_BF16: on the 2-core Xeon with AMX this was measured on, torch's bfloat16 F.linear
(oneDNN) read a decode step's weights at 10.3 GB/s whether for 1 row or 32 (a plain read: 25.7 GB/s); gemv.c's
bfloat16 loop took the step's 210 products of one row in 12.2 against 20.6 ms (17.5 GB/s), 18.0 against 20.5 at 8
rows (ROWS_BF16), and the LM head in 1.1 against 2.8 ms. The float32 loop does not pay on that Xeon (0.70x at one
row: MKL reads float32 at 26.6 GB/s there), which serve holds in bfloat16 anyway.

Off until `enable()`: `autotp serve` enables it on CPU, and a library user keeps F.linear's bits (the tests
compare column slices with the unsharded model's bit for bit). Results equal F.linear's within float32 rounding
(another summation order, as an all-reduce's). Inside a compiled graph the kernel is the custom op
`autotp::gemv`, so torch.compile keeps it; without a C compiler `enable()` returns why and F.linear stays.
"""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F

from autotp.parallel import native

ROWS = 16  # the kernel takes products of at most this many rows of x (gemv_bench.py: 1.3x F.linear at 16, 0.8x at 32)
ROWS_BF16 = 8  # bfloat16: 1.14x F.linear at 8 rows, its margin shrinking with each row (gemv_bench.py, Xeon AMX)
LIMITS = {torch.float32: ROWS, torch.bfloat16: ROWS_BF16}  # dtype -> the most rows of x its loop takes
FLAGS = ("-O3", "-march=native", "-fopenmp")  # OpenMP: torch's own libgomp.so.1, already loaded, runs it

_kernels: dict = {}  # dtype -> its C function, once built (bfloat16: only where the CPU has AVX512_BF16)
_on = False  # a plain bool for the hot check (and for torch.compile's guards)


def enable() -> str | None:
    """Builds and loads gemv.c once per process; None when the kernel is on, else why it is not."""
    global _on
    if not _kernels:
        try:
            lib = ctypes.CDLL(str(native.build(Path(__file__).with_name("gemv.c"), FLAGS)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            return f"{type(e).__name__}: {e}"
        for dtype, name in ((torch.float32, "autotp_gemv_f32"), (torch.bfloat16, "autotp_gemv_bf16")):
            if hasattr(lib, name):  # the bfloat16 loop is built only where the CPU has AVX512_BF16
                f = getattr(lib, name)
                f.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
                f.restype = None
                _kernels[dtype] = f
    _on = True
    return None


def takes(dtype: torch.dtype) -> bool:
    """Whether the kernel, once enabled, has a loop for `dtype` (bfloat16: only where the CPU has AVX512_BF16)."""
    return dtype in _kernels


def _run(x2: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x2 (m, k) contiguous, m at most the dtype's rows -> (m, n); more rows go to F.linear."""
    m, k = x2.shape
    if m > LIMITS[x2.dtype]:
        return F.linear(x2, w, b)
    n = w.shape[0]
    y = torch.empty((m, n), dtype=x2.dtype)
    _kernels[x2.dtype](x2.data_ptr(), w.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(), m, k, n,
           torch.get_num_threads())
    return y


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, b), through gemv.c where it is on and takes the product."""
    if not (_on and x.device.type == "cpu" and x.dtype == w.dtype and x.dtype in _kernels and w.dim() == 2
            and w.is_contiguous() and (b is None or b.is_contiguous() and b.dtype == x.dtype)
            and not (torch.is_grad_enabled() and w.requires_grad)):
        return F.linear(x, w, b)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = _gemv_op(x2, w, b) if torch.compiler.is_compiling() else _run(x2, w, b)
    return y.view(*x.shape[:-1], w.shape[0])


# In a compiled graph: one opaque op whose rows are known only when it runs (the decode graph's rows are dynamic).
@torch.library.custom_op("autotp::gemv", mutates_args=())
def _gemv_op(x2: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return _run(x2.contiguous(), w, b)


@_gemv_op.register_fake
def _(x2: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return x2.new_empty((x2.shape[0], w.shape[0]))
