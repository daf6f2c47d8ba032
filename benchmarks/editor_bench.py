"""Editors typing against a server, and the prefix sweep: what prefix caching is for.

Editor workload. Each editor types through a real source file (a module of Python's standard library):
a burst of 1-4 characters (80 ms apart), then a pause; 150 ms into the pause it sends a streamed
completion of the file up to the cursor (the prompt grows from `--prompt-tokens` tokens with every burst,
as llm-vscode and Continue send it), `--max-tokens` tokens, greedy; when the user types again, the request
still running is cancelled (the connection dropped), as editors do. The pauses are drawn (seeded) from
0.3-3 s, the same schedule for every server. Per server: time to first token p50 / p90 over the
requests that saw one, how many saw one, and how many completions arrived whole before the user typed
again ("in time").

Prefix sweep. A prompt of P tokens (text) is sent once (1 token), then the same text with 8 more tokens: its
time to first token, the median of `--repeats`, for P from 128 up: with prefix caching the second
request computes only its new tokens, so its time should not grow with P.

    python benchmarks/editor_bench.py [--model demo|smollm2] [--systems new:1 new:2 old:1 old:2 hf] [--editors 1 3]

Prints a table, merges it into benchmarks/results/editor_bench_MODEL.json (under runs/RUN with --run). Servers:
servers.py.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import sys
import sysconfig
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from common import write_json
from servers import cpus, label, model_id, model_path, start, stop

HERE = Path(__file__).parent
FILES = ["textwrap.py", "json/decoder.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py"]
CHAR_S = 0.08  # between two keystrokes of a burst
DEBOUNCE_S = 0.15  # the editor waits this long into a pause before it asks
PAUSE_S = (0.3, 3.0)


def source(i: int) -> str:
    return (Path(sysconfig.get_paths()["stdlib"]) / FILES[i % len(FILES)]).read_text()


def cursor_at(tokenizer, text: str, tokens: int) -> int:
    """The character offset where the text before it first holds at least `tokens` tokens."""
    low, high = 0, len(text)
    while low < high:
        mid = (low + high) // 2
        if len(tokenizer(text[:mid]).input_ids) < tokens:
            low = mid + 1
        else:
            high = mid
    return low


async def request(client, model: str, prompt: str, max_tokens: int, record: dict) -> None:
    """A streamed greedy completion; fills record with sent and done (its clock) and first (s after sending)."""
    t0 = record["sent"] = time.monotonic()
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True)
    try:
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text and "first" not in record:
                record["first"] = time.monotonic() - t0
        record["done"] = time.monotonic()
    finally:
        await stream.close()


async def typist(cursor: int, bursts: int, rng: random.Random, ask: Callable[[int, dict], Awaitable]) -> list[dict]:
    """The typing schedule: `bursts` times, a burst of keystrokes, then a pause into which, DEBOUNCE_S in, ask(cursor,
    record) is sent; the next keystroke cancels it (its record's "typed_at"). Each request's record, in order."""
    records: list[dict] = []
    running: asyncio.Task | None = None
    for _ in range(bursts):
        for _ in range(rng.randint(1, 4)):  # a burst: the running request is cancelled at its first keystroke
            if running is not None:
                running.cancel()
                records[-1]["typed_at"] = time.monotonic()
                running = None
            cursor += 1
            await asyncio.sleep(CHAR_S)
        pause = rng.uniform(*PAUSE_S)
        await asyncio.sleep(DEBOUNCE_S)
        records.append({})
        running = asyncio.create_task(ask(cursor, records[-1]))
        await asyncio.sleep(pause - DEBOUNCE_S)
    if running is not None:
        records[-1]["typed_at"] = time.monotonic()
        running.cancel()
    await asyncio.gather(running, return_exceptions=True)
    return records


async def editor(client, model: str, text: str, cursor: int, bursts: int, max_tokens: int, rng: random.Random
                 ) -> list[dict]:
    return await typist(cursor, bursts, rng,
                        lambda at, record: request(client, model, text[:at], max_tokens, record))


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def editors(url: str, tokenizer, count: int, bursts: int, prompt_tokens: int, max_tokens: int) -> dict:
    import openai

    model = model_id(url)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    try:
        await client.completions.create(model=model, prompt="def f(x):", max_tokens=4, temperature=0)  # warm-up
        jobs = []
        for i in range(count):
            text = source(i)
            jobs.append(editor(client, model, text, cursor_at(tokenizer, text, prompt_tokens), bursts, max_tokens,
                               random.Random(i)))
        records = [r for rs in await asyncio.gather(*jobs) for r in rs]
    finally:
        await client.close()
    firsts = [r["first"] for r in records if "first" in r]
    in_time = sum("done" in r and r["done"] <= r.get("typed_at", float("inf")) for r in records)
    wholes = [r["done"] - r["sent"] for r in records if "done" in r]  # completions that ran to their end
    return {"requests": len(records), "saw_first": len(firsts), "in_time": in_time,
            "ttft_p50_s": quantile(firsts, 0.5), "ttft_p90_s": quantile(firsts, 0.9),
            "whole_p50_s": quantile(wholes, 0.5)}


async def sweep(url: str, tokenizer, lengths: list[int], repeats: int) -> list[dict]:
    import openai

    model = model_id(url)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    text = "".join(source(i) for i in range(len(FILES)))
    ids = tokenizer(text).input_ids
    out = []
    try:
        for length in lengths:
            times = []
            for r in range(repeats):
                at = r * 7 + length  # a new prefix each repeat: nothing cached before its first send
                base = tokenizer.decode(ids[r * 7:at])
                await client.completions.create(model=model, prompt=base, max_tokens=1, temperature=0)
                t0 = time.monotonic()
                stream = await client.completions.create(model=model, prompt=base + tokenizer.decode(ids[at:at + 8]),
                                                         max_tokens=1, temperature=0, stream=True)
                first = None
                async for chunk in stream:
                    if chunk.choices and first is None:
                        first = time.monotonic() - t0
                times.append(first)
            out.append({"prefix_tokens": length, "ttft_median_s": quantile(times, 0.5), "ttft_s": times})
    finally:
        await client.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="demo, smollm2 or a model directory")
    parser.add_argument("--systems", nargs="+", default=["new:1", "new:2", "old:1", "old:2", "hf"])
    parser.add_argument("--baseline", default="6a1d188", help="commit of the padded engine")
    parser.add_argument("--editors", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--bursts", type=int, default=36, help="requests per editor")
    parser.add_argument("--prompt-tokens", type=int, help="the first prompt's size (default: 700, demo 300)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--sweep", type=int, nargs="*", help="prefix lengths (default 128 512 1024 2048, demo "
                                                             "128 256 448)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--run", help="keep this run under runs/RUN in the results file (default: the file's top "
                                      "level, where RESULTS.md's paged-engine tables come from)")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    path = model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    demo = args.model == "demo"
    prompt_tokens = args.prompt_tokens or (300 if demo else 700)
    lengths = args.sweep if args.sweep is not None else ([128, 256, 448] if demo else [128, 512, 1024, 2048])
    rows = {}
    with tempfile.TemporaryDirectory() as scratch:
        for system in args.systems:
            log = Path(scratch) / f"{re.sub(r'[^a-z0-9]', '_', system)}.log"
            proc, url = start(system, args.baseline, path, log)
            try:
                rows[system] = {f"editors_{n}": asyncio.run(editors(url, tokenizer, n, args.bursts, prompt_tokens,
                                                                    args.max_tokens)) for n in args.editors}
                rows[system]["sweep"] = asyncio.run(sweep(url, tokenizer, lengths, args.repeats)) if lengths else []
            finally:
                stop(proc)
            print(f"{system}: done", file=sys.stderr, flush=True)
    print(f"{args.model}, {cpus()} CPUs: editors typing ({args.bursts} requests each, first prompt {prompt_tokens} "
          f"tokens, {args.max_tokens} new, cancelled on the next keystroke)")
    head = " | ".join(f"{n} editor{'s' if n > 1 else ''}: TTFT p50 / p90, saw first, in time" for n in args.editors)
    print(f"{'server':42} | {head}")
    for system, r in rows.items():
        cells = " | ".join(f"{e['ttft_p50_s']:.3f} / {e['ttft_p90_s']:.3f} s, {e['saw_first']} of {e['requests']}, "
                           f"{e['in_time']} of {e['requests']}" for e in (r[f"editors_{n}"] for n in args.editors))
        print(f"{label(system, args.baseline):42} | {cells}")
    if lengths:
        print(f"\nprefix sweep: TTFT of a cached prompt + 8 tokens (median of {args.repeats})")
        print(f"{'server':42} | " + " | ".join(f"{n:>6}" for n in lengths) + " | ratio last/first")
        for system, r in rows.items():
            t = [s["ttft_median_s"] for s in r["sweep"]]
            cells = " | ".join(f"{x:6.3f}" for x in t)
            print(f"{label(system, args.baseline):42} | {cells} | {t[-1] / t[0]:.2f}")
    run = {"cpus": cpus(), "model": args.model, "baseline": args.baseline, "prompt_tokens": prompt_tokens,
           "max_tokens": args.max_tokens, "bursts": args.bursts, "rows": rows}
    write_json(HERE / "results" / f"editor_bench_{Path(args.model).name}.json", {"runs": {args.run: run}} if args.run
               else run)


if __name__ == "__main__":
    main()
