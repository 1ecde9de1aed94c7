"""drift.kernels: the vectorised kernels against their float64 naive counterparts (drift.naive).

Shapes are small but not degenerate: 2 layers, 3 batch rows (one on the dummy slot 0),
D = 4, 2 key heads grouped over 4 value heads, K = 16 != V = 8 (a K/V swap cannot hide),
conv kernel 4. States are stored the NPU way (a transposed view of [K, V] storage).

Tolerances (u32 = 2^-24, the fp32 unit roundoff):

* One gated delta-rule token, per (layer, row, head), computed in fp32: the dot
  product k^T h of length K errs by at most about K u32 ||k|| ||h|| (Higham, gamma_K),
  the decay, the exp of g, the subtraction, the beta product and the rank-one update
  add a few more u32 (||h|| + ||v||). So one token adds at most
  (K + 6) u32 (||h_t||_F + ||v_t||) in Frobenius norm. The map h -> a (I - beta k k^T) h
  has norm <= 1 (0 < a <= 1, 0 < beta < 1, ||k|| <= 1 after the l2 norm), so earlier
  errors do not grow: after t tokens the state errs by at most
  t (K + 6) u32 max_t (||h_t|| + ||v_t||). See :func:`state_bound`.
* An output o = q^T h (||q|| <= K^-1/2) errs by ||q|| (state error + K u32 ||h||).
* A bf16 store of the fp32 state versus the float64 state rounded to bf16: the two
  pre-rounding values differ by the tiny bound above (~1e-6 relative), so the rounded
  values agree or differ by one bf16 ulp, the latter only when a rounding boundary
  falls between them: a fraction of about (error / ulp) ~ 1e-6 / 2^-8 ~ 3e-4 of the
  elements. We allow 1% (30x margin); a wrong rounding mode (truncation) mismatches
  about half of them.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import U32, U64, bf16_ulp, gdn_state_bound, rel_fro, same_bits, verify_bounds
from drift.sim import kernels, naive

L, N, D, HK, HV, K, V, KC = 2, 3, 4, 2, 4, 16, 8, 4
C = 2 * HK * K + HV * V
W = (KC - 1) + (D - 1)
S = 6  # pool slots
SLOTS = [4, 1, 0]  # batch rows -> slots; the last row is a padded row on the dummy slot


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def bf16_grid(shape, seed, scale=1.0) -> torch.Tensor:
    """Float32 values on the bfloat16 grid (what a bf16 model feeds the kernels)."""
    return (torch.randn(shape, generator=gen(seed), dtype=torch.float32) * scale).to(torch.bfloat16).float()


# ----------------------------------------------------------------------- gating
def _gating_inputs():
    a = torch.empty(L, N, D, HV).uniform_(-8.0, 8.0, generator=gen(1))
    a[0, 0, 0] = torch.tensor([19.0, 20.0, 20.5, 25.0])  # both sides of the softplus threshold 20
    b = torch.empty(L, N, D, HV).uniform_(-8.0, 8.0, generator=gen(2))
    A_log = torch.randn(L, HV, generator=gen(3))
    dt_bias = torch.randn(L, HV, generator=gen(4)) * 0.5
    return a, b, A_log, dt_bias


@pytest.mark.parametrize("dtype, u", [(torch.float32, U32), (torch.float64, U64)])
def test_gating_matches_the_scalar_definition(dtype, u):
    a, b, A_log, dt_bias = _gating_inputs()
    g, beta = kernels.gdn_gating(a, b, A_log, dt_bias, dtype)
    assert g.dtype == dtype and beta.dtype == dtype and g.shape == a.shape
    ref_g = torch.empty(a.shape, dtype=torch.float64)
    ref_b = torch.empty(a.shape, dtype=torch.float64)
    for idx in torch.cartesian_prod(*(torch.arange(n) for n in a.shape)).tolist():
        l, _, _, h = idx
        ref_g[tuple(idx)], ref_b[tuple(idx)] = naive.gating(float(a[tuple(idx)]), float(b[tuple(idx)]),
                                                            float(A_log[l, h]), float(dt_bias[l, h]))
    # z = a + dt_bias is rounded once (u |z|); softplus amplifies a relative input error
    # by z sigmoid(z) / softplus(z) <= max(1, |z|); exp, log1p, the product each add <= 2 u.
    z = (a + dt_bias[:, None, None, :]).to(torch.float64)
    cond = torch.clamp(z.abs(), min=1.0)
    assert ((g.double() - ref_g).abs() <= (cond + 8) * u * ref_g.abs()).all()
    # sigmoid = 1 / (1 + exp(-b)): exp, add and divide, each <= 2 u relative.
    assert ((beta.double() - ref_b).abs() <= 8 * u * ref_b.abs()).all()


# ----------------------------------------------------------------------- conv
def _conv_case(strided: bool):
    """A bf16 conv pool [L, S, W, C]; strided: a transposed view of [L, S, C, W] storage."""
    vals = bf16_grid((L, S, W, C), 10)
    if strided:
        conv = torch.empty(L, S, C, W, dtype=torch.bfloat16).transpose(2, 3)
        conv.copy_(vals)
        assert not conv.is_contiguous()
    else:
        conv = vals.to(torch.bfloat16)
    x = bf16_grid((L, N, D, C), 11).to(torch.bfloat16)
    # Depthwise weights on the bf16 grid like drift.stream's, unit output variance.
    weight = bf16_grid((L, C, KC), 12, scale=KC ** -0.5)
    return conv, x, weight


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_conv_verify_matches_naive(strided):
    conv, x, weight = _conv_case(strided)
    before = conv.clone()
    slots = torch.tensor(SLOTS)
    conv_naive = conv.clone().contiguous()
    out = kernels.conv_verify(conv, slots, x, weight)
    ref = naive.conv_verify(conv_naive, SLOTS, x, weight)  # float64
    assert out.dtype == torch.float32 and out.shape == (L, N, D, C)
    # Rolled buffers are pure data movement: bit-identical to the naive loop, and equal
    # to the definition [old[D:], x_0 .. x_{D-1}] (docs/semantics.md §3).
    assert same_bits(conv.contiguous(), conv_naive)
    for n, s in enumerate(SLOTS):
        assert same_bits(conv[:, s], torch.cat([before[:, s, D:], x[:, n]], dim=1))
    untouched = [s for s in range(S) if s not in SLOTS]
    assert same_bits(conv[:, untouched], before[:, untouched])
    # Outputs: products of bf16 values are exact in fp32; the Kc-term sum errs by at most
    # (Kc - 1) u32 sum|w x|, SiLU' <= 1.1 carries that through, and SiLU's own evaluation
    # adds <= 4 u32 |silu|. Margin 2x on the first term.
    seq = torch.cat([before[:, SLOTS, W - (KC - 1):].double(), x.double()], dim=2)  # [L, N, Kc-1+D, C]
    win = seq.unfold(2, KC, 1)  # [L, N, D, C, Kc]
    abs_sum = (win.abs() * weight.double().abs()[:, None, None]).sum(-1)
    bound = 2 * 1.1 * (KC - 1) * U32 * abs_sum + 4 * U32 * ref.abs()
    assert ((out.double() - ref).abs() <= bound).all()


def test_split_qkv_matches_naive_heads():
    qkv = torch.randn(L, N, D, C, generator=gen(13))
    q, k, v = kernels.split_qkv(qkv, HK, K, HV, V)
    assert q.shape == k.shape == (L, N, D, HV, K) and v.shape == (L, N, D, HV, V)
    for l in range(L):
        for n in range(N):
            for t in range(D):
                rq, rk, rv = naive.qkv_heads(qkv[l, n, t].double(), HK, K, HV, V)
                # l2 norm in fp32: a K-term sum of squares (K u32), rsqrt and product (3 u32).
                tol = (K + 6) * U32
                assert (rel_fro(q[l, n, t], rq, -1) <= tol).all() and (rel_fro(k[l, n, t], rk, -1) <= tol).all()
                assert torch.equal(v[l, n, t].double(), rv)  # a reshape


# ------------------------------------------------------------------ state stores
def _grid_values(n: int, seed: int) -> torch.Tensor:
    """fp32 values in the normal range, both signs, off the bf16 grid, plus exact bf16
    values and exact ties (a bf16 value plus half an ulp)."""
    g = gen(seed)
    x = (torch.rand(n, generator=g) + 1.0) * torch.exp2(torch.randint(-20, 20, (n,), generator=g).float())
    x = torch.where(torch.rand(n, generator=g) < 0.5, -x, x)
    on_grid = x[: n // 8].to(torch.bfloat16).float()
    ties = (on_grid.double() + 0.5 * bf16_ulp(on_grid)).float()  # exact in fp32 (9 bits)
    return torch.cat([x, on_grid, ties])


def _ref_round(x: torch.Tensor, mode: str) -> torch.Tensor:
    """Independent float64 definition of rounding fp32 values to bf16."""
    x64 = x.double()
    ulp = bf16_ulp(x)
    lo = torch.floor(x64.abs() / ulp) * ulp  # toward zero
    if mode == "truncate":
        return torch.copysign(lo, x64)
    rem = x64.abs() - lo
    lo_even = (torch.floor(x64.abs() / ulp) % 2) == 0
    up = (rem > ulp / 2) | ((rem == ulp / 2) & ~lo_even)
    return torch.copysign(lo + up * ulp, x64)


@pytest.mark.parametrize("mode", ["rne", "truncate"])
def test_store_rounding_rne_and_truncate_match_their_definitions(mode):
    x = _grid_values(4096, 20)
    dst = torch.empty(x.shape, dtype=torch.bfloat16)
    kernels.store_state(dst, x, mode)
    assert torch.equal(dst.double(), _ref_round(x, mode))
    if mode == "rne":
        assert same_bits(dst, x.to(torch.bfloat16))  # RNE is exactly the cast
    else:
        assert (dst.double().abs() <= x.double().abs()).all()  # toward zero, either sign
        assert (dst.double() != _ref_round(x, "rne")).float().mean() > 0.3  # not RNE in disguise


@pytest.mark.parametrize("frac", [0.1, 0.3, 0.5, 0.9])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_stochastic_rounding_is_unbiased(frac, sign):
    lo = torch.tensor(sign * 1.1875)  # a bf16 value (binade [1, 2), ulp 2^-7)
    ulp = 2.0 ** -7
    x = float(lo) + sign * frac * ulp
    n = 1 << 16
    h = torch.full((n,), x, dtype=torch.float32)
    dst = torch.empty(n, dtype=torch.bfloat16)
    kernels.store_state(dst, h, "stochastic", key=7)
    vals = dst.double()
    # Every result is one of the two neighbours of x.
    assert ((vals == float(lo)) | (vals == float(lo) + sign * ulp)).all()
    # Rounded away from zero with probability frac: the mean is x within 5 sigma of the
    # sample mean (sigma = ulp sqrt(p (1 - p) / n)) plus the 2^-16 ulp quantisation of
    # the 16 random bits.
    sigma = ulp * math.sqrt(frac * (1 - frac) / n)
    assert abs(vals.mean().item() - x) <= 5 * sigma + ulp * 2.0 ** -16
    # Over keys, for one element: unbiased as well (4,096 keys, 5 sigma).
    per_key = torch.stack([kernels.round_to(h[:1], torch.bfloat16, "stochastic", key) for key in range(4096)])
    sigma_k = ulp * math.sqrt(frac * (1 - frac) / 4096)
    assert abs(per_key.double().mean().item() - x) <= 5 * sigma_k + ulp * 2.0 ** -16
    # It differs from RNE (which always picks the nearer neighbour).
    assert (dst != h.to(torch.bfloat16)).any()


def test_stochastic_rounding_is_deterministic_for_a_key_and_keeps_grid_values():
    x = _grid_values(4096, 21)
    a, b, c = (torch.empty(x.shape, dtype=torch.bfloat16) for _ in range(3))
    kernels.store_state(a, x, "stochastic", key=3)
    kernels.store_state(b, x, "stochastic", key=3)
    kernels.store_state(c, x, "stochastic", key=4)
    assert same_bits(a, b)
    assert not same_bits(a, c)
    grid = x.to(torch.bfloat16).float()
    kernels.store_state(a, grid, "stochastic", key=5)
    assert same_bits(a, grid.to(torch.bfloat16))  # nothing to round: exact


def test_store_rejects_unknown_rounding_and_non_bf16_targets():
    h = torch.ones(4)
    with pytest.raises(ValueError, match="not known"):
        kernels.store_state(torch.empty(4, dtype=torch.bfloat16), h, "banker")
    with pytest.raises(ValueError, match="bfloat16"):
        kernels.store_state(torch.empty(4, dtype=torch.float16), h, "truncate")
    fp32 = torch.empty(4)
    kernels.store_state(fp32, h * 1.1, "stochastic")  # fp32 store: a copy, nothing to round
    assert torch.equal(fp32, h * 1.1)


# ------------------------------------------------------------------------ GDN
def _gdn_case(state_dtype=torch.bfloat16, inter_dtype=torch.bfloat16):
    """Committed states [L, S, HV, K, V] and scratch [L, N+1, D, HV, K, V], both transposed
    views of [.., V, K] storage (npu layout), plus q, k, v, g, beta for N rows."""
    storage = torch.empty(L, S, HV, V, K, dtype=state_dtype)
    state_kv = storage.transpose(-1, -2)
    # States of norm ~5 per head, like decoded states (unit-variance values, decay <= 1).
    state_kv.copy_(bf16_grid((L, S, HV, K, V), 30, scale=0.3))
    state_kv[:, 0] = float("nan")  # the dummy: the padded row reads it, nothing else may
    inter_storage = torch.full((L, N + 1, D, HV, V, K), float("nan"), dtype=inter_dtype)
    inter_kv = inter_storage.transpose(-1, -2)
    qkv = torch.randn(L, N, D, C, generator=gen(31))
    q, k, v = kernels.split_qkv(qkv, HK, K, HV, V)
    a = torch.randn(L, N, D, HV, generator=gen(32)) * 0.5
    b = torch.randn(L, N, D, HV, generator=gen(33))
    # Per-head median decays from fast to very slow, as ci-small.
    A_log = torch.tensor([[math.log(-math.log(d) / math.log(2.0)) for d in (0.5, 0.9, 0.98, 0.995)]] * L)
    g, beta = kernels.gdn_gating(a, b, A_log, torch.zeros(L, HV))
    return state_kv, inter_kv, q, k, v, g, beta


def state_bound(t, h_norm, v_norm, u=U32):
    """:func:`conftest.gdn_state_bound` at this module's K."""
    return gdn_state_bound(t, K, h_norm, v_norm, u)


