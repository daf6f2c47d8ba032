"""Waiting for a server another process starts: until its /health answers, or it is given up on."""

from __future__ import annotations

import time
import urllib.request


def healthy(url: str, timeout_s: float, procs=(), every_s: float = 0.05) -> bool:
    """Whether url's /health answered within timeout_s; False as soon as one of procs (Popen) has exited. A refused
    connection costs microseconds, so it asks often: the tests that serve many checkpoints in turn wait here once
    for each."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return True
        except OSError:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                return False
            time.sleep(every_s)
