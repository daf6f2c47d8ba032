import families
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
