"""Every style's slices against numbers written out by hand from the architecture.

test_families and test_quant take their expected slices from `layout.resolve`, the code under test. Here
each expected range is a literal, worked out from the model's layout with the arithmetic in a comment
beside it (the way the README reads StarCoder's c_attn: rows 0:1536 + 6144:6272 + 6272:6400), and
compared with what autotp gives: `layout.resolve` on a meta model (heads, styles and Conv1D geometry
together), a style's `shards()` where a case needs no model, and `autotp plan --json` for StarCoder and
Mixtral. Nothing below computes an expected value with autotp code.

Ranges are [a, b) rows (dim 0 of nn.Linear's (out, in) weight) or columns (dim 1), listed in the order the
rank's local tensor holds them; `indices` expands both sides so that "0:10 + 10:30" equals "0:30".
"""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from autotp.errors import AutotpError
from autotp.loading.skeleton import skeleton
from autotp.parallel.layout import resolve
from autotp.parallel.partition import HeadShard, assign_heads
from autotp.parallel.styles import RankContext
from autotp.plans import plan_for
from autotp.quant.load import QuantTarget, quantize_slice
from autotp.quant.weights import Quant

ROWS, COLS = 0, 1
REPLICATED = None
NO_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def layout(model_type: str, tp: int, quant: Quant | None = None, **overrides):
    """The resolved layout of a one-layer meta model of `model_type` at `tp` ranks (vocab 101 unless set)."""
    cfg = AutoConfig.for_model(model_type, **({"vocab_size": 101} | NO_TOKENS | overrides))
    return resolve(skeleton(cfg, torch.float32, buffers=False), plan_for(cfg), tp, quant=quant)


def indices(ranges) -> list[int]:
    return [i for a, b in ranges for i in range(a, b)]


def held(lay, name: str) -> list[tuple[int | None, list[int]]]:
    """[rank] -> (dim, the indices along it, in order) of parameter `name`; (None, []) when replicated."""
    return [(s.dim, indices(s.ranges)) for s in lay.param(name).shards]


def expect(lay, name: str, dim: int | None, per_rank: list[list[tuple[int, int]]]) -> None:
    got = held(lay, name)
    want = [(dim, indices(ranges)) for ranges in per_rank]
    assert got == want, f"{name}: {[lay.param(name).shards[r].describe() for r in range(lay.tp)]}"


def expect_replicated(lay, name: str) -> None:
    assert all(s.dim is None for s in lay.param(name).shards), name


# --- Colwise "even", Rowwise "even", Vocab, VocabHead: GPT-BigCode's MLP and embeddings ---------------------------

def test_even_mlp_and_vocab_splits_of_gpt_bigcode_at_tp_4():
    """n_embd 80, 10 heads of 8, multi-query, n_inner 70, vocab 101 (tests/checkpoints.py's mqa10) at tp 4."""
    lay = layout("gpt_bigcode", 4, n_embd=80, n_head=10, multi_query=True, n_inner=70, n_layer=1, n_positions=64)
    # 70 = 4*17 + 2: the first two ranks get 18 -> 0:18, 18:36, 36:53, 53:70
    mlp = [[(0, 18)], [(18, 36)], [(36, 53)], [(53, 70)]]
    expect(lay, "transformer.h.0.mlp.c_fc.weight", ROWS, mlp)  # (70, 80): rows are outputs
    expect(lay, "transformer.h.0.mlp.c_fc.bias", ROWS, mlp)
    expect(lay, "transformer.h.0.mlp.c_proj.weight", COLS, mlp)  # (80, 70): columns are inputs
    expect_replicated(lay, "transformer.h.0.mlp.c_proj.bias")  # added once, after the all-reduce
    # 101 = 4*25 + 1: rank 0 gets 26 -> 0:26, 26:51, 51:76, 76:101; lm_head is tied to wte
    expect(lay, "transformer.wte.weight", ROWS, [[(0, 26)], [(26, 51)], [(51, 76)], [(76, 101)]])
    assert lay.param("lm_head.weight") is lay.param("transformer.wte.weight")
    expect_replicated(lay, "transformer.wpe.weight")
    expect_replicated(lay, "transformer.h.0.ln_1.weight")


