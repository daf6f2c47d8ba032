"""Markdown tables, goal checks and PNG charts from benchmarks/results/compare.json (made by compare.py).

    python benchmarks/compare_report.py > benchmarks/results/compare_tables.md

Charts go to benchmarks/charts/. Goals are checked on the starcoderbase-1b-shaped bf16 checkpoint, with the
idle-import RSS of load_memory.py (a process that only imports torch, transformers' model class and autotp).
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
RESULTS = HERE / "results"
CHARTS = HERE / "charts"
ORDER = ["hf", "autotp", "deepspeed", "hf-tp-plan", "hf-tp-auto"]
LABELS = {"hf": "plain HF (1 process)", "autotp": "autotp", "deepspeed": "DeepSpeed 0.19.8 AutoTP",
          "hf-tp-plan": "HF TP, MLP-only plan", "hf-tp-auto": 'HF TP, tp_plan="auto"'}
MARKERS = {"hf": "s", "autotp": "o", "deepspeed": "^", "hf-tp-plan": "D", "hf-tp-auto": "x"}  # tp 1 points overlap


def per_rank(row: dict, key: str, fmt: str = "{:.0f}") -> str:
    values = [r.get(key) for r in row["ranks"]]
    return " / ".join(fmt.format(v) for v in values) if values and None not in values else "–"


def peak(rank: dict) -> float:
    return max(rank["peak_rss_load_mib"], rank["peak_rss_generate_mib"])


def rows_for(data: dict, checkpoint: str) -> list[dict]:
    rows = [r for r in data["rows"] if r["checkpoint"] == checkpoint]
    return sorted(rows, key=lambda r: (ORDER.index(r["system"]), r["tp"]))


def correctness_table(data: dict) -> str:
    lines = ["| checkpoint | system | tp | greedy tokens = plain HF | max \\|Δlogit\\| | per-rank params MiB "
             "| largest / smallest | error |", "|---|---|---|---|---|---|---|---|"]
    for ckpt in ["tiny-mqa", "tiny-mha", "1b-bf16", "1b-fp32"]:
        for r in rows_for(data, ckpt):
            if "skipped" in r:
                lines.append(f"| {ckpt} | {r['system']} | {r['tp']} | – | – | – | – | skipped: {r['skipped']} |")
                continue
            params = [x["param_mib"] for x in r["ranks"] if "param_mib" in x]
            ratio = f"{max(params) / min(params):.2f}" if params else "–"
            equal = {True: "yes", False: "**no**"}.get(r.get("tokens_equal"), "–")
            dlogit = f"{r['max_abs_dlogit']:.2g}" if "max_abs_dlogit" in r else "–"
            error = (r.get("error") or "").replace("|", "\\|")
            lines.append(f"| {ckpt} | {r['system']} | {r['tp']} | {equal} | {dlogit} | "
                         f"{per_rank(r, 'param_mib') if params else '–'} | {ratio} | {error} |")
    return "\n".join(lines)


def performance_table(data: dict, checkpoint: str) -> str:
    lines = ["| system | tp | threads/rank | params MiB | peak RSS load MiB | peak RSS generate MiB | load s "
             "| prefill ms | decode ms/token |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows_for(data, checkpoint):
        if "skipped" in r:
            lines.append(f"| {r['system']} | {r['tp']} | | skipped: {r['skipped']} | | | | | |")
        elif r.get("error") or not r["ranks"] or "prefill_ms" not in r["ranks"][0]:
            lines.append(f"| {r['system']} | {r['tp']} | | error: {(r.get('error') or '')[:80]} | | | | | |")
        else:
            rank0 = r["ranks"][0]
            load_s = max(x["load_s"] for x in r["ranks"])
            lines.append(f"| {r['system']} | {r['tp']} | {r['threads_per_rank']} | {per_rank(r, 'param_mib')} | "
                         f"{per_rank(r, 'peak_rss_load_mib')} | {per_rank(r, 'peak_rss_generate_mib')} | "
                         f"{load_s:.1f} | {rank0['prefill_ms']:.0f} | {rank0['decode_ms_per_token']:.1f} |")
    return "\n".join(lines)


def find(data: dict, checkpoint: str, system: str, tp: int) -> dict | None:
    for r in data["rows"]:
        if (r["checkpoint"], r["system"], r["tp"]) == (checkpoint, system, tp) and "ranks" in r and not r.get("error"):
            return r
    return None


def goals(data: dict, idle_mib: float) -> str:
    """The issue's goals, each with its numbers; a missing row says so instead of passing."""
    ck = "1b-bf16"
    hf, a1, a2, a4 = (find(data, ck, s, tp) for s, tp in [("hf", 1), ("autotp", 1), ("autotp", 2), ("autotp", 4)])
    ds4 = find(data, ck, "deepspeed", 4)
    out = []

    def line(name: str, met: bool, detail: str) -> None:
        out.append(f"| {name} | {'met' if met else '**not met**'} | {detail} |")

    if a4:
        weights = a4["weights_mib"]
        target = 1.15 * weights / 4 + idle_mib
        load_peak = max(x["peak_rss_load_mib"] for x in a4["ranks"])
        gen_peak = max(x["peak_rss_generate_mib"] for x in a4["ranks"])
        line("tp 4 per-rank peak RSS, load ≤ 1.15 × weights/4 + idle", load_peak <= target,
             f"{load_peak:.0f} MiB vs target {target:.0f} (1.15 × {weights:.0f}/4 + {idle_mib:.0f})")
        line("tp 4 per-rank peak RSS, generate ≤ same target", gen_peak <= target,
             f"{gen_peak:.0f} MiB vs target {target:.0f} (48-token KV cache, activations, fp32 logits included)")
        if ds4:
            ds_peak = max(peak(x) for x in ds4["ranks"])
            ours = max(peak(x) for x in a4["ranks"])
            line("tp 4 largest per-rank peak ≥ 3× below DeepSpeed's", ds_peak / ours >= 3,
                 f"DeepSpeed {ds_peak:.0f} MiB / autotp {ours:.0f} MiB = {ds_peak / ours:.2f}×")
    for r, tp in [(a2, 2), (a4, 4)]:
        if r:
            params = [x["param_mib"] for x in r["ranks"]]
            line(f"tp {tp} parameter bytes balanced (largest / smallest ≤ 1.05)", max(params) / min(params) <= 1.05,
                 f"{' / '.join(f'{p:.0f}' for p in params)} MiB: {max(params) / min(params):.3f}")
    if hf and a2:
        base, ours = hf["ranks"][0]["decode_ms_per_token"], a2["ranks"][0]["decode_ms_per_token"]
        line("tp 2 decode (1 thread/rank) ≤ 1.1 × plain HF (2 threads)", ours <= 1.1 * base,
             f"{ours:.1f} vs {base:.1f} ms/token: {ours / base:.2f}×")
        ds2 = find(data, ck, "deepspeed", 2)
        if ds2:
            out[-1] = out[-1][:-2] + f" (DeepSpeed {ds2['ranks'][0]['decode_ms_per_token'] / base:.2f}×) |"
    if hf and a1:
        base, ours = hf["ranks"][0]["decode_ms_per_token"], a1["ranks"][0]["decode_ms_per_token"]
        line("tp 1 decode within 3% of plain HF", ours <= 1.03 * base,
             f"{ours:.1f} vs {base:.1f} ms/token: {100 * (ours / base - 1):+.1f}%")
    return "\n".join(["| goal | status | numbers |", "|---|---|---|", *out])