def _naive_rows(state_kv, q, k, v, g, beta, **kw):
    """naive.gdn_verify on the active (non-padded) rows: SLOTS[:-1]."""
    n = N - 1
    h0 = state_kv[:, SLOTS[:n]]
    return naive.gdn_verify(h0, q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], **kw)


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inter_dtype", [torch.float32, torch.bfloat16])
def test_gdn_verify_matches_float64(state_dtype, inter_dtype):
    state_kv, inter_kv, q, k, v, g, beta = _gdn_case(state_dtype, inter_dtype)
    state_before = state_kv.clone()
    out = kernels.gdn_verify(state_kv, torch.tensor(SLOTS), q, k, v, g, beta, inter_kv[:, :N])
    assert out.dtype == torch.float32 and out.shape == (L, N, D, HV, V)
    assert same_bits(state_kv, state_before)  # verify never writes the committed state
    assert torch.isnan(inter_kv[:, N]).all()  # the spare scratch row is untouched
    n = N - 1
    ref_inter, ref_out = _naive_rows(state_kv, q, k, v, g, beta)  # float64, kept state exact
    bound, out_bound = verify_bounds(ref_inter, v[:, :n])
    got = inter_kv[:, :n].double()
    if inter_dtype == torch.float32:
        assert ((got - ref_inter).norm(dim=(-1, -2)) <= bound).all()
    else:
        # Within one bf16 ulp of the float64 state rounded to bf16, and equal to it except
        # where a rounding boundary separates fp32 from float64 (<= 1%, see the docstring).
        ref_b = ref_inter.to(torch.bfloat16).double()
        diff = (got - ref_b).abs()
        assert (diff <= bf16_ulp(torch.maximum(got.abs(), ref_b.abs()))).all()
        assert (diff > 0).double().mean() < 0.01
    # Outputs use the fp32 state kept on chip, not the stored one: same bound either way.
    assert ((out[:, :n].double() - ref_out).norm(dim=-1) <= out_bound).all()
    assert torch.isnan(out[:, n:]).all()  # the padded row computed from the NaN dummy: visible


