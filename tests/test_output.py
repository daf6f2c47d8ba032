"""The output processor in process (engine/output.py): a step's sampled tokens into each row's text, stream, end and
answer, and the step's stats, without a model. The tokenizer is byte-level BPE with StarCoder's FIM tokens."""

from __future__ import annotations

import fim_model
import pytest

from autotp.serve.engine.output import OutputProcessor
from autotp.serve.engine.request import Request, Status
from autotp.serve.engine.stats import StepStats
from autotp.serve.lockstep.step import Sampled, StepResult
from autotp.serve.types import Failed, Finished, Row, Token, TokenLogprob

PROMPT = "def add(a, b):\n"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return fim_model.tokenizer(tmp_path_factory.mktemp("fim"))


def request(tok, max_tokens: int = 8, stop=(), stream: bool = False, i: int = 0) -> Request:
    r = Request(i, f"c{i}", 0, Row(tuple(tok(PROMPT).input_ids), max_tokens, 0.0, 1.0, 0, tuple(stop)), stream)
    r.status, r.admitted = Status.RUNNING, r.arrived
    return r


def feed(out: OutputProcessor, r: Request, tokens: list[int], stats: StepStats | None = None, **sampled) -> list:
    """One step whose sampler drew `tokens` for r."""
    return out.process({r.id: r}, StepResult({r.id: Sampled(r.id, tuple(tokens), **sampled)}), stats or StepStats())


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids


def test_tokens_become_the_text_they_add_and_the_row_ends_at_its_budget(tok):
    out, r = OutputProcessor(tok, frozenset()), request(tok, max_tokens=3)
    body = ids(tok, "    return a + b\n")[:3]
    stats = StepStats()
    events = [e for t in body for e in feed(out, r, [t], stats)]
    (done,) = events
    assert isinstance(done, Finished) and r.status is Status.LENGTH and done.result.finish_reason == "length"
    assert done.result.text == tok.decode(tok(PROMPT).input_ids + body)[len(PROMPT):] and done.result.tokens == tuple(
        body)
    assert len(stats.first_tokens) == 1 and len(stats.inter_tokens) == 2 and stats.ended[0].generation_tokens == 3


def test_an_eos_token_ends_the_row_with_stop(tok):
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    out, r = OutputProcessor(tok, frozenset({eos})), request(tok)
    (done,) = feed(out, r, [ids(tok, " x")[0]]) + feed(out, r, [eos])
    assert done.result.finish_reason == "stop" and r.status is Status.STOPPED and done.result.completion_tokens == 2


def test_a_stream_holds_back_what_may_begin_a_stop_string_and_never_sends_the_stop(tok):
    out, r = OutputProcessor(tok, frozenset()), request(tok, max_tokens=20, stop=("return",), stream=True)
    events = [e for t in ids(tok, "    x = 1\n    return a") for e in feed(out, r, [t])]
    pieces = "".join(e.piece.text for e in events if isinstance(e, Token))
    done = events[-1]
    assert isinstance(done, Finished) and done.result.stopped_by == "return" and done.result.finish_reason == "stop"
    assert pieces == done.result.text == "    x = 1\n    "


def test_a_verified_draft_appends_every_kept_token_and_counts_the_accepted_ones(tok):
    out, r = OutputProcessor(tok, frozenset()), request(tok, max_tokens=10)
    body = ids(tok, "    return a + b\n")
    r.draft = tuple(body[:3])  # the runner kept the drafted tokens its sampler drew, then one more
    stats = StepStats()
    assert feed(out, r, body[:4], stats) == []
    assert r.output == body[:4] and (stats.drafted, stats.accepted) == (3, 3)


def test_a_row_that_finishes_inside_a_draft_keeps_no_token_after_its_end(tok):
    out, r = OutputProcessor(tok, frozenset()), request(tok, max_tokens=2)
    body = ids(tok, "    return a + b\n")
    r.draft = tuple(body[:3])
    (done,) = feed(out, r, body[:4])
    assert done.result.tokens == tuple(body[:2]) and r.output == body[:2]


