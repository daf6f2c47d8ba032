"""The protocol parsers in process: OpenAI's completions and chat, TGI's generate, each request body checked into the
rows the engine gets (api/openai_api.py, api/tgi_api.py, api/boundary.py), without a model, a rank or a server.
The served model here has StarCoder's FIM tokens, a chat template, a context of 64 and a KV cache of 40 slots."""

from __future__ import annotations

import json

import fim_model
import pytest

from autotp.serve.api import openai_api, tgi_api
from autotp.serve.api.boundary import ApiError, Served
from autotp.serve.types import kv_slots

CONTEXT, KV = 64, 40


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Served:
    tok = fim_model.tokenizer(tmp_path_factory.mktemp("fim"), fim_model.CHAT_TEMPLATE)
    return Served("tiny", tok, CONTEXT, 0, KV, len(tok))


def body(**fields) -> bytes:
    return json.dumps({"model": "tiny"} | fields).encode()


def refused(parse, raw: bytes, served: Served) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(raw, served)
    return e.value


def test_a_completion_is_one_row_per_prompt_and_choice_with_openais_defaults(served):
    parsed = openai_api.parse_completion(body(prompt=["def add(a, b):", "class Point:"], n=2, seed=7), served)
    assert [r.ids for r in parsed.rows] == [tuple(served.tokenizer("def add(a, b):").input_ids)] * 2 + [
        tuple(served.tokenizer("class Point:").input_ids)] * 2
    assert {(r.max_tokens, r.temperature, r.top_p, r.top_k) for r in parsed.rows} == {(16, 1.0, 1.0, 0)}
    assert [r.seed for r in parsed.rows] == [7, 8, 7, 8]  # choice j samples with seed + j
    assert not parsed.stream and parsed.prompt_tokens == sum(len(r.ids) for r in parsed.rows)


def test_a_suffix_makes_the_fill_in_the_middle_prompt_of_the_models_own_tokens(served):
    parsed = openai_api.parse_completion(body(prompt="def f(x):\n    ", suffix="\n    return y", max_tokens=4), served)
    want = served.tokenizer("<fim_prefix>def f(x):\n    <fim_suffix>\n    return y<fim_middle>").input_ids
    assert parsed.rows[0].ids == tuple(want)


def test_token_id_prompts_are_checked_against_the_ids_the_model_and_tokenizer_both_know(served, tmp_path):
    assert openai_api.parse_completion(body(prompt=[5, 6, 7]), served).rows[0].ids == (5, 6, 7)
    e = refused(openai_api.parse_completion, body(prompt=[5, len(served.tokenizer)]), served)
    assert e.status == 400 and e.message == (f"token id {len(served.tokenizer)} is not in the vocabulary of tiny "
                                             f"(0 to {len(served.tokenizer) - 1})")
    # a fine-tune that added a token without resizing the embedding (Llama-2's [PAD]): the tokenizer knows one id
    # more than the model has rows for, and the sharded embedding would turn that id into zeros
    tok = fim_model.tokenizer(tmp_path)
    rows = len(tok)
    tok.add_tokens(["<extra_pad>"])
    fewer = Served("tiny", tok, CONTEXT, 0, KV, min(rows, len(tok)))
    e = refused(openai_api.parse_completion, body(prompt=[5, rows]), fewer)
    assert e.message == (f"token id {rows} is not in the vocabulary of tiny (0 to {rows - 1}): its tokenizer knows "
                         f"{rows + 1} tokens, the model has embeddings for {rows}")
    e = refused(openai_api.parse_completion, body(prompt="x <extra_pad>"), fewer)  # written in a text prompt
    assert e.status == 400 and e.message.startswith(f"token id {rows} is not in the vocabulary")


def test_a_row_that_exactly_fits_the_kv_cache_is_taken_and_one_token_more_is_refused(served):
    """A row fills prompt + max_tokens - 1 slots (its last token is never fed back): 10 + 31 - 1 = 40 fit exactly."""
    prompt = list(range(5, 15))
    assert kv_slots(10, 31) == KV
    assert openai_api.parse_completion(body(prompt=prompt, max_tokens=31), served).rows[0].max_tokens == 31
    e = refused(openai_api.parse_completion, body(prompt=prompt, max_tokens=32), served)
    assert (e.status, e.code) == (400, "context_length_exceeded") and "can never fit the KV cache of 40" in e.message


