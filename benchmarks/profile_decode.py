"""Where a decode step's time goes: torch.profiler over greedy decode steps of one system, rank 0's table.

Run under torchrun like compare_worker.py (same systems, same venvs), e.g. autotp at tp 2, one thread each:

    OMP_NUM_THREADS=1 PYTHONPATH=benchmarks:src torchrun --nproc-per-node 2 benchmarks/profile_decode.py autotp \
        benchmarks/.cache/starcoderbase-1b-bfloat16 bfloat16

DeepSpeed needs DS_ACCELERATOR=cpu LOCAL_SIZE=<nproc> and its venv's torchrun. Prints the wall ms/token and
the top operators by self CPU time (matmuls vs collectives vs the rest).
"""

import os
import sys
import time

import torch
import torch.distributed as dist
from compare_worker import load
from torch.profiler import ProfilerActivity, profile

STEPS = 10


def main() -> None:
    system, path, dtype = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3])
    world = int(os.environ.get("WORLD_SIZE", 1))
    if system == "deepspeed":  # as in compare_worker.py: DeepSpeed wraps the group in its own backend
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    elif world > 1:
        dist.init_process_group("gloo")
    model = load(system, path, dtype, world).eval()
    prompt = (torch.arange(32).unsqueeze(0) * 37 + 11) % 1000
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(3):  # warm-up
            out = model(token, past_key_values=out.past_key_values, use_cache=True)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(STEPS):
                out = model(token, past_key_values=out.past_key_values, use_cache=True)
                token = out.logits[:, -1:].argmax(-1)
            wall = (time.perf_counter() - start) * 1e3 / STEPS
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"{system} world={world} threads={torch.get_num_threads()}: {wall:.1f} ms/token under the profiler")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
