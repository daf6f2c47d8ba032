"""llama-server's native protocol (serve/api/llama_api.py, llama_info.py) from its clients' side: llama.vim's
requests as a real Vim sent them and llama.vscode's as its source builds them, checked into rows and answered
in the shapes those plugins read; n_predict's edges, the sampling chain, /completion, /props, /tokenize,
/detokenize; and the line rules the engine applies (engine/text.py). In process: no server, no model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import fim_families
import fim_model
import pytest

from autotp import fim
from autotp.serve.api import llama_api, llama_info
from autotp.serve.api.boundary import ApiError, Served, prompt_budget
from autotp.serve.engine.text import indent_cut, past_deadline
from autotp.serve.types import Piece, Result

FIXTURES = Path(__file__).parent / "fixtures"
VIM = json.loads((FIXTURES / "llama_vim_requests.json").read_text())
VSCODE = json.loads((FIXTURES / "llama_vscode_requests.json").read_text())
CONTEXT = 512  # the demo model's
REAL_FILE = Path(__file__).parent.parent / "src" / "autotp" / "sampling" / "sampler.py"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo model's kind of tokenizer: StarCoder's FIM tokens, no repository tokens."""
    tok = fim_model.tokenizer(tmp_path_factory.mktemp("demo"))
    return Served("autotp-demo", tok, CONTEXT, 0, 4096, len(tok))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    tok = fim_families.tokenizer("qwen2.5-coder", tmp_path_factory.mktemp("qwen"))
    return Served("qwen-coder", tok, CONTEXT, 0, 4096, len(tok))


def vim_looks_at(answer: str) -> bool:
    """llama.vim's s:fim_on_response: an answer that fails this is dropped before it is parsed."""
    return re.match(r"^\s*\{", answer) is not None and re.search(r'"content"\s*:"', answer) is not None


def done(text: str = "    return a + b\n", tokens=(1, 2, 3, 4), reason: str = "stop", **kw) -> Result:
    return Result(text, reason, len(tokens), tuple(tokens), **({"cached_tokens": 0, "prompt_s": 0.5,
                                                                 "decode_s": 0.04} | kw))


def test_llama_vims_prepare_request_is_the_files_alone_and_answered_with_an_empty_object(demo):
    sent = VIM["requests"][1]  # the ring's two files, n_predict 0, response_fields [""]
    parsed = llama_api.parse_infill(sent["body"].encode(), demo)
    (row,) = parsed.rows
    body = json.loads(sent["body"])
    want = fim.fim_ids(demo.tokenizer, "", "", extra=[fim.Chunk(c["text"], c["filename"]) for c in body["input_extra"]])
    assert row.ids == want.ids and row.max_tokens == 1  # the engine samples one token; the answer leaves it out
    answer = parsed.answer.body("c", parsed.rows, [done(cached_tokens=0)], len(row.ids))
    assert llama_api.compact(answer) == "{}"  # what llama-server answers to response_fields [""]; Vim ignores it


@pytest.mark.parametrize("index", [2, 3, 4, 5])
def test_llama_vims_completions_are_answered_in_the_shape_vim_shows(demo, index):
    sent = VIM["requests"][index]
    body = json.loads(sent["body"])
    parsed = llama_api.parse_infill(sent["body"].encode(), demo)
    (row,) = parsed.rows
    extra = [fim.Chunk(c["text"], c["filename"]) for c in body["input_extra"]]
    want = fim.fim_ids(demo.tokenizer, body["input_prefix"] + body["prompt"], body["input_suffix"], extra=extra,
                       budget=prompt_budget(CONTEXT, 128))
    assert row.ids == want.ids and row.max_tokens == 128
    # samplers ["top_k", "top_p", "infill"]: no temperature in llama.cpp's chain, so tokens are drawn at 1.0
    assert (row.temperature, row.top_k, row.top_p) == (1.0, 40, 0.9)
    assert (row.indent, row.newline_deadline_s) == (body["n_indent"], body["t_max_predict_ms"] / 1000)
    assert row.stop_ids == fim.stop_ids(demo.tokenizer)

    answer = llama_api.compact(parsed.answer.body("c", parsed.rows, [done(cached_tokens=20)], len(row.ids)))
    assert vim_looks_at(answer)
    got = json.loads(answer)
    assert list(got) == [f for f in body["response_fields"]]  # each field asked for, flattened, in its order
    assert got["content"] == "    return a + b\n" and got["tokens_cached"] == 20 and got["truncated"] is False
    assert got["timings/prompt_n"] == len(row.ids) - 20 and got["timings/predicted_n"] == 4
    assert got["timings/prompt_ms"] == 500.0 and got["timings/predicted_per_second"] == pytest.approx(100.0)


