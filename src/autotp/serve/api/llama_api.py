"""llama-server's native protocol (llama.cpp tools/server), which llama.vim and llama.vscode speak, and Continue's
llama.cpp provider and Twinny POST to: `POST /infill` and `POST /completion` checked into rows, and their answers
built from the rows' results as llama-server builds them (llama_info.py: /props, /tokenize, /detokenize).

As llama-server does (server-task.cpp params_from_json_cmpl and to_json_non_oaicompat, server-common.cpp
format_prompt_infill and json_get_nested_values, server-context.cpp):
- /infill's prompt is the model's FIM format with the other files (`input_extra`, oldest first) in its own
  repository-level tokens (fim.py; llama-server matches only <|file_sep|>), `prompt` (the cursor's line up to the
  cursor) joined to the prefix; a prompt longer than the context is cut by fim.py's budget rule, `truncated: true`.
- `n_predict`: -1 (or left out) as many as the context leaves; 0 computes the prompt only (the engine samples one
  token, which the answer leaves out: content "", tokens_predicted 0); more than the room left generates what
  fits, stop_type "limit", truncated true. `n_cmpl` (or `n`): several completions of one prompt, computed once
  through the prefix cache, answered as an array (several prompts of /completion too).
- Sampling follows the chain: `samplers` (default llama-server's) says which of top_k, top_p, temperature apply;
  a chain without "temperature" samples at 1.0, as llama.cpp's does. "infill" (llama.vim's chain ends with it)
  applies llama.cpp's infill sampler after top-k and top-p (sampling/infill.py): it ends the middle where end of
  generation outweighs the text. "dry", "typ_p", "min_p", "xtc", "top_n_sigma" and "penalties" are accepted but not
  applied; a request that sets one of their parameters to a value that would change anything, with that sampler in
  its chain, is refused. seed -1 (and 4294967295): random.
- `response_fields` picks fields, "timings/prompt_n" moved to the top level under that name; a field that does not
  exist is left out ([""]: `{}`, llama.vim's prepare request). A whole answer is compact JSON (`compact`): llama.vim
  drops any answer without `"content":"` in it.
- `cache_prompt`, `id_slot`, `t_max_prompt_ms` (llama-server ignores it too), `n_keep` and `model` are accepted
  and change nothing: autotp's prefix cache reuses any prompt, and it has no slots.
- Errors are `{"error": {"code", "message", "type"}}`; a prompt that fits no context is 400
  "exceed_context_size_error" with n_prompt_tokens and n_ctx; /infill on a model without FIM tokens is 501.
No torch here.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict

from autotp.fim import Chunk, FimError, split_fim, stop_ids
from autotp.serve.api.boundary import (
    MAX_STOP,
    ApiError,
    Fitted,
    Parsed,
    Served,
    checked_ids,
    fit_fim,
    invalid,
    parse_json,
    sampling,
    seeds,
    validate,
)
from autotp.serve.engine.text import indent_cut
from autotp.serve.types import Piece, Result, Row

LLAMA_PATHS = frozenset({"/infill", "/completion", "/completions", "/tokenize", "/detokenize"})  # llama_info's two
MAX_N = 16  # completions per prompt (n_cmpl), as OpenAI's n
RANDOM_SEEDS = (-1, 4294967295)  # llama.cpp's "pick one" (LLAMA_DEFAULT_SEED)
DEFAULT_CHAIN = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95}  # llama-server's, for a request that leaves them out
APPLIED = ("top_k", "top_p", "temperature")  # the samplers of a chain autotp applies, in the chain's order
# `samplers` as a string of letters (llama.cpp's common_sampler_types_from_chars)
LETTERS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "m": "min_p", "x": "xtc", "t": "temperature",
           "s": "top_n_sigma", "i": "infill", "e": "penalties"}
# a sampler autotp lacks -> its parameters and the values that leave the tokens as they are
INERT = {"min_p": {"min_p": (0.0,)}, "typ_p": {"typical_p": (1.0,)}, "dry": {"dry_multiplier": (0.0,)},
         "xtc": {"xtc_probability": (0.0,)}, "top_n_sigma": {"top_n_sigma": (-1.0, 0.0)},
         "penalties": {"repeat_penalty": (1.0,), "presence_penalty": (0.0,), "frequency_penalty": (0.0,)},
         "temperature": {"dynatemp_range": (0.0,)}}
# parameters outside the chain that autotp does not implement -> their neutral values (beside None, left out)
UNSUPPORTED = {"mirostat": (0,), "n_probs": (0,), "grammar": ("",), "json_schema": (), "logit_bias": ([], {}),
               "ignore_eos": (False,), "lora": ([],), "timings_per_token": (False,), "return_progress": (False,)}


def is_llama(path: str) -> bool:
    return path in LLAMA_PATHS


class Body(BaseModel):
    """The fields /infill and /completion share. Unknown fields are ignored, as llama-server ignores them."""

    model_config = ConfigDict(strict=True, extra="ignore")
    n_predict: int | None = None
    max_tokens: int | None = None  # OpenAI's names, which llama-server reads when n_predict is left out
    max_completion_tokens: int | None = None
    n_cmpl: int | None = None
    n: int | None = None
    n_indent: int | None = None
    t_max_predict_ms: float | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    samplers: list[str] | str | None = None
    stream: bool | None = None
    response_fields: list[str] | None = None
    return_tokens: bool | None = None
    cache_prompt: bool | None = None
    id_slot: int | None = None
    t_max_prompt_ms: float | None = None
    n_keep: int | None = None
    min_p: float | None = None
    typical_p: float | None = None
    dry_multiplier: float | None = None
    xtc_probability: float | None = None
    top_n_sigma: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    dynatemp_range: float | None = None
    mirostat: int | None = None
    n_probs: int | None = None
    grammar: str | None = None
    json_schema: dict | None = None
    logit_bias: list | dict | None = None
    ignore_eos: bool | None = None
    lora: list | None = None
    timings_per_token: bool | None = None
    return_progress: bool | None = None


class Extra(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # llama.vim's `time` ([s, us]), llama.vscode's (ms)
    text: str
    filename: str | None = None


class InfillBody(Body):
    input_prefix: str
    input_suffix: str
    input_extra: list[Extra] | None = None
    prompt: str = ""


class CompletionBody(Body):
    prompt: str | list[int] | list[str | list[int]]


def _chain(body: Body) -> tuple[str, ...]:
    if body.samplers is None:
        return DEFAULT_CHAIN
    names = [LETTERS.get(c, "") for c in body.samplers] if isinstance(body.samplers, str) else body.samplers
    return tuple(n for n in names if n)  # llama.cpp skips a name it does not know


def _check_inert(body: Body, chain: tuple[str, ...]) -> None:
    for sampler, params in INERT.items():
        for name, neutral in params.items():
            value = getattr(body, name)
            if sampler in chain and value is not None and value not in neutral:
                raise invalid(name, f"{name}={value} is not supported by autotp serve ({sampler} sampling); leave it "
                                    f"out, send {neutral[0]}, or leave \"{sampler}\" out of samplers")
    for name, neutral in UNSUPPORTED.items():
        value = getattr(body, name)
        if value is not None and value not in neutral:
            raise invalid(name, f"{name} is not supported by autotp serve; leave it out")


class Asked:
    """What parse_infill and parse_completion read alike: the completions asked for and how to sample them."""

    def __init__(self, body: Body, served: Served):
        chain = _chain(body)
        _check_inert(body, chain)
        asked = (body.n_predict, body.max_completion_tokens, body.max_tokens)
        n_predict = next((v for v in asked if v is not None), -1)
        if n_predict < -1:
            raise invalid("n_predict", f"n_predict must be -1 (as many as fit), 0 (compute the prompt only) or more, "
                                       f"got {n_predict}")
        self.n_predict = n_predict
        self.max_tokens = None if n_predict == -1 else max(n_predict, 1)  # 0: one token, left out of the answer
        self.n = next((v for v in (body.n_cmpl, body.n) if v is not None), 1)
        if not 1 <= self.n <= MAX_N:
            raise invalid("n_cmpl", f"n_cmpl must be between 1 and {MAX_N}, got {self.n}")
        for name in ("n_indent", "t_max_predict_ms"):
            if (getattr(body, name) or 0) < 0:
                raise invalid(name, f"{name} must be at least 0, got {getattr(body, name)}")
        self.indent, self.deadline_s = body.n_indent or 0, (body.t_max_predict_ms or 0) / 1000
        self.samplers = [s for s in chain if s in APPLIED or s == "infill"]
        value = {k: getattr(body, k) if getattr(body, k) is not None else DEFAULTS[k] for k in DEFAULTS}
        temperature = max(value["temperature"], 0.0) if "temperature" in chain else 1.0  # below 0: greedy
        top_k = max(value["top_k"], 0) if "top_k" in chain else 0  # 0 or less: off
        top_p = min(value["top_p"], 1.0) if "top_p" in chain else 1.0  # 1 or more: off
        if top_p <= 0:  # llama.cpp's top-p keeps one token at least: the most likely
            temperature, top_p = 0.0, 1.0
        seed = None if body.seed in RANDOM_SEEDS else body.seed
        self.sampling = sampling(served, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, max_tokens=1)
        before = chain[:chain.index("infill")] if "infill" in chain else ()
        greedy = self.sampling.temperature == 0
        # a greedy temperature or a top-p of 0 before infill leaves it one candidate, which it keeps: no effect
        alone = ("temperature" in before and greedy) or ("top_p" in before and value["top_p"] <= 0)
        self.eog = _eog(served) if "infill" in chain and not alone else ()
        self.scaled = "temperature" in before and not greedy  # infill sees the scaled probabilities
        given = [body.stop] if isinstance(body.stop, str) else body.stop or []
        words = [w for w in given if w]  # llama-server skips an empty stop word
        if len(words) > MAX_STOP:
            raise invalid("stop", f"at most {MAX_STOP} stop strings, got {len(words)}")
        self.stop = tuple(words)
        self.stream = bool(body.stream)
        self.fields = body.response_fields or []
        self.return_tokens = bool(body.return_tokens)

    def rows(self, ids: tuple[int, ...], max_tokens: int, stops: tuple[int, ...]) -> list[Row]:
        s = self.sampling
        return [Row(ids, max_tokens, s.temperature, s.top_p, seed, self.stop, s.top_k, stop_ids=stops,
                    indent=self.indent, newline_deadline_s=self.deadline_s, infill=self.eog,
                    infill_scaled=self.scaled)
                for seed in seeds(s.seed, self.n)]


def _eog(served: Served) -> tuple[int, ...]:
    """The infill sampler's end-of-generation ids, EOT (the tokenizer's eos) first: the eos and the FIM sentinels
    the tokenizer has, as llama.cpp's vocabulary counts them, prompt FIM or not. Each ends the row: the engine ends a
    row at the model's eos, and a FIM prompt's row (/infill, /completion in FIM form) at the sentinels too."""
    eos = served.tokenizer.eos_token_id
    try:
        sentinels = stop_ids(served.tokenizer)
    except FimError:
        sentinels = ()
    eog = tuple(dict.fromkeys(((eos,) if eos is not None else ()) + sentinels))
    if not eog:
        raise invalid("samplers", "the infill sampler ends a middle with an end-of-generation token, and this "
                                  "tokenizer has none (no eos, no FIM sentinels); leave \"infill\" out of samplers")
    return eog


def _no_fim(served: Served, e: FimError) -> ApiError:
    return ApiError(501, f"infill is not supported by {served.model_id}: {e}", code="not_supported",
                    type="not_supported_error")


def parse_infill(raw: bytes, served: Served) -> Parsed:
    """POST /infill bytes -> one row per completion (n_cmpl) of the FIM prompt; raises ApiError."""
    body = validate(InfillBody, parse_json(raw))
    asked = Asked(body, served)
    try:
        stops = stop_ids(served.tokenizer)
    except FimError as e:
        raise _no_fim(served, e) from None
    extra = tuple(Chunk(c.text, c.filename or "") for c in body.input_extra or ())
    fitted = fit_fim(served, body.input_prefix + body.prompt, body.input_suffix, asked.max_tokens, extra=extra,
                     param="input_prefix")
    rows = asked.rows(fitted.ids, fitted.max_tokens, stops)
    return Parsed(rows, asked.stream, Native(served, asked, [fitted] * len(rows)))


class ContextFull(ApiError):
    """llama-server's refusal of a prompt that fills the context, with the numbers llama.vscode reads."""

    def __init__(self, prompt_tokens: int, context: int, param: str):
        super().__init__(400, "the request exceeds the available context size, try increasing it", param=param,
                         code="context_length_exceeded", type="exceed_context_size_error")
        self.n_prompt_tokens, self.n_ctx = prompt_tokens, context