def test_an_untied_vocab_head_with_a_bias_splits_both_like_the_embedding():
    """GPT-J: lm_head (101, 48) with a bias (101,), untied; vocab 101 at tp 4 as above."""
    lay = layout("gptj", 4, n_embd=48, n_head=6, n_inner=90, rotary_dim=4, n_layer=1, n_positions=64,
                 tie_word_embeddings=False)
    vocab = [[(0, 26)], [(26, 51)], [(51, 76)], [(76, 101)]]  # 101 = 4*25 + 1
    for name in ("transformer.wte.weight", "lm_head.weight", "lm_head.bias"):
        expect(lay, name, ROWS, vocab)


# --- FusedQKV "blocks": StarCoder, multi-query --------------------------------------------------------------------

STARCODER = dict(n_embd=6144, n_head=48, multi_query=True, n_inner=24576, n_positions=8192, vocab_size=49152,
                 n_layer=1)


def test_starcoder_c_attn_at_tp_4_and_at_an_uneven_tp_5():
    """c_attn (6144 + 2*128, 6144) = [Q 48 heads x 128 = rows 0:6144 | K 6144:6272 | V 6272:6400]."""
    kv = [(6144, 6272), (6272, 6400)]  # the one K and V head, on every rank
    lay = layout("gpt_bigcode", 4, **STARCODER)
    # 48 heads / 4 = 12 per rank, 12 * 128 = 1536 rows each
    q4 = [(0, 1536), (1536, 3072), (3072, 4608), (4608, 6144)]
    expect(lay, "transformer.h.0.attn.c_attn.weight", ROWS, [[q, *kv] for q in q4])
    expect(lay, "transformer.h.0.attn.c_attn.bias", ROWS, [[q, *kv] for q in q4])
    expect(lay, "transformer.h.0.attn.c_proj.weight", COLS, [[q] for q in q4])  # (6144, 6144): its heads' inputs
    lay = layout("gpt_bigcode", 5, **STARCODER)
    # 48 = 5*9 + 3: heads 10, 10, 10, 9, 9 -> heads 0:10, 10:20, 20:30, 30:39, 39:48; x128 rows
    q5 = [(0, 1280), (1280, 2560), (2560, 3840), (3840, 4992), (4992, 6144)]
    assert [(h.q_start, h.q_stop, h.kv_start, h.kv_stop) for h in lay.heads] == [
        (0, 10, 0, 1), (10, 20, 0, 1), (20, 30, 0, 1), (30, 39, 0, 1), (39, 48, 0, 1)]
    expect(lay, "transformer.h.0.attn.c_attn.weight", ROWS, [[q, *kv] for q in q5])
    expect(lay, "transformer.h.0.attn.c_proj.weight", COLS, [[q] for q in q5])
    # 24576 = 5*4915 + 1: rank 0 gets 4916 -> 0:4916, then +4915 each
    mlp = [[(0, 4916)], [(4916, 9831)], [(9831, 14746)], [(14746, 19661)], [(19661, 24576)]]
    expect(lay, "transformer.h.0.mlp.c_fc.weight", ROWS, mlp)
    expect(lay, "transformer.h.0.mlp.c_proj.weight", COLS, mlp)
    # 49152 = 5*9830 + 2: ranks 0 and 1 get 9831
    expect(lay, "transformer.wte.weight", ROWS,
           [[(0, 9831)], [(9831, 19662)], [(19662, 29492)], [(29492, 39322)], [(39322, 49152)]])


