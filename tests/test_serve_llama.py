"""llama-server's surface on a 2-rank `autotp serve` of a StarCoder-architecture model with StarCoder's FIM tokens, as
llama.vim and llama.vscode use it: their requests byte for byte (recorded from a real Vim running llama.vim, rebuilt
from llama.vscode's source: tests/fixtures/), every field they read present and true, greedy content equal to
transformers' own generate on the same prompt, and a real file longer than the context through every FIM route.

The plugin itself is not run here: CI has no network to fetch llama.vim (the fixture says how it was recorded).
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import fim_model
import pytest
import torch
from serve_harness import Server

from autotp import fim
from autotp.serve.api import llama_api
from autotp.serve.api.boundary import Served

FIXTURES = Path(__file__).parent / "fixtures"
VIM = json.loads((FIXTURES / "llama_vim_requests.json").read_text())
VSCODE = json.loads((FIXTURES / "llama_vscode_requests.json").read_text())
CONTEXT = 512
FILE = (Path(__file__).parent.parent / "src" / "autotp" / "sampling" / "sampler.py").read_text()  # ~1,700 tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return fim_model.build(tmp_path_factory.mktemp("fim"), n_positions=CONTEXT)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = Server(model_dir, tmp_path_factory.mktemp("serve") / "server.log")  # no --api-key
    yield s
    s.kill()


@pytest.fixture(scope="module")
def served(server, model_dir) -> Served:
    """The boundary's view of the server's model, to compute in the test what the server must have done."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    kv = int(re.search(r"KV cache: (\d+) tokens per rank", server.text()).group(1))
    return Served(server.model_id, tok, CONTEXT, 0, kv, len(tok))


