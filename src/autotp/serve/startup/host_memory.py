"""How much memory this process may still take on its host: the kernel's MemAvailable, or less where the process sits
in a memory cgroup with a limit (Docker's `--memory`, a Kubernetes limit), whose OOM killer stops it at the limit
whatever the host has free.

The cgroup is read as the kernel shows it: /proc/self/cgroup names the process's cgroup within each hierarchy
(`0::/path` for cgroup v2, `N:memory:/path` for v1's memory controller), and /proc/self/mountinfo says where that
hierarchy is mounted and which of its cgroups the mount shows as its root (inside a container, often the container's
own cgroup). A parent's limit binds its children too, so every cgroup from the process's up to the mount's root
counts, each with its own limit less its own use: v2 memory.max / memory.current (no limit reads "max"), v1
memory.limit_in_bytes / memory.usage_in_bytes (no limit reads as a huge number, which MemAvailable undercuts). The use
leaves out inactive file pages (memory.stat), which the kernel drops before it kills, as MemAvailable leaves out the
page cache it can drop; a checkpoint just read sits there.

Reads only; it does not say how much of the room the server takes (budget.py does).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

# cgroup version -> (limit file, use file, memory.stat key of the inactive file pages)
FILES = {2: ("memory.max", "memory.current", "inactive_file"),
         1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}


@dataclass(frozen=True)
class Room:
    """`bytes` the process may still take; `limit`: the cgroup limit that gave it, None where MemAvailable did."""

    bytes: int
    limit: int | None = None

    def what(self) -> str:
        """For the start-up line: which memory sized it."""
        if self.limit is None:
            return "the host's available memory"
        return f"the cgroup's {size_text(self.limit)} memory limit less its use"


def mem_available(meminfo: str = "/proc/meminfo") -> int:
    """The host's available memory (MemAvailable: free, and caches the kernel can drop)."""
    try:
        with open(meminfo) as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def room(meminfo: str = "/proc/meminfo", proc_cgroup: str = "/proc/self/cgroup",
         mountinfo: str = "/proc/self/mountinfo") -> Room:
    """The smaller of MemAvailable and every memory cgroup's limit less its use, on the way from this process's
    cgroup to the root its mount shows."""
    best = Room(mem_available(meminfo))
    for limit, left in cgroup_rooms(proc_cgroup, mountinfo):
        if left < best.bytes:
            best = Room(left, limit)
    return best


def cgroup_rooms(proc_cgroup: str, mountinfo: str) -> list[tuple[int, int]]:
    """(limit, limit less use) of every limited memory cgroup above this process, itself included; [] outside any."""
    out = []
    for version, folder, mount_point in cgroup_dirs(proc_cgroup, mountinfo):
        limit_file, use_file, inactive_key = FILES[version]
        for level in (folder, *folder.parents):
            limit, use = _read(level / limit_file), _read(level / use_file)
            if limit not in (None, "max") and use is not None:
                inactive = _stat(level / "memory.stat").get(inactive_key, 0)
                out.append((int(limit), max(0, int(limit) - (int(use) - inactive))))
            if level == mount_point:
                break
    return out


def cgroup_dirs(proc_cgroup: str, mountinfo: str) -> list[tuple[int, Path, Path]]:
    """(version, folder, mount point) of this process's memory cgroup in each hierarchy that has one and is mounted
    over it: walking up from the folder stops at the mount point."""
    paths = {}  # version -> the cgroup's path within its hierarchy
    for line in _lines(proc_cgroup):
        parts = line.split(":", 2)
        if len(parts) < 3:
            continue
        number, controllers, path = parts
        if number == "0" and controllers == "":
            paths[2] = path
        elif "memory" in controllers.split(","):
            paths[1] = path
    out = []
    for version, (root, point) in _mounts(mountinfo).items():
        path = paths.get(version)
        root = root.rstrip("/")  # "/" -> "": every path starts with it
        if path is None or "/.." in path or not (path == root or path.startswith(root + "/")):
            continue  # not under what this mount shows (a cgroup namespace writes one outside it as /../x)
        out.append((version, Path(point, path[len(root):].lstrip("/")), Path(point)))
    return out


def _mounts(mountinfo: str) -> dict[int, tuple[str, str]]:
    """version -> (the cgroup the mount shows as its root, where it is mounted): the first cgroup2 mount, and the
    first v1 mount whose options name the memory controller. A mountinfo line: `id parent major:minor root point
    options [optional fields] - fstype source super_options`."""
    out: dict[int, tuple[str, str]] = {}
    for line in _lines(mountinfo):
        fields, _, tail = line.partition(" - ")
        fields, tail = fields.split(), tail.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        version = 2 if tail[0] == "cgroup2" else 1 if tail[0] == "cgroup" and "memory" in tail[2].split(",") else 0
        if version and version not in out:
            out[version] = (_unescape(fields[3]), _unescape(fields[4]))
    return out


def _unescape(field: str) -> str:
    """mountinfo writes a space, tab, newline or backslash in a path as an octal escape (\\040)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _stat(path: Path) -> dict[str, int]:
    return {k: int(v) for k, v in (line.split() for line in _lines(str(path)) if len(line.split()) == 2)}


def size_text(n: int) -> str:
    """Bytes as people read them: 1.5 GiB."""
    return next(f"{n / 2**p:.1f} {unit}" for p, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB"), (0, "B")) if n >= 2**p
                or p == 0)
