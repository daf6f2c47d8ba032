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

The CPU is shared, so step times vary: the schedule runs on the wall clock.  `progress` = training time
used / training time available (`--budget-minutes` minus data preparation and a reserve for the final report)
drives the cosine learning rate and the switch to 512-token windows, and training stops at progress 1.  Every
step's sequence length and learning rate go to demo/loss_curve.csv; `--replay demo/loss_curve.csv` repeats
exactly those steps (same seed -> same data order, FIM cuts, initialization), whatever the machine's speed.

    python demo/train.py                       # phase 1 of the shipped model (~30 min on 2 CPU cores)
    python demo/train.py --max-files 60 --budget-minutes 1.5 --out demo/.work/smoke/model \
        --log-dir demo/.work/smoke             # end-to-end smoke test

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
import hashlib
import json
import math
import os
import platform
import random
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent

# StarCoder's special tokens, in StarCoder's order, so they get the same ids (0..4) as in bigcode/starcoder.
EOT, FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX, FIM_PAD = (
    "<|endoftext|>",
    "<fim_prefix>",
    "<fim_middle>",
    "<fim_suffix>",
    "<fim_pad>",
)
SPECIAL_TOKENS = [EOT, FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX, FIM_PAD]
IGNORE = -100  # label value that F.cross_entropy skips (padding)

# Directories of the standard library that are not "ordinary Python source": test suites (a third of the
# stdlib, full of deliberately odd code), generated codec tables, pydoc's generated help-text blob, and
# anything installed into the interpreter's own site-packages.
SKIP_DIRS = {"test", "tests", "idle_test", "encodings", "pydoc_data", "site-packages", "__pycache__"}
SKIP_PREFIXES = ("_sysconfigdata",)  # the build's generated config dict, not code
MAX_FILE_BYTES = 256_000  # skip the few giant files; they would dominate the held-out split
MAX_LINE_CHARS = 1_000  # a line this long is data, not code


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
    return p.parse_args()


# ----------------------------------------------------------------------------------------------------------
# 1. corpus
# ----------------------------------------------------------------------------------------------------------


@dataclass
class Doc:
    name: str  # path relative to its source root, e.g. "stdlib/json/decoder.py"
    text: str


def collect_sources(include_site_packages: bool) -> list[Doc]:
    roots = [("stdlib", Path(sysconfig.get_paths()["stdlib"]))]
    if include_site_packages:
        roots.append(("site-packages", Path(sysconfig.get_paths()["purelib"])))
    docs = []
    for label, root in roots:
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root)
            # stdlib's own site-packages is skipped; for the site-packages root, only the dirs below it count
            if SKIP_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith(SKIP_PREFIXES):
                continue
            if path.is_symlink():
                continue
            try:
                raw = path.read_bytes()
                text = raw.decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if not text.strip() or len(raw) > MAX_FILE_BYTES:
                continue
            if max(map(len, text.splitlines())) > MAX_LINE_CHARS:
                continue
            docs.append(Doc(f"{label}/{rel.as_posix()}", text))
    return docs


def is_heldout(name: str, percent: int) -> bool:
    # Hash of the relative path: stable across machines and independent of how many files exist.
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % 100 < percent


# ----------------------------------------------------------------------------------------------------------
# 2. tokenizer
# ----------------------------------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    # StarCoder's tokenizer.json: BPE over bytes; pre-tokenizer = digits split one by one, then the GPT-2
    # regex over the byte-level alphabet (no prefix space, so encode/decode is exactly lossless).
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,  # includes the 5 special tokens and the 256 byte symbols
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,  # ids 0..4, as in StarCoder
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no <unk> ever
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def to_hf_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,  # StarCoder uses <|endoftext|> for bos, eos and unk
        eos_token=EOT,
        unk_token=EOT,
        additional_special_tokens=SPECIAL_TOKENS[1:],
        clean_up_tokenization_spaces=False,  # the cleanup would rewrite " ," etc. -> not lossless
        model_max_length=512,
    )


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character table used by the ByteLevel pre-tokenizer."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def token_bytes_table(tok) -> list[bytes]:
    """id -> the exact bytes the token stands for (special tokens -> b""), for exact, cheap detokenizing."""
    char_to_byte = {c: b for b, c in bytes_to_unicode().items()}
    table = [b""] * tok.get_vocab_size()
    for piece, idx in tok.get_vocab().items():
        if piece not in SPECIAL_TOKENS:
            table[idx] = bytes(char_to_byte[c] for c in piece)
    return table


