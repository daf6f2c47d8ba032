"""`autotp serve` on many checkpoints in one torchrun: for each, `autotp.cli.main(["serve", ...])` as
`python -m autotp serve` runs it, while a thread on rank 0 asks it for a greedy completion (whole and
streamed) through the openai client and then signals rank 0 to stop, as an operator's SIGTERM would.
Rank 0 writes OUT/NAME.json = {"code", "text", "streamed", "stderr"}.

    torchrun --nproc-per-node N family_serve.py OUT PROMPT TOKENIZER NAME=DIR...

One torchrun instead of one per checkpoint, as tests/family_cli.py does for generate; main() leaves the
process group for the next checkpoint instead of destroying it.
"""

import contextlib
import io
import json
import os
import signal
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path

import openai

from autotp import cli, distributed

out, prompt, tokenizer, rest = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
distributed.shutdown = lambda: None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ask(port: int, name: str, answers: dict) -> None:
    """Rank 0's client: wait for the server, ask twice, then stop the server."""
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        model = os.path.basename(name)
        whole = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
        answers["text"] = whole.choices[0].text
        answers["streamed"] = "".join(c.choices[0].text for c in client.completions.create(
            model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True) if c.choices)
    except Exception as e:  # noqa: BLE001 - written to the result, for the test to show
        answers["error"] = f"{type(e).__name__}: {e}"
    finally:
        os.kill(os.getpid(), signal.SIGTERM)


for name, directory in (a.split("=", 1) for a in rest):
    port = free_port() if distributed.rank() == 0 else 0
    answers: dict = {}
    client = threading.Thread(target=ask, args=(port, directory, answers)) if distributed.rank() == 0 else None
    if client is not None:
        client.start()
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        # float32: HF's float32 is the oracle, on a CPU with native bfloat16 too. A KV cache of 64 MiB: a family
        # without a context limit (BLOOM) is otherwise given half the host's available memory (5.5 GiB per rank on
        # a 24 GiB host, 15 s of page faults and most of the host's memory for one 2-rank test server)
        code = cli.main(["serve", "--model", directory, "--tokenizer", tokenizer, "--port", str(port),
                         "--dtype", "float32", "--kv-cache-memory", "64MiB"])
    if client is not None:
        client.join()
        (out / f"{name}.json").write_text(json.dumps({"code": code, "stderr": stderr.getvalue()} | answers))
