"""The compiled decode step (`autotp serve --compile`) against eager, plain transformers and the floor.

    python benchmarks/compile_bench.py [--models smollm2 demo] [--batch 1 8] [--tp 1 2] [--new-tokens 48]

Each (model, tp) runs under torchrun as `autotp serve` runs its engine (rank 0 schedules, the others
follow; no HTTP), float32, greedy, speculation off. Per batch size B: B rows with the same 64-token prompt,
then decode; ms per step = the steps after the first (the prefill) over their count; every row gains one
token per step. Eager first, then every rank compiles (the warm-up's seconds, with a fresh inductor cache),
then compiled; the compiled rows' tokens must be eager's. At tp 1 also plain transformers' `generate`
((t(n tokens) - t(1 token)) / (n - 1)), and the floor: this rank's weight bytes over the best of 5 copies'
bandwidth (a copy reads and writes each byte). Last, a second process compiles again with the cache the
first one left: the start-up a restart pays.

Prints a table; writes benchmarks/results/compile_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import write_json
from servers import cpus, model_path

HERE = Path(__file__).parent
PROMPT = [(i * 37 + 11) % 1000 for i in range(64)]


def bandwidth_gbs(mib: int = 256) -> float:
    src = torch.ones(mib * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() / best / 1e9


def engine_run(model, runner, channel, limits, rows: int, new: int) -> tuple[float, list]:
    """Rank 0: `rows` greedy rows at once on a fresh engine; (ms per decode step, each row's tokens)."""
    from transformers import AutoTokenizer

    from autotp.serve import server
    from autotp.serve.engine.blocks import BlockPool
    from autotp.serve.engine.scheduler import Scheduler
    from autotp.serve.types import Finished, Row

    scheduler = Scheduler(BlockPool(limits.kv_tokens // 16, 16, False), limits)
    engine = server.engine(model, AutoTokenizer.from_pretrained(model.name_or_path), runner, scheduler, channel, 64)
    engine.submit("bench", [Row(tuple(PROMPT), new, 0.0, 1.0, 0) for _ in range(rows)])
    ended = engine.step().events  # the prefill
    start, steps = time.perf_counter(), 0
    while sum(isinstance(e, Finished) for e in ended) < rows:
        ended += engine.step().events
        steps += 1
    ms = (time.perf_counter() - start) * 1e3 / steps
    done = sorted((e for e in ended if isinstance(e, Finished)), key=lambda e: e.index)
    return ms, [list(e.result.tokens) for e in done]


def worker(path: str, batches: list[int], new: int, out: str, startup_only: bool) -> None:
    import autotp
    import autotp.distributed
    from autotp.serve.engine.scheduler import Limits
    from autotp.serve.lockstep.executor import follow
    from autotp.serve.lockstep.step import Step
    from autotp.serve.lockstep.wire import Channel
    from autotp.serve.runner.probe import probe
    from autotp.serve.server import parts
    from autotp.serve.types import StopFlag

    env = autotp.distributed.init("cpu")
    world, rank = env.world_size, env.rank
    model = autotp.from_pretrained(path, dtype="float32", check_inputs=False)
    channel = Channel()
    limits = Limits(max(batches), 4096, 8192)
    runner, _ = parts(model, probe(model), limits, 16, False, rank0=rank == 0)
    result = {"tp": world, "rows": []}

    def phase() -> dict:
        if rank != 0:
            follow(runner, channel, StopFlag())
            return {}
        runs = {b: engine_run(model, runner, channel, limits, b, new) for b in batches}
        channel.send(Step(stop=True))
        return runs

    if not startup_only:
        eager = phase()
    result["compile_s"] = runner.compile()
    runner.use_graph()
    if not startup_only:
        compiled = phase()
        if rank == 0:
            for b in batches:
                result["rows"].append({"batch": b, "eager_ms": eager[b][0], "compiled_ms": compiled[b][0],
                                       "same_tokens": eager[b][1] == compiled[b][1]})
    if rank == 0 and world == 1 and not startup_only:
        result["floor_ms"] = sum(p.numel() * p.element_size() for p in model.parameters()) / bandwidth_gbs() / 1e6
        from transformers import AutoModelForCausalLM

        plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for row in result["rows"]:
            ids = torch.tensor([PROMPT] * row["batch"])
            times = {}
            for n in (1, new):
                start = time.perf_counter()
                plain.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False)
                times[n] = time.perf_counter() - start
            row["transformers_ms"] = (times[new] - times[1]) * 1e3 / (new - 1)
    channel.close()
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def launch(path: Path, tp: int, batches: list[int], new: int, cache: str, startup_only: bool = False) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": str(max(1, cpus() // tp)),
               "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp), str(Path(__file__)),
               "--worker", str(path), "--out", out.name, "--new-tokens", str(new), "--batch", *map(str, batches)]
        if startup_only:
            cmd.append("--startup-only")
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "demo"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--worker")
    parser.add_argument("--out")
    parser.add_argument("--startup-only", action="store_true")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.batch, args.new_tokens, args.out, args.startup_only)
    results = []
    for name in args.models:
        for tp in args.tp:
            with tempfile.TemporaryDirectory() as cache:
                r = launch(model_path(name), tp, args.batch, args.new_tokens, cache)
                r["restart_compile_s"] = launch(model_path(name), tp, [1], args.new_tokens, cache, True)["compile_s"]
            r["model"] = name
            results.append(r)
            print(f"{name} tp {tp}: {r}", file=sys.stderr, flush=True)
    print(f"decode ms per step (every row gains a token per step), float32, greedy, {cpus()} CPUs, "
          f"{args.new_tokens} new tokens after a {len(PROMPT)}-token prompt")
    print(f"{'model':8} {'tp':>2} {'batch':>5} {'eager':>7} {'compiled':>8} {'speedup':>7} {'transformers':>12} "
          f"{'floor':>6} {'comp/floor':>10} {'same':>5} {'compile s':>9} {'restart s':>9}")
    for r in results:
        for row in r["rows"]:
            floor = r.get("floor_ms")
            print(f"{r['model']:8} {r['tp']:>2} {row['batch']:>5} {row['eager_ms']:>7.1f} {row['compiled_ms']:>8.1f} "
                  f"{row['eager_ms'] / row['compiled_ms']:>6.2f}x "
                  f"{row.get('transformers_ms', float('nan')):>12.1f} {floor or float('nan'):>6.1f} "
                  f"{row['compiled_ms'] / floor if floor else float('nan'):>10.2f} {str(row['same_tokens']):>5} "
                  f"{r['compile_s']:>9.1f} {r['restart_compile_s']:>9.1f}")
    write_json(HERE / "results" / "compile_bench.json", {"cpus": cpus(), "new_tokens": args.new_tokens,
                                                         "results": results})


if __name__ == "__main__":
    main()
