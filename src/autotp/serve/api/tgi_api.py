"""Text Generation Inference's protocol, which Hugging Face's editor stack speaks (llm-ls / llm-vscode,
Continue's huggingface-tgi provider, huggingface_hub's InferenceClient): POST /generate,
/generate_stream and / (stream or not), GET /info, and TGI's error shape.

As TGI does (router/src/server.rs, validation.rs): `generated_text` includes the stop sequence that ended
it; sampling is on when do_sample is true or temperature, top_k or top_p asks for it; `details` lists
each generated token (id, text, log-probability, special) and, with decoder_input_details, the prompt's;
finish reasons are "length", "eos_token" and "stop_sequence"; POST / answers a list of one and prepends
the prompt unless return_full_text is false; a stream has no [DONE] and its last event carries the text
(and details, when asked for); errors are `{"error", "error_type"}`: 422 validation, 429 overloaded,
424 generation, also as an event once a stream has begun. Log-probabilities are the model's own (before
temperature, top-k, top-p). No torch here.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from autotp.fim import split_fim, stop_ids
from autotp.serve.api.boundary import (
    GENERATION_FAILED,
    MAX_LOGPROBS,
    MAX_STOP,
    ApiError,
    Parsed,
    Served,
    fit_fim,
    invalid,
    parse_json,
    prompt_ids,
    sampling,
    seeds,
    stop_strings,
    validate,
)
from autotp.serve.engine.text import TokenTexts
from autotp.serve.types import Piece, Result, Row, TokenLogprob

TGI_PATHS = frozenset({"/generate", "/generate_stream", "/"})
DEFAULT_NEW_TOKENS = 100  # TGI's default max_new_tokens
VERSION = "3.0.0"  # the TGI API this follows, as /info reports it


def is_tgi(path: str) -> bool:
    return path in TGI_PATHS


class Parameters(BaseModel):
    """TGI's `parameters`. Fields TGI has and autotp does not implement accept only their neutral value;
    unknown fields are ignored, as TGI ignores them (llm-ls sends a nested `parameters`, Continue a
    `presence_penalty`)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    do_sample: bool | None = None
    seed: int | None = None
    stop: list[str] | None = None
    return_full_text: bool | None = None
    details: bool | None = None
    decoder_input_details: bool | None = None
    top_n_tokens: int | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    typical_p: float | None = None
    truncate: int | None = None
    best_of: int | None = None
    watermark: bool | None = None
    grammar: dict | None = None
    adapter_id: str | None = None


class GenerateBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    inputs: str
    parameters: Parameters | None = None
    stream: bool | None = None


def _neutral(p: Parameters) -> None:
    fields = {"repetition_penalty": (None, 1.0), "frequency_penalty": (None, 0.0), "typical_p": (None, 1.0),
              "truncate": (None,), "best_of": (None, 1), "watermark": (None, False), "grammar": (None,),
              "adapter_id": (None,)}
    for name, allowed in fields.items():
        if getattr(p, name) not in allowed:
            raise invalid(f"parameters.{name}", f"parameters.{name}={getattr(p, name)!r} is not supported by autotp "
                                                f"serve; leave it out")


