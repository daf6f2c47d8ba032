"""More than one server: `autotp serve` replicas behind SGLang's router (PyPI `sglang-router`, its real Rust
binary), as a team runs them, and the worker routes that router reads.

The fleet (one for the module): two tp-1 replicas of the demo model (`python -m autotp serve`, no torchrun)
and one tp-2 replica under torchrun, each with an API key, behind `python -m sglang_router.launch_router
--policy cache_aware` with the same key, everything bound to 127.0.0.1. The oracles are outside autotp: the
router's own view of its workers (`/workers`, `/engine_metrics`), the demo model's config.json, the replica
that answered a request directly, and each replica's log, which names every response id it answered (the
router passes ids through): that is how a request is traced to its replica. Tests run in file order; the
last one kills a replica.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import checkpoints
import openai
import pytest
import torch
from engine_driver import drive, engine_for, job
from pool import free_port
from serve_harness import ENV, Server

from autotp.serve.engine.blocks import BlockPool

DEMO = Path(__file__).parent.parent / "src" / "autotp" / "demo_model"
KEY = "router-test-key"
# what the README recommends: a dead replica is out of rotation after two failed requests (circuit breaker) or
# two failed health checks 2 s apart, whichever comes first; a request is tried up to 5 times (the router's default)
HEALTH = ["--health-check-interval-secs", "2", "--health-check-timeout-secs", "2", "--health-failure-threshold", "2",
          "--cb-failure-threshold", "2", "--cb-timeout-duration-secs", "30"]
START_S = 60  # the router registers its workers within this (they are up before it starts)
USERS = 4


# -- the prefix cache's flush, by hand and on the engine's thread ------------------------------------------------


def test_a_flush_frees_every_idle_cached_block_and_keeps_the_held_ones():
    pool = BlockPool(8, 2)
    pool.reserve(2)
    idle = [pool.take(), pool.take()]  # a row that computed [1, 2, 3, 4] and left: two cached blocks, idle
    pool.register(idle[1], pool.register(idle[0], None, (1, 2)), (3, 4))
    for block in idle:
        pool.release(block)
    assert [b for b, _ in pool.match([1, 2, 3, 4], 9)] == idle
    pool.reserve(1)
    busy = pool.take()
    pool.register(busy, None, (9, 9))  # a row holds a cached block
    assert pool.flush() == 2
    assert pool.match([1, 2, 3, 4], 9) == [] and [b for b, _ in pool.match([9, 9], 9)] == [busy]
    assert set(idle) <= set(pool.free) and pool.available() == 7 and pool.used() == 1
    pool.release(busy)
    assert pool.flush() == 1 and pool.match([9, 9], 9) == [] and pool.available() == 8


def test_a_flush_is_refused_while_a_row_runs_and_empties_the_cache_when_idle(tmp_path):
    """engine.flush_cache from another thread is answered at the next step: None (refused, SGLang's rule) while a
    row runs or waits; once the server is idle, every cached block goes and the same prompt is computed cold."""
    from transformers import AutoTokenizer

    from autotp.serve.api.metrics import Metrics

    tokenizer = AutoTokenizer.from_pretrained(checkpoints.word_tokenizer(tmp_path))
    engine = engine_for(checkpoints.build("mqa12"), tokenizer)
    metrics = Metrics(engine.load)
    prompt = torch.randint(0, 101, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    asked = []
    drive(engine, {0: [job(prompt, 6)]}, on_step=lambda s, e: s == 2 and asked.append(e.flush_cache()),
          metrics=metrics)
    assert asked[0].result(timeout=0) is None  # a row was running: nothing flushed
    drive(engine, {0: [job(prompt, 2, index=1)]}, metrics=metrics)
    hits = metrics.prefix_hits._value.get()
    assert hits == 29  # the control: the second prompt found its 7 full blocks of 4 and the 8th's first token
    flushed = engine.flush_cache()
    engine.step()  # an idle step (a heartbeat): the flush is answered between two steps
    assert flushed.result(timeout=0) >= 7 and engine.scheduler.pool.available() == engine.scheduler.pool.num_blocks
    drive(engine, {0: [job(prompt, 2, index=2)]}, metrics=metrics)
    assert metrics.prefix_hits._value.get() == hits  # computed cold
    late = engine.flush_cache()
    engine._refuse_queued()  # the engine stops: nobody will answer at a next step
    assert isinstance(late.exception(timeout=0), RuntimeError)


# -- the fleet ----------------------------------------------------------------------------------------------------


def get(url: str, path: str, key: str | None = KEY, timeout: float = 10) -> tuple[int, str]:
    request = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def post_empty(url: str, path: str, key: str | None = KEY) -> tuple[int, str]:
    """A POST with no body and no Content-Type, as the router sends /flush_cache."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("POST", path, headers={"Authorization": f"Bearer {key}"} if key else {})
        answer = connection.getresponse()
        return answer.status, answer.read().decode()
    finally:
        connection.close()


def metric(url: str, name: str) -> float:
    """The sum of a family's samples in a replica's /metrics (open without the key, for scrapers)."""
    text = get(url, "/metrics", key=None)[1]
    return sum(float(v) for v in re.findall(rf"^autotp:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


class Router:
    """python -m sglang_router.launch_router on free loopback ports (its Prometheus port too: both bind 0.0.0.0
    unless told), in its own session so that it is always killed whole (it renames itself `sglang::router`)."""

    def __init__(self, workers: list[str], log: Path, *flags: str):
        self.port = free_port()
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--worker-urls", *workers,
               "--policy", "cache_aware", "--api-key", KEY, "--log-level", "warn", *HEALTH, *flags]
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=60)
        deadline = time.monotonic() + START_S
        while len([w for w in self.workers() if w["is_healthy"]]) < len(workers):
            assert self.proc.poll() is None, f"the router exited:\n{log.read_text(errors='replace')[-3000:]}"
            assert time.monotonic() < deadline, f"workers not registered:\n{log.read_text(errors='replace')[-3000:]}"
            time.sleep(0.3)

    def workers(self) -> list[dict]:
        try:
            status, body = get(self.url, "/workers", timeout=5)
        except OSError:  # not listening yet
            return []
        return json.loads(body)["workers"] if status == 200 else []

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    logs = tmp_path_factory.mktemp("router")
    replicas: list[Server] = []
    router = None
    try:
        for i, (ranks, torchrun) in enumerate([(1, False), (1, False), (2, True)]):
            replicas.append(Server(str(DEMO), logs / f"replica{i}.log", "--api-key", KEY, api_key=KEY, ranks=ranks,
                                   torchrun=torchrun, wait=False))
        for r in replicas:
            r.up()
        router = Router([r.url for r in replicas], logs / "router.log")
        yield router, replicas
    finally:
        if router is not None:
            router.kill()
        for r in replicas:
            r.kill()


def served_by(replicas: list[Server], response_id: str) -> int:
    """The replica whose log names this response id (its one log line per request, written as a stream ends:
    possibly just after the client read its end)."""
    deadline = time.monotonic() + 10
    while not (found := [i for i, r in enumerate(replicas) if f"{response_id} status=" in r.text()]):
        assert time.monotonic() < deadline, f"no replica logged {response_id}"
        time.sleep(0.1)
    assert len(found) == 1, (response_id, found)
    return found[0]


def test_the_router_registers_each_replica_under_its_name_with_its_facts(fleet):
    router, replicas = fleet
    config = json.loads((DEMO / "config.json").read_text())
    workers = {w["url"]: w for w in router.workers()}
    assert set(workers) == {r.url for r in replicas}
    for r in replicas:
        w = workers[r.url]
        tp = "2" if r is replicas[2] else "1"
        assert (w["model_id"], w["is_healthy"]) == ("demo_model", True)  # not "unknown": /server_info was read
        assert w["metadata"]["model_type"] == config["model_type"] and w["metadata"]["tp_size"] == tp
        assert json.loads(w["metadata"]["architectures"]) == config["architectures"]
        info = json.loads(get(r.url, "/get_server_info")[1])
        assert info == json.loads(get(r.url, "/server_info")[1])
        assert (info["tp_size"], info["context_length"]) == (int(tp), config["n_positions"])
        model = json.loads(get(r.url, "/model_info")[1])
        assert Path(model["tokenizer_path"]) == DEMO.resolve() and model["is_generation"] is True
        assert json.loads(get(r.url, "/get_load")[1]) == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0,
                                                             "num_tokens": 0}]


