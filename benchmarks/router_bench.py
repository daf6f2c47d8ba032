"""More than one server: editors against 2 replicas behind SGLang's router (`cache_aware`, `round_robin`) and
against 1 replica, with small KV caches, which is where routing decides whether prefix caching pays.

Workload: each user edits one file of Python's standard library (a ~1,000-character window of it), typing
forward: every request is the same start of the file plus a suffix that grows by `--grow` characters, a
streamed greedy completion of `--max-tokens` tokens, then a pause (seeded, 0.2-0.8 s) before the next; the users
run at once. Per configuration: first-token latency p50 / p90 over every request, completions (requests
answered whole), prompt tokens computed (looked up in the prefix cache and not found, summed over the
replicas' /metrics) and the prefix-cache hit rate, against the workload's maximum: every request after a
user's first finds the full blocks its previous prompt shares with it, and nothing more.

The replicas (`autotp serve`, one process each, OMP_NUM_THREADS = cores / 2) are started once; before each
configuration every replica's prefix cache is emptied (POST /flush_cache) and a router is started on loopback.
Greedy texts are compared across configurations.

    python benchmarks/router_bench.py [--model demo] [--users 4] [--requests 12] [--kv-cache-memory 1MiB]

Prints a table, merges its run into benchmarks/results/router_bench.json.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import random
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from pathlib import Path

from common import free_port
from servers import cpus, model_id, model_path, stop

HERE = Path(__file__).parent
FILES = ["textwrap.py", "json/decoder.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py", "base64.py",
         "calendar.py"]
START_TIMEOUT_S = 300
ROUTER_FLAGS = ["--health-check-interval-secs", "2", "--health-check-timeout-secs", "2", "--health-failure-threshold",
                "2", "--cb-failure-threshold", "2", "--cb-timeout-duration-secs", "30", "--log-level", "warn"]


def user_text(i: int, prefix_chars: int, tail_chars: int) -> tuple[str, str]:
    """A user's file: its start (~prefix_chars, from a line start) and what they type after it."""
    text = (Path(sysconfig.get_paths()["stdlib"]) / FILES[i % len(FILES)]).read_text()
    start = text.index("\n", len(text) // 3) + 1  # past the module docstring and imports: code
    return text[start:start + prefix_chars], text[start + prefix_chars:start + prefix_chars + tail_chars]


def launch(cmd: list[str], log: Path, env: dict) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_until(ready, proc: subprocess.Popen, log: Path, what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc, timeout=30)
            raise SystemExit(f"{what} did not start:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            if ready():
                return
        except (OSError, KeyError, IndexError, ValueError):
            pass
        time.sleep(0.5)


def replica(model: Path, kv: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, cpus() // 2)))
    proc = launch([sys.executable, "-m", "autotp", "serve", "--model", str(model), "--port", str(port),
                   "--kv-cache-memory", kv], log, env)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: model_id(url), proc, log, "a replica")
    return proc, url


def router(policy: str, workers: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = launch([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--policy", policy,
                   "--worker-urls", *workers, *ROUTER_FLAGS], log, dict(os.environ))
    url = f"http://127.0.0.1:{port}"

    def registered() -> bool:
        with urllib.request.urlopen(f"{url}/workers", timeout=5) as r:
            return sum(w["is_healthy"] for w in json.loads(r.read())["workers"]) == len(workers)

    wait_until(registered, proc, log, "the router")
    return proc, url


def flush(url: str) -> None:
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("POST", "/flush_cache")
        answer = connection.getresponse()
        assert answer.status == 200, answer.read()
    finally:
        connection.close()


def counters(urls: list[str]) -> dict[str, float]:
    out = {"queries": 0.0, "hits": 0.0}
    for url in urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            text = r.read().decode()
        for key, name in (("queries", "prefix_cache_queries_total"), ("hits", "prefix_cache_hits_total")):
            out[key] += float(re.search(rf"^autotp:{name} (\S+)$", text, re.M).group(1))
    return out


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def user(client, model: str, prompts: list[str], max_tokens: int, rng: random.Random) -> list[dict]:
    records = []
    for prompt in prompts:
        record: dict = {}
        t0 = time.monotonic()
        try:
            stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                     stream=True)
            text = ""
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    record.setdefault("first", time.monotonic() - t0)
                    text += chunk.choices[0].text
            record["text"] = text
        except Exception as e:  # noqa: BLE001 - counted: a request that did not complete
            record["error"] = f"{type(e).__name__}: {e}"[:200]
        records.append(record)
        await asyncio.sleep(rng.uniform(0.2, 0.8))
    return records


async def workload(url: str, model: str, users: list[list[str]], max_tokens: int) -> list[list[dict]]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        return await asyncio.gather(*[user(client, model, prompts, max_tokens, random.Random(i))
                                      for i, prompts in enumerate(users)])
    finally:
        await client.close()


def maximum_hits(tokenizer, users: list[list[str]], block: int) -> tuple[int, int]:
    """(prompt tokens a perfect router's replicas could find cached, all prompt tokens): each request after a user's
    first finds the full blocks of what it shares with the user's previous prompt (never its last token)."""
    found = total = 0
    for prompts in users:
        previous: list[int] = []
        for prompt in prompts:
            ids = tokenizer(prompt).input_ids
            common = min(len(ids), len(previous))
            shared = next((i for i in range(common) if ids[i] != previous[i]), common)
            found += min(shared, len(ids) - 1) // block * block
            total += len(ids)
            previous = ids
    return found, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="demo, smollm2 or a model directory")
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--requests", type=int, default=12, help="per user")
    parser.add_argument("--prefix-chars", type=int, default=1000)
    parser.add_argument("--grow", type=int, default=8, help="characters typed between two requests")
    parser.add_argument("--max-tokens", type=int, default=16)
    # the demo model's 768 bytes per token: 853 tokens, 53 blocks of 16, about two users' files (~350 tokens each
    # and the rows running): a replica that sees every user evicts, one that sees half of them need not
    parser.add_argument("--kv-cache-memory", default="0.625MiB", help="per replica (default: about two users' files "
                                                                       "of the demo model)")
    parser.add_argument("--configs", nargs="+", default=["cache_aware", "round_robin", "one"],
                        help="router policies over 2 replicas, and 'one': 1 replica, no router")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    path = model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    users = []
    for i in range(args.users):
        head, tail = user_text(i, args.prefix_chars, args.grow * args.requests)
        users.append([head + tail[:args.grow * k] for k in range(args.requests)])
    found, total = maximum_hits(tokenizer, users, 16)
    rows, texts = {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        logs = Path(scratch)
        replicas = [replica(path, args.kv_cache_memory, logs / f"replica{i}.log") for i in range(2)]
        try:
            urls = [url for _, url in replicas]
            model = model_id(urls[0])
            for config in args.configs:
                for url in urls:
                    flush(url)
                proc, url = (None, urls[0]) if config == "one" else router(config, urls, logs / f"{config}.log")
                try:
                    before = counters(urls)
                    records = asyncio.run(workload(url, model, users, args.max_tokens))
                    after = counters(urls)
                finally:
                    if proc is not None:
                        stop(proc, timeout=30)
                flat = [r for rs in records for r in rs]
                firsts = [r["first"] for r in flat if "first" in r]
                queries, hits = after["queries"] - before["queries"], after["hits"] - before["hits"]
                rows[config] = {"requests": len(flat), "completions": sum("text" in r for r in flat),
                                "errors": sorted({r["error"] for r in flat if "error" in r}),
                                "ttft_p50_s": quantile(firsts, 0.5), "ttft_p90_s": quantile(firsts, 0.9),
                                "prompt_tokens": queries, "prompt_tokens_computed": queries - hits,
                                "hit_rate": hits / queries if queries else float("nan")}
                texts[config] = [r.get("text") for r in flat]
                print(f"{config}: done", file=sys.stderr, flush=True)
        finally:
            for proc, _ in replicas:
                stop(proc, timeout=30)
    same = len({json.dumps(t) for t in texts.values()}) == 1
    print(f"{args.model}, {cpus()} CPUs: {args.users} users x {args.requests} requests ({args.prefix_chars}-character "
          f"file + {args.grow} characters per request, {args.max_tokens} new tokens, greedy, streamed), KV cache "
          f"{args.kv_cache_memory} per replica; workload maximum hit rate {found / total:.3f} ({found} of {total} "
          f"prompt tokens)")
    print(f"{'configuration':24} | TTFT p50 / p90 | completions | prompt tokens computed | hit rate")
    names = {"one": "1 replica", "cache_aware": "2 replicas, cache_aware", "round_robin": "2 replicas, round_robin"}
    for config, r in rows.items():
        print(f"{names.get(config, '2 replicas, ' + config):24} | {r['ttft_p50_s']:.3f} / {r['ttft_p90_s']:.3f} s | "
              f"{r['completions']} of {r['requests']} | {r['prompt_tokens_computed']:.0f} of "
              f"{r['prompt_tokens']:.0f} | {r['hit_rate']:.3f}")
    print(f"greedy texts identical in every configuration: {'yes' if same else 'no'}")
    out = HERE / "results" / "router_bench.json"
    merged = json.loads(out.read_text()) if out.exists() else {}
    key = f"{Path(args.model).name}_{args.users}x{args.requests}_kv{args.kv_cache_memory}"
    merged[key] = {"cpus": cpus(), "model": args.model, "users": args.users, "requests": args.requests,
                   "prefix_chars": args.prefix_chars, "grow": args.grow, "max_tokens": args.max_tokens,
                   "kv_cache_memory": args.kv_cache_memory, "max_hit_rate": found / total, "texts_identical": same,
                   "configs": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(merged, indent=2) + "\n")


if __name__ == "__main__":
    main()
