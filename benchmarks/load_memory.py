"""Per-rank peak RSS and load time of `autotp.from_pretrained` at tp 1, 2, 4 (issue: core, benchmarks).

Target: per-rank peak RSS <= 1.15 x (weights / tp) + the RSS of a process that only imports torch,
transformers and autotp. Prints a table, merges it into benchmarks/results/load_memory_DTYPE.json (rows by tp).

    python benchmarks/load_memory.py [--dtype bfloat16] [--tp 1 2 4] [--baseline REV] [--run NAME]

--baseline REV measures the autotp of commit REV instead (servers.py's worktree, imported from its own src/), on
the same checkpoint; --run NAME keeps the rows under `runs/NAME` instead of the file's top-level rows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import starcoderbase_1b, write_json
from servers import baseline_tree

HERE = Path(__file__).parent


def ranks(nproc: int, arg: str, threads: int, src: Path | None = None) -> list[dict]:
    """Each rank's figures (load_worker.py), with the autotp under src where given (a baseline's)."""
    with tempfile.TemporaryDirectory() as out_dir:
        path = os.pathsep.join([str(HERE)] + ([str(src)] if src else []))
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": path, "BENCH_OUT": out_dir}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", "29533", str(HERE / "load_worker.py"), arg]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if out.returncode:
            raise SystemExit(out.stderr[-3000:])
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(nproc)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--baseline", help="a commit: its autotp measured instead of this tree's")
    parser.add_argument("--run", help="keep the rows under runs/RUN (default: the file's top-level rows)")
    args = parser.parse_args()
    src = baseline_tree(args.baseline) / "src" if args.baseline else None

    ckpt = starcoderbase_1b(args.dtype)
    weights_mib = (ckpt / "model.safetensors").stat().st_size / 2**20
    idle = ranks(1, "idle", 1, src)[0]["idle_rss_mib"]
    rows = []
    for tp in args.tp:
        for r in ranks(tp, str(ckpt), max(1, os.cpu_count() // tp), src):
            target = 1.15 * weights_mib / tp + idle
            peak = max(r["peak_rss_load_mib"], r["peak_rss_forward_mib"], r["peak_rss_generate_mib"])
            rows.append({"tp": tp, **r, "target_mib": round(target, 1), "met": peak <= target})
    print(f"autotp {args.baseline or 'of this tree'}, starcoderbase-1b shape, {args.dtype}, checkpoint "
          f"{weights_mib:.0f} MiB, idle-import RSS {idle:.0f} MiB")
    print(f"{'tp':>3} {'rank':>4} {'params MiB':>10} {'read MiB':>9} {'peak RSS load':>13} {'+forward':>9} "
          f"{'+generate':>9} "
          f"{'target MiB':>10} {'met':>4} {'load s':>7}")
    for r in rows:
        print(f"{r['tp']:>3} {r['rank']:>4} {r['param_mib']:>10} {r['read_mib']:>9} {r['peak_rss_load_mib']:>13} "
              f"{r['peak_rss_forward_mib']:>9} {r['peak_rss_generate_mib']:>9} "
              f"{r['target_mib']:>10} {'yes' if r['met'] else 'NO':>4} {r['load_s']:>7}")
    # rows of the tp sizes not run this time are kept (RESULTS.md quotes them): each run replaces its own
    path = HERE / "results" / f"load_memory_{args.dtype}.json"
    if args.run:
        write_json(path, {"runs": {args.run: {"autotp": args.baseline or "this tree", "rows": rows}}})
        return
    old = json.loads(path.read_text()).get("rows", []) if path.exists() else []
    kept = [r for r in old if r["tp"] not in args.tp]
    write_json(path, {"checkpoint_mib": round(weights_mib, 1), "idle_rss_mib": round(idle, 1),
                      "rows": sorted(kept + rows, key=lambda r: (r["tp"], r["rank"]))})


if __name__ == "__main__":
    main()