# ----------------------------------------------------------------------------------------------------------
# 3. data: packed windows + StarCoder-style FIM
# ----------------------------------------------------------------------------------------------------------


class FimPermuter:
    """bigcode Megatron-LM's `permute`, per window: every <|endoftext|>-separated segment of the window is,
    with probability `rate`, cut at two uniformly random *character* positions and rearranged as

        <fim_prefix> prefix <fim_suffix> suffix <fim_middle> middle

    (PSM; the <|endoftext|> that followed the segment stays in place, so a whole document reads
    `<fim_prefix>p<fim_suffix>s<fim_middle>m<|endoftext|>`).  Re-tokenizing the three pieces separately
    costs 3 sentinels plus a few tokens where the cuts split a token; like Megatron, the suffix is truncated
    to keep the window length fixed, and a shorter result is padded with <fim_pad> (label IGNORE).
    """

    def __init__(self, tok, table: list[bytes]):
        self.tok, self.table = tok, table
        self.eot, self.pre, self.mid, self.suf, self.pad = (tok.token_to_id(t) for t in SPECIAL_TOKENS)

    def __call__(self, window: list[int], rate: float, rng: np.random.Generator):
        """window: L token ids -> (input_ids [L], labels [L], is_middle [L]: mask of FIM-middle tokens)."""
        ids, labels, middle = [], [], []
        segments = _split_keep(window, self.eot)
        for seg in segments:
            out = None
            if seg and seg[0] != self.eot and rng.random() < rate:
                out = self._permute(seg, rng)
            if out is None:  # plain segment (or an <|endoftext|>, or a segment FIM could not rearrange)
                ids += seg
                labels += seg
                middle += [False] * len(seg)
            else:
                ids += out[0]
                labels += out[1]
                middle += out[2]
        assert len(ids) == len(window)
        return ids, labels, middle

    def _permute(self, seg: list[int], rng: np.random.Generator):
        try:  # window edges can cut a multi-byte UTF-8 character; leave such segments plain
            text = b"".join(self.table[i] for i in seg).decode("utf-8")
        except UnicodeDecodeError:
            return None
        lo, hi = sorted(rng.integers(0, len(text) + 1, size=2).tolist())
        p, m, s = (e.ids for e in self.tok.encode_batch([text[:lo], text[lo:hi], text[hi:]]))
        excess = len(p) + len(m) + len(s) + 3 - len(seg)
        if excess > 0:
            if len(s) <= excess:  # nothing sensible left of the suffix: keep the segment plain
                return None
            s = s[: len(s) - excess]
        head = [self.pre, *p, self.suf, *s, self.mid]
        ids = head + m
        pad = len(seg) - len(ids)
        return (
            ids + [self.pad] * pad,
            ids + [IGNORE] * pad,
            [False] * len(head) + [True] * len(m) + [False] * pad,
        )


def _split_keep(window: list[int], sep: int) -> list[list[int]]:
    """[a a E b b E c] -> [[a a] [E] [b b] [E] [c]]: separators become their own segments."""
    out, cur = [], []
    for t in window:
        if t == sep:
            if cur:
                out.append(cur)
            out.append([t])
            cur = []
        else:
            cur.append(t)
    if cur:
        out.append(cur)
    return out


class WindowStream:
    """Endless stream of training windows: each epoch shuffles the files (seeded), concatenates
    `file tokens + <|endoftext|>` into one stream and cuts it into consecutive windows of the requested length
    (the partial window at the end of an epoch is dropped)."""

    def __init__(self, docs: list[list[int]], eot: int, seed: int):
        self.docs, self.eot, self.seed = docs, eot, seed
        self.epoch, self.pos = -1, 0
        self.stream: list[int] = []

    def next(self, length: int) -> list[int]:
        if self.pos + length > len(self.stream):
            self.epoch += 1
            order = random.Random(self.seed * 1000 + self.epoch).sample(range(len(self.docs)), len(self.docs))
            self.stream = [t for i in order for t in (*self.docs[i], self.eot)]
            self.pos = 0
        w = self.stream[self.pos : self.pos + length]
        self.pos += length
        return w


