"""Train autotp's embedded demo model: a tiny StarCoder-architecture (GPT-BigCode) Python code model.

The model exists so that autotp's tests and examples have a real, *trained* GPT-BigCode checkpoint that ships
inside the package: multi-query attention, 12 heads (tensor-parallel degrees 1, 2, 3, 4 and 6 divide the
heads evenly, 5 does not), learned absolute positions, tied embeddings, a StarCoder-style tokenizer with the
fill-in-the-middle (FIM) sentinels.  It is far too small to write useful code; it writes Python-flavoured
text.

Everything runs offline on CPU:

1. corpus   -- the interpreter's own standard library (*.py, tests and generated tables skipped), split into
               train / held-out *by file* with a hash of the relative path (deterministic, order-independent);
2. tokenizer -- byte-level BPE trained with `tokenizers` (StarCoder's pre-tokenizer: single digits + GPT-2
               byte-level regex), StarCoder's special tokens at ids 0..4, saved in Hugging Face format;
3. training -- StarCoder's recipe scaled down: documents packed into fixed-length windows separated by
               <|endoftext|>, and each document segment inside a window rearranged with probability
               `--fim-rate` into prefix-suffix-middle (PSM) order, like bigcode's Megatron-LM `permute`;
               AdamW(0.9, 0.95, wd 0.1), linear warmup + cosine decay, grad clip 1.0;
               sequence length 256 for the first 80% of the time, then 512 so every position embedding
               is trained (attention at 512 is ~2x slower per token on CPU, so the short phase buys tokens);
4. report   -- held-out loss / perplexity on plain and FIM windows, a loss chart, sample generations and a
               model card, all written next to the weights.

This file is the training loop and the command line; the steps live beside it: data.py (1, and the FIM
windows of 3), tokenizer.py (2), evaluate.py and model_card.py with model_card.md.tmpl (4).

The CPU is shared, so step times vary: the schedule runs on the wall clock.  `progress` = training time
used / training time available (`--budget-minutes` minus data preparation and a reserve for the final report)
drives the cosine learning rate and the switch to 512-token windows, and training stops at progress 1.  Every
step's sequence length and learning rate go to demo/loss_curve.csv; `--replay demo/loss_curve.csv` repeats
exactly those steps (same seed -> same data order, FIM cuts, initialization), whatever the machine's speed.

    python demo/train.py                       # phase 1 of the shipped model (~30 min on 2 CPU cores)
    python demo/train.py --max-files 60 --budget-minutes 1.5 --out demo/.work/smoke/model \
        --log-dir demo/.work/smoke             # end-to-end smoke test
    python demo/train.py --card-only           # README.md again from demo/metrics.json, no training

Continued training (`--init-from DIR`): start from a saved model instead of a random one, reuse its tokenizer
(no tokenizer training: the vocabulary and special-token ids stay), and run a schedule of its own -- fresh
AdamW state, warmup to `--lr` (give it a lower peak than phase 1), cosine decay over this run's budget.  The
training files are shuffled with `--seed` + phase - 1, so phase 2 does not replay phase 1's file order; the
held-out windows and their FIM cuts still use `--seed`, so every phase is evaluated on identical inputs.  The
loaded model is evaluated first, the steps go to loss_curve_continued.csv (replayable with `--replay` like
phase 1's), and `--init-log-dir` (the earlier run's loss_curve.csv + metrics.json) feeds the combined chart,
metrics.json and model card.

    nice -n 19 python demo/train.py --init-from src/autotp/demo_model --lr 1e-3 --budget-minutes 65 \
        --reserve-seconds 300 --out demo/.work/continued/model --log-dir demo/.work/continued   # phase 2
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from common import IGNORE, SPECIAL_TOKENS, log
from data import FimPermuter, WindowStream, heldout_windows, make_batch, n_bytes, split_corpus, tokenize_corpus
from evaluate import curve_name, evaluate, heldout_report, rewrite_report, run_summary, samples, write_report
from model import build_model, new_optimizer
from tokenizer import save_and_check, token_bytes_table

REPO = Path(__file__).resolve().parent.parent


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "src/autotp/demo_model", help="artifact directory")
    p.add_argument("--log-dir", type=Path, default=REPO / "demo", help="loss curve CSV + metrics JSON")
    p.add_argument("--work", type=Path, default=REPO / "demo/.work", help="caches (git-ignored)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--budget-minutes", type=float, default=32.0, help="wall-clock budget of the whole run")
    p.add_argument("--replay", type=Path, default=None, help="repeat the steps of a loss_curve.csv exactly")
    p.add_argument("--init-from", type=Path, default=None, help="continue training this model (and its tokenizer)")
    p.add_argument(
        "--init-log-dir", type=Path, default=REPO / "demo", help="loss_curve.csv + metrics.json of --init-from's run"
    )
    p.add_argument("--reserve-seconds", type=float, default=150, help="budget kept for the final report")
    p.add_argument("--max-files", type=int, default=None, help="use only the first N files (smoke tests)")
    p.add_argument("--site-packages", action="store_true", help="also train on site-packages sources")
    p.add_argument("--heldout-percent", type=int, default=5)
    # tokenizer
    p.add_argument("--vocab-size", type=int, default=4096)
    # model (12 heads is fixed by design: see the module docstring)
    p.add_argument("--n-embd", type=int, default=288)
    p.add_argument("--n-layer", type=int, default=4)
    # training
    p.add_argument("--tokens-per-step", type=int, default=4096, help="16 x 256 or 8 x 512")
    p.add_argument("--short-len", type=int, default=256)
    p.add_argument("--long-len", type=int, default=512)
    p.add_argument("--long-fraction", type=float, default=0.2, help="final fraction of time at --long-len")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--fim-rate", type=float, default=0.5)
    p.add_argument("--eval-windows", type=int, default=64, help="held-out 512-token windows for the report")
    p.add_argument("--curve-windows", type=int, default=16, help="held-out windows per loss-curve point")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--report-only", action="store_true", help="only rewrite README.md + loss.png from the last run's logs"
    )
    p.add_argument("--card-only", action="store_true", help="only rewrite README.md from the last run's metrics.json")
    return p.parse_args()


def lr_at(step: int, progress: float, args) -> float:
    """Linear warmup over the first steps, then cosine decay to min_lr_ratio * lr over the time budget."""
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return args.lr * min(1.0, (step + 1) / args.warmup_steps) * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine)


def seq_len_at(progress: float, args) -> int:
    return args.long_len if progress >= 1 - args.long_fraction else args.short_len


def schedule(args, t_start: float):
    """step -> (progress, sequence length, learning rate), or None when training is over: the steps of
    --replay's loss curve, or the wall clock (`--budget-minutes` less what is spent and the reserve)."""
    if args.replay:
        with open(args.replay, newline="") as f:
            replay = [(int(r["seq_len"]), float(r["lr"])) for r in csv.DictReader(f)]
        log(f"replaying {len(replay)} steps from {args.replay}")
        log("training")
        return lambda step: ((step + 1) / len(replay), *replay[step]) if step < len(replay) else None
    # the reserve pays for the final plain + FIM evaluation, samples, saving, plotting (on a loaded CPU)
    budget_s = args.budget_minutes * 60 - (time.time() - t_start) - args.reserve_seconds
    assert budget_s > 30, "--budget-minutes leaves no time to train"
    log(f"training for {budget_s / 60:.1f} min")
    t_train = time.time()

    def at(step: int):
        progress = (time.time() - t_train) / budget_s
        return None if progress >= 1 else (progress, seq_len_at(progress, args), lr_at(step, progress, args))

    return at