def test_the_answer_vim_showed_passes_vims_check_and_a_spaced_one_does_not():
    """The negative control of vim_looks_at: the fixture's answer was shown by a real Vim, the same JSON with
    json.dumps' default spacing was dropped by it."""
    assert vim_looks_at(VIM["answer_shown"])
    assert not vim_looks_at(json.dumps(json.loads(VIM["answer_shown"])))


def test_llama_vim_sends_an_empty_key_and_an_empty_model_which_change_nothing(demo):
    assert {r["authorization"] for r in VIM["requests"]} == {"Bearer "}
    assert all(json.loads(r["body"])["model"] == "" for r in VIM["requests"])
    assert all(isinstance(c["time"], list) and len(c["time"]) == 2  # [seconds, microseconds]
               for r in VIM["requests"] for c in json.loads(r["body"])["input_extra"])


def test_llama_vscodes_three_completions_share_one_prompt_and_come_back_as_an_array(demo):
    sent = VSCODE["requests"][1]
    parsed = llama_api.parse_infill(sent["body"].encode(), demo)
    assert len(parsed.rows) == 3 and len({r.ids for r in parsed.rows}) == 1  # one prompt, computed once
    assert len({r.seed for r in parsed.rows}) == 3  # seed left out: three random draws, seed, seed + 1, seed + 2
    assert (parsed.rows[0].temperature, parsed.rows[0].top_p) == (1.0, 0.99)
    results = [done("a"), done("b", cached_tokens=len(parsed.rows[0].ids)), done("a")]
    answer = parsed.answer.body("c", parsed.rows, results, 0)
    assert isinstance(answer, list) and [a["index"] for a in answer] == [0, 1, 2]
    for item in answer:  # what llama.vscode's statusbar and completion read
        assert {"content", "tokens_cached", "truncated", "generation_settings", "timings"} <= set(item)
        assert item["generation_settings"]["n_ctx"] == CONTEXT
        assert {"prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms",
                "predicted_per_second"} <= set(item["timings"])
    # all of its prompt from the cache: llama-server divides 500 ms by 0 tokens and writes the inf as null
    assert answer[1]["timings"]["prompt_n"] == 0 and answer[1]["timings"]["prompt_per_token_ms"] is None


def test_llama_vscodes_prepare_and_whitespace_line_requests(demo):
    prepare, _, continuation, blank = (llama_api.parse_infill(r["body"].encode(), demo) for r in VSCODE["requests"])
    assert len(prepare.rows) == 1 and prepare.rows[0].max_tokens == 1
    assert prepare.answer.body("c", prepare.rows, [done()], 0)["content"] == ""  # n_predict 0: nothing generated
    assert continuation.rows[0].indent == 4 and blank.rows[0].indent == 0  # n_indent left out when it is 0


def test_what_the_prepare_request_computes_is_where_the_next_completion_starts(demo):
    """llama.vim's prepare request exists so that the next completion finds the files computed: its prompt and
    the completion's share the files' tokens (tokens_cached then counts them: the engine's prefix cache)."""
    prepare, completion = (llama_api.parse_infill(VIM["requests"][i]["body"].encode(), demo) for i in (0, 2))
    body = json.loads(VIM["requests"][0]["body"])
    files = fim.fim_ids(demo.tokenizer, "", "", extra=[fim.Chunk(c["text"], c["filename"]) for c in
                                                       body["input_extra"]])
    shared = files.context_tokens
    assert shared > 0 and prepare.rows[0].ids[:shared] == completion.rows[0].ids[:shared]


