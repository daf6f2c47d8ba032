"""The OpenAI completions protocol at the boundary: request checking, error bodies, response shapes.

Everything a client sends is checked here, before any job reaches the engine, so a bad request is a 4xx
with OpenAI's error body `{"error": {"message", "type", "param", "code"}}` and never touches the ranks.
No HTTP framework and no torch in here; `parse_completion` turns bytes into `Row`s or raises ApiError.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from functools import cached_property

from pydantic import BaseModel, ConfigDict, ValidationError

from autotp.errors import AutotpError
from autotp.sampling import SamplingError, check_sampling
from autotp.serve.types import Result, Row
from autotp.tokenizer import fim_prompt

MAX_STOP = 4  # OpenAI's limit on stop strings
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


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


class CompletionBody(BaseModel):
    """POST /v1/completions as OpenAI documents it. strict: "5" is not an int, 1 is a float, true is no int.
    Fields that exist in OpenAI's API but not here (logprobs, echo, best_of, penalties) accept only their
    neutral value, so a client that sends the default still works."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: str
    prompt: str | list[str]
    suffix: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extension: 0 or -1 is off
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    user: str | None = None
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, int] | None = None


@dataclass(frozen=True)
class Served:
    """What the boundary checks against: the model's name, its tokenizer, the context it may use and the
    KV cache slots per rank (a row that needs more could never be admitted)."""

    model_id: str
    tokenizer: object
    max_model_len: int
    created: int
    kv_tokens: int

    @cached_property
    def max_prompt_chars(self) -> int:
        """More characters than this cannot fit the context, so they are refused before tokenizing.
        Vocabulary strings are at least as long as the text they decode to (byte-level BPE: one character
        per byte; WordPiece adds "##"), so the longest one bounds the characters a token can cover."""
        longest = max(map(len, self.tokenizer.get_vocab()), default=1)
        return self.max_model_len * longest * CHARS_MARGIN


@dataclass
class Completion:
    rows: list[Row]
    stream: bool
    include_usage: bool

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.ids) for r in self.rows)


def _invalid(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param)


