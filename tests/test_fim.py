"""fim.py: each family's documented FIM format token by token, the format read from the tokenizer, a tokenizer
without FIM tokens refused, and a real file larger than the context cut to the text nearest the cursor."""

from __future__ import annotations

import json
from pathlib import Path

import fim_families
import pytest

from autotp import fim
from autotp.errors import AutotpError
from autotp.serve.api.boundary import prompt_budget
from autotp.tokenizer import fim_prompt

# the file the editor had open
REAL_FILE = Path(__file__).parent.parent / "src" / "autotp" / "sampling" / "sampler.py"

# Two other files and the one being edited, written so that each piece starts with a non-space character: there,
# tokenizing the pieces one by one (as fim.py and llama-server do) gives the tokens of the whole documented string.
LIBRARY = "class Book:\n    def __init__(self, title):\n        self.title = title\n"
STUDENT = "class Student:\n    def borrow(self, book):\n        return book\n"
PREFIX = "from library import Book\n\nbook = Book("
SUFFIX = ")\nprint(book.title)\n"
EXTRA = (fim.Chunk(LIBRARY, "library.py"), fim.Chunk(STUDENT, "student.py"))

# What each family's authors document, filled in with the pieces above (the sources are cited in fim.py): the
# repository context (the same whatever the cursor's text), then the edited file
DOCUMENTED = {
    # Qwen2.5-Coder Technical Report, Figure 4: a line per repository and per path, a newline after each file
    "qwen2.5-coder": (f"<|repo_name|>library-system\n<|file_sep|>library.py\n{LIBRARY}\n<|file_sep|>student.py\n"
                      f"{STUDENT}\n",
                      f"<|file_sep|>main.py\n<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>"),
    # StarCoder 2 paper, section 5.1: no newline after the repository name or a file, the path inside <fim_prefix>
    "starcoder2": (f"<repo_name>library-system<file_sep>library.py\n{LIBRARY}<file_sep>student.py\n{STUDENT}",
                   f"<file_sep><fim_prefix>main.py\n{PREFIX}<fim_suffix>{SUFFIX}<fim_middle>"),
    # StarCoder paper, section 5.1: each file a document with its metadata, ended by <|endoftext|>; FIM around the
    # edited document, metadata included
    "starcoder": (f"<reponame>library-system<filename>library.py\n{LIBRARY}<|endoftext|>"
                  f"<reponame>library-system<filename>student.py\n{STUDENT}<|endoftext|>",
                  f"<fim_prefix><reponame>library-system<filename>main.py\n{PREFIX}<fim_suffix>{SUFFIX}<fim_middle>"),
}
LAYOUT = {"qwen2.5-coder": "Qwen2.5-Coder", "starcoder2": "StarCoder2", "starcoder": "StarCoder"}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    return {f: fim_families.tokenizer(f, tmp_path_factory.mktemp(f)) for f in fim_families.FAMILIES}


def whole(tokenizer, text: str) -> list[int]:
    """The documented string tokenized in one piece, its sentinels recognized."""
    return tokenizer(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("family", list(DOCUMENTED))
def test_repo_level_prompt_is_the_familys_documented_format_token_by_token(tokenizers, family):
    tok = tokenizers[family]
    assert fim.layout_of(tok).name == LAYOUT[family]
    context, frame = DOCUMENTED[family]
    built = fim.fim_ids(tok, PREFIX, SUFFIX, extra=EXTRA, repo="library-system", path="main.py")
    assert list(built.ids) == whole(tok, context + frame)
    assert not built.truncated and built.chunks_kept == 2
    assert list(built.ids[:built.context_tokens]) == whole(tok, context)


@pytest.mark.parametrize("family", list(DOCUMENTED))
def test_without_context_every_family_gets_the_file_level_prompt(tokenizers, family):
    tok = tokenizers[family]
    pre, suf, mid = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>") if family == "qwen2.5-coder" else \
        ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")
    text = fim_prompt(tok, PREFIX, SUFFIX)  # what `autotp generate --suffix` and OpenAI's suffix send
    assert text == f"{pre}{PREFIX}{suf}{SUFFIX}{mid}"
    assert list(fim.fim_ids(tok, PREFIX, SUFFIX).ids) == tok(text).input_ids


