"""The command line's own mistakes, as a user makes them: an abbreviated or mistyped flag, `--help` without the
defaults, a pipeline the model's config.json refuses (refused before torch is imported and before any rank starts,
under `--tp N` and under torchrun, checked by what the process imported, not by time), int4 at a tp it does not
fit, and the package's metadata."""

import json
import os
import subprocess
import sys
from pathlib import Path

import families
import pytest
from commands import autotp, cli, error_lines, torchrun

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "src" / "autotp" / "demo_model"  # 4 decoder layers, 12 query heads, n_embd 288
# what refusing a pipeline must not import: torch itself, a family's model code, a rank's launch
HEAVY = ("torch", "transformers.models.gpt_bigcode.modeling_gpt_bigcode", "torch.distributed.launcher.api")
SUM = "--pp-layers {given} must give each stage a layer at least and sum to the model's 4 layers, not {total}"
PIPELINES = {  # the command line after `autotp` -> the line it must print
    "plan --tp 1 --pp-layers 3": SUM.format(given=3, total=3),
    "generate --pp-layers 3 --prompt x": SUM.format(given=3, total=3),
    "serve --port 0 --pp-layers 3": SUM.format(given=3, total=3),
    "plan --tp 1 --pp-layers 2,2": "--pp-layers gives 2 stages (2,2) for --pp 1",
    "serve --port 0 --pp-layers 2,2": "--pp-layers gives 2 stages (2,2) for --pp 1",
    "serve --port 0 --tp 2 --pp 5": "--pp 5 exceeds the model's 4 decoder layers: each stage holds one at least",
    "generate --tp 2 --pp 5 --prompt x": "--pp 5 exceeds the model's 4 decoder layers: each stage holds one at least",
    "generate --tp 2 --pp 2 --pp-layers 1,2 --prompt x": SUM.format(given="1,2", total=3),
    "serve --port 0 --pp 2 --pp-layers 3,2": "--pp-layers 3,2 must give each stage a layer at least and sum to the "
                                             "model's 4 layers, not 5",
}


