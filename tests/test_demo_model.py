"""The embedded demo model: it ships with the package, and every tp size completes code identically."""

import subprocess
import sys
import zipfile

import pytest
import torch
from commands import cli
from transformers import AutoTokenizer

from autotp.cli import default_model
from autotp.generate import generate
from autotp.tokenizer import fim_prompt

SEED_PROMPT = "def print_hello_world():"
FIM = ("def add(a, b):\n    ", "\n    return c\n")


def greedy_completions(model_dir: str) -> dict:
    """Runs on every rank of a pool (and in-process for tp 1)."""
    import autotp

    model = autotp.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    out = {}
    for name, text in [("plain", SEED_PROMPT), ("fim", fim_prompt(tok, *FIM))]:
        ids = tok(text, return_tensors="pt").input_ids
        out[name] = generate(model, ids, max_new_tokens=24)[0, ids.shape[-1]:].tolist()
    return out


def test_demo_model_and_tokenizer_load_and_round_trip():
    tok = AutoTokenizer.from_pretrained(default_model())
    source = open(torch.__file__.replace("__init__.py", "functional.py")).read()[:5000]
    assert tok.decode(tok(source).input_ids) == source
    for special in ("<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"):
        assert special in tok.get_vocab()


@pytest.fixture(scope="module")
def tp1():
    return greedy_completions(default_model())


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 3, 4])
def test_demo_completions_are_identical_at_every_tp(pools, tp1, tp):
    results = pools(tp).run(greedy_completions, default_model())
    for r in results:
        assert r == tp1
    assert len(set(tp1["plain"])) > 3 and len(tp1["fim"]) > 0


def test_the_installed_wheel_finds_the_model(tmp_path):
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"),
                            str(__import__("pathlib").Path(__file__).parents[1])],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp_path / "dist").glob("autotp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"):
        assert f"autotp/demo_model/{f}" in names
    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                              str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    probe = ("import autotp, autotp.cli, transformers; d = autotp.cli.default_model(); "
             "print(autotp.__file__); print(transformers.AutoConfig.from_pretrained(d).model_type)")
    out = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(site)!r}); {probe}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    where, model_type = out.stdout.split()
    assert where.startswith(str(site)) and model_type == "gpt_bigcode"


def test_plan_without_model_shows_the_demo_partition(capsys):
    code, out, err = cli(capsys, "plan", "--tp", "5", "--json")
    assert code == 0, err
    report = __import__("json").loads(out)
    assert report["family"] == "gpt_bigcode" and report["checkpoint_headers"]
    assert [r["q_heads"] for r in report["ranks"]] == [[0, 3], [3, 6], [6, 8], [8, 10], [10, 12]]