def test_autotp_plan_json_prints_starcoders_slices_at_tp_5(capsys):
    """What a user reads: `autotp plan --model examples/starcoder --tp 5 --json` (the 40-layer config)."""
    from autotp.cli import main

    assert main(["plan", "--model", str(Path(__file__).parents[1] / "examples" / "starcoder"), "--tp", "5",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    holds = [{t["name"]: t["holds"] for t in r["tensors"]} for r in report["ranks"]]
    assert [r["q_heads"] for r in report["ranks"]] == [[0, 10], [10, 20], [20, 30], [30, 39], [39, 48]]
    assert [h["transformer.h.39.attn.c_attn.weight"] for h in holds] == [
        "rows 0:1280 + 6144:6272 + 6272:6400", "rows 1280:2560 + 6144:6272 + 6272:6400",
        "rows 2560:3840 + 6144:6272 + 6272:6400", "rows 3840:4992 + 6144:6272 + 6272:6400",
        "rows 4992:6144 + 6144:6272 + 6272:6400"]
    assert [h["transformer.h.0.attn.c_proj.weight"] for h in holds] == [
        "cols 0:1280", "cols 1280:2560", "cols 2560:3840", "cols 3840:4992", "cols 4992:6144"]
    assert [h["transformer.h.0.mlp.c_fc.weight"] for h in holds] == [
        "rows 0:4916", "rows 4916:9831", "rows 9831:14746", "rows 14746:19661", "rows 19661:24576"]
    assert [h["transformer.wte.weight"] for h in holds] == [
        "rows 0:9831", "rows 9831:19662", "rows 19662:29492", "rows 29492:39322", "rows 39322:49152"]
    # rank 3: 9 heads x 128 = 1152 query rows + K 128 + V 128
    c_attn = next(t for t in report["ranks"][3]["tensors"] if t["name"] == "transformer.h.0.attn.c_attn.weight")
    assert c_attn["local_shape"] == [1408, 6144]


# --- FusedQKV "blocks" with grouped-query attention, and separate q/k/v with KV heads < tp ------------------------

LLAMA_GQA = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, intermediate_size=90,
                 num_hidden_layers=1, max_position_embeddings=64, tie_word_embeddings=False)


def test_gqa_with_fewer_kv_heads_than_ranks_replicates_each_kv_head_to_its_query_heads():
    """Llama, 8 query heads and 2 KV heads of 8 at tp 4: KV head 0 serves query heads 0-3, KV head 1 heads 4-7.
    Two ranks share each KV head: ranks 0, 1 hold query heads 0:2, 2:4 and KV head 0; ranks 2, 3 heads 4:6,
    6:8 and KV head 1."""
    lay = layout("llama", 4, attention_bias=True, **LLAMA_GQA)
    assert [(h.q_start, h.q_stop, h.kv_start, h.kv_stop) for h in lay.heads] == [
        (0, 2, 0, 1), (2, 4, 0, 1), (4, 6, 1, 2), (6, 8, 1, 2)]
    q = [[(0, 16)], [(16, 32)], [(32, 48)], [(48, 64)]]  # 2 heads x 8 rows each
    kv = [[(0, 8)], [(0, 8)], [(8, 16)], [(8, 16)]]  # k_proj/v_proj (16, 64): KV head 0 = rows 0:8, head 1 = 8:16
    for part in ("weight", "bias"):
        expect(lay, f"model.layers.0.self_attn.q_proj.{part}", ROWS, q)
        expect(lay, f"model.layers.0.self_attn.k_proj.{part}", ROWS, kv)
        expect(lay, f"model.layers.0.self_attn.v_proj.{part}", ROWS, kv)
    expect(lay, "model.layers.0.self_attn.o_proj.weight", COLS, q)  # (64, 64): the same heads' inputs
    # gated MLP: 90 = 4*22 + 2 -> 0:23, 23:46, 46:68, 68:90
    mlp = [[(0, 23)], [(23, 46)], [(46, 68)], [(68, 90)]]
    expect(lay, "model.layers.0.mlp.gate_proj.weight", ROWS, mlp)
    expect(lay, "model.layers.0.mlp.up_proj.weight", ROWS, mlp)
    expect(lay, "model.layers.0.mlp.down_proj.weight", COLS, mlp)
    vocab = [[(0, 26)], [(26, 51)], [(51, 76)], [(76, 101)]]  # 101 = 4*25 + 1
    expect(lay, "model.embed_tokens.weight", ROWS, vocab)
    expect(lay, "lm_head.weight", ROWS, vocab)
    expect_replicated(lay, "model.layers.0.input_layernorm.weight")


def test_phi3_fused_qkv_and_gate_up_blocks_at_tp_4():
    """Phi-3, 8 query heads, 2 KV heads of 8: qkv_proj (64 + 2*16, 64) = [Q 0:64 | K 64:80 | V 80:96], K/V head 0 at
    K 64:72 / V 80:88 and head 1 at K 72:80 / V 88:96; heads as in the Llama case above. gate_up_proj (180, 64)
    = [gate 0:90 | up 90:180], each half split 23, 23, 22, 22 (90 = 4*22 + 2), a rank's piece of both."""
    lay = layout("phi3", 4, **LLAMA_GQA)
    expect(lay, "model.layers.0.self_attn.qkv_proj.weight", ROWS, [
        [(0, 16), (64, 72), (80, 88)], [(16, 32), (64, 72), (80, 88)],
        [(32, 48), (72, 80), (88, 96)], [(48, 64), (72, 80), (88, 96)]])
    expect(lay, "model.layers.0.mlp.gate_up_proj.weight", ROWS, [
        [(0, 23), (90, 113)], [(23, 46), (113, 136)], [(46, 68), (136, 158)], [(68, 90), (158, 180)]])
    expect(lay, "model.layers.0.mlp.down_proj.weight", COLS, [[(0, 23)], [(23, 46)], [(46, 68)], [(68, 90)]])


def test_gpt2_conv1d_c_attn_slices_columns():
    """GPT-2's Conv1D stores (in, out): c_attn.weight (48, 144) = output columns [Q 0:48 | K 48:96 | V 96:144],
    6 heads of 8 (kv_heads == heads). At tp 4 (6 = 4*1 + 2) heads 0:2, 2:4, 4:5, 5:6."""
    lay = layout("gpt2", 4, n_embd=48, n_head=6, n_inner=90, n_layer=1, n_positions=64)
    qkv = [[(0, 16), (48, 64), (96, 112)], [(16, 32), (64, 80), (112, 128)],
           [(32, 40), (80, 88), (128, 136)], [(40, 48), (88, 96), (136, 144)]]
    expect(lay, "transformer.h.0.attn.c_attn.weight", COLS, qkv)
    expect(lay, "transformer.h.0.attn.c_attn.bias", ROWS, qkv)  # (144,): the same outputs
    # attn.c_proj (48, 48), stored (in, out): rows are inputs, the rank's heads' 16, 16, 8, 8
    expect(lay, "transformer.h.0.attn.c_proj.weight", ROWS, [[(0, 16)], [(16, 32)], [(32, 40)], [(40, 48)]])
    # mlp.c_fc (48, 90): output columns 0:23, ...; mlp.c_proj (90, 48): input rows
    mlp = [[(0, 23)], [(23, 46)], [(46, 68)], [(68, 90)]]
    expect(lay, "transformer.h.0.mlp.c_fc.weight", COLS, mlp)
    expect(lay, "transformer.h.0.mlp.c_proj.weight", ROWS, mlp)


# --- FusedQKV "grouped": per-head (heads, 3, d) and Falcon's (kv_heads, group + 2, d) ----------------------------

def test_bloom_per_head_qkv_at_an_uneven_tp_3():
    """BLOOM, 7 heads of 10: query_key_value (210, 70) is (heads, 3, d), head h at rows 30h:30h+30 ([q | k | v]
    of 10 each). 7 = 3*2 + 1: heads 0:3, 3:5, 5:7 -> rows 0:90, 90:150, 150:210."""
    lay = layout("bloom", 3, hidden_size=70, n_head=7, n_layer=1)
    expect(lay, "transformer.h.0.self_attention.query_key_value.weight", ROWS, [[(0, 90)], [(90, 150)], [(150, 210)]])
    expect(lay, "transformer.h.0.self_attention.query_key_value.bias", ROWS, [[(0, 90)], [(90, 150)], [(150, 210)]])
    # dense (70, 70): inputs are the heads' 10 features each -> 0:30, 30:50, 50:70
    expect(lay, "transformer.h.0.self_attention.dense.weight", COLS, [[(0, 30)], [(30, 50)], [(50, 70)]])
    # MLP 4*70 = 280 = 3*93 + 1 -> 0:94, 94:187, 187:280
    expect(lay, "transformer.h.0.mlp.dense_h_to_4h.weight", ROWS, [[(0, 94)], [(94, 187)], [(187, 280)]])
    expect(lay, "transformer.h.0.mlp.dense_4h_to_h.weight", COLS, [[(0, 94)], [(94, 187)], [(187, 280)]])


def test_gpt_neox_per_head_qkv_at_tp_4():
    """GPT-NeoX, 5 heads of 8: query_key_value (120, 40), head h at rows 24h:24h+24. 5 = 4*1 + 1: heads 0:2, 2:3,
    3:4, 4:5 -> rows 0:48, 48:72, 72:96, 96:120."""
    lay = layout("gpt_neox", 4, hidden_size=40, num_attention_heads=5, intermediate_size=70, num_hidden_layers=1,
                 max_position_embeddings=64)
    expect(lay, "gpt_neox.layers.0.attention.query_key_value.weight", ROWS,
           [[(0, 48)], [(48, 72)], [(72, 96)], [(96, 120)]])
    expect(lay, "gpt_neox.layers.0.attention.dense.weight", COLS, [[(0, 16)], [(16, 24)], [(24, 32)], [(32, 40)]])


def test_falcon_new_decoder_architecture_groups_at_tp_4_and_3():
    """Falcon-40B's layout, 8 query heads and 2 KV heads of 8: query_key_value (96, 64) is (kv_heads, 4 + 2, 8),
    group g at rows 48g:48g+48 = [its 4 query heads, 8 rows each | K | V]: group 0 = q 0:32, K 32:40, V 40:48;
    group 1 = q 48:80, K 80:88, V 88:96."""
    falcon = dict(hidden_size=64, num_attention_heads=8, num_kv_heads=2, new_decoder_architecture=True,
                  num_hidden_layers=1)
    lay = layout("falcon", 4, **falcon)
    # 2 ranks per KV head: query heads 0:2 (rows 0:16), 2:4 (16:32) with K/V 32:48; 4:6 (48:64), 6:8 (64:80)
    # with K/V 80:96
    expect(lay, "transformer.h.0.self_attention.query_key_value.weight", ROWS, [
        [(0, 16), (32, 48)], [(16, 32), (32, 48)], [(48, 64), (80, 96)], [(64, 80), (80, 96)]])
    expect(lay, "transformer.h.0.self_attention.dense.weight", COLS, [[(0, 16)], [(16, 32)], [(32, 48)], [(48, 64)]])
    lay = layout("falcon", 3, **falcon)
    # 3 ranks over 2 KV heads: 2 ranks share KV head 0 (query heads 0:2, 2:4), 1 rank has group 1 whole
    expect(lay, "transformer.h.0.self_attention.query_key_value.weight", ROWS, [
        [(0, 16), (32, 48)], [(16, 32), (32, 48)], [(48, 96)]])
    expect(lay, "transformer.h.0.self_attention.dense.weight", COLS, [[(0, 16)], [(16, 32)], [(32, 64)]])


def test_falcon_multi_query_is_blocks_with_one_kv_head():
    """Falcon-7B's layout, 6 heads of 8, multi_query: [Q 0:48 | K 48:56 | V 56:64]; at tp 4 heads 2, 2, 1, 1."""
    lay = layout("falcon", 4, hidden_size=48, num_attention_heads=6, multi_query=True, bias=True, num_hidden_layers=1)
    kv = [(48, 56), (56, 64)]
    expect(lay, "transformer.h.0.self_attention.query_key_value.weight", ROWS,
           [[(0, 16), *kv], [(16, 32), *kv], [(32, 40), *kv], [(40, 48), *kv]])


# --- BlockInterleavedQKV: CodeGen's mp_num = 4 blocks of [Q | V | K] ---------------------------------------------

def test_codegen_qkv_at_tp_3_where_a_ranks_heads_span_blocks():
    """CodeGen, 8 heads of 8: qkv_proj (192, 64) is 4 blocks of 48 rows = [Q 16 | V 16 | K 16], each part holding
    2 heads: head h is in block h // 2 at position h % 2, so its Q rows are 48*(h//2) + 8*(h%2) + 0:8, its V rows
    +16, its K rows +32. A rank keeps, head after head, the head's [Q | V | K] rows. 8 = 3*2 + 2: heads 0:3, 3:6,
    6:8, so rank 0 spans blocks 0-1 and rank 1 blocks 1-2."""
    lay = layout("codegen", 3, n_embd=64, n_head=8, rotary_dim=4, n_inner=90, n_layer=1, n_positions=64)
    expect(lay, "transformer.h.0.attn.qkv_proj.weight", ROWS, [
        # head 0 (block 0, pos 0)     head 1 (block 0, pos 1)      head 2 (block 1, pos 0)
        [(0, 8), (16, 24), (32, 40), (8, 16), (24, 32), (40, 48), (48, 56), (64, 72), (80, 88)],
        # head 3 (block 1, pos 1)     head 4 (block 2, pos 0)       head 5 (block 2, pos 1)
        [(56, 64), (72, 80), (88, 96), (96, 104), (112, 120), (128, 136), (104, 112), (120, 128), (136, 144)],
        # head 6 (block 3, pos 0)           head 7 (block 3, pos 1)
        [(144, 152), (160, 168), (176, 184), (152, 160), (168, 176), (184, 192)]])
    # out_proj (64, 64): inputs are the heads in order, 8 each -> 0:24, 24:48, 48:64
    expect(lay, "transformer.h.0.attn.out_proj.weight", COLS, [[(0, 24)], [(24, 48)], [(48, 64)]])


def test_codegen_qkv_where_heads_straddle_blocks():
    """5 heads of 8 (n_embd 40): each part of a block is 40/4 = 10 rows, a block 30 rows [Q 10 | V 10 | K 10].
    Within a part the heads run across blocks: head h covers dims 8h:8h+8 of 40, dim i at block i // 10, offset
    i % 10, so head 1 (dims 8:16) is offsets 8:10 of block 0 and 0:6 of block 1: Q rows 8:10 + 30:36, V 18:20 +
    40:46, K 28:30 + 50:56. 5 = 2*2 + 1: heads 0:3 and 3:5."""
    lay = layout("codegen", 2, n_embd=40, n_head=5, rotary_dim=4, n_inner=90, n_layer=1, n_positions=64)
    assert [(h.q_start, h.q_stop) for h in lay.heads] == [(0, 3), (3, 5)]
    expect(lay, "transformer.h.0.attn.qkv_proj.weight", ROWS, [
        [(0, 8), (10, 18), (20, 28),  # head 0: dims 0:8, block 0 offsets 0:8
         (8, 10), (30, 36), (18, 20), (40, 46), (28, 30), (50, 56),  # head 1: dims 8:16, blocks 0-1
         (36, 40), (60, 64), (46, 50), (70, 74), (56, 60), (80, 84)],  # head 2: dims 16:24, blocks 1-2 (6:10, 0:4)
        [(64, 70), (90, 92), (74, 80), (100, 102), (84, 90), (110, 112),  # head 3: dims 24:32, blocks 2-3 (4:10, 0:2)
         (92, 100), (102, 110), (112, 120)]])  # head 4: dims 32:40, block 3 offsets 2:10


# --- FusedExperts: Mixtral's 3-D experts in granules ------------------------------------------------------------

MIXTRAL = dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=44, num_local_experts=4,
               num_experts_per_tok=2, num_hidden_layers=1, max_position_embeddings=64, tie_word_embeddings=False)


