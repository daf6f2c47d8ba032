"""Charts of benchmarks/results/quant_kernels.json and quant_bench.json -> benchmarks/charts/quant_*.png.

Needs matplotlib, which autotp does not install: `pip install matplotlib` into the venv that runs this.

    python benchmarks/quant_charts.py
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
PATHS = {"int8_kernel": "int8 kernel", "int8_dequant": "int8 dequant + F.linear", "int4_kernel": "int4 kernel (g128)",
         "int4_dequant": "int4 dequant + F.linear"}
MODES = ("bf16", "int8", "int4")


def kernels_chart() -> None:
    data = json.loads((HERE / "results" / "quant_kernels.json").read_text())
    layers = data["layers"]
    fig, axes = plt.subplots(2, 4, figsize=(16, 7.5), sharex=True, sharey=True)
    for ax, layer in zip(axes.flat, layers, strict=False):
        rows = [r["rows"] for r in layer["rows"]]
        for key, label in PATHS.items():
            ax.plot(rows, [r[key] / r["bf16"] for r in layer["rows"]], marker="o", label=label)
        ax.axhline(1.0, color="black", lw=1)
        ax.axhline(1.1, color="grey", lw=1, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{layer['model']} {layer['layer']} ({layer['out']}x{layer['in']})", fontsize=10)
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("input rows M")
    for ax in axes[:, 0]:
        ax.set_ylabel("time / bf16 F.linear")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"CPU weight-only kernels vs bf16, 1 thread, torch {data['torch']} (below 1 = faster than bf16; "
                 f"dashed = 1.1)")
    fig.tight_layout()
    fig.savefig(HERE / "charts" / "quant_kernels.png", dpi=90)


def bench_chart() -> None:
    data = json.loads((HERE / "results" / "quant_bench.json").read_text())
    by = {(r["tp"], r["mode"]): r for r in data["rows"]}
    tps = sorted({r["tp"] for r in data["rows"]})
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2))
    panels = [("peak_rss_load_mib", "largest per-rank peak RSS, load (MiB)"),
              ("decode_ms", "decode ms/token, batch 1"),
              ("prefill_ms", "prefill ms, 512-token prompt"), ("decode16_ms", "batch-16 decode ms/step")]
    width = 0.27
    for ax, (key, title) in zip(axes, panels, strict=True):
        for i, mode in enumerate(MODES):
            xs = [t + (i - 1) * width for t in range(len(tps)) if (tps[t], mode) in by]
            ys = [by[(tp, mode)][key] for tp in tps if (tp, mode) in by]
            bars = ax.bar(xs, ys, width, label=mode)
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_xticks(range(len(tps)), [f"tp {tp}" + (" (oversub.)" if tp > 2 else "") for tp in tps])
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    fig.suptitle("starcoderbase-1b shape on 2 shared CPU cores: bf16 vs int8 vs int4 (group 128); "
                 "tp 4 timings are oversubscribed")
    fig.tight_layout()
    fig.savefig(HERE / "charts" / "quant_bench.png", dpi=90)


if __name__ == "__main__":
    kernels_chart()
    if (HERE / "results" / "quant_bench.json").exists():
        bench_chart()
