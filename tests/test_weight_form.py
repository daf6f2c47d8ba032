"""The form serve holds the weights in on CPU (serve/startup/weight_form.py).

gemv.c, the float32 and bfloat16 kernel for products of a few rows (parallel/gemv.py): F.linear's results within
float32 rounding on every shape it takes (bfloat16: each output the float32 sum rounded once, as F.linear's),
F.linear itself past its rows or while off, kept inside a compiled graph. The dtype: a float32 checkpoint in
bfloat16 only where the CPU multiplies bfloat16 natively. From the user's side:
`autotp serve` names both at start-up and answers with HF's greedy text, with the kernel and without a C compiler.
The bfloat16 model's numbers against the float32 one's: test_real_model.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from serve_harness import Server

from autotp.generate import generate
from autotp.parallel import gemv
from autotp.serve.startup import weight_form


@pytest.fixture
def kernel():
    """gemv.c on for one test, off again after (a library user's default); skipped where it cannot be built."""
    why = gemv.enable()
    if why:
        pytest.skip(f"gemv.c did not build here: {why}")
    yield
    gemv._on = False


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16])
@pytest.mark.parametrize("k", [576, 37])  # a multiple of the vector width, and not
def test_the_kernel_gives_f_linears_products_within_float32_rounding(kernel, rows, k):
    g = torch.Generator().manual_seed(rows * 100 + k)
    w, b = torch.randn(300, k, generator=g), torch.randn(300, generator=g)
    x = torch.randn(1, rows, k, generator=g)  # (batch, tokens, hidden), as a layer sees it
    for bias in (None, b):
        got, want = gemv.linear(x, w, bias), F.linear(x, w, bias)
        assert got.shape == want.shape == (1, rows, 300)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        assert not torch.equal(got, want) or rows == 1 and k == 37  # the kernel ran: another summation order
    strided = torch.randn(rows, 2 * k, generator=g)[:, ::2]  # a view that is not contiguous
    torch.testing.assert_close(gemv.linear(strided, w), F.linear(strided, w), rtol=1e-5, atol=1e-4)


@pytest.fixture
def bf16_kernel(kernel):
    """gemv.c's bfloat16 loop, each call counted; skipped where the CPU has no AVX512_BF16 (the loop is not built)."""
    if not gemv.takes(torch.bfloat16):
        pytest.skip("gemv.c's bfloat16 loop is built only where the CPU has AVX512_BF16")
    function = gemv._kernels[torch.bfloat16]
    calls = []
    gemv._kernels[torch.bfloat16] = lambda *args: calls.append(args[4]) or function(*args)
    yield calls
    gemv._kernels[torch.bfloat16] = function


@pytest.mark.parametrize("rows", [1, 2, 4, 5, gemv.ROWS_BF16])
@pytest.mark.parametrize("k", [576, 96, 37])  # whole 64-wide steps, one 32-wide step after them, a ragged tail
def test_the_bfloat16_kernel_rounds_the_float32_sum_once(bf16_kernel, rows, k):
    """Each output is the float32 sum of the bfloat16 products, rounded to nearest bfloat16 once: within half a
    bfloat16 step of the exact product (the float32 sum's own error is far smaller), and close to F.linear's."""
    g = torch.Generator().manual_seed(rows * 100 + k)
    w, b = torch.randn(300, k, generator=g).bfloat16(), torch.randn(300, generator=g).bfloat16()
    x = torch.randn(1, rows, k, generator=g).bfloat16()
    for bias in (None, b):
        got = gemv.linear(x, w, bias)
        exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        assert got.dtype == torch.bfloat16 and got.shape == (1, rows, 300)
        half_step = exact.abs() * 2 ** -8 + 1e-4  # rounded to nearest: half a bfloat16 step (8 significant bits)
        assert ((got.double() - exact).abs() <= half_step).all()
        torch.testing.assert_close(got, F.linear(x, w, bias), rtol=2 ** -7, atol=1e-2)
    assert bf16_kernel == [rows, rows]  # the kernel ran, once per product