@pytest.mark.parametrize("rounding", ["truncate", "stochastic"])
def test_gdn_verify_store_rounding_modes(rounding):
    """Truncation stores trunc(h32) exactly; stochastic stores one of h32's two bf16
    neighbours, sometimes the far one; both relative to the same kernel's fp32 states."""
    state_kv, inter32, q, k, v, g, beta = _gdn_case(torch.bfloat16, torch.float32)
    _, inter16, *_ = _gdn_case(torch.bfloat16, torch.bfloat16)
    slots = torch.tensor(SLOTS)
    kernels.gdn_verify(state_kv, slots, q, k, v, g, beta, inter32[:, :N])
    kernels.gdn_verify(state_kv, slots, q, k, v, g, beta, inter16[:, :N], rounding=rounding, key=11)
    h32, got = inter32[:, : N - 1], inter16[:, : N - 1].double()
    trunc = _ref_round(h32, "truncate")
    if rounding == "truncate":
        assert torch.equal(got, trunc)
    else:
        away = torch.copysign(trunc.abs() + bf16_ulp(h32), trunc)
        assert ((got == trunc) | (got == away)).all()
        assert (got != h32.to(torch.bfloat16).double()).any()  # not RNE
        again = torch.empty_like(inter16)
        kernels.gdn_verify(state_kv, slots, q, k, v, g, beta, again[:, :N], rounding=rounding, key=11)
        assert same_bits(again[:, : N - 1], inter16[:, : N - 1])  # same key, same bits