def make_batch(windows: list[list[int]], fim: FimPermuter, rate: float, rng: np.random.Generator):
    """B windows of L ids -> input_ids [B, L] int64, labels [B, L] (IGNORE on padding), is_middle [B, L]."""
    rows = [fim(w, rate, rng) for w in windows]
    return tuple(torch.tensor([r[k] for r in rows]) for k in range(3))


def causal_lm_loss(model, input_ids, labels, reduction="mean"):
    # logits [B, L, V]; position t predicts token t+1, so compare logits[:, :-1] with labels[:, 1:]
    logits = model(input_ids=input_ids).logits
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(),
        labels[:, 1:].flatten(),
        ignore_index=IGNORE,
        reduction=reduction,
    )


# ----------------------------------------------------------------------------------------------------------
# 4. evaluation
# ----------------------------------------------------------------------------------------------------------


def heldout_windows(docs: list[list[int]], eot: int, length: int, count: int) -> list[list[int]]:
    """`count` evenly spaced, non-overlapping windows of the held-out stream (files in name order)."""
    stream = [t for d in docs for t in (*d, eot)]
    n = len(stream) // length
    picks = np.linspace(0, n - 1, num=min(count, n)).round().astype(int).tolist()
    return [stream[i * length : (i + 1) * length] for i in sorted(set(picks))]


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


# ----------------------------------------------------------------------------------------------------------
# 5. main
# ----------------------------------------------------------------------------------------------------------


def lr_at(step: int, progress: float, args) -> float:
    """Linear warmup over the first steps, then cosine decay to min_lr_ratio * lr over the time budget."""
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return args.lr * min(1.0, (step + 1) / args.warmup_steps) * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine)


def new_config(vocab: int, hf_tok, args):
    from transformers import GPTBigCodeConfig

    return GPTBigCodeConfig(
        vocab_size=vocab,
        n_positions=args.long_len,  # 512
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=12,  # fixed: tp 1, 2, 3, 4, 6 divide 12, tp 5 does not
        n_inner=4 * args.n_embd,
        multi_query=True,  # StarCoder: one shared K/V head
        activation_function="gelu_pytorch_tanh",
        resid_pdrop=0.0,  # < 2 epochs of data: dropout only slows learning down
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=hf_tok.convert_tokens_to_ids(EOT),
        eos_token_id=hf_tok.convert_tokens_to_ids(EOT),
        tie_word_embeddings=True,
    )


