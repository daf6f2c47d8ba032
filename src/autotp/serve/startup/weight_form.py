"""The form a CPU reads the weights fastest in, chosen at start-up and said in one line each.

- dtype: a float32 checkpoint is held in bfloat16 where the CPU multiplies bfloat16 natively (AVX512_BF16 or AMX:
  half the bytes per decode step at full speed); elsewhere it stays float32, because without those instructions
  the bfloat16 products convert in software, and float32 keeps the checkpoint's numbers. Quantized (`--quantize
  int8/int4`) on CPU, it is bfloat16 (the scales and activations) on any CPU: torch's CPU int8 and int4 kernels
  take float32 activations through a slow path (a SmolLM2 decode step's products, 2 cores, AVX2, gemv_bench.py:
  int8 95.7 ms and int4 143.6 ms with float32 activations, 20.8 and 12.6 ms with bfloat16; float32 weights
  through gemv.c 39.3 ms).
  `--dtype` decides instead where given; a bfloat16 or float16 checkpoint stays as stored.
- kernel: float32 and bfloat16 products of a few rows go through gemv.c (parallel/gemv.py) unless AUTOTP_GEMV=0;
  bfloat16 only where the CPU has AVX512_BF16's dot product (gemv.c's loop for it is built only there).
"""

from __future__ import annotations

import os

import torch

from autotp.parallel import gemv


def native_bf16() -> str | None:
    """The instructions this CPU multiplies bfloat16 with, or None (torch's own probes; absent before torch 2.3)."""
    probes = (("AMX", "_is_amx_tile_supported"), ("AVX512_BF16", "_is_avx512_bf16_supported"))
    return next((name for name, probe in probes if getattr(torch.cpu, probe, lambda: False)()), None)


def choose_dtype(asked: str | None, stored: torch.dtype | None, device: torch.device,
                 quantize: str | None = None) -> tuple[str | None, str]:
    """(the dtype to load, None for as stored; what the start-up line says of it)."""
    if asked is not None:
        slow = device.type == "cpu" and quantize and asked == "float32"
        return asked, f"{asked} (--dtype)" + (f"; {quantize} weights with float32 activations take torch's slow CPU "
                                               "path, --dtype bfloat16 is 4-11x faster" if slow else "")
    name = str(stored or torch.float32).removeprefix("torch.")
    if device.type != "cpu" or stored not in (None, torch.float32):
        return None, f"{name} as stored"
    if quantize:
        return "bfloat16", f"bfloat16 scales and activations for the {quantize} weights (torch's CPU {quantize} " \
                           "kernel takes float32 activations 4-11x slower)"
    native = native_bf16()
    if native:
        return "bfloat16", f"bfloat16 from the float32 checkpoint (this CPU multiplies bfloat16 natively: {native}; " \
                           f"--dtype float32 keeps float32)"
    return None, "float32 as stored (this CPU has no native bfloat16 products: no AVX512_BF16 or AMX)"


def kernels(net, device: torch.device) -> str | None:
    """float32 or bfloat16 weights on CPU: few-row products through gemv.c unless AUTOTP_GEMV=0; what the start-up
    line says (None where there is nothing to choose)."""
    dtype = next(net.parameters()).dtype
    rows = gemv.LIMITS.get(dtype)
    if device.type != "cpu" or rows is None:
        return None
    why = "AUTOTP_GEMV=0" if os.environ.get("AUTOTP_GEMV", "1") == "0" else gemv.enable()
    if why is None and not gemv.takes(dtype):
        why = "this CPU has no AVX512_BF16 dot product"
    name = str(dtype).removeprefix("torch.")
    return f"{name} products of up to {rows} rows: {f'torch F.linear ({why})' if why else 'gemv.c'}"
