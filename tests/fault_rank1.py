"""`autotp generate` whose rank 1 fails as generation starts, while rank 0 waits in a collective."""

import os
import sys

import autotp.generate
from autotp.cli import main

if os.environ.get("RANK") == "1":
    def broken_generate(*args, **kwargs):
        raise RuntimeError("injected failure on rank 1")

    autotp.generate.generate = broken_generate

sys.exit(main())
