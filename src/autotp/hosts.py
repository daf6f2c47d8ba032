"""What ranks on several hosts need beyond one host's: the network interface that reaches the others, and a start-up
that ends on every host when one host's ranks fail.

- `choose_interface`: gloo binds the address its host's name resolves to, which on many machines is 127.0.1.1 or
  127.0.0.1 (/etc/hosts); then no other host can connect ("connectFullMesh ... Connection refused") and the first
  host fails while the second waits. Where the user set no GLOO_SOCKET_IFNAME, it is set to the interface that
  reaches MASTER_ADDR, and the first rank of each host says which.
- `StartupWatch`: under torchrun, a rank that fails posts its line (`post_failure`, called by distributed.fail) in
  the launcher's store, which every host reaches; every other host's ranks, waiting for it in the rendezvous or a
  collective that will never complete, see it within a poll and exit, the first rank of each host saying which host
  failed and why. Ranks of the failing host itself are torchrun's to stop. The watch ends when start-up does
  (`StartupWatch.stop`): once serving, a lost host is the pipeline's liveness to name (serve/pipeline/liveness.py).
- `check_in_for_agent`: torchrun's agents meet at an exit barrier in the store that the first host's agent hosts.
  After a Ctrl-C on the first host its agent never arrives and exits, taking the store, while the other hosts'
  agents, whose ranks the first host's rank 0 stopped in order, wait there: each printed the store's error, its C++
  frames and a traceback (two dozen lines) for a service stopped on purpose. Rank 0 checks in for its agent instead and
  keeps the store up until the barrier is met, so the other hosts exit 0 in silence.
- `node`: which host a rank is on, as its launcher numbers the hosts. Never the hostname, which two hosts may share
  (cloned VMs, containers, two torchruns on one machine); the name is only shown.
No torch.distributed process group is needed: the launcher's store exists before any rank starts.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

POLL_S = 0.5
OWN_FAILURE_S = 5.0  # a rank that fails too, alike (the same bad input on every host), says its own line instead


def _address_of(interface: str) -> str | None:
    """The IPv4 address of a network interface (SIOCGIFADDR), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", interface[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def route_to(addr: str) -> tuple[str, str] | None:
    """(interface, its address) that this host reaches `addr` through, by the kernel's routing table (a UDP socket's
    connect sends nothing); None where that is the loopback (one host) or cannot be told."""
    try:
        target = socket.getaddrinfo(addr, None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            local = s.getsockname()[0]
    except OSError:
        return None
    if ipaddress.ip_address(local).is_loopback:
        return None
    return next(((name, local) for _, name in socket.if_nameindex() if _address_of(name) == local), None)


def choose_interface(local_rank: int | None) -> None:
    """GLOO_SOCKET_IFNAME, where the user set none, to the interface that reaches MASTER_ADDR (the module docstring;
    NCCL_SOCKET_IFNAME likewise, for NCCL's own connections); said by the first rank of the host."""
    if os.environ.get("GLOO_SOCKET_IFNAME") or "MASTER_ADDR" not in os.environ:
        return
    found = route_to(os.environ["MASTER_ADDR"])
    if found is None:
        return
    name, local = found
    os.environ["GLOO_SOCKET_IFNAME"] = name
    os.environ.setdefault("NCCL_SOCKET_IFNAME", name)
    if not local_rank:
        print(f"autotp: {socket.gethostname()} reaches MASTER_ADDR {os.environ['MASTER_ADDR']} through {name} "
              f"({local}): the ranks use it (GLOO_SOCKET_IFNAME chooses another)", file=sys.stderr, flush=True)


def launcher_store(timeout_s: float):
    """A client of torchrun's own store, which its agent hosts at MASTER_ADDR:MASTER_PORT for the whole launch
    (TORCHELASTIC_USE_AGENT_STORE), or None: not under torchrun with more than one rank, or unreachable."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    try:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timedelta(seconds=timeout_s))
    except (KeyError, ValueError, RuntimeError):
        return None


def node() -> int | None:
    """This rank's host, as the launcher numbers them: torchrun's GROUP_RANK, the deepspeed launcher's CROSS_RANK,
    else RANK // LOCAL_WORLD_SIZE (ranks started by hand, host after host); None where nothing says it."""
    for name in ("GROUP_RANK", "CROSS_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    rank, per_host = os.environ.get("RANK", ""), os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE", "")
    if rank.isdigit() and per_host.isdigit() and int(per_host) > 0:
        return int(rank) // int(per_host)
    return None


def key() -> str:
    """This rank's host as a key that ranks compare ('node 1'): the node rank where the launcher gives one, the
    hostname only where nothing does (a script's own mp.spawn, all on one machine)."""
    n = node()
    return socket.gethostname() if n is None else f"node {n}"


def where() -> str:
    """This rank's host for a line: 'node 1 (host-b)', its hostname shown, not relied on."""
    n = node()
    return socket.gethostname() if n is None else f"node {n} ({socket.gethostname()})"


def check_in_for_agent(wait_s: float = 10.0) -> None:
    """On rank 0 of node 0 of a multi-host torchrun whose command ended well (module docstring): arrive at torchrun's
    exit barrier for this host's agent, and wait (at most wait_s) until every host's agent has. A second arrival of
    the same agent is harmless: the barrier only counts up to the number of hosts. The keys are those of torch's
    agent (elastic/agent/server/api.py _TERMINAL_STATE_SYNC_ID, elastic/utils/store.py barrier) under the static
    rendezvous's prefix (its run id), torchrun's default with --master-addr, where the agents' rank assignment is
    found; with --rdzv-backend c10d it is not, and this does nothing."""
    hosts = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    if hosts < 2 or node() != 0 or os.environ.get("LOCAL_RANK") != "0" or (store := launcher_store(2.0)) is None:
        return
    agents = os.environ.get("TORCHELASTIC_RUN_ID", "none")  # the static rendezvous's prefix of the agents' keys
    barrier = f"{agents}/torchelastic/agent/terminal_state"
    try:
        if not store.check([f"{agents}/torchelastic/assigned_ranks/0"]):  # another rendezvous: its keys are elsewhere
            return
        if store.add(f"{barrier}/num_members", 1) == hosts:
            store.set(f"{barrier}/last_member", "<val_ignored>")
        store.wait([f"{barrier}/last_member"], timedelta(seconds=wait_s))
    except RuntimeError:  # the other hosts are gone or slow: their agents say what they say
        pass


def _key() -> str:
    return f"autotp/failed/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


class StartupWatch:
    """One per process (`WATCH`): `begin` once the command line is good (a thread polls the store), `stop` once
    start-up is done."""

    def __init__(self):
        self.armed = False
        self.failing = False  # this process is saying its own failure (distributed.fail)

    def begin(self) -> None:
        if not self.armed and launcher_store(2.0) is not None:
            self.armed = True
            threading.Thread(target=self.run, name="autotp-startup-watch", daemon=True).start()

    def stop(self) -> None:
        self.armed = False

    def post_failure(self, rank: int, message: str) -> None:
        """This rank failed: the first failure posted is what the other hosts say."""
        self.failing = True
        store = launcher_store(2.0)
        if store is None:
            return
        try:
            store.compare_set(_key(), "", f"{rank}\t{node()}\t{where()}\t{message}")
        except RuntimeError:  # the store is gone with the launch: nobody is left to tell
            pass

    def run(self) -> None:
        store, here = launcher_store(2.0), str(node())
        while self.armed:
            time.sleep(POLL_S)
            try:
                posted = store.check([_key()]) and store.get(_key()).decode()
            except RuntimeError:  # the store's host is gone: the collectives this rank waits in fail on their own
                return
            if not posted:
                continue
            rank, posted_node, host, message = posted.split("\t", 3)
            if posted_node == here:  # a rank of this host: torchrun stops its peers here
                continue
            deadline = time.monotonic() + OWN_FAILURE_S
            while time.monotonic() < deadline and self.armed and not self.failing:
                time.sleep(0.1)
            if not self.armed or self.failing:
                return
            me = int(os.environ.get("RANK", "0"))
            if int(os.environ.get("LOCAL_RANK", "0")) == 0:
                prefix = "autotp: error" if me == 0 else f"autotp: error on rank {me}"
                print(f"{prefix}: rank {rank} on {host} failed at start-up, so every host stops: {message}",
                      file=sys.stderr, flush=True)
            os._exit(1)


WATCH = StartupWatch()
