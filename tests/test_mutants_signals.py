"""Hang-ups as `autotp serve` takes them, whatever the tests were started under (serve_harness.Server resets SIGHUP to
its default in each server it starts, unless a test starts it under nohup).

The rule: a SIGHUP drains the server (the requests in flight run to their end) and it exits 129; a second SIGHUP
changes nothing (a closing terminal sends two: its shell's and the kernel's), where a second Ctrl-C or SIGTERM stops
every rank at once; a SIGHUP ignored when autotp started (`nohup`) stays ignored, by the launcher of `--tp N` and by
a server of one process alike, since the user asked for it to outlive the terminal.
"""

from __future__ import annotations

import signal
import time
import urllib.error
import urllib.request

import pytest
from serve_harness import Server, alive

PROMPT = "def print_hello_world():"


def accepting(server: Server) -> bool:
    """Whether the server takes new requests (/health 200; 503 once it drains)."""
    try:
        with urllib.request.urlopen(server.url + "/health", timeout=10):
            return True
    except urllib.error.HTTPError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_second_hang_up_mid_stream_lets_the_stream_finish(tmp_path):
    """`autotp serve --tp 2 > log 2>&1 &` in a terminal that closes: SIGHUP, and once the ranks drain, SIGHUP again.
    The stream in flight gets every token and the launcher exits 129; before, the second was taken as a second
    Ctrl-C and every rank was SIGKILLed mid-stream. Slow (a second launcher of two ranks, 25-30 s on two busy cores):
    the fast suite's test_a_terminal_that_closes_drains_the_server_and_exits_129 hangs up twice too."""
    server = Server(None, tmp_path / "serve.log", tp_flag=True)
    try:
        stream = iter(server.client.completions.create(model="autotp-demo", prompt=PROMPT, max_tokens=160,
                                                       temperature=0, stream=True,
                                                       stream_options={"include_usage": True}))
        next(stream)
        server.proc.send_signal(signal.SIGHUP)
        while accepting(server):  # the first reached the ranks: two signals pending at once would be one
            time.sleep(0.01)
        server.proc.send_signal(signal.SIGHUP)
        assert [c.usage.completion_tokens for c in stream if c.usage] == [160], server.text()
        assert server.proc.wait(timeout=60) == 129, server.text()
        assert not [p for p in server.ranks if alive(p)]
    finally:
        server.kill()


@pytest.mark.timeout(120)
def test_one_process_under_nohup_answers_on_after_a_hang_up(tmp_path):
    """`nohup python -m autotp serve &` (one process, no launcher): SIGHUP changes nothing, it answers on and stops on
    SIGTERM with 0. (Without nohup it drains and exits 129: test_launch's terminal that closes.)"""
    kept = Server(None, tmp_path / "kept.log", torchrun=False, prefix=("nohup",))
    try:
        kept.proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)  # a drain would have begun: /health 503
        assert accepting(kept), kept.text()
        assert kept.client.completions.create(model="autotp-demo", prompt=PROMPT, max_tokens=4).usage
        kept.proc.send_signal(signal.SIGTERM)
        assert kept.proc.wait(timeout=60) == 0, kept.text()
        assert kept.text().splitlines()[-1] == "autotp serve: stopped", kept.text()
    finally:
        kept.kill()