def test_the_openai_client_through_the_router_gets_each_replicas_own_answer(fleet):
    router, replicas = fleet
    params = dict(model="demo_model", prompt="def add(a, b):\n    ", suffix="\n    return c\n", max_tokens=12,
                  temperature=0, n=2, logprobs=2)
    routed = router.client.completions.create(**params)
    direct = replicas[served_by(replicas, routed.id)].client.completions.create(**params)
    assert [c.text for c in routed.choices] == [c.text for c in direct.choices] and routed.choices[0].text
    for a, b in zip(routed.choices[0].logprobs.token_logprobs, direct.choices[0].logprobs.token_logprobs, strict=True):
        assert a == pytest.approx(b, abs=1e-4)  # the second was served from cached blocks: not bit for bit
    stream = router.client.completions.create(**{k: v for k, v in params.items() if k != "logprobs"}, stream=True)
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert list(texts.values()) == [c.text for c in direct.choices]
    # the router adds SGLang's chat fields (continue_final_message, separate_reasoning, ...) at their neutral values:
    # they pass, and the demo model's missing chat template is what refuses the request
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        router.client.chat.completions.create(model="demo_model", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="separate_reasoning=false is not supported"):
        router.client.chat.completions.create(model="demo_model", messages=[{"role": "user", "content": "hi"}],
                                              extra_body={"separate_reasoning": False})
    # a user's own SGLang extension at a value autotp does not implement: a 400 that names it
    with pytest.raises(openai.BadRequestError, match="ignore_eos=true is not supported"):
        router.client.completions.create(model="demo_model", prompt="x", max_tokens=2, extra_body={"ignore_eos": True})


