"""A sentencepiece model's completion keeps its first space, on every surface a client reads.

Llama-2's tokenizer layout (tests/sentencepiece_model.py: its decoder strips one leading space) on a tiny
random model whose greedy completion of `x = a` starts with `▁+`. The oracle is the tokenizer's own decode of
the prompt and the unsharded model's greedy tokens together, less the prompt's decode: ` + ...`, as vLLM,
TGI and OpenAI answer, where a completion decoded alone gives `+ ...` and an editor inserting it at the
cursor glues `a+`. Checked through the openai client (text, stream, echo, logprobs' tokens and text_offset,
stop strings, chat) and huggingface_hub's InferenceClient (TGI's /generate and /generate_stream) against a
2-rank `autotp serve`.
"""

from __future__ import annotations

import json

import pytest
import sentencepiece_model
import torch
from commands import cli
from fim_model import CHAT_TEMPLATE
from huggingface_hub import InferenceClient
from serve_harness import Server

from autotp.generate import generate

PROMPT = sentencepiece_model.PROMPT
N = 11  # tokens: the greedy completion's first 11 split no character over byte tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return sentencepiece_model.build(tmp_path_factory.mktemp("sp"), chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = Server(model_dir, tmp_path_factory.mktemp("serve") / "server.log")
    yield s
    s.kill()


@pytest.fixture(scope="module")
def unsharded(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)


def oracle(unsharded, prompt_ids: list[int], n: int = N) -> tuple[list[int], str]:
    """The unsharded model's greedy tokens, and decode(prompt + them) less decode(prompt)."""
    model, tok = unsharded
    new = generate(model, torch.tensor([prompt_ids]), max_new_tokens=n)[0, len(prompt_ids):].tolist()
    before, after = tok.decode(prompt_ids, skip_special_tokens=True), tok.decode(prompt_ids + new,
                                                                                 skip_special_tokens=True)
    assert after.startswith(before)
    return new, after[len(before):]


@pytest.fixture(scope="module")
def expected(unsharded):
    _, tok = unsharded
    ids, text = oracle(unsharded, tok(PROMPT).input_ids)
    # the case of the issue: the first token is `▁+`, which decoded alone loses its space
    assert tok.convert_ids_to_tokens(ids[0]) == "▁+" and text.startswith(" +") and "\ufffd" not in text
    assert tok.decode(ids, skip_special_tokens=True) == text[1:]  # what the server answered before
    return ids, text


def test_completions_text_stream_and_echo(server, expected):
    ids, text = expected
    create = server.client.completions.create
    out = create(model=server.model_id, prompt=PROMPT, max_tokens=N, temperature=0)
    assert out.choices[0].text == text  # ' + ...', the prompt and it join to decode(prompt + completion)
    chunks = list(create(model=server.model_id, prompt=PROMPT, max_tokens=N, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    echo = create(model=server.model_id, prompt=PROMPT, max_tokens=N, temperature=0, echo=True)
    assert echo.choices[0].text == PROMPT + text


def test_logprobs_tokens_join_to_the_text_at_their_offsets(server, expected, unsharded):
    ids, text = expected
    _, tok = unsharded
    out = server.client.completions.create(model=server.model_id, prompt=PROMPT, max_tokens=N, temperature=0,
                                           logprobs=2)
    lp = out.choices[0].logprobs
    assert lp.tokens[0] == " +" and "".join(lp.tokens) == out.choices[0].text == text
    assert [text[o:o + len(t)] for o, t in zip(lp.text_offset, lp.tokens, strict=True)] == lp.tokens
    assert all(t in top for t, top in zip(lp.tokens, lp.top_logprobs, strict=True))
    echo = server.client.completions.create(model=server.model_id, prompt=PROMPT, max_tokens=N, temperature=0,
                                            logprobs=1, echo=True)
    lp, full = echo.choices[0].logprobs, echo.choices[0].text
    assert lp.tokens[0] == tok.bos_token and "".join(lp.tokens[1:]) == full == PROMPT + text
    assert [full[o:o + len(t)] for o, t in zip(lp.text_offset[1:], lp.tokens[1:], strict=True)] == lp.tokens[1:]
    chunks = list(server.client.completions.create(model=server.model_id, prompt=PROMPT, max_tokens=N,
                                                   temperature=0, logprobs=1, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == echo.choices[0].logprobs.tokens[-N:]
    assert [o for s in streamed for o in s.text_offset] == out.choices[0].logprobs.text_offset


def test_a_stop_string_on_the_first_token(server, expected):
    """vLLM answers '' with finish_reason stop: ` +` is the first token's text, not only later ones'."""
    create = server.client.completions.create
    out = create(model=server.model_id, prompt=PROMPT, max_tokens=N, temperature=0, stop=[" +"])
    assert out.choices[0].text == "" and out.choices[0].finish_reason == "stop"
    chunks = list(create(model=server.model_id, prompt=PROMPT, max_tokens=N, temperature=0, stop=[" +"],
                         stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_chat_content_and_its_logprobs(server, unsharded):
    """One token: the random model's next ones after a chat prompt split characters over byte tokens."""
    _, tok = unsharded
    messages = [{"role": "user", "content": "y = a - b"}]
    ids, text = oracle(unsharded, tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                          return_dict=False), 1)
    assert tok.convert_ids_to_tokens(ids[0]).startswith("▁") and text.startswith(" ")
    chat = server.client.chat.completions.create(model=server.model_id, messages=messages, max_tokens=1,
                                                 temperature=0, logprobs=True, top_logprobs=2)
    assert chat.choices[0].message.content == text
    assert [t.token for t in chat.choices[0].logprobs.content] == [text]
    assert chat.choices[0].logprobs.content[0].bytes == list(text.encode())
    chunks = list(server.client.chat.completions.create(model=server.model_id, messages=messages, max_tokens=1,
                                                        temperature=0, stream=True, logprobs=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [t.token for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content] \
        == [text]


def test_tgi_generate_and_generate_stream(server, expected):
    ids, text = expected
    client = InferenceClient(base_url=server.url)
    out = client.text_generation(PROMPT, max_new_tokens=N, details=True, return_full_text=False)
    assert out.generated_text == text and [t.id for t in out.details.tokens] == ids
    assert "".join(t.text for t in out.details.tokens) == text
    assert client.text_generation(PROMPT, max_new_tokens=N) == PROMPT + text  # "/" prepends the prompt
    streamed = list(client.text_generation(PROMPT, max_new_tokens=N, stream=True, details=True,
                                           return_full_text=False))
    assert "".join(s.token.text for s in streamed) == streamed[-1].generated_text == text
    stopped = client.text_generation(PROMPT, max_new_tokens=N, stop=[" +"], details=True, return_full_text=False)
    assert stopped.generated_text == " +" and stopped.details.finish_reason == "stop_sequence"  # TGI keeps it


def test_generate_json_text_is_what_the_server_answers(model_dir, expected, capsys):
    """`autotp generate --json` writes the completion's text as the server answers it (README: temperature 0
    gives exactly generate's text)."""
    ids, text = expected
    code, out, err = cli(capsys, "generate", "--model", model_dir, "--prompt", PROMPT, "--max-new-tokens", str(N),
                         "--json")
    assert code == 0, err[-2000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["text"] == text and result["output_ids"][0][-N:] == ids
