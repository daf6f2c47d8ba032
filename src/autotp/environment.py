"""The environment variables autotp reads, each with one line of what it does: each command's `--help` prints them
(its epilog), and tests/test_cli.py checks that every `AUTOTP_*` name read under src/ is here and nothing else is;
the ones autotp sets for itself are INTERNAL, kept out of `--help`.
No torch."""

from __future__ import annotations

VARIABLES = {  # each text fits one 80-column line under its name; defaults in parentheses
    "AUTOTP_API_KEY": "serve's API key when --api-key is not given (hidden from the process list)",
    "AUTOTP_DEBUG": "1: print an unexpected error's traceback after its one line",
    "AUTOTP_TIMEOUT": "seconds a collective waits for the other ranks before it fails (600)",
    "AUTOTP_RENDEZVOUS_TIMEOUT": "seconds rank 0 waits for ranks that never start, outside torchrun (300)",
    "AUTOTP_HUB_TIMEOUT": "seconds a hub fetch may go without a new byte (30)",
    "AUTOTP_DOWNLOAD_STALL_TIMEOUT": "seconds ranks wait on their node's download without progress (300)",
    "AUTOTP_SHM": "0: CPU ranks on one host all-reduce through gloo, not shared memory",
    "AUTOTP_LIVENESS_S": "seconds a pipeline waits for a silent host before it stops (6)",
    "GLOO_SOCKET_IFNAME": "the network interface gloo uses (unset: the one that reaches MASTER_ADDR)",
    "AUTOTP_GEMV": "0: serve's few-row products on CPU use torch's F.linear, not gemv.c",
    "AUTOTP_INFERRED_PLANS": "0: refuse a family without a built-in plan instead of inferring one",
    "OMP_NUM_THREADS": "threads per CPU rank (unset: cores / N under --tp N; torchrun sets 1)",
    "CC": "the C compiler that builds the shared-memory barrier and gemv.c (cc)",
}
# read by autotp, set by autotp: not for users, so not in --help
INTERNAL = {
    "AUTOTP_LAUNCHER_NAMES_EXITS": "set by --tp N in its ranks (it names a rank that exits)",
    "AUTOTP_STALLED_NOTES": "set by --tp N in its ranks: where a rank notes a stalled peer for the launcher to end",
}


def epilog() -> str:
    """The variables as `--help` prints them, in argparse's layout: each name, then its line."""
    return "environment variables:\n" + "\n".join(f"  {name}\n      {text}" for name, text in VARIABLES.items())