def test_the_routers_merged_metrics_hold_every_replica_once_one_has_served(fleet):
    """/engine_metrics merges the replicas' /metrics; it failed ("Label names should agree") while one replica had
    no request_success_total sample and another had. By now only some replicas have served."""
    router, replicas = fleet
    status, text = get(router.url, "/engine_metrics")
    assert status == 200, text[:500]
    for r in replicas:
        for reason in ("stop", "length"):
            assert re.search(rf'^autotp_request_success_total{{finished_reason="{reason}",worker_addr="{r.url}"}} ',
                             text, re.M), r.url


def stream_first_rounds(router: Router, prompts: list[str]) -> list[str]:
    """Every user's first request at once, streamed, each still running while the others are routed (the router
    spreads prompts it has not seen over its least loaded workers). Returns the response ids."""
    ids: list[str | None] = [None] * len(prompts)
    errors: list[BaseException] = []

    def user(i: int) -> None:
        try:
            for chunk in router.client.completions.create(model="demo_model", prompt=prompts[i], max_tokens=100,
                                                          temperature=0, stream=True):
                ids[i] = chunk.id
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=user, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and all(ids), errors
    return ids


def user_prompts() -> list[str]:
    """Each user's file: a different ~1,000-character window of the same stdlib module."""
    import textwrap

    source = Path(textwrap.__file__).read_text()
    return [source[i * 3000:i * 3000 + 1000] for i in range(USERS)]


