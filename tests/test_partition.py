"""The partition arithmetic and the slices styles cut, checked without any process group."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers.pytorch_utils import Conv1D

from autotp.errors import AutotpError
from autotp.parallel.partition import assign_heads, even_split
from autotp.parallel.slices import TensorShard
from autotp.parallel.styles import Colwise, FusedQKV, RankContext, Rowwise


def test_even_split_matches_the_documented_example():
    assert even_split(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [b - a for a, b in even_split(48, 5)] == [10, 10, 10, 9, 9]


def test_starcoder_heads_at_tp4_keep_kv_replicated():
    shards = assign_heads(48, 1, 128, 4)
    assert [(s.q_start, s.q_stop) for s in shards] == [(0, 12), (12, 24), (24, 36), (36, 48)]
    assert all((s.kv_start, s.kv_stop) == (0, 1) for s in shards)


def test_starcoder_c_attn_rows_are_whole_heads_plus_k_and_v():
    """The rows DeepSpeed AutoTP got wrong: it gave every rank 1600 rows of [Q 6144 | K 128 | V 128]."""
    shards = assign_heads(48, 1, 128, 4)
    rows = [FusedQKV(layout="blocks").row_ranges(h) for h in shards]
    assert rows[0] == [(0, 1536), (6144, 6272), (6272, 6400)]
    assert rows[3] == [(4608, 6144), (6144, 6272), (6272, 6400)]


def test_tp_larger_than_heads_is_an_error_naming_both_numbers():
    with pytest.raises(AutotpError, match="tp_size 64 exceeds the 48 query heads"):
        assign_heads(48, 1, 128, 64)


def test_gqa_below_tp_replicates_each_kv_head_to_its_query_heads():
    shards = assign_heads(8, 2, 4, 4)
    assert [(s.q_start, s.q_stop, s.kv_start, s.kv_stop) for s in shards] == [
        (0, 2, 0, 1), (2, 4, 0, 1), (4, 6, 1, 2), (6, 8, 1, 2)]


def test_tensor_shard_take_is_pure_indexing():
    t = torch.arange(60.0).reshape(10, 6)
    shard = TensorShard.along(0, [(0, 2), (2, 4), (8, 10)])
    assert shard.reads() == [(0, 4), (8, 10)]
    assert torch.equal(shard.take(t), torch.cat([t[0:4], t[8:10]]))
    cols = TensorShard.along(1, [(1, 3)])
    assert torch.equal(cols.take(t), t[:, 1:3]) and cols.local_shape((10, 6)) == (10, 2)


@settings(max_examples=300, deadline=None)
@given(kv=st.integers(1, 8), group=st.integers(1, 6), head_dim=st.integers(1, 4), tp=st.integers(1, 12),
       layout=st.sampled_from(["blocks", "grouped"]))
def test_every_row_of_a_fused_qkv_is_owned_or_declared_replicated(kv, group, head_dim, tp, layout):
    """Every query row on exactly one rank; K/V rows on every rank whose query heads use them; whole heads."""
    heads = kv * group
    if tp > heads:
        with pytest.raises(AutotpError):
            assign_heads(heads, kv, head_dim, tp)
        return
    shards = assign_heads(heads, kv, head_dim, tp)
    sizes = [s.q_heads for s in shards]
    assert sum(sizes) == heads and min(sizes) >= 1
    total = (heads + 2 * kv) * head_dim
    # label each row of the fused weight by (kind, head) from the layout, then check ownership
    labels = []
    if layout == "blocks":
        labels = [("q", r // head_dim) for r in range(heads * head_dim)]
        labels += [("k", r // head_dim) for r in range(kv * head_dim)]
        labels += [("v", r // head_dim) for r in range(kv * head_dim)]
    else:
        for g in range(kv):
            for i in range(group + 2):
                kind, head = ("q", g * group + i) if i < group else ("k" if i == group else "v", g)
                labels += [(kind, head)] * head_dim
    assert len(labels) == total
    q_owner = {}
    for rank, s in enumerate(shards):
        rows = [r for a, b in FusedQKV(layout=layout).row_ranges(s) for r in range(a, b)]
        assert len(rows) == len(set(rows)) == (s.q_heads + 2 * s.kv_heads) * head_dim
        mine = [labels[r] for r in rows]
        q_heads = {h for kind, h in mine if kind == "q"}
        kv_heads = {h for kind, h in mine if kind in "kv"}
        assert q_heads == set(range(s.q_start, s.q_stop))
        assert kv_heads == {h // group for h in q_heads}, "a query head without its KV head, or a stray KV head"
        assert s.q_heads == s.q_per_kv * s.kv_heads, "repeat_kv needs equal query heads per KV head"
        for h in q_heads:
            assert h not in q_owner
            q_owner[h] = rank
    assert sorted(q_owner) == list(range(heads))


@settings(max_examples=200, deadline=None)
@given(size=st.integers(1, 30), blocks=st.integers(1, 3), inp=st.integers(1, 9), tp=st.integers(1, 9),
       conv=st.booleans())
def test_colwise_blocks_and_rowwise_concatenate_back_for_linear_and_conv1d(size, blocks, inp, tp, conv):
    """Fused [gate | up] blocks: each rank holds the same piece of every block, and the pieces of each block
    concatenate back to it; rowwise pieces concatenate back along the inputs. nn.Linear.weight is (out, in),
    HF Conv1D's (in, out): the same style slices the other dim, and the same elements."""
    if tp > min(size, inp):
        return  # layout.resolve refuses empty slices; tested with the families
    out = size * blocks
    module = Conv1D(out, inp) if conv else nn.Linear(inp, out, device="meta")
    out_dim = 1 if conv else 0
    w = torch.arange(out * inp).reshape((inp, out) if conv else (out, inp))
    ctxs = [RankContext(r, tp, None) for r in range(tp)]
    cols = [Colwise(blocks=blocks).shards(module, c) for c in ctxs]
    taken = [s["weight"].take(w) for s in cols]
    assert all(s["bias"].dim == 0 and s["bias"].ranges == s["weight"].ranges for s in cols)
    for k in range(blocks):
        pieces = [t.narrow(out_dim, k * (t.shape[out_dim] // blocks), t.shape[out_dim] // blocks) for t in taken]
        assert torch.equal(torch.cat(pieces, out_dim), w.narrow(out_dim, k * size, size))
    rows = [Rowwise().shards(module, c) for c in ctxs]
    assert torch.equal(torch.cat([s["weight"].take(w) for s in rows], 1 - out_dim), w)
    assert all(s["bias"].replicated for s in rows)
    if conv:  # a Conv1D's shard is the transpose of the equal nn.Linear's
        linear = nn.Linear(inp, out, device="meta")
        for c, s in zip(ctxs, cols, strict=True):
            assert Colwise(blocks=blocks).shards(linear, c)["weight"].ranges == s["weight"].ranges
            assert torch.equal(s["weight"].take(w), Colwise(blocks=blocks).shards(linear, c)["weight"].take(w.T).T)
