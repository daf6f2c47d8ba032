"""The demo model's data: the corpus (the interpreter's own standard library), its train / held-out split, the
tokenized corpus (cached by content), packed training windows and StarCoder-style fill-in-the-middle.

It trains no tokenizer itself (tokenizer.py does, called from `tokenize_corpus`) and no model.
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common import IGNORE, SPECIAL_TOKENS, log
from tokenizer import train_tokenizer

# Directories of the standard library that are not "ordinary Python source": test suites (a third of the
# stdlib, full of deliberately odd code), generated codec tables, pydoc's generated help-text blob, and
# anything installed into the interpreter's own site-packages.
SKIP_DIRS = {"test", "tests", "idle_test", "encodings", "pydoc_data", "site-packages", "__pycache__"}
SKIP_PREFIXES = ("_sysconfigdata",)  # the build's generated config dict, not code
MAX_FILE_BYTES = 256_000  # skip the few giant files; they would dominate the held-out split
MAX_LINE_CHARS = 1_000  # a line this long is data, not code


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


def split_corpus(args) -> tuple[list[Doc], list[Doc], list[Doc]]:
    """All files (the first --max-files), and the training and held-out files among them."""
    docs = collect_sources(args.site_packages)[: args.max_files]
    train_docs = [d for d in docs if not is_heldout(d.name, args.heldout_percent)]
    held_docs = [d for d in docs if is_heldout(d.name, args.heldout_percent)]
    log(
        f"corpus: {len(train_docs)} train files ({n_bytes(train_docs) / 1e6:.1f} MB), "
        f"{len(held_docs)} held-out files ({n_bytes(held_docs) / 1e6:.2f} MB)"
    )
    return docs, train_docs, held_docs


def n_bytes(docs: list[Doc]) -> int:
    return sum(len(d.text.encode()) for d in docs)


def tokenize_corpus(args, docs: list[Doc], train_docs: list[Doc], held_docs: list[Doc]):
    """(tokenizer, {"train": [ids per file], "held": [...]}), cached in --work by the files' content.  The
    tokenizer is --init-from's when continuing, else trained here on the training files only."""
    from tokenizers import Tokenizer

    key = hashlib.sha256()
    for d in docs:
        key.update(d.name.encode() + b"\0" + hashlib.sha256(d.text.encode()).digest())
    key.update(f"{args.vocab_size}/{args.heldout_percent}".encode())
    if args.init_from:  # the corpus tokenized with the loaded model's tokenizer
        key.update((args.init_from / "tokenizer.json").read_bytes())
    cache = args.work / f"cache-{key.hexdigest()[:16]}"
    if args.init_from:
        tok = Tokenizer.from_file(str(args.init_from / "tokenizer.json"))
        log(f"reusing the tokenizer of {args.init_from}")
    if (cache / "corpus.pt").exists():
        log(f"loaded tokenizer + tokenized corpus from {cache}")
        return Tokenizer.from_file(str(cache / "tokenizer.json")), torch.load(cache / "corpus.pt")
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
    return tok, corpus


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


def heldout_windows(docs: list[list[int]], eot: int, length: int, count: int) -> list[list[int]]:
    """`count` evenly spaced, non-overlapping windows of the held-out stream (files in name order)."""
    stream = [t for d in docs for t in (*d, eot)]
    n = len(stream) // length
    picks = np.linspace(0, n - 1, num=min(count, n)).round().astype(int).tolist()
    return [stream[i * length : (i + 1) * length] for i in sorted(set(picks))]
