"""Liveness across hosts: every rank of a pipeline beats in the rendezvous store and watches every other rank's beat.

gloo notices a peer whose process ended (its connections close), but not a host that lost power or whose link went
down: a receive from it waits for the group's timeout, minutes. Here every rank adds 1 to a counter of its own every
BEAT_S, through a store client of its own, reads everyone's, and calls `lost(line)` where
- a rank's counter has not moved for LOST_S: its host stopped, or the network to it did; the line names its stage,
  rank and host;
- this rank's own beat has not gone through for LOST_S: the store's host (MASTER_ADDR), or the link to it, is gone.
  A second thread watches the first, because a store operation over a link that went down does not fail: it waits
  for an answer with no deadline (TCPStore's timeout covers waiting for keys, not a reply that never comes);
- a rank posted a fatal line (`fatal`): its forward failed where its stage's other ranks' did not, which leaves those
  waiting in a collective that will never end.
`lost` answers what it can and ends the process: rank 0 answers every request 503 first.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from autotp.parallel.stages import Stages

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
        self.store.set(f"{self.prefix}/host/{rank}", socket.gethostname())
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

    def who(self, rank: int) -> str:
        """'stage 1 (rank 2 on host-b)'."""
        try:
            host = self.store.get(f"{self.prefix}/host/{rank}").decode()
        except Exception:  # noqa: BLE001 - named without its host where the store cannot say
            host = "a host that never said its name"
        return f"stage {self.stages.stage(rank)} (rank {rank} on {host})"

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
                    self.lost(f"{self.who(r)} has not answered for {now - seen[r][1]:.0f} s: its host stopped, or "
                              f"the network to it")
                    return
            time.sleep(max(0.0, BEAT_S - (time.monotonic() - started)))
