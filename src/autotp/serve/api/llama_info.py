"""What llama-server's clients ask about the model besides completions: `GET /props` (llama.vscode reads
default_generation_settings.n_ctx from it) and `POST /tokenize`, `POST /detokenize`, in llama-server's shapes
(README "API Endpoints"; server-context.cpp's handlers). No torch here.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from autotp.serve.api.boundary import Served, invalid, parse_json, validate
from autotp.serve.api.llama_api import APPLIED, DEFAULTS


def props(served: Served, slots: int, version: str) -> dict:
    """GET /props. n_ctx is what one row may hold (the context, or the KV cache if that is less); total_slots the
    rows that run at once (--max-num-seqs); the params are the defaults /infill and /completion apply."""
    params = {"n_predict": -1, "seed": 4294967295, **DEFAULTS, "min_p": 0.0, "stop": [], "max_tokens": -1,
              "n_keep": 0, "n_discard": 0, "ignore_eos": False, "stream": False, "n_probs": 0, "min_keep": 0,
              "samplers": list(APPLIED)}
    settings = {"id": 0, "id_task": -1, "n_ctx": served.context, "speculative": False, "is_processing": False,
                "params": params, "prompt": "", "next_token": {"has_next_token": True, "has_new_line": False,
                                                               "n_remain": -1, "n_decoded": 0, "stopping_word": ""}}
    return {"default_generation_settings": settings, "total_slots": slots, "model_path": served.model_id,
            "chat_template": getattr(served.tokenizer, "chat_template", None) or "",
            "modalities": {"vision": False, "audio": False}, "build_info": f"autotp {version}", "is_sleeping": False}


class TokenizeBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    content: str | list[int | str] | None = None
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    tokens: list[int] = []


def _text_ids(served: Served, text: str, special: bool, parse: bool) -> list[int]:
    if len(text) > served.max_prompt_chars:  # tokenizing megabytes holds rank 0's CPU for seconds
        raise invalid("content", f"content of {len(text)} characters is more than any prompt of {served.model_id} "
                                 f"can hold ({served.max_prompt_chars})")
    return served.tokenizer(text, add_special_tokens=special, split_special_tokens=not parse).input_ids


def _checked(served: Served, ids: list[int], param: str) -> list[int]:
    vocab = len(served.tokenizer)
    if (bad := next((t for t in ids if not 0 <= t < vocab), None)) is not None:
        raise invalid(param, f"token id {bad} is not in the vocabulary of {served.model_id} (0 to {vocab - 1})")
    return ids


BYTES = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
# byte-level BPE writes byte b as the character chr(b) where b is printable, others as chr(256 + k) in byte order
# (GPT-2's bytes_to_unicode): this is its inverse
BYTE_OF = {chr(b): b for b in BYTES} | {chr(256 + k): b for k, b in enumerate(b for b in range(256) if b not in BYTES)}


def piece(tokenizer, token: int, added: set[int]) -> str | list[int]:
    """A token's text, or its bytes where they are not UTF-8 on their own (half of a character): llama-server's
    with_pieces. `added`: the ids of the tokenizer's added tokens (specials among them), which are their text."""
    text = tokenizer.convert_ids_to_tokens(token)
    if token in added:
        raw = text.encode()
    elif type(tokenizer.backend_tokenizer.decoder).__name__ == "ByteLevel" and all(c in BYTE_OF for c in text):
        raw = bytes(BYTE_OF[c] for c in text)
    elif text.startswith("<0x") and text.endswith(">") and len(text) == 6:  # sentencepiece's byte fallback
        raw = bytes([int(text[3:5], 16)])
    else:
        raw = tokenizer.decode([token]).encode()
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return list(raw)


def tokenize(raw: bytes, served: Served) -> dict:
    """POST /tokenize: `{"tokens": [ids]}`, or `[{"id", "piece"}]` with with_pieces. A list `content` mixes texts
    and ids (llama-server's tokenize_mixed: only the first item gets the BOS)."""
    body = validate(TokenizeBody, parse_json(raw))
    items = [] if body.content is None else [body.content] if isinstance(body.content, str) else body.content
    ids: list[int] = []
    for i, item in enumerate(items):
        ids += [item] if isinstance(item, int) else _text_ids(served, item, body.add_special and i == 0,
                                                              body.parse_special)
    ids = _checked(served, ids, "content")
    if not body.with_pieces:
        return {"tokens": ids}
    added = set(served.tokenizer.get_added_vocab().values())
    return {"tokens": [{"id": t, "piece": piece(served.tokenizer, t, added)} for t in ids]}


def detokenize(raw: bytes, served: Served) -> dict:
    """POST /detokenize: `{"content": text}`, special tokens written out as llama-server writes them."""
    body = validate(DetokenizeBody, parse_json(raw))
    return {"content": served.tokenizer.decode(_checked(served, body.tokens, "tokens"), skip_special_tokens=False)}

