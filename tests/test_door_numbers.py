"""What a hostile or unlucky client meets at `autotp serve`'s door, from its side (raw HTTP, as the openai client
cannot write NaN): numbers JSON has not (NaN, Infinity) refused in every protocol before anything runs; a stream
that fails after its first token still ends as its protocol ends a failure; every status a client gets counted in
/metrics; the start-up warning of a server open to the network without a key; the 501 of /infill on a model without
FIM tokens saying each missing token once.

One in-process server for the module (in_process.py); one test starts `autotp serve` itself, for its warning."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time

import fim_families
import openai
import pytest
from in_process import InProcess, events
from serve_harness import ENV, START_TIMEOUT_S, metrics

from autotp.serve.api import boundary, llama_api, llama_info, openai_api, tgi_api
from autotp.serve.api.boundary import ApiError, Served
from autotp.serve.api.guard import open_to_all

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
        raw = template.replace('"M"', json.dumps(server.model_id)).replace("{}", literal)
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
        with pytest.raises(ApiError) as e:  # a later duplicate key replaced it: the literal is refused all the same
            boundary.parse_json(raw)
        assert (e.value.status, e.value.param) == (400, None)
        assert e.value.message == f"the request body is not valid JSON: {literal} is not a finite number"
    assert boundary.parse_json(b'{"top_p": 1e308, "t": [-1.5e-300]}') == {"top_p": 1e308, "t": [-1.5e-300]}


def failing(monkeypatch, cls, name: str, after_events: bool = False) -> None:
    """cls.name raises once (a bug of ours in an answer's builder): on its first call, or on the first after a call
    that gave the client an event (a random model's first tokens may be half a character, held back)."""
    real, state = getattr(cls, name), {"armed": not after_events, "done": False}

    def method(self, *args):
        if state["armed"] and not state["done"]:
            state["done"] = True
            raise ValueError("injected failure")
        out = real(self, *args)
        state["armed"] = state["armed"] or bool(out)
        return out

    monkeypatch.setattr(cls, name, method)


STREAMS = [  # (route, greedy body, the builder's class, the protocol's error end)
    ("/v1/completions", {"prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0, "stream": True},
     openai_api.Completions,
     lambda error: [{"error": {"message": error, "type": "server_error", "param": None, "code": None}}, "[DONE]"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": 12,
                              "temperature": 0, "stream": True},
     openai_api.Chat,
     lambda error: [{"error": {"message": error, "type": "server_error", "param": None, "code": None}}, "[DONE]"]),
    ("/generate_stream", {"inputs": "def add(a, b):", "parameters": {"max_new_tokens": 12}}, tgi_api.Generation,
     lambda error: [{"error": error, "error_type": "server"}]),
    ("/completion", {"prompt": "def add(a, b):", "n_predict": 12, "temperature": 0, "stream": True}, llama_api.Native,
     lambda error: [{"error": {"code": 500, "message": error, "type": "server_error"}}]),
]


@pytest.mark.parametrize("route, body, cls, end", STREAMS, ids=[s[0] for s in STREAMS])
def test_a_stream_whose_answer_fails_after_its_first_token_still_ends(server, monkeypatch, capfd, route, body, cls,
                                                                      end):
    """The builder raises once a token has been sent: the client gets the protocol's error end and the stream's last
    chunk, not a connection that stops; the server logs one line and serves on."""
    failing(monkeypatch, cls, "piece", after_events=True)
    before = errors_of(server, 500)
    status, answer = server.post(route, json.dumps({"model": server.model_id} | body).encode())
    got = events(answer)
    assert status == 200 and len(got) > len(end("")), got
    assert got[-len(end("")):] == end("ValueError: injected failure")
    assert errors_of(server, 500) - before == 1
    log = capfd.readouterr().err
    assert re.search(rf"internal error on POST {re.escape(route)} at test_door_numbers.py:\d+: ValueError: injected "
                     rf"failure", log), log
    assert "Traceback" not in log
    monkeypatch.undo()
    assert server.post(route, json.dumps({"model": server.model_id} | body).encode())[1].count(b'"error"') == 0


def test_a_row_the_engine_fails_mid_stream_ends_the_openai_clients_stream(server):
    """The model's forward raises on the third step (greedy, the seeded model has written "1" by then): the openai
    client, mid-stream, gets an APIError (the error object, then [DONE]) instead of waiting, and the next request is
    served."""
    forwards = []

    def third(module, args, kwargs):
        forwards.append(None)
        if len(forwards) == 3:
            raise RuntimeError("out of memory (injected)")

    hook = server.model.register_forward_pre_hook(third, with_kwargs=True)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        before = errors_of(server, 500)
        texts = []
        with pytest.raises(openai.APIError, match="out of memory \\(injected\\)"):
            for chunk in client.completions.create(model=server.model_id, prompt="x", max_tokens=12, temperature=0,
                                                   stream=True):
                texts.append(chunk.choices[0].text)
        assert texts and errors_of(server, 500) - before == 1
    finally:
        hook.remove()
    assert client.completions.create(model=server.model_id, prompt="x", max_tokens=12).usage.completion_tokens > 0


def test_every_status_a_client_gets_is_counted(server, monkeypatch, capfd):
    """A bug of ours answered 500 (Starlette's handler for it answered outside the counting middleware: uncounted), a
    400, a 429, and uvicorn's own 400 to bytes that are no HTTP request."""
    before = {code: errors_of(server, code) for code in (400, 429, 500)}
    failing(monkeypatch, llama_api.Native, "final")
    status, answer = server.post("/infill", b'{"input_prefix": "def f(", "input_suffix": "", "n_predict": 3}')
    assert (status, json.loads(answer)) == (500, {"error": {"code": 500, "message": "ValueError: injected failure",
                                                           "type": "server_error"}})
    log = capfd.readouterr().err
    assert re.search(r"internal error on POST /infill at test_door_numbers.py:\d+: ValueError: injected failure", log)
    assert "Traceback" not in log
    assert server.post("/completion", b'{"prompt": "a", "temperature": NaN}')[0] == 400
    monkeypatch.setattr(server.engine, "submit", lambda *args: "full")
    assert server.post("/completion", b'{"prompt": "a", "n_predict": 2}')[0] == 429
    monkeypatch.undo()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"NOT HTTP\r\n\r\n")
        assert s.recv(1024).startswith(b"HTTP/1.1 400 ")
    grew = {code: errors_of(server, code) - before[code] for code in before}
    assert grew == {400: 2, 429: 1, 500: 1}
    # /infill's 501 (no FIM tokens; this model has them) has its sample from start-up, as every status autotp answers
    assert metrics(server)["autotp:request_errors_total{status=501}"] == 0


def test_listening_beyond_loopback_without_a_key_is_said_at_start_up(tmp_path):
    """`autotp serve --host 0.0.0.0` without --api-key: a warning line once the port is bound, before the model loads
    (the test stops there)."""
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "autotp", "serve", "--host", "0.0.0.0", "--port", "0"],
                                stdout=out, stderr=subprocess.STDOUT, env=ENV)
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while not re.search("without an API key|serving autotp-demo", text := log.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, text
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert [line for line in text.splitlines() if "API key" in line] == [
        "autotp serve: " + open_to_all("0.0.0.0", None)], text


def test_the_warning_is_for_any_address_but_loopback_and_only_without_a_key():
    for host in ("0.0.0.0", "::", "192.168.1.20", "gpu-box.example"):
        assert open_to_all(host, None) == (f"warning: listening on {host} without an API key: anyone who can reach "
                                           f"this port can generate with the model; set a key with AUTOTP_API_KEY=... "
                                           f"(or --api-key), or listen on 127.0.0.1")
        assert open_to_all(host, "key") is None
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert open_to_all(host, None) is None


def test_infill_on_a_model_without_fim_tokens_names_each_missing_token_once(tmp_path):
    tok = fim_families.tokenizer("plain", tmp_path)
    plain = Served("smollm2", tok, 128, 0, 4096, len(tok))
    with pytest.raises(ApiError) as e:
        llama_api.parse_infill(b'{"input_prefix": "a", "input_suffix": "b"}', plain)
    assert (e.value.status, e.value.message) == (501, (
        "infill is not supported by smollm2: this tokenizer has none of the fill-in-the-middle formats autotp knows: "
        "it lacks <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>, <|file_sep|> (Qwen2.5-Coder); <fim_prefix>, "
        "<fim_suffix>, <fim_middle> (StarCoder2, StarCoder); <file_sep> (StarCoder2)"))