def charts(data: dict) -> list[str]:
    """Per-rank peak RSS vs tp and decode ms/token vs tp, one line per system, one panel per 1b checkpoint."""
    CHARTS.mkdir(exist_ok=True)
    ckpts = [c for c in ("1b-bf16", "1b-fp32") if any(r["checkpoint"] == c for r in data["rows"])]
    made = []
    for name, ylabel, value in [
            ("rss_vs_tp.png", "largest per-rank peak RSS (MiB)", lambda r: max(peak(x) for x in r["ranks"])),
            ("decode_vs_tp.png", "decode ms/token (rank 0, median)", lambda r: r["ranks"][0]["decode_ms_per_token"])]:
        fig, axes = plt.subplots(1, len(ckpts), figsize=(6 * len(ckpts), 4), squeeze=False)
        for ax, ckpt in zip(axes[0], ckpts, strict=True):
            for system in ORDER:
                points = [(r["tp"], value(r)) for r in rows_for(data, ckpt)
                          if r["system"] == system and "ranks" in r and r["ranks"]
                          and "decode_ms_per_token" in r["ranks"][0]]
                if points:
                    ax.plot([p[0] for p in points], [p[1] for p in points], marker=MARKERS[system], markersize=8,
                            fillstyle="none", label=LABELS[system])
            ax.set(title=f"starcoderbase-1b shape, {ckpt[3:]}", xlabel="tp (ranks)", ylabel=ylabel, xticks=[1, 2, 4])
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(CHARTS / name, dpi=110)
        plt.close(fig)
        made.append(name)
    return made


def seed_table() -> str:
    seed = json.loads((RESULTS / "seed_repro.json").read_text())
    lines = ["| system | tp | tokens = single process | error |", "|---|---|---|---|"]
    lines += [f"| {r['system']} | {r['tp']} | {'yes' if r['tokens_equal'] else 'no'} | {r['error'] or ''} |"
              for r in seed["rows"]]
    return "\n".join(lines)


def load_table() -> tuple[str, float]:
    load = json.loads((RESULTS / "load_memory_bfloat16.json").read_text())
    lines = [f"checkpoint {load['checkpoint_mib']:.0f} MiB, idle-import RSS {load['idle_rss_mib']:.0f} MiB", "",
             "| tp | rank | params MiB | read MiB | peak RSS load MiB | + forward MiB | target MiB | met | load s |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['tp']} | {r['rank']} | {r['param_mib']:.0f} | {r['read_mib']:.0f} | "
              f"{r['peak_rss_load_mib']:.0f} | {r['peak_rss_forward_mib']:.0f} | {r['target_mib']:.0f} | "
              f"{'yes' if r['met'] else 'no'} | "
              f"{r['load_s']} |" for r in load["rows"]]
    return "\n".join(lines), load["idle_rss_mib"]


def main() -> None:
    data = json.loads((RESULTS / "compare.json").read_text())
    load, idle = load_table()
    sections = [("Correctness and partition balance", correctness_table(data))]
    sections += [(f"starcoderbase-1b shape, {c[3:]}", performance_table(data, c)) for c in ("1b-bf16", "1b-fp32")
                 if any(r["checkpoint"] == c for r in data["rows"])]
    sections += [("Goals (starcoderbase-1b shape, bf16)", goals(data, idle)),
                 ("Seed reproduction (benchmarks/results/seed_repro.json)", seed_table()),
                 ("autotp load benchmark (benchmarks/results/load_memory_bfloat16.json)", load)]
    for title, body in sections:
        print(f"### {title}\n\n{body}\n")
    print("charts: " + ", ".join(f"benchmarks/charts/{name}" for name in charts(data)))


if __name__ == "__main__":
    main()
