"""All-reduce and all-gather through shared memory, for CPU ranks on one host.

gloo's collectives go through TCP loopback: 0.1-1.6 ms each on this project's machines, and a SmolLM2 decode
token at tp 2 makes 62 of them. Ranks that share a host instead meet in one shared segment per process group:
each rank copies its tensor into its slot, waits at a barrier, and reads every slot. The barrier is C
(shm_wait.c, through ctypes, which releases the GIL: rank 0's HTTP threads run while it waits); the copies
and sums are torch's.

The segment, SLOT_BYTES per rank in each of two halves:
    [0, 4)             the barrier's counter (uint32; collective k is complete at (k + 1) * tp)
    [64, 68)           how many ranks sleep on it (uint32)
    [128, 128 + 4 tp)  each rank's pid (int32), so a waiting rank sees a peer that died
    [HEADER, ...)      data: (2, tp, SLOT_BYTES) bytes
Collective k uses half k % 2. A rank writes that half at collective k only after the barrier of collective
k - 1, which every rank passes only after reading collective k - 2's half, the same one: one barrier per
collective and never a stale read. A tensor larger than a slot goes through in slot-sized pieces.

The sum: every rank adds the tp slots with one `torch.sum` over the rank dim (in rank order; bfloat16 and
float16 accumulate in float32 and round once), the same op on the same bytes, so every rank gets the same
bits. At tp 2 that is gloo's sum bit for bit (one addition); at tp >= 3 gloo adds in another order.

The segment's name is unlinked once every rank has mapped it, so nothing is left in /dev/shm after any exit,
a crash included: the memory goes with the last process that maps it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import socket
import uuid
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from autotp.parallel import native

SLOT_BYTES = 2 << 20  # a 512-token prefill's all-reduce at hidden 1024 in float32 goes in one piece
HEADER = 4096
PIDS = 128
DIRECTORY = "/dev/shm"
DEFAULT_TIMEOUT_S = 600.0
SPIN_S = 1e-3  # 64 KB at tp 2, measured when written: 43 us spinning up to 1 ms, 128 us up to 50 us then a futex


class PeerGone(RuntimeError):
    """A rank's process exited while the others waited for it in a shared-memory collective: which one (its
    rank in the group) and its pid."""

    def __init__(self, rank: int, pid: int):
        super().__init__(f"rank {rank} (pid {pid}) exited during a shared-memory collective")
        self.rank, self.pid = rank, pid


_arrive = None
# Why the barrier could not be built, once per process, not once per group. Kept as text: a kept exception's
# traceback holds the frame of the _open that raised it, and so its process group, alive past
# destroy_process_group until interpreter teardown, where gloo's threads abort the process ("terminate called").
_unbuilt: str | None = None


def _barrier():
    """shm_wait.c's autotp_shm_arrive, built and loaded on first use; a build that failed is not tried again
    (serve opens two process groups: the second would run the compiler, and warn, again)."""
    global _arrive, _unbuilt
    if _unbuilt is not None:
        raise RuntimeError(_unbuilt)
    if _arrive is None:
        try:
            lib = ctypes.CDLL(str(native.build(Path(__file__).with_name("shm_wait.c"))))
        except Exception as e:
            _unbuilt = f"{type(e).__name__}: {e}"
            raise RuntimeError(_unbuilt) from None
        f = lib.autotp_shm_arrive
        f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32,
                      ctypes.c_longlong, ctypes.c_int, ctypes.c_longlong]
        f.restype = ctypes.c_int
        _arrive = f
    return _arrive


class ShmGroup:
    """One process group's shared segment, mapped by this rank (see the module docstring)."""

    def __init__(self, segment: mmap.mmap, rank: int, tp: int, timeout_s: float):
        self.segment, self.rank, self.tp = segment, rank, tp
        with torch.inference_mode(False):  # opened inside a forward maybe, used outside one too
            raw = torch.frombuffer(segment, dtype=torch.uint8)
            self.data = raw[HEADER:].view(2, tp, SLOT_BYTES)
        base = raw.data_ptr()
        self.args = (ctypes.c_void_p(base), ctypes.c_void_p(base + 64), ctypes.c_void_p(base + PIDS), tp)
        self.pids = raw[PIDS:PIDS + 4 * tp].view(torch.int32)
        # spin up to SPIN_S before sleeping; with more ranks than cores, yield the core at every turn
        self.waiting = (int(SPIN_S * 1e9), int(tp > len(os.sched_getaffinity(0))), int(timeout_s * 1e9))
        self.calls = 0
        self.broken: Exception | None = None
        self.views: dict[tuple[int, torch.dtype, int], tuple[torch.Tensor, ...]] = {}
        self.arrive = _barrier()

    def _slots(self, dtype: torch.dtype, n: int) -> tuple[torch.Tensor, ...]:
        """This collective's half as `dtype`, its first n elements per rank: (tp, n), then each rank's (n,).
        Views cost microseconds each, so they are kept: a decode step asks for the same few sizes again."""
        key = (self.calls & 1, dtype, n)
        views = self.views.get(key)
        if views is None:
            if len(self.views) > 256:  # prompts of every length: keep the decode sizes, not all of them
                self.views.clear()
            with torch.inference_mode(False):  # used inside and outside forwards alike
                whole = self.data[key[0]].view(dtype)[:, :n]
                views = self.views[key] = (whole, *whole.unbind(0))
        return views

    def _wait(self) -> None:
        if self.broken is not None:
            raise self.broken
        self.calls += 1
        code = self.arrive(*self.args, (self.calls * self.tp) & 0xFFFFFFFF, *self.waiting)
        if code > 0:
            self.broken = PeerGone(code - 1, int(self.pids[code - 1]))
            raise self.broken
        if code < 0:
            self.broken = RuntimeError(f"a shared-memory collective waited {self.waiting[2] / 1e9:.0f} s for the "
                                       f"other ranks")
            raise self.broken

    def _pieces(self, x: torch.Tensor):
        """x's elements in slot-sized pieces: (offset, flat piece) each."""
        flat = x.view(-1)
        per = SLOT_BYTES // x.element_size()
        if flat.numel() <= per:
            return ((0, flat),)
        return ((a, flat[a:a + per]) for a in range(0, flat.numel(), per))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; x contiguous, on CPU."""
        if x.requires_grad and torch.is_grad_enabled():  # as gloo's all-reduce, which autograd does not see
            with torch.no_grad():
                return self.all_reduce(x)
        for _, piece in self._pieces(x):
            whole, *rows = self._slots(x.dtype, piece.numel())
            rows[self.rank].copy_(piece)
            self._wait()
            if self.tp == 2:  # one addition, rounded once: torch.sum's result, sooner
                torch.add(rows[0], rows[1], out=piece)
            else:
                torch.sum(whole, dim=0, out=piece)
        return x

    @torch.no_grad()
    def broadcast(self, x: torch.Tensor, root: int = 0) -> torch.Tensor:
        """The group rank `root`'s x, into x on every rank; x contiguous, on CPU."""
        for _, piece in self._pieces(x):
            _, *rows = self._slots(x.dtype, piece.numel())
            if self.rank == root:
                rows[root].copy_(piece)
            self._wait()
            if self.rank != root:
                piece.copy_(rows[root])
        return x

    @torch.no_grad()
    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """(tp, *x.shape): every rank's x; x contiguous, on CPU."""
        out = x.new_empty((self.tp, x.numel()))
        for a, piece in self._pieces(x):
            whole, *rows = self._slots(x.dtype, piece.numel())
            rows[self.rank].copy_(piece)
            self._wait()
            out[:, a:a + piece.numel()].copy_(whole)
        return out.view(self.tp, *x.shape)


