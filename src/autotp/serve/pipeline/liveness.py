"""Liveness across hosts: every rank of a pipeline beats in the rendezvous store and watches every other rank's beat.

gloo notices a peer whose process ended (its connections close), but not a host that lost power or whose link went
down: a receive from it waits for the group's timeout, minutes. Here every rank adds 1 to a counter of its own every
BEAT_S, through a store client of its own, reads everyone's, and calls `lost(line)` where
- a rank's counter has not moved for LOST_S: its host stopped, or the network to it did; the line names its stage,
  rank and host. Where that rank runs on this host (the same node rank: hostnames may repeat) and its process is
  alive, it is stalled (stopped by SIGSTOP or a debugger, or stuck): the line says so, and under autotp's launcher
  this rank notes it (autotp.launch.STALLED), so that the launcher ends it at once and names it stalled, instead of
  waiting out its grace period for a process that cannot exit and then naming its own SIGKILL;
- this rank's own beat has not gone through for LOST_S: the store's host (MASTER_ADDR), or the link to it, is gone.
  A second thread watches the first, because a store operation over a link that went down does not fail: it waits
  for an answer with no deadline (TCPStore's timeout covers waiting for keys, not a reply that never comes);
- a rank posted a fatal line (`fatal`): its forward failed where its stage's other ranks' did not, which leaves those
  waiting in a collective that will never end.
`lost` answers what it can and ends the process: rank 0 answers every request 503 first. `exited` tells a peer of
this host whose process ended (the launcher names it) from one that is lost.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from autotp import hosts
from autotp.launch import STALLED
from autotp.parallel.shm import PeerGone
from autotp.parallel.stages import Stages
from autotp.serve.lockstep.watchdog import EXIT_SEEN_S, gone

BEAT_S = 1.0
LOST_S = float(os.environ.get("AUTOTP_LIVENESS_S", 6.0))  # clients get 503 within this and a beat
PREFIX = "autotp/pipeline"


def store_client(timeout_s: float) -> dist.TCPStore:
    """A client of the rendezvous store (torchrun's agent's, or rank 0's own) with a connection of its own."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


class Liveness(threading.Thread):
    """This rank's beat and watch (see the module). tag: the same on every rank, new for each server."""

    def __init__(self, rank: int, stages: Stages, tag: str, lost: Callable[[str], None]):
        super().__init__(name="autotp-liveness", daemon=True)
        self.rank, self.stages, self.on_lost = rank, stages, lost
        self.once = threading.Lock()
        self.prefix = f"{PREFIX}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{tag}"
        self.store = store_client(LOST_S)
        self.addr = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"  # the store's, for the lines
        self.store.set(f"{self.prefix}/host/{rank}", f"{hosts.node()}\t{os.getpid()}\t{socket.gethostname()}")
        self.armed = True
        self.beaten = time.monotonic()  # when this rank's beat last went through
        self.watcher = threading.Thread(target=self._watch_self, name="autotp-liveness-watch", daemon=True)

    def start(self) -> None:
        super().start()
        self.watcher.start()

    def _watch_self(self) -> None:
        while self.armed:
            time.sleep(BEAT_S)
            silent = time.monotonic() - self.beaten
            if silent > LOST_S and self.armed:
                self.lost(f"rank {self.rank} has not reached the rendezvous store at {self.addr} for {silent:.0f} s: "
                          f"its host, or the network to it, is gone")
                return

    def lost(self, line: str) -> None:
        """on_lost(line), once, whichever thread finds it first (the other waits: the process is ending)."""
        if self.once.acquire(blocking=False):
            self.on_lost(line)
        else:
            time.sleep(3600)

    def _said(self, rank: int) -> tuple[str, int, str] | None:
        """(node, pid, hostname) that `rank` said, or None where the store cannot say."""
        try:
            node, pid, host = self.store.get(f"{self.prefix}/host/{rank}").decode().split("\t", 2)
        except Exception:  # noqa: BLE001 - the store is gone, or the rank never said
            return None
        return node, int(pid), host

    def who(self, rank: int) -> str:
        """'stage 1 (rank 2 on host-b)'."""
        said = self._said(rank)
        host = said[2] if said else "a host that never said its name"
        return f"stage {self.stages.stage(rank)} (rank {rank} on {host})"

    def _local_pid(self, rank: int) -> int | None:
        """The pid of `rank` where it runs on this host (its node rank is this one's), else None."""
        said = self._said(rank)
        return said[1] if said and said[0] == str(hosts.node()) else None

    def exited(self, rank: int) -> PeerGone | None:
        """`rank`'s process, on this host, has exited (a lost connection to it can show before /proc does): said as
        the shared-memory collective says it, so that a rank whose launcher names the exit adds nothing."""
        pid = self._local_pid(rank)
        deadline = time.monotonic() + EXIT_SEEN_S
        while pid is not None:
            if gone(pid):
                return PeerGone(rank, pid)
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)
        return None

    def _silent(self, rank: int, silent_s: float) -> str:
        """The line for a rank whose beat has not moved for silent_s; a stalled process of this host is noted for the
        launcher (see the module)."""
        pid = self._local_pid(rank)
        state = None if pid is None else process_state(pid)
        if state is None:
            return f"{self.who(rank)} has not answered for {silent_s:.0f} s: its host stopped, or the network to it"
        if os.environ.get(STALLED):
            note = Path(os.environ[STALLED]) / f"{rank}"
            note.with_suffix(".new").write_text(f"{pid}\t{os.getpid()}\t{state}")
            note.with_suffix(".new").replace(note)  # whole, or not at all, for the launcher's poll
        return f"{self.who(rank)}, pid {pid}, has not answered for {silent_s:.0f} s: its process is {state}"

    def fatal(self, line: str) -> None:
        """Every rank's watch calls lost(line) within a beat (the first line posted wins)."""
        try:
            self.store.compare_set(f"{self.prefix}/fatal", "", line)
        except Exception:  # noqa: BLE001 - the store is gone: the others lose this rank's beat instead
            pass

    def stop(self) -> None:
        """The server stops in order: peers that leave are not lost."""
        self.armed = False

    def run(self) -> None:
        others = [r for r in range(self.stages.world) if r != self.rank]
        seen = {r: (-1, time.monotonic()) for r in others}
        beat = f"{self.prefix}/beat"
        while self.armed:
            started = time.monotonic()
            try:
                self.store.add(f"{beat}/{self.rank}", 1)
                counts = {r: self.store.add(f"{beat}/{r}", 0) for r in others}
                fatal = self.store.check([f"{self.prefix}/fatal"]) and self.store.get(f"{self.prefix}/fatal").decode()
            except Exception as e:  # noqa: BLE001 - DistStoreError, a timeout, a closed connection
                if self.armed:
                    self.lost(f"rank {self.rank} lost the rendezvous store at {self.addr} (its host, or the network to "
                              f"it, is gone): {type(e).__name__}: {e}".splitlines()[0][:300])
                return
            now = self.beaten = time.monotonic()
            if fatal and self.armed:
                self.lost(fatal)
                return
            for r, count in counts.items():
                if count != seen[r][0]:
                    seen[r] = (count, now)
                elif now - seen[r][1] > LOST_S and self.armed:
                    self.lost(self._silent(r, now - seen[r][1]))
                    return
            time.sleep(max(0.0, BEAT_S - (time.monotonic() - started)))


def process_state(pid: int) -> str | None:
    """What a live process of this host is doing, in words, from /proc/PID/stat; None where it has exited."""
    if gone(pid):
        return None
    try:
        code = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return {"T": "stopped (SIGSTOP, or a job control stop)", "t": "stopped by a debugger",
            "D": "stuck in the kernel (uninterruptible sleep)"}.get(code, "alive but not beating (stuck)")
