"""Rank plumbing: process-group set-up from the launcher's environment, rank-aware printing.

torchrun and the `deepspeed` launcher both export RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT; multi-node torchrun (rendezvous) exports the same. CUDA ranks use NCCL on device
LOCAL_RANK, CPU ranks use gloo. A plain single process, with no WORLD_SIZE, is tp 1 with no group.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401 - before any group exists: see _destroy_at_exit

from autotp import hosts
from autotp.errors import AutotpError
from autotp.parallel.shm import PeerGone

RENDEZVOUS_TIMEOUT_S = 300  # how long rank 0 waits for the others to start (AUTOTP_RENDEZVOUS_TIMEOUT)
WAIT_NOTICE_S = 5  # after this, rank 0 says what it is waiting for
# fail()'s fallback: a rank that posts its failure and hears nothing from rank 0 for this long speaks itself
FAILURE_WAIT_S = 5
# ... and for a failure of the command line, which rank 0 is certain to have too (it parses the same argv):
# long enough for a rank 0 that a busy machine holds back
COMMAND_LINE_WAIT_S = 60


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    group: dist.ProcessGroup | None  # None when world_size == 1


@dataclass
class _Process:
    """What `fail` needs to know about this process's part in its group."""

    joining: bool = False  # init() was called: a failure from then on may be this rank's own, not the command line's
    hosts_store: bool = False  # rank 0 of a group made by autotp's own rendezvous: the store lives here
    failures: int = 0  # failures posted so far; every rank numbers the same failure alike


_PROCESS = _Process()


def _env_int(name: str, default: int | None) -> int | None:
    value = os.environ.get(name)
    try:
        return default if value is None else int(value)
    except ValueError:
        raise AutotpError(f"environment variable {name}={value!r} is not an integer") from None


def resolve_device(device: str | torch.device | None, local_rank: int | None,
                   bound: torch.device | None = None) -> torch.device:
    """The device this rank runs on: cuda:LOCAL_RANK when CUDA is present (or asked for), else cpu.

    Never the global rank: on a second node, rank 4 may own cuda:0. With one visible GPU (a launcher
    that sets CUDA_VISIBLE_DEVICES per rank) every rank's GPU is cuda:0. `bound` is the GPU a process
    group the user made is bound to (init_process_group(device_id=...)): a request that disagrees
    with it is an error, not a second device.
    """
    if device is None:
        device = bound or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise AutotpError("device 'cuda' was asked for but torch sees no CUDA device")
    count = torch.cuda.device_count()
    if device.index is None:
        if count == 1:
            device = torch.device("cuda", 0)
        elif local_rank is None:
            raise AutotpError(f"LOCAL_RANK is not set, so this rank cannot tell which of the {count} GPUs is its "
                              "own: launch with torchrun or deepspeed (they set it), or pass device='cuda:N'")
        else:
            device = torch.device("cuda", local_rank)
    if device.index >= count:
        owner = f"LOCAL_RANK {local_rank}" if local_rank is not None else "this rank"
        raise AutotpError(f"{owner} wants {device}, but torch sees {count} GPU{'s' * (count != 1)}")
    if bound is not None and device != bound:
        raise AutotpError(f"device {device} was asked for, but this rank's process group is bound to {bound}")
    return device


def gpu_uuid(device: torch.device) -> str:
    """The physical GPU behind a logical CUDA device: its UUID. CUDA_VISIBLE_DEVICES renumbers the GPUs each
    process sees, so under a launcher that gives every rank its own GPU (SLURM --gpus-per-task=1, Kubernetes
    device plugins) every rank is cuda:0 of a different GPU. Where torch has no UUID, the logical name."""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return str(uuid) if uuid else str(device)