def test_fused_experts_split_every_experts_features_in_granules_at_tp_3():
    """Each expert's intermediate 44 features are 11 granules of 4 (gcd(44, 8) = 4); 11 = 3*3 + 2: 4, 4, 3 granules
    -> features 0:16, 16:32, 32:44. gate_up_proj (4 experts, 2*44, 48) = [gate 0:44 | up 44:88] per expert: a rank
    keeps rows a:b of gate and 44+a:44+b of up; down_proj (4, 48, 44) columns a:b. The router is replicated."""
    lay = layout("mixtral", 3, **MIXTRAL)
    gate_up = lay.param("model.layers.0.mlp.experts.gate_up_proj")
    down = lay.param("model.layers.0.mlp.experts.down_proj")
    assert gate_up.shape == (4, 88, 48) and down.shape == (4, 48, 44)
    # dim 1 of (experts, rows, cols) is each expert's rows, dim 2 its columns
    assert held(lay, gate_up.name) == [(1, indices(r)) for r in (
        [(0, 16), (44, 60)], [(16, 32), (60, 76)], [(32, 44), (76, 88)])]
    assert held(lay, down.name) == [(2, indices(r)) for r in ([(0, 16)], [(16, 32)], [(32, 44)])]
    expect_replicated(lay, "model.layers.0.mlp.gate.weight")


