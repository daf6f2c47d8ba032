"""What every protocol checks at the boundary, before a request can reach the engine: the JSON itself,
the prompt's size and tokens, the sampling parameters, stop strings; and the error a client gets.

No HTTP framework and no torch in here (nor in the protocol modules openai_api.py and tgi_api.py built
on it): a bad request is refused with an `ApiError` and never touches the ranks. `ApiError.body()` is
OpenAI's error shape `{"error": {"message", "type", "param", "code"}}`; the TGI routes re-shape it.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from functools import cached_property

from pydantic import BaseModel, ValidationError

from autotp.fim import Chunk, FimError, fim_ids
from autotp.sampling.rules import SEED_MAX, SamplingError, check_sampling
from autotp.serve.types import Result, Row, kv_slots

MAX_STOP = 16  # stop strings: OpenAI allows 4, but Continue sends 7 (its StarCoder template's) to other hosts
MAX_LOGPROBS = 5  # OpenAI's limit on top log-probabilities for completions
ECHO_CHARS = 200  # an error message or log line repeats at most this much of what a client sent
# a token's text is at most `longest token` characters, but a normalizer may shrink the text before it is
# split (NFC composes base + mark, Hangul jamo compose 3 -> 1): this margin keeps the cheap bound safe
CHARS_MARGIN = 4


def clip(text: str, limit: int = ECHO_CHARS) -> str:
    """text, or its start and how much was left out: errors and logs never repeat a 5 MB value whole."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        message, param = clip(message, 2 * ECHO_CHARS), None if param is None else clip(param)
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str | None, message: str) -> ApiError:
    return ApiError(400, message, param=param)


GENERATION_FAILED = "generation_failed"  # the code of an engine's 500 (TGI answers it 424)


def engine_error(status: int, message: str) -> ApiError:
    """A row the engine failed: 500 is a failed generation, 503 the server going away."""
    return ApiError(status, message, type="server_error", code=GENERATION_FAILED if status == 500 else None)


@dataclass(frozen=True)
class Served:
    """What the boundary checks against: the model's name, its tokenizer, the context it may use, the KV cache slots
    per rank (a row that needs more could never be admitted) and the ids a prompt may hold: those both the model
    has an embedding for and the tokenizer knows (a fine-tune that added a token without resizing has more of the
    latter: the sharded embedding would turn such an id into zeros, and the model would answer made-up text)."""

    model_id: str
    tokenizer: object
    max_model_len: int
    created: int
    kv_tokens: int
    vocab: int  # min(the model's embedding rows (config.vocab_size), len(tokenizer))

    @property
    def context(self) -> int:
        """The tokens one row may hold, prompt and completion: the context, or the KV cache's slots where those are
        fewer (types.kv_slots: a row's last token takes none). What /props reports as n_ctx."""
        return min(self.max_model_len, self.kv_tokens - kv_slots(0, 1) + 1)

    def room(self, prompt_tokens: int, max_tokens: int | None = None) -> int:
        """The most tokens a row may generate after a prompt of `prompt_tokens`, and at most `max_tokens` where given.
        The one rule for what fits."""
        left = self.context - prompt_tokens
        return left if max_tokens is None else min(max_tokens, left)

    @cached_property
    def max_prompt_chars(self) -> int:
        """More characters than this cannot fit the context, so they are refused before tokenizing.
        Vocabulary strings are at least as long as the text they decode to (byte-level BPE: one character
        per byte; WordPiece adds "##"), so the longest one bounds the characters a token can cover."""
        longest = max(map(len, self.tokenizer.get_vocab()), default=1)
        return self.max_model_len * longest * CHARS_MARGIN


@dataclass
class Parsed:
    """A checked request: its rows (in the order the response lists them) and how to answer it."""

    rows: list[Row]
    stream: bool
    answer: object  # the protocol's response builder (openai_api.py, tgi_api.py)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.ids) for r in self.rows)


class NonFinite:
    """What parse_json reads for NaN, Infinity, -Infinity (which Python's JSON parser takes and JSON has not) or a
    number beyond a double (1e400, read as inf): a value no field accepts, refused with its place."""

    def __init__(self, literal: str):
        self.literal = literal


def _non_finite(data) -> tuple[str, str] | None:
    """(place, literal) of the first NonFinite in data, in the order the body writes it: "parameters.temperature",
    "logit_bias.50256", "prompt[2]", "" for the body itself; None where a later duplicate key replaced it."""
    stack = [("", data)]
    while stack:  # not recursive: json.loads nests deeper than Python's recursion limit
        where, value = stack.pop()
        if isinstance(value, NonFinite):
            return where, value.literal
        if isinstance(value, dict):
            stack += reversed([(f"{where}.{k}" if where else k, v) for k, v in value.items()])
        elif isinstance(value, list):
            stack += reversed([(f"{where}[{i}]", v) for i, v in enumerate(value)])
    return None


