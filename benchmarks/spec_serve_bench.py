"""Speculation through the server under load: `autotp serve --speculate K` against `--speculate 0`, the same
code-edit requests, greedy, at concurrency 8 and 32: tokens per second over the load, and whether every text
is the one without drafts.

The requests are spec_bench.py's edit workload, as an editor's "rename this function" sends it: a function of
autotp's serve/ package and, through the instruct model's chat template, the start of its rewrite with the
name changed; the completion copies the rest, which prompt-lookup drafting predicts. 2 x C requests of 128
new tokens each at concurrency C (C workers, each sending its next request as the last one ends), token-id
prompts through the `openai` client. A run starts each server once (off and on, the order alternating from
run to run, since this machine drifts) and measures every concurrency on it.

    python benchmarks/spec_serve_bench.py [--model smollm2] [--k 4] [--concurrency 8 32] [--runs 3]
        [--baseline REV]

--baseline REV compares two engines instead, both at --speculate K: REV's (servers.py's "old:1", a worktree)
as "off" and this tree's as "on" (a change to how drafts are scheduled, measured on the same load).
Prints a table, merges it into benchmarks/results/spec_serve_bench.json under `runs`, keyed by --run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import write_json
from servers import cpus, model_id, model_path, start, stop
from spec_bench import prompts

HERE = Path(__file__).parent
NEW_TOKENS = 128


def edit_prompts(path: Path, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    chat = tok.chat_template is not None
    edits = prompts(tok, chat, count)["edit"]
    return [ids[-(512 - NEW_TOKENS - 8):] for ids in edits]  # the demo model's context is 512


async def load(url: str, edits: list[list[int]], concurrency: int) -> dict:
    """2 x concurrency requests, `concurrency` at a time: tokens per second and each request's text."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=900)
    model = model_id(url)
    queue = list(range(2 * concurrency))
    texts, tokens = {}, [0]

    async def worker():
        while queue:
            i = queue.pop(0)
            r = await client.completions.create(model=model, prompt=edits[i % len(edits)], max_tokens=NEW_TOKENS,
                                                temperature=0)
            texts[i] = r.choices[0].text
            tokens[0] += r.usage.completion_tokens

    try:
        await client.completions.create(model=model, prompt=edits[0], max_tokens=8, temperature=0)  # warm-up
        start_at = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.monotonic() - start_at
    finally:
        await client.close()
    return {"tokens_per_s": tokens[0] / wall, "tokens": tokens[0], "wall_s": wall,
            "texts": [texts[i] for i in sorted(texts)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="demo, smollm2 or a model directory")
    parser.add_argument("--k", type=int, default=4, help="--speculate K of the server with drafts")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--run", default=None, help="this run's key in the results file (default: the UTC time)")
    parser.add_argument("--baseline", default=None, help="a commit: its engine against this tree's, both at K")
    parser.add_argument("--dtype", default=None, help="serve's --dtype (default: its own choice, bfloat16 on a CPU "
                                                      "with native bfloat16, where a different batch can flip a tie)")
    args = parser.parse_args()
    path = model_path(args.model)
    edits = edit_prompts(path, 8)
    # "off" and "on": (system, --speculate)
    systems = ({"off": ("new:1", 0), "on": ("new:1", args.k)} if args.baseline is None else
               {"off": ("old:1", args.k), "on": ("new:1", args.k)})
    names = ({"off": "--speculate 0", "on": f"--speculate {args.k}"} if args.baseline is None else
             {"off": f"{args.baseline}, K={args.k}", "on": f"this tree, K={args.k}"})
    samples = {(s, c): [] for s in systems for c in args.concurrency}
    same = True
    with tempfile.TemporaryDirectory() as scratch:
        for run in range(args.runs):
            order = ("off", "on") if run % 2 == 0 else ("on", "off")
            texts = {}
            for side in order:
                system, k = systems[side]
                proc, url = start(system, args.baseline or "", path, Path(scratch) / f"{side}.log",
                                  ["--speculate", str(k), *(["--dtype", args.dtype] if args.dtype else [])])
                try:
                    for c in args.concurrency:
                        got = asyncio.run(load(url, edits, c))
                        samples[side, c].append(got["tokens_per_s"])
                        texts[side, c] = got["texts"]
                finally:
                    stop(proc)
                print(f"run {run + 1}, {names[side]}: done", file=sys.stderr, flush=True)
            same = same and all(texts["off", c] == texts["on", c] for c in args.concurrency)
    rows = []
    for c in args.concurrency:
        off, on = samples["off", c], samples["on", c]
        rows.append({"concurrency": c, "off_tok_s": off, "on_tok_s": on,
                     "ratio_median": statistics.median(on) / statistics.median(off),
                     "ratios": [b / a for a, b in zip(off, on, strict=True)]})
    print(f"{args.model} model, {cpus()} CPUs, 1 rank, code-edit requests, greedy, {NEW_TOKENS} new tokens, "
          f"{args.runs} runs (median, min-max)")
    print(f"{'concurrency':>11} {names['off'] + ' tok/s':>24} {names['on'] + ' tok/s':>24} {'on / off':>18}")
    for r in rows:
        off, on = r["off_tok_s"], r["on_tok_s"]
        print(f"{r['concurrency']:>11} {statistics.median(off):>8.1f} ({min(off):.1f}-{max(off):.1f}) "
              f"{statistics.median(on):>10.1f} ({min(on):.1f}-{max(on):.1f}) {r['ratio_median']:>8.2f}x "
              f"({min(r['ratios']):.2f}-{max(r['ratios']):.2f})")
    print(f"every text the same on both servers: {same}")
    key = args.run or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_json(HERE / "results" / "spec_serve_bench.json", {"runs": {key: {
        "cpus": cpus(), "model": args.model, "k": args.k, "new_tokens": NEW_TOKENS, "runs": args.runs,
        "off": names["off"], "on": names["on"], "dtype": args.dtype or "serve's choice",
        "rows": rows, "same_text": same}}})


if __name__ == "__main__":
    main()
