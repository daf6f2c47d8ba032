"""`--tp N` (alias `--tensor-parallel-size`): one command starts N local ranks itself, as a user types it.

The oracle for tokens is the same command at tp 1 (one process, no launcher); for the launch, the exit code
and the lines a user sees; for a bad flag, the message (answered before torch is imported, checked by
import, not by time)."""

import os
import pty
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from commands import by_hand, cli, error_lines, run
from pool import free_port
from serve_harness import Server, alive, children

from autotp.launch import outcome

PROMPT = "def print_hello_world():"


def autotp(*args, timeout=180):
    return run([sys.executable, "-m", "autotp", *args], timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_generate_tp_2_prints_the_tokens_of_one_process(capsys):
    """`autotp generate --tp 2` as its own process against the same command at tp 1 in this one (test_cli.cli);
    vLLM's spelling of the flag parses to the same."""
    from autotp.cli import build_parser

    code, alone, err = cli(capsys, "generate", "--prompt", PROMPT, "--max-new-tokens", "24")
    assert code == 0, err
    sharded = autotp("generate", "--tp", "2", "--prompt", PROMPT, "--max-new-tokens", "24")
    assert sharded.returncode == 0, sharded.stderr
    assert sharded.stdout == alone and len(alone) > len(PROMPT) + 10
    assert sharded.stderr == "", sharded.stderr  # neither the launcher's nor torch's log lines
    assert build_parser().parse_args(["generate", "--tensor-parallel-size", "2"]).tp == 2


def plain(log: str) -> list[str]:
    """The log's lines that are not autotp's own."""
    return [line for line in log.splitlines() if line.strip() and not line.startswith("autotp")]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_three_servers_with_tp_2_on_one_host_serve_then_stop_by_their_signals(tmp_path):
    """All three start (each launch opens its rendezvous on a port the OS picks) and answer the openai client. Under
    `nohup autotp serve --tp 2 &`, SIGHUP is ignored, as nohup promises, and the server answers on; then SIGTERM
    (what `docker stop` and systemd send) drains it and it exits 0 with autotp's lines only. Sent where it is not
    ignored (`autotp serve --tp 2 > log 2>&1 &` and the terminal closes), SIGHUP stops the second, whose log's last
    line says so. The third loses a rank to SIGKILL, which is named in one line, and exits 1. (One nohup server
    for both of its checks: a start of a server is what these tests pay for.)"""
    kept = Server(None, tmp_path / "kept.log", tp_flag=True, prefix=("nohup",), wait=False)
    hung = Server(None, tmp_path / "hung.log", tp_flag=True, wait=False)
    second = Server(None, tmp_path / "second.log", tp_flag=True, wait=False)
    try:
        for server in (kept, hung, second):
            assert len(server.up().ranks) == 2
            done = server.client.completions.create(model="autotp-demo", prompt=PROMPT, max_tokens=8, temperature=0)
            assert done.usage.completion_tokens == 8
        for server in (kept, hung):
            server.proc.send_signal(signal.SIGHUP)
        assert hung.proc.wait(timeout=60) == 129, hung.text()
        assert hung.text().splitlines()[-1] == "autotp serve: hung up (SIGHUP): stopped", hung.text()
        assert plain(hung.text()) == [], hung.text()
        time.sleep(1)  # what a forwarded SIGHUP would have stopped by now
        assert kept.client.completions.create(model="autotp-demo", prompt=PROMPT, max_tokens=4).usage
        running = kept.client.completions.create(model="autotp-demo", prompt=PROMPT, max_tokens=64, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        chunks = iter(running)
        next(chunks)
        kept.proc.send_signal(signal.SIGTERM)
        assert [c.usage.completion_tokens for c in chunks if c.usage] == [64]  # the admitted request ran to its end
        assert kept.proc.wait(timeout=60) == 0, kept.text()
        assert not [p for p in kept.ranks if alive(p)]
        assert "autotp serve: stopped" in kept.text() and plain(kept.text()) == [], kept.text()

        dying = max(second.ranks)
        os.kill(dying, signal.SIGKILL)
        assert second.proc.wait(timeout=120) == 1, second.text()
        named = [line for line in second.text().splitlines() if line.startswith("autotp: error")]
        assert named == [f"autotp: error: rank 1 (pid {dying}) died of SIGKILL"], second.text()
        assert plain(second.text()) == [], second.text()
        deadline = time.monotonic() + 30
        while any(alive(p) for p in second.ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in second.ranks if alive(p)]
    finally:
        kept.kill()
        hung.kill()
        second.kill()


def serving(fd: int, timeout: float = 150) -> str:
    """The terminal's output until the server's start-up line."""
    seen, deadline = b"", time.monotonic() + timeout
    while b"autotp serve: serving" not in seen:
        assert time.monotonic() < deadline, seen.decode(errors="replace")
        if select.select([fd], [], [], 1)[0]:
            seen += os.read(fd, 4096)
    return seen.decode(errors="replace")


def accepting(port: int) -> bool:
    """Whether the server on port takes new requests (/health 200; 503 once it drains)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10):
            return True
    except urllib.error.HTTPError:
        return False


@pytest.mark.timeout(300)
def test_a_terminal_that_closes_drains_the_server_and_exits_129():
    """`autotp serve --tp 2` typed in a terminal that is then closed (an ssh session dropped): the kernel hangs up
    its controlling process with SIGHUP, and after that a write to the terminal fails. The request in flight runs to
    its end, every rank stops and the exit code says it was hung up, as a shell reports it (128 + 1); before, the
    stream was cut and it was `starting 2 ranks failed: SignalException ...`, exit 1. A closing terminal can hang up
    twice (its shell's SIGHUP, and the kernel's): the second is not a second Ctrl-C, which would SIGKILL every rank
    mid-stream (191 of 201 chunks sent, before). The shell's SIGHUP is at its default whatever this test was started
    under (`nohup pytest` ignores it, and an ignored signal stays ignored across exec)."""
    port = free_port()
    pid, terminal = pty.fork()
    if pid == 0:  # the terminal's process, as a shell would exec it (SIGHUP not ignored, also under a nohup pytest)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        os.environ["OMP_NUM_THREADS"] = "1"
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        os.execv(sys.executable, [sys.executable, "-m", "autotp", "serve", "--tp", "2", "--port", str(port)])
    try:
        serving(terminal)
        ranks = children(pid)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        stream = iter(client.completions.create(model="autotp-demo", prompt=PROMPT, max_tokens=480, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        next(stream)
        os.close(terminal)  # the terminal closes
        while accepting(port):  # until the hang-up reached the ranks: a second one pending with it would be one
            time.sleep(0.01)
        os.kill(pid, signal.SIGHUP)  # the shell's hang-up of its job
        assert [c.usage.completion_tokens for c in stream if c.usage] == [480]
        _, status = os.waitpid(pid, 0)
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    assert os.waitstatus_to_exitcode(status) == 129
    assert len(ranks) == 2 and not [p for p in ranks if alive(p)]


def rank_environment(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")


@pytest.mark.timeout(180)
def test_a_rank_killed_mid_generation_is_named_once():
    """The launcher stops the other rank (SIGTERM) once rank 1 is gone: only rank 1 is named, with its signal."""
    proc = subprocess.Popen([sys.executable, "-m", "autotp", "generate", "--tp", "2", "--prompt", PROMPT,
                             "--max-new-tokens", "480"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert proc.stdout.read(len(PROMPT)) == PROMPT  # rank 0 has loaded the model and started to stream
        victim = next(pid for pid in children(proc.pid) if "RANK=1" in rank_environment(pid))
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    named = [line for line in err.splitlines() if line.startswith("autotp: error") and "rank" in line]
    assert named == [f"autotp: error: rank 1 (pid {victim}) died of SIGKILL"], err


@pytest.mark.timeout(180)
def test_an_autotp_error_under_tp_is_its_one_line_and_exit_2():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = autotp("serve", "--tp", "2", "--port", str(port))
    assert out.returncode == 2, out.stderr
    [line] = out.stderr.splitlines()  # rank 0's, and nothing of the launcher's
    assert line.startswith(f"autotp: error: cannot listen on 127.0.0.1:{port}: Address already in use"), line


@pytest.mark.parametrize("args, hint", [
    (["generate", "--num-shard", "2"], "(--num-shard is text-generation-inference's flag; autotp's is --tp)"),
    (["serve", "--nproc-per-node=2"], "(--nproc-per-node is torchrun's flag; autotp's is --tp)"),
    (["serve", "-tp", "2"], "(-tp is vLLM's flag; autotp's is --tp)"),
    (["serve", "--model-id", "bigcode/starcoder"], "(--model-id is text-generation-inference's flag; autotp's is "
                                                   "--model)"),
    (["--tp", "2", "serve"], "(the command comes first, its flags after it: autotp serve --tp 2)"),
])
def test_another_tools_flag_gets_autotps_in_one_line_before_torch_is_imported(args, hint):
    code = ("import sys, autotp.cli\n"
            "try:\n"
            f"    autotp.cli.main({args!r})\n"
            "except SystemExit as e:\n"
            "    print(e.code, sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.stdout.strip() == "2 []", out.stderr
    [line] = out.stderr.splitlines()
    assert line.startswith("autotp: error: ") and not line.startswith("autotp: error: autotp"), line
    assert line.endswith(hint), line


def test_a_bad_flag_from_the_shell_is_one_line():
    out = autotp("generate", "--tensor-parallel-size", "0")
    assert out.returncode == 2 and out.stderr.splitlines() == [
        "autotp: error: argument --tp/--tensor-parallel-size: must be at least 1, got 0"]


def test_tp_must_agree_with_the_launchers_world_size():
    """Under a launcher (here the `deepspeed` launcher's environment, 2 ranks), --tp 3 names both numbers, once."""
    ranks = by_hand(2, "generate", "--tp", "3", "--input-ids", "1,2")
    assert [code for code, _, _ in ranks] == [2, 2], ranks
    assert [error_lines(err) for _, _, err in ranks] == [[
        "autotp: error: --tp 3 disagrees with the 2 ranks its launcher started (WORLD_SIZE=2): under torchrun give "
        "--tp 2 or leave --tp out"], []], ranks


def test_the_launchers_outcome():
    """Exit code and lines from the ranks that failed ({rank: (exit code, pid)}, a negative code being a signal)."""
    # every rank failed with autotp's error: rank 0 has said it, the code is passed on, nothing is added
    assert outcome({0: (2, 10), 1: (2, 11)}, []) == (2, [])
    # a rank killed by a signal nobody sent is named, once; its peers' exits are consequences
    assert outcome({1: (-9, 11)}, []) == (1, ["autotp: error: rank 1 (pid 11) died of SIGKILL"])
    assert outcome({0: (1, 10), 1: (-11, 11)}, []) == (1, ["autotp: error: rank 1 (pid 11) died of SIGSEGV"])
    # ... and the SIGTERM with which the launcher then stops the others is not theirs to be named for
    assert outcome({0: (-15, 10), 1: (-9, 11)}, []) == (1, ["autotp: error: rank 1 (pid 11) died of SIGKILL"])
    assert outcome({1: (-15, 11)}, []) == (1, ["autotp: error: rank 1 (pid 11) died of SIGTERM"])  # someone's kill
    # ranks ended by the signal that was forwarded to them were stopped, not failed; a second one killed them
    assert outcome({0: (-15, 10), 1: (-15, 11)}, [signal.SIGTERM]) == (143, [])
    assert outcome({0: (-9, 10)}, [signal.SIGINT, signal.SIGINT]) == (130, [])
    assert outcome({0: (130, 10), 1: (130, 11)}, [signal.SIGINT]) == (130, [])
    # a hang-up: generate's ranks die of it (129); the server drains and its rank 0 exits 129 itself
    assert outcome({0: (-1, 10), 1: (-1, 11)}, [signal.SIGHUP]) == (129, [])
    assert outcome({0: (129, 10)}, [signal.SIGHUP]) == (129, [])
    # a rank its peers gave up on as stalled, which the launcher then ended, is named stalled, not by that SIGKILL
    stopped = "stopped (SIGSTOP, or a job control stop)"
    assert outcome({0: (1, 10), 1: (-9, 11)}, [], {1: stopped}) == (1, [
        f"autotp: error: rank 1 (pid 11) stalled: its process was {stopped}, so its peers gave up on it and the "
        "launcher ended it"])
    assert outcome({0: (-15, 10), 1: (-9, 11)}, [], {1: stopped})[0] == 1


def listening(port: int) -> set[str]:
    """The addresses (hex, as /proc/net/tcp* writes them) on which something of this machine listens on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pin", ["flag", "environment"])
def test_the_rendezvous_port_can_be_pinned_and_listens_on_loopback_only(pin):
    """`--tp 2 --master-port P` (torchrun's flag) or MASTER_PORT=P: the ranks meet on port P, which listens on
    127.0.0.1 alone (every rank is on this host), not on every interface."""
    port = free_port()
    flag, env = (["--master-port", str(port)], {}) if pin == "flag" else ([], {"MASTER_PORT": str(port)})
    proc = subprocess.Popen([sys.executable, "-m", "autotp", "generate", "--tp", "2", "--prompt", PROMPT,
                             "--max-new-tokens", "480", *flag], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **env}, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (seen := listening(port)) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert seen == {"0100007F"}, (seen, proc.poll())  # 127.0.0.1, and no 0.0.0.0 or ::
    finally:
        proc.send_signal(signal.SIGTERM)  # forwarded to the ranks, as from a service manager
        proc.wait(timeout=60)


def test_a_master_port_that_is_no_port_is_one_line():
    out = subprocess.run([sys.executable, "-m", "autotp", "generate", "--tp", "2"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "MASTER_PORT": "80a"})
    assert out.returncode == 2 and out.stderr.splitlines() == [
        "autotp: error: MASTER_PORT='80a' is not a port number (0 to 65535): set it to one, or leave it out"]


@pytest.mark.timeout(120)
def test_a_server_started_without_a_terminal_says_at_once_what_it_loads():
    """`autotp serve --tp 2` with its output to a file (systemd, nohup, a pipe): no progress bar, and the load takes
    18-37 s on 2 cores; the first line, before torch is imported or a rank starts, says what is loading, and on what."""
    proc = subprocess.Popen([sys.executable, "-m", "autotp", "serve", "--tp", "2", "--pp", "1", "--device", "cpu",
                             "--port", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        first = proc.stderr.readline()
        started = children(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert first == "autotp serve: loading autotp-demo (tp=2 pp=1) on cpu\n"
    assert started == []  # no rank yet: said before torch's import


def test_a_line_to_a_terminal_that_has_closed_is_dropped_not_raised(monkeypatch):
    """After a hang-up the terminal is gone and a write to it fails (EIO): the launcher's lines, said from its signal
    handler (a second Ctrl-C or SIGTERM during the drain) or at the end, must not raise there, which turned a drain
    into 'starting 2 ranks failed', exit 1."""
    import errno
    import io

    from autotp import launch

    class Closed(io.StringIO):
        def write(self, text):
            raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(sys, "stderr", Closed())
    launch._say("autotp: second SIGTERM: stopping every rank now")
