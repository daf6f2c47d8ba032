"""`--tp N` on `autotp generate` and `autotp serve`: this process starts the N local ranks of the same command.

torch's own launcher does the work (`elastic_launch`, what torchrun runs), with torchrun's `--standalone`
rendezvous: a store that listens on the loopback address only (every rank is on this host; torch's store would
listen on every interface), on the port --master-port or MASTER_PORT pins (torchrun's names), else on port 0, so
the OS picks a free port and two launches on one host never collide. Each rank runs `python -m autotp ARGS`
with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT of that store), in its own
session, so a terminal's Ctrl-C reaches this process only.

What this adds to torchrun's behaviour, and the reason it is not `torchrun` itself:
- SIGINT, SIGTERM and SIGHUP (a closed terminal) are forwarded once to every rank, which do what they do
  under torchrun (the server drains, then every rank stops), and the launcher waits for them with no
  deadline: a drain that ends well is exit 0 (129 after a hang-up: the server says so), not torchrun's
  `SignalException` traceback and exit 1. A second SIGINT or SIGTERM kills the ranks; a second SIGHUP does
  not (a closing terminal can send it twice: its shell's, and the kernel's to the foreground job). An
  ignored SIGHUP stays ignored: under `nohup` the ranks outlive the terminal.
- Failures are autotp's lines: a rank that fails with autotp's error has said its one line already
  (autotp.distributed.fail), so the launcher adds nothing and exits with the rank's code (2 for bad
  input); a rank that dies of a signal it was not sent is named in one line. torchrun's failure report
  and the agent's log lines are not printed.
- A rank that stalls (SIGSTOP, a debugger, stuck), which its peers give up on after their liveness window
  (serve/pipeline/liveness.py), is ended at once and named as stalled: torchrun's agent would wait out its grace
  period (30 s) for a process that cannot act on SIGTERM, then SIGKILL it and report that kill as the failure.
Multi-host runs stay torchrun's (`torchrun --nnodes ... -m autotp serve`): this module knows one host.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Set in each rank's environment: this launcher names a rank whose process ended (its signal, or the rank has said
# its own failure), so a peer that only saw it go (parallel.shm.PeerGone) has nothing to add
NAMES_EXITS = "AUTOTP_LAUNCHER_NAMES_EXITS"
# Set in each rank's environment: a folder where a rank notes a peer of this host that stalled, in a file named by its
# rank: "PID\tNOTER_PID\tSTATE" (serve/pipeline/liveness.py); the launcher ends it once the noter has said its line
STALLED = "AUTOTP_STALLED_NOTES"
NOTED_S = 3.0  # how long the noting rank may take to say its line and exit before the stalled rank is ended anyway


class _Stopped(Exception):
    """A signal arrived before any rank was started: nothing to forward it to."""

    def __init__(self, sig: int):
        super().__init__(sig)
        self.sig = sig


def _ranks() -> list[int]:
    """The ranks: this process's children (the agent runs in this process and Popens them; each leads its own
    process group, so a signal to the group reaches anything a rank started too)."""
    pids = []
    for children in Path("/proc/self/task").glob("*/children"):
        try:
            pids += [int(p) for p in children.read_text().split()]
        except OSError:
            continue
    return pids


def _signal_ranks(sig: int) -> None:
    for pid in _ranks():
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _say(line: str) -> None:
    """One line on stderr, which may be a terminal already closed (after its SIGHUP): a failed write there must not
    turn a drain into an error, least of all inside a signal handler."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