def _plain(served: Served, prompt: str | list[int], max_tokens: int | None) -> Fitted:
    """A /completion prompt that is not FIM: whole or refused, as llama-server does; the row generates what fits."""
    context = served.context
    if isinstance(prompt, str):
        if len(prompt) > served.max_prompt_chars:  # more characters than any context holds: not worth tokenizing
            raise ContextFull(len(prompt) // (served.max_prompt_chars // served.max_model_len), context, "prompt")
        ids = tuple(served.tokenizer(prompt).input_ids)  # BOS where the tokenizer adds one, as llama-server does
    else:
        ids = tuple(prompt)
    left = served.room(len(ids), max_tokens)
    if ids and left < 1:
        raise ContextFull(len(ids), context, "prompt")
    checked_ids(served, ids, left)
    return Fitted(ids, left, False, max_tokens is None or left < max_tokens, 0)


def parse_completion(raw: bytes, served: Served) -> Parsed:
    """POST /completion bytes -> rows: each prompt (a text, token ids, or a list of them) times n_cmpl. A text in
    the tokenizer's FIM form is a FIM prompt and is cut as /infill's is; any other is whole or refused."""
    body = validate(CompletionBody, parse_json(raw))
    asked = Asked(body, served)
    one = isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], int))
    prompts = [body.prompt] if one else body.prompt
    if not prompts:
        raise invalid("prompt", "the prompt list is empty")
    rows, fits = [], []
    for prompt in prompts:
        split = split_fim(served.tokenizer, prompt) if isinstance(prompt, str) else None
        if split is None:
            fitted, stops = _plain(served, prompt, asked.max_tokens), ()
        else:
            fitted = fit_fim(served, split.prefix, split.suffix, asked.max_tokens, lead=split.lead)
            stops = stop_ids(served.tokenizer)
        rows += asked.rows(fitted.ids, fitted.max_tokens, stops)
        fits += [fitted] * asked.n
    return Parsed(rows, asked.stream, Native(served, asked, fits))


