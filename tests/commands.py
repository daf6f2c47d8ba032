"""The command line as the tests run it: `autotp` in a process of its own, under torchrun, by hand with the
`deepspeed` launcher's environment, or in this process (`cli`)."""

import os
import subprocess
import sys

from pool import free_port


def run(args, timeout=120):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)


def autotp(*args):
    return run([sys.executable, "-m", "autotp", *args])


def torchrun(n, *args, script=None):
    target = [script] if script else ["-m", "autotp"]
    return run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
                "--master-port", str(free_port()), *target, *args])


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("autotp: error")]


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """`autotp ARGS` in this process, where a process of its own is not what the test is about (a Python with
    torch and transformers costs ~3.5 s to start): (exit code, stdout, stderr). test_launch, test_said_once and
    test_help_and_flag_errors_import_neither_torch_nor_transformers run the command as its own process."""
    from autotp.cli import main

    try:
        code = main(list(args))
    except SystemExit as e:  # argparse's flag errors
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def by_hand(n: int, *args: str, flag_local_rank: bool = False) -> list[tuple[int, str, str]]:
    """`python -m autotp ARGS` in n processes with the environment the `deepspeed` launcher gives (no torchrun: no
    agent stops a rank when another exits); (exit code, stdout, stderr) per rank."""
    port, procs = free_port(), []
    for rank in range(n):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n),
               "LOCAL_SIZE": str(n), "CROSS_RANK": "0", "CROSS_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        local_rank = [f"--local_rank={rank}"] if flag_local_rank else []
        procs.append(subprocess.Popen([sys.executable, "-u", "-m", "autotp", *args, *local_rank], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs, strict=True)]