def test_gdn_decode_rounds_after_every_token():
    """Sequential decode of a bf16 state: the state rounded to bf16 (RNE) after each token.
    Rows process 4, 2 and 0 tokens."""
    state_kv, _, q, k, v, g, beta = _gdn_case(torch.bfloat16)
    before = state_kv.clone()
    slots, num = [4, 1, 3], [D, 2, 0]
    kernels.gdn_decode(state_kv, torch.tensor(slots), q, k, v, g, beta, torch.tensor(num))
    ref_final, _ = naive.gdn_decode(before[:, slots], q, k, v, g, beta, num, torch.bfloat16)
    for n, s in enumerate(slots[:2]):
        got, ref = state_kv[:, s].double(), ref_final[:, n]
        # Each side rounds after every token; they can only part where fp32 and float64
        # straddle a bf16 rounding boundary (fraction ~3e-4 per token, <= 1% allowed;
        # skipping the per-token rounding moves most elements).
        assert (got != ref).double().mean() < 0.01
        # Rigorous norm bound: per token the fp32 error (state_bound) plus at most one bf16
        # ulp (<= 2^-7 relative) per element where the roundings part.
        h_norm = ref.norm(dim=(-1, -2))
        v_norm = v[:, n].double().norm(dim=-1).amax(1)
        tol = num[n] * (state_bound(1, h_norm, v_norm) + 2.0 ** -7 * h_norm)
        assert ((got - ref).norm(dim=(-1, -2)) <= tol).all()
    # A row with no tokens: identity tokens (decay 1, beta 0) are exact, bit-identical.
    assert same_bits(state_kv[:, 3], before[:, 3])
    others = [s for s in range(S) if s not in slots]
    assert same_bits(state_kv[:, others], before[:, others])


