"""The sliced loader: what each rank reads, and every way a checkpoint or config can be wrong."""

import json
import math
import re
import shutil
import struct

import pytest
import torch
from checkpoints import build, save
from pool import RankError
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tasks import load_error, sharded_outputs

import autotp
from autotp.errors import AutotpError
from autotp.generate import generate
from autotp.loading import checkpoint as loader
from autotp.loading.checkpoint import Checkpoint
from autotp.parallel.layout import ExpertKeys
from autotp.parallel.partition import even_split
from autotp.parallel.slices import TensorShard
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
        assert r["info"].bytes_read == plan["total_bytes"] == r["info"].param_bytes == r["held_bytes"]
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
                           "(.|\n)*Built-in plans: bloom, codegen, falcon, gemma, gemma2, gpt2, gpt_bigcode")


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


def test_a_rank_that_dies_mid_generation_does_not_hang_the_others(tmp_path, pools, checkpoint):
    """Rank 1 exits hard as its third forward begins: rank 0, waiting in that forward's collectives, raises out
    of the sharded model's forward instead of waiting for a rank that is gone."""
    from tasks import die_while_generating

    with pytest.raises(RuntimeError, match=r"ranks \[1\] died"):
        pools(2).run(die_while_generating, checkpoint("mqa12")[0], 1, str(tmp_path), timeout=60)
    survivor = json.loads((tmp_path / "rank0.json").read_text())  # written before the pool let rank 0 go
    assert survivor["ended"].startswith("raised ") and survivor["forwards"] == 3, survivor
    assert any(frame.startswith(("layers.py:", "guard.py:", "collectives.py:")) for frame in survivor["frames"]), \
        survivor


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
    with pytest.raises(AutotpError) as absent:
        autotp.from_pretrained("bigcode/absent")
    # huggingface_hub's own message was cut mid-word at 200 characters ("... set 'HF_HUB_OFFLINE"): this one is whole
    assert str(absent.value) == (f"cannot find model 'bigcode/absent': HF_HUB_OFFLINE is set and it is not in the hub "
                                 f"cache ({tmp_path / 'hub'}): fetch it once with the network on, or give a local "
                                 "directory")


def test_a_long_hub_message_is_cut_between_words():
    from autotp.hub import clip

    text = "Cannot find an appropriate cached snapshot folder " * 6 + "\nsecond line"
    cut = clip(text, 120)
    kept = cut.removesuffix(" ...")
    assert cut.endswith(" ...") and len(kept) <= 120 and text.startswith(kept) and text[len(kept)] == " "
    assert clip("short\nsecond line") == "short" and clip("") == ""


def rewrite_header(path, change):
    """Apply `change` to a safetensors file's JSON header in place; the data bytes stay as they are."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = change(json.loads(data[8:8 + n]))
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def expect_plan_and_load_error(model_dir, match):
    """`autotp plan` and `from_pretrained` (what `autotp generate` calls) refuse alike, before any weight."""
    with pytest.raises(AutotpError, match=match):
        plan_report(str(model_dir), 2)
    expect_error(model_dir, match)


def with_index(model_dir, file_for):
    """Replace model_dir's single file by an index whose weight_map gives each tensor file_for(key)."""
    keys = load_file(model_dir / "model.safetensors").keys()
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: file_for(k) for k in keys}}))


@pytest.mark.parametrize("where", ["../outside.safetensors", "absolute", "shards/../../outside.safetensors"])
def test_index_naming_a_file_outside_the_directory_is_refused(broken, where):
    outside = broken.parent / "outside.safetensors"
    (broken / "model.safetensors").rename(outside)  # a valid checkpoint, just not inside the model directory
    where = str(outside) if where == "absolute" else where
    shutil.copy(outside, broken / "model.safetensors")
    with_index(broken, lambda k: where)
    (broken / "model.safetensors").unlink()
    expect_plan_and_load_error(broken, f"model.safetensors.index.json maps tensor .* to {re.escape(where)}, "
                                       f"outside {re.escape(str(broken))}: autotp reads only files inside")