def test_log_probabilities_ride_with_their_tokens_and_the_prompts_accumulate(tok):
    out, r = OutputProcessor(tok, frozenset()), request(tok, max_tokens=1)
    token = ids(tok, " x")[0]
    entry = TokenLogprob(token, -0.5, ((token, -0.5),))
    (done,) = feed(out, r, [token], logprobs=(entry,), prompt_logprobs=(TokenLogprob(3, -1.0),))
    assert done.result.logprobs == (entry,) and done.result.prompt_logprobs == (None, TokenLogprob(3, -1.0))


def test_scores_that_cannot_be_sampled_fail_that_row_alone(tok):
    out = OutputProcessor(tok, frozenset())
    bad, good = request(tok, i=0), request(tok, max_tokens=1, i=1)
    result = StepResult({0: Sampled(0, (), error="the model's scores for this prompt are not finite (max nan)"),
                         1: Sampled(1, (ids(tok, " x")[0],))})
    events = out.process({0: bad, 1: good}, result, StepStats())
    assert [type(e) for e in events] == [Failed, Finished]
    assert (events[0].status, events[0].client) == (500, "c0") and bad.status is Status.FAILED


def test_a_tokenizer_that_raises_on_a_row_fails_it_with_500_and_the_others_go_on(tok, monkeypatch):
    out = OutputProcessor(tok, frozenset())
    r = request(tok, max_tokens=1)

    def broken(*args, **kwargs):
        raise ValueError("no such token")

    monkeypatch.setattr(out.tokenizer, "decode", broken)
    (failed,) = feed(out, r, [5])
    assert isinstance(failed, Failed) and failed.message == "decoding the completion failed: ValueError"


def test_a_row_that_ended_meanwhile_gets_no_event(tok):
    out, r = OutputProcessor(tok, frozenset()), request(tok)
    r.status = Status.ABORTED  # its client went away while its step was in flight
    assert feed(out, r, [5]) == [] and r.output == []


def test_a_fim_sentinel_in_the_rows_stop_ids_ends_it_as_eos_does(tok):
    """A FIM model that writes <fim_prefix> after its middle has finished it (fim.stop_ids)."""
    sentinel = tok.convert_tokens_to_ids("<fim_prefix>")
    out = OutputProcessor(tok, frozenset())
    r = request(tok)
    r.row = Row(r.row.ids, 8, 0.0, 1.0, 0, stop_ids=(sentinel,))
    (done,) = feed(out, r, [ids(tok, " x")[0]]) + feed(out, r, [sentinel])
    assert done.result.finish_reason == "stop" and done.result.text == " x"


def test_n_indent_ends_the_row_before_a_line_indented_less(tok):
    """llama-server's n_indent for editors: a body indented 4 ends where a line starts at column 0."""
    out = OutputProcessor(tok, frozenset())
    r = request(tok, max_tokens=40, stream=True)
    r.row = Row(r.row.ids, 40, 0.0, 1.0, 0, indent=4)
    events = [e for t in ids(tok, "    return a + b\ndef sub(a, b):") for e in feed(out, r, [t])]
    done = events[-1]
    assert isinstance(done, Finished) and done.result.finish_reason == "length"
    assert done.result.text == "    return a + b\n" == "".join(e.piece.text for e in events if isinstance(e, Token))


def test_t_max_predict_ms_ends_the_row_at_the_first_newline_after_the_deadline(tok, monkeypatch):
    from autotp.serve.engine import output

    clock = iter([0.0, 0.1, 0.2, 5.0, 5.1, 5.2, 5.3, 5.4])
    monkeypatch.setattr(output.time, "monotonic", lambda: next(clock))
    out = OutputProcessor(tok, frozenset())
    r = request(tok, max_tokens=40)
    r.row, r.arrived = Row(r.row.ids, 40, 0.0, 1.0, 0, newline_deadline_s=0.25), 0.0
    body = ids(tok, " x = 1\n y = 2\n z")
    events = [e for t in body for e in feed(out, r, [t])]
    (done,) = events
    assert done.result.text.endswith("\n") and done.result.text.count("\n") == 1  # the newline after 0.25 s, kept
