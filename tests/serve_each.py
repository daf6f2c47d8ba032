"""`autotp serve` on checkpoints in turn, in one torchrun (family_serve.py, hosts_serve.py): for each NAME=DIR,
`autotp.cli.main(["serve", ...])` as `python -m autotp serve` runs it, while a thread on rank 0 waits for it, asks it
and then signals rank 0 to stop, as an operator's SIGTERM would. Rank 0 writes OUT/NAME.json = {"code", "answers",
"stderr"}. One torchrun instead of one per checkpoint, as tests/family_cli.py does for generate.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

from health import healthy
from pool import free_port

from autotp import cli, distributed


def serve_each(out: Path, checkpoints: list[str], flags: list[str], ask: Callable[[str, str, dict], None],
               wait_s: float) -> None:
    """Serves each of checkpoints (NAME=DIR) with `--model DIR FLAGS`; ask(url, DIR, answers) fills the answers."""
    distributed.shutdown = lambda: None  # main() leaves the process group for the next checkpoint
    for name, directory in (a.split("=", 1) for a in checkpoints):
        port = free_port() if distributed.rank() == 0 else 0
        answers: dict = {}
        client = (threading.Thread(target=_client, args=(f"http://127.0.0.1:{port}", directory, ask, answers, wait_s))
                  if distributed.rank() == 0 else None)
        if client is not None:
            client.start()
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            code = cli.main(["serve", "--model", directory, "--port", str(port), *flags])
        if client is not None:
            client.join()
            (out / f"{name}.json").write_text(json.dumps({"code": code, "answers": answers,
                                                          "stderr": stderr.getvalue()}))


def _client(url: str, directory: str, ask, answers: dict, wait_s: float) -> None:
    """Rank 0's client: wait for the server, ask, then stop the server."""
    try:
        if not healthy(url, wait_s):
            raise TimeoutError(f"{url}/health did not answer within {wait_s:.0f} s")
        ask(url, directory, answers)
    except Exception as e:  # noqa: BLE001 - written to the result, for the test to show
        answers["error"] = f"{type(e).__name__}: {e}"
    finally:
        os.kill(os.getpid(), signal.SIGTERM)
