"""Serving under load, side by side: `autotp serve` (this tree and a baseline commit, 1 and 2 ranks) and
`transformers serve --continuous-batching` (servers.py), on the demo model or SmolLM2-135M, with one client
for all of them.

Three loads, every request streamed and greedy, through the `openai` client:
- head of line: one 300-token completion, then six 8-token ones at once while it runs: the short ones'
  time to first token (TTFT), and the long one's end-to-end time. The short ones are sent 1 s later (the
  issue's protocol) or at the long one's 100th token if that comes first: on a quiet machine a 1-rank
  server has finished 300 tokens of the demo model within the second, and nothing would wait behind it;
- mixed: 24 requests, Poisson arrivals at 6/s, max_tokens drawn from {8, 16, 64, 200} (seeded): TTFT p50
  and p99, end-to-end p99, streamed tokens per second over the whole load;
- throughput: 64-token completions at concurrency 1, 8 and 32 (max(16, 2 C) requests each).

    python benchmarks/serve_bench.py [--systems new:1 new:2 old:1 old:2 hf] [--baseline 6a1d188] [--model demo]

Prints a table, merges it into benchmarks/results/serve_bench[_MODEL].json under `runs`, keyed by --run.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import sys
import tempfile
import time
from pathlib import Path

from common import write_json
from servers import cpus, label, model_id, model_path, start, stop

HERE = Path(__file__).parent
PROMPTS = ["def print_hello_world():", "import os\n\ndef list_files(path):", "class Stack:\n    def push(self, x):",
           "for i in range(10):", "def fibonacci(n):", "with open(path) as f:", "def add(a, b):",
           "try:\n    import json\nexcept ImportError:"]


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
    parser.add_argument("--baseline", default="6a1d188", help="commit of the padded engine before the paged one")
    parser.add_argument("--model", default="demo", help="demo, smollm2 or a model directory")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--serve-args", default="", help="more `autotp serve` flags for new:N and old:N, "
                                                         "e.g. '--speculate 0'")
    parser.add_argument("--run", default=None, help="this run's key in the results file (default: the UTC time): "
                                                    "runs are kept side by side, a repeated key is replaced")
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as scratch:
        for system in args.systems:
            log = Path(scratch) / f"{re.sub(r'[^a-z0-9]', '_', system)}.log"
            proc, url = start(system, args.baseline, model_path(args.model), log, args.serve_args.split())
            try:
                rows[system] = asyncio.run(measure(url, args.concurrency))
            finally:
                stop(proc)
            print(f"{system}: done", file=sys.stderr, flush=True)
    print(f"{args.model} model, {cpus()} CPUs, streamed greedy completions")
    print(f"{'server':44} {'short TTFT':>10} {'sent at':>7} {'long e2e':>8} {'mixed TTFT p50/p99':>18} {'e2e p99':>7} "
          f"{'mixed tok/s':>11} " + " ".join(f"{'C=' + str(c) + ' tok/s':>11}" for c in args.concurrency))
    for system, r in rows.items():
        h, m = r["head_of_line"], r["mixed"]
        sent = f"{h['shorts_sent_after_s']:.2f}s" + ("" if h["long_was_running"] else "!")
        print(f"{label(system, args.baseline):44} {h['short_ttft_max_s']:>9.3f}s {sent:>7} {h['long_e2e_s']:>7.2f}s "
              f"{m['ttft_p50_s']:>8.3f} / {m['ttft_p99_s']:.3f}s {m['e2e_p99_s']:>6.2f}s {m['tokens_per_s']:>11.0f} "
              + " ".join(f"{t['tokens_per_s']:>11.0f}" for t in r["throughput"]))
    report = goals(rows)
    print("short TTFT: the slowest of the six; sent at: after the long one started (! = it had ended before a "
          "short one's first token)")
    print("\n".join(report))
    suffix = "" if args.model == "demo" else f"_{Path(args.model).name}"
    run = args.run or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_json(HERE / "results" / f"serve_bench{suffix}.json", {"runs": {run: {
        "cpus": cpus(), "baseline": args.baseline, "model": args.model, "serve_args": args.serve_args,
        "concurrency": args.concurrency, "rows": rows, "goals": report}}})


if __name__ == "__main__":
    main()
