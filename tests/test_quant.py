"""Weight-only int8 / int4 with tensor parallelism: every rank's quantized slice is the same slice of the
unsharded quantized weight, bit for bit, and greedy tokens at tp 2, 3, 4 equal the unsharded quantized
model's (the same code at tp 1, in this process).

The models have dims that every tp in 2..4 splits into whole int4 groups of 32 and shapes torch's CPU
kernels take: gpt_bigcode multi-query and multi-head, llama (grouped-query, KV heads replicated at tp > 2)
and gpt2 (Conv1D, weights stored (in, out)).
"""

import re

import pytest
import torch
from checkpoints import widen
from quant_models import GROUP, MODELS, config
from tasks import quant_rank_outputs
from transformers import AutoModelForCausalLM

import autotp
from autotp.errors import AutotpError
from autotp.loading.skeleton import skeleton
from autotp.parallel.layout import resolve
from autotp.plans import plan_for
from autotp.quant.weights import (
    INT8_DEQUANT_ROWS,
    Quant,
    check_kernel,
    int8_scales,
    pack_int4,
    quantize_int4,
    quantize_int8,
)


@pytest.fixture(scope="module")
def quant_checkpoint(tmp_path_factory):
    """quant_checkpoint(name) -> (directory, the unsharded model's full weights), saved once."""
    made = {}

    def get(name):
        if name not in made:
            torch.manual_seed(0)
            model = widen(AutoModelForCausalLM.from_config(config(name), dtype=torch.float32).eval())
            directory = tmp_path_factory.mktemp(name)
            model.save_pretrained(directory)
            made[name] = (str(directory), {k: v.clone() for k, v in model.state_dict().items()})
        return made[name]

    return get


def unsharded_quantized(weight: torch.Tensor, kind: str, conv1d: bool):
    """The unsharded weight quantized: (values (out, in), scales) by the same functions the loader uses."""
    w = weight.t() if conv1d else weight
    if kind == "int8":
        scales = int8_scales(w.abs().amax(1), w.dtype)
        return quantize_int8(w, scales), scales
    return quantize_int4(w, GROUP, w.dtype)


def expected_slice(layout, name: str, rank: int, full: torch.Tensor, kind: str):
    """(qweight, scales) rank `rank` must hold: the unsharded quantized weight, sliced as the layout slices it."""
    param = layout.param(name)
    target, shard = param.quant, param.shards[rank]
    values, scales = unsharded_quantized(full, kind, target.conv1d)
    out_dim = 1 if target.conv1d else 0
    # the shard indexes the stored weight; the quantized weight is (out, in)
    q = shard.take(values.t() if target.conv1d else values)
    q = q.t() if target.conv1d else q
    if shard.dim == out_dim:  # column-parallel: the rank's output channels carry their scales
        rows = torch.cat([torch.arange(a, b) for a, b in shard.reads()])
        scales = scales[rows] if kind == "int8" else scales[:, rows]
    elif kind == "int4":  # row-parallel: the groups of the rank's input features
        (a, b), = shard.ranges
        scales = scales[a // GROUP:b // GROUP]
    if kind == "int4":
        q = pack_int4(q, torch.device("cpu"))
    return q, scales


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("name", list(MODELS))
def test_quantized_tp_is_exact(pools, quant_checkpoint, name, kind):
    model_dir, full = quant_checkpoint(name)
    reference = autotp.from_pretrained(model_dir, quantize=kind, group_size=GROUP)  # tp 1, this process
    ids = torch.tensor([[3, 17, 42, 8, 99, 51, 23]])
    with torch.no_grad():
        ref_logits = reference(ids).logits
    from autotp.generate import generate

    ref_greedy = generate(reference, ids, max_new_tokens=16).tolist()
    assert len(set(ref_greedy[0][7:])) > 3, "degenerate reference output proves nothing"
    for tp in (2, 3, 4):
        layout = resolve(skeleton(config(name), torch.float32, buffers=False), plan_for(config(name)), tp,
                         quant=Quant.parse(kind, GROUP))
        ranks = pools(tp).run(quant_rank_outputs, model_dir, kind, GROUP)
        quantized = [p.name for p in layout.params.values() if p.quant is not None]
        assert quantized, "nothing was quantized"
        for r, out in enumerate(ranks):
            for name_ in quantized:
                q, scales = expected_slice(layout, name_, r, full[name_], kind)
                assert torch.equal(out["state"][f"{name_}.qweight"], q), f"tp {tp} rank {r}: {name_}"
                assert torch.equal(out["state"][f"{name_}.scales"], scales), f"tp {tp} rank {r}: {name_} scales"
            assert out["greedy"] == ref_greedy, f"tp {tp} rank {r}"
            assert out["bytes"] == layout.rank_bytes(r) == out["held_bytes"], f"tp {tp} rank {r}"
            diff = (out["logits"] - ref_logits).abs().max().item()
            assert diff < 5e-4 * max(1.0, ref_logits.abs().max().item()), f"tp {tp} rank {r}: {diff}"


def test_init_inference_quantizes_like_from_pretrained(quant_checkpoint):
    model_dir, _ = quant_checkpoint("gpt2")
    for kind in ("int8", "int4"):
        loaded = autotp.from_pretrained(model_dir, quantize=kind, group_size=GROUP)
        engine = autotp.init_inference(AutoModelForCausalLM.from_pretrained(model_dir), quantize=kind,
                                       group_size=GROUP)
        a = {k: v for k, v in loaded.state_dict().items() if k.endswith((".qweight", ".scales"))}
        b = {k: v for k, v in engine.module.state_dict().items() if k.endswith((".qweight", ".scales"))}
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), kind


