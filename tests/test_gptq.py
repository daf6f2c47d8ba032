"""GPTQ checkpoints (autotp.quant.gptq) checked against the library that wrote them, not against autotp's own code.

fixtures/gptq/ holds tiny checkpoints made by GPTQModel 7.6.0 (fixtures/make_gptq.py says how; no GPTQ library is
needed to run these tests), each with the library's own dequantized weights and its single-process logits and
greedy tokens:
    v1_sym         GPTQModel, checkpoint_format "gptq" (v1: qzeros store zero - 1), symmetric
    v1_asym_zero0  GPTQModel, v1, asymmetric, and layer 0's down_proj has groups whose zero point is 0 (the v1
                   writer's whole-word subtract borrows across the packed zeros there)
    v2_asym        transformers' GPTQConfig through optimum (GPTQModel underneath): "gptq_v2", asymmetric
    v1_desc_act    GPTQModel with desc_act (act order): refused
    v1_bigcode     GPTQModel, v1, asymmetric, GPT-BigCode (StarCoder's architecture: the fused multi-query c_attn
                   [Q | K | V], every rank reading the one K/V head's columns; biases)
    v1_gpt2        GPTQModel, v1, asymmetric, GPT-2: transformers' Conv1D layers, whose weight is (in, out), stored
                   by GPTQ as a Linear's (qweight (in / 8, out)), with the fused [Q | K | V] c_attn
A Llama (the GPT-BigCode and GPT-2: the same sizes) of hidden 128, 4 heads, 2 KV heads, intermediate 384, 2
layers, groups of 32: every tp in 1..4 splits its row-parallel inputs into whole groups and gives slices torch's
CPU int4 kernel takes.
"""

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tasks import gptq_rank_outputs, held_bytes

import autotp
from autotp.errors import AutotpError
from autotp.generate import generate
from autotp.parallel.slices import TensorShard
from autotp.prepare import prepare
from autotp.quant import gptq
from autotp.quant.gptq import GptqFormat, GptqKeys, GptqSlice, load_slice
from autotp.report import plan_report

FIXTURES = Path(__file__).parent / "fixtures" / "gptq"
ROOT = Path(__file__).resolve().parents[1]
LOADABLE = ["v1_sym", "v1_asym_zero0", "v2_asym", "v1_bigcode", "v1_gpt2"]
CPU = torch.device("cpu")
NEW_TOKENS = 16


@functools.cache
def oracle(name: str) -> tuple[dict[str, torch.Tensor], dict]:
    """The library's dequantized weights ((out, in) fp16 by layer name, and `logits`), and oracle.json."""
    directory = FIXTURES / name
    return load_file(directory / "oracle.safetensors"), json.loads((directory / "oracle.json").read_text())


def kernel_weight(weight) -> torch.Tensor:
    """The (out, in) weight torch's int4 kernel runs for a QuantizedWeight: the kernel applied to the identity
    (each output is one product 1 * w, the rest exact zeros), so this is what the model computes with."""
    eye = torch.eye(weight.in_features, dtype=weight.scales.dtype)
    return torch._weight_int4pack_mm_for_cpu(eye, weight.qweight, weight.quant.group_size, weight.scales).t()


def gptq_scales(name: str, layer: str) -> torch.Tensor:
    """Each weight's GPTQ scale, (out, in), read from the fixture by the format's definition: scales[g_idx[i], o]."""
    state = load_file(FIXTURES / name / "model.safetensors")
    prefix = layer.removesuffix("weight")
    return state[prefix + "scales"].float()[state[prefix + "g_idx"].long()].t()


def rank_slice(param, rank: int, weight: torch.Tensor) -> torch.Tensor:
    """The rank's part of an (out, in) tensor, (out, in): the shard indexes the module's own weight, which for
    a Conv1D (GPT-2) is (in, out)."""
    if param.quant.conv1d:
        return param.shards[rank].take(weight.t()).t()
    return param.shards[rank].take(weight)