def test_the_demo_models_tokenizer_puts_other_files_in_documents_of_their_own(tokenizers, tmp_path):
    import fim_model  # StarCoder's FIM tokens, but neither <reponame> nor <filename>, like the demo model's

    tok = fim_model.tokenizer(tmp_path)
    built = fim.fim_ids(tok, PREFIX, SUFFIX, extra=EXTRA, repo="library-system", path="main.py")
    assert list(built.ids) == whole(tok, f"{LIBRARY}<|endoftext|>{STUDENT}<|endoftext|>"
                                         f"<fim_prefix>{PREFIX}<fim_suffix>{SUFFIX}<fim_middle>")


def test_a_tokenizer_without_fim_tokens_is_refused_naming_what_it_lacks(tokenizers):
    plain = tokenizers["plain"]
    with pytest.raises(fim.FimError) as e:
        fim.fim_ids(plain, PREFIX, SUFFIX)
    for token in ("<|fim_prefix|>", "<|file_sep|>", "<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>",
                  "(Qwen2.5-Coder)", "(StarCoder2, StarCoder)", "<file_sep> (StarCoder2)"):
        assert str(e.value).count(token) == 1, token  # StarCoder's three tokens are StarCoder2's too: said once
    with pytest.raises(AutotpError, match="^--suffix needs fill-in-the-middle tokens: this tokenizer has none"):
        fim_prompt(plain, "a", "b")


def test_code_that_spells_a_sentinel_stays_code(tokenizers):
    tok = tokenizers["starcoder"]
    mid = fim.token_id(tok, "<fim_middle>")
    ids = fim.fim_ids(tok, 'x = "<fim_middle>"\n', "").ids
    assert ids.count(mid) == 1 and ids[-1] == mid


def test_stop_ids_are_the_formats_sentinels_the_tokenizer_has(tokenizers):
    tok = tokenizers["qwen2.5-coder"]
    names = {tok.convert_ids_to_tokens(i) for i in fim.stop_ids(tok)}
    assert names == {"<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>", "<|repo_name|>"}


def test_a_real_file_larger_than_the_context_keeps_the_text_nearest_the_cursor(tokenizers):
    tok = tokenizers["starcoder2"]
    text = REAL_FILE.read_text()
    cursor = len(text) // 2
    prefix, suffix = text[:cursor], text[cursor:]
    pre_ids, suf_ids = tok(prefix, add_special_tokens=False).input_ids, tok(suffix, add_special_tokens=False).input_ids
    budget = prompt_budget(512, 60)  # a 512-token context, an editor asking for 60 tokens
    assert len(pre_ids) + len(suf_ids) > 4 * 512  # the file is far larger than the context

    built = fim.fim_ids(tok, prefix, suffix, extra=EXTRA, budget=budget)
    assert built.truncated and len(built.ids) == budget and built.chunks_kept == 0
    ids = list(built.ids)
    at_suf, at_mid = ids.index(fim.token_id(tok, "<fim_suffix>")), ids.index(fim.token_id(tok, "<fim_middle>"))
    # the frame is whole: <file_sep><fim_prefix>\n (an /infill request names no path), then the cut pieces
    head = whole(tok, "<file_sep><fim_prefix>\n")
    assert ids[:len(head)] == head and at_mid == len(ids) - 1
    kept_pre, kept_suf = ids[len(head):at_suf], ids[at_suf + 1:at_mid]
    room = budget - len(head) - 2
    assert (len(kept_pre), len(kept_suf)) == (room - room // 4, room // 4)  # the suffix is sure of a quarter
    assert kept_pre == pre_ids[-len(kept_pre):] and kept_suf == suf_ids[:len(kept_suf)]  # nearest the cursor
    assert prefix.endswith(tok.decode(kept_pre)) and suffix.startswith(tok.decode(kept_suf))


def test_a_short_side_leaves_its_share_to_the_other(tokenizers):
    tok = tokenizers["starcoder"]
    long = REAL_FILE.read_text()
    built = fim.fim_ids(tok, "x = (", long, budget=200)
    pre, suf, mid = (fim.token_id(tok, t) for t in ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))
    short = tok("x = (", add_special_tokens=False).input_ids
    assert built.ids[:len(short) + 2] == (pre, *short, suf)
    assert len(built.ids) == 200 and built.ids[-1] == mid  # the suffix took all the prefix left