def test_index_weight_map_value_that_is_not_a_file_name(broken):
    with_index(broken, lambda k: 5 if k == "transformer.wpe.weight" else "model.safetensors")
    expect_plan_and_load_error(broken, "corrupt checkpoint index .*model.safetensors.index.json: tensor "
                                       "transformer.wpe.weight maps to 5, not a file name")


def test_header_that_is_a_json_list(broken):
    rewrite_header(broken / "model.safetensors", lambda h: list(h))
    expect_plan_and_load_error(broken, "corrupt safetensors header in .*model.safetensors: the header is a JSON "
                                       "list, not an object")


def test_header_shape_that_disagrees_with_its_byte_range(broken):
    def shrink(header):
        begin, end = header["transformer.wpe.weight"]["data_offsets"]
        header["transformer.wpe.weight"]["data_offsets"] = [begin, end - 4]
        return header

    rewrite_header(broken / "model.safetensors", shrink)
    expect_plan_and_load_error(broken, r"corrupt safetensors header in .*model.safetensors: tensor "
                                       r"'transformer.wpe.weight' of shape \(64, 96\) and dtype F32 needs 24576 "
                                       r"bytes, but its data_offsets \d+:\d+ hold 24572")


def test_float_weight_stored_as_integers(broken):
    def as_i32(header):
        header["transformer.wpe.weight"]["dtype"] = "I32"  # same itemsize: the byte range still fits
        return header

    rewrite_header(broken / "model.safetensors", as_i32)
    expect_plan_and_load_error(broken, "checkpoint tensor transformer.wpe.weight in .*model.safetensors is stored "
                                       "as I32, but the model's transformer.wpe.weight is float32")


@pytest.mark.parametrize("config, message", [
    ([1, 2], "config.json is a JSON list, not an object of config fields"),
    ({"n_layer": "2"}, "cannot read .*config.json: Validation error for field 'n_layer': TypeError: Field "
                       "'n_layer' expected int, got str"),
    ({"n_head": 0}, "config.json gives n_head=0: a model needs at least 1 attention head"),
    ({"n_head": 7}, r"config.json gives n_embd=96, which does not split into n_head=7 heads of equal size "
                    r"\(96 % 7 = 5\)"),
])
def test_config_that_cannot_describe_a_model(broken, config, message):
    if isinstance(config, dict):
        config = json.loads((broken / "config.json").read_text()) | config
    (broken / "config.json").write_text(json.dumps(config))
    expect_plan_and_load_error(broken, message)


@pytest.mark.parametrize("bad", [101, 99999, -1])
def test_prompt_ids_outside_the_vocabulary(checkpoint, bad):
    model = autotp.from_pretrained(checkpoint("mqa12")[0])
    with pytest.raises(AutotpError, match=f"token id {bad} is outside the model's vocabulary of 101 ids "
                                          r"\(0 to 100\)"):
        generate(model, torch.tensor([[3, bad, 5]]), max_new_tokens=1)


@pytest.fixture(scope="module")
def tensors(tmp_path_factory):
    """A file of tensors whose rows and columns divide by none of 2, 3, 5, in two dtypes, and its contents."""
    torch.manual_seed(0)
    full = {"w": torch.randn(37, 29), "b": torch.randn(53), "h": torch.randn(41, 23).to(torch.bfloat16)}
    path = tmp_path_factory.mktemp("blocks") / "model.safetensors"
    save_file(full, path)
    return path.parent, full


def shards(shape):
    """Every rank's uneven row or column shard at tp 2, 3, 5, a fused-style shard of three ranges, the whole."""
    out = [TensorShard.along(dim, [part]) for dim in range(len(shape)) for tp in (2, 3, 5)
           for part in even_split(shape[dim], tp)]
    out.append(TensorShard.along(0, [(0, 4), (10, 15), (shape[0] - 7, shape[0])]))
    return out + [TensorShard()]


