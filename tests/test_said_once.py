"""A failure every rank finds alike is said exactly once, whatever the ranks' relative speed.

The way it failed: under torchrun a refusal before the process group exists was rank 0's to say, so rank 1
exited at once without a word; when rank 0 was slower to reach the same check (a busy machine), torchrun
saw rank 1's exit and stopped rank 0 before it printed: no autotp line at all. Here rank 0 is made slow on
purpose (a sitecustomize on PYTHONPATH sleeps in rank 0's interpreter before anything of autotp runs), and
a busy process competes for the cores; every refusal must still print its one line.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pool import free_port

ROOT = Path(__file__).resolve().parents[1]
SLOW_RANK_0 = """import os, time
if os.environ.get("RANK") == "0":
    time.sleep(float(os.environ.get("AUTOTP_TEST_RANK0_DELAY", "0")))
"""
REFUSALS = [
    (["generate", "--max-new-tokens", "-1"], "autotp: error: argument --max-new-tokens: "),
    (["serve", "--max-num-batched-tokens", "1"], "autotp: error: --max-num-batched-tokens 1 is less than "
                                                 "--max-num-seqs 16: every running row decodes one token per step"),
    (["plan", "--model", str(ROOT / "examples" / "starcoder"), "--tp", "64"],
     "autotp: error: tp_size 64 exceeds the 48 query heads"),
]


def torchrun(n: int, args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-port",
                           str(free_port()), "-m", "autotp", *args], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env})


@pytest.mark.parametrize("args,line", REFUSALS, ids=["argparse", "serve-budgets", "plan"])
def test_a_refusal_is_said_once_when_rank_0_is_the_slowest(tmp_path, args, line):
    """3 ranks: two that are fast beside the slow rank 0 (the 2-rank case is this one with a rank fewer)."""
    (tmp_path / "sitecustomize.py").write_text(SLOW_RANK_0)
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    out = torchrun(3, args, {"PYTHONPATH": path, "AUTOTP_TEST_RANK0_DELAY": "4"})
    assert out.returncode != 0
    said = [x for x in out.stderr.splitlines() if x.startswith("autotp:")]
    assert len(said) == 1 and said[0].startswith(line), out.stderr[-3000:]


@pytest.mark.slow
def test_every_refusal_is_said_once_beside_a_busy_process():
    """Each refusal once at tp 2 (the ranks' order left to the scheduler; the slow rank 0 is forced above). The busy
    process runs at the lowest priority: it takes a core whenever the ranks leave one idle, and none from the test
    running beside this one in pytest's other worker (pyproject's addopts)."""
    busy = subprocess.Popen([sys.executable, "-c", "import os\nos.nice(19)\nwhile True: pass"])
    try:
        for args, line in REFUSALS + [(["generate", "--model", "/nonexistent"], "autotp: error: ")]:
            out = torchrun(2, args, {})
            said = [x for x in out.stderr.splitlines() if x.startswith("autotp:")]
            assert out.returncode != 0 and len(said) == 1 and said[0].startswith(line), out.stderr[-3000:]
    finally:
        busy.kill()
        busy.wait()
