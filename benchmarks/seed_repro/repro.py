"""Reproduce the seed report with DeepSpeed 0.11.1, then run autotp on the same checkpoint.

    python benchmarks/seed_repro/repro.py

Builds an isolated venv (benchmarks/.cache/ds-0.11.1: deepspeed 0.11.1, transformers 4.34.0, numpy<2, the
CPU torch) on first use, saves a tiny GPT-BigCode multi-query checkpoint with it, runs the seed's flow
(init_inference(model, mp_size=N) then generate) at N = 2 and 4 with gloo, and runs
`torchrun -m autotp generate` at the same N. Prints a table; writes benchmarks/results/seed_repro.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
VENV = ROOT / "benchmarks" / ".cache" / "ds-0.11.1"
CKPT = ROOT / "benchmarks" / ".cache" / "gpt-bigcode-mqa-384"
NEW_TOKENS = 16
PROMPT = "3,17,42,8,99,51,23"


def sh(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)


def build_venv() -> None:
    """deepspeed 0.11.1 needs numpy<2 (it imports numpy.BUFSIZE) and installs without building its ops."""
    if (VENV / "bin" / "deepspeed").exists():
        return
    pip = str(VENV / "bin" / "pip")
    for cmd, env in [([sys.executable, "-m", "venv", str(VENV)], None),
                     ([pip, "install", "-q", "torch==2.13.0", "numpy<2", "transformers==4.34.0", "setuptools", "wheel",
                       "packaging", "psutil", "py-cpuinfo", "hjson", "ninja", "tqdm", "pydantic<2", "safetensors"],
                      None),
                     ([pip, "install", "-q", "--no-build-isolation", "deepspeed==0.11.1"], {"DS_BUILD_OPS": "0"})]:
        out = sh(cmd, env)
        if out.returncode:
            raise SystemExit(out.stderr[-2000:])


def torchrun(python: str, n: int, args: list[str], env: dict) -> subprocess.CompletedProcess:
    return sh([python, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-port", "29544", *args], env)


def main() -> None:
    build_venv()
    ds_python = str(VENV / "bin" / "python")
    made = sh([ds_python, str(HERE / "make_checkpoint.py"), str(CKPT), str(NEW_TOKENS)])
    if made.returncode:
        raise SystemExit(made.stderr[-2000:])
    reference = json.loads(made.stdout.strip().splitlines()[-1])["output_ids"]
    rows = []
    for n in (2, 4):
        with tempfile.TemporaryDirectory() as out:
            torchrun(ds_python, n, [str(HERE / "ds_seed.py"), str(CKPT), str(NEW_TOKENS)], {"OUT": out})
            ds = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(n)]
        rows.append({"system": "deepspeed 0.11.1", "tp": n, "error": ds[0].get("error"),
                     "tokens_equal": ds[0].get("output_ids") == reference})
        ours = torchrun(sys.executable, n, ["-m", "autotp", "generate", "--model", str(CKPT), "--input-ids", PROMPT,
                                            "--max-new-tokens", str(NEW_TOKENS), "--json"], {})
        result = json.loads(ours.stdout.strip().splitlines()[-1]) if ours.returncode == 0 else {}
        rows.append({"system": "autotp", "tp": n, "error": None if ours.returncode == 0 else ours.stderr[-500:],
                     "tokens_equal": result.get("output_ids") == reference})
    print("checkpoint: GPT-BigCode n_embd 384, 12 query heads, multi-query; "
          "reference: transformers 4.34, single process")
    print(f"{'system':<18} {'tp':>2}  {'tokens == single process':<24} error")
    for r in rows:
        print(f"{r['system']:<18} {r['tp']:>2}  {str(r['tokens_equal']):<24} {r['error'] or ''}")
    results = ROOT / "benchmarks" / "results"
    results.mkdir(exist_ok=True)
    (results / "seed_repro.json").write_text(json.dumps({"reference": reference, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