@pytest.mark.parametrize("block_bytes", [1, 200, 1000, None])
def test_shards_read_in_many_blocks_equal_slices_of_the_full_tensor(tensors, monkeypatch, block_bytes):
    """Bit-exact against indexing the full tensor, with blocks down to one row per file opening; None is
    the default block size, which holds each of these tensors whole."""
    directory, full = tensors
    opened = []
    monkeypatch.setattr(loader, "safe_open", lambda *a, **k: opened.append(1) or safe_open(*a, **k))
    ckpt = Checkpoint(directory) if block_bytes is None else Checkpoint(directory, block_bytes=block_bytes)
    for key, tensor in full.items():
        for shard in shards(tuple(tensor.shape)):
            opened.clear()
            got = ckpt.read(key, shard, None)
            assert got.dtype == tensor.dtype and torch.equal(got, shard.take(tensor)), (key, shard, block_bytes)
            rows = shard.local_shape(tuple(tensor.shape))[0] if shard.dim == 0 else tensor.shape[0]
            if block_bytes == 1:  # one row per opening: the multi-block path ran for every row
                assert len(opened) == rows, (key, shard)
            elif block_bytes is None:  # one opening per contiguous range
                assert len(opened) == (len(shard.reads()) if shard.dim == 0 else 1), (key, shard)
    assert ckpt.bytes_read > 0
    converted = ckpt.read("w", TensorShard.along(1, [(3, 17)]), torch.bfloat16)
    assert torch.equal(converted, full["w"][:, 3:17].to(torch.bfloat16))


class _SpanSpy:
    """safe_open that records, for every slice read, how many bytes of the file it spans (first to last
    element), and how many times the file was opened."""

    def __init__(self):
        self.spans, self.openings = [], 0

    def __call__(self, *args, **kwargs):
        self.openings += 1
        spy = self

        class Handle:
            def __enter__(self):
                self.f = safe_open(*args, **kwargs).__enter__()
                return self

            def __exit__(self, *exc):
                return self.f.__exit__(*exc)

            def get_slice(self, key):
                source = self.f.get_slice(key)
                shape, itemsize = source.get_shape(), 4  # float32
                strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]

                class Sliced:
                    def __getitem__(self, index):
                        full = list(index) + [slice(None)] * (len(shape) - len(index))
                        bounds = [s.indices(n)[:2] for s, n in zip(full, shape, strict=True)]
                        first = sum(a * st for (a, _), st in zip(bounds, strides, strict=True))
                        last = sum((b - 1) * st for (_, b), st in zip(bounds, strides, strict=True))
                        spy.spans.append((last - first + 1) * itemsize)
                        return source[index]

                return Sliced()

        return Handle()


@pytest.mark.parametrize("block_bytes", [1, 300, 5000, None])
def test_3d_shards_along_any_dim_read_in_bounded_blocks(tmp_path, monkeypatch, block_bytes):
    """A fused expert tensor (experts, rows, cols) sliced along dim 0, 1 or 2: bit-exact, and no read spans
    more of the file than the block size or, when one innermost row is larger, one innermost row."""
    torch.manual_seed(0)
    tensor = torch.randn(7, 13, 29)
    save_file({"experts": tensor}, tmp_path / "model.safetensors")
    spy = _SpanSpy()
    monkeypatch.setattr(loader, "safe_open", spy)
    ckpt = Checkpoint(tmp_path) if block_bytes is None else Checkpoint(tmp_path, block_bytes=block_bytes)
    fused = [TensorShard.along(1, [(0, 2), (5, 9)]), TensorShard.along(2, [(0, 3), (9, 12), (20, 29)])]
    for shard in [s for s in shards(tuple(tensor.shape)) if s.dim != 0 or len(s.ranges) == 1] + fused:
        spy.spans.clear()
        spy.openings = 0
        assert torch.equal(ckpt.read("experts", shard, None), shard.take(tensor)), (shard, block_bytes)
        limit = max(block_bytes or loader.BLOCK_BYTES, 29 * 4)
        assert max(spy.spans) <= limit, (shard, block_bytes, max(spy.spans))
        if block_bytes is None:  # the whole tensor fits one block: one opening per contiguous range of dim 0
            assert spy.openings == (len(shard.reads()) if shard.dim == 0 else 1), shard
        if block_bytes == 1:  # one innermost row per opening
            experts, rows = shard.local_shape(tuple(tensor.shape))[:2]
            assert spy.openings == experts * rows, shard
    assert torch.equal(ckpt.read("experts", TensorShard.along(2, [(3, 17)]), torch.bfloat16),
                       tensor[:, :, 3:17].to(torch.bfloat16))