def test_autotp_plan_json_prints_mixtrals_expert_slices_at_tp_3(tmp_path, capsys):
    from autotp.cli import main

    AutoConfig.for_model("mixtral", vocab_size=101, **NO_TOKENS, **MIXTRAL).save_pretrained(tmp_path)
    assert main(["plan", "--model", str(tmp_path), "--tp", "3", "--json"]) == 0
    holds = [{t["name"]: (t["holds"], t["local_shape"]) for t in r["tensors"]}
             for r in json.loads(capsys.readouterr().out)["ranks"]]
    assert [h["model.layers.0.mlp.experts.gate_up_proj"] for h in holds] == [
        ("rows 0:16 + 44:60", [4, 32, 48]), ("rows 16:32 + 60:76", [4, 32, 48]), ("rows 32:44 + 76:88", [4, 24, 48])]
    assert [h["model.layers.0.mlp.experts.down_proj"] for h in holds] == [
        ("cols 0:16", [4, 48, 16]), ("cols 16:32", [4, 48, 16]), ("cols 32:44", [4, 48, 12])]


# --- int4 groups on row-parallel weights ------------------------------------------------------------------------

BIGCODE_INT4 = dict(n_embd=128, n_head=4, multi_query=True, n_inner=384, n_layer=1, n_positions=64)