def slice_errors(name: str, tp: int, dtype=torch.float32) -> dict[tuple[int, str], float]:
    """(rank, layer) -> how far the rank's repacked slice, as the kernel runs it rounded to fp16, is from the
    library's dequantized weight's same slice, in units of the GPTQ scale (0.0: bit-exact); every layer of every
    rank, each loaded on its own as that rank loads it. Also checks that each rank read only its slice."""
    p = prepare(tp, "cpu", model_dir=FIXTURES / name, dtype=dtype)
    weights, _ = oracle(name)
    errors = {}
    for param in (q for q in p.layout.params.values() if q.gptq):
        scales = gptq_scales(name, param.name)
        for rank in range(tp):
            before = p.checkpoint.bytes_read
            ours = kernel_weight(load_slice(p.checkpoint, param.gptq[rank], dtype, CPU)).half().float()
            assert p.checkpoint.bytes_read - before == sum(r.nbytes() for r in param.gptq[rank].reads)
            theirs = rank_slice(param, rank, weights[param.name]).float()
            errors[rank, param.name] = ((ours - theirs).abs() / rank_slice(param, rank, scales)).max().item()
    assert len(errors) == (len(weights) - 1) * tp  # every layer the library dequantized (and its logits)
    return errors


@pytest.mark.parametrize("name", LOADABLE)
def test_each_ranks_repacked_slice_is_the_librarys_dequantized_slice(name):
    """Held in float32 the kernel's weight is GPTQ's s * (q - zero) exactly (an fp16 scale times a 4-bit integer
    fits float32), so rounded to fp16 it is the library's fp16 dequantized weight, bit for bit: every layer,
    every rank, tp 1 to 4."""
    for tp in (1, 2, 3, 4):
        errors = slice_errors(name, tp)
        assert all(e == 0.0 for e in errors.values()), {k: e for k, e in errors.items() if e}


@pytest.mark.parametrize("name", LOADABLE)
def test_held_in_float16_the_slice_is_within_rounding_of_the_librarys(name):
    """In float16 the kernel's zero Z = s * (8 - zero) is rounded to fp16 (0 for symmetric checkpoints, whose zero is
    8: bit-exact there). Bound: Z's rounding (|Z| <= 8 s, half an ulp: s / 256) plus the fp16 rounding of our output
    and of the library's (|W| <= 15 s: s / 137 each) is under s / 50; measured: 0.008 s (v1_asym_zero0), 0.010 s
    (v2_asym). A wrong zero or code is off by a whole s."""
    errors = slice_errors(name, 2, torch.float16)
    worst = max(errors.values())
    assert worst == 0.0 if name == "v1_sym" else 0.0 < worst < 1 / 50, worst


UNPACK_ZEROS = gptq.unpack_zeros


def per_nibble_v1(words: torch.Tensor, version: int) -> torch.Tensor:
    """The wrong v1 decode: unpack the stored zeros, then add 1 to each."""
    unpacked = UNPACK_ZEROS(words, 2)
    return unpacked + 1 if version == 1 else unpacked


def test_the_fixture_has_zero_points_of_0_and_a_per_nibble_decode_fails_the_oracle(monkeypatch):
    """v1 stores zero - 1 by subtracting 0x11111111 from each word: a zero of 0 becomes nibble 15 and borrows 1 from
    the next output's nibble. The checkpoint has such groups, and the slice test above fails on them when v1 is
    decoded by adding 1 per nibble (here: every rank's down_proj of layer 0, and nothing else)."""
    zeros = load_file(FIXTURES / "v1_asym_zero0" / "model.safetensors")["model.layers.0.mlp.down_proj.qzeros"]
    assert int((gptq.unpack_zeros(zeros, 2) == 15).sum()) > 500
    monkeypatch.setattr(gptq, "unpack_zeros", per_nibble_v1)
    wrong = {k for k, e in slice_errors("v1_asym_zero0", 2).items() if e}
    assert wrong == {(0, "model.layers.0.mlp.down_proj.weight"), (1, "model.layers.0.mlp.down_proj.weight")}
    assert all(e == 0.0 for e in slice_errors("v1_sym", 2).values()), "no zero of 0 there: the two decodes agree"


