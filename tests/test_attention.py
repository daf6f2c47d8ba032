"""The paged attention alone, against dense attention computed per row, and what a step costs in kernel calls.

The oracle is a plain softmax(q k^T * scale + bias) v per row and query, in float64, over the row's context
read from the pool by position through its block table, with the family's bias (ALiBi from the first or from
the last key), sliding window and soft-cap written out here, not taken from the code under test. A step mixes
decode rows, drafted rows and prefill chunks of different lengths, in multi-query, grouped-query and
multi-head layouts. Both backends answer to it: sdpa (attention/sdpa.py) and flex (attention/flex.py, eager flex on
CPU).
"""

from __future__ import annotations

import math

import pytest
import torch
from attention_cases import LAYOUTS, attend, dense, step
from torch.overrides import TorchFunctionMode

from autotp.serve.lockstep.step import Work
from autotp.serve.runner.attention.step import Alibi


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("variant", ["plain", "window", "softcap", "alibi", "alibi-from-end"])
def test_each_token_attends_to_its_own_rows_context_as_dense_attention_does(backend, layout, variant):
    heads, kv = LAYOUTS[layout]
    pool, tables, meta, query = step(heads, kv, backend=backend)
    scale = 1 / math.sqrt(8)
    slopes = torch.tensor([2 ** -(h + 1) for h in range(heads)])
    how = {"plain": {}, "window": dict(window=3), "softcap": dict(softcap=0.7)}.get(variant, {})
    alibi = None
    if variant.startswith("alibi"):
        width = 40  # a bias table wider than any row, as the families' forwards make them
        from_end = variant == "alibi-from-end"
        cols = torch.arange(width, dtype=torch.float32) - (width - 1 if from_end else 0)
        alibi = Alibi(slopes[:, None] * cols, from_end=from_end)
    got = attend(query, pool.keys[0], pool.values[0], meta, scale, alibi=alibi, **how)
    want = dense(pool, tables, query, scale, how.get("window"), how.get("softcap"),
                 slopes if alibi is not None else None, variant == "alibi-from-end")
    assert len(meta.attention.groups) == 2 if backend == "sdpa" else not hasattr(meta.attention, "groups")
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows", [[(9, 1), (2, 1), (17, 1), (0, 1)], [(5, 4), (12, 4)], [(6, 9)]],
                         ids=["decode", "drafts", "one-chunk"])
def test_a_step_of_one_group_without_padding_attends_as_dense_attention_does(layout, rows):
    """Rows of equal length are one group in step order (a decode step, rows verifying equal drafts, a lone prefill
    chunk): attend reads the layer's queries as they stand and returns the group's output as the layer's."""
    heads, kv = LAYOUTS[layout]
    pool, tables, meta, query = step(heads, kv, rows=rows)
    (group,) = meta.attention.groups
    assert group.real is None
    got = attend(query, pool.keys[0], pool.values[0], meta, 0.5, window=3)
    torch.testing.assert_close(got.double(), dense(pool, tables, query, 0.5, window=3, rows=rows), atol=2e-5,
                               rtol=2e-5)


class Calls(TorchFunctionMode):
    """Counts scaled_dot_product_attention calls and records the shapes of their queries and keys."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.scaled_dot_product_attention:
            self.shapes.append((tuple(args[0].shape), tuple(args[1].shape)))
        return func(*args, **(kwargs or {}))


def run_32_rows(attention: str, calls: TorchFunctionMode):
    """Through a model's forward (grouped-query: 8 query heads of 8, 2 KV heads, 2 layers): 24 decode rows, 8 rows
    verifying a draft of 4, two prefill chunks, under `calls`. -> the batch (its pool) and the layer count."""
    from families import build

    from autotp.serve.engine.scheduler import Limits
    from autotp.serve.lockstep.step import Step
    from autotp.serve.runner.probe import probe
    from autotp.serve.server import parts

    model = build("llama")
    runner, _ = parts(model, probe(model), Limits(64, 4096, 4096), block_size=4, rank0=False, speculate=4,
                      attention=attention)
    work, block = [], 0
    rows = [(30 + r, 1) for r in range(24)] + [(20 + r, 5) for r in range(8)] + [(0, 40), (16, 23)]
    for row, (start, n) in enumerate(rows):
        blocks = -(-(start + n) // 4)
        work.append(Work(id=row, tokens=tuple(range(n)), start=start, blocks=tuple(range(block, block + blocks)),
                         sample=True, every=n > 1, draft=4 if n == 5 else 0))
        block += blocks
    with calls:
        runner.apply(Step(work=tuple(work)))
        runner.run(Step(work=tuple(work)))
    return runner, model.config.num_hidden_layers


def test_a_step_of_32_rows_with_drafts_and_two_prefill_chunks_costs_two_sdpa_calls_per_layer():
    """Two SDPA calls per layer, whatever the rows; the short rows' keys have the pool's 2 KV heads, never one per
    query head."""
    calls = Calls()
    _, layers = run_32_rows("sdpa", calls)
    assert len(calls.shapes) == 2 * layers
    short = [(q[:3], k[:2]) for q, k in calls.shapes if q[0] == 32]
    long = [(q[:3], k[:2]) for q, k in calls.shapes if q[0] == 2]
    # 32 short rows: their 4 query heads per KV head x 5 queries packed, against the pool's 2 KV heads unexpanded
    assert short == [((32, 2, 4 * 5), (32, 2))] * layers
    # 2 chunks of up to 40 queries, longer than a head (8): K/V expanded to the 8 query heads, not the mask 4-fold
    assert long == [((2, 8, 40), (2, 8))] * layers


def test_the_same_step_costs_one_flex_call_per_layer_over_the_pool_in_place(monkeypatch):
    """One flex_attention call per layer for the whole step, no SDPA call; its keys and values are the layer's
    pool itself (same storage, the pool's 2 KV heads, every slot but the zero and scratch ones), not a copy."""
    from autotp.serve.runner.attention import flex

    seen = []

    def counted(q, k, v, **kwargs):
        seen.append((tuple(q.shape), tuple(k.shape), k.untyped_storage().data_ptr(),
                     v.untyped_storage().data_ptr(), kwargs["enable_gqa"]))
        return flex_attention(q, k, v, **kwargs)

    flex_attention = flex.flex_attention
    monkeypatch.setattr(flex, "flex_attention", counted)
    calls = Calls()
    batch, layers = run_32_rows("flex", calls)
    pool = batch.pool
    tokens = 24 + 8 * 5 + 40 + 23
    assert calls.shapes == []
    assert [s[:2] for s in seen] == [((1, 8, tokens, 8), (1, 2, pool.slots, 8))] * layers
    assert [s[2:] for s in seen] == [(pool.keys[i].untyped_storage().data_ptr(),
                                      pool.values[i].untyped_storage().data_ptr(), True) for i in range(layers)]


def test_a_model_whose_layers_need_another_mask_is_refused_naming_them():
    """Llama 4's chunked attention (a layer type the paged masks do not make) is refused at start, not served as
    plain causal attention."""
    from families import build

    from autotp.errors import AutotpError
    from autotp.serve.runner.probe import probe

    model = build("llama")
    model.config.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(AutotpError, match=r"layers of type \['chunked_attention'\] need a mask"):
        probe(model)