def test_a_real_file_larger_than_the_context_is_answered_truncated(demo):
    text = REAL_FILE.read_text()
    middle = len(text) // 2
    body = {"input_prefix": text[:middle], "input_suffix": text[middle:], "prompt": "", "n_predict": 60,
            "response_fields": ["content", "truncated"]}
    parsed = llama_api.parse_infill(json.dumps(body).encode(), demo)
    (row,) = parsed.rows
    assert len(row.ids) == prompt_budget(CONTEXT, 60) and row.max_tokens == 60
    kept = demo.tokenizer.decode(row.ids)
    assert kept.startswith("<fim_prefix>") and kept.endswith("<fim_middle>")
    before, after = kept[len("<fim_prefix>"):-len("<fim_middle>")].split("<fim_suffix>")
    assert text[:middle].endswith(before) and text[middle:].startswith(after)  # the text nearest the cursor
    assert parsed.answer.body("c", parsed.rows, [done()], 0) == {"content": "    return a + b\n", "truncated": True}


def test_n_predict_larger_than_the_room_generates_what_fits(demo):
    body = {"input_prefix": "def add(a, b):\n", "input_suffix": "", "n_predict": 4096}  # Continue's max_tokens
    parsed = llama_api.parse_infill(json.dumps(body).encode(), demo)
    (row,) = parsed.rows
    assert row.max_tokens == CONTEXT - len(row.ids)  # not a 400: the room the prompt leaves
    full = done("x" * 3, tokens=range(row.max_tokens), reason="length")
    item = parsed.answer.body("c", parsed.rows, [full], 0)
    assert (item["truncated"], item["stop_type"]) == (True, "limit")  # llama-server's: the context ran out
    assert parsed.answer.body("c", parsed.rows, [done()], 0)["truncated"] is False


def test_n_predict_minus_one_is_as_many_as_fit_and_below_is_refused(demo):
    parsed = llama_api.parse_infill(b'{"input_prefix": "a = ", "input_suffix": "", "n_predict": -1}', demo)
    assert parsed.rows[0].max_tokens == CONTEXT - len(parsed.rows[0].ids)
    with pytest.raises(ApiError, match="n_predict must be -1"):
        llama_api.parse_infill(b'{"input_prefix": "a", "input_suffix": "", "n_predict": -2}', demo)


def test_a_model_without_fim_tokens_is_refused_with_what_it_lacks(tmp_path):
    tok = fim_families.tokenizer("plain", tmp_path)
    plain = Served("smollm2", tok, CONTEXT, 0, 4096, len(tok))
    with pytest.raises(ApiError) as e:
        llama_api.parse_infill(VIM["requests"][2]["body"].encode(), plain)
    assert e.value.status == 501 and "<fim_prefix>" in e.value.message and "<|file_sep|>" in e.value.message
    assert llama_api.error_body(e.value)["error"]["type"] == "not_supported_error"


def test_qwen_gets_its_repository_format_from_an_infill_request(qwen):
    body = json.loads(VIM["requests"][4]["body"])
    row = llama_api.parse_infill(VIM["requests"][4]["body"].encode(), qwen).rows[0]
    text = qwen.tokenizer.decode(row.ids)
    chunk = body["input_extra"][0]
    assert text.startswith(f"<|file_sep|>{chunk['filename']}\n{chunk['text']}\n<|file_sep|>\n<|fim_prefix|>")
    assert fim.token_id(qwen.tokenizer, "<|file_sep|>") in row.stop_ids


@pytest.mark.parametrize("extra, want", [
    ({}, (0.8, 40, 0.95)),  # llama-server's defaults, its default chain
    ({"samplers": ["top_k", "temperature"], "temperature": 0.2, "top_p": 0.5}, (0.2, 40, 1.0)),  # top_p not chained
    ({"samplers": "kt", "temperature": 0.3}, (0.3, 40, 1.0)),  # the chain as letters
    ({"temperature": -1}, (0.0, 40, 0.95)),  # below 0: greedy
    ({"top_p": 0}, (0.0, 40, 1.0)),  # top-p keeps one token at least: greedy
    ({"samplers": [], "temperature": 0.0}, (1.0, 0, 1.0)),  # llama.vim's prepare: an empty chain draws at 1.0
])
def test_the_sampling_chain_decides_what_applies(demo, extra, want):
    row = llama_api.parse_completion(json.dumps({"prompt": "a", "n_predict": 1} | extra).encode(), demo).rows[0]
    assert (row.temperature, row.top_k, row.top_p) == want