def test_the_context_counts_the_prompt_and_the_completion(served):
    roomy = Served("tiny", served.tokenizer, CONTEXT, 0, 10_000, len(served.tokenizer))
    assert openai_api.parse_completion(body(prompt=list(range(54)), max_tokens=10), roomy).rows
    e = refused(openai_api.parse_completion, body(prompt=list(range(54)), max_tokens=11), roomy)
    assert e.message == "prompt of 54 tokens + max_tokens 11 exceeds the context of 64 tokens"
    e = refused(openai_api.parse_completion, body(prompt="x", max_tokens=64), roomy)
    assert e.message == "max_tokens 64 leaves no room for a prompt in the context of 64 tokens"


@pytest.mark.parametrize("fields,param", [
    ({"prompt": "x", "echo": True, "suffix": "y"}, "echo"), ({"prompt": "x", "logprobs": 6}, "logprobs"),
    ({"prompt": "x", "n": 17}, "n"), ({"prompt": "x", "temperature": 2.5}, "temperature"),
    ({"prompt": "x", "stop": [""]}, "stop"), ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": [], "max_tokens": 1}, "prompt"), ({"prompt": "x", "stream_options": {"include_usage": True}},
                                                   "stream_options"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"), ({"prompt": "x", "best_of": 2}, "best_of")])
def test_each_bad_field_is_refused_naming_it(served, fields, param):
    e = refused(openai_api.parse_completion, body(**fields), served)
    assert (e.status, e.param) == (400, param), e.message


def test_another_models_name_is_404(served):
    e = refused(openai_api.parse_completion, json.dumps({"model": "gpt-4", "prompt": "x"}).encode(), served)
    assert (e.status, e.code) == (404, "model_not_found")


def test_a_chat_goes_through_the_template_and_may_use_all_the_room_left(served):
    served = Served("tiny", served.tokenizer, 128, 0, 100, len(served.tokenizer))
    parsed = openai_api.parse_chat(body(messages=[{"role": "user", "content": "hi"}]), served)
    (row,) = parsed.rows
    text = served.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                add_generation_prompt=True)
    assert row.ids == tuple(served.tokenizer(text, add_special_tokens=False).input_ids)
    assert row.max_tokens == served.room(len(row.ids)) == 100 - len(row.ids) + 1  # the cache is the tighter bound
    e = refused(openai_api.parse_chat, body(messages=[{"role": "user", "content": "hi"}], top_logprobs=2), served)
    assert e.param == "top_logprobs"


def test_tgis_generate_takes_its_defaults_and_answers_its_own_statuses(served):
    roomy = Served("tiny", served.tokenizer, 512, 0, 10_000, len(served.tokenizer))
    (row,) = tgi_api.parse_generate(json.dumps({"inputs": "def f():"}).encode(), roomy).rows
    assert (row.max_tokens, row.temperature, row.logprobs) == (tgi_api.DEFAULT_NEW_TOKENS, 0.0, None)  # greedy
    sampled = tgi_api.parse_generate(json.dumps({"inputs": "x", "parameters": {
        "do_sample": True, "max_new_tokens": 5, "top_k": 3, "seed": 4, "stop": ["\n"]}}).encode(), served).rows[0]
    assert (sampled.temperature, sampled.top_k, sampled.seed, sampled.stop, sampled.max_tokens) == (1.0, 3, 4,
                                                                                                  ("\n",), 5)
    e = refused(tgi_api.parse_generate, json.dumps({"inputs": "x", "parameters": {"top_k": 0}}).encode(), served)
    assert (tgi_api.status(e), e.param) == (422, "parameters.top_k")
    assert tgi_api.parse_generate_stream(json.dumps({"inputs": "x", "parameters": {"max_new_tokens": 2}}).encode(),
                                         served).stream
