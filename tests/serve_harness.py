"""A 2-rank `autotp serve` (under torchrun, or started by its own `--tp`) for the serve tests, and the /proc
look-ups they use."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
from pool import free_port
from prometheus_client.parser import text_string_to_metric_families

START_TIMEOUT_S = 180
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def children(pid: int) -> list[int]:
    """Direct child processes of pid, from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Server:
    """torchrun -m autotp serve on a free port (--port 0), output in a log file the tests read."""

    def __init__(self, model_dir: str | None, log: Path, *args: str, api_key: str = "unused", ranks: int = 2,
                 script: str | None = None, env: dict | None = None, torchrun: bool = True, tp_flag: bool = False,
                 dtype: str | None = "float32", wait: bool = True, prefix: tuple[str, ...] = ()):
        """script: a file torchrun runs instead of `-m autotp` (one that patches autotp, then calls its main).
        model_dir None: the embedded demo model, served as autotp-demo. torchrun=False: one process, `python -m
        autotp serve` (tp 1), as a user starts it without torchrun. tp_flag: `python -m autotp serve --tp RANKS`,
        which starts its ranks itself, instead of torchrun. dtype: --dtype unless args give one (None: serve's own
        choice); float32 by default because the tests' checkpoints and their HF oracle are float32, and serve would
        hold them in bfloat16 on a CPU with native bfloat16 products (startup/weight_form.py). wait False: started,
        and up() waits for it, so that servers a test needs together start at once (each start is mostly one
        core's imports). prefix: the command the server is started under, e.g. ("nohup",)."""
        self.model_id, self.log, self.api_key = Path(model_dir).name if model_dir else "autotp-demo", log, api_key
        entry = [script] if script else ["-m", "autotp"]
        model = ["--model", model_dir] if model_dir else []
        launcher = [*prefix] + ([sys.executable] if tp_flag or not torchrun else
                    [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
                     str(free_port())])
        dtype = ["--dtype", dtype] if dtype and "--dtype" not in args else []
        cmd = [*launcher, *entry, "serve", *model, "--port", "0", "--max-num-seqs", "8", *dtype, *args,
               *(["--tp", str(ranks)] if tp_flag else [])]
        # no terminal on stdin, as under a service manager or `&` in a script: nohup then adds no line of its own.
        # SIGHUP as a shell leaves it (not ignored) even where pytest itself runs under nohup, or a hung-up server
        # would outlive its test's wait
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         env={**ENV, **(env or {})}, start_new_session=True,
                                         preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
        if wait:
            self.up()

    def up(self) -> Server:
        """Wait until it serves: its address, its ranks and a client."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (found := re.search(r"on (http://127\.0\.0\.1:(\d+))", self.text())):
            assert self.proc.poll() is None, f"server exited {self.proc.returncode}:\n{self.text()[-3000:]}"
            assert time.monotonic() < deadline, f"server not up after {START_TIMEOUT_S}s:\n{self.text()[-3000:]}"
            time.sleep(0.05)
        self.url, self.port = found.group(1), int(found.group(2))
        self.ranks = children(self.proc.pid)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key, max_retries=0, timeout=60)
        return self

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def post(self, body: bytes | dict, path: str = "/v1/completions", **headers: str) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self.api_key}", **headers}
        request = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def raw(self, request: bytes, timeout: float = 30) -> bytes:
        """Send bytes as they are, read the answer until the server closes the connection or, when it has a
        Content-Length, until the body is complete."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as s:
            s.sendall(request)
            out = b""
            while chunk := s.recv(65536):
                out += chunk
                head, sep, body = out.partition(b"\r\n\r\n")
                length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                if sep and length and len(body) >= int(length.group(1)):
                    break
            return out

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "/health", timeout=10) as r:
            return json.loads(r.read())

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def metrics(server) -> dict[str, float]:
    """Every sample of /metrics, by name{labels}."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "le")
            if "le" not in s.labels:
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out
