"""Evaluation and the run's report: held-out loss on plain and FIM windows, the two sample generations,
metrics.json, the loss chart and (through model_card.py) the model card.

It does not train; train.py calls it before, during and after training.
"""

from __future__ import annotations

import csv
import json
import math
import platform
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from common import EOT, FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX, IGNORE
from data import FimPermuter, make_batch
from model_card import model_card


@torch.no_grad()
def evaluate(model, windows, fim: FimPermuter, fim_rate: float, seed: int, batch: int = 8) -> dict:
    """Summed token NLL over the windows, after the FIM transform at `fim_rate` (0: plain, 1: every segment).
    Returns mean loss over all predicted tokens, and over FIM-middle tokens only (the infilled part)."""
    model.eval()
    rng = np.random.default_rng(seed)
    tot = tot_n = mid = mid_n = 0.0
    for i in range(0, len(windows), batch):
        ids, labels, is_mid = make_batch(windows[i : i + batch], fim, fim_rate, rng)
        logits = model(input_ids=ids).logits[:, :-1].float()  # [B, L-1, V]
        nll = F.cross_entropy(
            logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE, reduction="none"
        ).view_as(labels[:, 1:])
        valid = labels[:, 1:] != IGNORE
        tot += nll[valid].sum().item()
        tot_n += valid.sum().item()
        m = valid & is_mid[:, 1:]
        mid += nll[m].sum().item()
        mid_n += m.sum().item()
    model.train()
    out = {"loss": tot / tot_n, "tokens": int(tot_n)}
    if mid_n:
        out.update(middle_loss=mid / mid_n, middle_tokens=int(mid_n))
    return out


def heldout_report(model, windows, fim: FimPermuter, seed: int) -> dict:
    """The held-out numbers of metrics.json and the model card: plain and FIM loss on the 512-token windows."""
    plain = evaluate(model, windows, fim, 0.0, seed)
    fimd = evaluate(model, windows, fim, 1.0, seed)
    eval_bytes = sum(len(fim.table[t]) for w in windows for t in w)
    eval_tokens = sum(len(w) for w in windows)
    return {
        "heldout_plain_loss": plain["loss"],
        "heldout_plain_ppl": math.exp(plain["loss"]),
        "heldout_plain_bits_per_byte": plain["loss"] / math.log(2) * eval_tokens / eval_bytes,
        "heldout_fim_loss": fimd["loss"],
        "heldout_fim_ppl": math.exp(fimd["loss"]),
        "heldout_fim_middle_loss": fimd["middle_loss"],
        "heldout_fim_middle_ppl": math.exp(fimd["middle_loss"]),
        "heldout_eval_windows": len(windows),
        "heldout_eval_tokens": plain["tokens"],
    }


@torch.no_grad()
def samples(model, hf_tok) -> dict[str, str]:
    """The two examples in the model card: greedy left-to-right completion and greedy infilling."""
    model.eval()
    eot = hf_tok.convert_tokens_to_ids(EOT)
    out = {}
    prompt = "def print_hello_world():"
    ids = hf_tok(prompt, return_tensors="pt").input_ids
    gen = model.generate(ids, max_new_tokens=48, do_sample=False, eos_token_id=eot, pad_token_id=eot)
    out["completion_prompt"] = prompt
    out["completion"] = hf_tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)
    prefix, suffix = "def add(a, b):\n    ", "\n    return c\n"
    fim_prompt = f"{FIM_PREFIX}{prefix}{FIM_SUFFIX}{suffix}{FIM_MIDDLE}"
    ids = hf_tok(fim_prompt, return_tensors="pt").input_ids
    gen = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=eot, pad_token_id=eot)
    out["fim_prefix"], out["fim_suffix"] = prefix, suffix
    out["fim_middle"] = hf_tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)
    return out


