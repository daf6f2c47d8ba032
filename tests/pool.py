"""A pool of worker processes forming one gloo process group, reused across test cases.

Starting an interpreter that imports torch and transformers costs seconds on two cores, so each tp size
gets one pool for the whole session. `run(fn, *args)` calls a module-level function on every rank and
returns the results in rank order. A rank that raises comes back as `RankError`; a rank that dies or a
call that outlives its timeout kills the pool (the next `run` refuses) instead of hanging the suite.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from datetime import timedelta

import torch.multiprocessing as mp

# Ranks are forked from multiprocessing's fork server, which imports torch, transformers' model code and autotp
# once (a few seconds of a core on 2 cores) instead of in every rank: a session starts some 18 of them. The
# server imports and runs nothing else, so each rank starts from a clean interpreter, as a spawned one would.
CONTEXT = mp.get_context("forkserver")
CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "transformers.modeling_utils", "autotp"])


class RankError(Exception):
    def __init__(self, rank: int, exc: BaseException, text: str):
        super().__init__(f"rank {rank}: {text}")
        self.rank, self.exc = rank, exc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tasks, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(*args)))
        except BaseException as e:  # noqa: BLE001 - shipped back to the test
            results.put((rank, False, (e, traceback.format_exc())))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world: int):
        ctx = CONTEXT
        self.world = world
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        port = free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, world, port, self.tasks[r], self.results), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()
        self.broken = None

    def run(self, fn, *args, timeout: float = 120, errors: bool = False) -> list:
        """fn(*args) on every rank; results by rank. errors=True returns RankError values instead of raising."""
        if self.broken:
            raise RuntimeError(f"pool of {self.world} is broken: {self.broken}")
        for q in self.tasks:
            q.put((fn, args))
        out: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        while len(out) < self.world:
            try:
                rank, ok, value = self.results.get(timeout=1)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close()
                    self.broken = f"ranks {dead} died" if dead else f"{fn.__name__} timed out after {timeout}s"
                    raise RuntimeError(self.broken) from None
                continue
            out[rank] = value if ok else RankError(rank, *value)
        failures = [v for v in out.values() if isinstance(v, RankError)]
        if failures and not errors:
            raise failures[0]
        return [out[r] for r in range(self.world)]

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