def test_gdn_decode_without_rounding_and_capture_match_float64():
    """fp32 state (nothing to round) and the float64 path the twin uses, with a capture of
    the state after a chosen token."""
    state_kv, _, q, k, v, g, beta = _gdn_case(torch.float32)
    num, capture = [D, 3, 0], [1, 2, -1]
    h0 = state_kv[:, SLOTS].clone()
    ref_final, _ = naive.gdn_decode(h0, q, k, v, g, beta, num, torch.float64)
    ref_cap = [naive.gdn_decode(h0, q, k, v, g, beta, [c + 1] * N, torch.float64)[0][:, n]
               for n, c in enumerate(capture)]
    for cd, u in ((torch.float32, U32), (torch.float64, U64)):
        st = state_kv.clone().to(cd)
        cap = torch.zeros(L, N, HV, K, V, dtype=cd)
        kernels.gdn_decode(st, torch.tensor(SLOTS), q, k, v, g, beta, torch.tensor(num),
                           compute_dtype=cd, captures=((capture, cap),))
        for n, s in enumerate(SLOTS[:-1]):
            ref = ref_final[:, n]
            tol = state_bound(num[n], ref.norm(dim=(-1, -2)), v[:, n].double().norm(dim=-1).amax(1), u)
            assert ((st[:, s].double() - ref).norm(dim=(-1, -2)) <= tol).all()
            rc = ref_cap[n]
            tol_c = state_bound(capture[n] + 1, rc.norm(dim=(-1, -2)), v[:, n].double().norm(dim=-1).amax(1), u)
            assert ((cap[:, n].double() - rc).norm(dim=(-1, -2)) <= tol_c).all()
        assert (cap[:, N - 1] == 0).all()  # capture -1: untouched