def test_a_checkpoint_saved_from_the_base_model_loads(tmp_path):
    """The hub's GPT-2 files say `h.0.attn.c_attn.weight`, not `transformer.h.0...`, and still carry the old
    `attn.bias` mask buffers: they load, and give the model's own logits."""
    from safetensors.torch import save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_head=4, n_layer=2, n_positions=16, vocab_size=50)).eval()
    model.config.save_pretrained(tmp_path)
    tensors = {k: v.clone() for k, v in model.transformer.state_dict().items()}
    tensors |= {f"h.{i}.attn.bias": torch.ones(1, 1, 16, 16) for i in range(2)}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = autotp.from_pretrained(tmp_path)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("block_bytes", [1, 300, None])
def test_experts_stored_per_expert_read_as_the_fused_slice(tmp_path, monkeypatch, block_bytes):
    """A fused (experts, 2*I, hidden) tensor stored as one (I, hidden) gate and up per expert (the hub's
    layout), and (experts, hidden, I) as one down per expert: any shard of the fused tensor (rows of gate and
    up, columns of down, whole experts) is assembled bit-exact from the parts' slices, each read in blocks
    no larger than block_bytes (or one innermost row)."""
    torch.manual_seed(0)
    gate_up, down = torch.randn(3, 2 * 11, 6), torch.randn(3, 6, 11)
    parts = {f"e.{e}.gate": gate_up[e, :11] for e in range(3)} | {f"e.{e}.up": gate_up[e, 11:] for e in range(3)}
    parts |= {f"e.{e}.down": down[e] for e in range(3)}
    save_file({k: v.contiguous() for k, v in parts.items()}, tmp_path / "model.safetensors")
    spy = _SpanSpy()
    monkeypatch.setattr(loader, "safe_open", spy)
    ckpt = Checkpoint(tmp_path) if block_bytes is None else Checkpoint(tmp_path, block_bytes=block_bytes)
    fused_gu = ExpertKeys((3, 22, 6), tuple((f"e.{e}.gate", f"e.{e}.up") for e in range(3)))
    fused_d = ExpertKeys((3, 6, 11), tuple((f"e.{e}.down",) for e in range(3)))

    def read(keys: ExpertKeys, shard: TensorShard, dtype) -> torch.Tensor:
        return ckpt.assemble(shard.local_shape(keys.shape), keys.reads(shard), dtype)

    cases = [(fused_gu, gate_up, TensorShard.along(1, [(4, 8), (15, 19)])),  # a rank's gate and up rows
             (fused_gu, gate_up, TensorShard.along(1, [(8, 14)])),  # a range across the gate | up boundary
             (fused_d, down, TensorShard.along(2, [(4, 8)])), (fused_d, down, TensorShard.along(2, [(0, 2), (9, 11)])),
             (fused_gu, gate_up, TensorShard.along(0, [(1, 3)])), (fused_d, down, TensorShard())]
    for keys, tensor, shard in cases:
        spy.spans.clear()
        assert torch.equal(read(keys, shard, None), shard.take(tensor)), (shard, block_bytes)
        assert max(spy.spans) <= max(block_bytes or loader.BLOCK_BYTES, 11 * 4), (shard, block_bytes)
    assert torch.equal(read(fused_gu, TensorShard.along(1, [(0, 3), (11, 14)]), torch.bfloat16),
                       gate_up[:, [0, 1, 2, 11, 12, 13]].to(torch.bfloat16))
