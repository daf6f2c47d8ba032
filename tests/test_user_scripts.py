"""The user's own scripts, as they run them: their generate/pipeline with no seed, DeepSpeed's call patterns,
a process group they made, a hub id on an empty cache, a rank seeded differently from the others.

The pool tests run on the embedded demo model (a real tokenizer and real text, as in the bug report); every
task starts from a per-rank random state, as a fresh process has.
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest
import torch
from pool import RankError, free_port
from standin_hub import SilentHub, StandinHub
from tasks import downloader_without_local_rank, user_generate, user_pipeline

import autotp
from autotp.cli import default_model

SCRIPTS = Path(__file__).parent / "user_scripts"
DEMO = default_model()


def torchrun(n: int, *args, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-port",
           str(free_port()), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def rank_outputs(out: Path, n: int) -> list:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


@pytest.mark.parametrize("tp, tp_kwargs", [(2, {"mp_size": 2}), (4, {"mp_size": 4})])
def test_unseeded_pipeline_after_init_inference_agrees_on_every_rank(pools, tp, tp_kwargs):
    texts = pools(tp).run(user_pipeline, DEMO, tp_kwargs, "DeepSpeed is")
    assert len(set(texts)) == 1, texts


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("how", ["from_pretrained", "tensor_parallel"])
def test_unseeded_generate_agrees_on_every_rank(pools, tp, how):
    tokens = pools(tp).run(user_generate, DEMO, how)
    assert all(t == tokens[0] for t in tokens) and len(tokens[0][0]) == 7 + 24, tokens


def test_the_same_seed_everywhere_gives_tp_1s_text(pools):
    expected = user_generate(DEMO, "from_pretrained", seed=11)  # this process: tp 1, no process group
    assert pools(2).run(user_generate, DEMO, "from_pretrained", 11) == [expected, expected]


def test_sharding_draws_no_random_numbers():
    model = autotp.from_pretrained(DEMO)
    torch.manual_seed(3)
    before = torch.get_rng_state()
    autotp.init_inference(type(model).from_pretrained(DEMO))
    autotp.from_pretrained(DEMO)
    assert torch.equal(before, torch.get_rng_state())


def test_ranks_seeded_differently_fail_loudly(pools):
    """torch.manual_seed(rank): the ranks sample different tokens; the guard stops them at that step."""
    results = pools(2).run(user_generate, DEMO, "from_pretrained", 100, True, errors=True)
    for r in results:
        assert isinstance(r, RankError) and isinstance(r.exc, autotp.AutotpError), results
        assert "ranks fed different input ids to forward call" in str(r.exc)
        assert "rank 1 disagree with rank 0" in str(r.exc)
        assert "forward call 1 " not in str(r.exc)  # the prompt agrees; a sampled token does not
    assert pools(2).run(user_generate, DEMO, "from_pretrained", 5)  # the pool is still in lockstep


GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")  # ProcessGroupGloo's workers, gloo's transport loop


def run_to_the_end(script: str, *args: str, out: Path) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node 2 SCRIPT ARGS OUT` through at_exit.py, which records each rank's live threads
    as interpreter finalization begins. Exit 0 and no gloo thread left to abort there (see at_exit.py)."""
    run = torchrun(2, str(SCRIPTS / "at_exit.py"), str(SCRIPTS / script), *args, str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    for r in range(2):
        assert (out / f"threads{r}.json").exists(), f"rank {r} recorded no threads at exit: {run.stderr[-3000:]}"
        threads = json.loads((out / f"threads{r}.json").read_text())
        assert not [t for t in threads if t in GLOO_THREADS], f"rank {r} finalizes with gloo threads alive: {threads}"
    return run


def test_deepspeed_tutorial_pattern(tmp_path):
    """pipe.model = init_inference(pipe.model, tensor_parallel=..., replace_with_kernel_inject=True); pipe(...)."""
    run_to_the_end("ds_tutorial.py", DEMO, out=tmp_path)
    texts = rank_outputs(tmp_path, 2)
    assert texts[0] == texts[1] and texts[0].startswith("def print_hello_world():")


def test_seed_report_flow_as_a_script(tmp_path):
    """HF load, init_inference(model, mp_size=2), greedy generate: the unsharded model's tokens, and a clean exit."""
    from transformers import AutoModelForCausalLM

    run_to_the_end("seed_report.py", DEMO, out=tmp_path)
    ids = torch.tensor([[3, 17, 42, 8, 99, 51, 23]])
    expected = AutoModelForCausalLM.from_pretrained(DEMO).generate(ids, attention_mask=torch.ones_like(ids),
                                                                   max_new_tokens=16, do_sample=False)
    assert rank_outputs(tmp_path, 2) == [expected.tolist()] * 2


def test_engine_forwards_like_deepspeeds():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(DEMO)
    engine = autotp.init_inference(model, mp_size=1)
    assert isinstance(engine, torch.nn.Module) and engine.module is model
    assert engine.config is model.config and engine.generation_config is model.generation_config
    assert engine.device == torch.device("cpu") and engine.eval() is engine and engine.to("cpu") is engine
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(engine(ids).logits, model(ids).logits)
    assert torch.equal(engine.generate(ids, max_new_tokens=4, do_sample=False),
                       model.generate(ids, max_new_tokens=4, do_sample=False))
    with pytest.raises(AttributeError, match="no_such_attribute"):
        _ = engine.no_such_attribute


def _demo_hub(delay_s: float = 0.0) -> StandinHub:
    return StandinHub({"autotp/demo": Path(DEMO)}, delay_s=delay_s)  # started by `with`


def _hub_env(hub: StandinHub, home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    return {**env, "HF_ENDPOINT": hub.url, "HF_HOME": str(home)}


@pytest.mark.slow
def test_hub_id_on_an_empty_cache_downloads_once_while_the_other_rank_waits(tmp_path):
    """A slow first download (longer than the process-group timeout) at tp 2: one download, both ranks load."""
    with _demo_hub(delay_s=12) as hub:
        env = {**_hub_env(hub, tmp_path / "hf"), "AUTOTP_TIMEOUT": "8"}
        out = torchrun(2, "-m", "autotp", "generate", "--model", "autotp/demo", "--prompt", "def add(a, b):",
                       "--max-new-tokens", "8", "--json", env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        assert json.loads(out.stdout)["text"] is not None
        bodies = [r for r in hub.requests if r.startswith("GET /autotp/demo/resolve/")]
        assert len(bodies) == len(set(bodies)) >= 4, hub.requests  # every file once: one download per node
        # each body took the hub's 12 s to send, past the group's 8 s timeout, while rank 1 waited for it
        assert "autotp/demo/model.safetensors" in hub.sent_whole and len(hub.sent_whole) == len(bodies), hub.sent_whole


def test_own_process_group_and_a_hub_id_in_a_user_script(tmp_path):
    with _demo_hub() as hub:
        out = torchrun(2, str(SCRIPTS / "own_group.py"), "autotp/demo", str(tmp_path),
                       env=_hub_env(hub, tmp_path / "hf"))
    assert out.returncode == 0, out.stderr[-3000:]
    tokens = rank_outputs(tmp_path, 2)
    assert tokens[0] == tokens[1] and len(tokens[0][0]) == 4 + 16


def test_without_local_rank_one_rank_per_host_downloads(pools):
    """A script's own mp.spawn sets no LOCAL_RANK: the lowest rank on the host downloads, not every rank."""
    assert pools(2).run(downloader_without_local_rank) == [True, False]


def test_a_hub_id_that_does_not_exist_is_one_error(tmp_path):
    with _demo_hub() as hub:
        out = torchrun(2, "-m", "autotp", "generate", "--model", "autotp/missing", "--prompt", "x",
                       env=_hub_env(hub, tmp_path / "hf"), timeout=120)
    lines = [line for line in out.stderr.splitlines() if line.startswith("autotp: error")]
    assert out.returncode != 0 and len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith("autotp: error: cannot find model 'autotp/missing' locally or on the hub: "
                               "RepositoryNotFoundError")


def test_a_rank_that_never_starts_is_named_not_waited_for(tmp_path):
    """WORLD_SIZE=2 with one process: rank 0 says what it waits for, then gives up (not after 600 s)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "AUTOTP_RENDEZVOUS_TIMEOUT": "8"}
    out = subprocess.run([sys.executable, "-m", "autotp", "generate", "--input-ids", "1,2"], env=env,
                         capture_output=True, text=True, timeout=60)
    port = env["MASTER_PORT"]
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        f"autotp: waiting for 1 of 2 ranks at 127.0.0.1:{port}",
        f"autotp: error: only 1 of 2 ranks joined at 127.0.0.1:{port} within 8 s (AUTOTP_RENDEZVOUS_TIMEOUT): "
        "start all 2 processes, e.g. with torchrun --nproc-per-node 2"]


def _silent_hub_line(hub: SilentHub, repo_id: str, timeout_s: int) -> str:
    return (f"autotp: error: the hub at {hub.url} sent nothing for {timeout_s} s while fetching {repo_id!r} "
            "(AUTOTP_HUB_TIMEOUT; HF_ENDPOINT names the hub, HF_HUB_OFFLINE=1 uses the cache only)")


@pytest.mark.slow
def test_a_hub_that_never_answers_is_one_line_naming_it(tmp_path, family_checkpoint):
    """A proxy that takes connections and then stalls: huggingface_hub's repo_info waits forever on it. `autotp
    plan`, `autotp generate` at tp 2 and a --tokenizer hub id each stop with one line naming the endpoint."""
    with SilentHub() as hub:
        env = {**_hub_env(hub, tmp_path / "hf"), "AUTOTP_HUB_TIMEOUT": "3", "OMP_NUM_THREADS": "1"}
        alone = partial(subprocess.run, env=env, capture_output=True, text=True, timeout=60)
        with ThreadPoolExecutor(3) as started:  # at once: each spends its 3 s waiting on the hub
            runs = {
                "plan": started.submit(alone, [sys.executable, "-m", "autotp", "plan", "--model", "org/name", "--tp",
                                               "2"]),
                "generate": started.submit(torchrun, 2, "-m", "autotp", "generate", "--model", "org/name",
                                           "--input-ids", "1,2", env=env, timeout=60),
                "tokenizer": started.submit(alone, [sys.executable, "-m", "autotp", "generate", "--model",
                                                    family_checkpoint("gpt2")[0], "--tokenizer", "org/tok", "--prompt",
                                                    "x"]),
            }
            runs = {what: run.result() for what, run in runs.items()}
        assert hub.connections >= 3
    for what, run in runs.items():
        lines = [line for line in run.stderr.splitlines() if line.startswith("autotp: error")]
        repo_id = "org/tok" if what == "tokenizer" else "org/name"
        assert run.returncode != 0 and lines == [_silent_hub_line(hub, repo_id, 3)], (what, run.stderr[-3000:])
    from autotp.hub import HUB_TIMEOUT_S

    assert HUB_TIMEOUT_S <= 30  # by default the line comes within a minute; the test sets 3 s
