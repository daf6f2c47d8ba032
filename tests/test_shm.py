"""The shared-memory all-reduce and all-gather (parallel/shm.py) against gloo's, and their failure paths.

The pools' ranks share this host, so parallel/collectives.py sends their CPU tensors through shared memory;
every test first checks that it did, or it would be testing gloo against itself.
"""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from pool import free_port

from autotp.parallel import shm
from autotp.parallel.collectives import GroupRef, all_gather_last_dim, all_reduce_sum

HERE = Path(__file__).parent
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# 1 element; not a multiple of anything; three slots' worth of float32 and bfloat16 (pieces and a ragged end)
SIZES = (1, 1001, 3 * shm.SLOT_BYTES // 4 + 7, 3 * shm.SLOT_BYTES // 2 + 5)


def _world() -> GroupRef:
    group = GroupRef.of(dist.group.WORLD)
    assert shm.for_group(group.name, group.get()) is not None, "shared memory is not in use"
    return group


def _sums() -> list:
    """Each case: this rank's sum through shared memory, gloo's, and every rank's input (to sum by hand)."""
    group, rank, world = _world(), dist.get_rank(), dist.get_world_size()
    out = []
    for dtype in DTYPES:
        for n in SIZES:
            x = torch.randn(n, generator=torch.Generator().manual_seed(1000 * n + rank)).to(dtype)
            inputs = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(inputs, x)
            gloo = x.clone()
            dist.all_reduce(gloo)
            out.append((dtype, n, all_reduce_sum(x.clone(), group), gloo, inputs))
    return out


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_all_reduce_sums_in_rank_order_and_equals_gloo_at_tp_2(pools, tp):
    results = pools(tp).run(_sums, timeout=240)
    for case, (dtype, n, mine, gloo, inputs) in enumerate(results[0]):
        # written out: float32 accumulation over ranks 0, 1, ..., rounded once to the dtype
        expected = inputs[0].float()
        for x in inputs[1:]:
            expected = expected + x.float()
        expected = expected.to(dtype)
        assert torch.equal(mine, expected), (dtype, n)
        for r in range(1, tp):  # every rank has the same bits
            assert torch.equal(results[r][case][2], mine), (dtype, n, r)
        if tp == 2:  # one addition: gloo's sum bit for bit
            assert torch.equal(mine, gloo), (dtype, n)
        else:  # gloo adds in another order: they differ by rounding only
            torch.testing.assert_close(mine.float(), gloo.float(), rtol=0.02, atol=0.02)


def _many_steps() -> list[str]:
    """300 steps of an all-reduce, an all-gather and a broadcast, each rank's values new at every step and sizes
    that change: a read of the previous step's slot (or of a slot not yet written) gives a wrong result."""
    group, rank, world = _world(), dist.get_rank(), dist.get_world_size()
    wrong = []
    for step in range(300):
        n = (1, 7, 5000, shm.SLOT_BYTES // 4 + 3)[step % 4]
        x = torch.full((n,), float(step * 100 + rank))
        if rank == step % world:
            time.sleep(0.002)  # one rank late, a different one each step
        got = all_reduce_sum(x, group)
        if not got.eq(step * 100 * world + sum(range(world))).all():
            wrong.append(f"step {step}: {got[:3].tolist()}")
        y = torch.full((1, 2, 3 + rank), float(step + rank))
        gathered = all_gather_last_dim(y, [3 + r for r in range(world)], group)
        want = torch.cat([torch.full((1, 2, 3 + r), float(step + r)) for r in range(world)], dim=-1)
        if not torch.equal(gathered, want):
            wrong.append(f"gather at step {step}")
        sent = torch.full((3 + step % 5,), float(step)) if rank == 0 else torch.zeros(3 + step % 5)
        if not shm.for_group(group.name, group.get()).broadcast(sent).eq(step).all():
            wrong.append(f"broadcast at step {step}")
    return wrong


@pytest.mark.parametrize("tp", [2, 3])
def test_many_collectives_in_a_row_never_read_a_stale_slot(pools, tp):
    assert pools(tp).run(_many_steps, timeout=240) == [[]] * tp


def _wait_beside_a_thread() -> int:
    """Rank 0 waits ~1 s in an all-reduce for rank 1 while a thread of its own wakes every millisecond. With
    a switch interval of 2 s, a wait that held the GIL would let the thread run about once."""
    group = _world()
    ticks = [0]
    done = threading.Event()

    def tick():
        while not done.is_set():
            time.sleep(0.001)
            ticks[0] += 1

    previous = sys.getswitchinterval()
    sys.setswitchinterval(2.0)
    try:
        if dist.get_rank() == 0:
            thread = threading.Thread(target=tick)
            thread.start()
        else:
            time.sleep(1.0)
        all_reduce_sum(torch.ones(10), group)
        done.set()
        if dist.get_rank() == 0:
            thread.join()
    finally:
        sys.setswitchinterval(previous)
    return ticks[0]


def test_a_waiting_rank_leaves_the_gil_to_its_other_threads(pools):
    ticks = pools(2).run(_wait_beside_a_thread, timeout=60)[0]
    assert ticks >= 100, f"rank 0's thread woke {ticks} times in the ~1 s rank 0 waited"


def _launch(world: int, mode: str, env: dict | None = None) -> list[subprocess.CompletedProcess]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(HERE / "shm_ranks.py"), mode], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**os.environ, **(env or {}), "RANK": str(r), "WORLD_SIZE": str(world),
                                   "MASTER_PORT": str(port), "MASTER_ADDR": "127.0.0.1"})
             for r in range(world)]
    out = []
    for p in procs:
        try:
            stdout, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"a rank hung: {mode}")
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout))
        out[-1].pid = p.pid  # a segment's name starts with its creator's pid
    return out