def _parse(raw: bytes, served: Served, stream: bool | None) -> Parsed:
    body = validate(GenerateBody, parse_json(raw))
    p = body.parameters or Parameters()
    _neutral(p)
    if p.temperature is not None and p.temperature <= 0:
        raise invalid("parameters.temperature", f"temperature must be strictly positive, got {p.temperature}")
    if p.top_k is not None and p.top_k <= 0:  # TGI's rule, where autotp's (and vLLM's) takes 0 as "off"
        raise invalid("parameters.top_k", f"top_k must be strictly positive, got {p.top_k}")
    sampled = bool(p.do_sample) or (p.temperature not in (None, 1.0)) or bool(p.top_k) or (p.top_p not in (None, 1.0))
    names = {"max_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
             "seed": "seed"}
    names = {k: f"parameters.{v}" for k, v in names.items()}
    asked = DEFAULT_NEW_TOKENS if p.max_new_tokens is None else p.max_new_tokens
    # inputs written in the tokenizer's FIM form (llm-vscode's, Continue's) are cut to leave room, not refused:
    # what is asked is then checked for its range only, and bounds what is generated
    fim = split_fim(served.tokenizer, body.inputs)
    checked = sampling(served, temperature=(p.temperature or 1.0) if sampled else 0.0,
                       top_p=1.0 if p.top_p is None else p.top_p, top_k=p.top_k or 0, seed=p.seed,
                       max_tokens=asked if fim is None else min(asked, 1), names=names)
    if p.top_n_tokens is not None and not 0 <= p.top_n_tokens <= MAX_LOGPROBS:
        raise invalid("parameters.top_n_tokens", f"top_n_tokens must be between 0 and {MAX_LOGPROBS}, "
                                                 f"got {p.top_n_tokens}")
    stop = stop_strings(p.stop, "parameters.stop")
    if fim is None:
        ids, max_tokens, stops = prompt_ids(served, body.inputs, checked.max_tokens, param="inputs",
                                            budget="parameters.max_new_tokens"), checked.max_tokens, ()
    else:
        fitted = fit_fim(served, fim.prefix, fim.suffix, asked, lead=fim.lead, param="inputs")
        ids, max_tokens, stops = fitted.ids, fitted.max_tokens, stop_ids(served.tokenizer)
    seed = seeds(checked.seed, 1)[0]
    details = stream or bool(p.details)
    row = Row(ids, max_tokens, checked.temperature, checked.top_p, seed, stop, checked.top_k,
              logprobs=(p.top_n_tokens or 0) if details else None, prompt_logprobs=bool(p.decoder_input_details),
              stop_ids=stops)
    streaming = bool(body.stream) if stream is None else stream
    # TGI's compatibility route prepends the prompt unless told not to (a text-generation model's default)
    full_text = p.return_full_text if p.return_full_text is not None else stream is None
    answer = Generation(served, body.inputs, full_text, bool(p.details), bool(p.decoder_input_details),
                        p.top_n_tokens, sampled, seed, compat=stream is None)
    return Parsed([row], streaming, answer)


def parse_generate(raw: bytes, served: Served) -> Parsed:
    return _parse(raw, served, False)


def parse_generate_stream(raw: bytes, served: Served) -> Parsed:
    return _parse(raw, served, True)


def parse_compat(raw: bytes, served: Served) -> Parsed:
    return _parse(raw, served, None)


FINISH = {"length": "length", "stop": "eos_token"}