def run_summary(args, phase: int, previous: list[dict], run: dict) -> dict:
    """metrics.json: the run's setup and figures (`run`), with totals over all phases when continuing."""
    summary = {
        "phase": phase,
        "command": "python demo/train.py " + " ".join(sys.argv[1:]),
        "reproduce": reproduce_command(args, phase),
        "seed": args.seed,
        "data_seed": args.seed + phase - 1,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "tokenizers": __import__("tokenizers").__version__,
        "machine": f"{cpu_name()}, {args.threads} CPU threads",
        **run,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    if previous:  # totals over all phases: the shipped model's whole training
        all_phases = [*previous, summary]
        for k in ("steps", "tokens_seen", "loss_tokens", "train_seconds"):
            summary[f"all_phases_{k}"] = sum(ph[k] for ph in all_phases)
        summary["all_phases_epochs"] = summary["all_phases_tokens_seen"] / summary["train_corpus_tokens"]
        summary["previous_phases"] = previous
    return summary


def curve_name(phase: int) -> str:
    return "loss_curve.csv" if phase == 1 else "loss_curve_continued.csv"


def reproduce_command(args, phase: int) -> str:
    if not args.init_from:
        return f"python demo/train.py --replay demo/{curve_name(phase)} --seed {args.seed}"
    return (
        f"python demo/train.py --init-from PHASE_{phase - 1}_MODEL --init-log-dir PHASE_{phase - 1}_LOGS "
        f"--replay demo/{curve_name(phase)} --seed {args.seed}"
    )


def write_report(summary: dict, rows: list[dict], args) -> None:
    """metrics.json first (a failing chart or card can be redone with --report-only), then loss.png and
    README.md next to the weights."""
    (args.log_dir / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
    prev_curves = [read_curve(args.init_log_dir / "loss_curve.csv")] if args.init_from else []
    plot_curve([*prev_curves, rows], args.out / "loss.png", args)
    (args.out / "README.md").write_text(model_card(summary))


def rewrite_report(args, chart: bool = True) -> None:
    """--report-only / --card-only: README.md (and loss.png) again from the last run's logs, no training."""
    summary = json.loads((args.log_dir / "metrics.json").read_text())
    if chart:
        names = ["loss_curve.csv", "loss_curve_continued.csv"][: 1 + len(summary.get("previous_phases", []))]
        plot_curve([read_curve(args.log_dir / n) for n in names], args.out / "loss.png", args)
    (args.out / "README.md").write_text(model_card(summary))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def read_curve(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def plot_curve(phases: list[list[dict]], path: Path, args) -> None:
    """Loss curve of one run, or of consecutive phases (continued training) on one token axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, starts, offset = [], [], 0
    for phase_rows in phases:
        starts.append(offset / 1e6)
        rows += [{**r, "tokens": int(r["tokens"]) + offset} for r in phase_rows]
        offset += int(phase_rows[-1]["tokens"])
    x = [int(r["tokens"]) / 1e6 for r in rows]
    y = [float(r["train_loss"]) for r in rows]
    k = max(1, len(y) // 50)  # moving average over ~2% of the run for a readable line
    smooth = np.convolve(y, np.ones(k) / k, mode="valid")
    ev = [(int(r["tokens"]) / 1e6, float(r["heldout_loss"])) for r in rows if r["heldout_loss"]]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(x, y, color="tab:blue", alpha=0.25, lw=0.8, label="train (per step)")
    ax.plot(x[k - 1 :], smooth, color="tab:blue", lw=1.5, label=f"train ({k}-step mean)")
    ax.plot(*zip(*ev, strict=True), "o-", color="tab:orange", ms=3, label="held-out (plain, 256 tokens)")
    # grey dotted: switch to 512-token windows (each phase ends with them); black dashed: a continued phase starts
    switches = [
        i for i in range(1, len(rows)) if int(rows[i]["seq_len"]) == args.long_len != int(rows[i - 1]["seq_len"])
    ]
    for n, i in enumerate(switches):
        ax.axvline(x[i], color="grey", ls=":", lw=1)
        if n == 0:
            label = f"{args.long_len}-token windows "
            ax.text(
                x[i], 0.98, label, transform=ax.get_xaxis_transform(), va="top", ha="right", fontsize=8, color="grey"
            )
    for n, x0 in enumerate(starts[1:]):
        ax.axvline(x0, color="black", ls="--", lw=1)
        label = f" phase {n + 2}:\n continued"
        ax.text(x0, 0.86, label, transform=ax.get_xaxis_transform(), va="top", ha="left", fontsize=8)
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_ylim(top=min(max(y), 9.0))
    ax.set_title("autotp demo model (GPT-BigCode, MQA, 12 heads) on CPython stdlib")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
