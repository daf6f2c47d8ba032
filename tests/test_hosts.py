"""Pipeline parallelism across hosts, as a user runs it: `torchrun --nnodes H --node-rank i ... -m autotp serve --pp H`
on each of H simulated hosts (tests/netns.py: network namespaces on a bridge, each with its own hostname, whose name,
as on many real machines, resolves to nothing), stages passing hidden states over the "network".

The oracle is transformers' unsharded `generate` (and its log-probabilities) on the same checkpoint. The faults are
the user's: a host killed mid-serve, its link cut, a host that fails at start-up; what is checked is what they see
(the answer their client gets, how long every process takes to exit, the one line that names the host).
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

import pytest
import torch
from checkpoints import saver, word_tokenizer
from families import any_model, build
from health import healthy
from netns import Hosts, available

from autotp.generate import generate

needs_hosts = pytest.mark.skipif(bool(available()), reason=available() or "namespaces")
ROOT = Path(__file__).parent.parent
PYTHON = sys.executable
LAYERS = 5
PROMPT = [3, 17, 42, 8, 99, 51, 23]
LONG = [(7 * i) % 97 for i in range(40)]
JOINER = [60, 61, 62]
REPEAT = [5, 6, 7, 8, 9] * 5


@pytest.mark.parametrize("env, node", [
    ({"GROUP_RANK": "1", "RANK": "0", "LOCAL_WORLD_SIZE": "4"}, 1),  # torchrun's word wins
    ({"CROSS_RANK": "2", "RANK": "9"}, 2),  # the deepspeed launcher's
    ({"RANK": "7", "LOCAL_WORLD_SIZE": "4"}, 1),  # ranks by hand, host after host: the edge, one rank before...
    ({"RANK": "8", "LOCAL_WORLD_SIZE": "4"}, 2),  # ... and the next host's first
    ({"RANK": "3"}, None),  # nothing says how many ranks a host runs
])
def test_a_host_is_its_launchers_node_rank_not_its_name(monkeypatch, env, node):
    """Two hosts may share a hostname (cloned machines, two torchruns on one machine): what tells them apart is the
    node's rank the launcher gives, which the lines show beside the name."""
    from autotp import hosts

    for name in ("GROUP_RANK", "CROSS_RANK", "RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(hosts.socket, "gethostname", lambda: "twin")
    assert hosts.node() == node
    assert hosts.where() == ("twin" if node is None else f"node {node} (twin)")
    assert hosts.key() == ("twin" if node is None else f"node {node}")  # what the hub, budget and watchdog compare


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_rank_0_checks_in_at_torchruns_exit_barrier_for_its_agent(monkeypatch, rendezvous):
    """Rank 0 of node 0 arrives at the agents' exit barrier for its own agent (gone after a Ctrl-C), so the other
    host's agent passes it; under a rendezvous whose keys are elsewhere (c10d) it writes nothing and does not wait."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist
    from pool import free_port

    from autotp import hosts

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    for name, value in {"TORCHELASTIC_USE_AGENT_STORE": "True", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port), "GROUP_WORLD_SIZE": "2", "GROUP_RANK": "0", "LOCAL_RANK": "0",
                        "TORCHELASTIC_RUN_ID": "none"}.items():
        monkeypatch.setenv(name, value)
    if rendezvous == "static":  # what torch's agents write under the static rendezvous's prefix before any rank starts
        store.set("none/torchelastic/assigned_ranks/0", "[0, 2, 0, 2]")
    barrier = "none/torchelastic/agent/terminal_state"
    passed = []

    def other_agent() -> None:  # host b's, arriving once its ranks are done, as torch's agent does (_exit_barrier)
        from torch.distributed.elastic.utils.store import barrier as agents_barrier

        time.sleep(0.5)
        try:
            agents_barrier(dist.PrefixStore("none", store), 2, "torchelastic/agent/terminal_state", 3)
            passed.append(True)
        except Exception:  # noqa: BLE001 - its timeout: what the agent logs with the store's frames
            pass

    other = threading.Thread(target=other_agent)
    other.start()
    start = time.monotonic()
    hosts.check_in_for_agent(wait_s=5.0)
    waited = time.monotonic() - start
    other.join()
    if rendezvous == "static":
        assert passed and 0.4 < waited < 5.0, waited
    else:
        assert not passed and store.add(f"{barrier}/num_members", 0) == 1 and waited < 0.4, waited


def model_named(name: str):
    """The test's checkpoints: llama_tied is Llama's grouped-query attention with tied embeddings."""
    if name == "llama_tied":
        return build("llama", num_hidden_layers=LAYERS, tie_word_embeddings=True)
    return any_model(name, LAYERS)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return saver(tmp_path_factory, model_named)


@pytest.fixture(scope="module")
def words(tmp_path_factory) -> str:
    return word_tokenizer(tmp_path_factory.mktemp("words"))


def torchrun(hosts: Hosts, i: int, per_host: int, port: int, *args: str) -> list[str]:
    return [PYTHON, "-m", "torch.distributed.run", "--nnodes", str(hosts.n), "--node-rank", str(i),
            "--nproc-per-node", str(per_host), "--master-addr", hosts.addr(0), "--master-port", str(port), *args]


def wait_all(procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        p.wait(timeout=max(1.0, deadline - time.monotonic()))


def text(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def expected(name: str) -> dict:
    """What each of hosts_serve.py's requests gets from the unsharded model, greedily."""
    model = model_named(name)

    def greedy(prompt: list[int], n: int) -> list[int]:
        x = torch.tensor([prompt])
        return generate(model, x, max_new_tokens=n)[0, len(prompt):].tolist()

    cold = greedy(PROMPT, 12)
    with torch.no_grad():
        scores = torch.log_softmax(model(torch.tensor([PROMPT + cold])).logits[0].float(), -1)
    logprobs = [scores[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(cold)]
    return {"cold": text(cold), "logprobs": logprobs, "long": text(greedy(LONG, 16)),
            "joiner": text(greedy(JOINER, 10)), "repeat": text(greedy(REPEAT, 16))}


@pytest.mark.parametrize("pp, per_host, names", [
    (2, 1, ["gpt_bigcode_mqa12", "llama_tied", "bloom", "gemma2"]),
    (2, 2, ["gpt_bigcode_mqa12", "llama_tied"]),
    (3, 1, ["gpt_bigcode_mqa12", "bloom"]),
])
@needs_hosts
@pytest.mark.slow
def test_hosts_serve_what_transformers_generates(saved, words, tmp_path, pp, per_host, names):
    """Cold and from cached blocks, a long prompt in chunks with a row joining mid-way, drafts verified: every answer
    is the unsharded model's, on two or three hosts, one or two ranks each."""
    from pool import free_port

    checkpoints = [f"{n}={saved(n)}" for n in names]
    with Hosts(pp) as hosts:
        port = free_port()
        procs = [hosts.run(i, torchrun(hosts, i, per_host, port, str(ROOT / "tests" / "hosts_serve.py"),
                                       str(tmp_path), words, str(pp), *checkpoints), tmp_path / f"host{i}.log")
                 for i in range(pp)]
        wait_all(procs, 300)
    logs = "\n".join((tmp_path / f"host{i}.log").read_text()[-2000:] for i in range(pp))
    said = ""
    for name in names:
        got = json.loads((tmp_path / f"{name}.json").read_text())
        assert got["code"] == 0 and "error" not in got["answers"], (got, logs)
        answers, want = got["answers"], expected(name)
        for key in ("cold", "long", "joiner", "repeat"):
            assert answers[key]["text"].strip() == want[key], (name, key)
        assert answers["again"]["text"].strip() == want["cold"] and answers["again"]["cache_n"] >= 4
        assert answers["cold"]["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4)
        assert f"pp={pp}" in got["stderr"], got["stderr"]
        said += got["stderr"]
    assert "host-a reaches MASTER_ADDR" in said  # the host chose the interface to the others, and said so


def serving(hosts: Hosts, model: str, words: str, tmp_path: Path, *extra: str) -> tuple[list, str]:
    """`autotp serve --pp 2` across two hosts, listening on host 0's address: (the torchruns, its URL)."""
    from pool import free_port

    port, http = free_port(), free_port()
    procs = [hosts.run(i, torchrun(hosts, i, 1, port, "-m", "autotp", "serve", "--model", model, "--tokenizer", words,
                                   "--pp", "2", "--host", "0.0.0.0", "--port", str(http), "--allowed-hosts", "*",
                                   "--dtype", "float32", "--kv-cache-memory", "16MiB", *extra),
                       tmp_path / f"host{i}.log") for i in range(2)]
    url = f"http://{hosts.addr(0)}:{http}"
    if not healthy(url, 180, procs):
        raise AssertionError("\n".join((tmp_path / f"host{i}.log").read_text() for i in range(2)))
    return procs, url


def stream_until_failure(url: str, model: str, started: list) -> dict:
    """A long streamed completion: what the client saw, and when its stream ended."""
    body = json.dumps({"model": Path(model).name, "prompt": text(PROMPT), "max_tokens": 3000, "temperature": 0.9,
                       "stream": True}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"content-type": "application/json"})
    seen = {"tokens": 0, "error": None}
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            for line in r:
                if line.startswith(b"data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        seen["error"] = chunk["error"]["message"]
                    else:
                        seen["tokens"] += 1
                        if seen["tokens"] == 5:
                            started.append(time.monotonic())
    except OSError as e:
        seen["error"] = str(e)
    seen["ended"] = time.monotonic()
    return seen


def lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.startswith("autotp")]


@needs_hosts
@pytest.mark.slow
@pytest.mark.parametrize("fault", ["killed", "cut"])
def test_a_lost_host_answers_the_client_and_stops_every_rank(saved, words, tmp_path, fault):
    """Mid-stream, host 1 is killed (every process SIGKILLed) or its link goes down: the client's stream ends with an
    error within 10 s, every rank exits within 30 s, and host 0's one line names the lost host."""
    import threading

    with Hosts(2) as hosts:
        model = saved("bloom")  # ALiBi: no position limit, a long stream
        procs, url = serving(hosts, model, words, tmp_path)
        started, seen = [], {}
        client = threading.Thread(target=lambda: seen.update(stream_until_failure(url, model, started)))
        client.start()
        deadline = time.monotonic() + 60
        while not started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started, ("the stream never started", seen)
        hit = time.monotonic()
        hosts.kill(1) if fault == "killed" else hosts.cut(1)
        client.join(30)
        exits = [hosts.wait_empty(i, 30) for i in range(2)]
    assert seen.get("error") and seen["ended"] - hit < 10, seen
    assert None not in exits, exits
    said = lines(tmp_path / "host0.log")
    assert any("stage 1 (rank 1 on host-b)" in line for line in said), said
    if fault == "cut":  # host 1 lives on, cut off: it stops by itself, saying why
        assert any("has not reached the rendezvous store" in line for line in lines(tmp_path / "host1.log"))


@needs_hosts
@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("names", [None, ["twin", "twin"]], ids=["named", "same-hostname"])
def test_a_host_that_fails_at_start_up_stops_the_others_in_seconds(saved, words, tmp_path, names):
    """Host 1's model directory is missing: it says so, and host 0, waiting for it at the rendezvous, exits within
    seconds, its one line naming host 1 and why (never the ten-minute wait of a collective's timeout). Also where
    both hosts have one hostname (cloned machines): hosts are told apart by torchrun's node rank, not by name."""
    from pool import free_port

    model = saved("gpt_bigcode_mqa12")
    with Hosts(2, names=names) as hosts:
        port = free_port()
        start = time.monotonic()
        procs = [hosts.run(i, torchrun(hosts, i, 1, port, "-m", "autotp", "serve", "--pp", "2", "--port", "0",
                                       "--tokenizer", words, "--model", model if i == 0 else "/nonexistent/model"),
                           tmp_path / f"host{i}.log") for i in range(2)]
        wait_all(procs, 60)
        elapsed = time.monotonic() - start
    assert all(p.returncode != 0 for p in procs)
    assert elapsed < 30, elapsed
    said = lines(tmp_path / "host0.log")
    failed = f"rank 1 on node 1 ({hosts.name(1)}) failed at start-up"
    assert any(failed in line and "/nonexistent/model" in line for line in said), said
    assert any("/nonexistent/model" in line for line in lines(tmp_path / "host1.log"))


@needs_hosts
@pytest.mark.slow
def test_generate_runs_its_stages_on_two_hosts(saved, words, tmp_path):
    """`autotp generate --pp 2` across two hosts prints what the unsharded model generates."""
    from pool import free_port

    with Hosts(2) as hosts:
        port = free_port()
        procs = [hosts.run(i, torchrun(hosts, i, 1, port, "-m", "autotp", "generate", "--pp", "2", "--model",
                                       saved("llama_tied"), "--tokenizer", words, "--prompt", text(PROMPT),
                                       "--max-new-tokens", "12", "--json"), tmp_path / f"host{i}.log")
                 for i in range(2)]
        wait_all(procs, 120)
    assert [p.returncode for p in procs] == [0, 0]
    printed = [line for line in (tmp_path / "host0.log").read_text().splitlines() if line.startswith("{")]
    assert json.loads(printed[-1])["text"].strip() == expected("llama_tied")["cold"]


@needs_hosts
@pytest.mark.slow
def test_sigterm_on_every_host_drains_and_exits_0(saved, words, tmp_path):
    """An operator stops the servers (SIGTERM to every rank): the stages stop in order, every rank exits 0 (and so
    does each host's torchrun), and no host calls another lost."""
    with Hosts(2) as hosts:
        model = saved("gpt_bigcode_mqa12")
        procs, url = serving(hosts, model, words, tmp_path)
        body = json.dumps({"model": Path(model).name, "prompt": text(PROMPT), "max_tokens": 8,
                           "temperature": 0}).encode()
        with urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", body,
                                                           {"content-type": "application/json"}), timeout=60) as r:
            answer = json.loads(r.read())["choices"][0]["text"].strip()
        assert answer.split() == expected("gpt_bigcode_mqa12")["cold"].split()[:8]
        for i in range(2):  # the ranks, as a service manager signals them (torchrun itself exits 1 on a signal)
            for pid in hosts.pids(i):
                argv = Path(f"/proc/{pid}/cmdline").read_text()
                if "-m\0autotp" in argv and "torch.distributed.run" not in argv:
                    os.kill(pid, signal.SIGTERM)
        wait_all(procs, 60)
    assert [p.returncode for p in procs] == [0, 0], [lines(tmp_path / f"host{i}.log") for i in range(2)]
    for i in range(2):
        assert not any("error" in line for line in lines(tmp_path / f"host{i}.log"))
    loading = [[line for line in lines(tmp_path / f"host{i}.log") if "serve: loading" in line] for i in range(2)]
    assert [len(said) for said in loading] == [1, 0], loading  # rank 0's line, at once: host-b has no rank 0


@needs_hosts
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ctrl_c_on_the_first_host_stops_the_other_in_one_line(saved, words, tmp_path):
    """`torchrun --nnodes 2 ... serve --pp 2` typed on two hosts; Ctrl-C on host a (SIGINT to its foreground job):
    host a drains and stops, and host b, whose service that was, says so in one line and exits 0, instead of
    printing the store's errors and C++ frames of the connection it lost."""
    with Hosts(2) as hosts:
        procs, url = serving(hosts, saved("gpt_bigcode_mqa12"), words, tmp_path)
        served = [len((tmp_path / f"host{i}.log").read_text().splitlines()) for i in range(2)]
        hit = time.monotonic()
        os.killpg(procs[0].pid, signal.SIGINT)  # the terminal's Ctrl-C: torchrun and its ranks, one process group
        wait_all(procs, 60)
        elapsed = time.monotonic() - hit
    after = [(tmp_path / f"host{i}.log").read_text().splitlines()[served[i]:] for i in range(2)]
    assert elapsed < 30, elapsed
    assert procs[1].returncode == 0 and len(after[1]) <= 1, after[1]
    assert "autotp serve: stopped" in after[0], after[0]