def test_other_files_get_what_is_left_newest_first_and_whole(tokenizers):
    tok = tokenizers["qwen2.5-coder"]
    files = [fim.Chunk(f"def f{i}():\n    return {i}\n", f"f{i}.py") for i in range(6)]
    sizes = [len(whole(tok, f"<|file_sep|>{c.path}\n{c.text}\n")) for c in files]
    alone = fim.fim_ids(tok, PREFIX, SUFFIX, path="main.py")
    budget = len(alone.ids) + sizes[5] + sizes[4] + sizes[3] // 2  # room for two files and half of a third
    built = fim.fim_ids(tok, PREFIX, SUFFIX, extra=files, path="main.py", budget=budget)
    assert built.truncated and built.chunks_kept == 2 and len(built.ids) == len(alone.ids) + sizes[5] + sizes[4]
    text = tok.decode(built.ids)
    assert "f4.py" in text and "f5.py" in text and "f3.py" not in text and "f0.py" not in text
    assert text.index("f4.py") < text.index("f5.py")  # oldest first, as sent


def test_what_a_prepare_request_computes_is_the_start_of_the_next_prompt(tokenizers):
    """llama.vim sends the files alone every second (empty prefix and suffix) so that the next completion finds
    them computed: the two prompts share their first context_tokens tokens."""
    tok = tokenizers["qwen2.5-coder"]
    prepare = fim.fim_ids(tok, "", "", extra=EXTRA)
    complete = fim.fim_ids(tok, PREFIX, SUFFIX, extra=EXTRA)
    assert prepare.context_tokens == complete.context_tokens > 0
    assert prepare.ids[:prepare.context_tokens] == complete.ids[:complete.context_tokens]


def test_a_frame_longer_than_the_budget_is_refused(tokenizers):
    with pytest.raises(fim.FimError, match=r"frame alone is \d+ tokens, more than the 3 the prompt may take"):
        fim.fim_ids(tokenizers["starcoder2"], "a", "b", path="main.py", budget=3)


def test_a_prompt_written_in_fim_form_splits_back_into_its_pieces(tokenizers):
    tok = tokenizers["starcoder"]
    sent = f"<fim_prefix>{PREFIX}<fim_suffix>{SUFFIX}<fim_middle>"  # llm-vscode's, Continue's openai template
    split = fim.split_fim(tok, sent)
    assert split == fim.Split("", PREFIX, SUFFIX)
    assert list(fim.fim_ids(tok, split.prefix, split.suffix, lead=split.lead).ids) == tok(sent).input_ids
    lead = "<filename>main.py\n"  # a client's own metadata before the frame stays whole, sentinels and all
    split = fim.split_fim(tok, lead + sent)
    assert split.lead == lead and list(fim.fim_ids(tok, split.prefix, split.suffix, lead=split.lead).ids) == \
        tok(lead + sent).input_ids
    assert fim.split_fim(tok, "def add(a, b):") is None  # not FIM
    assert fim.split_fim(tok, sent + "    return") is None  # its middle already begun: not cut
    assert fim.split_fim(tokenizers["plain"], sent) is None


def test_openai_suffix_still_gets_the_prompt_it_got(tmp_path):
    """OpenAI's `suffix` (through boundary.fit_fim now) tokenizes to the ids the whole text tokenized to before fim.py:
    StarCoder's three tokens around the prompt and the suffix."""
    import fim_model

    from autotp.serve.api.boundary import Served
    from autotp.serve.api.openai_api import parse_completion

    tok = fim_model.tokenizer(tmp_path)
    served = Served("demo", tok, 512, 0, 4096, len(tok))
    body = {"model": "demo", "prompt": "def add(a, b):\n    ", "suffix": "\n    return c\n", "max_tokens": 16}
    (row,) = parse_completion(json.dumps(body).encode(), served).rows
    assert list(row.ids) == tok("<fim_prefix>def add(a, b):\n    <fim_suffix>\n    return c\n<fim_middle>").input_ids
    assert row.max_tokens == 16 and row.stop_ids == fim.stop_ids(tok)