class Generation:
    """The answers of one TGI request (one row): GenerateResponse, or StreamResponse events."""

    def __init__(self, served: Served, inputs: str, full_text: bool, details: bool, prefill: bool,
                 top_n: int | None, sampled: bool, seed: int, compat: bool):
        self.served, self.inputs, self.full_text, self.details = served, inputs, full_text, details
        self.prefill, self.top_n, self.sampled, self.seed, self.compat = prefill, top_n, sampled, seed, compat
        self.pending: list[Piece] = []
        self.sent = 0  # token events so far: each event's index
        self.texts: TokenTexts | None = None  # the streamed tokens' texts, from the prompt's last tokens on

    def _text(self, result: Result) -> str:
        text = result.text + result.stopped_by
        return self.inputs + text if self.full_text else text

    def _token(self, entry: TokenLogprob, special: bool | None = None, texts: TokenTexts | None = None) -> dict:
        """A token of `details`: a generated one's text is what it adds after the tokens before it (TGI's
        decode_token, with prefix_offset/read_offset: engine/text.TokenTexts), a prompt token's its own decode (as
        TGI's prefill)."""
        text = self.served.tokenizer.decode([entry.id]) if texts is None else texts.text(entry.id)
        out = {"id": entry.id, "text": text, "logprob": entry.logprob}
        return out if special is None else out | {"special": special}

    @staticmethod
    def _top(entry: TokenLogprob, specials: set[int], texts: TokenTexts) -> list[dict]:
        return [{"id": i, "text": texts.text(i), "logprob": lp, "special": i in specials} for i, lp in entry.top]

    def _details(self, row: Row, result: Result) -> dict:
        reason = "stop_sequence" if result.stopped_by else FINISH[result.finish_reason]
        specials = set(self.served.tokenizer.all_special_ids)
        texts = TokenTexts(self.served.tokenizer, row.ids)
        tokens, tops = [], []
        for e in result.logprobs:  # each generated token's text and its alternatives', after the tokens before it
            tokens.append(self._token(e, e.id in specials, texts))
            if self.top_n:
                tops.append(self._top(e, specials, texts))
            texts.push(e.id)
        out = {"finish_reason": reason, "generated_tokens": result.completion_tokens,
               "seed": self.seed if self.sampled else None, "prefill": [], "tokens": tokens}
        if self.prefill:
            first = {"id": row.ids[0], "text": self.served.tokenizer.decode([row.ids[0]]), "logprob": None}
            out["prefill"] = [first] + [self._token(e) for e in result.prompt_logprobs[1:]]
        if self.top_n:
            out["top_tokens"] = tops
        return out

    def body(self, cid: str, rows: list[Row], results: list[Result], prompt_tokens: int) -> dict | list:
        """GenerateResponse; POST / answers a list of one, as TGI's compatibility route does."""
        out = {"generated_text": self._text(results[0])}
        out |= {"details": self._details(rows[0], results[0])} if self.details else {}
        return [out] if self.compat else out

    # the streaming interface http.py drives (as openai_api's answers): events per token, per finished row,
    # at the end; TGI's stream has no [DONE]

    def start(self, cid: str, rows: list[Row]) -> list[dict]:
        self.row = rows[0]
        self.texts = TokenTexts(self.served.tokenizer, self.row.ids)
        return []

    def piece(self, cid: str, index: int, piece: Piece) -> list[dict]:
        self.pending.append(piece)
        return self._events(None)

    def finish(self, cid: str, index: int, result: Result) -> list[dict]:
        return self._events(result)

    def end(self, cid: str, results: list[Result], prompt_tokens: int) -> list[dict]:
        return []

    def failure(self, error: ApiError) -> list[dict]:
        """How a stream that failed ends: TGI's error event (huggingface_hub raises it)."""
        return [error_body(error)]

    def _events(self, result: Result | None) -> list[dict]:
        """StreamResponse events for the tokens received so far; the last token's event waits for the row's
        result, since it carries the generated text (and the details, when asked for)."""
        ready = self.pending if result is not None else self.pending[:-1]
        self.pending = self.pending[len(ready):]
        out = []
        for n, piece in enumerate(ready):
            entry = piece.logprob
            self.sent += 1
            last = result is not None and n == len(ready) - 1
            # TGI keeps the stop sequence in generated_text, so the tokens' texts must join to it too: the
            # stream held it back (it might have been one), and the last token releases it
            text = piece.text + (result.stopped_by if last else "")
            event = {"index": self.sent, "token": {"id": piece.id, "text": text,
                                                   "logprob": entry.logprob if entry else None,
                                                   "special": piece.special},
                     "generated_text": None, "details": None}
            if self.top_n and entry is not None:
                event["top_tokens"] = self._top(entry, set(self.served.tokenizer.all_special_ids), self.texts)
            self.texts.push(piece.id)
            if last:
                event["generated_text"] = self._text(result)
                if self.details:
                    reason = "stop_sequence" if result.stopped_by else FINISH[result.finish_reason]
                    event["details"] = {"finish_reason": reason, "generated_tokens": result.completion_tokens,
                                        "seed": self.seed if self.sampled else None, "input_length": len(self.row.ids)}
            out.append(event)
        return out


ERROR_TYPES = {422: "validation", 429: "overloaded", 424: "generation", 503: "unhealthy"}


def status(error: ApiError) -> int:
    """TGI answers a request it cannot take with 422 where OpenAI answers 400, and a generation that failed
    with 424 (huggingface_hub's GenerationError) where OpenAI answers 500."""
    if error.status == 500 and error.code == GENERATION_FAILED:
        return 424
    return 422 if error.status == 400 else error.status


def error_body(error: ApiError) -> dict:
    code = status(error)
    return {"error": error.message, "error_type": ERROR_TYPES.get(code, "validation" if code < 500 else "server")}


def info(served: Served, max_queue: int) -> dict:
    return {"model_id": served.model_id, "model_sha": None, "model_dtype": "unknown", "model_device_type": "unknown",
            "model_pipeline_tag": "text-generation", "max_concurrent_requests": max_queue, "max_best_of": 1,
            "max_stop_sequences": MAX_STOP, "max_input_tokens": served.max_model_len - 1,
            "max_input_length": served.max_model_len - 1, "max_total_tokens": served.max_model_len,
            "validation_workers": 1, "max_client_batch_size": 1, "router": "autotp", "version": VERSION,
            "sha": None, "docker_label": None}