def row_blocks(part: torch.Tensor):
    """A reader of `part` in blocks of rows, as the loader gives a slice to quant_load."""
    return lambda rows: ((r, part[r:r + (rows or len(part))]) for r in range(0, len(part), rows or len(part)))


def int4_by_hand(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The int4 format of torch's kernels, written out (quant.py's docstring): per output row and group of `group`
    inputs, s = (max - min) / 15, zero = min + 8 s, q = round((w - zero) / s) + 8 in [0, 15]; -> (q (out, in),
    scales_and_zeros (in / group, out, 2)), in float32, where the rounding to the dtype is exact."""
    g = w.reshape(w.shape[0], -1, group)
    low, high = g.amin(-1), g.amax(-1)
    s = (high - low) / 15
    zero = low + 8 * s
    q = (torch.round((g - zero[..., None]) / s[..., None]) + 8).clamp(0, 15).to(torch.uint8).reshape(w.shape)
    return q, torch.stack([s, zero], -1).transpose(0, 1).contiguous()


def test_int4_groups_stay_whole_where_the_row_parallel_split_keeps_them():
    """n_embd 128 (4 heads of 32), n_inner 384, groups of 32 input features, tp 3. attn.c_proj (128, 128) splits its
    inputs by heads 2, 1, 1 (4 = 3*1 + 1) -> 0:64, 64:96, 96:128 = groups 0:2, 2:3, 3:4 of 4; mlp.c_proj (128, 384)
    evenly, 384 / 3 = 128 -> 0:128, 128:256, 256:384 = groups 0:4, 4:8, 8:12 of 12. Each rank's int4 weight is
    then exactly those groups of the unsharded int4 weight."""
    lay = layout("gpt_bigcode", 3, quant=Quant("int4", 32), **BIGCODE_INT4)
    expect(lay, "transformer.h.0.attn.c_proj.weight", COLS, [[(0, 64)], [(64, 96)], [(96, 128)]])
    expect(lay, "transformer.h.0.mlp.c_proj.weight", COLS, [[(0, 128)], [(128, 256)], [(256, 384)]])
    torch.manual_seed(0)
    full = torch.randn(128, 384)
    values, scales = int4_by_hand(full, 32)  # the unsharded int4 weight: 12 groups per row
    target = QuantTarget(Quant("int4", 32), conv1d=False, splits_inputs=True)
    for cols, groups in (((0, 128), (0, 4)), ((128, 256), (4, 8)), ((256, 384), (8, 12))):
        piece = full[:, cols[0]:cols[1]]
        mine = quantize_slice(row_blocks(piece), target, tuple(piece.shape), torch.float32, torch.device("cpu"),
                              reduce_max=None)
        assert torch.equal(mine.scales, scales[groups[0]:groups[1]]), cols
        packed = torch._convert_weight_to_int4pack_for_cpu(values[:, cols[0]:cols[1]].to(torch.int32), 1)
        assert torch.equal(mine.qweight, packed), cols


def test_int4_refuses_a_tp_whose_split_cuts_a_group_naming_the_numbers():
    """n_embd 256 (2 heads of 128), n_inner 384 = 3 groups of 128, tp 2: attention splits at 128 (whole groups),
    but mlp.c_proj's 384 inputs split 192 + 192, and 192 = 1.5 groups: rank 0 would hold half of group 1."""
    big = dict(n_embd=256, n_head=2, multi_query=True, n_inner=384, n_layer=1, n_positions=64)
    with pytest.raises(AutotpError, match=r"^int4 quantizes transformer\.h\.0\.mlp\.c_proj\.weight in groups of 128 "
                                          r"input features, but at tp 2 rank 0 holds inputs 0:192 of 384, which "
                                          r"splits a group: choose a tp whose split keeps whole groups, or "
                                          r"--quantize int8$"):
        layout("gpt_bigcode", 2, quant=Quant("int4", 128), **big)
    lay = layout("gpt_bigcode", 2, quant=Quant("int4", 64), **big)  # groups of 64: 192 = 3 groups, whole
    expect(lay, "transformer.h.0.mlp.c_proj.weight", COLS, [[(0, 192)], [(192, 384)]])
    expect(lay, "transformer.h.0.attn.c_proj.weight", COLS, [[(0, 128)], [(128, 256)]])


