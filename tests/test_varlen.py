"""The varlen attention backend (serve/runner/attention/varlen.py) without a GPU: its step description held against
dense attention through an emulation of `varlen_attn`'s contract, and every refusal one line at start-up.

The emulation is written from torch 2.13's `varlen_attn` docstring and FlashAttention-2's rules, not from autotp:
queries (tokens, heads, d) cut by cu_seq_q; paged keys (pages, page_size, kv, d) read through an int32 block table,
the first seqused_k[r] of row r's; causality aligned to the end of each row's keys; window (left, right) as key
positions in [i - left, i + right]. What it cannot show is the kernel itself: benchmarks/gpu_decode.py --attention
varlen is that check, on a GPU.
"""

from __future__ import annotations

import math

import pytest
import torch
from attention_cases import LAYOUTS, ROWS, attend, dense, step

from autotp.errors import AutotpError
from autotp.serve.runner.attention import varlen
from autotp.serve.runner.attention.backends import check_model, choose
from autotp.serve.runner.attention.sdpa import Sdpa
from autotp.serve.runner.attention.step import Alibi
from autotp.serve.runner.attention.varlen import Varlen, VarlenStep
from autotp.serve.runner.probe import probe


def emulated_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                         window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """varlen_attn with a block table, row by row and query by query in float64 (see the module docstring). Its
    keywords are torch 2.13's; it insists on one split (varlen.py says why)."""
    assert num_splits == 1
    for t in (cu_seq_q, cu_seq_k, seqused_k, block_table):
        assert t.dtype == torch.int32, t.dtype  # the kernel's index dtype
    pages, page, kv, dim = key.shape
    heads = query.shape[1]
    assert enable_gqa == (heads != kv) and heads % kv == 0
    assert (cu_seq_k.diff() == seqused_k).all()
    left, right = window_size
    out = torch.empty(query.shape, dtype=torch.float64, device=query.device)
    for r in range(len(seqused_k)):
        a, b, length = int(cu_seq_q[r]), int(cu_seq_q[r + 1]), int(seqused_k[r])
        assert b - a <= max_q and length <= max_k
        where = [(int(block_table[r, p // page]), p % page) for p in range(length)]
        assert all(0 <= pg < pages for pg, _ in where)
        k = torch.stack([key[pg, i] for pg, i in where]).double()  # (length, kv, d)
        v = torch.stack([value[pg, i] for pg, i in where]).double()
        keys = torch.arange(length, device=key.device)
        for i in range(b - a):
            pos = length - (b - a) + i  # the row's queries are the last of its keys
            seen = (keys <= pos + right) if right >= 0 else torch.ones(length, dtype=torch.bool, device=key.device)
            if left >= 0:
                seen &= keys >= pos - left
            for h in range(heads):
                j = h // (heads // kv)
                scores = (k[:, j] @ query[a + i, h].double()) * (scale if scale is not None else dim ** -0.5)
                out[a + i, h] = scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v[:, j]
    return out.to(query.dtype)


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(varlen, "varlen_attn", emulated_varlen_attn)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("window", [None, 3])
def test_each_token_attends_to_its_own_rows_context_as_dense_attention_does(emulated, layout, window):
    """Decode rows, drafted rows and prefill chunks in one step, MQA/GQA/MHA, with and without a sliding window: one
    call per layer, the pool read in place, the answer dense attention's."""
    heads, kv = LAYOUTS[layout]
    pool, tables, meta, query = step(heads, kv, backend="varlen")
    assert isinstance(meta.attention, VarlenStep) and meta.attention.max_q == max(n for _, n in ROWS)
    assert meta.width == max(s + n for s, n in ROWS)
    scale = 1 / math.sqrt(8)
    got = attend(query, pool.keys[0], pool.values[0], meta, scale, window=window)
    torch.testing.assert_close(got.double(), dense(pool, tables, query, scale, window), atol=2e-5, rtol=2e-5)


def test_a_bias_or_a_cap_reaching_the_kernel_is_one_error(emulated):
    pool, _, meta, query = step(6, 2, backend="varlen")
    with pytest.raises(AutotpError, match="no soft-capping or ALiBi"):
        attend(query, pool.keys[0], pool.values[0], meta, softcap=0.7)
    with pytest.raises(AutotpError, match="no soft-capping or ALiBi"):
        attend(query, pool.keys[0], pool.values[0], meta, alibi=Alibi(torch.zeros(6, 40)))


@pytest.mark.parametrize("device,block,error", [
    ("cpu", 256, "--attention varlen runs on CUDA only (FlashAttention-2), not on cpu: use --attention sdpa"),
    ("cuda", 16, "--attention varlen needs --block-size a multiple of 256 (FlashAttention-2's pages), not 16"),
])
def test_a_device_or_block_size_the_kernel_cannot_page_is_refused_naming_both(device, block, error):
    with pytest.raises(AutotpError) as e:
        choose("varlen", torch.device(device), block)
    assert str(e.value) == error
    assert choose("sdpa", torch.device(device), block) is Sdpa


def test_an_ampere_gpu_is_taken_and_an_older_one_refused():
    from cuda_emulation import emulated_cuda

    with emulated_cuda():
        assert choose("varlen", torch.device("cuda"), 512) is Varlen
    with emulated_cuda(capability=(7, 5)), pytest.raises(AutotpError) as e:
        choose("varlen", torch.device("cuda"), 256)
    assert str(e.value) == ("--attention varlen needs a GPU of compute capability 8.0 or newer (FlashAttention-2), "
                            "not 7.5: use --attention sdpa")


def test_rocm_and_a_torch_without_a_paged_varlen_are_refused(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.4")
    with pytest.raises(AutotpError, match="runs on CUDA only .FlashAttention-2., not on ROCm"):
        choose("varlen", torch.device("cuda"), 256)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(varlen, "varlen_attn", lambda query, key, value, cu_seq_q, cu_seq_k, max_q, max_k: None)
    with pytest.raises(AutotpError, match="varlen_attn with a paged KV cache .block_table, num_splits, seqused_k, "
                                          "window_size., which torch"):
        choose("varlen", torch.device("cuda"), 256)


@pytest.mark.parametrize("name,needs", [("llama", set()), ("gemma2", {"soft-capping"}), ("falcon_alibi", {"ALiBi"}),
                                        ("bloom", {"ALiBi"}), ("mpt", {"ALiBi"})])
def test_the_probe_names_what_a_familys_attention_needs_and_varlen_refuses_it(name, needs):
    from families import build

    seen: set[str] = set()
    shapes = probe(build(name), seen)
    assert seen == needs
    half = [(kv, 64, torch.bfloat16) for kv, _, _ in shapes]
    if needs:
        with pytest.raises(AutotpError, match=f"--attention varlen has no {' or '.join(sorted(needs))}"):
            check_model(Varlen, seen, half)
    else:
        check_model(Varlen, seen, half)
    with pytest.raises(AutotpError, match="needs float16 or bfloat16 weights, not float32: add --dtype bfloat16"):
        check_model(Varlen, set(), shapes)  # the families are built in float32


def test_heads_the_kernel_cannot_take_are_refused_naming_them():
    with pytest.raises(AutotpError) as e:
        check_model(Varlen, set(), [(2, 12, torch.bfloat16), (2, 320, torch.bfloat16), (2, 128, torch.bfloat16)])
    assert str(e.value) == ("--attention varlen needs heads of a multiple of 8 up to 256 (FlashAttention-2), not "
                            "12, 320: use --attention sdpa")



def test_the_gpu_benchmark_runs_the_varlen_engine_under_the_emulation(emulated, monkeypatch, tmp_path, capsys):
    """benchmarks/gpu_decode.py --attention sdpa varlen, as a GPU would run it, on emulated CUDA (cuda_emulation.py:
    CUDA's device rules on CPU tensors) with the emulated kernel: its pages of 256 tokens, the refusals it checks
    first, and every index tensor on the device as the kernel's int32 (the emulation asserts the dtypes; the device
    rules catch a host tensor meeting a device one)."""
    import json
    import sys
    from pathlib import Path

    from cuda_emulation import emulated_cuda

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    import gpu_decode

    monkeypatch.setattr(gpu_decode, "STARCODER_15B", gpu_decode.STARCODER_15B | dict(
        n_embd=64, n_head=4, n_layer=2, n_inner=256, vocab_size=1000, n_positions=512))
    monkeypatch.setattr(gpu_decode, "copy_bandwidth_gbs", lambda: 100.0)
    monkeypatch.setattr(gpu_decode, "HERE", tmp_path)
    monkeypatch.setattr(sys, "argv", ["gpu_decode.py", "--batch", "2", "--new-tokens", "3", "--runs", "1",
                                      "--prompt-len", "8", "--systems", "engine", "--attention", "sdpa", "varlen"])
    monkeypatch.setenv("WORLD_SIZE", "1")
    with emulated_cuda():
        gpu_decode.main()
    result = json.loads((tmp_path / "results" / "gpu_decode.json").read_text())
    assert [r["system"] for r in result["rows"]] == ["engine/sdpa", "engine/varlen"]
    assert "ms/token" in capsys.readouterr().out
