"""`autotp serve` at its limits, as clients see them: a full queue is 429, a request that could never fit
the KV cache is 400, a prompt longer than the step's token budget is prefilled in chunks; and chat on a
model whose tokenizer has no chat template is 400.

One 2-rank server for the module with one sequence slot, a queue of one, 16 tokens per step and a KV
cache of 96 tokens per rank (the tiny model caches 256 bytes per token on each rank: 2 layers, one
16-wide K/V head, float32).
"""

import json
import re
import subprocess
import sys
import threading
import time
import urllib.request

import fim_model
import openai
import pytest
from pool import free_port
from serve_harness import ENV, Server


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return fim_model.build(tmp_path_factory.mktemp("fim"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = Server(model_dir, tmp_path_factory.mktemp("serve") / "server.log", "--max-num-seqs", "1", "--max-queue", "1",
               "--max-num-batched-tokens", "16", "--kv-cache-memory", "24KiB")
    yield s
    s.kill()


def test_the_budgets_are_announced(server):
    assert re.search(r"KV cache: 96 tokens per rank \(24\.0 KiB at 256 bytes per token, sized by --kv-cache-memory; "
                     r"6 blocks of 16, prefix "
                     r"caching on, speculation up to 4 tokens\), less than the context of 128: longer requests "
                     r"are refused",
                     server.text()), \
        server.text()[-2000:]


def test_a_request_that_could_never_fit_the_cache_is_400_at_once(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model=server.model_id, prompt="def add(a, b):", max_tokens=92)
    assert "can never fit the KV cache of 96 tokens per rank" in e.value.message
    assert server.client.completions.create(model=server.model_id, prompt="x", max_tokens=2).usage.completion_tokens


def test_a_request_that_exactly_fits_the_cache_is_answered_and_the_next_one_too(server):
    """prompt + max_tokens - 1 slots is a row's whole life (its last token is never fed back): 4 prompt tokens and
    93 new ones fill the 96 slots exactly. It is served, and a request sent after it is answered; one token more
    is 400 at once."""
    prompt = [5, 6, 7, 8]
    with pytest.raises(openai.BadRequestError, match="can never fit the KV cache of 96 tokens per rank"):
        server.client.completions.create(model=server.model_id, prompt=prompt, max_tokens=94)
    exact = server.client.completions.create(model=server.model_id, prompt=prompt, max_tokens=93, temperature=0)
    assert exact.choices[0].finish_reason in ("length", "stop")
    assert server.client.completions.create(model=server.model_id, prompt="x", max_tokens=3).usage.completion_tokens


def test_the_routers_load_counts_the_waiting_requests_and_their_prompts(server):
    """SGLang's router sums /get_load's num_tokens and reads num_reqs: a running request and one waiting behind it
    are two, and the waiting one's prompt tokens count with the running one's KV slots."""
    running = server.client.completions.create(model=server.model_id, prompt="def f(x):", max_tokens=60,
                                               temperature=0, stream=True)
    chunks = iter(running)
    next(chunks)  # the one sequence slot is taken
    waiter = threading.Thread(target=lambda: server.client.completions.create(
        model=server.model_id, prompt=[5, 6, 7, 8, 9, 10, 11], max_tokens=2, temperature=0))
    waiter.start()
    try:
        deadline = time.monotonic() + 30
        while waiting(server) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with urllib.request.urlopen(server.url + "/get_load", timeout=10) as r:
            (load,) = json.loads(r.read())
    finally:
        for _ in chunks:
            pass
        waiter.join(timeout=60)
    assert (load["num_reqs"], load["num_waiting_reqs"]) == (2, 1)
    assert load["num_tokens"] >= 16 + 7  # at least one block of the running row, and the waiting row's 7 tokens


def waiting(server) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    return families["autotp:num_requests_waiting"].samples[0].value


def test_past_the_queue_a_request_gets_429_with_retry_after_and_the_admitted_ones_finish(server):
    running = server.client.completions.create(model=server.model_id, prompt="def f(x):", max_tokens=80,
                                               temperature=0, stream=True)
    chunks = iter(running)
    first = next(chunks)  # the one sequence slot is taken
    queued = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    result = {}
    waiter = threading.Thread(target=lambda: result.update(r=queued.completions.create(
        model=server.model_id, prompt="x", max_tokens=3, temperature=0)))  # greedy: no EOS drawn by chance
    waiter.start()
    try:
        deadline = time.monotonic() + 30
        while waiting(server) < 1:  # the second request sits in the queue of one
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(openai.RateLimitError) as refused:
            server.client.completions.create(model=server.model_id, prompt="y", max_tokens=1)
    finally:
        rest = "".join(c.choices[0].text for c in chunks if c.choices)
        waiter.join(timeout=60)
    e = refused.value
    assert e.status_code == 429 and e.response.headers["retry-after"] == "1"
    assert e.body["code"] == "rate_limit_exceeded" and "--max-queue" in e.message
    assert result["r"].usage.completion_tokens == 3 and first.choices[0].text + rest
    assert re.search(r"status=429 ", server.text())


def test_a_prompt_longer_than_a_step_is_prefilled_in_chunks_and_gives_the_unchunked_text(server, model_dir):
    prompt = "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n"
    out = server.client.completions.create(model=server.model_id, prompt=prompt, max_tokens=8, temperature=0)
    assert out.usage.prompt_tokens > 16  # more than one step's 16 tokens
    cli = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(free_port()), "-m", "autotp", "generate", "--model", model_dir, "--prompt", prompt,
                          "--max-new-tokens", "8", "--json"], capture_output=True, text=True, timeout=120, env=ENV)
    assert cli.returncode == 0, cli.stderr
    assert out.choices[0].text == json.loads(cli.stdout)["text"]


