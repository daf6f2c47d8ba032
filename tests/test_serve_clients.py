"""`autotp serve` for the clients teams already run, driven as those clients drive it.

huggingface_hub's InferenceClient on TGI's API; the openai client's chat and completions with n,
logprobs and echo, checked against the unsharded model's log-probabilities; /metrics parsed by
prometheus_client; the request bodies llm-vscode (llm-ls), Continue and Tabby send, byte for byte as
their sources build them; an editor that cancels its completion on every keystroke; a 413 that reaches
Python's http.client. One 2-rank server for the module, on a tiny FIM model with a chat template.
"""

import http.client
import json
import os
import re
import socket
import time
import urllib.error
import urllib.request

import fim_model
import openai
import pytest
import torch
from commands import cli
from huggingface_hub import InferenceClient
from huggingface_hub.errors import ValidationError
from serve_harness import Server, metrics

from autotp.generate import generate

PROMPT = "def add(a, b):"
# fp32 at tp 2: an all-reduce reorders sums, so logits differ by ~1e-5 (see test_parity); log-softmax too
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return fim_model.build(tmp_path_factory.mktemp("fim"), chat_template=fim_model.CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = Server(model_dir, tmp_path_factory.mktemp("serve") / "server.log")
    yield s
    s.kill()


@pytest.fixture(scope="module")
def unsharded(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)


def greedy(unsharded, text: str, n: int) -> tuple[list[int], str]:
    model, tok = unsharded
    ids = torch.tensor([tok(text).input_ids])
    new = generate(model, ids, max_new_tokens=n)[0, ids.shape[1]:].tolist()
    return new, tok.decode(new, skip_special_tokens=True)


def reference_logprobs(unsharded, ids: list[int]) -> torch.Tensor:
    """(len(ids) - 1, vocab): the log-probabilities of each next token, from one unsharded forward."""
    model, _ = unsharded
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)


def sse(server, path: str, body: dict, **headers) -> list[str]:
    """The data lines of a server-sent event stream, as a client that reads every line sees them."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **headers})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    lines = [line.decode().rstrip("\n") for line in response]
    conn.close()
    return [line[len("data:"):].strip() for line in lines if line.startswith("data:")]


# --- TGI's API, through huggingface_hub's InferenceClient (it POSTs to the URL it is given: "/") ---

def test_inference_client_text_generation(server, unsharded):
    client = InferenceClient(base_url=server.url)
    ids, text = greedy(unsharded, PROMPT, 12)
    assert client.text_generation(PROMPT, max_new_tokens=12) == PROMPT + text  # "/" prepends, as TGI's does
    assert client.text_generation(PROMPT, max_new_tokens=12, return_full_text=False) == text
    out = client.text_generation(PROMPT, max_new_tokens=12, details=True, return_full_text=False)
    assert out.generated_text == text and out.details.finish_reason == "length"
    assert out.details.generated_tokens == 12 and [t.id for t in out.details.tokens] == ids
    expected = reference_logprobs(unsharded, unsharded[1](PROMPT).input_ids + ids)[-12:]
    got = torch.tensor([t.logprob for t in out.details.tokens])
    assert torch.allclose(got, expected.gather(1, torch.tensor(ids)[:, None])[:, 0], atol=LOGPROB_ATOL)
    streamed = list(client.text_generation(PROMPT, max_new_tokens=12, stream=True, details=True,
                                           return_full_text=False))
    assert "".join(s.token.text for s in streamed) == text and [s.token.id for s in streamed] == ids
    assert streamed[-1].generated_text == text and streamed[-1].details.finish_reason == "length"
    assert all(s.generated_text is None for s in streamed[:-1])


def test_inference_client_sampling_stop_and_errors(server):
    client = InferenceClient(base_url=server.url)
    sampled = client.text_generation(PROMPT, max_new_tokens=16, do_sample=True, temperature=0.8, seed=5,
                                     return_full_text=False)
    oai = server.client.completions.create(model=server.model_id, prompt=PROMPT, max_tokens=16, temperature=0.8,
                                           seed=5)
    assert sampled == oai.choices[0].text  # one sampler, whichever protocol asks
    full = client.text_generation(PROMPT, max_new_tokens=16, return_full_text=False)
    stop = full[4:7]
    out = client.text_generation(PROMPT, max_new_tokens=16, stop=[stop], details=True, return_full_text=False)
    assert out.generated_text == full[:full.find(stop)] + stop  # TGI keeps the stop sequence
    assert out.details.finish_reason == "stop_sequence"
    streamed = list(client.text_generation(PROMPT, max_new_tokens=16, stop=[stop], stream=True, details=True,
                                           return_full_text=False))
    # what huggingface_hub's streaming users and Continue's TGI provider build: the tokens' texts joined
    assert "".join(s.token.text for s in streamed) == streamed[-1].generated_text == out.generated_text
    with pytest.raises(ValidationError, match="temperature must be strictly positive"):
        client.text_generation(PROMPT, max_new_tokens=4, temperature=0.0)
    with pytest.raises(ValidationError, match="context"):
        client.text_generation(PROMPT, max_new_tokens=4000)


def test_continue_huggingface_tgi_provider(server):
    """Continue's huggingface-tgi: GET info (model_id, max_input_length), then POST generate_stream."""
    with urllib.request.urlopen(server.url + "/info", timeout=10) as r:
        info = json.loads(r.read())
    assert info["model_id"] == server.model_id and int(info["max_input_length"]) == 127
    body = {"inputs": "<fim_prefix>def add(a, b):\n    <fim_suffix>\n    return c\n<fim_middle>",
            "parameters": {"max_new_tokens": 24, "best_of": 1, "temperature": 0.01, "top_p": 0.95,
                           "presence_penalty": 0, "stop": ["<fim_prefix>", "<fim_suffix>", "<fim_middle>",
                                                           "<|endoftext|>"]}}
    events = [json.loads(d) for d in sse(server, "/generate_stream", body)]
    assert [e["index"] for e in events] == list(range(1, len(events) + 1))
    assert all(e["generated_text"] is None for e in events[:-1]) and events[-1]["generated_text"] is not None
    assert events[-1]["generated_text"].startswith("".join(e["token"]["text"] for e in events[:-1]))