def shared_gpus(placements: list[tuple[str, str, str]]) -> list[list[int]]:
    """placements[rank] = (host, device, physical GPU) -> the groups of ranks that would share one GPU."""
    owners: dict[tuple[str, str], list[int]] = {}
    for rank, (host, device, gpu) in enumerate(placements):
        if device.startswith("cuda"):
            owners.setdefault((host, gpu), []).append(rank)
    return [ranks for ranks in owners.values() if len(ranks) > 1]


def _check_one_gpu_per_rank(device: torch.device, group) -> None:
    """Two ranks on one GPU run (NCCL may even hang): say so on every rank instead."""
    placements: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(placements, (hosts.where(), str(device), gpu_uuid(device)), group=group)
    clashes = shared_gpus(placements)
    if clashes:
        ranks = clashes[0]
        raise AutotpError(f"ranks {', '.join(map(str, ranks))} all run on {placements[ranks[0]][1]} of "
                          f"{placements[ranks[0]][0]}: give each rank its own GPU (device='cuda' picks LOCAL_RANK's)")


def _rendezvous(rank: int, world: int, timeout: timedelta) -> dist.Store | None:
    """Wait for all `world` ranks at MASTER_ADDR:MASTER_PORT, saying on rank 0 what it waits for.

    torch's own env:// rendezvous waits silently for the whole collective timeout when a rank never
    starts. Here rank 0 hosts the store, counts who joined, prints one line after WAIT_NOTICE_S and
    gives up after AUTOTP_RENDEZVOUS_TIMEOUT. Under torchrun (agent store) torchrun has done this wait
    already: None, and init_process_group rendezvouses as usual.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    addr, port = os.environ["MASTER_ADDR"], _env_int("MASTER_PORT", 0)
    wait_s = float(os.environ.get("AUTOTP_RENDEZVOUS_TIMEOUT", RENDEZVOUS_TIMEOUT_S))
    try:
        store = dist.TCPStore(addr, port, world, is_master=rank == 0, timeout=timedelta(seconds=wait_s),
                              wait_for_workers=False)
    except (RuntimeError, OSError) as e:  # DistStoreError / DistNetworkError are RuntimeErrors
        where = "host the rendezvous" if rank == 0 else "reach rank 0"
        raise AutotpError(f"rank {rank} cannot {where} at {addr}:{port} within {wait_s:.0f} s "
                          f"(AUTOTP_RENDEZVOUS_TIMEOUT): {str(e).splitlines()[0]}") from None
    joined = store.add("autotp/joined", 1)
    start, noticed = time.monotonic(), False
    while rank == 0 and joined < world:
        waited = time.monotonic() - start
        if waited > wait_s:
            raise AutotpError(f"only {joined} of {world} ranks joined at {addr}:{port} within {wait_s:.0f} s "
                              f"(AUTOTP_RENDEZVOUS_TIMEOUT): start all {world} processes, e.g. with "
                              f"torchrun --nproc-per-node {world}")
        if waited > WAIT_NOTICE_S and not noticed:
            print(f"autotp: waiting for {world - joined} of {world} ranks at {addr}:{port}", file=sys.stderr,
                  flush=True)
            noticed = True
        time.sleep(0.05)
        joined = store.add("autotp/joined", 0)
    store.set_timeout(timeout)
    return store


def init(device: str | torch.device | None = None, timeout_s: float | None = None) -> Dist:
    """Join (or reuse) the default process group described by the environment; the rank's GPU, if it has
    one, becomes the current CUDA device (object collectives and NCCL barriers use the current one)."""
    _PROCESS.joining = True
    local_rank = _env_int("LOCAL_RANK", None)
    existing = dist.is_initialized()
    if not existing and _env_int("RANK", 0) == 0:
        _checks_passed()
    if existing:
        rank, world = dist.get_rank(), dist.get_world_size()
        bound = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)
        if device is None and bound is None and dist.get_backend() == "gloo":
            device = "cpu"
        dev = resolve_device(device, local_rank, bound)
    else:
        world, rank = _env_int("WORLD_SIZE", 1), _env_int("RANK", 0)
        dev = resolve_device(device, local_rank if world > 1 else 0)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world == 1:
        return Dist(rank, 1, 0, dev, None)
    if not existing:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in os.environ:
                raise AutotpError(f"WORLD_SIZE={world} but {name} is not set: launch with torchrun or deepspeed")
        timeout = timedelta(seconds=timeout_s or float(os.environ.get("AUTOTP_TIMEOUT", 600)))
        hosts.choose_interface(local_rank)
        store = _rendezvous(rank, world, timeout)
        _PROCESS.hosts_store = store is not None and rank == 0
        kwargs = {} if store is None else dict(store=store, rank=rank, world_size=world)
        if dev.type == "cuda":
            dist.init_process_group("nccl", timeout=timeout, device_id=dev, **kwargs)
        else:
            dist.init_process_group("gloo", timeout=timeout, **kwargs)
        _destroy_at_exit(dist.group.WORLD)
    if dev.type == "cuda":
        _check_one_gpu_per_rank(dev, dist.group.WORLD)
    return Dist(rank, world, 0 if local_rank is None else local_rank, dev, dist.group.WORLD)


def stage_dist(env: Dist, tp: int, pp: int) -> Dist:
    """This rank's pipeline stage as a Dist of its own: its rank within the stage, the stage's `tp` ranks and their
    process group (the stage's tensor-parallel group, the world's backend: NCCL on GPUs, gloo on CPUs). Stage s is
    ranks [s * tp, (s + 1) * tp) (parallel/stages.py). Every rank makes every stage's group, in stage order
    (new_group is collective over the world); with tp 1 there are none."""
    if pp == 1:
        return env
    mine = None
    for s in range(pp if tp > 1 else 0):
        group = dist.new_group(list(range(s * tp, (s + 1) * tp)))
        if s == env.rank // tp:
            mine = group
    return Dist(env.rank % tp, tp, env.local_rank, env.device, mine)


def _destroy_at_exit(group: dist.ProcessGroup) -> None:
    """Destroy the process group autotp created when the interpreter exits, while it is still whole.

    A gloo collective's work holds its tensors, and the gloo worker thread that ran it lets go of them
    only after waking the caller. Letting go of a tensor that has a Python object takes the GIL, and once
    interpreter finalization has begun a thread that asks for the GIL is ended by pthread_exit, whose
    unwinding through the work's noexcept destructor calls std::terminate: "terminate called without an
    active exception", exit -6, after the script's last line (a core's stack: ProcessGroupGloo::runLoop ->
    ~AsyncAllreduceWork -> TensorImpl::decref_pyobject -> gil_scoped_acquire -> PyThread_exit_thread). A
    loaded machine, which runs the worker late, makes it likely. Destroying the group before finalization
    joins its workers first, provided nothing else holds it: autotp's modules name the group
    (collectives.GroupRef), and torch.distributed.nn, whose functions take `group=group.WORLD` as default
    arguments bound at import (transformers imports it with a model's modeling module, through
    torch.distributed.fsdp), is imported with this module, before any group exists, so that those
    defaults are None. A group the user made is the user's to destroy."""
    created = weakref.ref(group)

    def destroy() -> None:
        if dist.is_initialized() and dist.group.WORLD is created():
            dist.destroy_process_group()

    atexit.register(destroy)