def test_each_users_requests_land_on_one_replica_which_serves_them_from_its_cache(fleet):
    router, replicas = fleet
    files = user_prompts()
    home = [served_by(replicas, rid) for rid in stream_first_rounds(router, files)]
    assert len(set(home)) > 1, home  # spread: otherwise one replica holding everyone would pass the next check
    before = [(metric(r.url, "prefix_cache_queries_total"), metric(r.url, "prefix_cache_hits_total")) for r in replicas]
    for k in range(1, 4):  # the user types: the same file and a few characters more
        for u in range(USERS):
            answer = router.client.completions.create(model="demo_model", prompt=files[u] + "\n    x" * k,
                                                      max_tokens=4, temperature=0)
            assert served_by(replicas, answer.id) == home[u], (u, k)
    queries = sum(metric(r.url, "prefix_cache_queries_total") - b[0] for r, b in zip(replicas, before, strict=True))
    hits = sum(metric(r.url, "prefix_cache_hits_total") - b[1] for r, b in zip(replicas, before, strict=True))
    assert hits / queries > 0.8, (hits, queries)  # each prompt found its user's file in its replica's cache


def test_flush_cache_through_the_router_empties_every_replicas_cache(fleet):
    router, replicas = fleet
    prompt = user_prompts()[0] + "\n    y"

    def hits_after_sending(replica: Server) -> float:
        replica.client.completions.create(model="demo_model", prompt=prompt, max_tokens=2, temperature=0)
        return metric(replica.url, "prefix_cache_hits_total")

    for r in replicas:  # sent to each replica directly: cached there
        assert hits_after_sending(r) < hits_after_sending(r)  # the control: the second send found the first's blocks
    status, body = post_empty(router.url, "/flush_cache")
    assert status == 200 and json.loads(body)["workers_flushed"] == len(replicas), body
    for r in replicas:
        before = metric(r.url, "prefix_cache_hits_total")
        assert hits_after_sending(r) == before  # computed cold


def test_a_flush_while_a_request_runs_is_refused_and_get_load_counts_it(fleet):
    _, replicas = fleet
    replica = replicas[0]
    stream = replica.client.completions.create(model="demo_model", prompt="def f(x):", max_tokens=400,
                                               temperature=0, stream=True)
    try:
        next(iter(stream))  # admitted and decoding: 400 tokens to go
        status, body = post_empty(replica.url, "/flush_cache")
        load = json.loads(get(replica.url, "/get_load")[1])[0]
    finally:
        stream.close()
    assert status == 400 and "requests are running" in json.loads(body)["error"]["message"], body
    assert load["num_reqs"] == 1 and load["num_tokens"] >= 4, load
    deadline = time.monotonic() + 30  # the cancelled row leaves at the replica's next step
    while json.loads(get(replica.url, "/get_load")[1])[0]["num_reqs"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert post_empty(replica.url, "/flush_cache")[0] == 200


def test_a_dead_replicas_users_are_served_by_the_others(fleet):
    """SIGKILL a replica that holds users: their next requests succeed on another replica (the router retries,
    and its circuit breaker opens after two failures), and its health checks mark the replica down."""
    router, replicas = fleet
    files = user_prompts()
    owners = {}
    for u in range(USERS):
        owners[u] = served_by(replicas, router.client.completions.create(
            model="demo_model", prompt=files[u] + "\n    z", max_tokens=2, temperature=0).id)
    dead = max(set(owners.values()), key=list(owners.values()).count)
    replicas[dead].kill()
    for k in range(3):
        for u in range(USERS):
            answer = router.client.completions.create(model="demo_model", prompt=files[u] + "\n    z" + "w" * k,
                                                      max_tokens=2, temperature=0)
            assert served_by(replicas, answer.id) != dead
    deadline = time.monotonic() + 30
    while next(w for w in router.workers() if w["url"] == replicas[dead].url)["is_healthy"]:
        assert time.monotonic() < deadline, "the router never marked the dead replica unhealthy"
        time.sleep(0.5)
