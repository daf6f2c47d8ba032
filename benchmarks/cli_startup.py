"""How long the CLI takes to answer: each command RUNS times, each run a fresh interpreter.

    python benchmarks/cli_startup.py --label after [--runs 5]
    PYTHONPATH=/tmp/cli_before/src python benchmarks/cli_startup.py --label before   # another checkout

Prints median and min wall seconds per command against its goal (`--help` and a flag error under 0.5 s,
`autotp plan` of a config under 3 s, another tool's flag, with its hint, under 0.3 s)
and stores them under `label` in benchmarks/results/cli_startup.json, next to the other labels already
there. Wall time includes the interpreter's start; the command is `python -m autotp`, which runs the same
`entry()` as the `autotp` script. Which autotp is measured is whatever `import autotp` finds (PYTHONPATH first).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "cli_startup.json"
# (name, argv after `python -m autotp`, expected exit code, goal in seconds)
COMMANDS = [
    ("--help", ["--help"], 0, 0.5),
    ("bad flag", ["plan", "--tp", "0"], 2, 0.5),
    ("another tool's flag", ["serve", "--num-shard", "2"], 2, 0.3),  # answered before torch is imported
    ("plan starcoder tp 4", ["plan", "--model", str(ROOT / "examples" / "starcoder"), "--tp", "4"], 0, 3.0),
]


def time_once(argv: list[str], code: int) -> float:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "autotp", *argv], capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - start
    if done.returncode != code:
        raise SystemExit(f"autotp {' '.join(argv)} exited {done.returncode}, expected {code}:\n{done.stderr}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True, help="key under which the timings are stored, e.g. before/after")
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per command (default 5)")
    args = parser.parse_args()

    source = subprocess.run([sys.executable, "-c", "import autotp; print(autotp.__file__)"], capture_output=True,
                            text=True, check=True).stdout.strip()
    print(f"{args.label}: autotp from {source}, {args.runs} runs each, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print(f"{'command':<22}{'median s':>10}{'min s':>8}{'goal s':>8}  ok")
    rows = {}
    for name, argv, code, goal in COMMANDS:
        time_once(argv, code)  # warm the page cache; not counted
        times = [time_once(argv, code) for _ in range(args.runs)]
        median = statistics.median(times)
        rows[name] = {"argv": argv, "median_s": round(median, 3), "min_s": round(min(times), 3), "goal_s": goal,
                      "meets_goal": median < goal, "runs_s": [round(t, 3) for t in times]}
        print(f"{name:<22}{median:>10.2f}{min(times):>8.2f}{goal:>8.1f}  {'yes' if median < goal else 'NO'}")

    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results[args.label] = {"autotp": source, "python": platform.python_version(), "cpus": os.cpu_count(),
                           "commands": rows}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
