"""OpenAI's protocol: `POST /v1/completions` and `POST /v1/chat/completions` checked into rows, and the
answers built from the rows' results, whole or as server-sent events, as OpenAI documents them.

A request with P prompts and n choices is P x n rows; choice index = prompt index x n + j, and choice j
samples with seed + j. Log-probabilities are the model's own (log-softmax of its scores, before
temperature, top-k or top-p), as vLLM reports them by default. No torch here.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

from pydantic import BaseModel, ConfigDict

from autotp.fim import FimError, Split, layout_of, split_fim, stop_ids
from autotp.serve.api.boundary import (
    MAX_LOGPROBS,
    ApiError,
    Parsed,
    Served,
    checked_ids,
    fit_fim,
    invalid,
    parse_json,
    prompt_ids,
    sampling,
    seeds,
    stop_strings,
    usage_of,
    validate,
)
from autotp.serve.engine.text import TokenTexts
from autotp.serve.types import Piece, Result, Row, TokenLogprob

STRICT = ConfigDict(strict=True, extra="forbid")

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on chat's top_logprobs (completions' logprobs: MAX_LOGPROBS)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class Sampled(BaseModel):
    """The fields both endpoints share. strict: "5" is not an int, 1 is a float, true is no int. Fields of
    OpenAI's API that autotp does not implement accept only their neutral value, so a client that sends
    the default still works."""

    model_config = STRICT
    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extension: 0 or -1 is off
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, int] | None = None
    # SGLang's extensions, which its router (sglang-router) and vllm-router add to every body they forward:
    # accepted at the values they add, which are what autotp does anyway (ROUTER_NEUTRAL)
    no_stop_trim: bool | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    return_hidden_states: bool | None = None


class CompletionBody(Sampled):
    prompt: str | list[str] | list[int] | list[list[int]]  # text, texts, token ids, lists of token ids (OpenAI's)
    suffix: str | None = None
    max_tokens: int | None = None
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None


class TextPart(BaseModel):
    model_config = STRICT
    type: str
    text: str


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatBody(Sampled):
    messages: list[Message]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    continue_final_message: bool | None = None  # SGLang's chat extensions, added by the routers too
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None


MAX_N = 16  # choices per prompt: each one is a row

# The value each SGLang extension takes when it changes nothing, beside None (left out). no_stop_trim false: the
# stop string is cut from the text; ignore_eos false: EOS ends a row; skip_special_tokens true: special tokens are
# left out of the text (autotp's decode skips them); no hidden states. Chat: the template adds the generation
# prompt (no final message continued); with no reasoning parser there is no reasoning to separate or stream.
ROUTER_NEUTRAL = {"no_stop_trim": (None, False), "ignore_eos": (None, False), "skip_special_tokens": (None, True),
                  "return_hidden_states": (None, False)}
CHAT_NEUTRAL = {"continue_final_message": (None, False), "separate_reasoning": (None, True),
                "stream_reasoning": (None, True)}


def _neutral(body: BaseModel, fields: dict[str, tuple]) -> None:
    for name, allowed in fields.items():
        value = getattr(body, name)
        if value not in allowed:
            raise invalid(name, f"{name}={json.dumps(value)} is not supported by autotp serve; leave it out or "
                                f"send {json.dumps(allowed[-1])}")


def _common(body: Sampled, served: Served, max_tokens: int | None, default_tokens: int):
    """The checks both endpoints make: model, neutral fields, n, sampling, stop strings."""
    if body.model != served.model_id:
        raise ApiError(404, f"the model {body.model!r} does not exist: this server serves {served.model_id!r}",
                       param="model", code="model_not_found")
    _neutral(body, {"presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
                    **ROUTER_NEUTRAL})
    n = 1 if body.n is None else body.n
    if not 1 <= n <= MAX_N:
        raise invalid("n", f"n must be between 1 and {MAX_N}, got {n}")
    checked = sampling(served, temperature=1.0 if body.temperature is None else body.temperature,
                       top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
                       top_k=0 if body.top_k in (None, -1) else body.top_k,
                       max_tokens=default_tokens if max_tokens is None else max_tokens)
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options", "stream_options is only allowed with stream=true")
    return n, checked, stop_strings(body.stop)


def _rows(ids: tuple[int, ...], n: int, checked, stop: tuple[str, ...], logprobs: int | None,
          prompt_logprobs: bool = False, max_tokens: int | None = None, stop_ids: tuple[int, ...] = ()) -> list[Row]:
    return [Row(ids, max_tokens or checked.max_tokens, checked.temperature, checked.top_p, seed, stop, checked.top_k,
                logprobs, prompt_logprobs, stop_ids) for seed in seeds(checked.seed, n)]


def _fim(served: Served, prompts: list, suffix: str | None, echo: bool) -> list[Split] | None:
    """Each prompt's parts where the request is fill-in-the-middle: a text prompt with a suffix, or every prompt
    written in the tokenizer's FIM form (Continue's and Tabby's templates); None for any other request, and with
    echo, which repeats the prompt as it was sent. These are cut to the context (boundary.fit_fim), not refused."""
    if echo or not all(isinstance(p, str) for p in prompts):
        return None
    if suffix is not None:
        try:
            layout_of(served.tokenizer)
        except FimError:
            raise invalid("suffix", f"suffix needs fill-in-the-middle tokens, and the tokenizer of {served.model_id} "
                                    f"lacks them") from None
        return [Split("", p, suffix) for p in prompts]
    splits = [split_fim(served.tokenizer, p) for p in prompts]
    return None if None in splits else splits


def parse_completion(raw: bytes, served: Served) -> Parsed:
    """POST /v1/completions bytes -> rows, every parameter checked; raises ApiError."""
    body = validate(CompletionBody, parse_json(raw))
    _neutral(body, {"best_of": (None, 1)})
    one = isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], int))
    prompts = [body.prompt] if one else body.prompt
    if not prompts:
        raise invalid("prompt", "the prompt list is empty")
    echo = bool(body.echo)
    if echo and body.suffix is not None:
        raise invalid("echo", "echo cannot be combined with suffix")
    if body.suffix is not None and not isinstance(prompts[0], str):
        raise invalid("suffix", "suffix needs a text prompt: fill-in-the-middle tokens are placed around its text")
    fims = _fim(served, prompts, body.suffix, echo)
    asked = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default of 16 tokens
    # a FIM prompt is cut to leave room: what is asked is checked for its range only, and bounds what is generated
    n, checked, stop = _common(body, served, asked if fims is None else min(asked, 1), 16)
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
        raise invalid("logprobs", f"logprobs must be between 0 and {MAX_LOGPROBS}, got {body.logprobs}")
    logprobs, prompt_logprobs = body.logprobs, echo and body.logprobs is not None
    if fims is None:
        ids = [prompt_ids(served, p, checked.max_tokens) if isinstance(p, str) else
               checked_ids(served, tuple(p), checked.max_tokens) for p in prompts]
        rows = [r for i in ids for r in _rows(i, n, checked, stop, logprobs, prompt_logprobs)]
    else:
        stops, rows = stop_ids(served.tokenizer), []
        for split in fims:
            fitted = fit_fim(served, split.prefix, split.suffix, asked, lead=split.lead)
            rows += _rows(fitted.ids, n, checked, stop, logprobs, prompt_logprobs, fitted.max_tokens, stops)
    # what echo repeats of a prompt sent as ids: its text, decoded as the completion's is
    texts = [p if isinstance(p, str) else served.tokenizer.decode(p, skip_special_tokens=True) for p in prompts]
    stream = bool(body.stream)
    usage = stream and body.stream_options is not None and body.stream_options.include_usage
    return Parsed(rows, stream, Completions(served, [t for t in texts for _ in range(n)], echo, body.logprobs,
                                            usage))


def _chat_prompt(body: ChatBody, served: Served) -> str:
    tokenizer = served.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise invalid("messages", f"the tokenizer of {served.model_id} has no chat template: send the prompt to "
                                  f"/v1/completions instead")
    if not body.messages:
        raise invalid("messages", "the message list is empty")
    messages = []
    for m in body.messages:
        if isinstance(m.content, list):
            if any(part.type != "text" for part in m.content):
                raise invalid("messages", "only text content parts are supported")
            content = "".join(part.text for part in m.content)
        else:
            content = m.content or ""
        messages.append({"role": m.role, "content": content} | ({"name": m.name} if m.name else {}))
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - the template's own check of the conversation (jinja raise_exception)
        raise invalid("messages", f"the chat template refused the messages: {e}".splitlines()[0]) from None


def parse_chat(raw: bytes, served: Served) -> Parsed:
    """POST /v1/chat/completions bytes -> rows: the messages through the tokenizer's chat template."""
    body = validate(ChatBody, parse_json(raw))
    _neutral(body, CHAT_NEUTRAL)
    text = _chat_prompt(body, served)
    tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    n, checked, stop = _common(body, served, tokens, 1)
    top = body.top_logprobs
    if top is not None and not (body.logprobs and 0 <= top <= MAX_TOP_LOGPROBS):
        raise invalid("top_logprobs", f"top_logprobs needs logprobs=true and is between 0 and {MAX_TOP_LOGPROBS}, "
                                      f"got {top}")
    ids = prompt_ids(served, text, checked.max_tokens if tokens is not None else 1, param="messages",
                     template=True)
    if tokens is None:  # OpenAI's default: as many as the context leaves
        checked = replace(checked, max_tokens=served.room(len(ids)))
    logprobs = (top or 0) if body.logprobs else None
    stream = bool(body.stream)
    usage = stream and body.stream_options is not None and body.stream_options.include_usage
    return Parsed(_rows(ids, n, checked, stop, logprobs), stream, Chat(served, n, logprobs, usage))