def test_chat_without_a_chat_template_is_400(server):
    with pytest.raises(openai.BadRequestError, match="has no chat template: send the prompt to /v1/completions"):
        server.client.chat.completions.create(model=server.model_id, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2)


@pytest.mark.parametrize("value", ["0", "1.5", "90"])  # 90: a percentage where vLLM's flag takes a fraction
def test_a_gpu_memory_utilization_outside_0_to_1_is_refused_in_one_line(value):
    out = subprocess.run([sys.executable, "-m", "autotp", "serve", "--gpu-memory-utilization", value],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.splitlines() == [
        f"autotp: error: argument --gpu-memory-utilization: must be in (0, 1], got {float(value)}"]


def cpu_budget(tp: int) -> tuple[int, int] | None:
    """A pool task: this rank's KV budget on CPU (startup/budget.size without --kv-cache-memory), with the host's
    available memory read as 8 GiB; -> (its bytes, tp) on rank 0."""
    import torch
    import torch.distributed as dist
    from checkpoints import build

    from autotp.serve.lockstep.wire import Channel
    from autotp.serve.options import ServeOptions
    from autotp.serve.runner.attention.sdpa import Sdpa
    from autotp.serve.startup import budget
    from autotp.serve.startup.host_memory import Room

    budget.room = lambda: Room(8 * 2**30)
    channel = Channel()
    try:
        opts = ServeOptions(max_num_seqs=10**6, max_num_batched_tokens=10**6)  # so memory, not the rows, sizes it
        cache = budget.size(build("mqa12"), channel, dist.get_rank(), torch.device("cpu"), opts, 64, Sdpa)
    finally:
        channel.close()
    return (cache.tokens * cache.per_token, tp) if dist.get_rank() == 0 else None


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_the_ranks_of_one_host_share_half_its_available_memory_for_the_cache(pools, tp):
    """On CPU the cache may hold half of what the host has available, shared by the host's ranks: at tp 4 the
    ranks together take 0.5x, never 4 x 0.5x, whatever the launcher says of the local world size."""
    got, _ = pools(tp).run(cpu_budget, tp)[0]
    assert 8 * 2**30 * 0.5 / tp - 64 * 4096 <= got <= 8 * 2**30 * 0.5 / tp  # whole blocks of a few KiB


def cgroup_budget(tp: int) -> tuple[int, list[str]] | None:
    """A pool task: budget.size on CPU with the host's room read as 8 GiB on every rank but the last, which sits in a
    cgroup whose 3 GiB limit leaves it 2 GiB; -> (rank 0's cache bytes, its start-up lines) on rank 0."""
    import torch
    import torch.distributed as dist
    from checkpoints import build

    from autotp.serve.lockstep.wire import Channel
    from autotp.serve.options import ServeOptions
    from autotp.serve.runner.attention.sdpa import Sdpa
    from autotp.serve.startup import budget
    from autotp.serve.startup.host_memory import Room

    budget.room = lambda: Room(2 * 2**30, 3 * 2**30) if dist.get_rank() == tp - 1 else Room(8 * 2**30)
    said: list[str] = []
    budget.log = said.append
    channel = Channel()
    try:
        opts = ServeOptions(max_num_seqs=10**6, max_num_batched_tokens=10**6)
        cache = budget.size(build("mqa12"), channel, dist.get_rank(), torch.device("cpu"), opts, 64, Sdpa)
    finally:
        channel.close()
    return (cache.tokens * cache.per_token, said) if dist.get_rank() == 0 else None


def test_the_rank_with_the_least_room_sizes_every_ranks_cache_and_its_line_names_the_cgroup(pools):
    """One host's ranks in different cgroups (or ranks of several hosts): the tightest room decides for all, and the
    start-up line that rank 0 writes says what sized it, though rank 0's own room was the host's MemAvailable."""
    got, said = pools(2).run(cgroup_budget, 2)[0]
    assert 2 * 2**30 * 0.5 / 2 - 64 * 4096 <= got <= 2 * 2**30 * 0.5 / 2
    assert "sized by half the cgroup's 3.0 GiB memory limit less its use, shared by the host's ranks;" in said[0], said