@pytest.mark.parametrize("name", LOADABLE)
def test_the_zero_convention_of_the_other_version_fails_the_oracle(monkeypatch, name):
    monkeypatch.setattr(gptq, "unpack_zeros", lambda words, version: UNPACK_ZEROS(words, 3 - version))
    errors = slice_errors(name, 1)
    assert all(e >= 0.99 for e in errors.values()), errors  # every weight of a group is one scale off


def test_a_column_split_inside_the_packed_zeros_reads_their_words_and_drops_the_other_outputs():
    """qzeros pack 8 outputs per word; a rank whose outputs start or end inside a word reads the word and keeps its
    own nibbles. The fixtures' splits are all multiples of 8, so this builds one that is not: outputs 4:20 and
    36:52 of q_proj (as a fused projection's ranges are), against the library's rows."""
    p = prepare(1, "cpu", model_dir=FIXTURES / "v1_asym_zero0", dtype=torch.float32)
    name = "model.layers.1.self_attn.q_proj.weight"
    piece = GptqSlice.of(GptqKeys.of_weight(name), 128, 128, GptqFormat(32, 1, False),
                         TensorShard.along(0, [(4, 20), (36, 52)]), 0)
    assert piece.reads[1].shard == TensorShard.along(1, [(0, 3), (4, 7)])  # the qzeros words of 4:20 and 36:52
    ours = kernel_weight(load_slice(p.checkpoint, piece, torch.float32, CPU))
    theirs = oracle("v1_asym_zero0")[0][name]
    assert torch.equal(ours.half(), torch.cat([theirs[4:20], theirs[36:52]]))


def read_bytes(layout, checkpoint, rank: int) -> int:
    """What a rank reads of the checkpoint: its GPTQ slices, and its part of every other tensor as stored."""
    total = 0
    for param in layout.params.values():
        if param.gptq:
            total += sum(r.nbytes() for r in param.gptq[rank].reads)
        else:
            total += torch.Size(param.local_shape(rank)).numel() * checkpoint.entries[param.key].dtype.itemsize
    return total


@pytest.mark.parametrize("name", LOADABLE)
def test_tp_greedy_tokens_equal_the_librarys_single_process_ones(pools, name):
    """The library runs its model in fp16 (its CPU kernel takes fp16 or bf16 only), autotp here in float32: each of
    the library's activations is rounded to fp16 (2^-11 relative), and the residual stream of this wide random model
    reaches |x| ~ 30-60, where an fp16 step is 0.03. Measured: its logits and ours differ by 0.06-0.07 at most, on
    logits up to 12-13 (0.5 %); the tolerance is 2 %. A wrong slice or zero moves logits by whole units. The prompt
    is one the library continues with a margin of 0.38 or more between its top two logits at every step, well
    above that noise (fixtures/make_gptq.py), so its greedy tokens must be ours at every tp."""
    weights, facts = oracle(name)
    reference = autotp.from_pretrained(str(FIXTURES / name), dtype=torch.float32)  # tp 1, this process
    ids = torch.tensor(facts["prompt"])
    with torch.no_grad():
        logits = reference(ids).logits
    runs = {1: [{"logits": logits, "greedy": generate(reference, ids, max_new_tokens=NEW_TOKENS).tolist(),
                 "bytes_read": reference.autotp.bytes_read, "bytes": reference.autotp.param_bytes,
                 "held_bytes": held_bytes(reference)}]}
    for tp in (2, 3, 4):
        runs[tp] = pools(tp).run(gptq_rank_outputs, str(FIXTURES / name), facts["prompt"], NEW_TOKENS)
    tolerance = 0.02 * weights["logits"].abs().max().item()
    for tp, outs in runs.items():
        p = prepare(tp, "cpu", model_dir=FIXTURES / name, dtype=torch.float32)
        for rank, out in enumerate(outs):
            assert out["greedy"] == facts["greedy"], f"tp {tp} rank {rank}"
            diff = (out["logits"] - weights["logits"]).abs().max().item()
            assert diff < tolerance, f"tp {tp} rank {rank}: {diff}"
            assert out["bytes_read"] == read_bytes(p.layout, p.checkpoint, rank), f"tp {tp} rank {rank}"
            assert out["bytes"] == p.layout.rank_bytes(rank) == out["held_bytes"], f"tp {tp} rank {rank}"


