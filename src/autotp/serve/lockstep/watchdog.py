"""A step that failed on some ranks only, found within seconds instead of at the collective's timeout.

The ranks run each step's forward in lockstep. A forward that raises on every rank alike (the same row too
long for every GPU) fails its rows and the server goes on (engine/loop.py). One that raises on some ranks only
(an out-of-memory error on one GPU) leaves the others waiting in one of its collectives, where no message
reaches them, for the process group's timeout (10 minutes by default). So a rank whose forward raised says
so in the process group's store, under the step's number, and:
- rank 0, when its own forward raised, waits up to GRACE_S for every rank to have said the same; if one has
  not, that rank is inside the forward's collectives and lockstep is lost (the engine answers 503 and exits);
- rank 0, while its forward runs (it did not raise), is watched by a thread of its own: once a rank has said
  its forward raised and rank 0's still has not ended GRACE_S later, rank 0 is stuck in a collective that
  rank will never join. The thread answers every request 503 and ends the process; torchrun stops the rest.

Nothing here costs a step that ran: the store is read only while a forward has run for POLL_S, and written
only by a rank whose forward raised.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from autotp import hosts
from autotp.distributed import exited_rank, peer_lost

GRACE_S = 5.0  # ranks that fail alike fail within milliseconds of each other: a second rank's note comes sooner
POLL_S = 0.25
EXIT_SEEN_S = 2.0  # how long a lost peer's process on this host may take to show in /proc as exited
PREFIX = "autotp/serve/failed"


def gone(pid: int) -> bool:
    """Whether a process of this host has exited (a zombie its parent has not reaped yet included)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


class Watch:
    """This rank's view of the steps that failed: `failed` writes, `alike` and `who` read (see above). tag: the
    same on every rank and new for each engine of the process group (its channel's group name), so that an
    earlier engine's notes in the same store are never read as this one's."""

    def __init__(self, rank: int, tp: int, tag: str, ranks: range | None = None):
        self.rank, self.tp, self.tag = rank, tp, tag
        self.stage = ranks  # whose notes count: a pipeline stage's ranks, or (None) every rank
        self.store = dist.distributed_c10d._get_default_store() if tp > 1 else None
        if self.store is not None:  # so that rank 0 can name a rank that died where gloo's error does not
            self.store.set(f"{PREFIX}/{tag}/pid/{rank}", f"{hosts.key()} {os.getpid()}")

    @property
    def ranks(self) -> range:
        return range(self.tp) if self.stage is None else self.stage

    def died(self, e: BaseException, doing: str) -> str | None:
        """One line for a failure that is another rank's exit, naming it and what the ranks were `doing`; None
        for any other failure. A shared-memory collective names the rank; gloo's "Connection reset by peer"
        does not, so the ranks on this host whose process is gone are looked up."""
        exited = exited_rank(e)
        if exited is not None:
            return f"rank {exited.rank} (pid {exited.pid}) exited while the ranks were {doing}"
        if not peer_lost(e):
            return None
        peers = []  # (rank, pid) of the other ranks on this host
        try:
            for r in self.ranks:
                host, pid = self.store.get(f"{PREFIX}/{self.tag}/pid/{r}").decode().rsplit(" ", 1)
                if r != self.rank and host == hosts.key():
                    peers.append((r, int(pid)))
        except Exception:  # noqa: BLE001 - the store went with the ranks: say what the collective said
            peers = []
        # a killed process's sockets close before /proc shows it exited: the reset can come first
        deadline = time.monotonic() + EXIT_SEEN_S
        while True:
            dead = [f"rank {r} (pid {pid})" for r, pid in peers if gone(pid)]
            if dead or not peers or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        who = " and ".join(dead) + (" exited" if dead else "a rank exited (on another host, or its pid unknown)")
        return f"{who} while the ranks were {doing}: {type(e).__name__}: {e}".splitlines()[0][:300]

    def _key(self, step: int, rank: int) -> str:
        return f"{PREFIX}/{self.tag}/{step}/{rank}"

    def failed(self, step: int, message: str) -> None:
        """This rank's forward of `step` raised."""
        if self.store is not None:
            self.store.set(self._key(step, self.rank), message)

    def alike(self, step: int) -> bool:
        """Whether every rank said its forward of `step` raised, within GRACE_S."""
        if self.store is None:
            return True
        keys = [self._key(step, r) for r in self.ranks]
        deadline = time.monotonic() + GRACE_S
        while not self.store.check(keys):  # (store.wait logs a warning line per timeout)
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def who(self, step: int) -> list[tuple[int, str]]:
        """The ranks that said their forward of `step` raised, and what."""
        return [(r, self.store.get(self._key(step, r)).decode()) for r in self.ranks
                if self.store.check([self._key(step, r)])]


class StepWatchdog(threading.Thread):
    """Rank 0's thread: `begin(step)` before a forward, `end()` after it. abandon(message) answers every request
    and must not return (it ends the process)."""

    def __init__(self, watch: Watch, abandon: Callable[[str], None]):
        super().__init__(name="autotp-step-watchdog", daemon=True)
        self.watch, self.abandon = watch, abandon
        self.running: tuple[int, float] | None = None  # (step, when its forward began)

    def begin(self, step: int) -> None:
        self.running = (step, time.monotonic())

    def end(self) -> None:
        self.running = None

    def run(self) -> None:
        while True:
            time.sleep(POLL_S)
            running = self.running
            if running is None or time.monotonic() - running[1] < POLL_S:
                continue
            try:
                failed = self.watch.who(running[0])
            except Exception:  # noqa: BLE001 - the store is gone: the engine's own collectives fail too
                return
            if not failed:
                continue
            deadline = time.monotonic() + GRACE_S
            while self.running == running and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.running == running:
                rank, message = failed[0]
                self.abandon(f"rank {rank}'s forward of a step failed and rank 0 waits for it in a collective: "
                             f"{message}")
                os._exit(1)
