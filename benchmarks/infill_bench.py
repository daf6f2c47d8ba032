"""The editor trace as llama.vim sends it, against autotp serve and llama.cpp's llama-server on the same weights.

Each editor types through a source file with editor_bench.py's schedule (bursts of 1-4 keystrokes 80 ms apart, a
pause of 0.3-3 s, the same seeded schedule for every server), two other files open. As llama.vim
(ggml-org/llama.vim, autoload/llama.vim) does:
- every second, a "prepare" request: /infill with n_predict 0, an empty prefix and suffix and `input_extra` the ring
  of chunks (here the two other files' first RING_LINES lines, as llama.vim's ring picks a file's chunk on entering
  it), so that the next completion finds them computed;
- 150 ms into a pause (its debounce), the completion: input_prefix the N_PREFIX lines before the cursor's line,
  input_suffix the rest of the line and the N_SUFFIX lines after it, prompt the cursor's line up to the cursor,
  input_extra the ring, n_predict 128, t_max_predict_ms 250, top_k 40, top_p 0.90, samplers [top_k, top_p, infill],
  the llama.vim request's other fields as it sends them; dropped at the next keystroke;
- a suggestion that arrives whole is followed by its background continuation: the same request as if it had been
  accepted (prefix + suggestion).
The completion streams here (llama.vim's does not: it shows the whole answer) so that its first token's time is
seen (the first event the server sends); everything else is llama.vim's body, unless --greedy: then both servers
draw greedily (samplers ["temperature"], temperature 0), the same work for both (llama.cpp's "infill" sampler,
which autotp accepts without applying, ends many of llama-server's completions at their first token).

Models: the demo model (StarCoder's tokenizer and FIM tokens; llama.cpp's converter reads gpt_bigcode) through
/infill; SmolLM2 (no FIM tokens) through /completion, the same windows as plain text: the ring's chunks, the lines
before the cursor and its line (what an editor can send a model without FIM). Both servers read the same float32
numbers (GGUF f32 made by llama.cpp's own converter; autotp serve with --dtype float32).

    python benchmarks/infill_bench.py [--models demo smollm2] [--editors 1 3] [--runs 3] [--bursts 24]

llama-server is built as llama_bench.py says. Prints a table per run, merges it into
benchmarks/results/infill_bench.json under runs/RUN.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

from common import write_json
from editor_bench import quantile, source, typist
from llama_bench import SRC, gguf, start_llama
from servers import cpus, model_path, start, stop

HERE = Path(__file__).parent
PREPARE_S = 1.0  # llama.vim's ring_update_ms
# model -> (route, context per request, (n_prefix, n_suffix, ring_chunk_size) in lines): llama.vim's defaults (256,
# 64, 64) for SmolLM2; for the demo model's context of 512, windows that fit it (llama-server refuses a longer
# /infill prompt: "request exceeds the available context size"), as its user would set them
SYSTEMS = {"demo": ("/infill", 512, (24, 8, 8)), "smollm2": ("/completion", 8192, (256, 64, 64))}
FIM = {"n_predict": 128, "n_indent": 0, "top_k": 40, "top_p": 0.90, "samplers": ["top_k", "top_p", "infill"],
       "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 250, "stop": [], "id_slot": 0, "model": ""}


def ring(editor: int, chunk: int) -> list[dict]:
    return [{"text": "\n".join(source(editor + k).splitlines()[:chunk]) + "\n", "time": [0, 0],
             "filename": f"file{k}.py"} for k in (1, 2)]


def windows(text: str, cursor: int, n_prefix: int, n_suffix: int) -> tuple[str, str, str]:
    """llama.vim's prefix (the lines before the cursor's), suffix (the rest of its line, the lines after) and prompt
    (its line up to the cursor)."""
    before, after = text[:cursor], text[cursor:]
    lines = before.split("\n")
    prefix = "\n".join(lines[:-1][-n_prefix:]) + ("\n" if len(lines) > 1 else "")
    rest = after.split("\n")
    return prefix, rest[0] + "\n" + "\n".join(rest[1:n_suffix + 1]), lines[-1]


def body(route: str, extra: list[dict], prefix: str, suffix: str, prompt: str, **fields) -> dict:
    if route == "/infill":
        return {"input_prefix": prefix, "input_suffix": suffix, "input_extra": extra, "prompt": prompt, **FIM,
                **fields}
    plain = "".join(c["text"] for c in extra) + prefix + prompt  # a model without FIM: the text before the cursor
    return {"prompt": plain, **{k: v for k, v in FIM.items() if k not in ("n_indent",)}, **fields}


async def lines(url: str, payload: dict):
    """POST payload as JSON over HTTP/1.1 and yield the answer's body line by line (chunked or not). A small client
    of its own: cancelling the task closes the connection, as an editor drops its request (llama.vim's jobstop)."""
    parts = urllib.parse.urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        data = json.dumps(payload).encode()
        writer.write(f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
                     f"Authorization: Bearer \r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n"
                     .encode() + data)  # llama.vim's empty key
        await writer.drain()
        status = (await reader.readline()).split()[1]
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        if status != b"200":
            raise RuntimeError(f"{url}: {status.decode()} {(await reader.read()).decode()[:300]}")
        chunked = headers.get("transfer-encoding") == "chunked"
        pending = b""
        while True:
            if chunked:
                size = int((await reader.readline()).strip() or b"0", 16)
                if size == 0:
                    break
                block = await reader.readexactly(size)
                await reader.readline()
            else:
                block = await reader.read(65536)
                if not block:
                    break
            pending += block
            *whole, pending = pending.split(b"\n")
            for line in whole:
                yield line.decode()
        if pending:
            yield pending.decode()
    finally:
        writer.close()


async def post(url: str, payload: dict, record: dict | None = None) -> str:
    """POST; a streamed one (record given) fills record (first: s to the first content, done: its clock) and
    returns the text."""
    if record is None:
        async for _ in lines(url, payload):
            pass
        return ""
    t0 = record["sent"] = time.monotonic()
    text = []
    async for line in lines(url, {**payload, "stream": True}):
        if not line.startswith("data:"):
            continue
        event = json.loads(line[5:])
        if "first" not in record:  # the first event: a token (llama-server sends one per token, autotp one per text
            record["first"] = time.monotonic() - t0  # it releases), or the end of a completion that has none
        text.append(event.get("content", ""))
        if event.get("stop"):
            record["tokens_cached"] = event.get("tokens_cached")
    record["done"] = time.monotonic()
    return "".join(text)


async def editor(url: str, model: str, i: int, bursts: int, rng: random.Random) -> list[dict]:
    route, _, (n_prefix, n_suffix, chunk) = SYSTEMS[model]
    text, extra = source(i), ring(i, chunk)
    stopped = asyncio.Event()

    async def prepare() -> None:  # the ring's files, computed ahead every second
        while not stopped.is_set():
            await post(url + route, body(route, extra, "", "", "", n_predict=0, response_fields=[""]))
            await asyncio.sleep(PREPARE_S)

    async def complete(cursor: int, record: dict) -> None:
        prefix, suffix, prompt = windows(text, cursor, n_prefix, n_suffix)
        try:
            shown = await post(url + route, body(route, extra, prefix, suffix, prompt), record)
            if shown:  # the suggestion is shown: llama.vim asks at once for what would follow it
                await post(url + route, body(route, extra, prefix, suffix, prompt + shown))
        except RuntimeError as e:  # an error answer: counted, and said once in the table
            record["error"] = str(e)

    warming = asyncio.create_task(prepare())
    records = await typist(len(text) // 3, bursts, rng, complete)
    stopped.set()
    await asyncio.gather(warming, return_exceptions=True)
    return records


async def trace(url: str, model: str, count: int, bursts: int) -> dict:
    route = SYSTEMS[model][0]
    await post(url + route, body(route, ring(0, 4), "def f(x):\n", "\n", "    ", n_predict=4))  # warm-up
    records = [r for rs in await asyncio.gather(*(editor(url, model, i, bursts, random.Random(i))
                                                  for i in range(count))) for r in rs]
    firsts = [r["first"] for r in records if "first" in r]
    wholes = [r["done"] - r["sent"] for r in records if "done" in r]
    in_time = sum("done" in r and r["done"] <= r.get("typed_at", float("inf")) for r in records)
    cached = [r["tokens_cached"] for r in records if r.get("tokens_cached") is not None]
    errors = [r["error"] for r in records if "error" in r]
    return {"requests": len(records), "errors": len(errors), "first_error": errors[0] if errors else None,
            "saw_first": len(firsts), "in_time": in_time,
            "first_p50_s": quantile(firsts, 0.5), "first_p90_s": quantile(firsts, 0.9),
            "whole_p50_s": quantile(wholes, 0.5), "tokens_cached_median": statistics.median(cached) if cached else None}


def serve(system: str, model: str, log: Path) -> tuple:
    path = model_path(model)
    context = SYSTEMS[model][1]
    if system == "llama":
        return start_llama(SRC / "build" / "bin" / "llama-server", gguf(path, SRC), log, ctx=4 * context,
                           alias=path.name)  # 4 slots of the model's context each
    return start("new:1", "", path, log, ["--dtype", "float32"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["demo", "smollm2"], choices=list(SYSTEMS))
    parser.add_argument("--systems", nargs="+", default=["llama", "autotp"])
    parser.add_argument("--editors", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--bursts", type=int, default=24, help="completions per editor")
    parser.add_argument("--runs", type=int, default=3, help="each run starts the servers in the other order")
    parser.add_argument("--greedy", action="store_true", help="samplers [temperature], temperature 0 for both")
    parser.add_argument("--run", default=time.strftime("%Y-%m-%d %H:%M"))
    args = parser.parse_args()
    if args.greedy:
        FIM.update(samplers=["temperature"], temperature=0.0)
    results: dict = {}
    with tempfile.TemporaryDirectory() as scratch:
        for run in range(args.runs):
            for model in args.models:
                order = args.systems if run % 2 == 0 else list(reversed(args.systems))
                for system in order:
                    log = Path(scratch) / f"{model}-{system}-{run}.log"
                    proc, url = serve(system, model, log)
                    try:
                        row = {f"editors_{n}": asyncio.run(trace(url, model, n, args.bursts))
                               for n in args.editors}
                    finally:
                        stop(proc)
                    results.setdefault(model, {}).setdefault(system, []).append(row)
                    print(f"run {run + 1}, {model}, {system}: done", file=sys.stderr, flush=True)
    print(f"{cpus()} CPUs, llama.vim's requests, {args.bursts} completions per editor, {args.runs} runs (first p50 / "
          f"p90, whole p50, in time)")
    for model, systems in results.items():
        print(f"\n{model} through {SYSTEMS[model][0]}")
        for system, rows in systems.items():
            for n in args.editors:
                cells = " | ".join(f"{r[f'editors_{n}']['first_p50_s']:.3f} / {r[f'editors_{n}']['first_p90_s']:.3f}"
                                   f", {r[f'editors_{n}']['whole_p50_s']:.3f} s, {r[f'editors_{n}']['in_time']} of "
                                   f"{r[f'editors_{n}']['requests']}" for r in rows)
                print(f"{system:8} {n} editor{'s' if n > 1 else ' '}: {cells}")
                errors = [r[f"editors_{n}"] for r in rows if r[f"editors_{n}"]["errors"]]
                if errors:
                    print(f"         {sum(e['errors'] for e in errors)} error answers, e.g. {errors[0]['first_error']}")
    write_json(HERE / "results" / "infill_bench.json", {"runs": {args.run: {"cpus": cpus(), "bursts": args.bursts,
                                                                          "greedy": args.greedy,
                                                                          "results": results}}})


if __name__ == "__main__":
    main()
