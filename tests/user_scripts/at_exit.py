"""Run a user script as `python SCRIPT ARGS...` would, then record which threads are still alive once every
atexit handler has run (autotp's among them), i.e. when interpreter finalization begins: OUT/threads{RANK}.json,
OUT being the script's last argument.

A gloo worker thread alive at that point can abort the process: when it lets go of a finished collective's
tensor it needs the GIL, and a thread that asks for the GIL during finalization is ended by pthread_exit inside a
noexcept destructor ("terminate called without an active exception", autotp.distributed._destroy_at_exit). Whether
it does depends on the scheduler, so a test that only counts exit codes needs many runs on a loaded machine; the
threads alive at finalization show the precondition every run.

    torchrun --nproc-per-node 2 at_exit.py SCRIPT ARGS... OUT
"""

import atexit
import json
import os
import runpy
import sys
from pathlib import Path


def record() -> None:  # registered before the script runs, so it runs after the script's own handlers
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{task}/comm").read_text().strip())
        except (FileNotFoundError, ProcessLookupError):  # the thread ended between the listing and the read
            pass
    Path(sys.argv[-1], f"threads{os.environ.get('RANK', '0')}.json").write_text(json.dumps(sorted(names)))


atexit.register(record)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