def test_a_bfloat16_model_decoding_through_the_kernel_scores_as_through_f_linear(bf16_kernel):
    """The demo model in bfloat16, decoded a token at a time (every product one row: the kernel) against one forward
    over the whole sequence (F.linear's GEMM): the same next token at >= 90 % of positions, each token's
    log-probability within 0.25 nats (mean 0.05): the bounds test_real_model.py holds bfloat16 to against float32."""
    from transformers import DynamicCache

    import autotp
    from autotp.cli import default_model

    model = autotp.from_pretrained(default_model(), dtype="bfloat16")
    ids = torch.tensor([[5, 17, 99, 3, 42, 8, 250, 31, 77, 12, 64, 9, 140, 23, 56, 88]])
    with torch.no_grad():
        whole = torch.log_softmax(model(ids).logits[0].float(), -1)
        calls = len(bf16_kernel)
        cache = DynamicCache()
        steps = [model(ids[:, i:i + 1], past_key_values=cache, use_cache=True).logits[0, -1] for i in range(16)]
    stepped = torch.log_softmax(torch.stack(steps).float(), -1)
    assert calls == 0 and len(bf16_kernel) >= 16 * 4  # the GEMM took no row through the kernel, decoding did
    drift = (whole[:-1] - stepped[:-1]).gather(-1, ids[0, 1:, None]).abs()  # each next token's log-probability
    assert (whole.argmax(-1) == stepped.argmax(-1)).float().mean() >= 0.9
    assert drift.max() <= 0.25 and drift.mean() <= 0.05, drift


def test_f_linear_itself_past_rows_for_other_dtypes_and_while_off(kernel):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=g)
    many = torch.randn(gemv.ROWS + 1, 32, generator=g)
    assert torch.equal(gemv.linear(many, w), F.linear(many, w))  # a prefill chunk: MKL's GEMM
    many = torch.randn(gemv.ROWS_BF16 + 1, 32, generator=g).bfloat16()
    assert torch.equal(gemv.linear(many, w.bfloat16()), F.linear(many, w.bfloat16()))  # oneDNN's AMX GEMM
    x = torch.randn(2, 32, generator=g)
    assert torch.equal(gemv.linear(x.half(), w.half()), F.linear(x.half(), w.half()))
    conv1d = w.t().contiguous().t()  # a weight stored transposed (HF's Conv1D)
    assert torch.equal(gemv.linear(x, conv1d), F.linear(x, conv1d))
    gemv._on = False
    assert torch.equal(gemv.linear(x, w), F.linear(x, w))