# --- what editors send ---

def test_llm_vscode_tgi_backend(server):
    """llm-ls (tgi backend) POSTs llm.requestBody + inputs (its FIM prompt) to /generate, never streaming,
    and reads generated_text; without a `parameters` object in requestBody it nests one (its bug)."""
    fim = "<fim_prefix>def add(a, b):\n    <fim_suffix>\n    return c\n<fim_middle>"
    code, out = server.post({"inputs": fim, "parameters": {"max_new_tokens": 24, "temperature": 0.2, "top_p": 0.95,
                                                           "return_full_text": False}}, "/generate")
    assert code == 200 and isinstance(out["generated_text"], str)
    code, nested = server.post({"inputs": fim, "parameters": {"parameters": {"return_full_text": False}}},
                               "/generate")
    assert code == 200 and isinstance(nested["generated_text"], str)
    greedy_fim = server.client.completions.create(model=server.model_id, prompt="def add(a, b):\n    ",
                                                  suffix="\n    return c\n", max_tokens=24, temperature=0)
    code, tgi_greedy = server.post({"inputs": fim, "parameters": {"max_new_tokens": 24}}, "/generate")
    assert tgi_greedy["generated_text"] == greedy_fim.choices[0].text


def test_continue_openai_provider_autocomplete(server):
    """Continue's openai provider renders its StarCoder FIM template into `prompt` (no suffix) and sends its
    seven stop strings, temperature 0.01, streaming; it reads choices[0].text of each chunk."""
    body = {"model": server.model_id, "prompt": "<fim_prefix>def add(a, b):\n    <fim_suffix>\n    return c\n"
                                                "<fim_middle>", "max_tokens": 24, "temperature": 0.01,
            "stop": ["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>", "<|endoftext|>", "</fim_middle>",
                     "</code>"], "stream": True}
    data = sse(server, "/v1/completions", body, Authorization="Bearer unused", **{"api-key": "unused"})
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] in ("stop", "length")


