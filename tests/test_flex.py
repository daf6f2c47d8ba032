"""The flex attention backend from the user's side: `autotp serve --attention flex` answers with HF's greedy
tokens, the engine under flex gives HF `generate`'s tokens for the families whose attention is unusual (ALiBi
from either end, soft-capping and a sliding window, grouped-query), and the choice of backend fails in one line
where it cannot be served. The attention function alone against dense attention: test_attention.py.
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import word_tokenizer
from engine_driver import drive, engine_for, job, tokens_of
from families import any_model
from serve_harness import Server

from autotp.errors import AutotpError
from autotp.generate import generate
from autotp.serve.engine.scheduler import Limits
from autotp.serve.runner.attention import flex
from autotp.serve.runner.attention.backends import choose
from autotp.serve.runner.attention.flex import Flex
from autotp.serve.runner.attention.sdpa import Sdpa


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(word_tokenizer(tmp_path_factory.mktemp("words")))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("name", ["gemma2", "mpt"])
def test_the_engine_under_flex_gives_hf_generates_greedy_tokens(name, tokenizer):
    """Gemma 2 (grouped-query, soft-capping, a sliding window of 4) and MPT (ALiBi from the last key; BLOOM's
    from the first is in test_attention.py): two rows decoding while a 13-token prompt arrives (decode rows and a
    prefill chunk in one step), then that prompt extended, served partly from the prefix cache. Every row's
    tokens are HF generate's of its prompt alone. Few steps: eager flex on CPU is slow (~0.1 s a call here)."""
    model = any_model(name)
    # a pool of 512 slots: eager flex (CPU) scores every query against the whole pool
    engine = engine_for(model, tokenizer, Limits(16, 2048, 512), attention="flex")
    g = torch.Generator().manual_seed(1)
    rows = [job(torch.randint(0, 101, (n,), generator=g).tolist(), 6, index=i) for i, n in enumerate((4, 5, 13))]
    drive(engine, {0: rows[:2], 2: rows[2:]})
    again = job([*rows[2].row.ids, 7, 8], 4, index=3)
    drive(engine, {0: [again]})
    for j in [*rows, again]:
        want = generate(model, torch.tensor([j.row.ids]), max_new_tokens=len(tokens_of(j.ended)))
        assert tokens_of(j.ended) == want[0, len(j.row.ids):].tolist()


def test_autotp_serve_with_attention_flex_says_so_and_answers_as_hf(tmp_path):
    """One process, as a user starts it; the demo model. Its start-up line names the backend, and a greedy
    completion's tokens are HF generate's."""
    from autotp.cli import default_model
    from autotp.tokenizer import load_tokenizer

    server = Server(None, tmp_path / "server.log", "--attention", "flex", "--kv-cache-memory", "2MiB",
                    torchrun=False)
    try:
        assert "attention: flex on cpu (one eager flex_attention call per layer and step" in server.text()
        prompt = [5, 17, 99, 3, 42, 8]
        got = server.post({"model": server.model_id, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                           "logprobs": 0})[1]
    finally:
        server.kill()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model()).eval()
    want = generate(model, torch.tensor([prompt]), max_new_tokens=12)[0, len(prompt):].tolist()
    tok = load_tokenizer(default_model(), missing="{source} {cause}")
    assert got["choices"][0]["text"] == tok.decode(want)


def test_the_backend_is_refused_in_one_line_where_it_cannot_serve(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose("flex", cpu, 12) is Flex and choose("sdpa", cuda, 12) is Sdpa
    with pytest.raises(AutotpError, match="^--attention flex on CUDA needs --block-size a power of two of at least "
                                          "16, not 24$"):
        choose("flex", cuda, 24)
    monkeypatch.setattr(flex, "flex_attention", None)  # a torch before 2.5
    with pytest.raises(AutotpError, match=r"^--attention flex needs torch.nn.attention.flex_attention, which torch "
                                          r"\S+ lacks \(2.5 or later\): use --attention sdpa$"):
        choose("flex", cpu, 16)


def test_the_command_line_offers_every_backend_of_the_table_and_the_default_first():
    """cli.py names the backends without importing torch (for --help): the names are the table's, in its order."""
    from autotp import cli
    from autotp.serve.runner.attention.backends import BACKENDS

    assert cli.ATTENTION == tuple(BACKENDS)