def test_quantized_bytes_and_many_rows(quant_checkpoint):
    """int8 weights take about a quarter of fp32's bytes, int4 an eighth; an int4 input of many rows gives what the
    kernel gives row by row."""
    model_dir, _ = quant_checkpoint("bigcode_mqa")
    fp32 = autotp.from_pretrained(model_dir).autotp.param_bytes
    for kind, most in (("int8", 0.45), ("int4", 0.40)):
        model = autotp.from_pretrained(model_dir, quantize=kind, group_size=GROUP)
        assert model.autotp.param_bytes < most * fp32, (kind, model.autotp.param_bytes, fp32)
    layer = model.transformer.h[0].mlp.c_fc  # the int4 model's
    x = torch.randn(16, 128)
    with torch.no_grad():
        together, alone = layer(x), torch.cat([layer(x[i:i + 1]) for i in range(16)])
    assert torch.allclose(together, alone, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [INT8_DEQUANT_ROWS - 1, INT8_DEQUANT_ROWS])
def test_int8_on_cpu_dequantizes_from_the_crossover_on(quant_checkpoint, monkeypatch, rows):
    """Below INT8_DEQUANT_ROWS input rows the CPU int8 kernel runs; from it on, the weight is dequantized for
    F.linear instead (the kernel is slower there, quant.py). Each side takes its path, and both give what the
    kernel gives one row at a time. The rows are (batch, seq) flattened, as a prefill sends them."""
    model_dir, _ = quant_checkpoint("bigcode_mqa")
    layer = autotp.from_pretrained(model_dir, quantize="int8").transformer.h[0].mlp.c_fc
    kernel, calls = torch._weight_int8pack_mm, []

    def counted(x, *args):
        calls.append(x.shape[0])
        return kernel(x, *args)

    monkeypatch.setattr(torch, "_weight_int8pack_mm", counted)
    x = torch.randn(1, rows, 128)
    with torch.no_grad():
        together = layer(x)
        together_calls, calls[:] = calls[:], []
        alone = torch.cat([layer(x[:, i:i + 1]) for i in range(rows)], dim=1)
    assert together_calls == ([rows] if rows < INT8_DEQUANT_ROWS else []), together_calls
    assert calls == [1] * rows  # one row is the kernel's
    torch.testing.assert_close(together, alone, atol=1e-4, rtol=1e-4)


def test_int4_refuses_a_tp_that_splits_a_group():
    cfg = config("bigcode_mqa")
    with pytest.raises(AutotpError, match=r"int4 quantizes transformer\.h\.0\.attn\.c_proj\.weight in groups of 128 "
                                          r"input features, but at tp 2 rank 0 holds inputs 0:64 of 128, which splits"):
        resolve(skeleton(cfg, torch.float32, buffers=False), plan_for(cfg), 2, quant=Quant.parse("int4", 128))


def test_int4_names_the_group_sizes_that_fit():
    """128 input features do not form groups of 256: the error names the group sizes that divide them."""
    cfg = config("bigcode_mqa")
    with pytest.raises(AutotpError, match=r"in groups of 256 input features, but it has 128: use --group-size 32 or "
                                          r"64 or 128, or --quantize int8"):
        resolve(skeleton(cfg, torch.float32, buffers=False), plan_for(cfg), 1, quant=Quant.parse("int4", 256))


@pytest.mark.parametrize("call, message", [
    (lambda: Quant.parse("int3"), "unknown quantization 'int3': choose one of int8, int4"),
    (lambda: Quant.parse("int4", 96), "int4 group size 96 is not one torch's int4 kernel takes: 32, 64, 128, 256"),
    (lambda: check_kernel("int4", "cuda", torch.float16),
     "--quantize int4 on CUDA needs --dtype bfloat16"),
    (lambda: check_kernel("int8", "mps", torch.float16), "kernels for cpu and cuda, not mps"),
])
def test_quantization_errors_name_the_choice(call, message):
    with pytest.raises(AutotpError, match=message):
        call()


