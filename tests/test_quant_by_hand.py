"""int8 / int4 weight quantization against arithmetic written out here, not against autotp's own functions.

Hand-sized weights whose values are exact binary fractions, so every scale, zero point and rounding is
checkable on paper: torch.round rounds halves to even (63.5 -> 64, -6.5 -> -6), an all-zero int8 row and a
constant int4 group get scale 1. The int4 packing order is checked through torch's own CPU int4 kernel
(`_weight_int4pack_mm_for_cpu`): it must compute x @ W.T for the W written out below.
"""

from __future__ import annotations

import torch

from autotp.quant.weights import int8_scales, pack_int4, quantize_int4, quantize_int8


def test_int8_scales_and_rounding_by_hand():
    w = torch.tensor([[63.5, -63.5, 0.25, 0.75, -0.25, 31.75],
                      [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                      [1.27, 0.0, -1.27, 0.0, 0.0, 0.0]])
    scales = int8_scales(w.abs().amax(dim=1), torch.float32)
    # row 0: 63.5 / 127 = 0.5; row 1: all zero -> 1; row 2: 1.27 / 127 = 0.01 (as float32 rounds it)
    assert scales.tolist() == [0.5, 1.0, torch.tensor(1.27 / 127, dtype=torch.float32).item()]
    q = quantize_int8(w, scales)
    # row 0 / 0.5: 127, -127, 0.5 -> 0 (half to even), 1.5 -> 2, -0.5 -> 0, 63.5 -> 64
    assert q.tolist() == [[127, -127, 0, 2, 0, 64], [0] * 6, [127, 0, -127, 0, 0, 0]]
    assert q.dtype == torch.int8


def test_int4_groups_scales_zero_points_and_rounding_by_hand():
    # one output row, three groups of 4
    w = torch.tensor([[-8.0, -3.0, 0.0, 7.0, 1.5, 2.0, 2.25, 9.0, 3.0, 3.0, 3.0, 3.0]])
    q, sz = quantize_int4(w, 4, torch.float32)
    # group 0: low -8, high 7 -> scale 15 / 15 = 1, zero = low + 8 * scale = 0; q = round((w - 0) / 1) + 8
    # group 1: low 1.5, high 9 -> scale 7.5 / 15 = 0.5, zero = 1.5 + 4 = 5.5; (w - 5.5) / 0.5 = -8, -7, -6.5, 7
    # group 2: constant -> scale 1, zero = 3 + 8 = 11; (3 - 11) / 1 + 8 = 0
    assert q.tolist() == [[0, 5, 8, 15, 0, 1, 2, 15, 0, 0, 0, 0]]
    assert sz.shape == (3, 1, 2) and sz[:, 0].tolist() == [[1.0, 0.0], [0.5, 5.5], [1.0, 11.0]]
    # what the kernel reconstructs, (q - 8) * scale + zero: exact except group 1's -6.5 -> -6 (2.25 -> 2.5)
    back = [(v - 8) * s + z for i, v in enumerate(q[0].tolist()) for s, z in [sz[i // 4, 0].tolist()]]
    assert back == [-8.0, -3.0, 0.0, 7.0, 1.5, 2.0, 2.5, 9.0, 3.0, 3.0, 3.0, 3.0]


def test_int4_packing_order_through_torchs_own_kernel():
    """16 output rows x 64 inputs (the smallest shape torch's CPU int4 kernel packs), groups of 32: the packed
    weight multiplied by torch's kernel equals x @ W.T for W = (q - 8) * scale + zero written out here."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (16, 64), generator=g, dtype=torch.uint8)
    scales = torch.tensor([0.5, 0.25], dtype=torch.float32)[None].repeat(16, 1) * (1 + torch.arange(16))[:, None]
    zeros = torch.tensor([1.0, -2.0])[None].repeat(16, 1)
    sz = torch.stack([scales, zeros], -1).transpose(0, 1).contiguous()  # (groups, out, 2)
    w = torch.empty(16, 64)
    for r in range(16):
        for c in range(64):
            w[r, c] = (int(q[r, c]) - 8) * scales[r, c // 32] + zeros[r, c // 32]
    x = torch.randn(3, 64, generator=g)
    packed = pack_int4(q, torch.device("cpu"))
    got = torch._weight_int4pack_mm_for_cpu(x, packed, 32, sz)
    torch.testing.assert_close(got, x @ w.T, rtol=1e-5, atol=1e-4)