# ------------------------------------------------------------ conv rollback
def _conv_pool(layout: str):
    """bf16 conv states [L, S, W, C]: contiguous, a transposed view, or a channel slice."""
    vals = torch.arange(L * S * W * C, dtype=torch.float32).reshape(L, S, W, C) % 251
    if layout == "contiguous":
        conv = vals.to(torch.bfloat16)
    elif layout == "transposed":  # [L, S, C, W] storage
        conv = torch.zeros(L, S, C, W, dtype=torch.bfloat16).transpose(2, 3)
        conv.copy_(vals)
    else:  # every other channel of a wider buffer
        conv = torch.zeros(L, S, W, 2 * C, dtype=torch.bfloat16)[..., ::2]
        conv.copy_(vals)
    assert conv.is_contiguous() == (layout == "contiguous")
    conv[:, 0] = float("nan")  # dummy slot
    return conv


ROLLBACK_SLOTS = [3, 1, 5, 0]  # the last is a padded row on the dummy slot (step -1)
LAYOUTS = ["contiguous", "transposed", "channel_slice"]


def _check_rollback(kernel, layout, steps):
    conv = _conv_pool(layout)
    ref = conv.clone().contiguous()
    state = torch.tensor(ROLLBACK_SLOTS)
    step = torch.tensor(steps)
    out = kernel(conv, state, step, D)
    naive.conv_state_rollback(ref, state, step, D)
    return out is conv and same_bits(conv.contiguous(), ref), conv, ref


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("step", list(range(-1, D)))
def test_conv_state_rollback_matches_definition(layout, step):
    ok, conv, ref = _check_rollback(kernels.conv_state_rollback, layout, [step, step, step, -1])
    assert ok
    orig = _conv_pool(layout)
    if step in (-1, D - 1):  # nothing to shift
        assert same_bits(conv.contiguous(), orig.contiguous())
    else:  # the shift really happened (the test is not vacuous)
        assert not same_bits(conv.contiguous(), orig.contiguous())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_conv_state_rollback_mixed_steps_in_one_call(layout):
    # Different steps per row, and an out-of-range step D, which must be left alone.
    ok, conv, _ = _check_rollback(kernels.conv_state_rollback, layout, [0, 2, D, -1])
    assert ok
    assert same_bits(conv[:, 5], _conv_pool(layout)[:, 5])


