"""Peak RSS of `autotp.init_inference` on a model the user loaded with Hugging Face (issue: user paths, 5).

Each rank loads the starcoderbase-1b-shaped bf16 checkpoint with `AutoModelForCausalLM.from_pretrained`,
then shards it in place. A thread samples the resident set every 2 ms during `init_inference`; the row
shows, before it, its peak and after it, the whole RSS and its anonymous part (RssAnon: memory the
process owns, as opposed to pages of the checkpoint file that transformers maps and that count in RSS
once touched). Two cases: the weights as transformers leaves them (mapped from the file), and
"owned" (copied into the process's memory first, as after a dtype conversion). The goal: about the
loaded model plus one layer at the peak, never two copies, and the rank's shard alone after. Prints a
table, writes benchmarks/results/init_inference_memory.json. To compare with another autotp tree, put its src first on
PYTHONPATH and pass --label.

    python benchmarks/init_inference_memory.py [--tp 1 2] [--label after]
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

HERE = Path(__file__).parent

WORKER = r'''
import json, os, sys, threading, time
import torch
from transformers import AutoModelForCausalLM
import autotp
from common import current_rss_mib

def anon_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024

model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
if sys.argv[2] == "owned":  # weights in the process's own memory, as after a dtype conversion or .bin load
    for p in model.parameters():
        p.data = p.data.clone()
before, anon_before, peak, anon_peak, running = current_rss_mib(), anon_mib(), [0.0], [0.0], [True]

def sample():
    while running[0]:
        peak[0] = max(peak[0], current_rss_mib())
        anon_peak[0] = max(anon_peak[0], anon_mib())
        time.sleep(0.002)

thread = threading.Thread(target=sample)
thread.start()
autotp.init_inference(model, mp_size=int(os.environ.get("WORLD_SIZE", 1)))
running[0] = False
thread.join()
rank = int(os.environ.get("RANK", 0))
with open(os.path.join(os.environ["BENCH_OUT"], f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "rss_before_mib": round(before, 1), "peak_during_mib": round(peak[0], 1),
               "rss_after_mib": round(current_rss_mib(), 1), "anon_before_mib": round(anon_before, 1),
               "anon_peak_mib": round(anon_peak[0], 1), "anon_after_mib": round(anon_mib(), 1)}, f)
'''


def ranks(ckpt: Path, tp: int, memory: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as out_dir:
        script = Path(out_dir) / "worker.py"
        script.write_text(WORKER)
        pythonpath = os.pathsep.join(p for p in [os.environ.get("PYTHONPATH"), str(HERE)] if p)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath, "BENCH_OUT": out_dir}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp), "--master-port", "29534",
               str(script), str(ckpt), memory]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if out.returncode:
            raise SystemExit(out.stderr[-3000:])
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(tp)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--label", default="after", help="name of this run in the results file")
    args = parser.parse_args()
    ckpt = starcoderbase_1b("bfloat16")
    weights_mib = (ckpt / "model.safetensors").stat().st_size / 2**20
    rows = [{"label": args.label, "memory": memory, "tp": tp, **r}
            for memory in ("mapped", "owned") for tp in args.tp for r in ranks(ckpt, tp, memory)]
    print(f"starcoderbase-1b shape, bf16, {weights_mib:.0f} MiB of weights; RSS in MiB")
    print(f"{'run':>8} {'weights':>8} {'tp':>3} {'rank':>4} {'RSS before':>10} {'peak':>8} {'after':>8} "
          f"{'anon before':>11} {'peak':>8} {'after':>8}")
    for r in rows:
        print(f"{r['label']:>8} {r['memory']:>8} {r['tp']:>3} {r['rank']:>4} {r['rss_before_mib']:>10} "
              f"{r['peak_during_mib']:>8} {r['rss_after_mib']:>8} {r['anon_before_mib']:>11} {r['anon_peak_mib']:>8} "
              f"{r['anon_after_mib']:>8}")
    path = HERE / "results" / "init_inference_memory.json"
    previous = json.loads(path.read_text())["rows"] if path.exists() else []
    write_json(path, {"weights_mib": round(weights_mib, 1),
                      "rows": [r for r in previous if r["label"] != args.label] + rows})


if __name__ == "__main__":
    main()