def test_samplers_autotp_lacks_are_accepted_only_where_they_change_nothing(demo):
    ok = {"prompt": "a", "min_p": 0.05, "samplers": ["top_k", "temperature"], "cache_prompt": False, "id_slot": 3,
          "t_max_prompt_ms": 500, "n_keep": 10, "some_future_field": [1]}
    llama_api.parse_completion(json.dumps(ok).encode(), demo)  # min_p is not in the chain; the rest change nothing
    for field, value in [("min_p", 0.05), ("repeat_penalty", 1.1), ("mirostat", 2), ("lora", [{"id": 0, "scale": 1}]),
                         ("grammar", "root ::= \"a\"")]:
        with pytest.raises(ApiError, match=f"^{field}.* not supported"):
            llama_api.parse_completion(json.dumps({"prompt": "a", field: value}).encode(), demo)


def test_seed_minus_one_is_random_and_a_seed_is_kept(demo):
    rows = [llama_api.parse_completion(b'{"prompt": "a", "seed": -1}', demo).rows[0] for _ in range(3)]
    assert len({r.seed for r in rows}) == 3
    assert llama_api.parse_completion(b'{"prompt": "a", "seed": 7, "n_cmpl": 2}', demo).rows[1].seed == 8


def test_completion_of_a_plain_prompt_is_whole_or_refused_as_llama_server_does(demo):
    parsed = llama_api.parse_completion(b'{"prompt": "def add(a, b):", "n_predict": 9999}', demo)
    assert parsed.rows[0].max_tokens == CONTEXT - len(parsed.rows[0].ids)
    long = json.dumps({"prompt": REAL_FILE.read_text()}).encode()
    with pytest.raises(llama_api.ContextFull) as e:
        llama_api.parse_completion(long, demo)
    error = llama_api.error_body(e.value)["error"]
    assert error["type"] == "exceed_context_size_error" and error["code"] == 400 and error["n_ctx"] == CONTEXT
    assert error["n_prompt_tokens"] > CONTEXT


def test_completion_of_a_prompt_in_fim_form_is_cut_as_infill_is(demo):
    text = REAL_FILE.read_text()
    prompt = f"<fim_prefix>{text[:3000]}<fim_suffix>{text[3000:]}<fim_middle>"  # Continue's llama.cpp template
    parsed = llama_api.parse_completion(json.dumps({"prompt": prompt, "n_predict": 4096}).encode(), demo)
    (row,) = parsed.rows
    assert len(row.ids) == prompt_budget(CONTEXT, 4096) and row.max_tokens == CONTEXT - len(row.ids)
    assert parsed.answer.body("c", parsed.rows, [done()], 0)["truncated"] is True


def test_several_prompts_are_an_array_and_ids_are_a_prompt(demo):
    parsed = llama_api.parse_completion(b'{"prompt": ["a", [5, 6, 7]], "n_predict": 2}', demo)
    assert [r.ids for r in parsed.rows][1] == (5, 6, 7)
    assert len(parsed.answer.body("c", parsed.rows, [done(), done()], 0)) == 2
    with pytest.raises(ApiError, match="not in the vocabulary"):
        llama_api.parse_completion(b'{"prompt": [5, 99999]}', demo)


def test_a_stream_sends_each_token_then_the_final_object(demo):
    body = {"prompt": "def add(a, b):", "n_predict": 3, "stream": True, "response_fields": ["content", "stop",
                                                                                           "timings/predicted_n"]}
    parsed = llama_api.parse_completion(json.dumps(body).encode(), demo)
    answer, rows = parsed.answer, parsed.rows
    assert parsed.stream and answer.start("c", rows) == []
    events = answer.piece("c", 0, Piece(7, "\n ", False)) + answer.piece("c", 0, Piece(8, "", False)) + \
        answer.piece("c", 0, Piece(9, " x", False))
    assert [(e["content"], e["tokens"], e["tokens_predicted"], e["stop"]) for e in events] == \
        [("\n ", [7], 1, False), (" x", [8, 9], 3, False)]  # a held-back token's id comes with the next text
    (last,) = answer.finish("c", 0, done("\n  x", tokens=(7, 8, 9), reason="length"))
    assert last == {"content": "", "stop": True, "timings/predicted_n": 3}  # the text went in the events
    assert answer.end("c", [], 0) == []  # no [DONE], as llama-server's own stream


