"""`autotp serve` whose rank AUTOTP_TEST_FAIL_RANK raises in its first forward of a request (as an
out-of-memory error on one GPU would), before any collective of it: the other ranks wait in the forward's
first collective for a rank that never comes."""

import os
import sys

import autotp.serve.lockstep.watchdog
import autotp.serve.runner.model_runner
from autotp.cli import main

# the watchdog's wait for the other ranks to say the same failure: 1 s instead of 5 in this test's ranks, for the
# suite's time (ranks that fail alike say it within milliseconds; here one never does, so the whole wait is spent)
autotp.serve.lockstep.watchdog.GRACE_S = 1.0

if os.environ.get("RANK") == os.environ["AUTOTP_TEST_FAIL_RANK"]:
    def out_of_memory(self, *args):
        raise RuntimeError(f"CUDA out of memory on rank {os.environ['RANK']} (injected)")

    autotp.serve.runner.model_runner.ModelRunner._run = out_of_memory

sys.exit(main())
