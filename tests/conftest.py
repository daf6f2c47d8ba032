import pytest
from checkpoints import CONFIGS, build, reference, save
from pool import RankPool


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