def test_a_pipeline_the_config_refuses_is_one_line_before_torch_is_imported():
    """One Python runs each command line as `autotp ...` would (autotp.cli.main), then says what it imported: not
    torch, so no rank started (--tp 2 launches them) and no model code was read. `--pp-layers 3` without `--pp` is
    refused as `--pp-layers 2,2` is, by plan, generate and serve alike."""
    code = ("import json, sys, autotp.cli\n"
            f"cases = {json.dumps(list(PIPELINES))}\n"
            "codes = [autotp.cli.main(case.split()) for case in cases]\n"
            f"print(json.dumps([codes, sorted(m for m in {HEAVY!r} if m in sys.modules)]))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    codes, imported = json.loads(out.stdout)
    assert imported == [] and codes == [2] * len(PIPELINES), (codes, imported)
    assert out.stderr.splitlines() == [f"autotp: error: {line}" for line in PIPELINES.values()]


def test_pp_layers_that_give_the_one_stage_every_layer_are_accepted(capsys):
    """The edge beside the refusal: without --pp, --pp-layers 4 on the 4-layer demo model is its one stage."""
    code, out, err = cli(capsys, "plan", "--tp", "1", "--pp-layers", "4")
    assert code == 0 and out.startswith(f"{DEMO}: gpt_bigcode"), err


def test_a_hub_ids_config_is_checked_where_it_is_fetched(capsys, monkeypatch):
    """A hub id's config.json comes with the ranks (as the early check cannot read it): plan and generate refuse
    --pp-layers 3 without --pp there, in the same words. The demo model stands in for the fetched directory."""
    from autotp import early

    monkeypatch.setattr(early, "check_model", lambda *args: None)  # as for a hub id: nothing local to read
    for command in (["plan", "--tp", "1"], ["generate", "--prompt", "x", "--device", "cpu"]):
        code, _, err = cli(capsys, *command, "--pp-layers", "3")
        assert code == 2 and err.splitlines() == [f"autotp: error: {SUM.format(given=3, total=3)}"], (command, err)


def test_the_librarys_from_pretrained_refuses_pp_layers_that_miss_a_layer_at_pp_1():
    """A script's own from_pretrained (and serve, which loads through it, with a hub id no early check could read):
    pp_layers=(3,) on the 4-layer demo model at pp 1 is refused, not silently ignored; (4,) loads."""
    import autotp
    from autotp.errors import AutotpError

    with pytest.raises(AutotpError) as refused:
        autotp.from_pretrained(str(DEMO), pp_layers=(3,))
    assert str(refused.value) == SUM.format(given=3, total=3)
    assert autotp.from_pretrained(str(DEMO), pp_layers=(4,)).config.n_layer == 4


@pytest.mark.timeout(120)
def test_under_torchrun_rank_0_refuses_the_pipeline_before_the_model_is_read(tmp_path):
    """Each rank runs the command itself and refuses before its process group forms; rank 0 says it, once, and no
    rank imports the model's code."""
    script = tmp_path / "rank.py"
    script.write_text("import json, os, sys, autotp.cli\n"
                      "code = autotp.cli.main(sys.argv[1:])\n"
                      f"heavy = sorted(m for m in {HEAVY[1:]!r} if m in sys.modules)\n"
                      f"(__import__('pathlib').Path({str(tmp_path)!r}) / os.environ['RANK']).write_text("
                      "json.dumps([code, heavy]))\n"
                      "sys.exit(code)\n")
    out = torchrun(2, "generate", "--pp", "2", "--pp-layers", "1,2", "--prompt", "x", script=str(script))
    assert out.returncode != 0  # torchrun's own code
    assert error_lines(out.stderr) == [f"autotp: error: {SUM.format(given='1,2', total=3)}"], out.stderr
    assert json.loads((tmp_path / "0").read_text()) == [2, []]


def test_the_layer_count_is_read_from_every_familys_config_json(tmp_path):
    """config.json names the decoder layers differently by family (n_layer, n_layers, num_hidden_layers): the count
    the early check reads is the one the model is built with, for every family with a plan and for StarCoder."""
    from autotp.early import layer_count

    for name in families.FAMILIES:
        config = families.config(name, num_hidden_layers=3)
        config.save_pretrained(tmp_path / name)
        fields = json.loads((tmp_path / name / "config.json").read_text())
        assert layer_count(fields) == 3, (name, sorted(fields))
    assert layer_count(json.loads((ROOT / "examples" / "starcoder" / "config.json").read_text())) == 40
    assert layer_count(json.loads((DEMO / "config.json").read_text())) == 4


# --- flags ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, line", [
    (["generate", "--tensor-parallel", "1", "--prompt", "x", "--max-new-tokens", "1"],
     "unrecognized arguments: --tensor-parallel 1 (did you mean --tensor-parallel-size?)"),
    (["plan", "--tp", "1", "--pipeline-parallel", "1"],
     "unrecognized arguments: --pipeline-parallel 1 (did you mean --pipeline-parallel-size?)"),
    (["plan", "--tp", "1", "--js"], "unrecognized arguments: --js (did you mean --json?)"),
    (["serve", "--prot", "8000"], "unrecognized arguments: --prot 8000 (did you mean --port?)"),
    (["generate", "--temprature", "0.5"], "unrecognized arguments: --temprature 0.5 (did you mean --temperature?)"),
    (["serve", "--port=8000", "--hots", "0.0.0.0"], "unrecognized arguments: --hots 0.0.0.0 (did you mean --host?)"),
    (["serve", "--zzzzzz"], "unrecognized arguments: --zzzzzz"),  # nothing near: no guess
    (["serve", "--num-shard", "2"],  # another tool's flag: that hint, not a guess
     "unrecognized arguments: --num-shard 2 (--num-shard is text-generation-inference's flag; autotp's is --tp)"),
])
def test_an_abbreviated_or_mistyped_flag_is_refused_with_the_flag_it_is_near(capsys, argv, line):
    """No abbreviations (a flag added later would change what one means); a typo names the command's closest flag."""
    code, out, err = cli(capsys, *argv)
    assert code == 2 and err.splitlines() == [f"autotp: error: {line}"], err


def test_a_hidden_flag_is_never_the_guess(capsys):
    """--local-rank is the deepspeed launcher's, kept out of --help: a typo near it gets no hint."""
    code, _, err = cli(capsys, "serve", "--local-rnk", "1")
    assert code == 2 and err.splitlines() == ["autotp: error: unrecognized arguments: --local-rnk 1"], err


