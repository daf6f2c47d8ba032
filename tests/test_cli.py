"""The command line as a user runs it: `autotp plan` alone, `autotp generate` under torchrun."""

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
from checkpoints import PROMPT, word_tokenizer
from commands import autotp, by_hand, cli, error_lines, run, torchrun
from families import FAMILIES
from pool import free_port

ROOT = Path(__file__).resolve().parents[1]
STARCODER = ROOT / "examples" / "starcoder"


def test_plan_of_starcoder_from_its_config_alone(capsys):
    assert sorted(p.name for p in STARCODER.iterdir()) == ["config.json"]
    code, out, err = cli(capsys, "plan", "--model", str(STARCODER), "--tp", "4", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert [r["q_heads"] for r in report["ranks"]] == [[0, 12], [12, 24], [24, 36], [36, 48]]
    c_attn = {r["rank"]: next(t for t in r["tensors"] if t["name"] == "transformer.h.0.attn.c_attn.weight")
              for r in report["ranks"]}
    assert c_attn[3]["holds"] == "rows 4608:6144 + 6144:6272 + 6272:6400"
    assert c_attn[3]["local_shape"] == [1792, 6144]
    totals = [r["total_bytes"] for r in report["ranks"]]
    assert totals[0] == totals[3] and 7.3 * 2**30 < totals[0] < 7.5 * 2**30  # 31 GB bf16 / 4 + replicated
    assert "transformer.h.*.attn.c_attn.weight x40" in cli(capsys, "plan", "--model", str(STARCODER), "--tp", "4")[1]


def test_plan_rejects_more_ranks_than_heads_in_one_line():
    """As its own process: the exit code and stderr a shell sees."""
    out = autotp("plan", "--model", str(STARCODER), "--tp", "64")
    assert out.returncode == 2
    assert out.stderr.strip() == ("autotp: error: tp_size 64 exceeds the 48 query heads: "
                                  "at most 48 ranks can hold a head")


def test_generate_under_torchrun_matches_the_unsharded_model(checkpoint):
    model_dir, ref = checkpoint("mqa10")
    ids = ",".join(map(str, PROMPT[0]))
    out = torchrun(2, "generate", "--model", model_dir, "--input-ids", ids, "--max-new-tokens", "32", "--json")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, "only rank 0 prints"
    assert json.loads(lines[0]) == {"output_ids": ref["greedy"], "text": None}


def test_generate_under_the_deepspeed_launchers_environment(checkpoint):
    """What `deepspeed --num_gpus 2 --module autotp generate ...` does: env vars, and --local_rank=N appended."""
    model_dir, ref = checkpoint("mqa10")
    ranks = by_hand(2, "generate", "--model", model_dir, "--max-new-tokens", "32", "--input-ids",
                    ",".join(map(str, PROMPT[0])), "--json", flag_local_rank=True)
    assert [code for code, _, _ in ranks] == [0, 0], ranks
    assert json.loads(ranks[0][1]) == {"output_ids": ref["greedy"], "text": None} and ranks[1][1] == ""


def test_generate_with_a_tokenizer_prints_text(tmp_path, checkpoint):
    model_dir, _ = checkpoint("mqa12")
    tok = word_tokenizer(tmp_path)
    out = torchrun(2, "generate", "--model", model_dir, "--tokenizer", tok, "--prompt", "w3 w17 w42",
                   "--max-new-tokens", "8", "--json", "--do-sample", "--seed", "7")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert len(result["output_ids"][0]) == 3 + 8 and len(result["text"].split()) == 8


@pytest.mark.parametrize("extra", [[], ["--num-beams", "2"]])
def test_generate_prints_the_prompt_and_its_completion_on_one_line_with_or_without_beams(capsys, extra):
    """What a user runs in a terminal: the prompt, then its completion (streamed, or at the end for beam search,
    which HF's streamer refuses), then one newline; the completion is the one --json reports."""
    from commands import cli

    args = ["generate", "--prompt", "def add(a, b):", "--max-new-tokens", "6", *extra]
    code, shown, err = cli(capsys, *args)
    assert code == 0, err
    code, out, err = cli(capsys, *args, "--json")
    assert code == 0, err
    assert shown == "def add(a, b):" + json.loads(out)["text"] + "\n"


@pytest.mark.parametrize("args, message", [
    (["--input-ids", "1,2,3", "--max-new-tokens", "62"],
     "prompt of 3 tokens + 62 new tokens exceeds the model's context of 64 positions"),
    (["--prompt", "w1 w2"], "cannot load a tokenizer from"),
    # found before the process group forms, on every rank alike (rank 1 once said them too, as its own)
    (["--prompt", "w1", "--input-ids", "1,2,3"], "give exactly one of --prompt and --input-ids"),
    (["--input-ids", "1,2,3", "--top-p", "2"], "--top-p must be in (0, 1], got 2.0"),
])
def test_generate_errors_are_one_line_from_rank_0(checkpoint, args, message):
    model_dir, _ = checkpoint("mqa12")
    out = torchrun(2, "generate", "--model", model_dir, *args)
    assert out.returncode != 0
    lines = error_lines(out.stderr)
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("autotp: error: "), out.stderr
    # our line comes first; what follows is torchrun's own failure summary, with no frame of ours in it
    assert out.stderr.splitlines()[0] == lines[0]
    assert not [line for line in out.stderr.splitlines() if line.strip().startswith("File") and "autotp" in line]


def test_generate_errors_in_a_single_process(tmp_path, checkpoint, capsys):
    def errors(*args: str) -> tuple[int, list[str]]:
        code, _, err = cli(capsys, "generate", *args)
        return code, error_lines(err)

    assert errors("--model", str(tmp_path / "nope"), "--input-ids", "1") == (2, [
        f"autotp: error: --model '{tmp_path / 'nope'}' is not a directory"])
    code, lines = errors("--model", str(STARCODER), "--input-ids", "1")
    assert code == 2 and "no model.safetensors or model.safetensors.index.json" in lines[0]
    # a config without weights, given a prompt: the weights are named, not the tokenizer it also lacks
    assert errors("--model", str(STARCODER), "--prompt", "def f():") == (2, [
        f"autotp: error: no weights in {STARCODER}: no model.safetensors or model.safetensors.index.json (autotp "
        "reads safetensors checkpoints; `autotp plan` needs only config.json)"])
    assert errors("--model", checkpoint("mqa12")[0], "--tokenizer", "/nonexistent/dir", "--prompt", "x") == (2, [
        "autotp: error: --tokenizer '/nonexistent/dir' is not a directory"])  # the flag that named it


def test_bad_flags_are_one_line(checkpoint, capsys):
    model = checkpoint("mqa12")[0]
    capsys.readouterr()  # the checkpoint's writing, where this test is the first to ask for it (-k, another order)
    code, _, err = cli(capsys, "generate", "--model", model, "--input-ids", "1", "--dtype", "float8")
    assert code == 2 and err.splitlines() == [
        "autotp: error: argument --dtype: invalid choice: 'float8' (choose from 'float32', "
        "'bfloat16', 'float16')"]
    code, _, err = cli(capsys, "plan", "--tp", "0")
    assert code == 2 and err.splitlines() == [
        "autotp: error: argument --tp/--tensor-parallel-size: must be at least 1, got 0"]
    code, _, err = cli(capsys, "serve", "--speculate", "-1")
    assert code == 2 and err.splitlines() == ["autotp: error: argument --speculate: must be at least 0, got -1"]


def test_help_and_flag_errors_import_neither_torch_nor_transformers():
    # `autotp --help` and a bad flag answer at once (benchmarks/cli_startup.py times them): the package
    # and the CLI import torch and transformers only inside the commands that use them.
    code = ("import sys, autotp, autotp.cli\n"
            "autotp.cli.build_parser().parse_args(['plan', '--tp', '1'])\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = run([sys.executable, "-c", code])
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_version_names_autotp_torch_and_transformers_at_once():
    """`autotp --version` for a bug report: the versions pip installed, read without importing torch."""
    from importlib.metadata import version

    out = autotp("--version")
    assert out.returncode == 0 and out.stdout == (f"autotp {version('autotp')} (torch {version('torch')}, "
                                                  f"transformers {version('transformers')})\n"), out.stderr
    code = ("import sys, autotp.cli\n"
            "try:\n"
            "    autotp.cli.main(['--version'])\n"
            "except SystemExit as e:\n"
            "    print(e.code, sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    assert run([sys.executable, "-c", code]).stdout.splitlines()[-1] == "0 []"


def test_pip_show_names_the_author_and_the_version_autotp_prints():
    import autotp

    out = run([sys.executable, "-m", "pip", "show", "autotp"])
    fields = dict(line.split(": ", 1) for line in out.stdout.splitlines() if ": " in line)
    assert fields["Author"] == "The autotp maintainers" and fields["License"] == "Apache-2.0", out.stdout
    assert fields["Version"] == autotp.__version__  # pyproject reads it from autotp.__version__


def test_help_lists_every_environment_variable_autotp_reads():
    """Every AUTOTP_* name in the package's code, OMP_NUM_THREADS and CC, each with its line, in each command's
    --help; no name the code no longer reads; and none that autotp sets for itself (INTERNAL: not for users)."""
    from autotp.environment import INTERNAL, VARIABLES

    package = ROOT / "src" / "autotp"
    code = "\n".join(p.read_text() for p in package.rglob("*.py") if p.name != "environment.py")
    read = set(re.findall(r"\bAUTOTP_[A-Z_]+\b", code))
    assert {name for name in VARIABLES | INTERNAL if name.startswith("AUTOTP_")} == read
    assert [name for name in VARIABLES | INTERNAL if not re.search(rf"\b{name}\b", code)] == []
    for command in ([], ["plan"], ["generate"], ["serve"]):
        out = autotp(*command, "--help")
        shown = out.stdout[out.stdout.index("environment variables:"):].splitlines()[1:]
        assert shown == [line for name, text in VARIABLES.items() for line in (f"  {name}", f"      {text}")]
        assert max(map(len, shown)) <= 80, command
        assert not [name for name in INTERNAL if name in out.stdout], command


def test_the_entry_points_resolve_on_first_use():
    import autotp
    from autotp import sharded

    assert (autotp.from_pretrained, autotp.init_inference, autotp.InferenceEngine) == (
        sharded.from_pretrained, sharded.init_inference, sharded.InferenceEngine)
    assert set(autotp.__all__) <= set(dir(autotp))
    with pytest.raises(AttributeError, match="no attribute 'from_pretrain'"):
        _ = autotp.from_pretrain


def test_a_failing_rank_stops_every_rank(checkpoint):
    """Rank 1 fails alone while rank 0 waits for it in a collective: rank 1 says so, and rank 0 does not wait out
    a timeout (the subprocess timeout bounds a hang): torchrun stops it, or its collective sees rank 1 go.
    Which of the two torchrun sees first is a race, so its summary is not checked."""
    model_dir, _ = checkpoint("mqa12")
    # a generation that fits the 64-position context, so that rank 0 passes validation and waits for rank 1
    out = torchrun(2, "generate", "--model", model_dir, "--input-ids", "1,2", "--max-new-tokens", "8",
                   script=str(Path(__file__).parent / "fault_rank1.py"))
    assert out.returncode != 0
    lines = error_lines(out.stderr)
    ours = "autotp: error on rank 1: RuntimeError: injected failure on rank 1"
    assert ours in lines, out.stderr
    # rank 0 speaks only if its collective saw rank 1 go before torchrun stopped it (gloo: "Connection closed by
    # peer", or "reset"), never of a timeout; rank 1 said its line before it left, so that line comes first
    # one root cause, one line: rank 0's "Connection closed by peer" when its collective sees rank 1 go is a
    # symptom of the failure rank 1 has said already, and rank 0 stays silent (or torchrun stopped it first)
    assert lines == [ours], out.stderr


def test_a_failure_every_rank_has_is_said_once_by_rank_0_however_late(pools):
    """Rank 0 reaches the failure later than the others (here half of distributed.FAILURE_WAIT_S): they learn
    from the process group's store that rank 0 has the same one and stay silent, instead of speaking after a
    grace period. A rank whose failure rank 0 does not share says it, naming itself."""
    from tasks import report_failure

    wait_s = 2.0  # FAILURE_WAIT_S for these calls: 5 s as shipped
    assert pools(2).run(report_failure, ["bad input", "bad input"], wait_s / 2, None, wait_s) == [
        ["autotp: error: bad input"], []]
    # rank 0 later than the bound: the first rank to give up waiting says it, once, and rank 0 stays silent
    late = pools(3).run(report_failure, ["bad input"] * 3, wait_s * 1.5, None, wait_s)
    assert sorted(line for lines in late for line in lines) in (
        [f"autotp: error on rank {r}: bad input"] for r in (1, 2)), late
    assert late[0] == []
    # a rank whose collective lost rank 0 after rank 0's own failure: a symptom, not said
    lost = "RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234"
    assert pools(2).run(report_failure, ["g_idx is broken", lost], 0.0, [False, True]) == [
        ["autotp: error: g_idx is broken"], []]
    assert pools(2).run(report_failure, ["bad input", "out of memory"]) == [
        ["autotp: error: bad input"], ["autotp: error on rank 1: out of memory"]]


def test_a_failure_every_rank_has_is_said_once_without_torchrun(checkpoint):
    """Launched by hand, nothing stops rank 1 once rank 0 has failed: it prints nothing because rank 0 has said
    the same, and rank 0, whose process holds the store, leaves once rank 1 has read it."""
    ranks = by_hand(2, "generate", "--model", checkpoint("mqa12")[0], "--input-ids", "1,2,3", "--max-new-tokens", "62")
    assert [code for code, _, _ in ranks] == [2, 2], ranks
    assert [error_lines(err) for _, _, err in ranks] == [["autotp: error: prompt of 3 tokens + 62 new tokens exceeds "
                                                          "the model's context of 64 positions (the config's "
                                                          "n_positions)"], []], ranks


@pytest.mark.parametrize("ids, bad", [("3,101", 101), ("99999", 99999), ("-1", -1)])
def test_generate_refuses_ids_outside_the_vocabulary_before_loading(checkpoint, capsys, ids, bad):
    from autotp.cli import main

    assert main(["generate", "--model", checkpoint("mqa12")[0], "--input-ids", ids, "--max-new-tokens", "4"]) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"autotp: error: token id {bad} is outside the model's vocabulary of 101 ids (0 to 100)"]


def test_generate_names_a_config_json_that_is_a_list(tmp_path, capsys):
    """AutoTokenizer reads config.json before the model does: the error must still be autotp's."""
    from autotp.cli import main

    (tmp_path / "config.json").write_text("[]")
    assert main(["generate", "--model", str(tmp_path), "--input-ids", "1"]) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"autotp: error: {tmp_path / 'config.json'} is a JSON list, not an object of config fields"]


def test_an_error_raised_by_transformers_on_every_rank_is_printed_once(tmp_path, checkpoint):
    """A typo in config.json that only transformers notices, as it builds the model on every rank."""
    model_dir = tmp_path / "m"
    shutil.copytree(checkpoint("mqa12")[0], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"activation_function": "gelu_typo"}))
    out = torchrun(2, "generate", "--model", str(model_dir), "--input-ids", "1,2", "--max-new-tokens", "8")
    assert out.returncode != 0
    assert error_lines(out.stderr) == ["autotp: error: KeyError: 'gelu_typo'"], out.stderr


