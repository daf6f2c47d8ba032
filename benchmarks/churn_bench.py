"""Rows joining and leaving a decoding batch: does it cost a copy of the KV cache?

In one process (tp 1, no HTTP), `--rows` rows of an `--context`-token prompt decode greedily. Steady: the
same rows for `--steps` steps. Churn: every step the oldest row is cancelled (it leaves at the next step)
and a new row arrives whose prompt is the same cached prompt, so in the paged engine it computes one
token, as a decoding row does. The figure is the median step time (engine.step(), planning, the forward
and sampling). The padded engine this was once compared with (deleted since; its figures stay in the results
file, from commit 7ef9c95) copied every row's KV when one left and prefilled a joining row's whole prompt in a
forward of its own.

    python benchmarks/churn_bench.py [--model demo|smollm2] [--rows 8] [--context 400] [--steps 40]

Prints a table, merges its figures into benchmarks/results/churn_bench_MODEL.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from common import write_json
from servers import model_path

from autotp.serve import server
from autotp.serve.engine.loop import Engine
from autotp.serve.engine.scheduler import Limits
from autotp.serve.lockstep.wire import Channel
from autotp.serve.runner.probe import probe
from autotp.serve.types import Row

HERE = Path(__file__).parent


def engine(model, tokenizer, rows: int, context: int, steps: int) -> Engine:
    limits = Limits(rows + 1, 2048, (rows + 2) * (context + 2 * steps + 16) + 2 * context)
    runner, scheduler = server.parts(model, probe(model), limits)
    return server.engine(model, tokenizer, runner, scheduler, Channel())


def measure(model, tokenizer, churn: bool, rows: int, context: int, steps: int) -> float:
    prompt = tuple(torch.randint(0, model.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
                   .tolist())
    eng = engine(model, tokenizer, rows, context, steps)
    clients = []

    def submit():
        clients.append(f"row{len(clients)}")
        eng.submit(clients[-1], [Row(prompt, steps + 16, 0.0, 1.0, 0)])  # never finishes here

    for _ in range(rows):
        submit()
    running = eng.scheduler.running
    while len(running) < rows or any(not r.output for r in running.values()):  # every row prefilled
        eng.step()
    times = []
    for i in range(steps):
        if churn:
            eng.abort(clients[i])
            submit()
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path(args.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    out = {}
    with torch.inference_mode():
        for churn in (False, True):
            out[f"paged_{'churn' if churn else 'steady'}_s"] = measure(model, tokenizer, churn, args.rows, args.context,
                                                                      args.steps)
    print(f"{args.model}, {args.rows} rows of {args.context} tokens, tp 1, {torch.get_num_threads()} threads: "
          f"median step time over {args.steps} steps")
    steady, churn = out["paged_steady_s"], out["paged_churn_s"]
    print(f"steady {steady * 1e3:7.1f}ms, churn {churn * 1e3:7.1f}ms, churn / steady {churn / steady:.2f}")
    path = HERE / "results" / f"churn_bench_{Path(args.model).name}.json"
    merged = json.loads(path.read_text()) if path.exists() else {}
    write_json(path, merged | vars(args) | out)


if __name__ == "__main__":
    main()
