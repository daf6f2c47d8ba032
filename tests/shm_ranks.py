"""One rank of a small gloo group that all-reduces through autotp's collectives, launched once per rank by
tests/test_shm.py: RANK, WORLD_SIZE, MASTER_PORT from the environment; argv[1] says what happens.

- die: after 5 all-reduces rank 1 kills itself (SIGKILL, as the OOM killer does); the others all-reduce
  once more and must fail, naming rank 1, long before the group's 300 s timeout.
- sum: 20 all-reduces, each of other values, then 5 in a second process group (as `autotp serve` has: the
  model's and the step channel's); every rank prints whether shared memory carried them and whether every
  sum is right.
"""

import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from autotp.parallel import shm
from autotp.parallel.collectives import GroupRef, all_reduce_sum

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
dist.init_process_group("gloo", timeout=timedelta(seconds=300))
rank, world = dist.get_rank(), dist.get_world_size()
group = GroupRef.of(dist.group.WORLD)

def sums(group: GroupRef, n: int) -> bool:
    """n all-reduces of (rank + i) * (1 + index): each one's sum checked, not only the last."""
    right = []
    for i in range(n):
        x = (rank + i) * (1 + torch.arange(1000, dtype=torch.float32))
        right.append(all_reduce_sum(x, group).equal((sum(range(world)) + world * i) * (1 + torch.arange(1000.0))))
    return all(right) and len(right) == n


ok = sums(group, 5 if sys.argv[1] == "die" else 20)
if sys.argv[1] == "sum":
    ok = sums(GroupRef.of(dist.new_group(backend="gloo")), 5) and ok
print(f"rank {rank}: shared memory {shm.for_group(group.name, group.get()) is not None}, sums right {ok}", flush=True)
if sys.argv[1] == "die":
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        all_reduce_sum(torch.ones(1000), group)
    except RuntimeError as e:
        print(f"rank {rank} failed after {time.monotonic() - start:.1f} s: {e}", flush=True)
        time.sleep(2)  # a survivor that left at once could be seen gone by another before rank 1 is
        os._exit(3)  # the group's peer is gone: no orderly teardown
    print(f"rank {rank}: the all-reduce returned without rank 1", flush=True)
    os._exit(4)
dist.destroy_process_group()