def _segments(ranks: list[subprocess.CompletedProcess]) -> set[str]:
    """The segments these ranks made that are still in /dev/shm (not another test's, running beside this one)."""
    return {n for n in os.listdir(shm.DIRECTORY) for r in ranks if n.startswith(f"autotp-{r.pid}-")}


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_killed_mid_run_fails_the_others_within_seconds_and_leaves_no_segment(world):
    ranks = _launch(world, "die")
    assert ranks[1].returncode == -9
    for r in [0] + list(range(2, world)):
        assert "shared memory True" in ranks[r].stdout, ranks[r].stdout
        assert ranks[r].returncode == 3, ranks[r].stdout
        line = next(x for x in ranks[r].stdout.splitlines() if "failed after" in x)
        assert "rank 1 (pid" in line and "exited during a shared-memory collective" in line, line
        assert float(line.split("failed after ")[1].split(" s")[0]) < 30, line  # the group's timeout is 300 s
    assert not _segments(ranks)


def test_separate_processes_sum_right_at_every_all_reduce_in_two_groups():
    """Launched as torchrun launches ranks (not the pool's forked workers): all 25 sums right, silently."""
    ranks = _launch(2, "sum")
    assert [r.returncode for r in ranks] == [0, 0], [r.stdout for r in ranks]
    assert all(r.stdout.strip() == f"rank {i}: shared memory True, sums right True" for i, r in enumerate(ranks)), \
        [r.stdout for r in ranks]


def test_without_a_compiler_gloo_carries_the_sums_after_one_warning(tmp_path):
    ranks = _launch(2, "sum", {"CC": "/bin/false", "XDG_CACHE_HOME": str(tmp_path)})
    assert [r.returncode for r in ranks] == [0, 0], [r.stdout for r in ranks]
    assert all("shared memory False, sums right True" in r.stdout for r in ranks)
    # one line, though both process groups (as serve's two) found no barrier
    warnings = [line for r in ranks for line in r.stdout.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "gloo carries them" in warnings[0] and "C compiler failed" in warnings[0], warnings


def test_autotp_shm_0_turns_it_off_silently():
    ranks = _launch(2, "sum", {"AUTOTP_SHM": "0"})
    assert [r.returncode for r in ranks] == [0, 0]
    assert all(r.stdout.strip().endswith("shared memory False, sums right True") for r in ranks), ranks


def _opened_in_inference_mode() -> list[float]:
    """The segment is opened at a process group's first CPU collective, wherever that is: inside
    `torch.inference_mode()` (the server's forward), then used outside it and on a tensor that requires grad."""
    group = GroupRef.of(dist.new_group(backend="gloo"))  # a new group: its segment not opened yet
    with torch.inference_mode():
        first = all_reduce_sum(torch.ones(3), group)
    assert shm.for_group(group.name, group.get()) is not None
    weight = torch.ones(3, requires_grad=True)
    second = all_reduce_sum(weight * 2, group)
    third = all_reduce_sum(torch.ones(2), group)
    return first.tolist() + second.tolist() + third.tolist()


def test_a_segment_opened_inside_inference_mode_serves_outside_it(pools):
    assert pools(2).run(_opened_in_inference_mode) == [[2.0] * 3 + [4.0] * 3 + [2.0] * 2] * 2