def test_tabby_openai_completion(server):
    """Tabby's openai/completion sends prompt + suffix (and vllm/completion suffix null), always streaming,
    and stops reading at the first chunk with a finish_reason: that chunk must come before [DONE]."""
    for suffix in ("\n    return c\n", None):
        body = {"model": server.model_id, "prompt": "def add(a, b):\n    ", "suffix": suffix, "max_tokens": 24,
                "temperature": 0.1, "stream": True, "presence_penalty": 0.0}
        data = sse(server, "/v1/completions", body)
        chunks = []
        for d in data:
            chunk = json.loads(d)  # Tabby's reader panics on anything but JSON before it has finished
            chunks.append(chunk)
            if chunk["choices"][0]["finish_reason"] is not None:
                break
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.timeout(120)
def test_an_editor_that_cancels_on_every_keystroke(server):
    """Continue and llm-vscode cancel the completion in flight when the user types on: ten keystrokes, each
    a FIM request whose stream is dropped after its first chunk; then the last one is read to its end."""
    line = "    total = a + b"
    before = metrics(server)
    for k in range(1, len(line) - 6):
        stream = server.client.completions.create(model=server.model_id, prompt="def add(a, b):\n" + line[:k],
                                                  suffix="\n    return total\n", max_tokens=80, temperature=0,
                                                  stream=True)
        next(iter(stream))
        stream.close()
    last = dict(model=server.model_id, prompt="def add(a, b):\n" + line, suffix="\n    return total\n",
                max_tokens=20, temperature=0)
    typed = "".join(c.choices[0].text for c in server.client.completions.create(stream=True, **last) if c.choices)
    deadline = time.monotonic() + 30
    while metrics(server)["autotp:num_requests_running"] != 0:  # every cancelled row has left
        assert time.monotonic() < deadline, server.text()[-2000:]
        time.sleep(0.1)
    assert typed == server.client.completions.create(**last).choices[0].text
    after = metrics(server)

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    cancelled = grew("autotp:request_errors_total{status=499}")
    # a keystroke's row ends early where the model writes a FIM token (the middle is done): answered, not cancelled
    done = grew("autotp:request_success_total{finished_reason=stop}") + grew(
        "autotp:request_success_total{finished_reason=length}")
    assert cancelled >= 1 and cancelled + done == len(line) - 7 + 2  # the ten keystrokes, then the two whole ones


@pytest.mark.timeout(120)
def test_llm_vscode_dropping_its_generate_request_ends_the_row_and_counts_499(server):
    """llm-ls POSTs /generate without streaming and drops the request when the user types on: the row ends at
    the next step, and the request is answered (to nobody) and counted as the client's 499, not left waiting."""
    body = json.dumps({"inputs": "def f(x):", "parameters": {"max_new_tokens": 115}}).encode()
    before = metrics(server)

    def running() -> float:
        return metrics(server)["autotp:num_requests_running"]

    for _ in range(3):
        deadline = time.monotonic() + 30
        while running():  # the row before has left: the next one seen running is this request's
            assert time.monotonic() < deadline, server.text()[-2000:]
            time.sleep(0.02)
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {server.api_key}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                     + body)
        deadline = time.monotonic() + 30
        while running() < 1:
            assert time.monotonic() < deadline, server.text()[-2000:]
            time.sleep(0.02)
        sock.close()  # mid-generation: 115 tokens take over a second here
    deadline = time.monotonic() + 30
    while (after := metrics(server))["autotp:request_errors_total{status=499}"] - before.get(
            "autotp:request_errors_total{status=499}", 0) < 3 or after["autotp:num_requests_running"]:
        assert time.monotonic() < deadline, server.text()[-2000:]
        time.sleep(0.1)
    text = server.text()
    cancelled = re.findall(r"^autotp serve: (tgi-\w+) prompt 0 cancelled after \d+ of 115 tokens", text, re.M)
    assert len(cancelled) >= 3 and all(re.search(rf"^autotp serve: {c} status=499 ", text, re.M) for c in cancelled)
    assert server.post({"inputs": "x", "parameters": {"max_new_tokens": 2}}, "/generate")[0] == 200


def test_tgi_refuses_what_tgi_refuses_and_names_a_failed_generation_424():
    """top_p and top_k of 0 (TGI: 422, they are not "off"); an engine failure is TGI's 424 "generation", which
    huggingface_hub raises as GenerationError, where OpenAI's routes answer 500."""
    from autotp.serve.api import tgi_api
    from autotp.serve.api.boundary import ApiError, engine_error

    failed = engine_error(500, "generation failed: RuntimeError: boom")
    assert tgi_api.status(failed) == 424 and tgi_api.error_body(failed)["error_type"] == "generation"
    assert failed.body()["error"]["type"] == "server_error" and failed.status == 500
    assert tgi_api.status(engine_error(503, "the server is shutting down")) == 503
    assert tgi_api.status(ApiError(500, "a bug", type="server_error")) == 500


@pytest.mark.parametrize("parameters, message", [
    ({"top_p": 0.0, "do_sample": True}, "parameters.top_p must be in (0, 1]"),
    ({"top_k": 0}, "top_k must be strictly positive")])
def test_tgi_parameters_tgi_refuses_get_422(server, parameters, message):
    code, out = server.post({"inputs": PROMPT, "parameters": {"max_new_tokens": 2, **parameters}}, "/generate")
    assert code == 422 and out["error_type"] == "validation" and message in out["error"], out


