"""The context rule (autotp.context.context_limit): --max-model-len, else the config's position limit, else the
tokenizer's model_max_length when it is real, else none; and what `autotp generate` says and refuses by it."""

from types import SimpleNamespace

import pytest
from checkpoints import word_tokenizer
from families import FAMILIES, config

from autotp.context import FROM_FLAG, FROM_TOKENIZER, context_limit
from autotp.errors import AutotpError

# the field each family's config keeps its position limit in (GPT-2-style configs map max_position_embeddings
# to n_positions); BLOOM has none
FIELDS = {"gpt2": "n_positions", "gptj": "n_positions", "codegen": "n_positions", "mpt": "max_seq_len",
          "bloom": None}
UNSET = int(1e30)  # what transformers puts in model_max_length when a tokenizer sets none


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_familys_config_gives_its_limit_or_none(name):
    field = FIELDS.get(name, "max_position_embeddings")
    limit, source = context_limit(config(name))
    if field is None:
        assert limit is None and source.startswith("bloom has no position limit in its config (n_positions, ")
    else:
        assert (limit, source) == (64, f"the config's {field}")


def test_the_tokenizers_model_max_length_counts_only_when_real_and_only_without_a_config_limit():
    bloom = config("bloom")
    assert context_limit(bloom, SimpleNamespace(model_max_length=2048)) == (2048, FROM_TOKENIZER)
    limit, source = context_limit(bloom, SimpleNamespace(model_max_length=UNSET))
    assert limit is None and source.endswith("and its tokenizer sets no model_max_length")
    assert context_limit(config("gpt2"), SimpleNamespace(model_max_length=1024)) == (64, "the config's n_positions")


def test_max_model_len_wins_but_not_past_the_configs_limit():
    assert context_limit(config("llama"), max_model_len=64) == (64, FROM_FLAG)
    assert context_limit(config("bloom"), SimpleNamespace(model_max_length=16), max_model_len=4096) == (4096, FROM_FLAG)
    with pytest.raises(AutotpError, match=r"^--max-model-len 65 exceeds the model's context of 64 positions "
                                          r"\(the config's max_seq_len\)$"):
        context_limit(config("mpt"), max_model_len=65)


def run_cli(capsys, *args) -> tuple[int, list[str]]:
    """`autotp ARGS` in this process (tp 1): its exit code and its stderr lines that start with "autotp:"."""
    from autotp.cli import main

    code = main(list(args))
    return code, [line for line in capsys.readouterr().err.splitlines() if line.startswith("autotp:")]


def test_generate_on_bloom_takes_max_model_len_or_the_tokenizers_limit(family_checkpoint, tmp_path, capsys):
    from transformers import AutoTokenizer

    model_dir, _ = family_checkpoint("bloom")
    prompt = ["--input-ids", "3,17,42,8,99,51,23", "--max-new-tokens", "4"]
    assert run_cli(capsys, "generate", "--model", model_dir, *prompt, "--max-model-len", "10") == (2, [
        "autotp: error: prompt of 7 tokens + 4 new tokens exceeds the model's context of 10 positions "
        "(--max-model-len)"])
    tok = AutoTokenizer.from_pretrained(word_tokenizer(tmp_path / "tok"))
    tok.model_max_length = 10
    tok.save_pretrained(tmp_path / "tok")
    words = ["--prompt", "w3 w17 w42 w8 w99 w51 w23", "--max-new-tokens", "4", "--tokenizer", str(tmp_path / "tok")]
    assert run_cli(capsys, "generate", "--model", model_dir, *words) == (2, [
        "autotp: context 10 tokens (the tokenizer's model_max_length)",
        "autotp: error: prompt of 7 tokens + 4 new tokens exceeds the model's context of 10 positions "
        "(the tokenizer's model_max_length)"])
    code, lines = run_cli(capsys, "generate", "--model", model_dir, *words, "--max-model-len", "11", "--json")
    assert (code, lines) == (0, [])  # above the tokenizer's advice is allowed, and said by nobody but the user


def test_generate_refuses_a_max_model_len_past_the_configs_limit(checkpoint, capsys):
    assert run_cli(capsys, "generate", "--model", checkpoint("mqa12")[0], "--input-ids", "1,2", "--max-model-len",
                   "100") == (2, ["autotp: error: --max-model-len 100 exceeds the model's context of 64 positions "
                                  "(the config's n_positions)"])