def test_a_compiled_graph_keeps_the_kernel(kernel):
    """fullgraph: the kernel is one opaque op (autotp::gemv), not a graph break; its rows are known at run time, so
    one graph takes 1 row and 32 (F.linear inside the op)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 48, generator=g)
    step = torch.compile(lambda x: torch.relu(gemv.linear(x, w)), fullgraph=True, dynamic=True)
    for rows in (1, 3, 32):
        x = torch.randn(rows, 48, generator=g)
        torch.testing.assert_close(step(x), torch.relu(F.linear(x, w)), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("compiler", ["found", "missing"])
def test_serve_in_float32_names_the_kernel_and_answers_as_hf(tmp_path, compiler):
    """`autotp serve --dtype float32` on the demo model, one process as a user starts it: the start-up line says
    which kernel reads the weights (gemv.c; without a C compiler, F.linear and why), and a greedy completion's
    text is the unsharded float32 model's."""
    from transformers import AutoModelForCausalLM

    from autotp.cli import default_model
    from autotp.tokenizer import load_tokenizer

    env = {} if compiler == "found" else {"CC": "/nonexistent/cc", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    server = Server(None, tmp_path / "server.log", "--dtype", "float32", "--kv-cache-memory", "2MiB", env=env,
                    torchrun=False)
    try:
        said = server.text()
        prompt = [5, 17, 99, 3, 42, 8]
        got = server.post({"model": server.model_id, "prompt": prompt, "max_tokens": 24, "temperature": 0})[1]
    finally:
        server.kill()
    built = gemv.enable() is None  # where this process can build it, so could serve
    gemv._on = False  # and the other tests keep a library user's F.linear
    if compiler == "found":
        kernel = "gemv.c" if built else "torch F.linear ("
        assert f"weights: float32 (--dtype); float32 products of up to 16 rows: {kernel}" in said
    else:
        assert "weights: float32 (--dtype); float32 products of up to 16 rows: torch F.linear (" in said
        assert "/nonexistent/cc" in said
    model = AutoModelForCausalLM.from_pretrained(default_model(), dtype=torch.float32).eval()
    want = generate(model, torch.tensor([prompt]), max_new_tokens=24)[0, len(prompt):].tolist()
    tok = load_tokenizer(default_model(), missing="{source} {cause}")
    assert got["choices"][0]["text"] == tok.decode(want)


def test_a_float32_checkpoint_is_held_in_bfloat16_only_where_the_cpu_multiplies_it(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(weight_form, "native_bf16", lambda: "AVX512_BF16")
    assert weight_form.choose_dtype(None, torch.float32, cpu) == (
        "bfloat16", "bfloat16 from the float32 checkpoint (this CPU multiplies bfloat16 natively: AVX512_BF16; "
                    "--dtype float32 keeps float32)")
    assert weight_form.choose_dtype(None, None, cpu)[0] == "bfloat16"  # no floating tensor named a dtype
    assert weight_form.choose_dtype(None, torch.bfloat16, cpu) == (None, "bfloat16 as stored")
    assert weight_form.choose_dtype(None, torch.float16, cpu) == (None, "float16 as stored")
    assert weight_form.choose_dtype("float32", torch.float32, cpu) == ("float32", "float32 (--dtype)")
    assert weight_form.choose_dtype(None, torch.float32, cuda) == (None, "float32 as stored")
    monkeypatch.setattr(weight_form, "native_bf16", lambda: None)
    assert weight_form.choose_dtype(None, torch.float32, cpu) == (
        None, "float32 as stored (this CPU has no native bfloat16 products: no AVX512_BF16 or AMX)")
    # quantized on CPU: bfloat16 activations on any CPU (torch's int8/int4 CPU kernels are slow with float32 ones)
    assert weight_form.choose_dtype(None, torch.float32, cpu, "int8") == (
        "bfloat16", "bfloat16 scales and activations for the int8 weights (torch's CPU int8 kernel takes float32 "
                    "activations 4-11x slower)")
    assert weight_form.choose_dtype(None, torch.float32, cuda, "int4") == (None, "float32 as stored")
    assert weight_form.choose_dtype("float32", torch.float32, cpu, "int4") == (
        "float32", "float32 (--dtype); int4 weights with float32 activations take torch's slow CPU path, --dtype "
                   "bfloat16 is 4-11x faster")


def test_serve_on_a_cpu_with_native_bfloat16_holds_a_float32_checkpoint_in_bfloat16(tmp_path):
    """The demo model (float32) served as a user starts it, on a CPU that says it has AMX: the start-up line says
    bfloat16 and why, and which kernel takes bfloat16 products of a few rows (gemv.c where this CPU has AVX512_BF16,
    else F.linear and why), and a completion arrives. Its numbers: test_real_model.py and the kernel's tests above."""
    server = Server(None, tmp_path / "server.log", "--kv-cache-memory", "2MiB", torchrun=False, dtype=None,
                    script=str(Path(__file__).parent / "native_bf16.py"))
    try:
        said = server.text()
        status, got = server.post({"model": server.model_id, "prompt": "def add(a, b):", "max_tokens": 8,
                                   "temperature": 0})
    finally:
        server.kill()
    kernel = "gemv.c" if gemv.enable() is None and gemv.takes(torch.bfloat16) else "torch F.linear ("
    gemv._on = False  # the other tests keep a library user's F.linear
    assert "weights: bfloat16 from the float32 checkpoint (this CPU multiplies bfloat16 natively: AMX; --dtype " \
           f"float32 keeps float32); bfloat16 products of up to {gemv.ROWS_BF16} rows: {kernel}" in said, said
    assert status == 200 and got["usage"]["completion_tokens"] == 8, got
