"""What a hostile or unlucky client meets at `autotp serve`'s door, from its side (raw HTTP, as the openai client
cannot write NaN): numbers JSON has not (NaN, Infinity) refused in every protocol before anything runs.

One in-process server for the module (in_process.py)."""

from __future__ import annotations

import json

import pytest
from in_process import InProcess
from serve_harness import metrics

from autotp.serve.api import boundary, llama_api, llama_info, openai_api, tgi_api
from autotp.serve.api.boundary import ApiError

NON_FINITE = ("NaN", "Infinity", "-Infinity", "1e400")  # Python's parser reads each; JSON has none of them


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = InProcess(tmp_path_factory.mktemp("fim"))
    yield s
    s.close()


def errors_of(server, status: int) -> float:
    return metrics(server).get(f"autotp:request_errors_total{{status={status}}}", 0)


# (route, body with {} where the number goes, the field's name in the answer, the status its protocol refuses with)
DOORS = [
    ("/v1/completions", '{"model": "M", "prompt": "a", "temperature": {}}', "temperature", 400),
    ("/v1/completions", '{"model": "M", "prompt": "a", "logit_bias": {"50": {}}, "stream": true}', "logit_bias.50",
     400),
    ("/v1/chat/completions", '{"model": "M", "messages": [{"role": "user", "content": "a"}], "frequency_penalty": {}}',
     "frequency_penalty", 400),
    ("/generate", '{"inputs": "a", "parameters": {"top_p": {}}}', "parameters.top_p", 422),
    ("/generate_stream", '{"inputs": "a", "parameters": {"repetition_penalty": {}}}', "parameters.repetition_penalty",
     422),
    ("/", '{"inputs": "a", "parameters": {"temperature": {}}}', "parameters.temperature", 422),
    ("/infill", '{"input_prefix": "a", "input_suffix": "", "n_predict": 4, "t_max_predict_ms": {}}', "t_max_predict_ms",
     400),
    ("/infill", '{"input_prefix": "a", "input_suffix": "", "t_max_predict_ms": {}, "stream": true}', "t_max_predict_ms",
     400),
    ("/completion", '{"prompt": "a", "n_predict": 4, "n_probs": {}}', "n_probs", 400),
    ("/tokenize", '{"content": ["a", {}]}', "content[1]", 400),
]


@pytest.mark.parametrize("route, template, field, status", DOORS)
def test_numbers_json_has_not_are_refused_at_every_protocols_door(server, route, template, field, status):
    """t_max_predict_ms: NaN on /infill generated its tokens, then answered 500 (streamed: 200 and no end at all)."""
    before = errors_of(server, status)
    for literal in NON_FINITE:
        raw = template.replace("M", server.model_id).replace("{}", literal)
        got, answer = server.post(route, raw.encode())
        body = json.loads(answer)
        message = f"invalid {field}: {literal} is not a finite number"
        assert got == status, (literal, body)
        if tgi_api.is_tgi(route):
            assert body == {"error": message, "error_type": "validation"}
        elif llama_api.is_llama(route):
            assert body == {"error": {"code": 400, "message": message, "type": "invalid_request_error"}}
        else:
            assert body == {"error": {"message": message, "type": "invalid_request_error", "param": field,
                                      "code": None}}
    assert errors_of(server, status) - before == len(NON_FINITE)


def test_no_field_of_any_protocol_takes_a_number_json_has_not():
    """Every field each protocol's body has, NaN in it: refused by the parser, naming the field, whatever the field's
    own check would have made of it (or missed)."""
    models = [(openai_api.CompletionBody, ""), (openai_api.ChatBody, ""), (tgi_api.GenerateBody, ""),
              (tgi_api.Parameters, "parameters."), (llama_api.InfillBody, ""), (llama_api.CompletionBody, ""),
              (llama_info.TokenizeBody, ""), (llama_info.DetokenizeBody, "")]
    for model, prefix in models:
        for name in model.model_fields:
            raw = json.dumps({"parameters": {name: "X"}} if prefix else {name: "X"}).replace('"X"', "NaN")
            with pytest.raises(ApiError) as e:
                boundary.parse_json(raw.encode())
            assert (e.value.status, e.value.param) == (400, prefix + name)


def test_a_number_json_has_not_is_refused_where_it_is_no_field_too():
    for raw, literal in ((b"NaN", "NaN"), (b'{"temperature": -Infinity, "temperature": 1.0}', "-Infinity")):
        with pytest.raises(ApiError) as e:  # a later duplicate key replaced it: refused all the same, as llama.cpp
            boundary.parse_json(raw)
        assert (e.value.status, e.value.param) == (400, None)
        assert e.value.message == f"the request body is not valid JSON: {literal} is not a finite number"
    assert boundary.parse_json(b'{"top_p": 1e308, "t": [-1.5e-300]}') == {"top_p": 1e308, "t": [-1.5e-300]}
