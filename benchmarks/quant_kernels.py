"""CPU kernels for one StarCoder linear layer, one thread: bf16 F.linear vs weight-only int8 and int4.

Per weight shape (out, in) and input rows M, the median ms of:
- bf16:          F.linear(x, w)
- int8 kernel:   torch._weight_int8pack_mm(x, q8, scales)            (what autotp runs for M < INT8_DEQUANT_ROWS)
- int8 dequant:  F.linear(x, q8.to(bf16)) * scales                   (what autotp runs from INT8_DEQUANT_ROWS on)
- int4 kernel:   torch._weight_int4pack_mm_for_cpu(x, packed, 128, scales_and_zeros)   (autotp's only int4 path)
- int8 blocked:  (--paths only) as int8 dequant, one block of output rows at a time (~1 MiB of bf16 each)
- int4 dequant:  unpack the CPU packed bytes to q, (q - 8) * s + zero in bf16, F.linear; not in autotp, measured
                 here to see what such a path would buy at many rows (checked to unpack q exactly).

Weights are random N(0, 0.02) bf16, quantized with autotp.quant.weights's own functions. Prints the table and the
crossovers, writes benchmarks/results/quant_kernels.json.

    python benchmarks/quant_kernels.py [--shapes 1b 15b] [--rows 1 2 4 8 16 64 512]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import write_json

from autotp.quant.weights import (
    INT4_GROUP,
    INT8_DEQUANT_ROWS,
    Quant,
    QuantizedWeight,
    int8_scales,
    quantize_int4,
    quantize_int8,
)

HERE = Path(__file__).parent
# (name, out_features, in_features); Linear.weight is (out_features, in_features)
SHAPES = {
    "1b": [("attn.c_proj", 2048, 2048), ("attn.c_attn", 2048 + 2 * 128, 2048),
           ("mlp.c_fc", 8192, 2048), ("mlp.c_proj", 2048, 8192)],
    "15b": [("attn.c_proj", 6144, 6144), ("attn.c_attn", 6144 + 2 * 128, 6144),
            ("mlp.c_fc", 24576, 6144), ("mlp.c_proj", 6144, 24576)],
}
PATHS = ("bf16", "int8_kernel", "int8_dequant", "int4_kernel", "int4_dequant", "int8_blocked")
BLOCK_BYTES = 1 << 20  # int8_blocked: bf16 bytes of one dequantized block of output rows (stays in cache)
REPS, BUDGET_S = 7, 1.5  # up to REPS timed calls after a warm-up, fewer (at least 3) once BUDGET_S is spent


def unpack_int4(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """torch's CPU int4 packing -> q uint8 (out, in): per block of 64 output rows a (in, 32) byte array,
    byte[k, j] = q[64 b + j, k] | q[64 b + 32 + j, k] << 4."""
    blocks = packed.view(out_features // 64, in_features, 32)
    return torch.cat([blocks & 15, blocks >> 4], 2).transpose(1, 2).reshape(out_features, in_features)


def int4_dequant_linear(x, packed, scales_and_zeros, out_features, in_features, group):
    q = unpack_int4(packed, out_features, in_features).view(out_features, in_features // group, group)
    sz = scales_and_zeros.transpose(0, 1)  # (out, groups, 2)
    w = (q.to(x.dtype) - 8) * sz[..., :1] + sz[..., 1:]
    return F.linear(x, w.view(out_features, in_features))


def int8_blocked_linear(x, q8, scales):
    """F.linear on BLOCK_BYTES-sized blocks of output rows, each dequantized just before its matmul."""
    step = max(16, BLOCK_BYTES // (2 * q8.shape[1]))
    y = x.new_empty(x.shape[0], q8.shape[0])
    for a in range(0, q8.shape[0], step):
        torch.mm(x, q8[a:a + step].to(x.dtype).t(), out=y[:, a:a + step])
    return y * scales


def median_ms(fn) -> float:
    fn()
    times, start = [], time.perf_counter()
    while len(times) < REPS and (len(times) < 3 or time.perf_counter() - start < BUDGET_S):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def bench_shape(out_features: int, in_features: int, rows: list[int], paths: list[str]) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(out_features, in_features, generator=gen) * 0.02).to(torch.bfloat16)
    scales = int8_scales(w.float().abs().amax(1), torch.bfloat16)
    q8 = quantize_int8(w, scales)
    q4, sz = quantize_int4(w, INT4_GROUP, torch.bfloat16)
    packed = QuantizedWeight.int4(Quant("int4"), q4, sz, torch.device("cpu")).qweight
    assert torch.equal(unpack_int4(packed, out_features, in_features).int(), q4)
    del q4
    out = []
    for m in rows:
        x = torch.randn(m, in_features, generator=gen).to(torch.bfloat16)
        fns = {
            "bf16": lambda x=x: F.linear(x, w),
            "int8_kernel": lambda x=x: torch._weight_int8pack_mm(x, q8, scales),
            "int8_dequant": lambda x=x: F.linear(x, q8.to(x.dtype)) * scales,
            "int4_kernel": lambda x=x: torch._weight_int4pack_mm_for_cpu(x, packed, INT4_GROUP, sz),
            "int4_dequant": lambda x=x: int4_dequant_linear(x, packed, sz, out_features, in_features, INT4_GROUP),
            "int8_blocked": lambda x=x: int8_blocked_linear(x, q8, scales),
        }
        row = {"out": out_features, "in": in_features, "rows": m}
        with torch.no_grad():
            row.update({p: round(median_ms(fns[p]), 3) for p in paths})
        out.append(row)
        print(f"{out_features:>6}x{in_features:<6}{m:>5}" + "".join(f"{row[p]:>15.3f}" for p in paths)
              + "".join(f"{row[p] / row['bf16']:>9.2f}" for p in paths[1:]), flush=True)
    return out


def crossovers(rows: list[dict], paths: list[str]) -> dict:
    """First M at which int8 dequant beats the int8 kernel, and at which each quantized path is slower than bf16."""
    def first(pred):
        return next((r["rows"] for r in rows if pred(r)), None)
    both = {"int8_kernel", "int8_dequant"} <= set(paths)
    return {"int8_dequant_beats_kernel_from": first(lambda r: r["int8_dequant"] < r["int8_kernel"]) if both else None,
            **{f"{p}_slower_than_bf16_from": first(lambda r, p=p: r[p] > r["bf16"]) for p in paths[1:]},
            **{f"{p}_more_than_10pct_slower_from": first(lambda r, p=p: r[p] > 1.1 * r["bf16"]) for p in paths[1:]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["1b", "15b"], choices=list(SHAPES))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 512])
    parser.add_argument("--paths", nargs="+", default=list(PATHS[1:5]), choices=PATHS[1:],
                        help="quantized paths to time beside bf16")
    parser.add_argument("--out", default="quant_kernels.json", help="file name under benchmarks/results/")
    args = parser.parse_args()
    torch.set_num_threads(1)
    paths = ["bf16", *args.paths]
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"torch {torch.__version__}, 1 thread, INT8_DEQUANT_ROWS = {INT8_DEQUANT_ROWS}; uptime: {load}")
    print(f"{'shape':<13}{'M':>5}" + "".join(f"{p + ' ms':>15}" for p in paths)
          + "".join(f"{p.replace('_kernel', 'K').replace('_dequant', 'D') + '/bf':>9}" for p in paths[1:]))
    layers = []
    for model in args.shapes:
        for name, out_features, in_features in SHAPES[model]:
            rows = bench_shape(out_features, in_features, args.rows, paths)
            layers.append({"model": model, "layer": name, "out": out_features, "in": in_features,
                           "crossovers": crossovers(rows, paths), "rows": rows})
    print("\ncrossovers (first M in the list; None = never up to the largest M)")
    for layer in layers:
        print(f"{layer['model']:>4} {layer['layer']:<12} {layer['out']:>6}x{layer['in']:<6} {layer['crossovers']}")
    write_json(HERE / "results" / args.out,
               {"torch": torch.__version__, "threads": 1, "cpus": os.cpu_count(),
                "int8_dequant_rows": INT8_DEQUANT_ROWS, "uptime_before": load,
                "uptime_after": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
                "layers": layers})


if __name__ == "__main__":
    main()