# --- OpenAI's completions and chat, as the openai client sends them ---

def test_n_logprobs_and_echo_against_the_unsharded_model(server, unsharded):
    _, tok = unsharded
    ids, text = greedy(unsharded, PROMPT, 8)
    out = server.client.completions.create(model=server.model_id, prompt=PROMPT, max_tokens=8, temperature=0, n=2,
                                           logprobs=3, echo=True)
    assert [c.index for c in out.choices] == [0, 1] and out.choices[0].text == out.choices[1].text == PROMPT + text
    lp = out.choices[0].logprobs
    prompt_ids = tok(PROMPT).input_ids
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens == [tok.decode([t]) for t in prompt_ids + ids]
    expected = reference_logprobs(unsharded, prompt_ids + ids)
    got = torch.tensor(lp.token_logprobs[1:])
    assert torch.allclose(got, expected.gather(1, torch.tensor(prompt_ids[1:] + ids)[:, None])[:, 0],
                          atol=LOGPROB_ATOL)
    for position, top in enumerate(lp.top_logprobs[1:]):
        best = expected[position].topk(3)
        assert {tok.decode([i]) for i in best.indices.tolist()} <= set(top) and len(top) <= 4
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert out.usage.completion_tokens == 16 and out.usage.prompt_tokens == len(prompt_ids) * 2


def test_n_sampled_choices_use_consecutive_seeds(server):
    many = server.client.completions.create(model=server.model_id, prompt=PROMPT, max_tokens=12, temperature=1.0,
                                            n=3, seed=40)
    alone = [server.client.completions.create(model=server.model_id, prompt=PROMPT, max_tokens=12, temperature=1.0,
                                              seed=40 + j).choices[0].text for j in range(3)]
    assert [c.text for c in many.choices] == alone and len(set(alone)) > 1


def test_chat_completions_through_the_openai_client(server, unsharded):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "add two numbers"}]
    rendered = unsharded[1].apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    plain = server.client.completions.create(model=server.model_id, prompt=rendered, max_tokens=16, temperature=0)
    chat = server.client.chat.completions.create(model=server.model_id, messages=messages, max_tokens=16,
                                                 temperature=0, logprobs=True, top_logprobs=2)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content == plain.choices[0].text
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in chat.choices[0].logprobs.content)
    wide = server.client.chat.completions.create(model=server.model_id, messages=messages, max_tokens=4,
                                                 temperature=0, logprobs=True, top_logprobs=20)  # OpenAI's limit
    assert all(len(t.top_logprobs) == 20 for t in wide.choices[0].logprobs.content)
    with pytest.raises(openai.BadRequestError, match="between 0 and 20"):
        server.client.chat.completions.create(model=server.model_id, messages=messages, logprobs=True,
                                              top_logprobs=21)
    chunks = list(server.client.chat.completions.create(model=server.model_id, messages=messages, max_tokens=16,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    with pytest.raises(openai.BadRequestError, match="tools"):
        server.client.chat.completions.create(model=server.model_id, messages=messages, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {}}}])


# --- operators ---

