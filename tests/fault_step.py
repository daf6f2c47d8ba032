"""`autotp serve` whose rank AUTOTP_TEST_FAIL_RANK raises in its first forward of a request (as an
out-of-memory error on one GPU would), before any collective of it: the other ranks wait in the forward's
first collective for a rank that never comes."""

import os
import sys

import autotp.serve.runner.model_runner
from autotp.cli import main

if os.environ.get("RANK") == os.environ["AUTOTP_TEST_FAIL_RANK"]:
    def out_of_memory(self, step):
        raise RuntimeError(f"CUDA out of memory on rank {os.environ['RANK']} (injected)")

    autotp.serve.runner.model_runner.PagedBatch._run = out_of_memory

sys.exit(main())