def causal_lm_loss(model, input_ids, labels, reduction="mean"):
    # logits [B, L, V]; position t predicts token t+1, so compare logits[:, :-1] with labels[:, 1:]
    logits = model(input_ids=input_ids).logits
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(),
        labels[:, 1:].flatten(),
        ignore_index=IGNORE,
        reduction=reduction,
    )


def train(model, opt, data: WindowStream, fim: FimPermuter, rng, curve_windows, at, curve_path: Path, args, t_start):
    """The training loop: one row per step, written to `curve_path` as it goes (a crashed run keeps its curve),
    with a held-out point every 5% of the schedule.  Returns the rows, tokens seen and tokens with a loss."""
    rows: list[dict] = []
    tokens_seen = loss_tokens = 0
    next_eval = 0.05  # loss-curve point every 5% of the budget (every 5% of the steps when replaying)
    model.train()
    with open(curve_path, "w", newline="") as curve_file:
        writer = None
        while (now := at(len(rows))) is not None:
            progress, length, lr = now
            b = args.tokens_per_step // length  # 16 x 256 or 8 x 512
            ids, labels, _ = make_batch([data.next(length) for _ in range(b)], fim, args.fim_rate, rng)
            for g in opt.param_groups:
                g["lr"] = lr
            loss = causal_lm_loss(model, ids, labels)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
            opt.step()
            opt.zero_grad(set_to_none=True)
            tokens_seen += ids.numel()
            loss_tokens += (labels[:, 1:] != IGNORE).sum().item()
            row = {
                "step": len(rows) + 1,
                "tokens": tokens_seen,
                "seq_len": length,
                "lr": repr(lr),  # full precision, for --replay
                "train_loss": f"{loss.item():.4f}",
                "grad_norm": f"{grad_norm:.3f}",
                "heldout_loss": "",
                "elapsed_s": f"{time.time() - t_start:.1f}",
            }
            if progress >= next_eval:
                next_eval = (math.floor(progress / 0.05) + 1) * 0.05
                row["heldout_loss"] = f"{evaluate(model, curve_windows, fim, 0.0, args.seed)['loss']:.4f}"
                log(
                    f"step {row['step']} ({progress:.0%}) len {length} lr {lr:.2e} loss {loss.item():.3f} "
                    f"held-out {row['heldout_loss']} | {tokens_seen:,} tokens, epoch {data.epoch}, "
                    f"{time.time() - t_start:.0f}s"
                )
            rows.append(row)
            if writer is None:
                writer = csv.DictWriter(curve_file, fieldnames=list(row))
                writer.writeheader()
            writer.writerow(row)
            curve_file.flush()
    return rows, tokens_seen, loss_tokens