@pytest.mark.timeout(120)
def test_metrics_add_up_during_a_load(server, unsharded):
    before = metrics(server)
    stream = server.client.completions.create(model=server.model_id, prompt=PROMPT, max_tokens=60, temperature=0,
                                              stream=True, stream_options={"include_usage": True})
    chunks = iter(stream)
    next(chunks)
    during = metrics(server)
    streamed = [c.usage for c in chunks if c.usage][0]
    assert during["autotp:num_requests_running"] >= 1 and 0 < during["autotp:kv_cache_usage_perc"] <= 1
    outs = [server.client.completions.create(model=server.model_id, prompt=f"def f{i}(x):", max_tokens=5 + i,
                                             temperature=0) for i in range(4)]
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model=server.model_id, prompt="x", max_tokens=0)
    after = metrics(server)

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    usages = [streamed] + [o.usage for o in outs]
    assert grew("autotp:time_to_first_token_seconds_count") == 5 == grew("autotp:e2e_request_latency_seconds_count")
    assert grew("autotp:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert grew("autotp:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert grew("autotp:inter_token_latency_seconds_count") == sum(u.completion_tokens - 1 for u in usages)
    reasons = grew("autotp:request_success_total{finished_reason=length}") + grew(
        "autotp:request_success_total{finished_reason=stop}")
    assert reasons == 5 and grew("autotp:request_errors_total{status=400}") == 1
    assert after["autotp:num_requests_running"] == 0 and after["autotp:num_requests_waiting"] == 0


def test_an_editor_resending_its_file_with_a_few_characters_more_is_served_from_the_cache(server, unsharded):
    """What llm-vscode and Continue do on every pause in typing: the file up to the cursor again, a few
    characters longer. The second request's prompt comes from the first one's cached blocks (/metrics counts
    them), and its completion is the unsharded model's."""
    _, tok = unsharded
    file = "".join(fim_model.CORPUS[:6])  # 88 tokens of code (5 full blocks of 16) in a context of 128
    before = metrics(server)
    server.client.completions.create(model=server.model_id, prompt=file, max_tokens=8, temperature=0)
    typed = file + "def sub(a"
    again = server.client.completions.create(model=server.model_id, prompt=typed, max_tokens=16, temperature=0)
    after = metrics(server)
    queried = after["autotp:prefix_cache_queries_total"] - before.get("autotp:prefix_cache_queries_total", 0)
    hits = after["autotp:prefix_cache_hits_total"] - before.get("autotp:prefix_cache_hits_total", 0)
    first, second = len(tok(file).input_ids), len(tok(typed).input_ids)
    assert queried == first + second
    # the second prompt's full blocks that the first prompt's tokens filled (its last token may be
    # tokenized differently once characters follow it)
    pairs = zip(tok(file).input_ids + [-1], tok(typed).input_ids, strict=False)
    shared = next(i for i, (a, b) in enumerate(pairs) if a != b)
    assert hits >= (shared // 16) * 16 - 16 and hits >= 64, (hits, shared)
    assert again.choices[0].text == greedy(unsharded, typed, 16)[1]


def test_every_answered_error_is_counted_once_under_the_status_the_client_got(server):
    """What an operator's dashboard sums: TGI's 422 (was counted as 400), and the refusals made before the API
    (Host, media type, size) and unknown paths (were not counted at all), each once."""
    before = metrics(server)
    sent = [server.post({"inputs": PROMPT, "parameters": {"temperature": 0}}, "/generate")[0],  # TGI validation
            server.post({"model": server.model_id, "prompt": "x", "max_tokens": -1})[0],  # OpenAI validation
            server.post({"model": server.model_id, "prompt": "x"}, Host="evil.example")[0],
            server.post(b"{}", **{"Content-Type": "text/plain"})[0],
            server.post({"model": server.model_id, "prompt": "x"}, "/v1/nowhere")[0]]
    request = urllib.request.Request(server.url + "/v1/completions", data=b"x" * (2**21 + 1),
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as too_large:
        urllib.request.urlopen(request, timeout=30)
    sent.append(too_large.value.code)
    assert sent == [422, 400, 400, 415, 404, 413]
    after = metrics(server)
    grew = {code: after.get(f"autotp:request_errors_total{{status={code}}}", 0) - before.get(
        f"autotp:request_errors_total{{status={code}}}", 0) for code in (400, 404, 413, 415, 422)}
    assert grew == {400: 2, 404: 1, 413: 1, 415: 1, 422: 1}
    assert re.search(r"^autotp serve: tgi-\w+ status=422 ", server.text(), re.M)  # the log says what was sent


# --- what must not break the server ---

def test_a_413_reaches_a_client_that_writes_its_whole_body_first(server):
    """http.client (like requests) sends the whole body before reading: it saw a reset, not the 413."""
    body = json.dumps({"model": server.model_id, "prompt": "x" * (3 * 2**20)})
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 413 and "limit of 2097152 bytes" in json.loads(response.read())["error"]["message"]
    conn.close()
    assert server.client.completions.create(model=server.model_id, prompt="x", max_tokens=2).usage.completion_tokens


@pytest.mark.parametrize("args, env, source", [(["--api-key", ""], {}, "--api-key"),
                                               ([], {"AUTOTP_API_KEY": ""}, "AUTOTP_API_KEY")])
def test_an_empty_api_key_is_refused_at_start(model_dir, capsys, monkeypatch, args, env, source):
    """--api-key "$KEY" with KEY unset passes '': a server open to anyone would be the silent outcome."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, _, err = cli(capsys, "serve", "--model", model_dir, *args)
    assert code == 2 and err.strip() == f"autotp: error: {source} is empty: give a key, or leave it out to serve " \
                                        "without one", err


def test_the_log_has_one_line_per_request(server):
    assert re.search(r"tgi-\w+ status=200 prompt_tokens=\d+ generated_tokens=\d+", server.text())
    assert os.path.exists(server.log)
