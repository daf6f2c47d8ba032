"""The room a CPU server's KV cache is sized from, inside a memory cgroup: the smaller of MemAvailable and every
limited cgroup's limit less its use, read as the kernel shows the cgroup (host_memory.py).

Fast tests read a fake /proc/meminfo, /proc/self/cgroup, /proc/self/mountinfo and cgroup tree in tmp_path; one starts
`python -m autotp serve` inside a real v1 memory cgroup with a 1.5 GiB limit (root and a memory controller needed)."""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path

import pytest
from serve_harness import Server

from autotp.serve.startup.host_memory import Room, room

GiB = 2**30
HOST = 16 * GiB  # the fake MemAvailable
V1_UNLIMITED = 9223372036854771712  # what v1 writes for no limit on 4 KiB pages


def fake(tmp_path: Path, cgroup: str, mounts: list[tuple[str, str, str]], files: dict[str, str | int]) -> Room:
    """room() over a fake host. mounts: (root the mount shows, folder under tmp_path, "cgroup2" or "cgroup"), v1 ones
    with the memory controller; files: path under tmp_path -> content."""
    (tmp_path / "meminfo").write_text(f"MemTotal: {2 * HOST // 1024} kB\nMemAvailable:   {HOST // 1024} kB\n")
    (tmp_path / "cgroup").write_text(cgroup)
    (tmp_path / "mountinfo").write_text("".join(
        f"{30 + i} 23 0:{40 + i} {root} {tmp_path / point} rw,relatime shared:9 - {kind} {kind} "
        f"rw{',memory' if kind == 'cgroup' else ''}\n" for i, (root, point, kind) in enumerate(mounts)))
    for path, content in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(f"{content}\n")
    return room(str(tmp_path / "meminfo"), str(tmp_path / "cgroup"), str(tmp_path / "mountinfo"))


V2 = [("/", "unified", "cgroup2")]