def wire_device(env: Dist) -> torch.device:
    """Where a tensor must be for a collective on the group: NCCL reduces only device tensors."""
    return env.device if dist.get_backend(env.group) == "nccl" else torch.device("cpu")


def all_reduce_max(tensor: torch.Tensor, env: Dist) -> None:
    """In place, the elementwise MAX of `tensor` over the ranks (nothing to do on one rank)."""
    if env.group is None:
        return
    wired = tensor.to(wire_device(env))
    dist.all_reduce(wired, op=dist.ReduceOp.MAX, group=env.group)
    tensor.copy_(wired)


def sync_random_state(env: Dist) -> None:
    """Give every rank rank 0's CPU (and current CUDA device's) random state.

    Each process starts from its own random seed (torch >= 2.13 seeds from the OS), so a user's unseeded
    `generate(do_sample=True)` would draw different tokens on each rank and the all-reduces would then
    mix partial sums of different sequences. After this, unseeded sampling agrees on every rank, and a
    user's `torch.manual_seed(s)` (the same s everywhere) still agrees as before.
    """
    if env.group is None:
        return
    wire = wire_device(env)
    states = [(torch.get_rng_state, torch.set_rng_state)]
    if env.device.type == "cuda":
        states.append((torch.cuda.get_rng_state, torch.cuda.set_rng_state))
    for get, put in states:
        state = get().to(wire)
        dist.broadcast(state, src=0, group=env.group)
        put(state.cpu())


