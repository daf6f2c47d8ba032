"""float32 linear layers of a few rows on CPU through gemv.c, where torch's kernels read weights at a third of
the memory's speed; everything else through F.linear.

A decode step reads every weight once for one or a few rows: its cost is the bytes read. On the 2-core AMD EPYC
this was measured on (benchmarks/gemv_bench.py, RESULTS.md), a SmolLM2 decode step's 210 float32 layer products,
each weight read cold, took 70.4 ms through F.linear (6.0 GB/s, where a plain read ran at 20.8 GB/s) and 39.3 ms
through gemv.c (10.8 GB/s), its 113 MB LM head 19.7 ms against 8.5. F.linear is slower still at 2-16 rows
(92-116 ms), where gemv.c reads each weight row once for four rows of x: 2.6x faster at 4 rows, 1.3x at 16, 0.8x
at 32. Past ROWS rows (prefill chunks) F.linear: MKL's blocked GEMM, compute-bound there.

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
FLAGS = ("-O3", "-march=native", "-fopenmp")  # OpenMP: torch's own libgomp.so.1, already loaded, runs it

_kernel = None
_on = False  # a plain bool for the hot check (and for torch.compile's guards)


def enable() -> str | None:
    """Builds and loads gemv.c once per process; None when the kernel is on, else why it is not."""
    global _kernel, _on
    if _kernel is None:
        try:
            lib = ctypes.CDLL(str(native.build(Path(__file__).with_name("gemv.c"), FLAGS)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            return f"{type(e).__name__}: {e}"
        f = lib.autotp_gemv_f32
        f.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
        f.restype = None
        _kernel = f
    _on = True
    return None


def _run(x2: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x2 (m, k) contiguous, m <= ROWS -> (m, n); more rows go to F.linear."""
    m, k = x2.shape
    if m > ROWS:
        return F.linear(x2, w, b)
    n = w.shape[0]
    y = torch.empty((m, n), dtype=x2.dtype)
    _kernel(x2.data_ptr(), w.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(), m, k, n,
            torch.get_num_threads())
    return y


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, b), through gemv.c where it is on and takes the product."""
    if not (_on and x.device.type == "cpu" and x.dtype == w.dtype == torch.float32 and w.dim() == 2
            and w.is_contiguous() and (b is None or b.is_contiguous() and b.dtype == torch.float32)
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
