"""Every family with a plan (and one with an inferred plan): sharded vs unsharded HF model at tp 2, 3, 4."""

import pytest
import torch
from checkpoints import LOGIT_ATOL
from families import FAMILIES, GLOBAL_SIZES, build, config, rank_outputs, reference, save_fused
from safetensors.torch import load_file

from autotp.errors import AutotpError
from autotp.loading.checkpoint import Checkpoint
from autotp.loading.skeleton import skeleton
from autotp.parallel.layout import ExpertKeys, resolve
from autotp.plans import builtin_plans, plan_for
from autotp.plans.infer import infer_plan
from autotp.report import plan_report


@pytest.mark.parametrize("tp", [2, 3, 4])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_parity(pools, family_checkpoint, name, tp):
    model_dir, ref = family_checkpoint(name)
    ranks = pools(tp).run(rank_outputs, model_dir)
    cfg = config(name)
    plan = plan_for(cfg)
    # every loaded tensor is exactly the planned slice of the checkpoint's (pure indexing: bit-exact); fused
    # experts, stored per expert, exactly the slice of the model's own fused tensor
    full = load_file(f"{model_dir}/model.safetensors")
    layout = resolve(skeleton(cfg, torch.float32, buffers=False), plan, tp, Checkpoint(model_dir))
    for r, rank in enumerate(ranks):
        for name, param in layout.params.items():
            tensor = ref["state"][name] if isinstance(param.key, ExpertKeys) else full[param.key]
            assert torch.equal(rank["state"][name], param.shards[r].take(tensor)), f"rank {r}: {param.key}"
    # fp32 logits within an all-reduce's rounding (see test_parity), scaled to these models' logit range
    atol = LOGIT_ATOL * max(1.0, ref["logits"].abs().max().item() / 10)
    for r, rank in enumerate(ranks):
        diff = (rank["logits"] - ref["logits"]).abs().max().item()
        assert diff <= atol, f"rank {r}: max |logit diff| {diff} > {atol}"
        assert rank["greedy"] == ref["greedy"], f"rank {r}"
        assert rank["sizes"] == {k: v for k, v in cfg.to_dict().items() if k in GLOBAL_SIZES}, "config was changed"
    assert len(set(ref["greedy"][0][len(ref["greedy"][0]) - 16:])) > 3, "degenerate reference output proves nothing"


def test_plan_from_config_alone_for_every_family(tmp_path):
    """`autotp plan` needs only config.json: every family, including the inferred one, at tp 4."""
    for name in FAMILIES:
        config(name).save_pretrained(tmp_path / name)
        report = plan_report(str(tmp_path / name), 4)
        assert report["plan_source"] == ("inferred" if name == "granite" else "built-in"), name
        assert not report["checkpoint_headers"] and len(report["ranks"]) == 4


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3", "gemma", "olmo", "starcoder2", "opt"])
def test_inferred_plan_matches_the_built_in_one(name):
    """Where a family's layout is unambiguous, inference from the module tree finds the hand-written plan."""
    cfg = config(name)
    inferred, built_in = infer_plan(cfg), builtin_plans()[cfg.model_type](cfg)
    assert inferred.source == "inferred" and built_in.source == "built-in"
    assert inferred.layers == built_in.layers and inferred.attention == built_in.attention
    assert set(built_in.attention_attrs.items()) <= set(inferred.attention_attrs.items())


@pytest.mark.parametrize("name, reason", [
    ("phi3", "qkv_proj .* is not the .* output.*reads head counts from the config"),
    ("gpt2", "c_attn .* is neither a query .* fused projections need a built-in plan"),
    ("falcon_mq", "ALiBi biases built for all 6 heads"),
])
def test_ambiguous_inference_is_refused_with_the_inferred_plan(name, reason):
    with pytest.raises(AutotpError, match=reason) as e:
        infer_plan(config(name), supported=["llama"])
    assert "Inferred (" in str(e.value) and "write src/autotp/plans/<family>.py" in str(e.value)


@pytest.mark.parametrize("name, tp, message", [
    ("gemma", 5, "tp_size 5 exceeds the 4 query heads: at most 4 ranks can hold a head"),
    ("qwen2", 7, "tp_size 7 exceeds the 6 query heads"),
])
def test_tp_beyond_the_heads_names_both_numbers(name, tp, message):
    with pytest.raises(AutotpError, match=message):
        plan_for(config(name)).heads(tp)


