"""drift.sim.naive: the definitions the kernels are tested against, pinned by hand-worked
examples from docs/semantics.md §3, §5, §6 and §10 (so a wrong definition cannot make a wrong
kernel pass). States are ``[V, K]`` blocks, the op's order; every example has K != V where the
orientation could hide, and every expected value is worked out here, not by calling drift.
"""

from __future__ import annotations

import math

import pytest
import torch

from drift.sim import naive

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16


# ----------------------------------------------------------------- input stages
def test_gating_hand_values():
    # a + dt_bias = 0: softplus = ln 2; A_log = 0: g = -ln 2, so the decay exp(g) is 1/2.
    assert naive.gating(0.0, 0.0, 0.0) == pytest.approx(-math.log(2.0), rel=1e-15)
    # Above the threshold 20 softplus is the identity: g = -exp(1) * 25 exactly.
    assert naive.gating(24.0, 1.0, 1.0) == -math.exp(1.0) * 25.0
    # At z = 20 (not above the threshold) softplus is still log1p(exp(z)) = 20 + 2.06e-9.
    at = naive.gating(20.0, 0.0, 0.0)
    assert at == pytest.approx(-(20.0 + math.exp(-20.0)), rel=1e-15) and at != -20.0
    # A_log scales: -exp(ln 3) * ln 2.
    assert naive.gating(0.0, math.log(3.0), 0.0) == pytest.approx(-3.0 * math.log(2.0), rel=1e-15)


def test_sigmoid_hand_values():
    assert naive.sigmoid(0.0) == 0.5
    assert naive.sigmoid(math.log(3.0)) == pytest.approx(0.75, rel=1e-15)  # 1 / (1 + 1/3)
    assert naive.sigmoid(-math.log(3.0)) == pytest.approx(0.25, rel=1e-15)


def test_quantize_mix_rounds_to_fp32_then_to_bf16():
    """docs/semantics.md §10: the float64 conv output is rounded to fp32 (the conv op's
    accumulator), then to bf16, each to nearest even. Between 1 and 2 the bf16 ulp is 2^-7."""
    q = naive.quantize_mix
    assert q(1.0 + 2.0 ** -9) == 1.0  # a quarter ulp: down
    assert q(1.0 + 3 * 2.0 ** -9) == 1.0 + 2.0 ** -7  # three quarters: up
    assert q(1.0 + 2.0 ** -8) == 1.0  # an exact tie: to the even neighbour (1.0)
    assert q(1.0 + 2.0 ** -7 + 2.0 ** -8) == 1.0 + 2.0 ** -6  # tie, the even neighbour is above
    # Double rounding: 1 + 2^-8 + 2^-30 lies above the tie, so one rounding to bf16 gives
    # 1 + 2^-7; but fp32 (ulp 2^-23 here) rounds it onto the tie first, and the tie goes to
    # the even 1.0. The definition is the two roundings.
    x = 1.0 + 2.0 ** -8 + 2.0 ** -30
    assert q(x) == 1.0 and q(-x) == -1.0
    single = 1.0 + 2.0 ** -7  # what a single rounding (to the nearer bf16 value) gives
    assert abs(x - single) < abs(x - 1.0)  # (the example is what it claims to be)


def test_conv_mix_hand_example():
    # One layer, row, channel; Kc = 3, D = 2: window = the Kc-1 = 2 tokens before, [5, 2];
    # x = [1, -3]; tap m multiplies token t - (Kc-1) + m, weights [w0, w1, w2] = [1, 0.5, 2]:
    #   z_0 = 1*5 + 0.5*2 + 2*1 = 8,   z_1 = 1*2 + 0.5*1 + 2*(-3) = -3.5.
    # SiLU z / (1 + exp(-z)): 7.99732 and -0.1025928; bf16 (via fp32): in [4, 8) the ulp is
    # 2^-5, so 7.99732 -> 8.0; in [2^-4, 2^-3) it is 2^-11, so -0.1025928 = -210.11 * 2^-11
    # -> -210 * 2^-11 = -0.1025390625.
    window = torch.tensor([5.0, 2.0]).reshape(1, 1, 2, 1)
    x = torch.tensor([1.0, -3.0]).reshape(1, 1, 2, 1)
    w = torch.tensor([1.0, 0.5, 2.0]).reshape(1, 1, 3)
    out = naive.conv_mix(window, x, w)
    assert out.dtype == F64 and out.shape == (1, 1, 2, 1)
    assert out.flatten().tolist() == [8.0, -0.1025390625]
    # Unrounded, the values differ: the rounding is part of the definition.
    assert -3.5 / (1.0 + math.exp(3.5)) != -0.1025390625