def main() -> None:
    args = parse_args()
    t_start = time.time()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))  # tokenizers' thread pool
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    for d in (args.out, args.log_dir, args.work):
        d.mkdir(parents=True, exist_ok=True)
    if args.report_only or args.card_only:
        return rewrite_report(args, chart=not args.card_only)
    previous: list[dict] = []  # metrics.json of the earlier phases, when continuing
    if args.init_from:
        prev = json.loads((args.init_log_dir / "metrics.json").read_text())
        previous = [*prev.pop("previous_phases", []), prev]
    phase = len(previous) + 1

    docs, train_docs, held_docs = split_corpus(args)
    tok, corpus = tokenize_corpus(args, docs, train_docs, held_docs)
    vocab = tok.get_vocab_size()
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(5))
    n_tokens = {k: sum(map(len, v)) for k, v in corpus.items()}
    log(
        f"vocab {vocab}; train {n_tokens['train']:,} tokens ({n_bytes(train_docs) / n_tokens['train']:.2f} "
        f"bytes/token), held-out {n_tokens['held']:,} tokens"
    )
    hf_tok = save_and_check(tok, args.out, held_docs)
    model, n_params = build_model(args, vocab, hf_tok)
    opt = new_optimizer(model, args)

    fim = FimPermuter(tok, token_bytes_table(tok))
    curve_windows = heldout_windows(corpus["held"], fim.eot, args.short_len, args.curve_windows)
    eval_windows = heldout_windows(corpus["held"], fim.eot, args.long_len, args.eval_windows)
    init_metrics = {}
    if args.init_from:  # the starting point, measured exactly like the final report
        init_metrics = {f"init_{k}": v for k, v in heldout_report(model, eval_windows, fim, args.seed).items()}
        log("loaded model, held-out: " + ", ".join(f"{k} {v:.4g}" for k, v in init_metrics.items()))

    at = schedule(args, t_start)
    data_seed = args.seed + phase - 1  # a new file order per phase; evaluation keeps args.seed
    data = WindowStream(corpus["train"], fim.eot, data_seed)
    rng = np.random.default_rng(data_seed)  # FIM decisions and cut points
    t_train = time.time()
    rows, tokens_seen, loss_tokens = train(
        model, opt, data, fim, rng, curve_windows, at, args.log_dir / curve_name(phase), args, t_start
    )
    train_seconds = time.time() - t_train

    metrics = heldout_report(model, eval_windows, fim, args.seed)  # on full 512-token windows
    log("held-out: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
    # config.json, generation_config.json, model.safetensors (tied lm_head stored once)
    model.save_pretrained(args.out, safe_serialization=True)
    hf_tok.save_pretrained(args.out)
    examples = samples(model, hf_tok)
    log(f"sample completion: {examples['completion']!r}; FIM middle: {examples['fim_middle']!r}")

    run = {
        "train_files": len(train_docs),
        "heldout_files": len(held_docs),
        "train_bytes": n_bytes(train_docs),
        "heldout_bytes": n_bytes(held_docs),
        "train_corpus_tokens": n_tokens["train"],
        "heldout_corpus_tokens": n_tokens["held"],
        "vocab_size": vocab,
        "n_embd": args.n_embd,
        "n_layer": args.n_layer,
        "n_head": 12,
        "parameters": n_params,
        "steps": len(rows),
        "tokens_seen": tokens_seen,
        "loss_tokens": loss_tokens,
        "epochs": tokens_seen / n_tokens["train"],
        "train_seconds": train_seconds,
        "total_seconds": time.time() - t_start,
        "safetensors_bytes": (args.out / "model.safetensors").stat().st_size,
        **init_metrics,
        **metrics,
        "examples": examples,
    }
    write_report(run_summary(args, phase, previous, run), rows, args)
    log(f"done in {(time.time() - t_start) / 60:.1f} min; artifacts in {args.out}")


if __name__ == "__main__":
    main()