def parse_json(raw: bytes) -> dict:
    """Request bytes -> the JSON object; refuses what neither the tokenizer nor a response could take, and numbers
    that are not finite, as llama-server's parser refuses them: NaN in t_max_predict_ms generated a whole answer and
    then failed to write it."""
    found: list[NonFinite] = []

    def non_finite(literal: str) -> NonFinite:
        found.append(NonFinite(literal))
        return found[-1]

    def number(text: str) -> float | NonFinite:
        value = float(text)
        return value if math.isfinite(value) else non_finite(text)

    try:
        data = json.loads(raw, parse_constant=non_finite, parse_float=number)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON: nested too deeply") from None
    except ValueError as e:  # an integer of more than 4300 digits (Python's int_max_str_digits)
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if found:
        where, literal = _non_finite(data) or ("", found[0].literal)
        if not where:
            raise ApiError(400, f"the request body is not valid JSON: {clip(literal)} is not a finite number")
        raise invalid(where, f"invalid {where}: {clip(literal)} is not a finite number")
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:  # "\ud800" decodes to a lone surrogate, which neither the tokenizer nor a UTF-8 response can take
        json.dumps(data, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise ApiError(400, "the request body contains a lone UTF-16 surrogate (\\ud800-\\udfff), "
                            "which is not a character") from None
    except RecursionError:  # json.loads nests deeper than json.dumps can
        raise ApiError(400, "the request body is not valid JSON: nested too deeply") from None
    return data


def validate(model: type[BaseModel], data: dict):
    """data -> model, or an ApiError naming the first field that is wrong ("stream_options.include_usage")."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        # a union reports its member in the location ("prompt", "str"): the field is the first part
        where = [str(p) for p in first["loc"] if not isinstance(p, int)][:2] if first["loc"] else []
        param = where[0] if where else None
        if len(where) > 1 and where[1] not in ("str", "int", "float", "bool", "list[str]", "list[int]"):
            param = f"{param}.{where[1]}"
        if first["type"] == "extra_forbidden":
            raise invalid(param, f"unrecognized request argument: {param}") from None
        if first["type"] == "missing":
            raise invalid(param, f"missing required argument: {param}") from None
        got = clip(json.dumps(first.get("input")))
        raise invalid(param, f"invalid {param}: {first['msg'].lower()}, got {got}") from None


def sampling(served: Served, *, temperature: float, top_p: float, top_k: int, seed: int | None,
             max_tokens: int, names: dict[str, str] | None = None):
    """The sampling parameters by sampling/rules.py's rules (shared with the CLI); names maps our parameter
    names to the protocol's (TGI's max_new_tokens)."""
    names = names or {}
    try:
        checked = check_sampling(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, max_tokens=max_tokens)
    except SamplingError as e:
        name = names.get(e.param, e.param)
        raise invalid(name, f"{name} {e.rule}, got {e.value}") from None
    if checked.max_tokens >= served.max_model_len:
        name = names.get("max_tokens", "max_tokens")
        raise ApiError(400, f"{name} {checked.max_tokens} leaves no room for a prompt in the context of "
                            f"{served.max_model_len} tokens", param=name, code="context_length_exceeded")
    return checked


def seeds(seed: int | None, n: int) -> list[int]:
    """One seed per choice: seed, seed + 1, ... (wrapping into torch's range), or fresh ones."""
    if seed is None:
        return [random.SystemRandom().randrange(2**31) for _ in range(n)]
    return [s - 2**64 if s > SEED_MAX else s for s in (seed + j for j in range(n))]


def prompt_budget(context: int, max_tokens: int | None) -> int:
    """The tokens a prompt that can be cut (a FIM prompt: fim.py's budget rule) may keep: the context less the room
    it leaves for generating, max_tokens but at most half the context (None, as many as fit: half). An editor
    that asks for 4096 tokens in a context of 512 gets a 256-token prompt, not a refusal."""
    return context - (context // 2 if max_tokens is None else min(max_tokens, context // 2))


@dataclass(frozen=True)
class Fitted:
    """A fill-in-the-middle prompt fitted to the context (fit_fim)."""

    ids: tuple[int, ...]
    max_tokens: int  # what its row may generate: the request's, or what the context leaves if less
    truncated: bool  # text was left out of the prompt (fim.py's budget rule)
    capped: bool  # max_tokens is less than the request's (or it asked for as many as fit): a row that ends by
    # length has filled the context
    context_tokens: int  # its first tokens that do not depend on the cursor (fim.FimPrompt)


def fit_fim(served: Served, prefix: str, suffix: str, max_tokens: int | None, *, extra: tuple[Chunk, ...] = (),
            lead: str = "", param: str = "prompt") -> Fitted:
    """The FIM prompt of every FIM route (/infill, OpenAI's suffix, a prompt written in FIM form), cut to the
    budget rule instead of refused: the prompt keeps prompt_budget's room, the row generates what it leaves
    (`room`). Text beyond what could ever fit is dropped before tokenizing (max_prompt_chars nearest the cursor;
    the newest files within it), so a megabyte costs no more than the context. The caller checks first that the
    tokenizer has FIM tokens (fim.layout_of); a frame (or `lead`) that alone exceeds the budget is an ApiError."""
    limit = served.max_prompt_chars
    files, chars = [], 0
    for chunk in reversed(extra):  # newest first: the oldest are the ones the budget rule leaves out
        chars += len(chunk.text) + len(chunk.path)
        if chars > limit:
            break
        files.insert(0, chunk)
    if len(lead) > limit:
        raise _too_long(served, f"at least {len(lead) // (limit // served.max_model_len)}", max_tokens or 1, param,
                        "max_tokens")
    try:
        fim = fim_ids(served.tokenizer, prefix[-limit:], suffix[:limit], extra=tuple(files), lead=lead,
                      budget=prompt_budget(served.context, max_tokens))
    except FimError as e:
        raise ApiError(400, str(e), param=param, code="context_length_exceeded") from None
    left = served.room(len(fim.ids), max_tokens)
    checked_ids(served, fim.ids, left, param)  # the vocabulary; the context and the KV cache fit by construction
    truncated = fim.truncated or len(files) < len(extra) or len(prefix) > limit or len(suffix) > limit
    return Fitted(fim.ids, left, truncated, max_tokens is None or left < max_tokens, fim.context_tokens)


def stop_strings(stop: str | list[str] | None, param: str = "stop") -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop or []
    if len(stops) > MAX_STOP:
        raise invalid(param, f"at most {MAX_STOP} stop strings, got {len(stops)}")
    if any(s == "" for s in stops):
        raise invalid(param, "stop strings must not be empty")
    return tuple(stops)


def _too_long(served: Served, tokens: str, max_tokens: int, param: str, budget: str) -> ApiError:
    return ApiError(400, f"prompt of {tokens} tokens + {budget} {max_tokens} exceeds the context of "
                         f"{served.max_model_len} tokens", param=param, code="context_length_exceeded")


def prompt_ids(served: Served, prompt: str, max_tokens: int, param: str = "prompt", budget: str = "max_tokens",
               template: bool = False) -> tuple[int, ...]:
    """A prompt's token ids, checked against the context and the KV cache, whole or refused (a FIM prompt is cut
    instead: fit_fim). template: the text came from the chat template, which writes its own special tokens."""
    if len(prompt) > served.max_prompt_chars:  # tokenizing megabytes would hold rank 0's CPU for seconds
        raise _too_long(served, f"at least {len(prompt) // (served.max_prompt_chars // served.max_model_len)}",
                        max_tokens, param, budget)
    return checked_ids(served, tuple(served.tokenizer(prompt, add_special_tokens=not template).input_ids), max_tokens,
                       param, budget)


def checked_ids(served: Served, ids: tuple[int, ...], max_tokens: int, param: str = "prompt",
                budget: str = "max_tokens") -> tuple[int, ...]:
    """A prompt's token ids (tokenized here, or sent as ids), checked against the vocabulary, the context and the
    KV cache."""
    if not ids:
        raise invalid(param, "the prompt is empty")
    if (bad := next((t for t in ids if not 0 <= t < served.vocab), None)) is not None:
        known = len(served.tokenizer)
        raise invalid(param, f"token id {bad} is not in the vocabulary of {served.model_id} (0 to {served.vocab - 1})"
                      + (f": its tokenizer knows {known} tokens, the model has embeddings for {served.vocab}"
                         if known != served.vocab else ""))
    if max_tokens <= served.room(len(ids)):
        return ids
    if len(ids) + max_tokens > served.max_model_len:
        raise _too_long(served, str(len(ids)), max_tokens, param, budget)
    raise ApiError(400, f"prompt of {len(ids)} tokens + {budget} {max_tokens} can never fit the KV cache of "
                        f"{served.kv_tokens} tokens per rank (--kv-cache-memory)", param=param,
                   code="context_length_exceeded")


def usage_of(prompt_tokens: int, results: list[Result]) -> dict:
    completion_tokens = sum(r.completion_tokens for r in results)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
