"""Where `autotp serve`'s time goes on CPU, per decode step and per prefill chunk: SmolLM2-135M, one rank, in
process (the engine as serve runs it, without HTTP), every core.

The engine's step is timed in its parts by wrapping them: the linear products (every `gemv.linear` call: gemv.c's
few-row kernel or F.linear), the paged attention (`StepCache.attend` and the KV writes of `update`), the rest of
the forward (norms, rotary, activations, the model's Python), and outside the forward: planning, the step's wire
and applying it, sampling and detokenizing (`next_tokens.take`, `output.process`). The HTTP side is what
llama_bench.py's streamed ms/token adds to the engine's step. Decode: one greedy row, 64 steps after its prompt;
prefill: a 400-token prompt in one chunk, 1 new token (a new prompt each time: nothing cached). Medians over
--repeats.

    python benchmarks/step_profile.py [--dtype float32] [--repeats 5]     # AUTOTP_GEMV=0: F.linear throughout

Prints a table, merges it into benchmarks/results/step_profile.json under `runs`, keyed by --run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from common import write_json
from editor_bench import source
from servers import cpus, model_path

HERE = Path(__file__).parent
PARTS = ["linear products", "attention + KV writes", "rest of the forward", "plan, wire, apply", "sample, detokenize"]


class Clock:
    """Seconds spent inside wrapped functions, by part (not nested: attention holds no linear product)."""

    def __init__(self):
        self.spent = defaultdict(float)

    def wrap(self, owner, name: str, part: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.spent[part] += time.perf_counter() - t

        setattr(owner, name, timed)


def engine(model, tokenizer, clock: Clock):
    from autotp.serve import server
    from autotp.serve.engine.scheduler import Limits
    from autotp.serve.lockstep.wire import Channel
    from autotp.serve.runner.probe import probe

    limits = Limits(16, 2048, 8192)
    runner, scheduler = server.parts(model, probe(model), limits, 16, True)
    eng = server.engine(model, tokenizer, runner, scheduler, Channel(), 16)
    clock.wrap(runner, "_forward", "forward")
    clock.wrap(runner.next_tokens, "take", "sample, detokenize")
    clock.wrap(eng.output, "process", "sample, detokenize")
    return eng


def request(eng, ids: list[int], max_tokens: int, clock: Clock) -> tuple[dict, int]:
    """Runs one greedy request to its end; per step: seconds by part, and the steps taken (its prefill first)."""
    from autotp.serve.types import Failed, Finished, Row

    eng.submit("profile", [Row(tuple(ids), max_tokens, 0.0, 1.0, 0)])
    parts, steps, ended = defaultdict(list), 0, False
    while not ended:
        clock.spent.clear()
        t = time.perf_counter()
        ended = any(isinstance(e, Finished | Failed) for e in eng.step().events)
        wall = time.perf_counter() - t
        spent = dict(clock.spent)
        parts["step"].append(wall)
        for part in ("linear products", "attention + KV writes", "sample, detokenize"):
            parts[part].append(spent.get(part, 0.0))
        parts["rest of the forward"].append(spent["forward"] - spent.get("linear products", 0.0)
                                            - spent.get("attention + KV writes", 0.0))
        parts["plan, wire, apply"].append(wall - spent["forward"] - spent.get("sample, detokenize", 0.0))
        steps += 1
    return parts, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--run", default=time.strftime("%Y-%m-%d %H:%M"))
    args = parser.parse_args()
    os.environ.setdefault("WORLD_SIZE", "1")
    torch.set_num_threads(cpus())
    from transformers import AutoTokenizer

    import autotp
    from autotp.parallel import gemv
    from autotp.serve.runner import kv_cache

    kernel = "F.linear (AUTOTP_GEMV=0)" if os.environ.get("AUTOTP_GEMV") == "0" else (gemv.enable() or "gemv.c")
    path = model_path("smollm2")
    model = autotp.from_pretrained(str(path), dtype=args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    clock = Clock()
    clock.wrap(gemv, "linear", "linear products")
    clock.wrap(kv_cache.StepCache, "attend", "attention + KV writes")
    clock.wrap(kv_cache.StepCache, "update", "attention + KV writes")
    eng = engine(model, tokenizer, clock)
    text = tokenizer("".join(source(i) for i in range(4))).input_ids
    request(eng, text[:32], 4, clock)  # warm-up
    decode, prefill = defaultdict(list), defaultdict(list)
    for r in range(args.repeats):
        parts, _ = request(eng, text[r * 50:r * 50 + 200], 65, clock)
        for part, values in parts.items():
            decode[part].append(statistics.median(values[1:]) * 1e3)  # the steps after the prefill
        parts, _ = request(eng, text[5000 + r * 401:5000 + r * 401 + 400], 1, clock)
        for part, values in parts.items():
            prefill[part].append(values[0] * 1e3)
    rows = {"decode": {p: statistics.median(v) for p, v in decode.items()},
            "prefill_400": {p: statistics.median(v) for p, v in prefill.items()}}
    print(f"SmolLM2-135M, {args.dtype}, {kernel}, {cpus()} CPUs, 1 rank in process: ms per step (median of "
          f"{args.repeats})")
    print(f"{'part':24} | {'decode (1 row)':>14} | {'prefill (400 tokens)':>20}")
    for part in [*PARTS, "step"]:
        print(f"{part:24} | {rows['decode'][part]:14.2f} | {rows['prefill_400'][part]:20.1f}")
    write_json(HERE / "results" / "step_profile.json",
               {"runs": {args.run: {"cpus": cpus(), "dtype": args.dtype, "kernel": kernel, **rows}}})


if __name__ == "__main__":
    main()