def seq_len_at(progress: float, args) -> int:
    return args.long_len if progress >= 1 - args.long_fraction else args.short_len


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


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
    if args.report_only:
        summary = json.loads((args.log_dir / "metrics.json").read_text())
        names = ["loss_curve.csv", "loss_curve_continued.csv"][: 1 + len(summary.get("previous_phases", []))]
        plot_curve([read_curve(args.log_dir / n) for n in names], args.out / "loss.png", args)
        (args.out / "README.md").write_text(model_card(summary))
        return
    previous: list[dict] = []  # metrics.json of the earlier phases, when continuing
    if args.init_from:
        prev = json.loads((args.init_log_dir / "metrics.json").read_text())
        previous = [*prev.pop("previous_phases", []), prev]
    phase = len(previous) + 1

    # --- corpus ------------------------------------------------------------------------------------------
    docs = collect_sources(args.site_packages)[: args.max_files]
    train_docs = [d for d in docs if not is_heldout(d.name, args.heldout_percent)]
    held_docs = [d for d in docs if is_heldout(d.name, args.heldout_percent)]
    n_bytes = {k: sum(len(d.text.encode()) for d in v) for k, v in (("train", train_docs), ("held", held_docs))}
    log(
        f"corpus: {len(train_docs)} train files ({n_bytes['train'] / 1e6:.1f} MB), "
        f"{len(held_docs)} held-out files ({n_bytes['held'] / 1e6:.2f} MB)"
    )

    # --- tokenizer + tokenized corpus, cached by content ---------------------------------------------------
    key = hashlib.sha256()
    for d in docs:
        key.update(d.name.encode() + b"\0" + hashlib.sha256(d.text.encode()).digest())
    key.update(f"{args.vocab_size}/{args.heldout_percent}".encode())
    if args.init_from:  # the corpus tokenized with the loaded model's tokenizer
        key.update((args.init_from / "tokenizer.json").read_bytes())
    cache = args.work / f"cache-{key.hexdigest()[:16]}"
    from tokenizers import Tokenizer

    if args.init_from:
        tok = Tokenizer.from_file(str(args.init_from / "tokenizer.json"))
        log(f"reusing the tokenizer of {args.init_from}")
    if (cache / "corpus.pt").exists():
        tok = Tokenizer.from_file(str(cache / "tokenizer.json"))
        corpus = torch.load(cache / "corpus.pt")
        log(f"loaded tokenizer + tokenized corpus from {cache}")
    else:
        if not args.init_from:
            t0 = time.time()
            tok = train_tokenizer([d.text for d in train_docs], args.vocab_size)  # held-out files never seen
            log(f"tokenizer trained in {time.time() - t0:.0f}s")
        corpus = {
            split: [e.ids for e in tok.encode_batch([d.text for d in ds])]
            for split, ds in (("train", train_docs), ("held", held_docs))
        }
        cache.mkdir(parents=True, exist_ok=True)
        tok.save(str(cache / "tokenizer.json"))
        torch.save(corpus, cache / "corpus.pt")
    vocab = tok.get_vocab_size()
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(5))
    n_tokens = {k: sum(map(len, v)) for k, v in corpus.items()}
    log(
        f"vocab {vocab}; train {n_tokens['train']:,} tokens ({n_bytes['train'] / n_tokens['train']:.2f} "
        f"bytes/token), held-out {n_tokens['held']:,} tokens"
    )

    hf_tok = to_hf_tokenizer(tok)
    hf_tok.save_pretrained(args.out)
    # the shipped tokenizer, reloaded the way users load it, must reproduce every held-out file byte for byte
    from transformers import AutoTokenizer, GPTBigCodeForCausalLM

    shipped_tok = AutoTokenizer.from_pretrained(args.out)
    bad = [d.name for d in held_docs if shipped_tok.decode(shipped_tok(d.text).input_ids) != d.text]
    assert not bad, f"tokenizer does not round-trip: {bad[:5]}"
    assert len(shipped_tok) == vocab
    log(f"tokenizer round-trips all {len(held_docs)} held-out files exactly")

    # --- model -------------------------------------------------------------------------------------------
    if args.init_from:
        model = GPTBigCodeForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
        c = model.config
        assert (c.vocab_size, c.n_embd, c.n_layer, c.n_head) == (vocab, args.n_embd, args.n_layer, 12), c
    else:
        model = GPTBigCodeForCausalLM(new_config(vocab, hf_tok, args)).float()
    n_params = sum(p.numel() for p in model.parameters())  # tied lm_head counted once
    log(f"model: n_embd {args.n_embd}, n_layer {args.n_layer}, 12 heads (MQA), {n_params:,} parameters")

    decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices + embeddings decay, biases/LN don't
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )

    fim = FimPermuter(tok, token_bytes_table(tok))
    eot_id = fim.eot
    curve_windows = heldout_windows(corpus["held"], eot_id, args.short_len, args.curve_windows)
    eval_windows = heldout_windows(corpus["held"], eot_id, args.long_len, args.eval_windows)
    init_metrics = {}
    if args.init_from:  # the starting point, measured exactly like the final report
        init_metrics = {f"init_{k}": v for k, v in heldout_report(model, eval_windows, fim, args.seed).items()}
        log("loaded model, held-out: " + ", ".join(f"{k} {v:.4g}" for k, v in init_metrics.items()))

    # --- schedule: the wall clock, or the exact steps of an earlier run -----------------------------------
    replay = None
    if args.replay:
        with open(args.replay, newline="") as f:
            replay = [(int(r["seq_len"]), float(r["lr"])) for r in csv.DictReader(f)]
        log(f"replaying {len(replay)} steps from {args.replay}")
    # the reserve pays for the final plain + FIM evaluation, samples, saving, plotting (on a loaded CPU)
    train_budget_s = args.budget_minutes * 60 - (time.time() - t_start) - args.reserve_seconds
    assert replay or train_budget_s > 30, "--budget-minutes leaves no time to train"
    log(f"training for {train_budget_s / 60:.1f} min" if not replay else "training")
    next_eval = 0.05  # loss-curve point every 5% of the budget (every 5% of the steps when replaying)

    # --- training ----------------------------------------------------------------------------------------
    data_seed = args.seed + phase - 1  # a new file order per phase; evaluation keeps args.seed
    data = WindowStream(corpus["train"], eot_id, data_seed)
    rng = np.random.default_rng(data_seed)  # FIM decisions and cut points
    curve_name = "loss_curve.csv" if phase == 1 else "loss_curve_continued.csv"
    curve_path = args.log_dir / curve_name
    rows: list[dict] = []
    curve_file = open(curve_path, "w", newline="")  # written row by row: a crashed run keeps its curve
    writer = None
    tokens_seen = loss_tokens = 0
    t_train = time.time()
    model.train()
    step = 0
    while True:
        if replay:
            if step == len(replay):
                break
            progress = (step + 1) / len(replay)
            length, lr = replay[step]
        else:
            progress = (time.time() - t_train) / train_budget_s
            if progress >= 1:
                break
            length, lr = seq_len_at(progress, args), lr_at(step, progress, args)
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
            "step": step + 1,
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
                f"step {step + 1} ({progress:.0%}) len {length} lr {lr:.2e} loss {loss.item():.3f} "
                f"held-out {row['heldout_loss']} | {tokens_seen:,} tokens, epoch {data.epoch}, "
                f"{time.time() - t_start:.0f}s"
            )
        rows.append(row)
        if writer is None:
            writer = csv.DictWriter(curve_file, fieldnames=list(row))
            writer.writeheader()
        writer.writerow(row)
        curve_file.flush()
        step += 1
    curve_file.close()
    steps = step
    train_seconds = time.time() - t_train

    # --- final held-out report on full 512-token windows -------------------------------------------------
    metrics = heldout_report(model, eval_windows, fim, args.seed)
    log("held-out: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))

    # --- artifacts ---------------------------------------------------------------------------------------
    # config.json, generation_config.json, model.safetensors (tied lm_head stored once)
    model.save_pretrained(args.out, safe_serialization=True)
    hf_tok.save_pretrained(args.out)
    examples = samples(model, hf_tok)
    log(f"sample completion: {examples['completion']!r}; FIM middle: {examples['fim_middle']!r}")

    reproduce = f"python demo/train.py --replay demo/{curve_name} --seed {args.seed}"
    if args.init_from:
        reproduce = (
            f"python demo/train.py --init-from PHASE_{phase - 1}_MODEL --init-log-dir PHASE_{phase - 1}_LOGS "
            f"--replay demo/{curve_name} --seed {args.seed}"
        )
    summary = {
        "phase": phase,
        "command": "python demo/train.py " + " ".join(sys.argv[1:]),
        "reproduce": reproduce,
        "seed": args.seed,
        "data_seed": data_seed,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "tokenizers": __import__("tokenizers").__version__,
        "machine": f"{cpu_name()}, {args.threads} CPU threads",
        "train_files": len(train_docs),
        "heldout_files": len(held_docs),
        "train_bytes": n_bytes["train"],
        "heldout_bytes": n_bytes["held"],
        "train_corpus_tokens": n_tokens["train"],
        "heldout_corpus_tokens": n_tokens["held"],
        "vocab_size": vocab,
        "n_embd": args.n_embd,
        "n_layer": args.n_layer,
        "n_head": 12,
        "parameters": n_params,
        "steps": steps,
        "tokens_seen": tokens_seen,
        "loss_tokens": loss_tokens,
        "epochs": tokens_seen / n_tokens["train"],
        "train_seconds": train_seconds,
        "total_seconds": time.time() - t_start,
        "safetensors_bytes": (args.out / "model.safetensors").stat().st_size,
        **init_metrics,
        **metrics,
        "examples": examples,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    if previous:  # totals over all phases: the shipped model's whole training
        all_phases = [*previous, summary]
        for k in ("steps", "tokens_seen", "loss_tokens", "train_seconds"):
            summary[f"all_phases_{k}"] = sum(ph[k] for ph in all_phases)
        summary["all_phases_epochs"] = summary["all_phases_tokens_seen"] / n_tokens["train"]
        summary["previous_phases"] = previous
    # metrics first: a failing chart or card can be redone with --report-only
    (args.log_dir / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
    prev_curves = [read_curve(args.init_log_dir / "loss_curve.csv")] if args.init_from else []
    plot_curve([*prev_curves, rows], args.out / "loss.png", args)
    (args.out / "README.md").write_text(model_card(summary))
    log(f"done in {summary['total_seconds'] / 60:.1f} min; artifacts in {args.out}")


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


def model_card(s: dict) -> str:
    """README.md of the model directory, from metrics.json (phase 1 alone, or phase 1 + continued training)."""
    ex = s["examples"]
    phases = [*s.get("previous_phases", []), s]
    p1, a1 = phases[0], phases[0]["args"]
    total = {k: s.get(f"all_phases_{k}", s[k]) for k in ("steps", "tokens_seen", "train_seconds", "epochs")}
    size_mb = s["safetensors_bytes"] / 1e6
    head_dim = s["n_embd"] // s["n_head"]
    long_pct = float(a1["long_fraction"])
    training = f"""StarCoder's objective, scaled down: files are shuffled, joined with `<|endoftext|>` and packed into
fixed windows; each document segment of a window is, with probability {a1["fim_rate"]}, cut at two random
character positions and rearranged as `<fim_prefix>prefix<fim_suffix>suffix<fim_middle>middle`
(PSM fill-in-the-middle, as in bigcode's Megatron-LM); the rest is plain left-to-right text.
AdamW (betas 0.9, 0.95, weight decay {a1["weight_decay"]}), gradient clipping 1.0, no dropout,
{a1["tokens_per_step"]} tokens per step; within each phase, 256-token windows for the first {1 - long_pct:.0%}
of the training time and 512-token windows (the full context) for the rest. Each phase's learning rate
warms up linearly and then follows a cosine decay over that phase's wall-clock budget.
"""
    for n, ph in enumerate(phases, 1):
        a = ph["args"]
        what = "from a random initialization (tokenizer trained first)"
        if n > 1:
            what = (
                f"continued from phase {n - 1}'s weights and tokenizer,\nwith a fresh optimizer state and the "
                f"training files reshuffled (data seed {ph['data_seed']})"
            )
        training += f"""
**Phase {n}**, {what}:
peak learning rate {a["lr"]} after {a["warmup_steps"]} warmup steps, cosine decay to {float(a["min_lr_ratio"]):g}x;
{ph["steps"]:,} steps, {ph["tokens_seen"]:,} tokens
({ph["epochs"]:.2f} epochs of the training files) in {ph["train_seconds"] / 60:.1f} min of training
({ph["total_seconds"] / 60:.1f} min end to end) on {ph["machine"]}, i.e.
{ph["tokens_seen"] / ph["train_seconds"]:,.0f} tokens/s including the loss-curve evaluations.
"""
        if n > 1:
            training += f"""Over this phase the held-out plain loss went from {ph["init_heldout_plain_loss"]:.3f} to
{ph["heldout_plain_loss"]:.3f} and the FIM loss from {ph["init_heldout_fim_loss"]:.3f} to {ph["heldout_fim_loss"]:.3f}.
"""
    niced = " (phase 2 ran at `nice -n 19`, on CPU time they left idle)" if len(phases) > 1 else ""
    training += f"""
In total: {total["steps"]:,} steps, {total["tokens_seen"]:,} tokens seen ({total["epochs"]:.2f} epochs of the
training files), {total["train_seconds"] / 60:.1f} min of training (torch {s["torch"]}, transformers
{s["transformers"]}, tokenizers {s["tokenizers"]}). The cores were shared with other jobs{niced}; an idle
machine gets more tokens into the same budget."""
    if len(phases) == 1:
        training = training.replace("Each phase's learning rate", "The learning rate").replace(
            "within each phase, ", ""
        )
        training = training.replace(" over that phase's wall-clock budget", " over the wall-clock budget")
    rows = [
        ("plain left-to-right", "plain_loss", "plain_ppl"),
        ("fill-in-the-middle (every segment PSM), all tokens", "fim_loss", "fim_ppl"),
        ("fill-in-the-middle, middle tokens only", "fim_middle_loss", "fim_middle_ppl"),
    ]
    if len(phases) == 1:
        table = "| | loss (nats/token) | perplexity |\n|---|---|---|\n" + "".join(
            f"| {name} | {s[f'heldout_{lo}']:.3f} | {s[f'heldout_{pp}']:.1f} |\n" for name, lo, pp in rows
        )
    else:
        head = " | ".join(f"after phase {n}: loss | ppl" for n in range(1, len(phases) + 1))
        table = f"| | {head} |\n|---|" + "---|---|" * len(phases) + "\n"
        for name, lo, pp in rows:
            cells = " | ".join(f"{ph[f'heldout_{lo}']:.3f} | {ph[f'heldout_{pp}']:.1f}" for ph in phases)
            table += f"| {name} | {cells} |\n"
    reproduce = f"""```
python demo/train.py                 # phase 1, wall-clock schedule: --budget-minutes {a1["budget_minutes"]}
{p1["reproduce"]}   # exactly phase 1's {p1["steps"]} steps
```
"""
    if len(phases) > 1:
        reproduce = f"""The shipped model is phase 1 followed by phase 2. Phase 1 was `{p1["command"].strip()}` (a
wall-clock schedule of --budget-minutes {a1["budget_minutes"]}); phase 2, started from phase 1's model, which
was then in `src/autotp/demo_model/` with its logs in `demo/`, was

```
nice -n 19 {s["command"]}
```

Wall-clock schedules depend on the machine's speed. To repeat exactly the same steps of both phases (same
data order, FIM cuts, sequence lengths and learning rates), replay them into a scratch directory; nothing
in the repository is overwritten:

```
python demo/train.py --replay demo/loss_curve.csv --seed {p1["seed"]} \\
    --out demo/.work/phase1/model --log-dir demo/.work/phase1
python demo/train.py --init-from demo/.work/phase1/model --init-log-dir demo/.work/phase1 \\
    --replay demo/loss_curve_continued.csv --seed {s["seed"]} \\
    --out demo/.work/phase2/model --log-dir demo/.work/phase2
```

To replay phase 2 alone from the exact phase-1 files, take them from the git commit that shipped phase 1
(`git log -- src/autotp/demo_model`):

```
mkdir -p demo/.work/p1 && git archive be566f2 src/autotp/demo_model demo | tar -x -C demo/.work/p1
python demo/train.py --init-from demo/.work/p1/src/autotp/demo_model --init-log-dir demo/.work/p1/demo \\
    --replay demo/loss_curve_continued.csv --seed {s["seed"]} \\
    --out demo/.work/phase2/model --log-dir demo/.work/phase2
```
"""
    fim_vs_plain = "worse than" if s["heldout_fim_middle_loss"] > s["heldout_plain_loss"] else "better than"
    curves = "`demo/loss_curve.csv`" + (" and `demo/loss_curve_continued.csv`" if len(phases) > 1 else "")
    return f"""# autotp demo model

A tiny [StarCoder](https://huggingface.co/bigcode/starcoder)-architecture (GPT-BigCode) model trained
from scratch on the Python standard library, shipped inside `autotp` so that tensor-parallel tests and
examples run on a real, trained checkpoint without downloading anything. **It is a test fixture, not a
coding assistant**: it writes Python-flavoured text (indentation, comments, identifier fragments) that
soon degenerates into repetition, never correct or useful code.

## Architecture

| | |
|---|---|
| class | `GPTBigCodeForCausalLM` (`model_type: gpt_bigcode`) |
| layers / hidden / MLP | {s["n_layer"]} / {s["n_embd"]} / {4 * s["n_embd"]} (`gelu_pytorch_tanh`) |
| attention | **multi-query** (`multi_query: true`): {s["n_head"]} query heads of dim {head_dim}, \
one shared K/V head |
| positions | learned absolute, `n_positions` 512 |
| vocabulary | {s["vocab_size"]} byte-level BPE tokens, embeddings tied with the LM head |
| parameters | {s["parameters"]:,} (float32; `model.safetensors` {size_mb:.1f} MB) |

12 heads make tensor-parallel degrees 1, 2, 3, 4 and 6 split the heads evenly and 5 unevenly.

## Tokenizer

Byte-level BPE trained with `tokenizers` on the training files only, with StarCoder's pre-tokenizer
(digits split one by one, then the GPT-2 byte-level regex) and StarCoder's special tokens at StarCoder's
ids: `<|endoftext|>` = 0 (also bos / eos / unk), `<fim_prefix>` = 1, `<fim_middle>` = 2,
`<fim_suffix>` = 3, `<fim_pad>` = 4. No padding token is set (as in StarCoder). `decode(encode(x)) == x`
holds exactly for every held-out file (checked by the training script on the saved tokenizer).

## Data

Python {s["python"]}'s standard library `*.py` files (the CPython sources, PSF license), excluding
test suites (`test/`, `tests/`, `idle_test/`), generated codec tables (`encodings/`), `pydoc_data/`,
files over 256 kB and files with lines over 1000 characters. Files are split by a hash of their path:
{s["train_files"]} training files ({s["train_bytes"] / 1e6:.1f} MB, {s["train_corpus_tokens"]:,} tokens)
and {s["heldout_files"]} held-out files ({s["heldout_bytes"] / 1e6:.2f} MB,
{s["heldout_corpus_tokens"]:,} tokens) that neither the tokenizer nor the model saw.

## Training

{training}

![loss curve](loss.png)

## Held-out results

{s["heldout_eval_windows"]} evenly spaced 512-token windows of the held-out files
({s["heldout_eval_tokens"]:,} predicted tokens), the same windows and FIM cuts for every phase:

{table}
Plain text: {s["heldout_plain_bits_per_byte"]:.2f} bits per byte.

## Examples (greedy decoding)

`def print_hello_world():`, 48 new tokens:

```python
{ex["completion_prompt"]}{ex["completion"]}
```

Fill-in-the-middle, prompt
`<fim_prefix>{_esc(ex["fim_prefix"])}<fim_suffix>{_esc(ex["fim_suffix"])}<fim_middle>`;
generated middle (greedy, up to `<|endoftext|>` or 24 tokens): `{_esc(ex["fim_middle"])}`, i.e.

```python
{ex["fim_prefix"]}{ex["fim_middle"]}{ex["fim_suffix"]}```

## What it can and cannot do

With {total["epochs"]:.1f} epochs over {s["train_corpus_tokens"] / 1e6:.1f}M tokens, it has learned the surface of
Python source: indentation, comments, blank lines, docstring quotes, statement-shaped lines, identifier
fragments of the standard library. It has not learned to write code: greedy decoding falls into
repetition within a line or two, nesting and indentation do not stay consistent, strings are left open,
and its fill-in-the-middle answers have the shape of a middle without being a sensible infill (see the
examples above); held-out FIM middles are predicted {fim_vs_plain} plain text
(loss {s["heldout_fim_middle_loss"]:.2f} vs {s["heldout_plain_loss"]:.2f}).
Contexts longer than 512 tokens are not supported. Use it to test loading, sharding and numerical parity
of tensor-parallel inference (its logits are those of a trained, non-degenerate network), not to generate
code.

## Reproduce

{reproduce}
The loss curve is in {curves}, all numbers above in `demo/metrics.json`.
"""


def _esc(text: str) -> str:
    return text.encode("unicode_escape").decode()


if __name__ == "__main__":
    main()
