"""CPU ranks on one host: gloo's all-reduce against the shared-memory one (autotp.parallel.shm), then what it
does to decoding through `autotp serve`.

1. all-reduce latency, float32, 1 KB / 64 KB / 1 MB / 16 MB, at tp 2 and 4: rank 0's mean time per call over
   a run of calls (the median of 5 runs), gloo's `dist.all_reduce` against `ShmGroup.all_reduce`, the same
   process group.
2. decode through `autotp serve` (servers.py), one greedy stream at a time, three of them: a ~400-token
   prompt's first token (prompt + first token; each prompt new to the prefix cache) and the median time
   between streamed tokens after it, medians of the three, at 1 rank, 2 ranks with gloo (AUTOTP_SHM=0) and
   2 ranks with shared memory; OMP_NUM_THREADS = cores / ranks.

    python benchmarks/shm_bench.py [--models smollm2 demo] [--parts allreduce decode]

Prints tables, merges them into benchmarks/results/shm_bench.json (a run of one part keeps the other's).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import free_port, write_json
from servers import cpus, model_id, model_path, start, stop

HERE = Path(__file__).parent
SIZES = {"1 KB": 1 << 10, "64 KB": 64 << 10, "1 MB": 1 << 20, "16 MB": 16 << 20}
PROMPT = "".join(f"def handler_{i}(request):\n    return respond(request, status={200 + i})\n\n" for i in range(17))


def _rank(rank: int, tp: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, cpus() // tp))
    dist.init_process_group("gloo", rank=rank, world_size=tp, timeout=timedelta(seconds=120))
    from autotp.parallel import shm

    local = shm.for_group(dist.group.WORLD.group_name, dist.group.WORLD)
    assert local is not None, "shared memory is not available"
    row = {}
    for label, size in SIZES.items():
        x = torch.randn(size // 4)
        calls = max(5, min(2000, (8 << 20) // size))
        for name, op in (("gloo", lambda t: dist.all_reduce(t)), ("shm", local.all_reduce)):
            runs = []
            for _ in range(6):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    op(x)
                runs.append((time.perf_counter() - t0) / calls)
            row[(label, name)] = statistics.median(runs[1:]) * 1e6
            x.normal_()  # a sum of sums grows without bound
    if rank == 0:
        out.put(row)
    dist.destroy_process_group()


def allreduce(tp: int) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, tp, port, out)) for r in range(tp)]
    for p in procs:
        p.start()
    row = out.get(timeout=600)
    for p in procs:
        p.join()
    return row


def stream(url: str) -> dict:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    model = model_id(url)
    client.completions.create(model=model, prompt="def f(x):", max_tokens=8, temperature=0)  # warm-up
    runs = []
    for i in range(3):  # each prompt new to the prefix cache: its first token costs the whole prompt
        t0 = time.monotonic()
        times = []
        for chunk in client.completions.create(model=model, prompt=f"# run {i}\n{PROMPT}", max_tokens=96,
                                               temperature=0, stream=True):
            if chunk.choices and chunk.choices[0].text:
                times.append(time.monotonic())
        gaps = [b - a for a, b in zip(times[:-1], times[1:], strict=True)]
        runs.append((times[0] - t0, statistics.median(gaps) * 1e3, len(times)))
    return {"first_token_s": statistics.median(r[0] for r in runs), "decode_ms": statistics.median(r[1] for r in runs),
            "tokens": min(r[2] for r in runs)}


def decode(models: list[str]) -> dict:
    rows = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name in models:
            for system, shm_on in (("new:1", "1"), ("new:2", "0"), ("new:2", "1")):
                os.environ["AUTOTP_SHM"] = shm_on
                label = f"{system[-1]} rank{'s' if system != 'new:1' else ''}" + (
                    "" if system == "new:1" else ", shared memory" if shm_on == "1" else ", gloo")
                proc, url = start(system, "", model_path(name), Path(scratch) / "serve.log")
                try:
                    rows[f"{name} / {label}"] = stream(url)
                finally:
                    stop(proc)
                print(f"{name} / {label}: done", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "demo"])
    parser.add_argument("--parts", nargs="+", default=["allreduce", "decode"], choices=["allreduce", "decode"])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4], help="all-reduce group sizes")
    args = parser.parse_args()
    result = {"cpus": cpus()}
    if "allreduce" in args.parts:
        result["allreduce_us"] = {}
        print(f"all-reduce, float32, rank 0's mean us per call ({cpus()} CPUs)")
        print(f"{'':6} " + " ".join(f"{size + ' gloo':>13} {size + ' shm':>12}" for size in SIZES))
        for tp in args.tp:
            row = allreduce(tp)
            result["allreduce_us"][f"tp {tp}"] = {f"{s} {n}": v for (s, n), v in row.items()}
            print(f"tp {tp:<3} " + " ".join(f"{row[(s, 'gloo')]:>13.1f} {row[(s, 'shm')]:>12.1f}" for s in SIZES))
        if 2 in args.tp:
            at = result["allreduce_us"]["tp 2"]["64 KB shm"]
            print(f"goal: 64 KB at tp 2 <= 50 us: {at:.1f} us, {'met' if at <= 50 else 'NOT met'}")
    if "decode" in args.parts:
        rows = result["decode"] = decode(args.models)
        print(f"\nautotp serve, one greedy stream, {len(PROMPT)}-character prompt, 96 tokens (medians of 3)")
        print(f"{'':42} {'prompt + 1st token':>18} {'decode ms/token':>15} {'tokens':>6}")
        for name, r in rows.items():
            print(f"{name:42} {r['first_token_s'] * 1e3:>16.0f}ms {r['decode_ms']:>15.1f} {r['tokens']:>6}")
        for name in args.models:
            one, two = rows[f"{name} / 1 rank"], rows[f"{name} / 2 ranks, shared memory"]
            ratio = two["decode_ms"] / one["decode_ms"]
            print(f"goal ({name}): 2-rank decode <= 1.1x 1 rank: {ratio:.2f}x, {'met' if ratio <= 1.1 else 'NOT met'}")
    write_json(HERE / "results" / "shm_bench.json", result)


if __name__ == "__main__":
    main()
