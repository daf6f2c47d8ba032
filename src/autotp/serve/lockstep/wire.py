"""The one message per step: rank 0's `Step` (step.py), broadcast to every rank on a gloo group of its own.

A step is a few hundred bytes (the running requests' next tokens, the ones that ended, a new one's sampling
parameters), sent as one broadcast of a fixed BUFFER-byte tensor: its first 8 bytes give the pickled step's length.
A step that does not fit (a long prompt's chunk, say) is sent whole in a second broadcast of exactly its size. So a
decode step costs one collective beyond the model's own, whatever happens in it: who leaves, who is cancelled, what
the next tokens are. NCCL runs keep NCCL for the model; this group is gloo, on CPU tensors, and its ranks on one host
broadcast through shared memory (parallel/shm.py: ~10 us for 4 KiB against gloo's ~1 ms). Pickle is safe here: only
rank 0's own process writes it.
"""

from __future__ import annotations

import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

from autotp import distributed
from autotp.parallel import shm
from autotp.serve.lockstep.step import Step

BUFFER = 4096
HEADER = 8
TIMEOUT_S = 60  # no broadcast waits longer than a heartbeat plus one step (a long prefill chunk included)


def frame(data: bytes, head: torch.Tensor) -> torch.Tensor | None:
    """data into head, a message of BUFFER bytes: its length in the first HEADER bytes, then data where it fits. The
    second message, data whole in exactly its size, where it does not fit (None where it does)."""
    head[:HEADER] = torch.frombuffer(bytearray(len(data).to_bytes(HEADER, "little")), dtype=torch.uint8)
    if len(data) <= BUFFER - HEADER:
        head[HEADER:HEADER + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return None
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def unframe(head: torch.Tensor) -> tuple[int, bytes | None]:
    """What a head message (`frame`) says: the data's length, and the data where it fit (None: it follows, whole)."""
    size = int.from_bytes(head[:HEADER].numpy().tobytes(), "little")
    return size, head[HEADER:HEADER + size].numpy().tobytes() if size <= BUFFER - HEADER else None


class Channel:
    """rank 0 `send`s, every other rank `recv`s, once per step. group None (one rank): nothing is sent.
    ranks: the ranks it reaches (a pipeline's first stage; default every rank), rank 0 among them. Every rank makes
    it (a process group is made by the world); on a rank outside `ranks` it does nothing."""

    def __init__(self, ranks: range | None = None):
        self.group = self.local = None
        world = distributed.world_size()
        ranks = range(world) if ranks is None else ranks
        if len(ranks) > 1:
            group = dist.new_group(list(ranks) if len(ranks) < world else None, backend="gloo",
                                   timeout=timedelta(seconds=TIMEOUT_S))
            if distributed.rank() in ranks:
                self.group = group
                self.local = shm.for_group(self.group.group_name, self.group)
        self.size = len(ranks)
        self.buffer = torch.zeros(BUFFER, dtype=torch.uint8)

    def _broadcast(self, x: torch.Tensor) -> None:
        if self.local is not None:
            self.local.broadcast(x)
        else:
            dist.broadcast(x, src=0, group=self.group)

    def send(self, step: Step) -> None:
        self.send_raw(pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL))

    def send_raw(self, data: bytes) -> None:
        """A step already pickled (a pipeline hands the same bytes on to the next stage)."""
        if self.group is None:
            return
        rest = frame(data, self.buffer)
        self._broadcast(self.buffer)
        if rest is not None:
            self._broadcast(rest)

    def recv(self) -> Step:
        return pickle.loads(self.recv_raw())

    def recv_raw(self) -> bytes:
        self._broadcast(self.buffer)
        size, data = unframe(self.buffer)
        if data is None:
            whole = torch.empty(size, dtype=torch.uint8)
            self._broadcast(whole)
            data = whole.numpy().tobytes()
        return data

    def tag(self) -> str:
        """A name the same on every rank and new for each channel of the process group."""
        return "" if self.group is None else self.group.group_name

    def share(self, value):
        """rank 0's value on every rank: start-up only, never per step."""
        if self.group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def close(self) -> None:
        """Destroy the group (its gloo threads must not outlive the interpreter's finalization)."""
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None

    def gather(self, value) -> list:
        """Every rank's value on every rank: start-up only, never per step."""
        if self.group is None:
            return [value]
        out = [None] * self.size
        dist.all_gather_object(out, value, group=self.group)
        return out
