"""Rules of the API that one-character bugs broke while the suite passed, from the client's side: its request to a
real `autotp serve` (one process, a tiny StarCoder-architecture model with StarCoder's FIM tokens), each test failing
when its rule is broken that way (checked by breaking it once).

The model is a fine-tune's kind: its tokenizer has one token more than the model has embedding rows (a token added
without resizing), and it writes <fim_suffix> often (that row of its tied embedding is scaled up), so a FIM
completion ends on a sentinel within a few tokens.

- /infill's `truncated` counts the other files dropped before tokenizing, as well as what the budget rule cut;
- /completion fits a budget per completion: `n_cmpl` completions of a prompt are each answered, whole and streamed;
- /completion of a prompt written in FIM form stops at the format's sentinels, as /infill does;
- a prompt's ids are checked against the embedding rows where the tokenizer knows more: rows - 1 accepted, rows not;
- /get_load's num_reqs counts the waiting requests with the running ones.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import fim_model
import pytest
import torch
from checkpoints import widen
from serve_harness import Server

from autotp import fim
from autotp.serve.api.boundary import Served

CONTEXT = 128
ADDED = "<added_without_resizing>"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    directory = tmp_path_factory.mktemp("fim_added")
    tok = fim_model.tokenizer(directory)
    rows = len(tok)
    tok.add_tokens([ADDED])
    tok.save_pretrained(directory)
    eos = tok.convert_tokens_to_ids(fim_model.SPECIAL[0])
    config = GPTBigCodeConfig(n_layer=2, n_embd=64, n_head=4, multi_query=True, n_inner=150, n_positions=CONTEXT,
                              vocab_size=rows, bos_token_id=eos, eos_token_id=eos)
    torch.manual_seed(0)
    model = widen(GPTBigCodeForCausalLM(config).eval())
    with torch.no_grad():  # tied: the LM head's row of <fim_suffix> too, whose logit grows fourfold
        model.transformer.wte.weight[tok.convert_tokens_to_ids("<fim_suffix>")] *= 4
    model.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = Server(model_dir, tmp_path_factory.mktemp("serve") / "server.log", "--max-num-seqs", "1", torchrun=False)
    yield s
    s.kill()


@pytest.fixture(scope="module")
def served(model_dir) -> Served:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    return Served("m", tok, CONTEXT, 0, 10_000, rows)


def post(server, path: str, body: dict, stream: bool = False) -> tuple[int, object]:
    """(status, the JSON answer; streamed: the list of its events' JSON objects)."""
    request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            text = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    if not stream:
        return status, json.loads(text)
    return status, [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and
                    line != "data: [DONE]"]


# --- 6. /infill: other files dropped before tokenizing are a truncation --------------------------------------------


@pytest.mark.timeout(60)
def test_infill_with_an_other_file_too_long_to_tokenize_says_truncated(server, served):
    """llama.vim sends the files it has seen (`input_extra`, oldest first): one longer than any context could hold
    is dropped before it is tokenized; the answer says the prompt was cut. The control: the newest file alone fits,
    and nothing is cut."""
    small = {"filename": "b.py", "text": "x = 1\n"}
    huge = {"filename": "a.py", "text": "y = 2\n" * (served.max_prompt_chars // 6 + 1)}
    body = {"input_prefix": "def f(", "input_suffix": ")\n", "n_predict": 2, "temperature": 0}
    status, whole = post(server, "/infill", body | {"input_extra": [small]})
    assert status == 200 and whole["truncated"] is False, whole
    status, cut = post(server, "/infill", body | {"input_extra": [huge, small]})
    assert status == 200, cut
    assert cut["truncated"] is True and cut["tokens_evaluated"] == whole["tokens_evaluated"], cut


# --- 7. /completion: a budget per completion --------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True])
def test_completion_with_n_cmpl_answers_every_completion(server, stream):
    """n_cmpl 2 (llama-server's; llama.vscode asks 3 of /infill): two completions of one prompt, each answered as
    a whole object or streamed to its final object, every one with its index."""
    body = {"prompt": "def add(a, b):", "n_predict": 6, "n_cmpl": 2, "temperature": 0, "stream": stream,
            "return_tokens": True}
    status, answer = post(server, "/completion", body, stream=stream)
    assert status == 200, answer
    finals = answer if not stream else [e for e in answer if e.get("stop")]
    assert sorted(a["index"] for a in finals) == [0, 1], answer
    assert all(a["tokens_predicted"] >= 1 for a in finals), finals
    if stream:
        for i in (0, 1):
            tokens = [t for e in answer if e["index"] == i and not e.get("stop") for t in e["tokens"]]
            assert len(tokens) == next(a["tokens_predicted"] for a in finals if a["index"] == i), answer


# --- 8. /completion of a prompt in FIM form stops at the sentinels ----------------------------------------------


@pytest.mark.timeout(60)
def test_completion_of_a_prompt_in_fim_form_stops_at_a_sentinel(server, served):
    """Continue and Twinny write the FIM prompt themselves and POST it to /completion: the completion ends where the
    model writes a sentinel of the format (<fim_suffix> here), as /infill's would, stop_type "eos"."""
    sentinels = set(fim.stop_ids(served.tokenizer))
    prompt = fim.fim_text(served.tokenizer, "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n")
    status, answer = post(server, "/completion", {"prompt": prompt, "n_predict": 32, "temperature": 0,
                                                  "return_tokens": True})
    assert status == 200, answer
    assert answer["tokens"] and answer["tokens"][-1] in sentinels, answer
    assert not sentinels & set(answer["tokens"][:-1]), answer
    assert (answer["stop_type"], answer["tokens_predicted"]) == ("eos", len(answer["tokens"])), answer


# --- 9. the ids a prompt may hold: the embedding rows --------------------------------------------------------------


@pytest.mark.timeout(60)
def test_prompt_ids_at_the_embedding_rows_edge(server, served):
    """The tokenizer knows rows + 1 tokens, the model has rows embeddings: id rows - 1 is served, id rows (the
    token added without resizing) is refused with both numbers, on OpenAI's route and llama-server's."""
    rows = served.vocab
    assert len(served.tokenizer) == rows + 1 and served.tokenizer.convert_tokens_to_ids(ADDED) == rows
    ok = server.client.completions.create(model=server.model_id, prompt=[5, rows - 1], max_tokens=2, temperature=0)
    assert ok.usage.prompt_tokens == 2
    status, answer = server.post({"model": server.model_id, "prompt": [5, rows], "max_tokens": 2})
    assert status == 400, answer
    assert answer["error"]["message"] == (f"token id {rows} is not in the vocabulary of {server.model_id} (0 to "
                                          f"{rows - 1}): its tokenizer knows {rows + 1} tokens, the model has "
                                          f"embeddings for {rows}"), answer
    status, answer = post(server, "/completion", {"prompt": [5, rows], "n_predict": 2})
    assert status == 400, answer
    assert post(server, "/completion", {"prompt": [5, rows - 1], "n_predict": 2})[0] == 200


# --- 10. /get_load counts the waiting -----------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_get_load_counts_a_waiting_request_with_the_running_one(server):
    """One sequence slot (--max-num-seqs 1): a streamed request runs, a second waits behind it; SGLang's router
    reads num_reqs 2, of which num_waiting_reqs 1."""
    running = iter(server.client.completions.create(model=server.model_id, prompt=[5, 6, 7], max_tokens=100,
                                                    temperature=0, stream=True))
    next(running)  # the slot is taken
    waiter = threading.Thread(target=lambda: server.client.completions.create(
        model=server.model_id, prompt=[8, 9], max_tokens=2, temperature=0))
    waiter.start()
    try:
        deadline, load = time.monotonic() + 30, {}
        while load.get("num_waiting_reqs", 0) < 1:
            assert time.monotonic() < deadline, load
            with urllib.request.urlopen(server.url + "/get_load", timeout=10) as r:
                (load,) = json.loads(r.read())
    finally:
        for _ in running:
            pass
        waiter.join(timeout=60)
    assert (load["num_reqs"], load["num_waiting_reqs"]) == (2, 1), load
