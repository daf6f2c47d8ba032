"""Load on `autotp serve` (issue 6): C concurrent clients, a fixed number of requests, loopback only.

Starts a torchrun server (2 ranks on CPU by default) on the demo model, or on the tests' tiny random
FIM model when the demo model is not installed, then for each C runs `--requests` completions of
`--max-tokens` tokens each through the official `openai` client, C at a time, each level bounded by
`--time-limit` seconds. Reports requests/s, p50/p99 latency, generated tokens/s and errors; writes
benchmarks/results/serve_load.json and prints a table.

    python benchmarks/serve_load.py [--model DIR] [--tp 2] [--concurrency 1 8 32] [--requests 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import free_port, write_json

HERE = Path(__file__).parent
START_TIMEOUT_S = 300


def pick_model(model: str | None, scratch: Path) -> tuple[str, str]:
    """(directory, what it is)."""
    if model:
        return model, model
    from autotp.cli import default_model
    from autotp.errors import AutotpError

    try:
        return default_model(), "the demo model"
    except AutotpError:
        sys.path.insert(0, str(HERE.parent / "tests"))
        import fim_model

        return fim_model.build(scratch), "tests/fim_model.py (tiny random GPT-BigCode; the demo model is not installed)"


def start_server(model: str, tp: int, max_batch_size: int, log: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp), "--master-port",
           str(free_port()), "-m", "autotp", "serve", "--model", model, "--port", "0",
           "--max-batch-size", str(max_batch_size)]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // tp))}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (found := re.search(r"on (http://127\.0\.0\.1:\d+)", log.read_text(errors="replace"))):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(proc)
            raise SystemExit(f"server did not start:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)
    return proc, found.group(1)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def level(url: str, model: str, concurrency: int, requests: int, max_tokens: int, time_limit: float) -> dict:
    """`requests` completions, `concurrency` in flight at a time, none started after time_limit seconds."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=time_limit)
    latencies, tokens, errors = [], 0, 0
    issued = 0
    start = time.monotonic()

    async def worker() -> None:
        nonlocal issued, tokens, errors
        while issued < requests and time.monotonic() - start < time_limit:
            i = issued
            issued += 1
            t0 = time.monotonic()
            try:
                r = await client.completions.create(model=model, prompt=f"def function_{i}(x):",
                                                    max_tokens=max_tokens, temperature=0.8, seed=i)
            except openai.OpenAIError:
                errors += 1
                continue
            latencies.append(time.monotonic() - t0)
            tokens += r.usage.completion_tokens

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await client.close()
    wall = time.monotonic() - start
    latencies.sort()

    def quantile(q: float) -> float:
        return round(latencies[min(len(latencies) - 1, int(q * len(latencies)))], 3) if latencies else float("nan")

    return {"concurrency": concurrency, "requests": issued, "ok": len(latencies), "errors": errors,
            "wall_s": round(wall, 2), "requests_per_s": round(len(latencies) / wall, 2),
            "p50_latency_s": quantile(0.5), "p99_latency_s": quantile(0.99),
            "generated_tokens_per_s": round(tokens / wall, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: the demo model, else a tiny random one)")
    parser.add_argument("--tp", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=64, help="requests per concurrency level (default 64)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per completion (default 16)")
    parser.add_argument("--time-limit", type=float, default=120, help="seconds per level (default 120)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        model, described = pick_model(args.model, Path(scratch))
        proc, url = start_server(model, args.tp, max(args.concurrency), Path(scratch) / "server.log")
        try:
            # the server was given --model, so clients name the model by that same string
            rows = [asyncio.run(level(url, model, c, args.requests, args.max_tokens, args.time_limit))
                    for c in args.concurrency]
        finally:
            stop_server(proc)
    print(f"autotp serve, tp={args.tp}, model: {described}, {args.max_tokens} tokens per request, "
          f"{os.cpu_count()} CPUs")
    print(f"{'C':>3} {'requests':>8} {'errors':>6} {'req/s':>7} {'p50 s':>7} {'p99 s':>7} {'gen tok/s':>9}")
    for r in rows:
        print(f"{r['concurrency']:>3} {r['requests']:>8} {r['errors']:>6} {r['requests_per_s']:>7} "
              f"{r['p50_latency_s']:>7} {r['p99_latency_s']:>7} {r['generated_tokens_per_s']:>9}")
    write_json(HERE / "results" / "serve_load.json",
               {"tp": args.tp, "model": described, "max_tokens": args.max_tokens, "cpus": os.cpu_count(),
                "rows": rows})


if __name__ == "__main__":
    main()