def post(server, path: str, body: bytes | dict, key: str = "") -> tuple[int, str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(server.url + path, data=data, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {key}"})  # llama.vim's empty key
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def vim_looks_at(answer: str) -> bool:
    """llama.vim's s:fim_on_response: an answer that fails this is dropped before it is parsed."""
    return re.match(r"^\s*\{", answer) is not None and re.search(r'"content"\s*:"', answer) is not None


def common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_llama_vims_session_is_answered_as_vim_reads_it_and_the_prepare_request_warms_the_cache(server, served):
    """The recorded session in order: the ring's prepare requests (n_predict 0, empty key and model), then the
    completions as the user typed. Each completion's tokens_cached is the prompt it shares with what was computed
    before it: at least the other files' tokens, which the prepare request computed."""
    before = None
    for sent in VIM["requests"]:
        status, answer = post(server, "/infill", sent["body"].encode())
        assert status == 200, answer
        body = json.loads(sent["body"])
        if body["n_predict"] == 0:
            assert answer == "{}"  # response_fields [""]: llama-server's empty answer, which Vim ignores
            before = llama_api.parse_infill(sent["body"].encode(), served).rows[0].ids
            continue
        assert vim_looks_at(answer), answer
        got = json.loads(answer)
        parsed = llama_api.parse_infill(sent["body"].encode(), served)
        ids = parsed.rows[0].ids
        assert list(got) == body["response_fields"] and got["truncated"] is parsed.answer.fits[0].truncated
        extra = [fim.Chunk(c["text"], c["filename"]) for c in body["input_extra"]]
        files = fim.fim_ids(served.tokenizer, "", "", extra=extra).context_tokens
        assert got["tokens_cached"] >= files > 0 and got["tokens_cached"] >= common(before, ids) - 1, got
        assert got["timings/prompt_n"] == len(ids) - got["tokens_cached"] and got["timings/predicted_n"] >= 1
        assert got["timings/prompt_ms"] > 0 and got["timings/predicted_ms"] >= 0
        before = ids


def test_llama_vscodes_three_completions_come_back_as_an_array_and_share_one_prompt(server, served):
    prepare, completion = VSCODE["requests"][0], VSCODE["requests"][1]
    assert post(server, "/infill", prepare["body"].encode())[0] == 200
    status, answer = post(server, "/infill", completion["body"].encode())
    assert status == 200, answer
    items = json.loads(answer)
    assert isinstance(items, list) and [i["index"] for i in items] == [0, 1, 2]
    (ids,) = {r.ids for r in llama_api.parse_infill(completion["body"].encode(), served).rows}
    full = (len(ids) - 1) // 16 * 16  # the full blocks of its prompt, all of them computed once
    assert sorted(i["tokens_cached"] for i in items)[1:] >= [full, full], [i["tokens_cached"] for i in items]
    for item in items:
        assert item["generation_settings"]["n_ctx"] == CONTEXT and item["stop"] is True
        assert {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms"} <= set(item["timings"])


def test_greedy_infill_content_is_transformers_generate_on_the_same_prompt(server, served, model_dir):
    from transformers import AutoModelForCausalLM

    body = {"input_prefix": "def add(a, b):\n", "input_suffix": "\n\ndef sub(a, b):\n    return a - b\n",
            "input_extra": [{"text": "def mean(xs):\n    return sum(xs) / len(xs)\n", "filename": "ops.py"}],
            "prompt": "    return", "n_predict": 12, "samplers": ["temperature"], "temperature": 0.0, "model": ""}
    status, answer = post(server, "/infill", body)
    assert status == 200, answer
    (row,) = llama_api.parse_infill(json.dumps(body).encode(), served).rows
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([row.ids]), max_new_tokens=12, do_sample=False)[0, len(row.ids):].tolist()
    ends = set(row.stop_ids) | {served.tokenizer.eos_token_id}
    out = out[:next((i for i, t in enumerate(out) if t in ends), len(out))]
    assert json.loads(answer)["content"] == served.tokenizer.decode(out, skip_special_tokens=True)


def test_a_real_file_longer_than_the_context_is_cut_nearest_the_cursor_through_every_fim_route(server, served):
    """Half of sampler.py before the cursor and half after (an editor's real file, ~1,700 tokens in a context of
    512): every FIM route answers, with the prompt fim.py's budget rule keeps; a plain prompt as long keeps its 400."""
    half = len(FILE) // 2
    prefix, suffix = FILE[:half], FILE[half:]
    status, answer = post(server, "/infill", {"input_prefix": prefix, "input_suffix": suffix, "n_predict": 4096})
    got = json.loads(answer)
    assert status == 200 and got["truncated"] is True and got["tokens_evaluated"] <= CONTEXT // 2, answer
    want = llama_api.parse_infill(json.dumps({"input_prefix": prefix, "input_suffix": suffix,
                                              "n_predict": 4096}).encode(), served).rows[0].ids
    assert got["tokens_evaluated"] == len(want)

    openai_body = {"model": server.model_id, "prompt": prefix, "suffix": suffix, "max_tokens": 4096, "temperature": 0}
    status, answer = post(server, "/v1/completions", openai_body)
    assert status == 200 and json.loads(answer)["usage"]["prompt_tokens"] == len(want), answer
    fim_form = f"<fim_prefix>{prefix}<fim_suffix>{suffix}<fim_middle>"  # Continue's template, rendered
    status, answer = post(server, "/v1/completions", {**openai_body, "prompt": fim_form, "suffix": None})
    assert status == 200 and json.loads(answer)["usage"]["prompt_tokens"] == len(want), answer
    status, answer = post(server, "/generate", {"inputs": fim_form, "parameters": {"max_new_tokens": 60}})
    assert status == 200 and isinstance(json.loads(answer)["generated_text"], str), answer
    status, answer = post(server, "/v1/completions", {**openai_body, "prompt": FILE, "suffix": None})
    assert status == 400 and json.loads(answer)["error"]["code"] == "context_length_exceeded", answer


def test_completion_props_tokenize_and_detokenize_answer_as_llama_server_does(server, served):
    status, answer = post(server, "/completion", {"prompt": "def add(a, b):", "n_predict": 3, "samplers": []})
    got = json.loads(answer)
    assert status == 200 and got["tokens_predicted"] <= 3 and got["stop"] is True and "content" in got
    with urllib.request.urlopen(server.url + "/props", timeout=10) as r:
        props = json.loads(r.read())
    slots = int(re.search(r"up to (\d+) sequences", server.text()).group(1))
    assert props["default_generation_settings"]["n_ctx"] == CONTEXT and props["total_slots"] == slots
    status, answer = post(server, "/tokenize", {"content": "def add(a, b):"})
    tokens = json.loads(answer)["tokens"]
    assert status == 200 and tokens == served.tokenizer("def add(a, b):", add_special_tokens=False).input_ids
    status, answer = post(server, "/detokenize", {"tokens": tokens})
    assert status == 200 and json.loads(answer) == {"content": "def add(a, b):"}
    status, answer = post(server, "/infill", {"input_prefix": "x", "input_suffix": "y", "n_predict": -5})
    assert status == 400 and json.loads(answer)["error"]["type"] == "invalid_request_error", answer
