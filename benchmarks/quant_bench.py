"""bf16 vs weight-only int8 vs int4 (group 128) at tp 1, 2, 4 on the starcoderbase-1b shape, one run.

Per (tp, mode) one torchrun of quant_worker.py with OMP_NUM_THREADS = max(1, 2 // tp): per-rank peak RSS of
the load and of the timed phases, then rank 0's medians of decode ms/token at batch 1 (16 greedy steps on the
KV cache after a 16-token prompt) and batch-16 decode ms/step (8 steps after a 4-token prompt), and one
512-token prefill. The modes take turns inside each tp so that they share the machine's conditions.
Prints the tables and the goals, writes benchmarks/results/quant_bench.json.

    python benchmarks/quant_bench.py [--tp 1 2 4] [--rounds 3] [--rounds-tp4 1] [--report]

Goals: per-rank peak RSS of int8 <= 0.6 x and int4 <= 0.4 x bf16's weights/tp, plus the same
runtime floor (bf16's load peak minus its weights, from the same run); decode at batch 1 int8 <= 0.6 x and
int4 <= 0.5 x bf16 at tp 1 and 2; no timed case slower than bf16 by more than 10 %.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import free_port, starcoderbase_1b, write_json

HERE = Path(__file__).parent
MODES = ("bf16", "int8", "int4")
RSS_GOAL = {"int8": 0.6, "int4": 0.4}
DECODE_GOAL = {"int8": 0.6, "int4": 0.5}
TIMED = ("decode_ms", "prefill_ms", "decode16_ms")


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def torchrun(nproc: int, script: str, args: list[str], threads: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out_dir:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(HERE), "BENCH_OUT": out_dir}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(free_port()), str(HERE / script), *args]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if out.returncode:
            raise SystemExit(out.stderr[-3000:])
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(nproc)]


def goals(rows: list[dict]) -> list[dict]:
    """Each goal per tp: met or not, with the numbers it was decided on."""
    by = {(r["tp"], r["mode"]): r for r in rows}
    out = []
    for tp in sorted({r["tp"] for r in rows}):
        bf = by.get((tp, "bf16"))
        if bf is None:
            continue
        floor = bf["peak_rss_load_mib"] - bf["param_mib"]
        for mode in ("int8", "int4"):
            q = by.get((tp, mode))
            if q is None:
                continue
            target = RSS_GOAL[mode] * bf["param_mib"] + floor
            out.append({"tp": tp, "goal": f"{mode} load peak RSS <= {RSS_GOAL[mode]} x bf16 weights/tp + floor",
                        "met": q["peak_rss_load_mib"] <= target,
                        "numbers": f"{q['peak_rss_load_mib']:.0f} MiB vs target {target:.0f} ({RSS_GOAL[mode]} x "
                                   f"{bf['param_mib']:.0f} + floor {floor:.0f}); weights {q['param_mib']:.0f} MiB = "
                                   f"{q['param_mib'] / bf['param_mib']:.2f} x bf16's"})
            if tp in (1, 2):
                ratio = q["decode_ms"] / bf["decode_ms"]
                out.append({"tp": tp, "goal": f"{mode} decode (batch 1) <= {DECODE_GOAL[mode]} x bf16",
                            "met": ratio <= DECODE_GOAL[mode],
                            "numbers": f"{q['decode_ms']:.1f} vs {bf['decode_ms']:.1f} ms/token = {ratio:.2f} x"})
            for key in TIMED:
                ratio = q[key] / bf[key]
                out.append({"tp": tp, "goal": f"{mode} {key.removesuffix('_ms')} <= 1.1 x bf16",
                            "met": ratio <= 1.1, "numbers": f"{q[key]:.1f} vs {bf[key]:.1f} ms = {ratio:.2f} x"})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=3, help="timed decode rounds (median), tp 1 and 2")
    parser.add_argument("--rounds-tp4", type=int, default=1, help="timed rounds at tp > 2 (oversubscribed)")
    parser.add_argument("--report", action="store_true", help="only reprint results/quant_bench.json's tables")
    args = parser.parse_args()
    if args.report:
        return report(json.loads((HERE / "results" / "quant_bench.json").read_text()))

    ckpt = starcoderbase_1b("bfloat16")
    weights_mib = (ckpt / "model.safetensors").stat().st_size / 2**20
    idle = torchrun(1, "load_worker.py", ["idle"], 1)[0]["idle_rss_mib"]
    rows = []
    for tp in args.tp:
        threads = max(1, (os.cpu_count() or 2) // tp)
        rounds = args.rounds if tp <= 2 else args.rounds_tp4
        for mode in MODES:
            load = uptime()
            ranks = torchrun(tp, "quant_worker.py", [str(ckpt), mode, str(rounds)], threads)
            r0 = ranks[0]
            row = {"tp": tp, "mode": mode, "threads_per_rank": threads, "rounds": rounds, "uptime": load,
                   "param_mib": max(r["param_mib"] for r in ranks),
                   "peak_rss_load_mib": max(r["peak_rss_load_mib"] for r in ranks),
                   "peak_rss_run_mib": max(r["peak_rss_run_mib"] for r in ranks),
                   "load_s": r0["load_s"], **{k: r0[k] for k in TIMED}, "ranks": ranks}
            row["peak_rss_mib"] = max(row["peak_rss_load_mib"], row["peak_rss_run_mib"])
            rows.append(row)
            print(f"tp {tp} {mode}: {row['peak_rss_mib']:.0f} MiB, decode {row['decode_ms']} ms, prefill "
                  f"{row['prefill_ms']} ms, batch-16 {row['decode16_ms']} ms  ({load})", flush=True)

    report({"checkpoint_mib": round(weights_mib, 1), "idle_rss_mib": round(idle, 1), "cpus": os.cpu_count(),
            "uptime_after": uptime(), "rows": rows})


def report(data: dict) -> None:
    """Print the table and the goals of `data` and write it, goals included, to results/quant_bench.json."""
    rows, weights_mib, idle = data["rows"], data["checkpoint_mib"], data["idle_rss_mib"]
    print(f"\nstarcoderbase-1b shape, bf16 checkpoint {weights_mib:.0f} MiB, idle-import RSS {idle:.0f} MiB; "
          "largest rank's RSS, rank 0's times")
    print(f"{'tp':>3} {'mode':>5} {'thr':>3} {'weights MiB':>11} {'peak load':>9} {'peak run':>9} {'load s':>6} "
          f"{'decode ms':>9} {'prefill ms':>10} {'b16 ms/step':>11}")
    for r in rows:
        print(f"{r['tp']:>3} {r['mode']:>5} {r['threads_per_rank']:>3} {r['param_mib']:>11.0f} "
              f"{r['peak_rss_load_mib']:>9.0f} {r['peak_rss_run_mib']:>9.0f} {r['load_s']:>6.1f} "
              f"{r['decode_ms']:>9.1f} {r['prefill_ms']:>10.0f} {r['decode16_ms']:>11.1f}")
    results = goals(rows)
    print()
    for g in results:
        print(f"tp {g['tp']} {g['goal']:<58} {'met' if g['met'] else 'NOT MET':<8} {g['numbers']}")
    write_json(HERE / "results" / "quant_bench.json", {**data, "goals": results})


if __name__ == "__main__":
    main()