def test_query_heads_not_grouping_over_kv_heads_is_an_error():
    cfg = config("llama")
    cfg.num_key_value_heads = 3
    with pytest.raises(AutotpError, match="8 query heads cannot be grouped over 3 KV heads"):
        plan_for(cfg).heads(2)


def test_bloom_slow_but_exact_is_refused():
    """BLOOM's slow_but_exact path slices dense's weight itself, bypassing the row-parallel layer."""
    cfg = config("bloom")
    cfg.pretraining_tp, cfg.slow_but_exact = 4, True
    with pytest.raises(AutotpError, match="slow_but_exact=True and pretraining_tp=4 is not supported"):
        plan_for(cfg)


def test_inference_refuses_a_forward_whose_source_is_not_installed(monkeypatch):
    """Zipapps and some frozen installs ship no .py: the forward cannot be checked, so nothing is inferred."""
    import inspect

    def no_source(obj):
        raise OSError("could not get source code")

    cfg = config("granite")
    assert infer_plan(cfg).source == "inferred"  # unambiguous when the source can be read
    monkeypatch.setattr(inspect, "getsource", no_source)
    with pytest.raises(AutotpError, match=r"cannot read the source of GraniteAttention\.forward to check it "
                                          r"\(could not get source code\)") as e:
        plan_for(cfg)
    assert "Inferred (" in str(e.value) and "Built-in plans: " in str(e.value)


def test_an_inferred_plan_is_announced_at_load_and_can_be_refused(capsys, monkeypatch):
    """The user learns that no built-in plan exists, how to see the inferred one, and how to refuse it."""
    import autotp

    model = build("granite")
    autotp.init_inference(model)
    err = capsys.readouterr().err
    assert "autotp: no built-in plan for granite: using one inferred from its modules" in err
    assert "AUTOTP_INFERRED_PLANS=0 refuses it" in err
    monkeypatch.setenv("AUTOTP_INFERRED_PLANS", "0")
    with pytest.raises(AutotpError, match="no built-in plan for 'granite' and AUTOTP_INFERRED_PLANS=0 refuses"):
        autotp.init_inference(build("granite"))


@pytest.mark.parametrize("tp", [2, 3, 4, 5])
def test_codegen_qkv_with_heads_straddling_mp_num_blocks(tp):
    """CodeGen's 4 blocks of [Q | V | K] hold 5 heads of 8 here (10 rows per part per block), so heads
    straddle blocks: each rank's rows, fed to HF's own attention with the plan's per-rank attributes, sum
    (over the row-parallel out_proj) to the unsharded attention's output."""
    import copy

    from transformers import CodeGenConfig
    from transformers.models.codegen.modeling_codegen import CodeGenAttention, CodeGenRotaryEmbedding

    from autotp.parallel.partition import assign_heads
    from autotp.parallel.slices import TensorShard
    from autotp.parallel.styles import BlockInterleavedQKV, RankContext

    cfg = CodeGenConfig(n_embd=40, n_head=5, rotary_dim=4, n_layer=1)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = CodeGenAttention(cfg, 0).eval()
    x = torch.randn(2, 6, 40)
    pos = CodeGenRotaryEmbedding(cfg)(x, torch.arange(6)[None])
    attrs = plan_for(cfg).attention_attrs
    with torch.no_grad():
        total = torch.zeros(2, 6, 40)
        for rank, h in enumerate(assign_heads(5, 5, 8, tp)):
            part = copy.deepcopy(attn)
            rows = BlockInterleavedQKV().out_ranges(120, RankContext(rank, tp, h))
            part.qkv_proj.weight = torch.nn.Parameter(TensorShard.along(0, rows).take(attn.qkv_proj.weight))
            part.out_proj.weight = torch.nn.Parameter(attn.out_proj.weight[:, h.q_start * 8:h.q_stop * 8])
            for attr, prop in attrs.items():
                setattr(part, attr, getattr(h, prop))
            total += part(x, pos)[0]
        torch.testing.assert_close(total, attn(x, pos)[0], rtol=0, atol=1e-6)


def test_per_head_inputs_that_cannot_be_narrowed_are_errors():
    from autotp.parallel.head_inputs import NarrowHeads, narrow_heads

    heads = plan_for(config("bloom")).heads(2)[1]  # heads 4:7 of 7
    bias = torch.arange(2 * 7 * 5.0).reshape(2 * 7, 1, 5)  # (batch * heads, 1, k)
    assert torch.equal(narrow_heads(bias, heads), bias.reshape(2, 7, 1, 5)[:, 4:].reshape(6, 1, 5))
    assert narrow_heads(torch.ones(2, 1, 3, 5), heads).shape == (2, 1, 3, 5)  # no heads dim: broadcast
    with pytest.raises(AutotpError, match=r"shape \(9, 1, 5\) has 9 rows at dim -3, not a multiple of the model's 7"):
        narrow_heads(torch.ones(9, 1, 5), heads)
    with pytest.raises(AutotpError, match="BloomAttention was called without alibi= as a keyword"):
        NarrowHeads(("alibi",), heads)(type("BloomAttention", (), {})(), (bias,), {})


