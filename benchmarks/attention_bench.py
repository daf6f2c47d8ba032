"""What a step of the paged engine costs in attention: calls, not FLOPs; the prefix a cached prompt stands on.

In process, tp 1, the engine's model runner alone (no scheduler, no HTTP), median step time over `--runs`:

- calls: a step of 64 plain decode rows (64 query tokens) against a step of 32 rows of which 8 verify a draft of
  4 (also 64 query tokens), every row with the same context: the old engine ran one more SDPA call per drafted
  row in every layer, the new one runs at most two per layer whatever the rows;
- mixed: 2 prefill chunks of 64 tokens beside 30 decode rows in one step, against the same rows in two steps
  (decode alone, then the chunks alone);
- prefix: one row whose prompt stands on a cached prefix of P tokens computes its last 8 (the second request of
  the editor pattern), P = 128 and 2048.

    python benchmarks/attention_bench.py [--model demo|smollm2] [--context 256] [--runs 7] [--label new]

Runs against whichever autotp is importable (PYTHONPATH=<a checkout of another commit>/src times that one):
rows are merged into benchmarks/results/attention_bench_MODEL.json under `--label`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent


def wire():
    """The module with the engine's Step and Work: lockstep/step.py, or an older engine's wire module."""
    try:
        from autotp.serve.lockstep import step
        return step
    except ImportError:  # an older engine
        pass
    try:
        from autotp.serve.lockstep import wire
    except ImportError:  # the older engine
        from autotp.serve import wire
    return wire


def work(row, tokens, start, blocks, sample=True, every=False, draft=0):
    """A step's entry for one row, as the engine under test spells it (the older one: a plain tuple)."""
    if hasattr(wire(), "NewRequest"):  # this engine's: a request's work, by id
        return wire().Work(id=row, tokens=tuple(tokens), start=start, blocks=tuple(blocks), sample=sample,
                           every=every, draft=draft)
    if hasattr(wire(), "Work"):
        return wire().Work(row, tuple(tokens), start, tuple(blocks), sample, every, draft)
    return (row, tuple(tokens), start, tuple(blocks), sample, every)


def make_batch(model, blocks: int, speculate: int):
    try:
        from autotp.serve.engine.scheduler import Limits
        from autotp.serve.runner.probe import probe
        from autotp.serve.server import parts
        return parts(model, probe(model), Limits(128, 1 << 16, blocks * 16), 16, False, rank0=False,
                     speculate=speculate)[0]
    except ImportError:  # an older engine
        pass
    try:
        from autotp.serve.server import backend
    except ImportError:  # the older engine
        from autotp.serve.engine import backend

    try:
        from autotp.serve.runner.probe import probe
        shapes = probe(model)
    except ImportError:  # the older engine
        from autotp.serve.paged import probe
        shapes = probe(model)[0]
    try:
        from autotp.serve.engine.planner import Limits
    except ImportError:
        from autotp.serve.scheduler import Limits
    limits = Limits(128, 1 << 16, blocks * 16)
    try:
        return backend(model, shapes, limits, 16, False, rank0=False, speculate=speculate)[0]
    except TypeError:
        return backend(model, shapes, limits, 16, False, rank0=False)[0]


def timed(batch, steps: list[list], runs: int) -> float:
    """Median ms of running `steps` (each a list of work entries) after a warm-up; tables rebuilt every run."""
    Step = wire().Step
    times = []
    for i in range(runs + 1):
        if hasattr(batch, "requests"):  # this engine's runner: the rows end by a step
            batch.apply(Step(finished=tuple(batch.requests())))
        else:
            batch.discard(batch.rows())
        start = time.perf_counter()
        for entries in steps:
            step = Step(work=tuple(entries))
            batch.apply(step)
            batch.run(step)
        if i:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def rows_at(n: int, context: int, first_block: int, tokens: int = 1, draft: int = 0) -> tuple[list, int]:
    """n rows whose next `tokens` tokens start at `context`, each with its own blocks."""
    per = -(-(context + tokens) // 16)
    out = [work(first_block + r, [5] * tokens, context, range(first_block + r * per, first_block + (r + 1) * per),
                True, tokens > 1, draft) for r in range(n)]  # row ids: unique, as the blocks are
    return out, first_block + n * per


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--label", default="new")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    os.environ.setdefault("WORLD_SIZE", "1")
    from servers import model_path

    import autotp

    model = autotp.from_pretrained(str(model_path(args.model)), dtype="float32", check_inputs=False)
    batch = make_batch(model, 4096, speculate=4)
    c = args.context
    plain, _ = rows_at(64, c, 0)
    decode, at = rows_at(24, c, 0)
    drafted, _ = rows_at(8, c, at, tokens=5, draft=4)
    thirty, at = rows_at(30, c, 0)
    chunks, _ = rows_at(2, 0, at, tokens=64)
    result = {"model": args.model, "context": c, "runs": args.runs, "torch": torch.__version__,
              "threads": torch.get_num_threads()}
    result["plain_64_ms"] = timed(batch, [plain], args.runs)
    result["drafted_32_ms"] = timed(batch, [decode + drafted], args.runs)
    result["drafted_over_plain"] = result["drafted_32_ms"] / result["plain_64_ms"]
    result["mixed_ms"] = timed(batch, [thirty + chunks], args.runs)
    result["separate_ms"] = timed(batch, [thirty, chunks], args.runs)
    prefixes = (128, 448) if args.model == "demo" else (128, 2048)  # the demo model has 512 positions
    for prefix in prefixes:
        blocks = -(-(prefix + 8) // 16)
        # the cached prefix is in the row's blocks already: only its last 8 tokens are computed
        row = [work(1, [5] * 8, prefix, range(blocks))]
        result[f"prefix_{prefix}_ms"] = timed(batch, [row], args.runs)
    result[f"prefix_{prefixes[1]}_over_128"] = result[f"prefix_{prefixes[1]}_ms"] / result["prefix_128_ms"]
    result = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}
    print(json.dumps(result, indent=2))
    path = HERE / "results" / f"attention_bench_{args.model}.json"
    merged = json.loads(path.read_text()) if path.exists() else {}
    merged[args.label] = result
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(merged, indent=2) + "\n")


if __name__ == "__main__":
    main()