def test_autotp_generate_under_torchrun_gives_the_librarys_tokens():
    """From the user's side: `torchrun ... autotp generate` on the checkpoint directory, nothing GPTQ-specific."""
    from commands import torchrun

    _, facts = oracle("v1_sym")
    ids = ",".join(map(str, facts["prompt"][0]))
    out = torchrun(2, "generate", "--model", str(FIXTURES / "v1_sym"), "--dtype", "float32", "--input-ids", ids,
                   "--max-new-tokens", str(NEW_TOKENS), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["output_ids"] == facts["greedy"]


def test_autotp_plan_shows_each_ranks_gptq_slices_and_bytes(capsys):
    report = plan_report(str(FIXTURES / "v1_sym"), 2)
    assert report["gptq"] == {"group_size": 32, "version": 1, "sym": True} and report["checkpoint_headers"]
    rank1 = {t["name"]: t for t in report["ranks"][1]["tensors"]}
    reads = {r["name"].rpartition(".")[2]: (r["holds"], r["local_shape"], r["bytes"], r["stored"])
             for r in rank1["model.layers.0.self_attn.o_proj.weight"]["gptq"]}
    assert reads == {"qweight": ("rows 8:16", [8, 128], 4096, "int32"), "qzeros": ("rows 2:4", [2, 16], 128, "int32"),
                     "scales": ("rows 2:4", [2, 128], 512, "float16"), "g_idx": ("rows 64:128", [64], 256, "int32")}
    reads = {r["name"].rpartition(".")[2]: (r["holds"], r["local_shape"])
             for r in rank1["model.layers.1.mlp.up_proj.weight"]["gptq"]}
    assert reads == {"qweight": ("cols 192:384", [16, 192]), "qzeros": ("cols 24:48", [4, 24]),
                     "scales": ("cols 192:384", [4, 192]), "g_idx": ("replicated", [128])}
    assert rank1["model.layers.1.mlp.up_proj.weight"]["stored"] == "int4"
    p = prepare(2, "cpu", model_dir=FIXTURES / "v1_sym")
    for rank in (0, 1):
        gptq_bytes = sum(r.nbytes() for q in p.layout.params.values() if q.gptq for r in q.gptq[rank].reads)
        assert report["ranks"][rank]["gptq_read_bytes"] == gptq_bytes
    from autotp.cli import main

    assert main(["plan", "--model", str(FIXTURES / "v1_sym"), "--tp", "2"]) == 0
    text = capsys.readouterr().out
    assert "GPTQ 4-bit checkpoint (groups of 32, v1) repacked to int4" in text
    assert "reads qzeros" in text and "reads 118.00 KiB of GPTQ tensors" in text


def test_a_gptq_starcoder_config_alone_plans_the_int4_bytes_of_round_to_nearest():
    """examples/starcoder-gptq: StarCoder's config with a 4-bit group-128 GPTQ quantization_config, no weights. Each
    rank holds what `--quantize int4` gives StarCoder (the same kernel format; fp16 scales are bf16's size), and reads
    its slices of the GPTQ tensors (int32 words of 8 codes: as many bytes as the int4 codes, plus scales, zeros and
    g_idx)."""
    gptq_plan = plan_report(str(ROOT / "examples" / "starcoder-gptq"), 4)
    rtn = plan_report(str(ROOT / "examples" / "starcoder"), 4, "float16", "int4", 128)
    assert [r["total_bytes"] for r in gptq_plan["ranks"]] == [r["total_bytes"] for r in rtn["ranks"]]
    assert 1.85 * 2**30 < gptq_plan["ranks"][0]["gptq_read_bytes"] < 1.87 * 2**30
    assert 2.13 * 2**30 < gptq_plan["ranks"][0]["total_bytes"] < 2.15 * 2**30


def config_only(tmp_path: Path, name: str = "v1_sym", **changes) -> Path:
    """A directory with the fixture's config.json alone, its quantization_config changed."""
    config = json.loads((FIXTURES / name / "config.json").read_text())
    config["quantization_config"] |= changes
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("changes, message", [
    (dict(bits=8), "has 8-bit GPTQ weights: autotp runs 4-bit GPTQ only"),
    (dict(bits=3), "has 3-bit GPTQ weights"),
    (dict(group_size=-1), "GPTQ group_size -1: torch's int4 kernel takes groups of 32, 64, 128, 256 input features"),
    (dict(group_size=16), "GPTQ group_size 16"),
    (dict(checkpoint_format="marlin"), "GPTQ checkpoint_format 'marlin': autotp reads 'gptq' and 'gptq_v2'"),
    (dict(desc_act=True), r"has desc_act \(act order\): its groups are scattered over each row's inputs"),
    (dict(lm_head=True), "has a GPTQ-quantized lm_head"),
    (dict(pack_dtype="int16"), "packs GPTQ weights in int16"),
    (dict(dynamic={"-:.*down_proj": {}}), r"per-module GPTQ overrides \(dynamic\)"),
    (dict(quant_method="awq"), "says quant_method 'awq': autotp loads GPTQ checkpoints and unquantized ones"),
])
def test_what_autotp_cannot_run_is_refused_before_loading_in_one_line(tmp_path, changes, message):
    with pytest.raises(AutotpError, match=message) as caught:
        plan_report(str(config_only(tmp_path, **changes)), 1)
    assert "\n" not in str(caught.value)


def test_a_tp_that_splits_a_gptq_group_is_refused_with_both_numbers(tmp_path):
    """Groups of 64 of o_proj's 128 inputs: tp 3 gives rank 0 the inputs of 1 head of 32 (heads 1, 1, 2). tp 2 is
    fine."""
    directory = config_only(tmp_path, group_size=64)
    assert plan_report(str(directory), 2)
    with pytest.raises(AutotpError, match=r"GPTQ stores model\.layers\.0\.self_attn\.o_proj\.weight in groups of 64 "
                                          r"input features, but at tp 3 rank 0 holds inputs 0:32 of 128, which splits "
                                          r"a group: choose a tp whose split keeps whole groups$"):
        plan_report(str(directory), 3)


def test_act_order_is_refused_by_the_config_and_by_the_data(tmp_path):
    """The library's desc_act checkpoint is refused by its flag; claiming static groups (whose g_idx is i // G) does
    not get it loaded: the rank reading a scattered g_idx names it."""
    with pytest.raises(AutotpError, match=r"has desc_act \(act order\)"):
        plan_report(str(FIXTURES / "v1_desc_act"), 2)
    directory = tmp_path / "claims_static_groups"
    shutil.copytree(FIXTURES / "v1_desc_act", directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"]["meta"]["static_groups"] = True
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "quantize_config.json").unlink()
    assert plan_report(str(directory), 2)  # nothing in the headers shows act order
    with pytest.raises(AutotpError, match=r"model\.layers\.0\.self_attn\.q_proj\.g_idx puts input 0 in group 2, not "
                                          r"0 // 32 = 0: act order \(desc_act\) scatters GPTQ groups"):
        autotp.from_pretrained(str(directory))


def test_an_autogptq_checkpoint_with_quantize_config_json_alone_loads_as_v1(tmp_path):
    """Older AutoGPTQ checkpoints (TheBloke's) have no quantization_config in config.json and no checkpoint_format:
    quantize_config.json says GPTQ, and the format is v1."""
    directory = tmp_path / "autogptq"
    shutil.copytree(FIXTURES / "v1_asym_zero0", directory)
    config = json.loads((directory / "config.json").read_text())
    fields = config.pop("quantization_config")
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "quantize_config.json").write_text(json.dumps(
        {k: fields[k] for k in ("bits", "group_size", "desc_act", "sym")} | {"true_sequential": True}))
    model = autotp.from_pretrained(str(directory), dtype=torch.float32)
    _, facts = oracle("v1_asym_zero0")
    assert generate(model, torch.tensor(facts["prompt"]), max_new_tokens=NEW_TOKENS).tolist() == facts["greedy"]
    (directory / "quantize_config.json").write_text(json.dumps({"bits": 8, "group_size": 32}))
    with pytest.raises(AutotpError, match=r"quantize_config\.json has 8-bit GPTQ weights"):
        plan_report(str(directory), 1)


