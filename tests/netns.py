"""Simulated hosts on one machine: network namespaces on one bridge, each with a hostname of its own.

Host i is namespace <prefix>h<i> at 10.<net>.0.<i + 1>, its one interface <prefix>h<i> (whose statistics count
what crossed "the network"), joined through a bridge in <prefix>sw that this process reaches too (10.<net>.0.254),
so a test talks to a server in any host directly. A command runs in a host under `unshare --uts` with the host's
name, so that gloo, the store and autotp see a machine of that name (and, like a real second machine, one whose
name resolves to nothing). Bandwidth is limited with `tc ... tbf` on each host's interface (egress); netem is not
on these kernels. Needs root (CI runs as root); `available()` says whether this machine can.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path


def available() -> str:
    """"" where namespaces can be made here, else why not (for a skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [t for t in ("ip", "tc", "unshare") if shutil.which(t) is None]
    return f"missing {', '.join(missing)}" if missing else ""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class Hosts:
    """n simulated hosts (see the module); a context manager that removes them, and every process in them."""

    def __init__(self, n: int, rate: str | None = None, names: list[str] | None = None):
        """names: the hosts' hostnames (default host-a, host-b, ...), alike where two cloned machines share one."""
        self.n, self.rate, self.names = n, rate, names
        tag = os.getpid() % 10_000
        self.prefix, self.net = f"a{tag}", 100 + tag % 150
        self.procs: list[subprocess.Popen] = []

    def ns(self, i: int) -> str:
        return f"{self.prefix}h{i}"

    def addr(self, i: int) -> str:
        return f"10.{self.net}.0.{i + 1}"

    def name(self, i: int) -> str:
        return self.names[i] if self.names else f"host-{'abcdefgh'[i]}"

    def __enter__(self) -> Hosts:
        sw, p = f"{self.prefix}sw", self.prefix
        try:
            _ip("netns", "add", sw)
            _ip("-n", sw, "link", "add", "br0", "type", "bridge")
            _ip("-n", sw, "link", "set", "br0", "up")
            for i in range(self.n):
                ns = self.ns(i)
                _ip("netns", "add", ns)
                _ip("link", "add", ns, "type", "veth", "peer", "name", f"{p}s{i}")
                _ip("link", "set", ns, "netns", ns)
                _ip("link", "set", f"{p}s{i}", "netns", sw)
                _ip("-n", sw, "link", "set", f"{p}s{i}", "master", "br0")
                _ip("-n", sw, "link", "set", f"{p}s{i}", "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", ns)
                _ip("-n", ns, "link", "set", ns, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                if self.rate:
                    self.limit(i, self.rate)
            _ip("link", "add", f"{p}r", "type", "veth", "peer", "name", f"{p}sr")
            _ip("link", "set", f"{p}sr", "netns", sw)
            _ip("-n", sw, "link", "set", f"{p}sr", "master", "br0")
            _ip("-n", sw, "link", "set", f"{p}sr", "up")
            _ip("addr", "add", f"10.{self.net}.0.254/24", "dev", f"{p}r")
            _ip("link", "set", f"{p}r", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def limit(self, i: int, rate: str) -> None:
        """Host i sends at most `rate` (e.g. "100mbit"), queueing up to 50 ms."""
        subprocess.run(["tc", "-n", self.ns(i), "qdisc", "replace", "dev", self.ns(i), "root", "tbf", "rate", rate,
                        "burst", "64kb", "latency", "50ms"], check=True, capture_output=True)

    def run(self, i: int, argv: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
        """argv on host i, its output (stdout and stderr) in `log`."""
        script = f'hostname {self.name(i)} && exec "$@"'
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(i), "unshare", "--uts", "sh", "-c", script, "sh",
                                 *argv], stdout=log.open("wb"), stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        self.procs.append(proc)
        return proc

    def pids(self, i: int) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.ns(i)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def traffic(self, i: int) -> int:
        """Bytes host i's interface sent and received so far."""
        stats = [f"/sys/class/net/{self.ns(i)}/statistics/{d}_bytes" for d in ("tx", "rx")]
        out = subprocess.run(["ip", "netns", "exec", self.ns(i), "cat", *stats], capture_output=True, text=True)
        return sum(int(v) for v in out.stdout.split())

    def cut(self, i: int) -> None:
        """Host i's link goes down: its packets go nowhere, no connection closes."""
        _ip("-n", self.ns(i), "link", "set", self.ns(i), "down")

    def kill(self, i: int) -> None:
        """Every process of host i, by SIGKILL (a host that lost its power)."""
        for pid in self.pids(i):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait_empty(self, i: int, timeout: float) -> float | None:
        """Seconds until host i runs no process any more, or None after `timeout`."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if not self.pids(i):
                return time.monotonic() - start
            time.sleep(0.2)
        return None

    def __exit__(self, *exc) -> None:
        for i in range(self.n):
            self.kill(i)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        subprocess.run(["ip", "link", "del", f"{self.prefix}r"], capture_output=True)
        for ns in [self.ns(i) for i in range(self.n)] + [f"{self.prefix}sw"]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
