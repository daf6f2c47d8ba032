"""`autotp generate` on many checkpoints in one torchrun: each is `autotp.cli.main([...])`, as `python -m autotp`
runs it, with its stdout and stderr captured; rank 0 writes OUT/NAME.json = {"code", "stdout", "stderr"}.

    torchrun --nproc-per-node N family_cli.py OUT NAME=DIR... -- GENERATE_ARGS...

One torchrun instead of one per checkpoint saves the interpreter start-up and the rendezvous of each (3-4 s on
two cores). The one thing main() does differently here is what it does last: it leaves the process group for
the next checkpoint instead of destroying it (autotp destroys it at exit, as for any script).
"""

import contextlib
import io
import json
import sys
from pathlib import Path

from autotp import cli, distributed

out, rest = Path(sys.argv[1]), sys.argv[2:]
split = rest.index("--")
checkpoints, generate_args = [a.split("=", 1) for a in rest[:split]], rest[split + 1:]
distributed.shutdown = lambda: None
for name, directory in checkpoints:
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = cli.main(["generate", "--model", directory, *generate_args])
    if distributed.rank() == 0:
        (out / f"{name}.json").write_text(json.dumps({"code": code, "stdout": stdout.getvalue(),
                                                      "stderr": stderr.getvalue()}))
