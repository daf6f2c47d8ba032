"""llama.cpp's `infill` sampler (llama_sampler_infill_apply, src/llama-sampling.cpp), which llama.vim puts in every
request's chain (`samplers: ["top_k", "top_p", "infill"]`): it stops a middle where the code stops.

Given the candidates top-k and top-p left, with their probabilities (a softmax over the candidates alone, in float32
as llama.cpp computes it, the likeliest first):
1. end of generation (EOG: the ids that end the row, `eog`) wins when 3 * p(EOG) * candidates > p(text): only the EOG
   candidates stay;
2. otherwise a candidate whose text (its bytes; a special token has none) is a prefix of another's (equal texts
   included) is merged with it: the likelier of the two (the later one only when strictly likelier) takes the other's
   probability, the other is dropped. Pairs are visited as llama.cpp does, each candidate in turn against every
   other, in order, skipping those already dropped;
3. text candidates below 0.2 are dropped; if none is left the row ends: EOT (`eog[0]`) alone; otherwise, renormalised,
   text candidates below 1 / (text candidates left + 1) are dropped too.
What stays is drawn from as llama.cpp's `dist` does: a softmax of the kept candidates' own scores (the merged
probabilities decide only who stays). That part is the caller's (sampler.py): `keep` answers the ids that stay.

Pure host code (numpy, no torch): the rank that samples runs it on the candidates read back from the device.
"""

from __future__ import annotations

import numpy as np

FIRST_THRESHOLD = np.float32(0.2)


def token_bytes(tokenizer) -> list[bytes]:
    """Each id's text as llama.cpp's token_to_piece (special=false) gives it: the bytes it decodes to, none for a
    special token. Byte-level BPE maps each character back to its byte (GPT-2's table); SentencePiece (a vocabulary
    that writes a space as U+2581) writes a raw byte as <0xNN> and any other text as itself."""
    byte_of = {c: b for b, c in _byte_level().items()}
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    byte_level = not any("\u2581" in t for t in tokens if t)
    out = []
    for i, token in enumerate(tokens):
        if i in special or token is None:
            out.append(b"")
        elif byte_level and all(c in byte_of for c in token):
            out.append(bytes(byte_of[c] for c in token))
        elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            out.append(bytes([int(token[3:5], 16)]))
        else:
            out.append(token.replace("\u2581", " ").encode())
    return out


def _byte_level() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> the character a vocabulary writes it as (printable bytes as themselves,
    the others from U+0100 on, in order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(shifted)}}


def _softmax(logits: np.ndarray) -> np.ndarray:
    """float32, summed in order as llama.cpp's llama_sampler_softmax_impl does."""
    p = np.exp(logits - logits[0], dtype=np.float32)
    return p / np.cumsum(p, dtype=np.float32)[-1]


def _sum(p: np.ndarray) -> np.float32:
    return np.cumsum(p, dtype=np.float32)[-1] if len(p) else np.float32(0)


def _merge(ids: list[int], p: np.ndarray, pieces: list[bytes]) -> np.ndarray:
    """Step 2 on p (the candidates' probabilities, likeliest first): -> alive, and p updated in place."""
    alive = np.ones(len(ids), dtype=bool)
    text = [pieces[i] if i < len(pieces) else b"" for i in ids]
    at: dict[bytes, list[int]] = {}
    for j, t in enumerate(text):
        at.setdefault(t, []).append(j)
    # longer[j0]: the positions whose text starts with text[j0] (j0 excluded), in order; only these pairs merge
    longer: dict[int, list[int]] = {}
    for j1, t in enumerate(text):
        for n in range(1, len(t) + 1):
            for j0 in at.get(t[:n], ()):
                if j0 != j1:
                    longer.setdefault(j0, []).append(j1)
    for j0 in range(len(ids)):
        for j1 in sorted(longer.get(j0, ())):
            if not alive[j0]:
                break
            if not alive[j1]:
                continue
            dst, src = (j1, j0) if p[j1] > p[j0] else (j0, j1)
            p[dst] += p[src]
            p[src], alive[src] = 0, False
    return alive


def keep(ids: list[int], logits: list[float], eog: tuple[int, ...], pieces: list[bytes]) -> list[int]:
    """The candidates (ids and their logits, in any order; all finite) -> the ids that stay, likeliest first, or
    [eog[0]] (EOT) alone when no text candidate is left."""
    order = sorted(range(len(ids)), key=lambda j: -logits[j])  # stable: ties keep the caller's order
    ids = [ids[j] for j in order]
    p = _softmax(np.array([logits[j] for j in order], dtype=np.float32))
    end = np.array([i in eog for i in ids], dtype=bool)
    p_eog, p_txt = _sum(p[end]), _sum(p[~end])
    if np.float32(3) * p_eog * np.float32(len(ids)) > p_txt:
        return [i for i, e in zip(ids, end, strict=True) if e]
    alive = _merge(ids, p, pieces)
    kept = [j for j in range(len(ids)) if end[j] or p[j] >= FIRST_THRESHOLD]
    text = sum(not end[j] for j in kept)
    if text == 0:
        return [eog[0]]
    total = _sum(p[kept])
    threshold = np.float32(1.0 / (text + 1))
    return [ids[j] for j in kept if alive[j] and (end[j] or p[j] / total >= threshold)]
