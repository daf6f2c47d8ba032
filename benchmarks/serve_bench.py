"""Serving under load, side by side: `autotp serve` (this tree and a baseline commit, 1 and 2 ranks) and
`transformers serve --continuous-batching`, on the demo model, with one client for all of them.

Three loads, every request streamed and greedy, through the `openai` client:
- head of line: one 300-token completion, then six 8-token ones at once while it runs: the short ones'
  time to first token (TTFT), and the long one's end-to-end time. The short ones are sent 1 s later (the
  issue's protocol) or at the long one's 100th token if that comes first: on a quiet machine a 1-rank
  server has finished 300 tokens of the demo model within the second, and nothing would wait behind it;
- mixed: 24 requests, Poisson arrivals at 6/s, max_tokens drawn from {8, 16, 64, 200} (seeded): TTFT p50
  and p99, end-to-end p99, streamed tokens per second over the whole load;
- throughput: 64-token completions at concurrency 1, 8 and 32 (max(16, 2 C) requests each).

The baseline is checked out under benchmarks/.cache/ (git worktree) and run from its own src/ with this
venv. transformers serve runs from its own venv (it needs `accelerate`, which autotp does not):

    python3 -m venv benchmarks/.cache/hf-serve
    benchmarks/.cache/hf-serve/bin/pip install torch==2.13.0 transformers==5.24.0 accelerate fastapi uvicorn openai
    python benchmarks/serve_bench.py [--systems new:1 new:2 old:1 old:2 hf] [--baseline 438d128]

Prints a table, writes benchmarks/results/serve_bench.json. OMP_NUM_THREADS = cores / ranks for every system.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from common import CACHE, free_port, write_json

HERE = Path(__file__).parent
ROOT = HERE.parent
DEMO = ROOT / "src" / "autotp" / "demo_model"
PROMPTS = ["def print_hello_world():", "import os\n\ndef list_files(path):", "class Stack:\n    def push(self, x):",
           "for i in range(10):", "def fibonacci(n):", "with open(path) as f:", "def add(a, b):",
           "try:\n    import json\nexcept ImportError:"]
START_TIMEOUT_S = 300


def cpus() -> int:
    return os.cpu_count() or 1


def baseline_tree(rev: str) -> Path:
    tree = CACHE / f"baseline-{rev}"
    if not (tree / "src" / "autotp").is_dir():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True,
                       capture_output=True)
    return tree


def command(system: str, port: int, baseline: str, hf_python: Path) -> tuple[list[str], dict]:
    """The server command line and environment for "new:N", "old:N" or "hf"."""
    env = dict(os.environ)
    if system == "hf":
        env["OMP_NUM_THREADS"] = str(cpus())
        exe = hf_python.parent / "transformers"
        return [str(exe), "serve", "--continuous-batching", "--device", "cpu", "--port", str(port), str(DEMO)], env
    kind, tp = system.split(":")
    env["OMP_NUM_THREADS"] = str(max(1, cpus() // int(tp)))
    slots = ["--max-num-seqs", "32"]
    if kind == "old":
        env["PYTHONPATH"] = str(baseline_tree(baseline) / "src")
        slots = ["--max-batch-size", "32"]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", tp, "--master-port", str(free_port()),
            "-m", "autotp", "serve", "--model", str(DEMO), "--port", str(port), *slots], env


def start(system: str, baseline: str, hf_python: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd, env = command(system, port, baseline, hf_python)
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


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def one(client, model: str, prompt: str, max_tokens: int, at_piece: tuple[int, asyncio.Event] | None = None
              ) -> dict:
    """A streamed greedy completion: TTFT (first non-empty text), end-to-end time, completion tokens, and the
    clock when it ended. at_piece (n, event): set the event once n text chunks have arrived."""
    t0 = time.monotonic()
    first, tokens, pieces = None, 0, 0
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            pieces += 1
            if at_piece is not None and pieces == at_piece[0]:
                at_piece[1].set()
            if first is None:
                first = time.monotonic() - t0
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    end = time.monotonic() - t0
    return {"ttft": first if first is not None else end, "e2e": end, "tokens": tokens or pieces, "sent": t0,
            "first_at": t0 + (first if first is not None else end), "ended": t0 + end}


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def head_of_line(client, model: str) -> dict:
    hundredth = asyncio.Event()
    long = asyncio.create_task(one(client, model, PROMPTS[0], 300, (100, hundredth)))
    try:
        await asyncio.wait_for(hundredth.wait(), timeout=1.0)
    except asyncio.TimeoutError:
        pass
    shorts = await asyncio.gather(*(one(client, model, p, 8) for p in PROMPTS[1:7]))
    lone = await long
    alone = await one(client, model, PROMPTS[1], 8)  # nothing else running: its own prefill and first step
    itl = lone["e2e"] / max(1, lone["tokens"])
    return {"short_ttft_median_s": quantile([s["ttft"] for s in shorts], 0.5),
            "short_ttft_max_s": max(s["ttft"] for s in shorts), "long_e2e_s": lone["e2e"],
            "long_tokens": lone["tokens"], "long_itl_s": itl, "short_alone_ttft_s": alone["ttft"],
            "shorts_sent_after_s": min(s["sent"] for s in shorts) - lone["sent"],
            "long_was_running": all(s["first_at"] < lone["ended"] for s in shorts)}


async def mixed(client, model: str, requests: int = 24, rate: float = 6.0, seed: int = 0) -> dict:
    rng = random.Random(seed)
    gaps = [rng.expovariate(rate) for _ in range(requests)]
    budgets = [rng.choice([8, 16, 64, 200]) for _ in range(requests)]
    start = time.monotonic()
    tasks = []
    for i in range(requests):
        tasks.append(asyncio.create_task(one(client, model, PROMPTS[i % len(PROMPTS)], budgets[i])))
        await asyncio.sleep(gaps[i])
    done = await asyncio.gather(*tasks)
    wall = time.monotonic() - start
    ttft = [d["ttft"] for d in done]
    return {"ttft_p50_s": quantile(ttft, 0.5), "ttft_p99_s": quantile(ttft, 0.99),
            "e2e_p99_s": quantile([d["e2e"] for d in done], 0.99),
            "tokens_per_s": sum(d["tokens"] for d in done) / wall, "wall_s": wall}


async def throughput(client, model: str, concurrency: int, max_tokens: int = 64) -> dict:
    requests = max(16, 2 * concurrency)
    queue = list(range(requests))
    results = []

    async def worker():
        while queue:
            i = queue.pop()
            results.append(await one(client, model, PROMPTS[i % len(PROMPTS)], max_tokens))

    start = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.monotonic() - start
    return {"concurrency": concurrency, "requests": requests, "tokens_per_s": sum(r["tokens"] for r in results) / wall,
            "requests_per_s": requests / wall, "e2e_p50_s": quantile([r["e2e"] for r in results], 0.5)}


async def measure(url: str, levels: list[int]) -> dict:
    import openai

    model = model_id(url)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    try:
        await one(client, model, PROMPTS[0], 8)  # warm-up
        out = {"head_of_line": await head_of_line(client, model), "mixed": await mixed(client, model)}
        out["throughput"] = [await throughput(client, model, c) for c in levels]
        return out
    finally:
        await client.close()


def goals(rows: dict) -> list[str]:
    """The issue's goals, each met or not, with the figures."""
    lines = []
    hf = rows.get("hf")
    for system in ("new:1", "new:2"):
        if system not in rows:
            continue
        h = rows[system]["head_of_line"]
        bound = 0.1 if system == "new:1" else 2 * h["long_itl_s"] + h["short_alone_ttft_s"]
        what = "0.1 s" if system == "new:1" else (f"2 decode steps ({h['long_itl_s'] * 1e3:.0f} ms each) + its own "
                                                   f"prefill ({h['short_alone_ttft_s']:.3f} s alone) = {bound:.3f} s")
        met = h["short_ttft_max_s"] <= bound
        lines.append(f"{system} short TTFT while a long one runs: max {h['short_ttft_max_s']:.3f} s, goal {what}: "
                     f"{'met' if met else 'NOT met'}")
    if hf and "new:1" in rows:
        ours, theirs = rows["new:1"]["mixed"]["ttft_p99_s"], hf["mixed"]["ttft_p99_s"]
        lines.append(f"new:1 mixed TTFT p99 {ours:.3f} s vs transformers serve {theirs:.3f} s x 1.5 = "
                     f"{1.5 * theirs:.3f} s: {'met' if ours <= 1.5 * theirs else 'NOT met'}")
        c32 = {s: next((t for t in rows[s]["throughput"] if t["concurrency"] == 32), None) for s in rows}
        if c32.get("new:1") and c32.get("hf"):
            ours, theirs = c32["new:1"]["tokens_per_s"], c32["hf"]["tokens_per_s"]
            lines.append(f"new:1 throughput at concurrency 32 {ours:.0f} tokens/s vs transformers serve {theirs:.0f}: "
                         f"{'met' if ours >= theirs else 'NOT met'}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", nargs="+", default=["new:1", "new:2", "old:1", "old:2", "hf"])
    parser.add_argument("--baseline", default="438d128", help="commit of the engine before continuous batching")
    parser.add_argument("--hf-python", type=Path, default=CACHE / "hf-serve" / "bin" / "python")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as scratch:
        for system in args.systems:
            log = Path(scratch) / f"{re.sub(r'[^a-z0-9]', '_', system)}.log"
            proc, url = start(system, args.baseline, args.hf_python, log)
            try:
                rows[system] = asyncio.run(measure(url, args.concurrency))
            finally:
                stop(proc)
            print(f"{system}: done", file=sys.stderr, flush=True)
    names = {"new:1": "autotp serve (continuous), 1 rank", "new:2": "autotp serve (continuous), 2 ranks",
             "old:1": f"autotp serve ({args.baseline}), 1 rank", "old:2": f"autotp serve ({args.baseline}), 2 ranks",
             "hf": "transformers serve --continuous-batching"}
    print(f"demo model, {cpus()} CPUs, streamed greedy completions")
    print(f"{'server':44} {'short TTFT':>10} {'sent at':>7} {'long e2e':>8} {'mixed TTFT p50/p99':>18} {'e2e p99':>7} "
          f"{'mixed tok/s':>11} " + " ".join(f"{'C=' + str(c) + ' tok/s':>11}" for c in args.concurrency))
    for system, r in rows.items():
        h, m = r["head_of_line"], r["mixed"]
        sent = f"{h['shorts_sent_after_s']:.2f}s" + ("" if h["long_was_running"] else "!")
        print(f"{names.get(system, system):44} {h['short_ttft_max_s']:>9.3f}s {sent:>7} {h['long_e2e_s']:>7.2f}s "
              f"{m['ttft_p50_s']:>8.3f} / {m['ttft_p99_s']:.3f}s {m['e2e_p99_s']:>6.2f}s {m['tokens_per_s']:>11.0f} "
              + " ".join(f"{t['tokens_per_s']:>11.0f}" for t in r["throughput"]))
    report = goals(rows)
    print("short TTFT: the slowest of the six; sent at: after the long one started (! = it had ended before a "
          "short one's first token)")
    print("\n".join(report))
    write_json(HERE / "results" / "serve_bench.json", {"cpus": cpus(), "baseline": args.baseline, "rows": rows,
                                                       "goals": report})


if __name__ == "__main__":
    main()
