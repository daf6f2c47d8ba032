"""gemv.c, the CPU float32 kernel for products of a few rows (parallel/gemv.py): F.linear's results within
float32 rounding on every shape it takes, F.linear itself past ROWS rows or while off, kept inside a compiled
graph, and from the user's side: `autotp serve` in float32 names the kernel that reads the weights and answers
with HF's greedy text, with the kernel and without a C compiler.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from serve_harness import Server

from autotp.generate import generate
from autotp.parallel import gemv


@pytest.fixture
def kernel():
    """gemv.c on for one test, off again after (a library user's default)."""
    assert gemv.enable() is None
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


def test_f_linear_itself_past_rows_for_other_dtypes_and_while_off(kernel):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=g)
    many = torch.randn(gemv.ROWS + 1, 32, generator=g)
    assert torch.equal(gemv.linear(many, w), F.linear(many, w))  # a prefill chunk: MKL's GEMM
    x = torch.randn(2, 32, generator=g)
    assert torch.equal(gemv.linear(x.bfloat16(), w.bfloat16()), F.linear(x.bfloat16(), w.bfloat16()))
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
    if compiler == "found":
        assert "float32 products of up to 16 rows: gemv.c" in said
    else:
        assert "float32 products of up to 16 rows: torch F.linear (" in said and "/nonexistent/cc" in said
    model = AutoModelForCausalLM.from_pretrained(default_model(), dtype=torch.float32).eval()
    want = generate(model, torch.tensor([prompt]), max_new_tokens=24)[0, len(prompt):].tolist()
    tok = load_tokenizer(default_model(), missing="{source} {cause}")
    assert got["choices"][0]["text"] == tok.decode(want)