def rewritten(tmp_path: Path, change) -> Path:
    """A copy of the v1_sym checkpoint whose tensors `change(state)` edits in place."""
    directory = tmp_path / "edited"
    shutil.copytree(FIXTURES / "v1_sym", directory)
    state = load_file(directory / "model.safetensors")
    change(state)
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def test_gptq_tensors_that_are_missing_or_misshaped_are_refused_before_loading(tmp_path):
    prefix = "model.layers.1.mlp.down_proj."
    directory = rewritten(tmp_path, lambda state: state.pop(prefix + "qzeros"))
    with pytest.raises(AutotpError, match=f"has {prefix}qweight but lacks {prefix}qzeros"):
        plan_report(str(directory), 2)
    shutil.rmtree(directory)
    directory = rewritten(tmp_path, lambda state: state.update({prefix + "scales": state[prefix + "scales"][:6]}))
    with pytest.raises(AutotpError, match=rf"GPTQ tensor {prefix}scales has shape \(6, 128\), but a \(128, 384\) "
                                          r"weight in groups of 32 gives \(12, 128\)"):
        plan_report(str(directory), 2)


def test_a_gptq_layer_the_plan_does_not_split_is_refused(tmp_path):
    """A quantized output head (tied to the embedding here, which the vocab style splits) has no module that runs
    GPTQ weights."""
    source = "model.layers.0.mlp.up_proj."
    directory = rewritten(tmp_path, lambda state: state.update(
        {f"lm_head.{t}": state[source + t].clone() for t in ("qweight", "qzeros", "scales", "g_idx")}))
    with pytest.raises(AutotpError, match=r"model\.embed_tokens\.weight is stored GPTQ-quantized \(lm_head\.qweight\), "
                                          r"but the llama plan does not split it column- or row-wise"):
        plan_report(str(directory), 2)


@pytest.mark.parametrize("call, message", [
    (lambda: plan_report(str(FIXTURES / "v1_sym"), 1, quantize="int8"),
     "is a GPTQ checkpoint, quantized already: drop --quantize int8"),
    (lambda: plan_report(str(FIXTURES / "v1_sym"), 1, device_type="cuda"),
     "a GPTQ checkpoint on CUDA needs --dtype bfloat16 \\(torch's int4 kernel\\), got float16"),
])
def test_gptq_with_quantize_or_a_kernel_that_cannot_run_it_is_refused(call, message):
    with pytest.raises(AutotpError, match=message):
        call()


def test_init_inference_refuses_a_model_loaded_quantized():
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(FIXTURES / "v1_sym"))
    with pytest.raises(AutotpError, match=r"this model was loaded quantized \(config\.quantization_config\): pass the "
                                          "checkpoint's directory to autotp.from_pretrained"):
        autotp.init_inference(model)
