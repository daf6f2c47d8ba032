"""The sliced loader: what each rank reads, and every way a checkpoint or config can be wrong."""

import json
import shutil

import pytest
import torch
from checkpoints import build, save
from pool import RankError
from safetensors.torch import load_file, save_file
from tasks import load_error, sharded_outputs

import autotp
from autotp.errors import AutotpError
from autotp.report import plan_report


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_reads_only_its_planned_slices(pools, checkpoint, tp):
    model_dir, _ = checkpoint("mqa12")
    ranks = pools(tp).run(sharded_outputs, model_dir, [[1, 2]], 1, 0)
    planned = plan_report(model_dir, tp)["ranks"]
    full = load_file(f"{model_dir}/model.safetensors")
    file_bytes = sum(t.numel() * t.element_size() for t in full.values())
    replicated = sum(t["bytes"] for t in planned[0]["tensors"] if t["holds"] == "replicated")
    kv_rows = sum(full[k][96:].numel() * 4 for k in full if "c_attn" in k)  # K/V: 2*head_dim rows per layer
    for r, plan in zip(ranks, planned, strict=True):
        assert r["info"].bytes_read == plan["total_bytes"] == r["info"].param_bytes
        assert r["info"].bytes_read < file_bytes / tp + replicated + kv_rows
    # every byte of the file is read by some rank; replicated ones (K/V included) by all of them
    assert sum(r["info"].bytes_read for r in ranks) == file_bytes + (tp - 1) * (replicated + kv_rows)


def test_sharded_checkpoint_with_index_loads_identically(tmp_path, pools, checkpoint):
    model_dir, ref = checkpoint("mqa10")
    model = build("mqa10")
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ranks = pools(2).run(sharded_outputs, str(tmp_path), [[3, 17, 42, 8, 99, 51, 23]], 32, 1234)
    assert all(r["greedy"] == ref["greedy"] for r in ranks)


def test_dtype_is_converted_on_read(checkpoint):
    model_dir, _ = checkpoint("mqa12")
    model = autotp.from_pretrained(model_dir, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    full = load_file(f"{model_dir}/model.safetensors")
    assert torch.equal(model.transformer.wpe.weight, full["transformer.wpe.weight"].to(torch.bfloat16))


@pytest.fixture
def broken(tmp_path, checkpoint):
    """A writable copy of a good checkpoint to break."""
    model_dir, _ = checkpoint("mqa12")
    shutil.copytree(model_dir, tmp_path / "m")
    return tmp_path / "m"


def expect_error(model_dir, match):
    with pytest.raises(AutotpError, match=match):
        autotp.from_pretrained(model_dir)


def test_corrupt_header(broken):
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[:8] + b"{not json" + data[17:])
    expect_error(broken, "corrupt safetensors header in .*model.safetensors")


def test_truncated_file(broken):
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    expect_error(broken, "corrupt safetensors header")


def test_missing_shard_file(tmp_path):
    build("mqa10").save_pretrained(tmp_path, max_shard_size="50KB")
    victim = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    victim.unlink()
    expect_error(tmp_path, f"names {victim.name}, which is missing")


def test_no_safetensors(broken):
    (broken / "model.safetensors").unlink()
    expect_error(broken, "no model.safetensors or model.safetensors.index.json")


def test_missing_and_unused_keys(broken):
    tensors = load_file(broken / "model.safetensors")
    tensors["transformer.h.0.attn.extra.weight"] = torch.zeros(2)
    save_file(tensors, broken / "model.safetensors")
    expect_error(broken, "1 tensors the model does not use: transformer.h.0.attn.extra.weight")
    del tensors["transformer.h.0.attn.extra.weight"], tensors["transformer.h.1.mlp.c_fc.bias"]
    save_file(tensors, broken / "model.safetensors")
    expect_error(broken, "lacks 1 tensors the model needs: transformer.h.1.mlp.c_fc.bias")


def test_config_checkpoint_shape_mismatch(broken):
    config = json.loads((broken / "config.json").read_text())
    config["n_inner"] = 204
    (broken / "config.json").write_text(json.dumps(config))
    expect_error(broken, r"checkpoint tensor transformer.h.0.mlp.c_fc.weight has shape \(202, 96\) but the config "
                         r"gives \(204, 96\)")


def test_unsupported_architecture_names_the_supported(tmp_path):
    """OLMo-2 has no built-in plan and its q_norm spans all heads: inference refuses and lists the plans."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    save(Olmo2ForCausalLM(Olmo2Config(hidden_size=16, num_attention_heads=2, intermediate_size=32, num_hidden_layers=1,
                                      vocab_size=50, pad_token_id=None, bos_token_id=None, eos_token_id=None)),
         tmp_path)
    expect_error(tmp_path, "no built-in plan for 'olmo2' and the inferred one is ambiguous: .*across heads"
                           "(.|\n)*Built-in plans: falcon, gemma, gemma2, gpt2, gpt_bigcode")


def test_unknown_dtype(checkpoint):
    with pytest.raises(AutotpError, match="unknown dtype 'float8': choose one of float32, bfloat16, float16"):
        autotp.from_pretrained(checkpoint("mqa12")[0], dtype="float8")


def test_tp_size_must_match_the_launched_processes(checkpoint):
    with pytest.raises(AutotpError, match="tp_size 4 does not match the 1 launched processes"):
        autotp.from_pretrained(checkpoint("mqa12")[0], tp_size=4)


def test_tp_larger_than_heads_fails_on_every_rank_before_reading(tmp_path, pools, checkpoint):
    model_dir = save(build("mqa10", n_head=2, n_embd=16), tmp_path)
    results = pools(3).run(load_error, model_dir, errors=True)
    for r in results:
        assert isinstance(r, RankError) and isinstance(r.exc, AutotpError)
        assert "tp_size 3 exceeds the 2 query heads" in str(r.exc)
    assert pools(3).run(sharded_outputs, checkpoint("mqa12")[0], [[1]], 1, 0)  # no rank was left waiting


def test_a_rank_that_dies_does_not_hang_the_others(pools):
    from tasks import die_or_reduce

    with pytest.raises(RuntimeError, match=r"ranks \[1\] died"):
        pools(2).run(die_or_reduce, 1, timeout=60)


def test_hub_id_resolves_from_the_offline_cache(tmp_path, monkeypatch, checkpoint):
    """A hub id is looked up in the huggingface_hub cache; HF_HUB_OFFLINE=1 means no request is made."""
    model_dir, ref = checkpoint("mqa12")
    snapshot = tmp_path / "hub" / "models--bigcode--tiny" / "snapshots" / "0123abcd"
    shutil.copytree(model_dir, snapshot)
    (tmp_path / "hub" / "models--bigcode--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--bigcode--tiny" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    model = autotp.from_pretrained("bigcode/tiny")
    assert model.autotp.bytes_read > 0
    with pytest.raises(AutotpError, match="cannot find model 'bigcode/absent' locally or on the hub"):
        autotp.from_pretrained("bigcode/absent")
