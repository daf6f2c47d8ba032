"""How often a user script that ends normally exits non-zero under torchrun: the teardown abort, counted.

    python benchmarks/exit_codes.py [--runs 20] [--parallel 1]

Runs each script of tests/user_scripts named below (the DeepSpeed tutorial pattern and the seed report's
flow, on the embedded demo model) `--runs` times under `torchrun --nproc-per-node 2`, `--parallel` torchruns
at once (more than 1 loads the machine, which is when the abort shows), and counts the runs that exited
non-zero and those whose output says "terminate called without an active exception" (the abort
autotp.distributed._destroy_at_exit is about). Prints a table; writes benchmarks/results/exit_codes.json.
The test suite checks the abort's precondition instead (tests/user_scripts/at_exit.py), which takes one run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import free_port, write_json

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "user_scripts"
DEMO = ROOT / "src" / "autotp" / "demo_model"
ABORT = "terminate called without an active exception"


def run_once(script: str) -> tuple[int, bool]:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), str(SCRIPTS / script), str(DEMO), out]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    return run.returncode, ABORT in run.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="runs per script (default 20)")
    parser.add_argument("--parallel", type=int, default=1, help="torchruns at once (default 1)")
    args = parser.parse_args()
    rows = []
    for script in ("ds_tutorial.py", "seed_report.py"):
        with ThreadPoolExecutor(args.parallel) as pool:
            results = list(pool.map(run_once, [script] * args.runs))
        rows.append({"script": script, "runs": args.runs, "parallel": args.parallel,
                     "nonzero": sum(code != 0 for code, _ in results), "aborts": sum(a for _, a in results)})
    print(f"{'script':<16} {'runs':>4} {'parallel':>8} {'non-zero exits':>14} {'aborts':>6}")
    for r in rows:
        print(f"{r['script']:<16} {r['runs']:>4} {r['parallel']:>8} {r['nonzero']:>14} {r['aborts']:>6}")
    write_json(ROOT / "benchmarks" / "results" / "exit_codes.json", rows)


if __name__ == "__main__":
    main()