def test_conv_verify_hand_example():
    # Kc = 3, D = 2, W = (Kc-1) + (D-1) = 3; slot 1 holds rows [9, 5, 2]: the window is the
    # last Kc-1 rows [5, 2], so the outputs are the conv_mix example's. The buffer is left
    # rolled: [old[D:], x_0, x_1] = [2, 1, -3]; slot 0 is not touched.
    conv = torch.tensor([[7.0, 7.0, 7.0], [9.0, 5.0, 2.0]]).reshape(1, 2, 3, 1)
    x = torch.tensor([1.0, -3.0]).reshape(1, 1, 2, 1)
    w = torch.tensor([1.0, 0.5, 2.0]).reshape(1, 1, 3)
    out = naive.conv_verify(conv, [1], x, w)
    assert out.flatten().tolist() == [8.0, -0.1025390625]
    assert conv[0, 1, :, 0].tolist() == [2.0, 1.0, -3.0]
    assert conv[0, 0, :, 0].tolist() == [7.0, 7.0, 7.0]


def test_head_inputs_normalise_scale_and_group_key_heads():
    # HK = 2 key heads, HV = 4 value heads: value heads 0, 1 use key head 0; 2, 3 key head 1.
    HK, K, HV, V = 2, 2, 4, 1
    token = torch.tensor([3.0, 4.0, 0.0, 2.0,  # q heads
                          1.0, 0.0, 0.0, 5.0,  # k heads
                          7.0, 8.0, 9.0, 10.0], dtype=F64)  # v heads
    q, k, v = naive.head_inputs(token, HK, K, HV, V, scale=0.5)
    assert q.shape == k.shape == (HV, K) and v.shape == (HV, V)
    # x / sqrt(|x|^2 + 1e-6): [1, 0] -> [1, 0] / sqrt(1 + 1e-6); [0, 5] -> [0, 5 / sqrt(25 + 1e-6)].
    e1 = 1.0 / math.sqrt(1.0 + 1e-6)
    e2 = 5.0 / math.sqrt(25.0 + 1e-6)
    assert torch.allclose(k, torch.tensor([[e1, 0.0]] * 2 + [[0.0, e2]] * 2, dtype=F64), rtol=1e-15, atol=0)
    # q [3, 4] -> [0.6, 0.8] (1 + 1e-6/25 in the norm), then times the scale 0.5.
    n = math.sqrt(25.0 + 1e-6)
    assert torch.allclose(q[0], torch.tensor([1.5 / n, 2.0 / n], dtype=F64), rtol=1e-15, atol=0)
    assert torch.allclose(q[2], torch.tensor([0.0, 1.0 / math.sqrt(4.0 + 1e-6)], dtype=F64), rtol=1e-15, atol=0)
    assert torch.equal(q[0], q[1]) and torch.equal(k[2], k[3])
    assert torch.equal(v[:, 0], token[8:])  # v is read as is


