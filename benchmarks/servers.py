"""The servers the serving benchmarks compare, started the same way for each: `autotp serve` from this tree
("new:N", N ranks) or from a baseline commit ("old:N", checked out under benchmarks/.cache/ with git
worktree and run from its own src/ with this venv), and `transformers serve --continuous-batching` ("hf",
from its own venv: it needs `accelerate`, which autotp does not):

    python3 -m venv benchmarks/.cache/hf-serve
    benchmarks/.cache/hf-serve/bin/pip install torch==2.13.0 transformers==5.24.0 accelerate fastapi uvicorn openai

OMP_NUM_THREADS = cores / ranks for every system.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from common import CACHE, free_port

ROOT = Path(__file__).parent.parent
DEMO = ROOT / "src" / "autotp" / "demo_model"
HF_PYTHON = CACHE / "hf-serve" / "bin" / "python"
START_TIMEOUT_S = 300
NAMES = {"new": "autotp serve (paged)", "old": "autotp serve ({baseline})", "hf": "transformers serve --cb"}


def cpus() -> int:
    return os.cpu_count() or 1


def label(system: str, baseline: str) -> str:
    kind, _, tp = system.partition(":")
    name = NAMES[kind].format(baseline=baseline)
    return f"{name}, {tp} rank{'s' if tp != '1' else ''}" if tp else name


def baseline_tree(rev: str) -> Path:
    tree = CACHE / f"baseline-{rev}"
    if not (tree / "src" / "autotp").is_dir():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True,
                       capture_output=True)
    return tree


def command(system: str, port: int, baseline: str, model: Path, extra: list[str],
            env_extra: dict | None = None) -> tuple[list[str], dict]:
    """The server command line and environment (this process's, with env_extra) for "new:N", "old:N" or "hf"."""
    env = dict(os.environ, **(env_extra or {}))
    if system == "hf":
        env["OMP_NUM_THREADS"] = str(cpus())
        exe = HF_PYTHON.parent / "transformers"
        return [str(exe), "serve", "--continuous-batching", "--device", "cpu", "--port", str(port), str(model)], env
    kind, tp = system.split(":")
    env["OMP_NUM_THREADS"] = str(max(1, cpus() // int(tp)))
    if kind == "old":
        env["PYTHONPATH"] = str(baseline_tree(baseline) / "src")
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", tp, "--master-port", str(free_port()),
            "-m", "autotp", "serve", "--model", str(model), "--port", str(port), "--max-num-seqs", "32", *extra], env


def start(system: str, baseline: str, model: Path, log: Path, extra: list[str] = (),
          env_extra: dict | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd, env = command(system, port, baseline, model, list(extra) if system != "hf" else [], env_extra)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise SystemExit(f"{system} did not start:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            if model_id(url):
                return proc, url
        except (OSError, KeyError, IndexError, ValueError):
            pass
        time.sleep(0.5)


def model_id(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
        return json.loads(r.read())["data"][0]["id"]


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM the process group, SIGKILL it after `timeout` seconds."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def smollm2() -> Path:
    """SmolLM2-135M-Instruct as the test suite converts it (tests/real_model.py), made on first use."""
    sys.path.insert(0, str(ROOT / "tests"))
    import real_model

    return Path(real_model.smollm2())


def model_path(name: str) -> Path:
    return DEMO if name == "demo" else smollm2() if name == "smollm2" else Path(name)