def compact(item: dict | list) -> str:
    """JSON as llama-server writes it (nlohmann's dump(-1)): no spaces, UTF-8 as is. llama.vim drops an answer in
    which `"content":` is followed by a space."""
    return json.dumps(item, separators=(",", ":"), ensure_ascii=False)


def pick(fields: list[str], item: dict) -> dict:
    """json_get_nested_values: each path ("timings/prompt_n") that exists, at the top level under its own name."""
    out = {}
    for path in fields:
        value, found = item, True
        for key in path.split("/"):
            found = found and isinstance(value, dict) and key in value
            value = value[key] if found else None
        if found:
            out[path] = value
    return out


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None  # llama-server divides anyway and writes the inf or NaN as null


def timings(prompt_tokens: int, result: Result, predicted: int) -> dict:
    """The request's own: prompt_n the prompt tokens it computed (the rest, cache_n, came from the prefix cache)."""
    computed = prompt_tokens - result.cached_tokens
    prompt_ms, predicted_ms = result.prompt_s * 1e3, result.decode_s * 1e3
    return {"cache_n": result.cached_tokens, "prompt_n": computed, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": _ratio(prompt_ms, computed), "prompt_per_second": _ratio(1e3 * computed, prompt_ms),
            "predicted_n": predicted, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": _ratio(predicted_ms, predicted),
            "predicted_per_second": _ratio(1e3 * predicted, predicted_ms)}