def _parse_body(raw: bytes) -> CompletionBody:
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON: nested too deeply") from None
    except ValueError as e:  # an integer of more than 4300 digits (Python's int_max_str_digits)
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:  # "\ud800" decodes to a lone surrogate, which neither the tokenizer nor a UTF-8 response can take
        json.dumps(data, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise ApiError(400, "the request body contains a lone UTF-16 surrogate (\\ud800-\\udfff), "
                            "which is not a character") from None
    except RecursionError:  # json.loads nests deeper than json.dumps can
        raise ApiError(400, "the request body is not valid JSON: nested too deeply") from None
    try:
        return CompletionBody.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        # a union reports its member in the location ("prompt", "str"): the field is the first part
        param = str(first["loc"][0]) if first["loc"] else None
        if first["type"] == "extra_forbidden":
            raise _invalid(param, f"unrecognized request argument: {param}") from None
        if first["type"] == "missing":
            raise _invalid(param, f"missing required argument: {param}") from None
        got = clip(json.dumps(first.get("input")))
        raise _invalid(param, f"invalid {param}: {first['msg'].lower()}, got {got}") from None


def _check_neutral(body: CompletionBody) -> None:
    neutral = {"n": (None, 1), "echo": (None, False), "logprobs": (None,), "best_of": (None, 1),
               "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {})}
    for name, allowed in neutral.items():
        value = getattr(body, name)
        if value not in allowed:
            raise _invalid(name, f"{name}={clip(json.dumps(value))} is not supported by autotp serve; "
                                 f"leave it out or send {json.dumps(allowed[-1])}")


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop or []
    if len(stops) > MAX_STOP:
        raise _invalid("stop", f"at most {MAX_STOP} stop strings, got {len(stops)}")
    if any(s == "" for s in stops):
        raise _invalid("stop", "stop strings must not be empty")
    return tuple(stops)


def _too_long(served: Served, tokens: str, max_tokens: int, param: str) -> ApiError:
    return ApiError(400, f"prompt of {tokens} tokens + max_tokens {max_tokens} exceeds the context of "
                         f"{served.max_model_len} tokens", param=param, code="context_length_exceeded")


def _prompt_ids(served: Served, prompt: str, suffix: str | None, max_tokens: int, param: str) -> tuple[int, ...]:
    chars = len(prompt) + len(suffix or "")
    if chars > served.max_prompt_chars:  # tokenizing megabytes would hold rank 0's CPU for seconds
        raise _too_long(served, f"at least {chars // (served.max_prompt_chars // served.max_model_len)}",
                        max_tokens, param)
    if suffix is not None:
        try:
            prompt = fim_prompt(served.tokenizer, prompt, suffix)
        except AutotpError:
            raise _invalid("suffix", f"suffix needs fill-in-the-middle tokens, and the tokenizer of "
                                     f"{served.model_id} lacks them") from None
    ids = tuple(served.tokenizer(prompt).input_ids)
    if not ids:
        raise _invalid(param, "the prompt is empty")
    if len(ids) + max_tokens > served.max_model_len:
        raise _too_long(served, str(len(ids)), max_tokens, param)
    if len(ids) + max_tokens > served.kv_tokens:
        raise ApiError(400, f"prompt of {len(ids)} tokens + max_tokens {max_tokens} can never fit the KV cache of "
                            f"{served.kv_tokens} tokens per rank (--kv-cache-memory)", param=param,
                       code="context_length_exceeded")
    return ids


def parse_completion(raw: bytes, served: Served) -> Completion:
    """Request bytes -> one Row per prompt, every parameter checked; raises ApiError."""
    body = _parse_body(raw)
    if body.model != served.model_id:
        raise ApiError(404, f"the model {body.model!r} does not exist: this server serves {served.model_id!r}",
                       param="model", code="model_not_found")
    _check_neutral(body)
    try:
        sampling = check_sampling(temperature=1.0 if body.temperature is None else body.temperature,
                                  top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
                                  top_k=0 if body.top_k in (None, -1) else body.top_k,
                                  max_tokens=16 if body.max_tokens is None else body.max_tokens)  # OpenAI's
    except SamplingError as e:
        raise _invalid(e.param, str(e)) from None
    max_tokens = sampling.max_tokens
    if max_tokens >= served.max_model_len:
        raise ApiError(400, f"max_tokens {max_tokens} leaves no room for a prompt in the context of "
                            f"{served.max_model_len} tokens", param="max_tokens", code="context_length_exceeded")
    stop = _stop_strings(body.stop)
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if not prompts:
        raise _invalid("prompt", "the prompt list is empty")
    seed = random.SystemRandom().randrange(2**31) if sampling.seed is None else sampling.seed
    rows = [Row(_prompt_ids(served, p, body.suffix, max_tokens, "prompt"), max_tokens, sampling.temperature,
                sampling.top_p, seed, stop, sampling.top_k) for p in prompts]
    stream = bool(body.stream)
    if body.stream_options is not None and not stream:
        raise _invalid("stream_options", "stream_options is only allowed with stream=true")
    return Completion(rows, stream, stream and body.stream_options is not None and body.stream_options.include_usage)


def completion_chunk(cid: str, served: Served, choices: list[dict], usage: dict | None = None) -> dict:
    """The object of a response (all choices) or of one streamed event (one choice, or usage alone)."""
    out = {"id": cid, "object": "text_completion", "created": int(time.time()), "model": served.model_id,
           "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out


def choice(index: int, text: str, finish_reason: str | None) -> dict:
    return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": None}


def usage_of(prompt_tokens: int, results: list[Result]) -> dict:
    completion_tokens = sum(r.completion_tokens for r in results)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def models_list(served: Served) -> dict:
    return {"object": "list",
            "data": [{"id": served.model_id, "object": "model", "created": served.created, "owned_by": "autotp"}]}
