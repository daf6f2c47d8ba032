"""Which GPU a rank takes, with the GPU count simulated: the logic runs on CPU; only a GPU can confirm that
NCCL, object collectives and CUDA graphs then run on that device (see the note in distributed.py)."""

import socket
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from autotp import distributed
from autotp.distributed import resolve_device, shared_gpus
from autotp.errors import AutotpError


@pytest.fixture
def gpus(monkeypatch):
    def simulate(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

    return simulate


def test_each_rank_takes_its_local_ranks_gpu(gpus):
    gpus(4)
    assert resolve_device(None, 3) == torch.device("cuda", 3)
    assert resolve_device("cuda", 1) == torch.device("cuda", 1)
    assert resolve_device("cuda:2", 0) == torch.device("cuda", 2)  # an explicit mapping is the user's
    assert resolve_device("cpu", 1) == torch.device("cpu")


def test_one_visible_gpu_per_rank_is_cuda_0(gpus):
    gpus(1)  # a launcher that sets CUDA_VISIBLE_DEVICES per rank
    assert resolve_device(None, 3) == torch.device("cuda", 0)


def test_no_local_rank_never_falls_back_to_the_global_rank(gpus):
    gpus(8)  # rank 12 of a 2-node job with LOCAL_RANK unset
    with pytest.raises(AutotpError, match="LOCAL_RANK is not set, so this rank cannot tell which of the 8 GPUs"):
        resolve_device(None, None)
    assert resolve_device("cuda:5", None) == torch.device("cuda", 5)


def test_a_local_rank_without_a_gpu(gpus):
    gpus(2)
    with pytest.raises(AutotpError, match="LOCAL_RANK 3 wants cuda:3, but torch sees 2 GPUs"):
        resolve_device(None, 3)
    gpus(0)
    with pytest.raises(AutotpError, match="torch sees no CUDA device"):
        resolve_device("cuda", 0)


def test_the_users_group_and_the_requested_device_must_agree(gpus):
    gpus(4)
    bound = torch.device("cuda", 1)  # init_process_group("nccl", device_id=cuda:1) by the user
    assert resolve_device(None, 1, bound) == bound
    assert resolve_device(None, None, bound) == bound
    with pytest.raises(AutotpError, match="device cuda:0 was asked for, but this rank's process group is bound to "
                                          "cuda:1"):
        resolve_device("cuda:0", 1, bound)


def test_two_ranks_on_one_gpu_are_found():
    # device="cuda:0" passed on every rank of one host: ranks 0 and 1 clash; the other host is fine
    placements = [("a", "cuda:0", "GPU-0"), ("a", "cuda:0", "GPU-0"), ("b", "cuda:0", "GPU-0"),
                  ("b", "cuda:1", "GPU-1"), ("a", "cpu", "cpu"), ("a", "cpu", "cpu")]
    assert shared_gpus(placements) == [[0, 1]]
    assert shared_gpus([("a", "cuda:0", "GPU-0"), ("a", "cuda:1", "GPU-1")]) == []


def init_on_visible_gpu(uuids: list[str]) -> str:
    """A pool task: autotp's own init(device="cuda") on a rank that sees one GPU (CUDA_VISIBLE_DEVICES set per
    rank by the launcher), cuda:0, whose UUID is uuids[rank]. The device queries are patched; the placements
    travel through the pool's real process group. Returns the device it got, or the error."""
    props = SimpleNamespace(uuid=uuids[dist.get_rank()], name="emulated", total_memory=2**34)
    with mock.patch.object(torch.cuda, "is_available", lambda: True), \
            mock.patch.object(torch.cuda, "device_count", lambda: 1), \
            mock.patch.object(torch.cuda, "set_device", lambda device: None), \
            mock.patch.object(torch.cuda, "get_device_properties", lambda device=None: props):
        try:
            return str(distributed.init(device="cuda").device)
        except AutotpError as e:
            return str(e)


def test_ranks_that_each_see_their_own_gpu_as_cuda_0_start(pools):
    # SLURM --gpus-per-task=1: every rank is cuda:0, each of another GPU (the UUID nvidia-smi -L prints)
    uuids = ["GPU-5e1d7a0c-0000-0000-0000-000000000000", "GPU-5e1d7a0c-1111-1111-1111-111111111111"]
    assert pools(2).run(init_on_visible_gpu, uuids, timeout=60) == ["cuda:0", "cuda:0"]


def test_two_ranks_on_one_physical_gpu_are_still_refused(pools):
    # two ranks given the same GPU (a launcher's mistake): the same UUID on one host
    uuid = "GPU-5e1d7a0c-0000-0000-0000-000000000000"
    said = f"ranks 0, 1 all run on cuda:0 of node 0 ({socket.gethostname()}): give each rank its own GPU"
    assert [s[:len(said)] for s in pools(2).run(init_on_visible_gpu, [uuid, uuid], timeout=60)] == [said, said]