def test_a_prepare_request_streams_nothing_but_its_final_object(demo):
    parsed = llama_api.parse_infill(b'{"input_prefix": "", "input_suffix": "", "n_predict": 0, "stream": true}', demo)
    assert parsed.answer.start("c", parsed.rows) == [] and parsed.answer.piece("c", 0, Piece(5, "x", False)) == []
    (last,) = parsed.answer.finish("c", 0, done("x", tokens=(5,), reason="length"))
    assert last["tokens_predicted"] == 0 and last["timings"]["predicted_n"] == 0


def test_the_answer_cuts_at_n_indent_where_the_engine_did_not(demo):
    body = {"input_prefix": "def add(a, b):\n", "input_suffix": "", "prompt": "    ", "n_indent": 4}
    parsed = llama_api.parse_infill(json.dumps(body).encode(), demo)
    text = "return a + b\n    # done\nprint(add(1, 2))\n"
    item = parsed.answer.body("c", parsed.rows, [done(text, reason="length")], 0)
    assert (item["content"], item["stop_type"]) == ("return a + b\n    # done\n", "limit")


@pytest.mark.parametrize("text, indent, cut", [
    ("return a\n    b = 1\nc = 2\n", 4, len("return a\n    b = 1\n")),  # the dedented line goes
    ("x\n\ty\n", 2, len("x\n\t")),  # a tab is one column: the line's blanks stay, its text goes
    ("x\n\n    y\n", 4, len("x\n")),  # an empty line ends it (its newline is the first character)
    ("x\n    y\n  ", 4, None),  # a line of blanks so far is not judged yet
    ("no newline at all", 8, None),  # the cursor's own line is never judged
    ("x\ny\n", 0, None),  # 0: off
])
def test_indent_cut_is_llama_servers_n_indent(text, indent, cut):
    assert indent_cut(text, indent) == cut


def test_past_deadline_looks_only_at_a_token_with_a_newline():
    assert past_deadline("x\n", 0.3, 0.25) and not past_deadline("x", 0.3, 0.25)
    assert not past_deadline("\n", 0.2, 0.25) and not past_deadline("\n", 9.0, 0.0)


def test_props_tokenize_and_detokenize(demo):
    props = llama_info.props(demo, slots=8, version="0.0")
    assert props["default_generation_settings"]["n_ctx"] == CONTEXT and props["total_slots"] == 8
    ids = demo.tokenizer("def add(a, b):", add_special_tokens=False).input_ids
    assert llama_info.tokenize(b'{"content": "def add(a, b):"}', demo) == {"tokens": ids}
    both = llama_info.tokenize(b'{"content": ["<fim_prefix>", 5]}', demo)["tokens"]
    assert both == [fim.token_id(demo.tokenizer, "<fim_prefix>"), 5]  # parse_special, mixed ids
    split = llama_info.tokenize(b'{"content": "<fim_prefix>", "parse_special": false}', demo)["tokens"]
    assert len(split) > 1
    pieces = llama_info.tokenize('{"content": "é x<fim_suffix>", "with_pieces": true}'.encode(), demo)["tokens"]
    assert [p["piece"] for p in pieces] == [[0xC3], [0xA9], " x", "<fim_suffix>"]  # half a character: its byte
    assert llama_info.detokenize(json.dumps({"tokens": ids}).encode(), demo) == {"content": "def add(a, b):"}
    with pytest.raises(ApiError, match="not in the vocabulary"):
        llama_info.detokenize(b'{"tokens": [-1]}', demo)


def test_errors_have_llama_servers_shape():
    error = llama_api.error_body(ApiError(400, "bad"))
    assert error == {"error": {"code": 400, "message": "bad", "type": "invalid_request_error"}}
    assert llama_api.error_body(ApiError(404, "no"))["error"]["type"] == "not_found_error"


def test_a_megabyte_before_the_cursor_is_cut_before_it_is_tokenized(demo):
    prefix = "total += step\n" * 100_000  # 1.4 MB, some 100 times what the context could hold
    body = {"input_prefix": prefix, "input_suffix": "print(total)\n", "n_predict": 32,
            "input_extra": [{"text": "step = 2\n" * 50_000, "filename": "old.py"}, {"text": "x = 1\n"}]}
    parsed = llama_api.parse_infill(json.dumps(body).encode(), demo)
    (row,) = parsed.rows
    assert len(row.ids) == prompt_budget(CONTEXT, 32) and parsed.answer.fits[0].truncated
    assert demo.tokenizer.decode(row.ids).split("<fim_suffix>")[0].endswith("total += step\n")