class Native:
    """The answers of /infill and /completion: llama-server's completion object per row (an array when there are
    several), or its server-sent events: one per token, then the row's final object (content "" there)."""

    def __init__(self, served: Served, asked: Asked, fits: list[Fitted]):
        self.served, self.asked, self.fits = served, asked, fits
        self.prepare = asked.n_predict == 0
        self.sent: dict[int, int] = {}  # tokens streamed per row
        self.pending: dict[int, list[int]] = {}  # ids of tokens whose text is held back
        self.rows: list[Row] = []

    def _outcome(self, row: Row, result: Result) -> tuple[str, list[int], str, str]:
        """(content, tokens, stop_type, stopping_word) as llama-server reports them."""
        if self.prepare:
            return "", [], "limit", ""
        text, kind = result.text, {"stop": "eos", "length": "limit"}.get(result.finish_reason, "limit")
        cut = indent_cut(text, row.indent)
        if cut is not None:  # an engine that does not yet end the row there: the answer is cut all the same
            text, kind = text[:cut], "limit"
        return text, list(result.tokens), "word" if result.stopped_by else kind, result.stopped_by

    def _settings(self, row: Row) -> dict:
        r = self.asked
        return {"n_ctx": self.served.context, "model": self.served.model_id, "seed": row.seed,
                "temperature": row.temperature, "top_k": row.top_k, "top_p": row.top_p, "min_p": 0.0,
                "stop": list(row.stop), "max_tokens": r.n_predict, "n_predict": r.n_predict, "n_indent": row.indent,
                "t_max_predict_ms": round(row.newline_deadline_s * 1000), "n_keep": 0, "n_discard": 0,
                "ignore_eos": False, "stream": r.stream, "n_probs": 0, "min_keep": 0, "samplers": r.samplers}

    def final(self, index: int, row: Row, result: Result, streamed: bool) -> dict:
        text, tokens, kind, word = self._outcome(row, result)
        fitted, predicted = self.fits[index], 0 if self.prepare else result.completion_tokens
        full = fitted.capped and result.finish_reason == "length" and result.completion_tokens >= row.max_tokens
        item = {"index": index, "content": "" if streamed else text,
                "tokens": [] if streamed or not self.asked.return_tokens else tokens, "id_slot": -1, "stop": True,
                "model": self.served.model_id, "tokens_predicted": predicted, "tokens_evaluated": len(row.ids),
                "generation_settings": self._settings(row),
                "prompt": self.served.tokenizer.decode(row.ids) if self._wants("prompt") else "",
                "has_new_line": "\n" in text, "truncated": fitted.truncated or (full and not self.prepare),
                "stop_type": kind, "stopping_word": word, "tokens_cached": result.cached_tokens,
                "timings": timings(len(row.ids), result, predicted)}
        return pick(self.asked.fields, item) if self.asked.fields else item

    def _wants(self, field: str) -> bool:
        return not self.asked.fields or any(f.split("/")[0] == field for f in self.asked.fields)

    def body(self, cid: str, rows: list[Row], results: list[Result], prompt_tokens: int) -> dict | list:
        items = [self.final(i, row, r, False) for i, (row, r) in enumerate(zip(rows, results, strict=True))]
        return items[0] if len(items) == 1 else items

    def start(self, cid: str, rows: list[Row]) -> list[dict]:
        self.rows = rows
        return []

    def piece(self, cid: str, index: int, piece: Piece) -> list[dict]:
        if self.prepare:
            return []
        self.sent[index] = self.sent.get(index, 0) + 1
        ids = self.pending.setdefault(index, [])
        ids.append(piece.id)
        if not piece.text:
            return []
        del self.pending[index]
        return [{"index": index, "content": piece.text, "tokens": ids, "stop": False, "id_slot": -1,
                 "tokens_predicted": self.sent[index], "tokens_evaluated": len(self.rows[index].ids)}]

    def finish(self, cid: str, index: int, result: Result) -> list[dict]:
        return [self.final(index, self.rows[index], result, True)]

    def end(self, cid: str, results: list[Result], prompt_tokens: int) -> list[dict]:
        return []  # llama-server's own stream has no [DONE]

    def failure(self, error: ApiError) -> list[dict]:
        """How a stream that failed ends: llama-server's `{"error": ...}` event."""
        return [error_body(error)]


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 429: "unavailable_error", 500: "server_error", 501: "not_supported_error",
               503: "unavailable_error"}  # llama-server has no 429 (it queues): the nearest of its types


def error_body(error: ApiError) -> dict:
    """llama-server's error shape (format_error_response), in the error's own HTTP status."""
    if error.code == "context_length_exceeded":
        kind = "exceed_context_size_error"
    else:
        kind = ERROR_TYPES.get(error.status, "server_error" if error.status >= 500 else "invalid_request_error")
    out = {"code": error.status, "message": error.message, "type": kind}
    if isinstance(error, ContextFull):
        out |= {"n_prompt_tokens": error.n_prompt_tokens, "n_ctx": error.n_ctx}
    return {"error": out}