class Completions:
    """The answers of /v1/completions: a `text_completion` object, or its chunks."""

    prefix, kind = "cmpl", "text_completion"

    def __init__(self, served: Served, prompts: list[str], echo: bool, logprobs: int | None, usage: bool):
        self.served, self.prompts, self.echo, self.logprobs, self.usage = served, prompts, echo, logprobs, usage
        self.pending: dict[int, list[TokenLogprob]] = {}  # streamed log-probabilities not sent yet
        self.rows: list[Row] = []
        self.texts: dict[int, TokenTexts] = {}  # a streamed choice's token texts, which go on from its last token
        self.offset: dict[int, int] = {}  # the length of a streamed choice's token texts so far

    def _object(self, cid: str, choices: list[dict], usage: dict | None = None) -> dict:
        out = {"id": cid, "object": self.kind, "created": int(time.time()), "model": self.served.model_id,
               "choices": choices}
        return out | ({"usage": usage} if usage is not None else {})

    def _choice(self, index: int, text: str, reason: str | None, logprobs: dict | None = None) -> dict:
        return {"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs}

    def body(self, cid: str, rows: list[Row], results: list[Result], prompt_tokens: int) -> dict:
        choices = []
        for i, (row, r) in enumerate(zip(rows, results, strict=True)):
            text = self.prompts[i] + r.text if self.echo else r.text
            lp = None
            if self.logprobs is not None:
                ids = list(row.ids) + list(r.tokens) if self.echo else list(r.tokens)
                entries = list(r.prompt_logprobs) + list(r.logprobs) if self.echo else list(r.logprobs)
                lp = self._logprobs(TokenTexts(self.served.tokenizer, [] if self.echo else row.ids), ids, entries)
            choices.append(self._choice(i, text, r.finish_reason, lp))
        return self._object(cid, choices, usage_of(prompt_tokens, results))

    def _logprobs(self, texts: TokenTexts, ids: list[int], entries: list[TokenLogprob | None],
                  offset: int = 0) -> dict:
        """OpenAI's legacy shape: tokens, token_logprobs, top_logprobs (the top N plus the chosen token,
        as vLLM gives them), text_offset (into this choice's text, which has `offset` characters before these
        tokens). Each token's text is what it adds to the tokens before it (engine/text.TokenTexts)."""
        special = set(self.served.tokenizer.all_special_ids)
        tokens, offsets, tops = [], [], []
        for t, e in zip(ids, entries, strict=True):
            tokens.append(texts.text(t))
            offsets.append(offset)
            offset += 0 if t in special else len(tokens[-1])  # the text skips a special token (<s>)
            tops.append(None if e is None else {texts.text(i): lp for i, lp in e.top} | {tokens[-1]: e.logprob})
            texts.push(t)
        return {"tokens": tokens, "token_logprobs": [None if e is None else e.logprob for e in entries],
                "top_logprobs": tops, "text_offset": offsets}

    def start(self, cid: str, rows: list[Row]) -> list[dict]:
        self.rows = rows
        if not self.echo:
            return []
        return [self._object(cid, [self._choice(i, p, None)]) for i, p in enumerate(self.prompts)]

    def piece(self, cid: str, index: int, piece: Piece) -> list[dict]:
        if piece.logprob is not None:
            self.pending.setdefault(index, []).append(piece.logprob)
        if not piece.text:
            return []
        return [self._object(cid, [self._choice(index, piece.text, None, self._flush(index))])]

    def _flush(self, index: int) -> dict | None:
        entries = self.pending.pop(index, [])
        if not entries:
            return None
        texts = self.texts.setdefault(index, TokenTexts(self.served.tokenizer, self.rows[index].ids))
        out = self._logprobs(texts, [e.id for e in entries], entries,
                             self.offset.get(index, len(self.prompts[index]) if self.echo else 0))
        self.offset[index] = out["text_offset"][-1] + len(out["tokens"][-1])
        return out

    def finish(self, cid: str, index: int, result: Result) -> list[dict]:
        return [self._object(cid, [self._choice(index, "", result.finish_reason, self._flush(index))])]

    def end(self, cid: str, results: list[Result], prompt_tokens: int) -> list[dict | str]:
        tail: list[dict | str] = [self._object(cid, [], usage_of(prompt_tokens, results))] if self.usage else []
        return [*tail, "[DONE]"]

    def failure(self, error: ApiError) -> list[dict | str]:
        """How a stream that failed ends: the error object, then [DONE] (vLLM's, which the openai client reads as
        an APIError)."""
        return [error.body(), "[DONE]"]


class Chat(Completions):
    """The answers of /v1/chat/completions: a `chat.completion` object, or `chat.completion.chunk`s."""

    prefix = "chatcmpl"

    def __init__(self, served: Served, n: int, logprobs: int | None, usage: bool):
        super().__init__(served, [], False, logprobs, usage)
        self.n = n

    @staticmethod
    def _content(texts: TokenTexts, entries: list[TokenLogprob]) -> dict:
        """OpenAI's chat shape; each token's text is what it adds to the tokens before it (engine/text.TokenTexts)."""

        def token(i: int, lp: float) -> dict:
            s = texts.text(i)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}

        content = []
        for e in entries:
            content.append(token(e.id, e.logprob) | {"top_logprobs": [token(i, lp) for i, lp in e.top]})
            texts.push(e.id)
        return {"content": content}

    def body(self, cid: str, rows: list[Row], results: list[Result], prompt_tokens: int) -> dict:
        choices = [{"index": i, "message": {"role": "assistant", "content": r.text},
                    "logprobs": self._content(TokenTexts(self.served.tokenizer, row.ids), list(r.logprobs))
                    if self.logprobs is not None else None,
                    "finish_reason": r.finish_reason} for i, (row, r) in enumerate(zip(rows, results, strict=True))]
        return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": self.served.model_id,
                "choices": choices, "usage": usage_of(prompt_tokens, results)}

    def _chunk(self, cid: str, choices: list[dict], usage: dict | None = None) -> dict:
        out = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
               "model": self.served.model_id, "choices": choices}
        return out | ({"usage": usage} if usage is not None else {})

    def _delta(self, index: int, delta: dict, reason: str | None, entries: list[TokenLogprob] | None) -> dict:
        logprobs = None
        if entries:
            texts = self.texts.setdefault(index, TokenTexts(self.served.tokenizer, self.rows[index].ids))
            logprobs = self._content(texts, entries)
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}

    def start(self, cid: str, rows: list[Row]) -> list[dict]:
        self.rows = rows
        return [self._chunk(cid, [self._delta(i, {"role": "assistant", "content": ""}, None, None)])
                for i in range(len(rows))]

    def piece(self, cid: str, index: int, piece: Piece) -> list[dict]:
        if piece.logprob is not None:
            self.pending.setdefault(index, []).append(piece.logprob)
        if not piece.text:
            return []
        return [self._chunk(cid, [self._delta(index, {"content": piece.text}, None, self.pending.pop(index, None))])]

    def finish(self, cid: str, index: int, result: Result) -> list[dict]:
        return [self._chunk(cid, [self._delta(index, {}, result.finish_reason, self.pending.pop(index, None))])]

    def end(self, cid: str, results: list[Result], prompt_tokens: int) -> list[dict | str]:
        tail: list[dict | str] = [self._chunk(cid, [], usage_of(prompt_tokens, results))] if self.usage else []
        return [*tail, "[DONE]"]


def models_list(served: Served) -> dict:
    return {"object": "list",
            "data": [{"id": served.model_id, "object": "model", "created": served.created, "owned_by": "autotp"}]}