def test_plan_of_every_familys_checkpoint(family_checkpoint, capsys):
    """`autotp plan` on each family's tiny checkpoint (config.json and safetensors, no tokenizer), tables and JSON."""
    from autotp.cli import main

    for name in FAMILIES:
        model_dir, _ = family_checkpoint(name)
        assert main(["plan", "--model", model_dir, "--tp", "3", "--json"]) == 0, name
        report = json.loads(capsys.readouterr().out)
        assert report["family"] == FAMILIES[name][0] and report["checkpoint_headers"], name
        assert [r["rank"] for r in report["ranks"]] == [0, 1, 2], name
        assert report["plan_source"] == ("inferred" if name == "granite" else "built-in"), name
        assert main(["plan", "--model", model_dir, "--tp", "3"]) == 0, name
        assert capsys.readouterr().out.startswith(f"{model_dir}: {FAMILIES[name][0]} ("), name


@pytest.mark.slow
def test_generate_on_every_familys_checkpoint_matches_the_unsharded_model(tmp_path, family_checkpoint):
    """`autotp generate --input-ids ... --json` at tp 3 on each family's tiny checkpoint, all in one torchrun
    (tests/family_cli.py): greedy ids equal the unsharded HF model's, no text (there is no tokenizer), and
    BLOOM, whose config has no position limit, runs with none and says so."""
    checkpoints = {name: family_checkpoint(name) for name in FAMILIES}
    ids = ",".join(map(str, PROMPT[0]))
    out = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port",
               str(free_port()), str(ROOT / "tests" / "family_cli.py"), str(tmp_path),
               *[f"{name}={d}" for name, (d, _) in checkpoints.items()],
               "--", "--input-ids", ids, "--max-new-tokens", "16", "--json"], timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for name, (_, ref) in checkpoints.items():
        result = json.loads((tmp_path / f"{name}.json").read_text())
        assert result["code"] == 0, (name, result["stderr"])
        assert json.loads(result["stdout"]) == {"output_ids": ref["greedy"], "text": None}, name
        notes = [line for line in result["stderr"].splitlines() if line.startswith("autotp: ")]
        if name == "bloom":
            assert notes == ["autotp: no context limit: bloom has no position limit in its config (n_positions, "
                             "max_position_embeddings, n_ctx, seq_length, max_seq_len) and there is no tokenizer; "
                             "--max-model-len sets one"], result["stderr"]
        else:
            assert not [line for line in notes if "context" in line or "error" in line], (name, notes)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_prompt_without_tokenizer_files_is_refused_alike_for_every_family(family_checkpoint, capsys, name):
    """transformers 5 builds an empty tokenizer (special tokens only) for some families' directories without
    tokenizer files: `--prompt` must get the same answer as where none loads at all, before any weight is read."""
    from autotp.cli import main

    model_dir, _ = family_checkpoint(name)
    assert main(["generate", "--model", model_dir, "--prompt", "def add(a, b):"]) == 2
    [line] = error_lines(capsys.readouterr().err)
    assert line.startswith(f"autotp: error: cannot load a tokenizer from {model_dir} (")
    assert line.endswith("): give --tokenizer, or the prompt as --input-ids")


