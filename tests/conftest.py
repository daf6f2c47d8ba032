import os
from collections import Counter

import families
import pytest
import torch
from checkpoints import CONFIGS, build, reference, save
from pool import RankPool


def pytest_configure(config):
    """One thread, for the session's own torch and for every rank or server its tests start: in each of
    pytest-xdist's workers (pyproject's addopts: two), so that two workers on two cores do not each run two OpenMP
    threads, and with `-n 0` too, where torch's two threads on a busy machine wait for each other: measured there
    (load 5-7), test_continuous.py's in-process tests took 129-136 s with two, 48 s with one."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Files with the most `slow` tests first, each file's tests in their own order: the workers take whole files
    (--dist loadfile) in this order, so the long ones start at once and the many short ones fill the end, instead
    of a long file starting last beside an idle worker."""
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    order = {item: i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-slow[item.path], order[item]))


@pytest.fixture(scope="session")
def pools():
    """pools(n) -> the session's RankPool of n ranks, started on first use (a broken one is replaced)."""
    started: dict[int, RankPool] = {}

    def get(n: int) -> RankPool:
        if n not in started or started[n].broken:
            started[n] = RankPool(n)
        return started[n]

    yield get
    for p in started.values():
        p.close()


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(name) -> (directory, unsharded reference outputs), built once per session."""
    made: dict[str, tuple[str, dict]] = {}

    def get(name: str) -> tuple[str, dict]:
        if name not in made:
            model = build(name)
            made[name] = (save(model, tmp_path_factory.mktemp(name)), reference(model))
        return made[name]

    return get


@pytest.fixture(scope="session")
def config_names():
    return list(CONFIGS)


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory):
    """family_checkpoint(name) -> (directory, unsharded reference outputs) of tests/families.py's tiny random
    checkpoint of family `name` (as save_pretrained writes it: config.json and safetensors, no tokenizer files),
    built once per session. The outputs: PROMPT's logits, the greedy continuation, and the state dict."""
    made: dict[str, tuple[str, dict]] = {}

    def get(name: str) -> tuple[str, dict]:
        if name not in made:
            model = families.build(name)
            directory = tmp_path_factory.mktemp(name)
            families.save(name, model, directory)
            made[name] = (str(directory), families.reference(model) | {"state": model.state_dict()})
        return made[name]

    return get


@pytest.fixture(autouse=True)
def library_linear():
    """Every test leaves F.linear in place, as a library user has it: gemv.c is process-wide once `autotp serve`'s
    start-up (or a test) enables it, and the tests that compare with HF bit for bit would then pass or fail by
    the order the tests ran in."""
    from autotp.parallel import gemv

    yield
    if gemv._on:
        gemv._on = False
        pytest.fail("this test left gemv.c on (gemv._on): later tests would not run F.linear")
