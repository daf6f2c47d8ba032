"""`serve()`, the entry of `autotp serve`: load the model on every rank, then serve until signalled.

Every rank loads its shard; rank 0 also runs the HTTP server (http.py) in a thread and the scheduler
(engine.Engine) in its main thread, the other ranks follow rank 0's commands. SIGINT/SIGTERM on
any rank set a flag: rank 0 stops taking requests, finishes the batch in flight, answers what is queued
with 503 and tells every rank to stop. Everything that can be checked (port, tokenizer, context) is
checked on every rank before the weights are read. Under torchrun every rank also stops when the
launcher dies (even by SIGKILL, which it cannot forward), instead of serving on as an orphan.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist

import autotp
from autotp import distributed
from autotp.api import load_config
from autotp.errors import AutotpError
from autotp.generate import context_limit
from autotp.hub import resolve_model_dir
from autotp.serve.api import Served
from autotp.serve.engine import Control, Engine, StopFlag, follow
from autotp.serve.guard import host_policy
from autotp.serve.http import HttpThread, build_app, listen
from autotp.serve.types import log
from autotp.tokenizer import load_tokenizer

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _stop_with_launcher() -> None:
    """SIGTERM this rank when its parent dies. torchrun's workers are its children (Popen from its main
    thread, and the signal follows the thread that forked), so its death, by any signal, stops them;
    SIGTERM takes the usual graceful path. Only under torchrun: a server started from a shell must
    outlive it (nohup)."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # the launcher died before prctl: nobody will send the signal
        os.kill(os.getpid(), signal.SIGTERM)


def public_name(model: str) -> str:
    """What /v1/models shows and clients send: a directory's name, not its path; a hub id as given."""
    path = Path(model)
    return path.resolve().name if path.is_dir() else model


def serve(model: str, model_id: str, host: str = "127.0.0.1", port: int = 8000, max_batch_size: int = 16,
          max_model_len: int | None = None, dtype: str | None = None, device: str | None = None,
          quantize: str | None = None, group_size: int = 128, max_body_bytes: int = 2**21,
          read_timeout: float = 30.0, allowed_hosts: list[str] | None = None,
          api_key: str | None = None) -> int:
    """Serve until signalled (returns 0) or until a rank fails (returns 1). port 0 picks a free port.
    model_id: the name clients use (a directory's path is shown by its name only)."""
    _stop_with_launcher()
    model_id = public_name(model_id)
    env = distributed.init(device)
    control = Control()
    sock, error = None, None
    if env.rank == 0:
        try:
            sock = listen(host, port)
        except OSError as e:
            error = f"cannot listen on {host}:{port}: {e.strerror or e}"
    error = control.share(error)
    if error:
        raise AutotpError(error)

    model_dir = resolve_model_dir(model)
    config = load_config(model_dir)
    tokenizer = load_tokenizer(model_dir, missing="autotp serve needs a tokenizer, and none loads from {source} "
                                                  "({cause})")
    max_model_len, source = context_limit(config, tokenizer, max_model_len)
    if max_model_len is None:
        raise AutotpError(f"autotp serve needs a context limit: {source}; give --max-model-len")
    net = autotp.from_pretrained(model_dir, dtype=dtype, device=device, quantize=quantize, group_size=group_size)
    if env.group is not None:
        # ranks finish loading at different times: wait here under the process group's long timeout
        # (AUTOTP_TIMEOUT), not in the control group's first broadcast, whose timeout is short
        dist.barrier(group=env.group)

    stopping = StopFlag()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    if env.rank != 0:
        return follow(net, tokenizer, control, stopping)

    engine = Engine(net, tokenizer, control, stopping, max_batch_size, max_model_len)
    app = build_app(Served(model_id, tokenizer, max_model_len, int(time.time())), engine, max_body_bytes,
                    host_policy(host, allowed_hosts), api_key)
    http = HttpThread(app, sock, read_timeout)
    try:
        http.start()
    except RuntimeError:
        control.share(("stop",))
        raise
    address = sock.getsockname()
    log(f"serving {model_id} (tp={env.world_size}, max batch {max_batch_size}, context {max_model_len}) "
        f"on http://{host}:{address[1]}")
    code = engine.run()
    http.stop()
    log("stopped" if code == 0 else "exited after a rank failure")
    return code