def threads_per_rank(tp: int) -> int:
    """OMP_NUM_THREADS for each of tp CPU ranks when the user set none: the cores this process may use,
    shared (torchrun sets 1, which leaves all but tp cores of a larger machine idle)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // tp)


def signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _end_stalled(notes: Path, done: threading.Event) -> None:
    """SIGKILL each rank noted in `notes` as stalled (see STALLED), once the rank that noted it has exited or NOTED_S
    has passed: the noter says the line first, and the agent then stops the rest without a grace period to wait out."""
    seen: dict[str, float] = {}  # note -> when this thread first read it
    ended: set[str] = set()
    while not done.wait(0.2):
        try:
            noted = [(note.name, note.read_text()) for note in notes.iterdir() if not note.suffix]  # .new: unfinished
        except OSError:  # the launch is over: its folder is gone
            return
        for name, text in noted:
            from autotp.serve.lockstep.watchdog import gone  # (torch's, imported only once a rank stalled)

            pid, noter = map(int, text.split("\t")[:2])
            first = seen.setdefault(name, time.monotonic())
            if name not in ended and (gone(noter) or time.monotonic() - first > NOTED_S) and pid in _ranks():
                os.killpg(pid, signal.SIGKILL)
                ended.add(name)


def stalled_ranks(notes: Path) -> dict[int, str]:
    """rank -> what its process was doing, for each rank noted as stalled (STALLED)."""
    return {int(note.name): note.read_text().split("\t", 2)[2] for note in notes.iterdir() if not note.suffix}


def outcome(failures: dict[int, tuple[int, int]], received: list[int],
            stalled: dict[int, str] | None = None) -> tuple[int, list[str]]:
    """(exit code, lines to print) for the ranks that failed: failures[rank] = (exit code, pid), a negative
    code being the signal that ended it; received: the signals this launcher forwarded (a second one is
    sent on as SIGKILL); stalled: rank -> its process's state, for the ranks its peers gave up on (STALLED),
    which this launcher ended.

    A rank that exits non-zero on its own has said why (autotp.distributed.fail), so its code is passed on
    and nothing is added: the lowest failing rank's, 2 for bad input. A rank ended by a signal nobody sent
    it (the kernel's OOM killer, a segfault, a `kill -9`) is named, once; the SIGTERM with which the agent
    then stops the others is not a failure of theirs. A stalled rank is named as such, not by the SIGKILL that
    ended it. After a forwarded SIGINT/SIGTERM, ranks ended by it were stopped, not failed: 128 + the signal, as a
    shell reports it (130, 143, 129)."""
    sent = set(received[:1]) | ({signal.SIGKILL} if len(received) > 1 else set())
    if any(code != -signal.SIGTERM for code, _ in failures.values()):
        sent.add(signal.SIGTERM)  # the agent stops the other ranks with SIGTERM once one has failed
    stalled = {rank: state for rank, state in (stalled or {}).items() if rank in failures}
    said = sorted(rank for rank, (code, _) in failures.items() if code > 0)
    died = sorted(r for r, (code, _) in failures.items() if code < 0 and -code not in sent and r not in stalled)
    lines = [f"autotp: error: rank {rank} (pid {failures[rank][1]}) died of {signal_name(failures[rank][0])}"
             for rank in died]
    lines += [f"autotp: error: rank {rank} (pid {failures[rank][1]}) stalled: its process was {state}, so its peers "
              f"gave up on it and the launcher ended it" for rank, state in sorted(stalled.items())]
    if said:
        return failures[said[0]][0], lines
    if died or stalled:
        return 1, lines
    return (128 + received[0] if received else 1), lines


def rendezvous_port(flag: int | None) -> int | str:
    """The rendezvous's port: --master-port, else MASTER_PORT, else 0 (the OS picks); a line for a MASTER_PORT that
    is no port."""
    if flag is not None:
        return flag
    text = os.environ.get("MASTER_PORT", "0")
    if not text.isdigit() or int(text) > 65535:
        return f"MASTER_PORT={text!r} is not a port number (0 to 65535): set it to one, or leave it out"
    return int(text)


def _rendezvous_store(port: int):
    """(the store the agent's rendezvous will use, its port), listening on 127.0.0.1 only: the agent's own
    TCPStore(multi_tenant=True) on the same port is this one (torch keeps one server per port and process)."""
    import torch.distributed as dist

    with socket.create_server(("127.0.0.1", port)) as listener:
        port = listener.getsockname()[1]
        store = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False,
                              master_listen_fd=listener.fileno())
        listener.detach()  # the store's now: it closes it
    return store, port


def launch(tp: int, argv: list[str], master_port: int | None = None) -> int:
    """Run `python -m autotp ARGV` as tp local ranks and return the command's exit code (see the module)."""
    port = rendezvous_port(master_port)
    if isinstance(port, str):
        print(f"autotp: error: {port}", file=sys.stderr, flush=True)
        return 2
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    try:
        store, port = _rendezvous_store(port)
    except OSError as e:
        print(f"autotp: error: the ranks' rendezvous cannot listen on 127.0.0.1:{port} (--master-port or MASTER_PORT "
              f"chooses another port): {e.strerror}", file=sys.stderr, flush=True)
        return 1
    # the agent's own log lines (rendezvous, "failed (exitcode: 2) local_rank: 0 ...") are not the user's business:
    # what failed is said by the ranks, or below
    logging.getLogger("torch.distributed").setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(tp)))
    os.environ[NAMES_EXITS] = "1"
    received: list[int] = []

    def forward(sig: int, _frame) -> None:
        if received and sig == signal.SIGHUP:  # the terminal's second hang-up, or one after a stop: nobody asked twice
            return
        received.append(sig)
        if len(received) > 1:
            _say(f"autotp: second {signal.Signals(sig).name}: stopping every rank now")
            _signal_ranks(signal.SIGKILL)
        elif not _ranks():
            raise _Stopped(sig)
        else:
            _signal_ranks(sig)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED
                if sig != signal.SIGHUP or signal.getsignal(sig) != signal.SIG_IGN}  # nohup's stays ignored
    done = threading.Event()
    try:
        with tempfile.TemporaryDirectory(prefix="autotp-launch-") as logs:
            notes = Path(logs) / "stalled"
            notes.mkdir()
            os.environ[STALLED] = str(notes)
            threading.Thread(target=_end_stalled, args=(notes, done), name="autotp-end-stalled", daemon=True).start()
            config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=tp, run_id=str(uuid.uuid4()),
                                  rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{port}", max_restarts=0,
                                  logs_specs=DefaultLogsSpecs(log_dir=logs),
                                  # SIGINT, SIGTERM and SIGHUP are forward()'s; the agent keeps its handling of
                                  # SIGQUIT
                                  signals_to_handle="SIGQUIT")
            try:
                elastic_launch(config, sys.executable)("-m", "autotp", *argv)
                return 0
            except ChildFailedError as e:
                code, lines = outcome({rank: (f.exitcode, f.pid) for rank, f in e.failures.items()}, received,
                                      stalled_ranks(notes))
                for line in lines:
                    _say(line)
                return code
    except _Stopped as e:
        return 128 + e.sig
    except Exception as e:  # noqa: BLE001 - the agent's own failure (its rendezvous store), in autotp's one line
        _say(f"autotp: error: starting {tp} ranks failed: {type(e).__name__}: {e}".splitlines()[0])
        return 1
    finally:
        done.set()
        del store
        for sig, handler in previous.items():
            signal.signal(sig, handler)
