"""C sources next to this file, built once per source version, flags and machine into the user's cache.

shm_wait.c (the shared-memory barrier) and gemv.c (the CPU float32 matrix-vector kernel) are plain C, loaded
through ctypes: `cc` builds each in well under a second, where a torch C++ extension would take a minute at a
user's first start-up. A build that fails raises RuntimeError with the compiler's first words; callers fall back.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from pathlib import Path


def build(source: Path, flags: tuple[str, ...] = ("-O2",)) -> Path:
    """The shared library of `source` built with `flags`; several ranks may build it at once (rename is atomic)."""
    key = source.read_bytes() + " ".join(flags).encode() + platform.processor().encode() + _cpu_flags()
    digest = hashlib.sha256(key).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "autotp"
    lib = cache / f"{source.stem}-{digest}-{platform.machine()}.so"
    if not lib.exists():
        cache.mkdir(parents=True, exist_ok=True)
        partial = lib.with_name(f"{lib.name}.{os.getpid()}")
        done = subprocess.run([os.environ.get("CC", "cc"), *flags, "-shared", "-fPIC", "-o", str(partial),
                               str(source)], capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(f"the C compiler failed: {(done.stderr or done.stdout).strip()[:200]}")
        os.replace(partial, lib)
    return lib


def _cpu_flags() -> bytes:
    """The CPU's feature flags (Linux), so that a -march=native build is not reused on another CPU sharing $HOME."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""
