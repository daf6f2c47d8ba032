"""Prompt-lookup speculation (`autotp serve --speculate K`), one request at a time, in process: the paged
engine as `autotp serve` runs it (tp 1, no HTTP), greedy, 128 new tokens, tokens per second with K = 0
(off) and each K given, and whether every text is the one without drafts.

Workloads, four prompts each:
- edit: a function from this repository's source, then its rewrite with the function renamed, begun (the
  instruct model gets the request through its chat template): the completion copies the rest;
- continue: 60 lines of a source file of an installed package (transformers, torch), continued;
- prose: questions answered in prose (the demo model, a code model, gets them as text): little repeats.

    python benchmarks/spec_bench.py [--models smollm2 demo] [--k 2 4 8]

Prints a table, writes benchmarks/results/spec_bench.json.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
import time
from pathlib import Path

import torch
from common import write_json
from servers import cpus, model_path

HERE = Path(__file__).parent
ROOT = HERE.parent
NEW_TOKENS = 128
QUESTIONS = ["Why is the sky blue? Answer in a paragraph.", "Describe the water cycle to a ten-year-old.",
             "What are the main causes of inflation?", "Tell me a short story about a lighthouse keeper."]


def functions(count: int = 4) -> list[tuple[str, str]]:
    """(source, name) of the first `count` functions of 10 to 25 lines in autotp's serve/ package."""
    out = []
    for path in sorted((ROOT / "src" / "autotp" / "serve").rglob("*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            lines = node.end_lineno - node.lineno if isinstance(node, ast.FunctionDef) else 0
            if 10 <= lines <= 25 and not node.decorator_list:
                out.append((ast.get_source_segment(text, node), node.name))
                if len(out) == count:
                    return out
    return out


def sources(count: int = 4) -> list[str]:
    import transformers

    files = [Path(transformers.__file__).parent / "generation" / "logits_process.py",
             Path(torch.__file__).parent / "nn" / "modules" / "linear.py",
             Path(transformers.__file__).parent / "models" / "llama" / "modeling_llama.py",
             Path(torch.__file__).parent / "optim" / "sgd.py"]
    return ["\n".join(f.read_text().splitlines()[100:160]) + "\n" for f in files[:count]]


def prompts(tok, chat: bool, count: int = 4) -> dict[str, list[list[int]]]:
    """The workloads' prompts, `count` edits (the other workloads have four)."""
    def ask(text: str, start: str = "") -> list[int]:
        if not chat:
            return tok(text + start).input_ids
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return list(ids) + tok(start).input_ids

    edit = []
    for source, name in functions(count):
        renamed = f"{name}_renamed"
        first = source.splitlines()[0].replace(name, renamed, 1)
        if chat:
            edit.append(ask(f"Rewrite this function with its name changed to `{renamed}`, nothing else changed:"
                            f"\n\n```python\n{source}\n```", f"```python\n{first}\n"))
        else:
            edit.append(ask(f"{source}\n\n\n", f"{first}\n"))
    return {"edit": edit, "continue": [tok(s).input_ids for s in sources()],
            "prose": [ask(q) for q in QUESTIONS]}


def run(model, tok, ids: list[int], k: int) -> tuple[tuple[int, ...], float, int, int]:
    """One greedy request alone on a fresh engine: its tokens, seconds, draft tokens and accepted ones."""
    from autotp.serve import server
    from autotp.serve.engine.scheduler import Limits
    from autotp.serve.lockstep.wire import Channel
    from autotp.serve.runner.probe import probe
    from autotp.serve.types import Failed, Finished, Row

    limits = Limits(16, 2048, 4096)
    runner, scheduler = server.parts(model, probe(model), limits, 16, True, speculate=k)
    engine = server.engine(model, tok, runner, scheduler, Channel(), 16)
    drafted = accepted = 0
    start = time.perf_counter()
    engine.submit("bench", [Row(tuple(ids), NEW_TOKENS, 0.0, 1.0, 0)])
    while True:
        out = engine.step()
        drafted, accepted = drafted + out.stats.drafted, accepted + out.stats.accepted
        end = next((e for e in out.events if isinstance(e, Finished | Failed)), None)
        if end is not None:
            break
    seconds = time.perf_counter() - start
    assert isinstance(end, Finished), end
    return end.result.tokens, seconds, drafted, accepted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "demo"])
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()
    torch.set_num_threads(cpus())
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    import autotp

    rows = []
    for name in args.models:
        path = model_path(name)
        model = autotp.from_pretrained(str(path), dtype="float32")
        tok = AutoTokenizer.from_pretrained(path)
        chat = tok.chat_template is not None
        run(model, tok, tok("def f(x):").input_ids, 4)  # warm-up
        for workload, items in prompts(tok, chat).items():
            items = [ids[-(512 - NEW_TOKENS - 8):] for ids in items]  # the demo model's context is 512
            base = [run(model, tok, ids, 0) for ids in items]
            for k in args.k:
                spec = [run(model, tok, ids, k) for ids in items]
                tokens = sum(len(r[0]) for r in base)
                row = {"model": name, "workload": workload, "k": k, "tokens": tokens,
                       "off_tok_s": tokens / sum(r[1] for r in base),
                       "on_tok_s": sum(len(r[0]) for r in spec) / sum(r[1] for r in spec),
                       "drafted": sum(r[2] for r in spec), "accepted": sum(r[3] for r in spec),
                       "same_text": all(a[0] == b[0] for a, b in zip(base, spec, strict=True))}
                row["speedup"] = row["on_tok_s"] / row["off_tok_s"]
                rows.append(row)
                print(f"{name} {workload} k={k}: {row['speedup']:.2f}x", file=sys.stderr, flush=True)
    print(f"one greedy request at a time, {NEW_TOKENS} new tokens, tp 1, {cpus()} CPUs, 4 prompts per workload")
    print(f"{'model':8} {'workload':9} {'K':>2} {'off tok/s':>9} {'on tok/s':>8} {'speedup':>7} "
          f"{'accepted/drafted':>16} {'same text':>9}")
    for r in rows:
        print(f"{r['model']:8} {r['workload']:9} {r['k']:>2} {r['off_tok_s']:>9.1f} {r['on_tok_s']:>8.1f} "
              f"{r['speedup']:>6.2f}x {r['accepted']:>7}/{r['drafted']:<8} {str(r['same_text']):>9}")
    write_json(HERE / "results" / "spec_bench.json", {"cpus": cpus(), "new_tokens": NEW_TOKENS, "rows": rows})


if __name__ == "__main__":
    main()