def test_serve_refuses_to_start_without_a_tokenizer(family_checkpoint, capsys):
    """MPT's directory without tokenizer files gets an empty GPTNeoXTokenizer: serve used to start with it and
    answer every request 400 "the prompt is empty"."""
    from autotp.cli import main

    model_dir, _ = family_checkpoint("mpt")
    assert main(["serve", "--model", model_dir, "--port", "0"]) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"autotp: error: autotp serve needs a tokenizer, and none loads from {model_dir} (no tokenizer files: "
        "transformers built an empty GPTNeoXTokenizer): give --tokenizer"]


def test_a_tokenizer_that_encodes_text_to_nothing_is_refused_when_it_loads(tmp_path):
    """transformers 5 loads a qwen2 directory's own tokenizer.json as a Qwen2Tokenizer, which drops every token of
    a word-level vocabulary: each prompt would be "empty". Refused where it loads, naming what happened."""
    from checkpoints import word_tokenizer
    from families import build, save

    from autotp.errors import AutotpError
    from autotp.tokenizer import load_tokenizer

    save("qwen2", build("qwen2"), tmp_path)
    word_tokenizer(tmp_path)
    assert load_tokenizer(str(tmp_path)) is None
    with pytest.raises(AutotpError, match=r"loaded it as a Qwen2Tokenizer that encodes 'def hello\(\): return 0' "
                                          r"to no tokens"):
        load_tokenizer(str(tmp_path), missing="none loads from {source} ({cause})")
    assert load_tokenizer(word_tokenizer(tmp_path / "alone")) is not None  # the same files on their own load