def test_fused_experts_stay_unquantized_and_refuse_what_they_cannot_split():
    """Quantization covers the 2-D linear weights only: the 3-D experts stay in the model dtype. Too many
    ranks for an expert's feature granules, and experts with biases, are errors before any weight is read."""
    from autotp.quant.weights import Quant

    cfg = config("mixtral")
    layout = resolve(skeleton(cfg, torch.float32, buffers=False), plan_for(cfg), 2, quant=Quant("int8"))
    assert layout.param("model.layers.0.self_attn.q_proj.weight").quant is not None
    assert layout.param("model.layers.0.mlp.experts.gate_up_proj").quant is None
    assert layout.param("model.layers.0.mlp.experts.down_proj").quant is None
    cfg.intermediate_size = 12  # 3 granules of 4 features
    with pytest.raises(AutotpError, match="tp_size 4 exceeds the 3 granules of 4 intermediate features of each "
                                          "expert of MixtralExperts: at most 3 ranks"):
        resolve(skeleton(cfg, torch.float32, buffers=False), plan_for(cfg), 4)
    net = skeleton(cfg, torch.float32, buffers=False)
    net.model.layers[0].mlp.experts.has_bias = True
    with pytest.raises(AutotpError, match="MixtralExperts has expert biases or post-expert norms"):
        resolve(net, plan_for(cfg), 2)


def test_a_checkpoint_with_fused_experts_loads_too(pools, tmp_path):
    """A checkpoint holding the model's own fused 3-D experts (its transformers 5 state_dict written with
    safetensors' save_file) loads as well as the hub's per-expert one: at tp 3, every tensor bit-exact and
    the greedy tokens identical."""
    model = build("mixtral")
    save_fused(model, tmp_path)
    ref, state = reference(model), model.state_dict()
    layout = resolve(skeleton(config("mixtral"), torch.float32, buffers=False), plan_for(config("mixtral")), 3,
                     Checkpoint(tmp_path))
    assert layout.param("model.layers.1.mlp.experts.gate_up_proj").key == "model.layers.1.mlp.experts.gate_up_proj"
    for r, rank in enumerate(pools(3).run(rank_outputs, str(tmp_path))):
        assert rank["greedy"] == ref["greedy"], f"rank {r}"
        for name, param in layout.params.items():
            assert torch.equal(rank["state"][name], param.shards[r].take(state[name])), f"rank {r}: {name}"


def test_per_expert_checkpoint_errors_name_the_tensor_and_both_shapes(tmp_path):
    """The hub's per-expert layout is validated like any other: a missing expert's part, a mis-shaped one,
    and a checkpoint that holds both the fused and the per-expert form are errors before any weight is read."""
    from safetensors.torch import save_file

    cfg, model = config("mixtral"), build("mixtral")
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")

    def resolve_with(changed):
        save_file(changed, tmp_path / "model.safetensors", metadata={"format": "pt"})
        return resolve(skeleton(cfg, torch.float32, buffers=False), plan_for(cfg), 2, Checkpoint(tmp_path))

    key = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    with pytest.raises(AutotpError, match=f"lacks 1 tensors the model needs: {key}$"):
        resolve_with({k: v for k, v in tensors.items() if k != key})
    with pytest.raises(AutotpError, match=rf"{key} has shape \(40, 48\) but the config gives \(44, 48\) \(one "
                                          r"expert's part of model.layers.1.mlp.experts.gate_up_proj \(4, 88, 48\)\)"):
        resolve_with(tensors | {key: tensors[key][:40]})
    fused = {"model.layers.1.mlp.experts.down_proj": model.state_dict()["model.layers.1.mlp.experts.down_proj"]}
    with pytest.raises(AutotpError, match="has 4 tensors the model does not use: "
                                          "model.layers.1.block_sparse_moe.experts.0.w2.weight"):
        resolve_with(tensors | fused)
    assert isinstance(resolve_with(tensors).param("model.layers.1.mlp.experts.down_proj").key, ExpertKeys)