def test_a_v2_limit_on_a_parent_binds_its_child_less_the_parents_use_but_not_its_dropable_cache(tmp_path):
    """A Kubernetes pod's limit sits on the pod, the process in a container below it with "max": 2 GiB less the pod's
    0.5 GiB in use, of which 0.25 GiB inactive page cache, leaves 1.75 GiB."""
    got = fake(tmp_path, "0::/kubepods/pod1/ctr\n", V2, {
        "unified/kubepods/memory.max": "max",
        "unified/kubepods/memory.current": 3 * GiB, "unified/kubepods/pod1/memory.max": 2 * GiB,
        "unified/kubepods/pod1/memory.current": GiB // 2, "unified/kubepods/pod1/memory.stat":
            f"anon {GiB // 4}\nfile {GiB // 4}\ninactive_file {GiB // 4}\n",
        "unified/kubepods/pod1/ctr/memory.max": "max", "unified/kubepods/pod1/ctr/memory.current": GiB // 2})
    assert got == Room(2 * GiB - GiB // 4, 2 * GiB)
    assert got.what() == "the cgroup's 2.0 GiB memory limit less its use"


def test_the_tightest_of_two_v2_limits_wins(tmp_path):
    got = fake(tmp_path, "0::/a/b\n", V2, {
        "unified/a/memory.max": 3 * GiB, "unified/a/memory.current": 2 * GiB + GiB // 2,
        "unified/a/b/memory.max": 2 * GiB, "unified/a/b/memory.current": GiB})
    assert got == Room(GiB // 2, 3 * GiB)  # a's 3 GiB less its 2.5 GiB, though b's own limit is lower


def test_v2_max_everywhere_leaves_memavailable_and_nothing_above_the_mount_is_read(tmp_path):
    got = fake(tmp_path, "0::/user.slice/session-1.scope\n", V2, {
        "memory.max": GiB, "memory.current": 0,  # beside the mount point, not in its hierarchy
        "unified/user.slice/memory.max": "max", "unified/user.slice/memory.current": GiB,
        "unified/user.slice/session-1.scope/memory.max": "max",
        "unified/user.slice/session-1.scope/memory.current": GiB})
    assert got == Room(HOST)
    assert got.what() == "the host's available memory"


def test_a_v1_limit_in_a_container_whose_mount_shows_its_own_cgroup(tmp_path):
    """Docker without a cgroup namespace: /proc/self/cgroup says /docker/abc and the memory mount's root is that same
    cgroup, so its files are at the mount point itself, not under docker/abc there (where a container started inside
    this one, by the same name, would have its own)."""
    got = fake(tmp_path, "12:pids:/docker/abc\n4:memory:/docker/abc\n1:name=systemd:/docker/abc\n0::/\n",
               [("/docker/abc", "memory", "cgroup"), ("/", "unified", "cgroup2")], {
                   "memory/memory.limit_in_bytes": 1717986918, "memory/memory.usage_in_bytes": 3 * 2**28,
                   "memory/memory.stat": f"cache {2**28}\ninactive_file {2**27}\ntotal_inactive_file {2**28}\n",
                   "memory/docker/abc/memory.limit_in_bytes": 2**29, "memory/docker/abc/memory.usage_in_bytes": 0})
    assert got == Room(1717986918 - 2 * 2**28, 1717986918)
    assert got.what() == "the cgroup's 1.6 GiB memory limit less its use"


def test_v1_without_a_limit_leaves_memavailable(tmp_path):
    got = fake(tmp_path, "4:memory:/user.slice\n", [("/", "memory", "cgroup")], {
        "memory/memory.limit_in_bytes": V1_UNLIMITED, "memory/memory.usage_in_bytes": GiB,
        "memory/user.slice/memory.limit_in_bytes": V1_UNLIMITED, "memory/user.slice/memory.usage_in_bytes": GiB})
    assert got == Room(HOST)


def test_a_cgroup_outside_what_the_mount_shows_is_not_read(tmp_path):
    """The mount shows /docker/abc but the process sits in /other: the limit at the mount point is not its own."""
    got = fake(tmp_path, "4:memory:/other\n", [("/docker/abc", "memory", "cgroup")], {
        "memory/memory.limit_in_bytes": GiB, "memory/memory.usage_in_bytes": 0})
    assert got == Room(HOST)


def test_a_cgroup_outside_the_processs_cgroup_namespace_is_not_read(tmp_path):
    """Under a cgroup namespace, a cgroup outside the namespace's root reads /../x: not below the mount point."""
    got = fake(tmp_path, "0::/../sibling\n", V2, {"unified/cgroup.procs": "", "sibling/memory.max": GiB,
                                                  "sibling/memory.current": 0})
    assert got == Room(HOST)


def test_without_any_cgroup_file_memavailable_decides(tmp_path):
    (tmp_path / "meminfo").write_text(f"MemAvailable:   {HOST // 1024} kB\n")
    assert room(str(tmp_path / "meminfo"), str(tmp_path / "no-cgroup"), str(tmp_path / "no-mountinfo")) == Room(HOST)


LIMIT = 3 * GiB // 2


@contextlib.contextmanager
def memory_cgroup(limit: int):
    """A child v1 memory cgroup of this process's own, with `limit`; removed once its processes have exited."""
    own = next((line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                if "memory" in line.split(":", 2)[1].split(",")), None)
    mount = Path("/sys/fs/cgroup/memory")
    if own is None or not (mount / "memory.limit_in_bytes").is_file():
        pytest.skip("no cgroup v1 memory controller at /sys/fs/cgroup/memory")
    parent = mount / own.lstrip("/") if (mount / own.lstrip("/")).is_dir() else mount  # a container's mount: its own
    child = parent / f"autotp-test-{os.getpid()}"
    try:
        child.mkdir()
        (child / "memory.limit_in_bytes").write_text(str(limit))
    except OSError as e:
        with contextlib.suppress(OSError):
            child.rmdir()
        pytest.skip(f"cannot make a memory cgroup with a limit under {parent}: {e}")
    try:
        yield child
    finally:
        deadline = time.monotonic() + 10
        while True:  # a killed process leaves the cgroup a moment after it exits
            try:
                child.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


@pytest.mark.timeout(120)
def test_a_server_in_a_memory_cgroup_sizes_its_cache_within_the_limit_and_serves(tmp_path):
    """Without the cgroup's limit the demo model's cache would take half the host's MemAvailable (4096 rows of 512
    tokens ask more than the limit), and the kernel's OOM killer would stop the server at the limit."""
    with memory_cgroup(LIMIT) as cgroup:
        join = ("sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh")
        server = Server(None, tmp_path / "server.log", "--max-num-seqs", "4096", "--max-num-batched-tokens", "4096",
                        torchrun=False, prefix=join)
        try:
            out = server.client.completions.create(model=server.model_id, prompt="def f(x):", max_tokens=4)
            assert out.usage.completion_tokens == 4
            line = re.search(r"KV cache: \d+ tokens per rank \(\S+ \S+ at (\d+) bytes per token, sized by ([^;]+);",
                             server.text())
            tokens = int(re.search(r"KV cache: (\d+) tokens", line.group(0)).group(1))
            assert line.group(2) == "half the cgroup's 1.5 GiB memory limit less its use, shared by the host's ranks"
            assert tokens * int(line.group(1)) <= LIMIT // 2
        finally:
            server.kill()
