"""`autotp generate` whose rank 1 fails as generation starts, while rank 0 waits in a collective."""

import os
import sys

import autotp.distributed
import autotp.generate
from autotp.cli import main

# how long rank 1 looks for rank 0's line before it says its own: 1 s instead of 5 in this test's ranks, for the
# suite's time (rank 0 waits in a collective and never posts one, so the whole wait is spent)
autotp.distributed.FAILURE_WAIT_S = 1.0

if os.environ.get("RANK") == "1":
    def broken_generate(*args, **kwargs):
        raise RuntimeError("injected failure on rank 1")

    autotp.generate.generate = broken_generate

sys.exit(main())