def rank() -> int:
    """This process's rank, also before the process group exists (from the launcher's RANK)."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    """The number of ranks of the process group; 1 before there is one."""
    return dist.get_world_size() if dist.is_initialized() else 1


def print0(*args, **kwargs) -> None:
    """print() on rank 0 only."""
    if rank() == 0:
        print(*args, **kwargs, flush=True)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def fail(message: str, code: int = 1, symptom: bool = False, rank_0_exited: bool = False) -> int:
    """Say this rank's failure in one line on stderr, once however many ranks have it; returns `code`.
    symptom: the failure is a peer that went away (`peer_lost`), the effect of another rank's failure;
    rank_0_exited: that peer is rank 0, whose process is gone (`exited_rank`): it posts nothing more, so what it
    posted is read at once instead of waited for.

    Rank 0 says its own: `autotp: error: MESSAGE`. Another rank says `autotp: error on rank N: MESSAGE`
    unless rank 0 has the same failure, and that is decided, not waited out:
    - in a process group, rank 0 posts its message to the group's store and every other failing rank reads
      it there: the same message, or a symptom of rank 0's failure, it stays silent; another, it speaks.
    - before this process called `init`, a failure comes from the command line, which every rank parses
      alike: rank 0 says it. Under torchrun the other ranks wait for it in torchrun's own store (its agent
      hosts it before any rank starts) before they exit: a rank that exits first would have torchrun stop
      rank 0 before it said anything. Without torchrun's store they exit silently. A rank that fails in
      `init`, before a group exists (its device, or it cannot reach rank 0), says so itself.
    Fallback, bounded in time: a rank that reads nothing from rank 0 within FAILURE_WAIT_S claims the line
    (rank 0 waits for it in a collective, or is slower to reach the same failure; torchrun stops it once this
    rank exits): the first rank to claim it speaks, and a later one, rank 0 included, only with another
    failure that is no symptom of the first. So one failure is one line, whichever rank is slow, and a rank
    that fails alone is named once, without its peers' "connection closed" after it. A rank 0 whose process
    hosts the store (a launch without torchrun) waits as long at most for the other ranks to have read its
    message before it exits and takes the store with it.
    """
    me = rank()
    if not symptom:  # the other hosts' ranks, which may wait for this one, stop and say why (hosts.py)
        hosts.WATCH.post_failure(me, message)
    store = key = None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if dist.is_initialized() and dist.get_world_size() > 1:
        store = dist.distributed_c10d._get_default_store()
        key = f"autotp/failure/{attempt}/{_PROCESS.failures}"
        _PROCESS.failures += 1
        speak = _speaks(store, key, me, message, symptom, 0 if rank_0_exited else FAILURE_WAIT_S)
    elif not _PROCESS.joining and (store := hosts.launcher_store(FAILURE_WAIT_S)) is not None:
        key = f"autotp/command-line/{attempt}"
        speak = _speaks(store, key, me, message, symptom, COMMAND_LINE_WAIT_S)
    else:
        speak = me == 0 or _PROCESS.joining
    if speak:
        prefix = "autotp: error" if me == 0 else f"autotp: error on rank {me}"
        print(f"{prefix}: {message}", file=sys.stderr, flush=True)
    if store is not None and me == 0:
        try:
            store.set(f"{key}/0", message)
        except RuntimeError:  # DistStoreError / DistNetworkError: the store is gone, and nobody to read it
            return code
        if _PROCESS.hosts_store:
            _wait_for(store, [f"{key}/heard/{r}" for r in range(1, dist.get_world_size())])
    return code


def exited_rank(e: BaseException) -> PeerGone | None:
    """The shared-memory collective's report, in e or what caused it, that a peer's process exited: it names the
    rank (its pid known gone, where gloo's "connection closed" names nobody); None if there is none."""
    while e is not None:
        if isinstance(e, PeerGone):
            return e
        e = e.__cause__ or e.__context__
    return None


def peer_lost(e: BaseException) -> bool:
    """Whether a failure is a collective that lost its peer (gloo's "Connection closed by peer" or "reset by
    peer", a store or network error): the effect of another rank's exit, not a cause of its own."""
    text = f"{type(e).__name__}: {e}"
    return isinstance(e, dist.DistNetworkError | PeerGone) or any(
        s in text for s in ("closed by peer", "reset by peer", "Broken pipe", "remote process exited"))


def _speaks(store, key: str, me: int, message: str, symptom: bool, wait_s: float) -> bool:
    """Whether this rank says its failure (fail's rules)."""
    if me == 0:
        return _claim(store, key, message, symptom)
    heard = _rank_0_said(store, key, me, wait_s)
    if heard is None:
        return _claim(store, key, message, symptom)
    return heard != message and not symptom


def _checks_passed() -> None:
    """Rank 0 reached init(): its command line and every check before the group passed, so a rank that failed before
    init on its own (another host's files, say) need not wait for rank 0 to say the same (fail's COMMAND_LINE_WAIT_S)
    before it says its own. Posted no sooner: a check that fails alike on every rank is rank 0's to say."""
    if (store := hosts.launcher_store(FAILURE_WAIT_S)) is not None:
        try:
            store.set(f"autotp/command-line/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/passed", "1")
        except RuntimeError:
            pass


def _rank_0_said(store, key: str, me: int, wait_s: float) -> str | None:
    """Rank 0's message for this failure, or None if it posted none within wait_s (or its store is gone, or it reached
    init: _checks_passed); rank 0 hears that this rank has read it. wait_s 0: only what it has posted already."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if store.check([f"{key}/0"]):
                break
            if store.check([f"{key}/passed"]):
                return None
        except RuntimeError:
            return None
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)
    try:
        theirs = store.get(f"{key}/0").decode()
        store.set(f"{key}/heard/{me}", "1")
    except RuntimeError:  # rank 0's store went with its process
        return None
    return theirs


def _claim(store, key: str, message: str, symptom: bool) -> bool:
    """The first rank to claim this failure's line says it; a later one only another failure, not a symptom."""
    try:
        if store.add(f"{key}/claim", 1) == 1:
            store.set(f"{key}/said", message)
            return True
        if not _wait_for(store, [f"{key}/said"]):
            return not symptom
        said = store.get(f"{key}/said").decode()
    except RuntimeError:  # the store is gone: nobody else can say it
        return True
    return said != message and not symptom


def _wait_for(store, keys: list[str], wait_s: float = FAILURE_WAIT_S) -> bool:
    """Whether `keys` were all set within wait_s (0: whether they are set now, without waiting)."""
    try:
        if wait_s <= 0:
            return store.check(keys)
        store.wait(keys, timedelta(seconds=wait_s))
    except RuntimeError:  # timed out, or the store went with rank 0's process
        return False
    return True
