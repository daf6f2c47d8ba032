"""The float32 and bfloat16 products of a SmolLM2-135M decode step, kernel against kernel: torch's F.linear (MKL,
oneDNN) and gemv.c (autotp/parallel/gemv.py), each weight read cold as in a real step, on every core.

The 210 layer products of a step (30 layers: q and o 576x576, k and v 192x576, gate and up 1536x576, down
576x1536; random float32 weights, 425 MB, so nothing stays in cache from one product to the next) for 1 to 32
rows of x, the 113 MB LM head (49152 x 576) for one row, and a plain read of 400 MB (torch.sum) for the memory's
speed. The same in bfloat16 (the weights halved: 212 MB), where this CPU has AVX512_BF16 and so gemv.c's
bfloat16 loop. Then torch's int8 and int4 CPU kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`, groups
of 32) on the same layer products, one row, with float32 activations and with bfloat16 ones: why
`autotp serve --quantize` holds activations in bfloat16 on CPU (serve/startup/weight_form.py). Median of --runs
passes per figure; GB/s counts the weight bytes read.

    python benchmarks/gemv_bench.py [--runs 5]

Prints a table, merges it into benchmarks/results/gemv_bench.json under `runs`, keyed by --run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import write_json
from servers import cpus

from autotp.parallel import gemv

HERE = Path(__file__).parent
LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
ROWS = [1, 2, 4, 6, 8, 12, 16, 32]


def ms(fn, runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--run", default=time.strftime("%Y-%m-%d %H:%M"))
    args = parser.parse_args()
    torch.set_num_threads(cpus())
    why = gemv.enable()
    if why:
        raise SystemExit(f"gemv.c did not build: {why}")
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=g) for o, i in LAYER * 30]
    inputs = {(m, k): torch.randn(m, k, generator=g) for m in ROWS for k in (576, 1536)}
    read_gbs = 400 / ms(torch.randn(100_000_000, generator=g).sum, args.runs)

    head = torch.randn(49152, 576, generator=g)
    print(f"{cpus()} CPUs; a plain read: {read_gbs:.1f} GB/s")
    run = {"cpus": cpus(), "read_gbs": read_gbs}
    for dtype in (torch.float32, torch.bfloat16):
        if not gemv.takes(dtype):
            print(f"{dtype}: gemv.c has no loop for it on this CPU")
            continue
        rows, head_ms = kernel_rows([w.to(dtype) for w in weights], {key: x.to(dtype) for key, x in inputs.items()},
                                    head.to(dtype), args.runs)
        name = str(dtype).removeprefix("torch.")
        prefix = "" if dtype == torch.float32 else f"{name}_"  # float32 keeps the file's older keys
        run.update({f"{prefix}layers_mb": rows[0]["mb"], f"{prefix}rows": rows, f"{prefix}head": head_ms})
    quantized = quantized_ms(weights, inputs, args.runs)
    print("quantized layer products, 1 row: " + ", ".join(f"{k} {v:.1f} ms" for k, v in quantized.items()))
    run["quantized_1_row"] = quantized
    write_json(HERE / "results" / "gemv_bench.json", {"runs": {args.run: run}})


def kernel_rows(weights: list[torch.Tensor], inputs: dict, head: torch.Tensor, runs: int) -> tuple[list, dict]:
    """F.linear against gemv.c over the step's layer products for each number of rows, and the LM head at one row;
    printed as a table."""
    megabytes = sum(w.numel() * w.element_size() for w in weights) / 1e6

    def step(linear, m: int):
        return lambda: [linear(inputs[m, w.shape[1]], w) for w in weights]

    rows = []
    for m in ROWS:
        f, c = ms(step(F.linear, m), runs), ms(step(gemv.linear, m), runs)
        rows.append({"rows": m, "mb": megabytes, "f_linear_ms": f, "gemv_ms": c, "f_linear_gbs": megabytes / f,
                     "gemv_gbs": megabytes / c, "speedup": f / c})
    x = inputs[1, 576]
    head_ms = {"f_linear_ms": ms(lambda: F.linear(x, head), runs), "gemv_ms": ms(lambda: gemv.linear(x, head), runs)}
    print(f"{weights[0].dtype}: a decode step's layer products, {megabytes:.0f} MB")
    print(f"{'rows':>4} | {'F.linear ms':>11} | {'GB/s':>5} | {'gemv.c ms':>9} | {'GB/s':>5} | speed-up")
    for r in rows:
        print(f"{r['rows']:4} | {r['f_linear_ms']:11.1f} | {r['f_linear_gbs']:5.1f} | {r['gemv_ms']:9.1f} | "
              f"{r['gemv_gbs']:5.1f} | {r['speedup']:.2f}x")
    print(f"LM head, 1 row: F.linear {head_ms['f_linear_ms']:.1f} ms, gemv.c {head_ms['gemv_ms']:.1f} ms")
    return rows, head_ms


def quantized_ms(weights: list[torch.Tensor], inputs: dict, runs: int) -> dict:
    """The layer products at one row through torch's int8 and int4 CPU kernels, float32 and bfloat16 activations."""
    from autotp.quant.weights import int8_scales, pack_int4, quantize_int4, quantize_int8

    def int8_step(layers, xs):
        return lambda: [torch._weight_int8pack_mm(xs[q.shape[1]], q, s) for q, s in layers]

    def int4_step(layers, xs):
        return lambda: [torch._weight_int4pack_mm_for_cpu(xs[k], q, 32, sz) for q, sz, k in layers]

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        xs = {k: x.to(dtype) for (m, k), x in inputs.items() if m == 1}
        layers = []
        for w in weights:
            scales = int8_scales(w.abs().amax(1), dtype)
            layers.append((quantize_int8(w, scales), scales))
        out[f"int8_{name}_ms"] = ms(int8_step(layers, xs), runs)
        layers = []
        for w in weights:
            q, scales_zeros = quantize_int4(w, 32, dtype)
            layers.append((pack_int4(q, torch.device("cpu")), scales_zeros, w.shape[1]))
        out[f"int4_{name}_ms"] = ms(int4_step(layers, xs), runs)
    return out


if __name__ == "__main__":
    main()