@pytest.mark.parametrize("layout", ["transposed", "channel_slice"])
def test_rollback_on_a_contiguous_copy_is_caught(layout):
    """Negative control (sgl-kernel-npu #748): a rollback on a .contiguous() copy of a
    strided tensor is a silent no-op; the comparison above must see it."""
    def on_copy(conv, *args):
        kernels.conv_state_rollback(conv.contiguous(), *args)
        return conv
    ok, _, _ = _check_rollback(on_copy, layout, [0, 1, 2, -1])
    assert not ok


@pytest.mark.parametrize("step", list(range(D)))
def test_verify_then_rollback_leaves_the_window_ending_at_the_accepted_token(step):
    """The semantic pin (docs/semantics.md §3): after verify and a rollback to ``step``, the
    last Kc-1 rows are the inputs up to and including draft token ``step``."""
    conv, x, weight = _conv_case(strided=True)
    before = conv.clone()
    slots = torch.tensor(SLOTS[:2])
    kernels.conv_verify(conv, slots, x[:, :2], weight)
    kernels.conv_state_rollback(conv, slots, torch.tensor([step, step]), D)
    for n, s in enumerate(SLOTS[:2]):
        seq = torch.cat([before[:, s, W - (KC - 1):], x[:, n]], dim=1)  # [L, Kc-1+D, C]
        assert same_bits(conv[:, s, W - (KC - 1):], seq[:, step + 1: step + KC])


def test_conv_state_rollback_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"\[L, slots, W, C\]"):
        kernels.conv_state_rollback(torch.zeros(2, 3, 4), torch.tensor([0]), torch.tensor([0]), D)
    with pytest.raises(ValueError, match="equal length"):
        kernels.conv_state_rollback(torch.zeros(1, 2, W, 3), torch.tensor([0, 1]), torch.tensor([0]), D)


# ------------------------------------------------------ move_intermediate_cache
def _ssm_pair(ssm_layout: str, inter_layout: str, dtype=torch.bfloat16):
    """Committed [L, S, HV, V, K] and scratch [L, N+1, D, HV, V, K] as SGLang's pool hands
    them out: 'npu' = transposed view of [K, V] storage, 'contiguous' = dense [V, K]."""
    def make(shape_vk, layout, seed):
        vals = bf16_grid(shape_vk, seed)
        if layout == "npu":
            kv = torch.empty(shape_vk[:-2] + (K, V), dtype=dtype)
            t = kv.transpose(-1, -2)
            t.copy_(vals)
            return t
        return vals.to(dtype)
    ssm = make((L, S, HV, V, K), ssm_layout, 40)
    ssm[:, 0] = float("nan")
    inter = make((L, N + 1, D, HV, V, K), inter_layout, 41)
    return ssm, inter


MOVE_DST = [2, 5, 0, 3]  # row 2 is padded (dummy slot, step -1)
MOVE_STEPS = [3, 0, -1, 1]
MOVE_SRC = [0, 1, 2, 0]  # two rows may read the same scratch row


@pytest.mark.parametrize("ssm_layout, inter_layout", [
    ("npu", "npu"), ("contiguous", "npu"), ("npu", "contiguous"), ("contiguous", "contiguous")])
