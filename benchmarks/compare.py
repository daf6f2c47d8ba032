"""autotp beside DeepSpeed's latest AutoTP and Hugging Face TP: one harness, same checkpoints, same launcher.

Every system runs under torchrun (plain HF too, as one process) with OMP_NUM_THREADS = cores // tp for
all of them, through compare_worker.py, each in its own venv:

    hf          plain transformers, one process (tp 1 only)          main venv
    autotp      autotp.from_pretrained                               main venv
    deepspeed   HF from_pretrained -> deepspeed.init_inference(tensor_parallel={"tp_size": N})
                                                                     benchmarks/.cache/ds-latest
    hf-tp-auto  from_pretrained(..., tp_plan="auto") (tp >= 2)       benchmarks/.cache/hf-tp (+accelerate)
    hf-tp-plan  from_pretrained with an explicit MLP-only tp_plan    benchmarks/.cache/hf-tp

Each (checkpoint, system, tp) row is merged into benchmarks/results/compare.json, so runs can be split:

    python benchmarks/compare.py --checkpoint tiny-mqa --systems hf,autotp --tp 1 2 4

Correctness is against the plain-HF tp 1 output of the same checkpoint (run first when missing): greedy
tokens equal, and the max |logit difference| over a 32-token prompt. `compare_report.py` renders tables.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from common import CACHE, free_port, starcoderbase_1b, widen, write_json

HERE = Path(__file__).parent
RESULTS = HERE / "results" / "compare.json"
PYTHONS = {"hf": sys.executable, "autotp": sys.executable,
           "deepspeed": str(CACHE / "ds-latest" / "bin" / "python"),
           "hf-tp-auto": str(CACHE / "hf-tp" / "bin" / "python"), "hf-tp-plan": str(CACHE / "hf-tp" / "bin" / "python")}
SYSTEMS = list(PYTHONS)
# Systems that materialize the whole model on every rank before (or instead of) slicing it.
FULL_MODEL_PER_RANK = {"deepspeed", "hf-tp-auto", "hf-tp-plan"}
TINY = dict(n_embd=384, n_head=12, n_layer=2, n_inner=1536, n_positions=256, vocab_size=1000,
            bos_token_id=0, eos_token_id=0)


def tiny(multi_query: bool) -> Path:
    """A tiny fp32 GPT-BigCode checkpoint (12 heads, so tp 2 and 4 split heads evenly), made once.

    Wide random weights (common.widen, as in the seed reproduction) make greedy tokens depend on every slice."""
    out = CACHE / f"compare-tiny-{'mqa' if multi_query else 'mha'}"
    if (out / "model.safetensors").exists():
        return out
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    torch.manual_seed(0)
    widen(GPTBigCodeForCausalLM(GPTBigCodeConfig(**TINY, multi_query=multi_query)).eval()).save_pretrained(out)
    return out


CHECKPOINTS = {"tiny-mqa": (lambda: tiny(True), "float32"), "tiny-mha": (lambda: tiny(False), "float32"),
               "1b-bf16": (lambda: starcoderbase_1b("bfloat16"), "bfloat16"),
               "1b-fp32": (lambda: starcoderbase_1b("float32"), "float32")}


def mem_available_mib() -> float:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable")) / 1024


def memory_needed_mib(system: str, tp: int, weights_mib: float) -> float:
    """A pessimistic estimate from the bf16 1b runs: a full-model system peaks near 1.45 x the weights plus
    ~600 MiB of interpreter on every rank; autotp near weights / tp plus the same interpreter."""
    per_rank = 1.45 * weights_mib if system in FULL_MODEL_PER_RANK else 1.2 * weights_mib / tp
    return tp * (per_rank + 600)


def run(system: str, ckpt: Path, dtype: str, tp: int, args) -> tuple[dict, dict | None]:
    """One torchrun launch: (row, rank 0's logits and tokens or None)."""
    cores = os.cpu_count()
    threads = max(1, cores // tp)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(HERE.parent / "src"),
           "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    if system == "deepspeed":  # without it the CPU accelerator's shared-memory all-reduce segfaults under torchrun
        env["LOCAL_SIZE"] = str(tp)
    with tempfile.TemporaryDirectory() as out:
        env["BENCH_OUT"] = out
        cmd = [PYTHONS[system], "-m", "torch.distributed.run", "--nproc-per-node", str(tp),
               "--master-port", str(free_port()), str(HERE / "compare_worker.py"), system, str(ckpt), dtype,
               str(args.runs), str(args.new_tokens)]
        # Own session, so that a timeout can kill torchrun's workers too (they would outlive a killed torchrun).
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        try:
            _, stderr = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, stderr = proc.communicate()
            stderr += f"\ntimed out after {args.timeout} s"
        ranks = [json.loads(p.read_text()) for r in range(tp) if (p := Path(out, f"rank{r}.json")).exists()]
        output = torch.load(Path(out, "output.pt")) if Path(out, "output.pt").exists() else None
    row = {"system": system, "tp": tp, "threads_per_rank": threads, "ranks": ranks}
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        row["error"] = errors[0]
    elif proc.returncode or len(ranks) != tp or output is None:
        row["error"] = f"exit {proc.returncode}: " + (stderr.strip().splitlines() or ["(no stderr)"])[-1][-400:]
    return row, output


def versions() -> dict:
    """Versions of each venv's torch / transformers / deepspeed / accelerate, asked of that venv."""
    code = ("import importlib.metadata as m, json\nfound = {}\n"
            "for p in ['torch', 'transformers', 'deepspeed', 'accelerate']:\n"
            "    try: found[p] = m.version(p)\n    except m.PackageNotFoundError: pass\nprint(json.dumps(found))")
    found = {}
    for name, python in {"main": sys.executable, "ds-latest": PYTHONS["deepspeed"],
                         "hf-tp": PYTHONS["hf-tp-auto"]}.items():
        if Path(python).exists():
            found[name] = json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True).stdout)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, choices=list(CHECKPOINTS))
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma-separated, of: {', '.join(SYSTEMS)}")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--runs", type=int, default=5, help="timed runs after one warm-up; medians are reported")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens per greedy run (decode = this - 1)")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per torchrun launch")
    args = parser.parse_args()
    systems = args.systems.split(",")
    if unknown := set(systems) - set(SYSTEMS):
        parser.error(f"unknown systems {sorted(unknown)}: choose from {', '.join(SYSTEMS)}")

    make, dtype = CHECKPOINTS[args.checkpoint]
    ckpt = make()
    weights_mib = sum(f.stat().st_size for f in ckpt.glob("*.safetensors")) / 2**20
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"rows": []}
    ref_path = CACHE / "compare-ref" / f"{args.checkpoint}.pt"
    todo = [(s, tp) for s in systems for tp in args.tp
            if not (s == "hf" and tp != 1) and not (s.startswith("hf-tp") and tp == 1)]
    if not ref_path.exists() and ("hf", 1) not in todo:
        todo.insert(0, ("hf", 1))
    todo.sort(key=lambda st: st != ("hf", 1))  # the reference first
    for system, tp in todo:
        need, have = memory_needed_mib(system, tp, weights_mib), mem_available_mib()
        if need > 0.9 * have:
            row, output = {"system": system, "tp": tp, "skipped": f"needs ~{need / 1024:.1f} GiB, "
                           f"{have / 1024:.1f} GiB available (free -g at run time)"}, None
        else:
            print(f"{args.checkpoint} {system} tp={tp} ...", flush=True)
            row, output = run(system, ckpt, dtype, tp, args)
        row = {"checkpoint": args.checkpoint, "dtype": dtype, "weights_mib": round(weights_mib, 1), **row}
        if output is not None:
            if (system, tp) == ("hf", 1):
                ref_path.parent.mkdir(exist_ok=True)
                torch.save(output, ref_path)
            ref = torch.load(ref_path)
            row["tokens_equal"] = output["tokens"] == ref["tokens"]
            row["max_abs_dlogit"] = float((output["logits"] - ref["logits"]).abs().max())
            row["max_abs_logit"] = float(ref["logits"].abs().max())
        print(json.dumps({k: v for k, v in row.items() if k != "ranks"}), flush=True)
        results["rows"] = [r for r in results["rows"]
                           if (r["checkpoint"], r["system"], r["tp"]) != (args.checkpoint, system, tp)] + [row]
        write_json(RESULTS, results)
    results["versions"] = versions()
    write_json(RESULTS, results)


if __name__ == "__main__":
    main()