_groups: dict[str, tuple[weakref.ref, ShmGroup | None]] = {}


def for_group(name: str, group: dist.ProcessGroup) -> ShmGroup | None:
    """The shared segment of `group` (named `name`), opened at its first CPU collective on every rank alike;
    None where its ranks do not share a host, its backend is not gloo, or the segment cannot be made."""
    known = _groups.get(name)
    if known is not None and known[0]() is group:
        return known[1]
    shm = _open(group)
    _groups[name] = (weakref.ref(group), shm)
    return shm


def _host() -> tuple:
    """What ranks on one host, able to share memory and see each other's processes, have in common."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    namespaces = tuple(os.readlink(f"/proc/self/ns/{ns}") if os.path.exists(f"/proc/self/ns/{ns}") else ""
                       for ns in ("ipc", "pid", "mnt"))
    return socket.gethostname(), boot.read_text().strip() if boot.exists() else "", namespaces


def _timeout_s(group: dist.ProcessGroup) -> float:
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except Exception:  # noqa: BLE001 - a private attribute: the default where a torch release lacks it
        return DEFAULT_TIMEOUT_S


def _open(group: dist.ProcessGroup) -> ShmGroup | None:
    """Collective over `group`: every rank agrees whether to use shared memory, and maps the segment."""
    if "gloo" not in str(dist.get_backend(group)):
        return None
    rank, tp = group.rank(), group.size()
    why = "AUTOTP_SHM=0" if os.environ.get("AUTOTP_SHM", "1") == "0" else ""
    if not why:
        try:
            _barrier()
        except RuntimeError as e:  # no compiler, no writable cache: gloo serves
            why = str(e)
    everyone = [None] * tp
    dist.all_gather_object(everyone, (_host(), why), group=group)
    if any(w for _, w in everyone) or len({h for h, _ in everyone}) > 1:
        reasons = sorted({w for _, w in everyone if w})
        if rank == 0 and reasons and reasons != ["AUTOTP_SHM=0"]:
            _off(reasons[0])
        return None
    size = HEADER + 2 * tp * SLOT_BYTES
    name = [f"autotp-{os.getpid()}-{uuid.uuid4().hex[:12]}" if rank == 0 else None]
    dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0), group=group)
    path = os.path.join(DIRECTORY, name[0])
    try:
        segment, why = _map(path, size, create=True) if rank == 0 else (None, "")
        dist.barrier(group=group)  # rank 0 made it before the others open it
        if rank != 0:
            segment, why = _map(path, size, create=False)
        if segment is not None:
            torch.frombuffer(segment, dtype=torch.int32, count=tp, offset=PIDS)[rank] = os.getpid()
        dist.all_gather_object(everyone, why, group=group)  # and every pid is written before anyone waits
    finally:
        if rank == 0:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    if any(everyone):
        if rank == 0:
            _off(next(w for w in everyone if w))
        return None
    return ShmGroup(segment, rank, tp, _timeout_s(group))


_said: set[str] = set()


def _off(why: str) -> None:
    """Rank 0's one line when shared memory cannot be used (this module imports no autotp rank plumbing), once
    per process for each reason: every process group that cannot use it for the same reason says nothing new."""
    if why not in _said:
        _said.add(why)
        print(f"autotp: warning: shared-memory collectives are off, gloo carries them ({why})", flush=True)


def _map(path: str, size: int, create: bool) -> tuple[mmap.mmap | None, str]:
    """The segment at `path` mapped (made first where `create`), or why it could not be."""
    try:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            return mmap.mmap(fd, size), ""
        finally:
            os.close(fd)
    except OSError as e:
        return None, f"{type(e).__name__}: {e}"