def test_move_intermediate_cache_matches_definition(ssm_layout, inter_layout):
    ssm, inter = _ssm_pair(ssm_layout, inter_layout)
    before = ssm.clone()
    ref = ssm.clone()
    args = (torch.tensor(MOVE_DST), torch.tensor(MOVE_SRC), torch.tensor(MOVE_STEPS))
    assert kernels.move_intermediate_cache(ssm, inter, *args) is ssm
    naive.move_intermediate_cache(ref, inter, *args)
    assert same_bits(ssm, ref)
    assert same_bits(ssm[:, 0], before[:, 0])  # -1 row: the dummy keeps its NaN bits
    for s in (1, 4):  # slots nobody names
        assert same_bits(ssm[:, s], before[:, s])
    for d, r, st in zip(MOVE_DST, MOVE_SRC, MOVE_STEPS):
        if st >= 0:
            assert torch.equal(ssm[:, d], inter[:, r, st])  # logical, whatever the strides


def test_a_raw_block_copy_across_layouts_is_caught():
    """Negative control (sgl-kernel-npu #748 class): copying raw [.., ., .] blocks between
    a transposed view and dense storage transposes every state; the comparison sees it."""
    ssm, inter = _ssm_pair("npu", "contiguous")
    raw = ssm.clone()
    storage = raw.transpose(-1, -2)  # [L, S, HV, K, V]: the memory order of the npu view
    assert storage.is_contiguous()
    for d, r, st in zip(MOVE_DST, MOVE_SRC, MOVE_STEPS):
        if st >= 0:  # the bytes of inter's dense [V, K] block land in ssm's [K, V] storage
            storage[:, d] = inter[:, r, st].reshape(L, HV, K, V)
    ref = ssm.clone()
    naive.move_intermediate_cache(ref, inter, *(torch.tensor(a) for a in (MOVE_DST, MOVE_SRC, MOVE_STEPS)))
    assert not same_bits(raw, ref)


def test_move_intermediate_cache_refuses_to_cast():
    ssm, _ = _ssm_pair("npu", "npu", torch.bfloat16)
    _, inter = _ssm_pair("npu", "npu", torch.float32)
    with pytest.raises(ValueError, match=r"does not cast.*bfloat16.*float32"):
        kernels.move_intermediate_cache(ssm, inter, torch.tensor([1]), torch.tensor([0]), torch.tensor([0]))


def test_move_intermediate_cache_rejects_bad_shapes():
    ssm, inter = _ssm_pair("npu", "npu")
    with pytest.raises(ValueError, match="state shapes differ"):
        kernels.move_intermediate_cache(ssm, inter[..., :4], torch.tensor([1]), torch.tensor([0]),
                                        torch.tensor([0]))
    with pytest.raises(ValueError, match="expects"):
        kernels.move_intermediate_cache(ssm[0], inter, torch.tensor([1]), torch.tensor([0]), torch.tensor([0]))


def test_stochastic_rounding_does_not_depend_on_kernel_chunking(monkeypatch):
    """The random bits hash the element's global index: a performance setting (how many layers
    a kernel call processes at once) must not change which way a value rounds."""
    from drift.sim import kernels as kmod
    from drift.config import preset
    from drift.simulate import Simulation

    def final_bits(chunk_bytes):
        monkeypatch.setattr(kmod, "STATE_CHUNK_BYTES", chunk_bytes)
        sim = Simulation(preset("ci-small", store_rounding="stochastic"), "sglang-0.5.23", check_untouched=False)
        sim.run(8)
        return sim.pool.temporal.clone().view(torch.int16)

    whole, per_layer = final_bits(4 << 20), final_bits(1)  # 1 byte: one layer per chunk
    assert torch.equal(whole, per_layer)
    # Negative control: a different step key does change the rounding.
    a = torch.full((4096,), 1.0 + 2.0**-10)
    assert not torch.equal(kmod.round_to(a, torch.bfloat16, "stochastic", key=1),
                           kmod.round_to(a, torch.bfloat16, "stochastic", key=2))
