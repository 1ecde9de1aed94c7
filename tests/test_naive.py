"""drift.naive: the definitions the kernels are tested against, pinned by hand-worked
examples from docs/semantics.md §3 and §5 (so a wrong definition cannot make a wrong kernel pass)."""

from __future__ import annotations

import math

import pytest
import torch

from drift.sim import naive


def test_gating_hand_values():
    # a + dt_bias = 0: softplus = ln 2; A_log = 0: g = -ln 2, decay exp(g) = 1/2.
    g, beta = naive.gating(0.0, 0.0, 0.0, 0.0)
    assert g == pytest.approx(-math.log(2.0), rel=1e-15) and beta == 0.5
    # Above the threshold 20 softplus is the identity: g = -exp(1) * 25.
    g, _ = naive.gating(24.0, 0.0, 1.0, 1.0)
    assert g == -math.exp(1.0) * 25.0
    _, beta = naive.gating(0.0, math.log(3.0), 0.0, 0.0)  # sigmoid(ln 3) = 3/4
    assert beta == pytest.approx(0.75, rel=1e-15)


def test_gdn_token_one_step_closed_form():
    # From h = 0: h' = beta k v^T (v' = v * beta since k^T h = 0), o = beta (q.k) v.
    k = torch.tensor([0.6, 0.8, 0.0], dtype=torch.float64)
    q = torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64)
    v = torch.tensor([1.0, -2.0], dtype=torch.float64)
    h, o = naive.gdn_token(torch.zeros(3, 2, dtype=torch.float64), q, k, v, 0.5, 0.25)
    assert torch.allclose(h, 0.25 * torch.outer(k, v), rtol=0, atol=1e-15)
    assert torch.allclose(o, 0.25 * 0.6 * v, rtol=0, atol=1e-15)
    # Delta rule with beta = 1 and a unit key: the value stored along k is replaced, not added.
    h2, _ = naive.gdn_token(h, q, k, torch.tensor([3.0, 4.0], dtype=torch.float64), 1.0, 1.0)
    assert torch.allclose(k @ h2, torch.tensor([3.0, 4.0], dtype=torch.float64), rtol=0, atol=1e-14)


def test_qkv_heads_groups_key_heads_over_value_heads():
    # HK = 2 key heads, HV = 4 value heads: value heads 0, 1 use key head 0; 2, 3 use key head 1.
    HK, K, HV, V = 2, 2, 4, 1
    token = torch.tensor([3.0, 4.0, 0.0, 2.0,  # q heads
                          1.0, 0.0, 0.0, 5.0,  # k heads
                          7.0, 8.0, 9.0, 10.0], dtype=torch.float64)  # v heads
    q, k, v = naive.qkv_heads(token, HK, K, HV, V)
    assert torch.allclose(k, torch.tensor([[1.0, 0.0]] * 2 + [[0.0, 1.0]] * 2, dtype=torch.float64), atol=1e-6)
    # q is l2-normalised and scaled by K^-1/2.
    assert torch.allclose(q[0], torch.tensor([0.6, 0.8], dtype=torch.float64) / math.sqrt(2), atol=1e-6)
    assert torch.equal(v[:, 0], token[8:])


def test_conv_verify_hand_example():
    # One layer, one channel, Kc = 2, D = 2, W = (Kc-1) + (D-1) = 2; slot 1 holds [9, 5]:
    # the committed window is the last Kc-1 = 1 row (5). Weights [w0, w1] = [1, 2]:
    # out_j = silu(1 * prev + 2 * x_j).
    conv = torch.tensor([[[[0.0], [0.0]], [[9.0], [5.0]]]])  # [L=1, S=2, W=2, C=1]
    x = torch.tensor([[[[1.0], [-3.0]]]])  # [L, N=1, D=2, C]
    w = torch.tensor([[[1.0, 2.0]]])  # [L, C, Kc]
    out = naive.conv_verify(conv, [1], x, w)
    pre = torch.tensor([5.0 + 2.0, 1.0 - 6.0], dtype=torch.float64)
    assert torch.allclose(out[0, 0, :, 0], pre * torch.sigmoid(pre), rtol=1e-15)
    # Rolled buffer: [old[D:], x_0 .. x_{D-1}] = [1, -3] (old rows all dropped since W = D).
    assert torch.equal(conv[0, 1, :, 0], torch.tensor([1.0, -3.0]))


def test_conv_state_rollback_hand_example():
    # W = 6, D = 4: shift = (D-1) - step; buf[shift:] = buf[:W-shift]; first rows stale.
    buf = torch.arange(6.0).reshape(1, 1, 6, 1).repeat(1, 4, 1, 1)  # 4 slots, rows 0..5
    steps = torch.tensor([0, 1, 3, -1])
    naive.conv_state_rollback(buf, torch.tensor([0, 1, 2, 3]), steps, 4)
    assert buf[0, 0, :, 0].tolist() == [0, 1, 2, 0, 1, 2]  # shift 3
    assert buf[0, 1, :, 0].tolist() == [0, 1, 0, 1, 2, 3]  # shift 2
    assert buf[0, 2, :, 0].tolist() == [0, 1, 2, 3, 4, 5]  # shift 0 (all accepted)
    assert buf[0, 3, :, 0].tolist() == [0, 1, 2, 3, 4, 5]  # step -1: untouched


def test_move_intermediate_cache_hand_example():
    ssm = torch.zeros(1, 3, 1, 1, 1)
    inter = torch.arange(8.0).reshape(1, 2, 4, 1, 1, 1)  # row r, step s holds 4 r + s
    naive.move_intermediate_cache(ssm, inter, torch.tensor([2, 1]), torch.tensor([1, 0]), torch.tensor([3, -1]))
    assert ssm.flatten().tolist() == [0.0, 0.0, 7.0]  # slot 2 <- row 1 step 3; -1 skipped


def test_gdn_decode_rounds_each_token_to_the_state_dtype():
    # One head, K = V = 1, h0 = 1, decay 1 - 2^-10, beta 0: each token multiplies by the
    # decay; in bf16 (ulp 2^-8 just below 1, half-ulp 2^-9) 1 - 2^-10 rounds back to 1,
    # so the state stagnates (docs/bounds.md); in float64 it decays.
    one = torch.ones(1, 1, 3, 1, 1, dtype=torch.float64)
    g = torch.full((1, 1, 3, 1), math.log1p(-2.0 ** -10), dtype=torch.float64)
    beta = torch.zeros(1, 1, 3, 1, dtype=torch.float64)
    h0 = torch.ones(1, 1, 1, 1, 1)
    f16, _ = naive.gdn_decode(h0, one, one, one, g, beta, [3], torch.bfloat16)
    f64, _ = naive.gdn_decode(h0, one, one, one, g, beta, [3], torch.float64)
    assert f16.item() == 1.0
    assert f64.item() == pytest.approx((1 - 2.0 ** -10) ** 3, rel=1e-15)