# ------------------------------------------------------------------- the op
def test_gdn_token_closed_form_in_v_k_orientation():
    """S <- a S; u = (v - S k) beta; S <- S + u k^T; o = S q, with S [V, K] = [2, 3]."""
    k = torch.tensor([0.6, 0.8, 0.0], dtype=F64)
    q = torch.tensor([1.0, 0.0, 2.0], dtype=F64)
    v = torch.tensor([1.0, -2.0], dtype=F64)
    # From S = 0: S' = beta v k^T (S k = 0), o = beta (k.q) v.
    S1, o1 = naive.gdn_token(torch.zeros(2, 3, dtype=F64), q, k, v, 0.5, 0.25)
    assert S1.shape == (2, 3) and o1.shape == (2,)
    assert torch.allclose(S1, 0.25 * torch.outer(v, k), rtol=0, atol=1e-15)
    assert torch.allclose(o1, 0.25 * 0.6 * v, rtol=0, atol=1e-15)
    # From S0 = [[1, 0, 1], [0, 2, 0]], a = 0.5, beta = 0.5, worked by hand:
    #   a S0 = [[.5, 0, .5], [0, 1, 0]];  a S0 k = [0.3, 0.8];  u = ([1, -2] - [0.3, 0.8]) * 0.5 = [0.35, -1.4];
    #   S' = a S0 + u k^T = [[.71, .28, .5], [-.84, -.12, 0]];  o = S' q = [1.71, -0.84].
    S0 = torch.tensor([[1.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=F64)
    S2, o2 = naive.gdn_token(S0, q, k, v, 0.5, 0.5)
    want = torch.tensor([[0.71, 0.28, 0.5], [-0.84, -0.12, 0.0]], dtype=F64)
    assert torch.allclose(S2, want, rtol=0, atol=1e-15)
    assert torch.allclose(o2, torch.tensor([1.71, -0.84], dtype=F64), rtol=0, atol=1e-15)
    # Delta rule with beta = 1 and a unit key: the value stored along k is replaced, not added.
    S3, _ = naive.gdn_token(S1, q, k, torch.tensor([3.0, 4.0], dtype=F64), 1.0, 1.0)
    assert torch.allclose(S3 @ k, torch.tensor([3.0, 4.0], dtype=F64), rtol=0, atol=1e-14)


def test_gdn_decode_rounds_each_token_to_the_state_dtype():
    # One head, K = V = 1, h0 = 1, decay 1 - 2^-10, beta 0: each token multiplies by the
    # decay; in bf16 (ulp 2^-8 just below 1, half-ulp 2^-9) 1 - 2^-10 rounds back to 1,
    # so the state stagnates (docs/bounds.md); in float64 it decays.
    one = torch.ones(1, 1, 3, 1, 1, dtype=F64)
    decay = torch.full((1, 1, 3, 1), 1.0 - 2.0 ** -10, dtype=F64)
    beta = torch.zeros(1, 1, 3, 1, dtype=F64)
    h0 = torch.ones(1, 1, 1, 1, 1)
    f16, _ = naive.gdn_decode(h0, one, one, one, decay, beta, [3], BF16)
    f64, out = naive.gdn_decode(h0, one, one, one, decay, beta, [3], F64)
    assert f16.item() == 1.0
    assert f64.item() == pytest.approx((1 - 2.0 ** -10) ** 3, rel=1e-15)
    assert out[0, 0, :, 0, 0].tolist() == pytest.approx([(1 - 2.0 ** -10) ** t for t in (1, 2, 3)], rel=1e-15)
    # A row's tokens past num_tokens are not processed: outputs stay zero, the state stops.
    f64_2, out2 = naive.gdn_decode(h0, one, one, one, decay, beta, [2], F64)
    assert f64_2.item() == pytest.approx((1 - 2.0 ** -10) ** 2, rel=1e-15) and out2[0, 0, 2].item() == 0.0


# ------------------------------------------------------------- update kernels
def test_conv_state_rollback_hand_example():
    # W = 6, D = 4: shift = (D-1) - step; buf[shift:] = buf[:W-shift]; first rows stale.
    buf = torch.arange(6.0).reshape(1, 1, 6, 1).repeat(1, 5, 1, 1)  # 5 slots, rows 0..5
    steps = torch.tensor([0, 1, 3, -1, 4])
    naive.conv_state_rollback(buf, torch.tensor([0, 1, 2, 3, 4]), steps, 4)
    assert buf[0, 0, :, 0].tolist() == [0, 1, 2, 0, 1, 2]  # shift 3
    assert buf[0, 1, :, 0].tolist() == [0, 1, 0, 1, 2, 3]  # shift 2
    assert buf[0, 2, :, 0].tolist() == [0, 1, 2, 3, 4, 5]  # shift 0 (all accepted)
    assert buf[0, 3, :, 0].tolist() == [0, 1, 2, 3, 4, 5]  # step -1: untouched
    assert buf[0, 4, :, 0].tolist() == [0, 1, 2, 3, 4, 5]  # step >= D: untouched


def test_move_intermediate_cache_hand_example_flat_blocks():
    ssm = torch.zeros(1, 4, 1, 1, 1)
    inter = torch.arange(12.0).reshape(1, 3, 4, 1, 1, 1)  # row r, step s holds 4 r + s
    dst, src, st = torch.tensor([2, 1, 3]), torch.tensor([1, 0, 0]), torch.tensor([3, -1, 5])
    naive.move_intermediate_cache(ssm, inter, dst, src, st)
    # slot 2 <- row 1 step 3 = block 7; the -1 row is skipped; slot 3 <- flat block 0 * 4 + 5 =
    # row 1 step 1 = 5: no upper bound on the step (docs/semantics.md §3), the flat index counts.
    assert ssm.flatten().tolist() == [0.0, 0.0, 7.0, 5.0]


def _vk(L, lead, V, K, transposed, values):
    """A [L, *lead, V, K] tensor holding ``values`` logically: dense, or a transposed view of
    [.., K, V] storage."""
    if transposed:
        t = torch.zeros(L, *lead, K, V).transpose(-1, -2)
    else:
        t = torch.zeros(L, *lead, V, K)
    t.copy_(values)
    return t


@pytest.mark.parametrize("ssm_t, inter_t", [(False, False), (True, True), (True, False), (False, True)],
                         ids=["contiguous", "both-transposed", "transposed-dst", "transposed-src"])
def test_move_intermediate_cache_is_a_raw_block_copy(ssm_t, inter_t):
    """docs/semantics.md §3: the block's memory is copied in flat order. V = 2, K = 3: the scratch
    block holds logically B = [[1, 2, 3], [4, 5, 6]] ([V, K])."""
    V, K = 2, 3
    B = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    inter = _vk(1, (1, 1, 1), V, K, inter_t, B.expand(1, 1, 1, 1, V, K))
    ssm = _vk(1, (2, 1), V, K, ssm_t, torch.zeros(1, 2, 1, V, K))
    naive.move_intermediate_cache(ssm, inter, torch.tensor([1]), torch.tensor([0]), torch.tensor([0]))
    got = ssm[0, 1, 0]  # what the destination's view shows
    # The source's memory in flat order: B's rows when dense; B^T's rows ([K, V] storage) when transposed.
    mem = (B.T if inter_t else B).reshape(-1)
    # Read back through the destination's view: dense [V, K] rows, or a [K, V] storage transposed.
    want = mem.reshape(K, V).T if ssm_t else mem.reshape(V, K)
    assert torch.equal(got, want)
    if ssm_t == inter_t:  # one layout: the logical copy
        assert torch.equal(got, B)
    else:  # layouts differ: not the logical copy
        assert not torch.equal(got, B)
    if ssm_t and not inter_t:  # hand-worked: memory 1..6 read as [K, V] rows [[1, 2], [3, 4], [5, 6]], transposed
        assert got.tolist() == [[1.0, 3.0, 5.0], [2.0, 4.0, 6.0]]
    assert torch.equal(ssm[0, 0], torch.zeros(1, V, K))  # slot 0: not named


def test_move_intermediate_cache_square_transposed_destination_gets_the_transposed_block():
    # V = K = 2: with a transposed destination the raw copy is exactly the transposed block.
    B = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    inter = B.reshape(1, 1, 1, 1, 2, 2).clone()
    ssm = torch.zeros(1, 1, 1, 2, 2).transpose(-1, -2)
    naive.move_intermediate_cache(ssm, inter, torch.tensor([0]), torch.tensor([0]), torch.tensor([0]))
    assert torch.equal(ssm[0, 0, 0], B.T)
