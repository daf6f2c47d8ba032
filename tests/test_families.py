"""Every family with a plan (and one with an inferred plan): sharded vs unsharded HF model at tp 2, 3, 4."""

import pytest
import torch
from families import FAMILIES, build, config, rank_outputs, reference
from safetensors.torch import load_file
from test_parity import LOGIT_ATOL

from autotp.plans import plan_for
from autotp.shard import rank_shards
from autotp.skeleton import skeleton


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory):
    """family_checkpoint(name) -> (directory, unsharded reference outputs), built once per session."""
    made: dict[str, tuple[str, dict]] = {}

    def get(name: str) -> tuple[str, dict]:
        if name not in made:
            model = build(name)
            directory = tmp_path_factory.mktemp(name)
            model.save_pretrained(directory)
            made[name] = (str(directory), reference(model))
        return made[name]

    return get


@pytest.mark.parametrize("tp", [2, 3, 4])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_parity(pools, family_checkpoint, name, tp):
    model_dir, ref = family_checkpoint(name)
    ranks = pools(tp).run(rank_outputs, model_dir)
    cfg = config(name)
    plan = plan_for(cfg)
    # every loaded tensor is exactly the planned slice of the checkpoint's (pure indexing: bit-exact)
    full = load_file(f"{model_dir}/model.safetensors")
    shards = rank_shards(skeleton(cfg, torch.float32, buffers=False), plan, tp)
    stored_as = {old: name for name, old in plan.checkpoint_names.items()}
    for r, rank in enumerate(ranks):
        for key, tensor in full.items():
            name = stored_as.get(key, key)
            assert torch.equal(rank["state"][name], shards[r][name].take(tensor)), f"rank {r}: {key}"
    # fp32 logits within an all-reduce's rounding (see test_parity), scaled to these models' logit range
    atol = LOGIT_ATOL * max(1.0, ref["logits"].abs().max().item() / 10)
    for r, rank in enumerate(ranks):
        diff = (rank["logits"] - ref["logits"]).abs().max().item()
        assert diff <= atol, f"rank {r}: max |logit diff| {diff} > {atol}"
        assert rank["greedy"] == ref["greedy"], f"rank {r}"
    assert len(set(ref["greedy"][0][len(ref["greedy"][0]) - 16:])) > 3, "degenerate reference output proves nothing"
