"""`autotp serve`'s mistakes that need no model, as a user makes them: a busy port, a typo in --model, a folder
without a tokenizer, `--attention varlen` on a CPU. Each is one line and exit 2 before the server's imports
(transformers' model code, FastAPI, uvicorn) and, with --tp 2, before any rank starts; checked by what the
process imported, not by time (serve/preflight.py)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import by_hand, error_lines, torchrun

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "src" / "autotp" / "demo_model"
# what serving imports and refusing must not: the server, its HTTP stack, a family's model code, a rank's launch
HEAVY = ("autotp.serve.server", "fastapi", "uvicorn", "transformers.modeling_utils",
         "transformers.models.gpt_bigcode.modeling_gpt_bigcode", "torch.distributed.launcher.api")


@pytest.fixture
def no_tokenizer(tmp_path) -> Path:
    """What save_pretrained of a model alone writes: config and weights, no tokenizer files."""
    folder = tmp_path / "model-only"
    folder.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (folder / name).symlink_to(DEMO / name)
    return folder


def mistakes(port: int, no_tokenizer: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (serve's flags, the line it must print)."""
    return {
        "busy port": (["--port", str(port)], f"cannot listen on 127.0.0.1:{port}: Address already in use"),
        "typo": (["--model", "./starcoderr"], "--model './starcoderr' is not a directory"),
        "no tokenizer": (["--model", str(no_tokenizer)],
                         f"autotp serve needs a tokenizer, and none loads from {no_tokenizer} ("),
        "varlen on a CPU": (["--attention", "varlen"], "--attention varlen runs on CUDA only (FlashAttention-2), "
                                                       "not on cpu: use --attention sdpa"),
    }


def test_each_mistake_is_one_line_before_the_server_is_imported(no_tokenizer):
    """One Python runs each mistake alone and with --tp 2, as `autotp serve ...` would (autotp.cli.main), then
    says which heavy modules it imported: none, so neither the server nor a rank ever started."""
    with socket.create_server(("127.0.0.1", 0)) as busy:
        cases = mistakes(busy.getsockname()[1], no_tokenizer)
        code = ("import json, sys, autotp.cli\n"
                f"cases = {json.dumps({name: flags for name, (flags, _) in cases.items()})}\n"
                "codes = {}\n"
                "for name, flags in cases.items():\n"
                "    for tp in ([], ['--tp', '2']):\n"
                "        codes[' '.join([name, *tp])] = autotp.cli.main(['serve', '--port', '0', *flags, *tp])\n"
                f"print(json.dumps([codes, sorted(m for m in {HEAVY!r} if m in sys.modules)]))\n")
        env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                             cwd=ROOT)
    assert out.returncode == 0, out.stderr
    codes, imported = json.loads(out.stdout)
    assert imported == [], imported
    assert set(codes.values()) == {2}, codes
    lines = out.stderr.splitlines()
    assert len(lines) == 2 * len(cases), out.stderr  # one line per refusal, nothing else
    for line, (_, message) in zip(lines, [case for case in cases.values() for _ in range(2)], strict=True):
        assert line.startswith(f"autotp: error: {message}"), (line, message)


@pytest.mark.timeout(120)
def test_under_torchrun_rank_0_says_it_before_the_server_is_imported(tmp_path):
    """Each rank runs the command itself. A busy port is rank 0's alone to find (only rank 0 binds it; ranks that
    probed it too would refuse one another, or rank 0's real bind): rank 0 says it, once, before it imports the
    server, and torchrun stops rank 1."""
    script = tmp_path / "rank.py"
    script.write_text("import json, os, sys, autotp.cli\n"
                      "code = autotp.cli.main(sys.argv[1:])\n"
                      f"heavy = sorted(m for m in {HEAVY!r} if m in sys.modules)\n"
                      f"(__import__('pathlib').Path({str(tmp_path)!r}) / os.environ['RANK']).write_text("
                      "json.dumps([code, heavy]))\n"
                      "sys.exit(code)\n")
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        out = torchrun(2, "serve", "--port", str(port), script=str(script))
    assert out.returncode != 0  # torchrun's own code
    message = f"autotp: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    assert [line[:len(message)] for line in error_lines(out.stderr)] == [message], out.stderr
    assert json.loads((tmp_path / "0").read_text()) == [2, []]  # rank 0: exit 2, nothing heavy imported

@pytest.mark.timeout(150)
def test_without_an_agent_that_stops_the_ranks_every_rank_hears_of_the_busy_port():
    """The `deepspeed` launcher's environment (ranks started alike, no torchrun agent to stop rank 1 once rank 0
    exits): rank 0 leaves the port to the server, whose refusal every rank hears, so rank 1 does not wait for
    it at the rendezvous. One line, every rank exits 2."""
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        ranks = by_hand(2, "serve", "--port", str(port))
    assert [code for code, _, _ in ranks] == [2, 2], ranks
    lines = [line for _, _, err in ranks for line in error_lines(err)]
    assert len(lines) == 1 and lines[0].startswith(f"autotp: error: cannot listen on 127.0.0.1:{port}: "), ranks


def test_a_port_taken_after_the_early_check_is_still_refused_where_it_is_bound():
    """The early check lets go of the port: what takes it before the server binds is refused by the server, in the
    same words (autotp.serve.serve, as a script calls it, skips the command line's check altogether)."""
    from autotp import distributed
    from autotp.errors import AutotpError
    from autotp.serve import serve
    from autotp.serve.options import ServeOptions

    try:
        with socket.create_server(("127.0.0.1", 0)) as busy:
            port = busy.getsockname()[1]
            with pytest.raises(AutotpError, match=f"^cannot listen on 127.0.0.1:{port}: Address already in use"):
                serve(str(DEMO), "autotp-demo", ServeOptions(port=port, device="cpu"))
    finally:
        distributed.shutdown()


def test_a_backend_that_runs_on_cuda_alone_is_refused_on_cpu_before_torch_is_imported():
    """`--attention varlen --device cpu`: the flags alone decide, so no torch (seconds of imports) before the line,
    with or without --tp 2."""
    code = ("import json, sys, autotp.cli\n"
            "flags = ['serve', '--port', '0', '--attention', 'varlen', '--device', 'cpu']\n"
            "codes = [autotp.cli.main(flags), autotp.cli.main(flags + ['--tp', '2'])]\n"
            "print(json.dumps([codes, 'torch' in sys.modules]))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert out.returncode == 0 and json.loads(out.stdout) == [[2, 2], False], (out.stdout, out.stderr)
    message = mistakes(0, DEMO)["varlen on a CPU"][1]
    assert out.stderr.splitlines() == [f"autotp: error: {message}"] * 2, out.stderr


def test_the_early_refusal_on_cpu_is_the_backends_own():
    """preflight.CUDA_ONLY against the backends' table: the backends that refuse a CPU are those it names, and each
    is refused early in the words its own refuse() says once torch is imported."""
    import torch

    from autotp.errors import AutotpError
    from autotp.serve import preflight
    from autotp.serve.options import ServeOptions
    from autotp.serve.runner.attention.backends import BACKENDS

    for name, backend in BACKENDS.items():
        why = backend.refuse(torch.device("cpu"), 256)
        assert (name in preflight.CUDA_ONLY) == (why is not None), (name, why)
        if why is not None:
            with pytest.raises(AutotpError) as refused:
                preflight.check(ServeOptions(attention=name, device="cpu", port=0), str(DEMO))
            assert str(refused.value) == why