@pytest.mark.parametrize("entry", ["from_pretrained", "init_inference"])
@pytest.mark.parametrize("kwargs, message", [
    (dict(quantize="int4", group_size=32.0), "group_size must be an int, got float 32.0"),
    (dict(quantize="int4", group_size=True), "group_size must be an int, got bool True"),
    (dict(quantize="int4", group_size="32"), "group_size must be an int, got str '32'"),
    (dict(quantize=["int8"]), r"unknown quantization \['int8'\]: choose one of int8, int4"),
    (dict(quantize=8), "unknown quantization 8: choose one of int8, int4"),
])
def test_quantize_arguments_of_the_wrong_type_are_refused_at_the_entry_points(entry, kwargs, message):
    """A float group size passes `32.0 in (32, ...)`: refused by type, before anything is loaded (on the demo
    model, whose layers int4 quantizes in groups of 32, it used to reach the loader and raise a TypeError)."""
    from transformers import AutoModelForCausalLM

    import autotp
    from autotp.cli import default_model

    with pytest.raises(AutotpError, match=message):
        if entry == "from_pretrained":
            autotp.from_pretrained(default_model(), **kwargs)
        else:
            autotp.init_inference(AutoModelForCausalLM.from_pretrained(default_model()), **kwargs)


def test_int4_on_a_torch_without_its_packing_ops_is_refused_before_loading(monkeypatch):
    """torch 2.4 (what pyproject allows) has neither the _for_cpu int4 ops nor CUDA's uint8 packing: one line,
    before any weight is read, from the user's own call."""
    import autotp
    from autotp.cli import default_model

    monkeypatch.setattr(torch, "__version__", "2.4.1+cu121")
    said = "--quantize int4 needs torch >= 2.5 (its int4 packing ops), this is torch 2.4.1+cu121: upgrade torch"
    with pytest.raises(AutotpError, match=re.escape(said)):
        check_kernel("int4", "cpu", torch.bfloat16)
    with pytest.raises(AutotpError, match=re.escape(said)):
        autotp.from_pretrained(default_model(), quantize="int4", group_size=32)
    check_kernel("int8", "cpu", torch.bfloat16)  # int8 needs nothing new
    monkeypatch.setattr(torch, "__version__", "2.5.0a0+git1234")  # a nightly of 2.5 has them
    check_kernel("int4", "cpu", torch.bfloat16)


def test_int4_on_a_gpu_older_than_ampere_is_refused_before_loading(monkeypatch):
    """A T4 (compute capability 7.5), the GPU of many free notebooks: torch's int4 kernel needs 8.0."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    with pytest.raises(AutotpError, match=re.escape("--quantize int4 on CUDA needs a GPU of compute capability 8.0 "
                                                    "or newer (torch's int4 kernel); Tesla T4 is 7.5: use --quantize "
                                                    "int8")):
        check_kernel("int4", "cuda", torch.bfloat16)
    with pytest.raises(AutotpError, match="a GPTQ checkpoint on CUDA needs a GPU of compute capability 8.0"):
        check_kernel("int4", "cuda", torch.bfloat16, "a GPTQ checkpoint")
    check_kernel("int8", "cuda", torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100
    check_kernel("int4", "cuda", torch.bfloat16)


def test_packing_in_chunks_of_64_rows_is_packing_whole():
    q = torch.randint(0, 16, (192, 128), dtype=torch.uint8)
    whole = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    assert torch.equal(pack_int4(q, torch.device("cpu")), whole)


def test_autotp_plan_checks_the_kernels_of_the_device_it_is_told():
    """`autotp plan --device cuda` refuses what loading on CUDA would (it used to check CPU's rules only);
    the demo model at tp 1: 288 input features are whole groups of 32 (CPU packs them), not a multiple
    of CUDA's 128 (c_attn: 12 query heads + 2 x 1 KV head of 24 = 336 rows)."""
    from autotp.cli import default_model
    from autotp.report import plan_report

    assert plan_report(default_model(), 1, quantize="int4", group_size=32, device_type="cpu")["ranks"]
    with pytest.raises(AutotpError, match="on CUDA needs --dtype bfloat16"):
        plan_report(default_model(), 1, quantize="int4", group_size=32, device_type="cuda")
    with pytest.raises(AutotpError, match=r"\(336, 288\) is not a weight CUDA's int4 kernel packs"):
        plan_report(default_model(), 1, "bfloat16", "int4", 32, device_type="cuda")