# --- the styles on their own, with heads written by hand --------------------------------------------------------

def test_styles_shards_with_hand_written_heads():
    """`shards()` given a HeadShard written out by hand (no assign_heads): StarCoder's rank 3 at tp 5 holds query
    heads 30:39 and the K/V head; Llama's rank 2 at tp 4 holds query heads 4:6 and KV head 1."""
    from torch import nn

    from autotp.parallel.styles import Colwise, FusedQKV, Rowwise

    rank3 = RankContext(3, 5, HeadShard(30, 39, 0, 1, 128, 48, 1))
    c_attn = nn.Linear(6144, 6400, device="meta")
    got = FusedQKV(layout="blocks").shards(c_attn, rank3)
    assert got["weight"].dim == 0 and list(got["weight"].ranges) == [(3840, 4992), (6144, 6272), (6272, 6400)]
    assert list(Rowwise(split="q_heads").shards(nn.Linear(6144, 6144, device="meta"), rank3)["weight"].ranges) == [
        (3840, 4992)]
    rank2 = RankContext(2, 4, HeadShard(4, 6, 1, 2, 8, 8, 2))
    assert list(Colwise(split="q_heads").shards(nn.Linear(64, 64, device="meta"), rank2)["weight"].ranges) == [(32, 48)]
    assert list(Colwise(split="kv_heads").shards(nn.Linear(64, 16, device="meta"), rank2)["weight"].ranges) == [(8, 16)]
    # and the head arithmetic itself, by hand: 48 heads on 5 ranks are 10, 10, 10, 9, 9
    assert [(h.q_start, h.q_stop) for h in assign_heads(48, 1, 128, 5)] == [(0, 10), (10, 20), (20, 30), (30, 39),
                                                                          (39, 48)]