def test_help_says_every_default_the_flags_have():
    """Each flag of generate and serve whose value is not None or off by default says its default in --help, the
    sampling flags included."""
    from readme_flags import command_parser

    for command in ("generate", "serve"):
        quiet = [action.option_strings[0] for action in command_parser(command)._actions
                 if action.help != "==SUPPRESS==" and action.default not in (None, False)
                 and action.option_strings != ["-h", "--help"] and "default" not in action.help]
        assert quiet == [], (command, quiet)
    out = autotp("generate", "--help").stdout
    shown = " ".join(out[out.index("options:"):].split())
    for flag, default in (("--temperature TEMPERATURE", "1.0"), ("--top-p P", "1.0: off"), ("--top-k TOP_K", "0"),
                          ("--num-beams NUM_BEAMS", "1")):
        entry = shown[shown.index(flag):]
        assert f"(default {default}" in entry[:entry.index(" --", len(flag))], flag


# --- int4 at a tp it does not fit ----------------------------------------------------------------------------------

def test_int4_at_a_tp_it_does_not_fit_names_the_tps_that_do_once(capsys):
    """The demo model's 288 features: groups of 128 never fit, 32 fit at tp 1 and 3 (96 each), and no group size
    fits tp 2 (144) or tp 4 (72; the int4 kernel packs 32). One refusal names what works, and following it works."""
    advice = "no int4 group size fits this model at tp {tp}; tp 1 or 3 do, with --group-size 32, or use --quantize int8"
    for tp, group in ((2, 128), (2, 32), (4, 128), (4, 32)):
        code, _, err = cli(capsys, "plan", "--tp", str(tp), "--quantize", "int4", "--group-size", str(group))
        assert code == 2 and len(err.splitlines()) == 1 and err.rstrip().endswith(advice.format(tp=tp)), err
    code, _, err = cli(capsys, "plan", "--tp", "3", "--quantize", "int4")
    assert code == 2 and err.rstrip().endswith("but it has 288: at tp 3 use --group-size 32, or --quantize int8"), err
    assert cli(capsys, "plan", "--tp", "3", "--quantize", "int4", "--group-size", "32")[0] == 0


def test_int4_names_every_tp_that_fits_up_to_eight():
    """8 heads of 32 and an MLP of 256: int4 fits tp 1, 2, 4 and 8 (every rank's inputs whole groups of 32), tp 8
    the edge of the tp sizes tried; not tp 3, whose MLP split (86, 85, 85) cuts every group size."""
    from autotp.errors import AutotpError
    from autotp.prepare import prepare

    model = families.build("llama", hidden_size=256, num_attention_heads=8, num_key_value_heads=8,
                           intermediate_size=256)
    with pytest.raises(AutotpError, match=r"no int4 group size fits this model at tp 3; tp 1 or 2 or 4 or 8 do, "
                                          r"with --group-size 32, or use --quantize int8$"):
        prepare(3, "cpu", model=model, quantize="int4")


def test_int4_that_no_tp_fits_says_so():
    """A model whose linear layers have 100 input features: no int4 group size divides them at any tp."""
    from autotp.errors import AutotpError
    from autotp.prepare import prepare

    model = families.build("llama", hidden_size=100, num_attention_heads=5, num_key_value_heads=1)
    with pytest.raises(AutotpError, match=r"but it has 100: no int4 group size fits this model at tp 1 to 5: use "
                                          r"--quantize int8$"):
        prepare(1, "cpu", model=model, quantize="int4")


# --- the package's metadata ----------------------------------------------------------------------------------------

def test_the_classifiers_agree_with_requires_python():
    """The Python versions pyproject's classifiers name are the ones requires-python allows, the floor among them,
    and so is the one this suite runs on."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11's
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floor = tuple(map(int, project["requires-python"].removeprefix(">=").split(".")))
    named = [tuple(map(int, c.rpartition(" :: ")[2].split("."))) for c in project["classifiers"]
             if c.startswith("Programming Language :: Python :: 3.")]
    assert min(named) == floor and sys.version_info[:2] in named, named
