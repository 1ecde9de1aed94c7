"""drift.sim.kernels: the vectorised kernels against their float64 naive definitions (drift.sim.naive).

Shapes are small but not degenerate: 2 layers, 3 batch rows (the last a padded row on the dummy
slot 0, whose NaN state must show in its outputs), D = S = 4 verify tokens, 2 key heads grouped
over 4 value heads, K = 16 != V = 8 (a K/V swap cannot hide), conv kernel 4. States are
``[.., V, K]`` blocks read by their raw meaning (drift.sim.pool.raw_state).

Tolerances (u = 2^-24, the fp32 unit roundoff; docs/semantics.md §5 for the op):

* The input stages (conv + SiLU, gating) are float64 rounded once (§10): bit-exact against the
  naive float64 loops rounded the same way. (Only a float64 result within a float64 ulp or two
  of an fp32 rounding boundary could part them: probability ~2^-28 per element.)
* What the op derives from its inputs in fp32 (:func:`kernels.op_inputs`) against the float64
  definition (naive.head_inputs, exp, sigmoid): q and k are ``x * rsqrt(sum x^2 + eps)``; the
  squares of bf16 values are exact in fp32, the K-term sum errs by <= (K-1) u relative (Higham
  gamma_K), rsqrt (a sqrt and a division) <= 2 u plus half the sum's error, the products
  <= 2 u: elementwise <= (K/2 + 4) u relative, so ||dq|| <= (K + 6) u ||q|| with a 2x margin
  (same for k). decay = exp(g): torch's fp32 exp is within 1 ulp (2 u relative). beta =
  sigmoid(b) = 1 / (1 + exp(-b)): exp 2 u, the add and the division u each: <= 4 u.
* One gated delta-rule token, per (layer, row, head), computed in fp32 on fp32 inputs: the dot
  product h k of length K errs by at most about K u ||h|| ||k|| (gamma_K), the decay, the
  subtraction, the beta product and the rank-one update add a few more u (||h|| + ||v||):
  (K + 6) u (||h|| + ||v||) in Frobenius norm (conftest.gdn_state_bound). The fp32 inputs
  add, through h' = a h - beta (a h k - v) k^T: |da| ||h|| + |dbeta| (||h|| + ||v||) +
  ||dk|| (2 ||h|| + ||v||) <= (2 + 4 + 2 (K + 6)) u (||h|| + ||v||) = (2K + 18) u (..).
  The map h -> a h (I - beta k k^T) has norm <= 1 (0 < a <= 1, 0 < beta < 1, ||k|| <= 1), so
  earlier errors do not grow: after t tokens the state errs by at most
  t (3K + 24) u max_t (||h_t|| + ||v_t||) (:func:`op_bounds`; max over the start state too).
* An output o = h q (||q|| <= K^-1/2) errs by ||q|| (state error + K u ||h||) + ||h|| ||dq||
  <= K^-1/2 (state error + (2K + 6) u ||h||); the op then casts it to bf16 (half a bf16 ulp:
  <= 2^-8 relative per element, 8 significant bits).
* A bf16 store (or output) of the fp32 value versus the float64 value rounded to bf16: the two
  pre-rounding values differ by the tiny bound above (~1e-6 relative), so the rounded values
  agree or differ by one bf16 ulp, the latter only where a rounding boundary falls between
  them: a fraction ~1e-6 / 2^-8 ~ 4e-4 of the elements at most. Measured on these cases (6
  seeds, 3 paths, both state dtypes): at most 0.012% of the states and 0.2% of the outputs (1 of
  512). We allow 1% for states and 2% for outputs (>= 10x the measured worst); truncation
  mismatches about half of them.
* The derived bounds are worst cases: the fp32 states measure at most 1.4% of theirs, the bf16
  outputs (dominated by the cast) 72%. A bf16-class input error (beta rounded to bf16 after
  the sigmoid, a mutant of drift's catalogue) exceeds the state bound
  (test_verify_regression_variants_differ_from_the_op).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from helpers import U32, U64, as_bits, bf16_ulp, gdn_state_bound, naive_of, rel_fro, same_bits, small_cfg
from drift.flows.copy_commit.rule import NpuRule
from drift.layouts import LAYOUTS
from drift.plug.mutants import MUTANTS
from drift.sim import kernels, naive, native
from drift.flows.copy_commit.backend import VerifyArgsBuilder
from drift.sim.kernels import VerifyArgs
from drift.sim.pool import StatePool, raw_state

F64, F32, BF16, I32 = torch.float64, torch.float32, torch.bfloat16, torch.int32
L, B, D, HK, HV, K, V, KC = 2, 3, 4, 2, 4, 16, 8, 4
C = 2 * HK * K + HV * V
W = (KC - 1) + (D - 1)
NSLOT = 6  # pool slots
SLOTS = [4, 1, 0]  # batch rows -> slots; the last row is a padded row on the dummy slot
ACTIVE = B - 1  # rows with a real (finite) committed state
DECAYS = (0.5, 0.9, 0.98, 0.995)  # per-head median decay per token, fast to very slow (as ci-small)
STATE_FRAC, OUT_FRAC = 0.01, 0.02  # rounding-boundary mismatches allowed (module docstring)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def bf16_grid(shape, seed, scale=1.0) -> torch.Tensor:
    """Float32 values on the bfloat16 grid (what a bf16 model feeds the kernels)."""
    return (torch.randn(shape, generator=gen(seed), dtype=F32) * scale).to(BF16).float()


def random_bits_(t: torch.Tensor, seed: int) -> torch.Tensor:
    """Fill t with random bit patterns (NaNs with payloads and infs included)."""
    b = as_bits(t)
    info = torch.iinfo(b.dtype)
    b.copy_(torch.randint(info.min, info.max, t.shape, generator=gen(seed), dtype=torch.int64).to(b.dtype))
    return t


# ----------------------------------------------------------------- input stages
def test_quantize_mix_rounds_to_fp32_then_to_bf16():
    # Double-rounding cases (tests/sim/test_naive.py): x above a bf16 tie by less than half an
    # fp32 ulp rounds to the tie in fp32, then to even in bf16.
    x = torch.tensor([1.0 + 2.0 ** -8 + 2.0 ** -30, -(1.0 + 2.0 ** -8 + 2.0 ** -30), 1.0 + 3 * 2.0 ** -9,
                      math.pi, -1e-3, 3e38 * 1.2], dtype=F64)
    got = kernels.quantize_mix(x)
    assert got.dtype == BF16
    want = [naive.quantize_mix(float(v)) for v in x]
    assert got.double().tolist() == want
    assert got[0].item() == 1.0 and got[2].item() == 1.0 + 2.0 ** -7
    assert math.isinf(got[5].item())  # beyond fp32's range: inf, as the two casts give
    # Negative control: a single rounding to nearest (independent float64 definition) differs.
    assert _ref_round(x[:1], "rne").item() == 1.0 + 2.0 ** -7


def _gating_inputs():
    a = torch.empty(L, B, D, HV, dtype=F32).uniform_(-8.0, 8.0, generator=gen(1))
    a[0, 0, 0] = torch.tensor([19.0, 20.0, 20.5, 25.0])  # both sides of the softplus threshold 20
    A_log = torch.randn(L, HV, generator=gen(3), dtype=F32)
    dt_bias = torch.randn(L, HV, generator=gen(4), dtype=F32) * 0.5
    dt_bias[0, :] = 0.0  # the threshold values reach softplus unchanged
    return a, A_log, dt_bias


def test_gdn_gating_is_the_float64_definition_rounded_to_fp32():
    a, A_log, dt_bias = _gating_inputs()
    g = kernels.gdn_gating(a, A_log, dt_bias)
    assert g.dtype == F32 and g.shape == a.shape
    ref = torch.empty(a.shape, dtype=F64)
    for idx in torch.cartesian_prod(*(torch.arange(n) for n in a.shape)).tolist():
        l, _, _, h = idx
        ref[tuple(idx)] = naive.gating(float(a[tuple(idx)]), float(A_log[l, h]), float(dt_bias[l, h]))
    assert same_bits(g, ref.to(F32))  # float64, rounded once (docs/semantics.md §10)
    # Above the threshold softplus is the identity: g = -exp(A_log) * z exactly (before rounding).
    assert g[0, 0, 0, 3].item() == torch.tensor(-math.exp(float(A_log[0, 3])) * 25.0, dtype=F64).float().item()
    # Negative control: the same formula evaluated in fp32 (a fused fp32 kernel) rounds some
    # elements differently; the bit comparison sees it.
    z = a + dt_bias[:, None, None, :]
    g32 = -torch.exp(A_log)[:, None, None, :] * torch.where(z > 20.0, z, torch.log1p(torch.exp(z.clamp(max=20.0))))
    assert not same_bits(g32, g)


def _conv_case(layout: str):
    """A bf16 conv pool [L, NSLOT, W, C]: contiguous, or channel-major (a transposed view of
    [L, NSLOT, C, W] storage, drift's 'transposed' conv layout)."""
    vals = bf16_grid((L, NSLOT, W, C), 10)
    if layout == "channel-major":
        conv = torch.empty(L, NSLOT, C, W, dtype=BF16).transpose(2, 3)
        conv.copy_(vals)
        assert not conv.is_contiguous()
    else:
        conv = vals.to(BF16)
    x = bf16_grid((L, B, D, C), 11).to(BF16)
    # Depthwise weights on the bf16 grid like drift.sim.stream's, unit output variance.
    weight = bf16_grid((L, C, KC), 12, scale=KC ** -0.5)
    return conv, x, weight


def test_conv_mix_is_the_float64_definition():
    conv, x, weight = _conv_case("contiguous")
    window = conv[:, SLOTS, W - (KC - 1):]
    got = kernels.conv_mix(window, x, weight)
    assert got.dtype == BF16 and got.shape == (L, B, D, C)
    ref = naive.conv_mix(window, x, weight)  # float64 holding the quantised values
    assert torch.equal(got.double(), ref)
    # The values are not trivially equal for any input: a window one row off changes them.
    assert not torch.equal(kernels.conv_mix(conv[:, SLOTS, W - KC:W - 1], x, weight).double(), ref)


@pytest.mark.parametrize("layout", ["contiguous", "channel-major"])
def test_conv_verify_matches_naive(layout):
    conv, x, weight = _conv_case(layout)
    before = conv.clone()
    slots = torch.tensor(SLOTS)
    conv_naive = conv.clone().contiguous()
    out = kernels.conv_verify(conv, slots, x, weight)
    ref = naive.conv_verify(conv_naive, SLOTS, x, weight)  # float64 holding bf16 values
    assert out.dtype == BF16 and out.shape == (L, B, D, C)
    assert torch.equal(out.double(), ref)  # same float64 arithmetic, same two roundings
    # Rolled buffers are pure data movement: bit-identical to the naive loop, and equal to the
    # definition [old[D:], x_0 .. x_{D-1}] (docs/semantics.md §3).
    assert same_bits(conv.contiguous(), conv_naive)
    for n, s in enumerate(SLOTS):
        assert same_bits(conv[:, s], torch.cat([before[:, s, D:], x[:, n]], dim=1))
    untouched = [s for s in range(NSLOT) if s not in SLOTS]
    assert same_bits(conv[:, untouched], before[:, untouched])
    assert conv.is_contiguous() == (layout == "contiguous")  # written in place, strides kept


@pytest.mark.parametrize("dtype, u", [(F32, U32), (F64, U64)])
def test_op_inputs_match_the_float64_head_inputs(dtype, u):
    mix = bf16_grid((L, B, D, C), 13).to(BF16)
    beta_logit = bf16_grid((L, B, D, HV), 14, scale=2.0).to(BF16)
    g = kernels.gdn_gating(torch.randn(L, B, D, HV, generator=gen(15)), torch.randn(L, HV, generator=gen(16)),
                           torch.zeros(L, HV))
    scale = K ** -0.5
    q, k, v, decay, beta = kernels.op_inputs(mix, beta_logit, g, HK, K, HV, V, scale, dtype)
    assert q.shape == k.shape == (L, B, D, HV, K) and v.shape == (L, B, D, HV, V)
    assert all(t.dtype == dtype for t in (q, k, v, decay, beta)) and decay.shape == beta.shape == (L, B, D, HV)
    rq, rk, rv = (torch.empty(L, B, D, HV, n, dtype=F64) for n in (K, K, V))
    for l in range(L):
        for n in range(B):
            for t in range(D):
                rq[l, n, t], rk[l, n, t], rv[l, n, t] = naive.head_inputs(mix[l, n, t], HK, K, HV, V, scale)
    ref_decay = g.double().exp()  # exact math: float64 exp of the fp32 g
    ref_beta = torch.tensor([naive.sigmoid(float(b)) for b in beta_logit.flatten()], dtype=F64).view(beta.shape)
    # Module docstring: ||dq|| <= (K + 6) u ||q||, decay <= 2 u, beta <= 4 u relative. In float64
    # the op's rsqrt and the definition's division differ by the same few-u terms at u = 2^-53.
    assert (rel_fro(q, rq, -1) <= (K + 6) * u).all() and (rel_fro(k, rk, -1) <= (K + 6) * u).all()
    assert torch.equal(v.double(), rv)  # a reshape of bf16 values: exact in any dtype
    assert ((decay.double() - ref_decay).abs() <= 2 * u * ref_decay).all()
    assert ((beta.double() - ref_beta).abs() <= 4 * u * ref_beta).all()
    if dtype == F32:  # negative control: the same bound at float64's u is far too tight for fp32
        assert not (rel_fro(q, rq, -1) <= (K + 6) * U64).all()


def test_scratch_blocks_are_flat_row_step_blocks():
    inter = torch.arange(L * (B + 1) * D * HV * V * K, dtype=F32).view(L, B + 1, D, HV, V, K)
    blocks = kernels.scratch_blocks(inter)
    assert blocks.shape == (L, (B + 1) * D, HV, V, K) and blocks.data_ptr() == inter.data_ptr()
    for r in range(B + 1):
        for s in range(D):
            assert torch.equal(blocks[:, r * D + s], inter[:, r, s])
    # A transposed view is read raw; a scratch whose rows and steps are not one run is refused.
    tr = inter.view(L, B + 1, D, HV, K, V).transpose(-1, -2)  # the same memory, [K, V] storage
    assert torch.equal(kernels.scratch_blocks(tr), blocks)  # raw: the memory read as [V, K] blocks
    assert not torch.equal(kernels.scratch_blocks(tr)[:, 0], tr[:, 0, 0])  # not the logical view
    with pytest.raises(ValueError, match="flat index"):
        kernels.scratch_blocks(torch.zeros(L, D, B + 1, HV, V, K).transpose(1, 2))


# ------------------------------------------------------------------ state stores
def _grid_values(n: int, seed: int) -> torch.Tensor:
    """fp32 values in the normal range, both signs, off the bf16 grid, plus exact bf16
    values and exact ties (a bf16 value plus half an ulp)."""
    g = gen(seed)
    x = (torch.rand(n, generator=g) + 1.0) * torch.exp2(torch.randint(-20, 20, (n,), generator=g).float())
    x = torch.where(torch.rand(n, generator=g) < 0.5, -x, x)
    on_grid = x[: n // 8].to(BF16).float()
    ties = (on_grid.double() + 0.5 * bf16_ulp(on_grid)).float()  # exact in fp32 (9 bits)
    return torch.cat([x, on_grid, ties])


def _ref_round(x: torch.Tensor, mode: str) -> torch.Tensor:
    """Independent float64 definition of rounding values to bf16 (one rounding)."""
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
    dst = torch.empty(x.shape, dtype=BF16)
    kernels.store_state(dst, x, mode)
    assert torch.equal(dst.double(), _ref_round(x, mode))
    if mode == "rne":
        assert same_bits(dst, x.to(BF16))  # RNE is exactly the cast
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
    h = torch.full((n,), x, dtype=F32)
    dst = torch.empty(n, dtype=BF16)
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
    per_key = torch.stack([kernels.round_to(h[:1], BF16, "stochastic", key) for key in range(4096)])
    sigma_k = ulp * math.sqrt(frac * (1 - frac) / 4096)
    assert abs(per_key.double().mean().item() - x) <= 5 * sigma_k + ulp * 2.0 ** -16
    # It differs from RNE (which always picks the nearer neighbour).
    assert (dst != h.to(BF16)).any()


def test_stochastic_rounding_is_deterministic_for_a_key_and_keeps_grid_values():
    x = _grid_values(4096, 21)
    a, b, c = (torch.empty(x.shape, dtype=BF16) for _ in range(3))
    kernels.store_state(a, x, "stochastic", key=3)
    kernels.store_state(b, x, "stochastic", key=3)
    kernels.store_state(c, x, "stochastic", key=4)
    assert same_bits(a, b)
    assert not same_bits(a, c)
    grid = x.to(BF16).float()
    kernels.store_state(a, grid, "stochastic", key=5)
    assert same_bits(a, grid.to(BF16))  # nothing to round: exact


def test_store_rejects_unknown_rounding_and_non_bf16_targets():
    h = torch.ones(4)
    with pytest.raises(ValueError, match="not known"):
        kernels.store_state(torch.empty(4, dtype=BF16), h, "banker")
    with pytest.raises(ValueError, match="bfloat16"):
        kernels.store_state(torch.empty(4, dtype=torch.float16), h, "truncate")
    fp32 = torch.empty(4)
    kernels.store_state(fp32, h * 1.1, "stochastic")  # fp32 store: a copy, nothing to round
    assert torch.equal(fp32, h * 1.1)


# ------------------------------------------------------------------ the verify op
def a_log_for(decays=DECAYS, layers=L) -> torch.Tensor:
    """A_log giving each head the median decay: with a = dt_bias = 0, softplus = ln 2 and
    decay = exp(-exp(A_log) ln 2) (drift.sim.stream)."""
    return torch.tensor([[math.log(-math.log(d) / math.log(2.0)) for d in decays]] * layers, dtype=F32)


def op_case(seed: int = 0, rec_dtype=BF16, scratch_dtype=BF16, slots=SLOTS, rounding="rne", key=0) -> VerifyArgs:
    """VerifyArgs of SGLang's graph-mode form (num_accepted 1, ssm_state_indices arange(B*D)):
    committed states [L, NSLOT, HV, V, K] of norm ~3.4 per head (like decoded states), slot 0 the
    NaN dummy; scratch [L, B+1, D, HV, V, K] with finite values (rows a test lets start there
    read them) and the NaN spare row; bf16 mix and beta logits; fp32 g from the gating stage."""
    nb = len(slots)
    rec = bf16_grid((L, NSLOT, HV, V, K), seed + 1, scale=0.3).to(rec_dtype)
    rec[:, 0] = float("nan")
    scratch = bf16_grid((L, nb + 1, D, HV, V, K), seed + 2, scale=0.3).to(scratch_dtype)
    scratch[:, nb] = float("nan")
    mix = bf16_grid((L, nb, D, C), seed + 3).to(BF16)
    beta = bf16_grid((L, nb, D, HV), seed + 4).to(BF16)
    a = torch.randn(L, nb, D, HV, generator=gen(seed + 5), dtype=F32) * 0.5
    g = kernels.gdn_gating(a, a_log_for(), torch.zeros(L, HV))
    return VerifyArgs(mix, beta, g, rec, scratch, torch.tensor(slots, dtype=I32),
                      torch.arange(nb * D, dtype=I32).view(nb, D), torch.ones(nb, dtype=I32),
                      torch.full((nb,), D, dtype=I32), HK, HV, K ** -0.5, rounding, key, rule=NpuRule())


def clone_args(args: VerifyArgs, **changes) -> VerifyArgs:
    """A copy with fresh state tensors (same strides), so runs do not share scratch."""
    def fresh(t):
        out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
        out.copy_(t)
        return out
    changes.setdefault("recurrent_state", fresh(args.recurrent_state))
    changes.setdefault("intermediate_state", fresh(args.intermediate_state))
    return replace(args, **changes)


PATHS = ["torch", "native", "device"]


def run_op(path: str, monkeypatch, args: VerifyArgs, **kw) -> torch.Tensor:
    """The op through one path: 'torch' (torch ops, host indices), 'native' (the C kernel; it
    must really run) or 'device' (torch ops with the device path's gathers, HOST_INDEX_PATHS off)."""
    monkeypatch.setattr(kernels, "USE_NATIVE", path == "native")
    monkeypatch.setattr(kernels, "HOST_INDEX_PATHS", path != "device")
    calls = []
    real = native.recurrent_gated_delta_rule
    monkeypatch.setattr(native, "recurrent_gated_delta_rule", lambda *a: (calls.append(1), real(*a))[1])
    if path == "native" and not native.enabled():
        pytest.skip("DRIFT_NATIVE=0 turns the native kernel off")
    out = kernels.recurrent_gated_delta_rule(args, **kw)
    assert bool(calls) == (path == "native"), (path, native.status())  # the path asked for ran
    monkeypatch.setattr(native, "recurrent_gated_delta_rule", real)
    return out


def start_of(args: VerifyArgs, b: int) -> tuple[str, int]:
    """Where row b starts by docs/semantics.md §6, worked out here: ('committed', slot) or ('scratch', i)."""
    i = int(args.ssm_state_indices[b, int(args.num_accepted_tokens[b]) - 1])
    return ("committed", int(args.cache_indices[b])) if i % args.mix_qkv.shape[2] == 0 else ("scratch", i)


def block(args: VerifyArgs, where: tuple[str, int]) -> torch.Tensor:
    """The raw [L, HV, V, K] block ``where`` names, float64."""
    kind, i = where
    src = raw_state(args.recurrent_state) if kind == "committed" else kernels.scratch_blocks(args.intermediate_state)
    return src[:, i].to(F64)


def chain(args: VerifyArgs, b: int, h0: torch.Tensor):
    """Row b's D tokens from the float64 start state h0 [L, HV, V, K], written out with the naive
    per-head pieces (naive.head_inputs, exp, naive.sigmoid, naive.gdn_token): (states after each
    token [L, D, HV, V, K], outputs [L, D, HV, V]), float64."""
    states = torch.empty(L, D, HV, V, K, dtype=F64)
    outs = torch.empty(L, D, HV, V, dtype=F64)
    for l in range(L):
        for hd in range(HV):
            h = h0[l, hd]
            for t in range(D):
                q, k, v = naive.head_inputs(args.mix_qkv[l, b, t], HK, K, HV, V, args.scale)
                decay = math.exp(float(args.g[l, b, t, hd]))
                beta = naive.sigmoid(float(args.beta[l, b, t, hd]))
                h, o = naive.gdn_token(h, q[hd], k[hd], v[hd], decay, beta)
                states[l, t, hd], outs[l, t, hd] = h, o
    return states, outs


def reference(args: VerifyArgs):
    """The copy-commit kind's naive reference (its rule in float64 loops) on copies of the arguments'
    states: (outputs [L, B, D, HV, V], states after each token [L, B, D, HV, V, K], start states
    [L, B, HV, V, K])."""
    start = torch.stack([block(args, start_of(args, b)) for b in range(args.mix_qkv.shape[1])], 1)
    out, blocks = naive_of(args)
    states = blocks[:, args.ssm_state_indices.long()]  # [L, B, D, HV, V, K]
    return out, states, start


def op_values(args: VerifyArgs) -> torch.Tensor:
    """v [L, B, D, HV, V] float64 (exact: a reshape of the bf16 mix)."""
    Lx, Bx, Dx, HVx, Vx, Kx = args.dims
    return args.mix_qkv[..., 2 * args.nk * Kx:].double().view(Lx, Bx, Dx, HVx, Vx)


def op_bounds(ref_states: torch.Tensor, h0: torch.Tensor, v: torch.Tensor, u: float = U32):
    """Frobenius bounds of the op's state after each token ``[L, n, D, HV]`` and of its outputs
    before the bf16 cast, against the float64 definition (module docstring):
    t (K + 6) u (||h|| + ||v||) for the recurrence (conftest.gdn_state_bound) plus
    t (2K + 18) u (||h|| + ||v||) for the fp32 inputs; outputs K^-1/2 (state + (2K + 6) u ||h||).
    ||h||: max over the start state and the states after each token; ||v||: max over tokens.
    K is the states' last dim; the op's scale is K^-1/2."""
    K = ref_states.shape[-1]
    h_norm = torch.maximum(h0.norm(dim=(-1, -2))[:, :, None], ref_states.norm(dim=(-1, -2)).amax(2, keepdim=True))
    v_norm = v.norm(dim=-1).amax(2, keepdim=True)
    t = torch.arange(1, ref_states.shape[2] + 1, dtype=F64)[None, None, :, None]
    state = gdn_state_bound(t, K, h_norm, v_norm, u) + t * (2 * K + 18) * u * (h_norm + v_norm)
    return state, K ** -0.5 * (state + (2 * K + 6) * u * h_norm)


def assert_close_to_float64(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, frac: float,
                            what: str) -> None:
    """got (fp32 or bf16) against the float64 ref ``[..., X, Y]`` / ``[..., X]`` with per-block
    Frobenius bound ``bound`` (one fewer trailing dim for vectors). fp32: the norm bound. bf16:
    within one bf16 ulp plus the bound of ref rounded to bf16 elementwise, equal to it but for
    rounding boundaries (fraction <= frac), and the norm bound plus half a bf16 ulp (<= 2^-8
    relative) per element."""
    dims = (-1, -2) if ref.ndim == bound.ndim + 2 else (-1,)
    pad = (None,) * len(dims)
    err = (got.double() - ref).norm(dim=dims)
    if got.dtype == F32:
        assert (err <= bound).all(), f"{what}: error {(err / bound).max():.3g} x the bound"
        return
    assert got.dtype == BF16
    ref_b = ref.to(BF16).double()
    diff = (got.double() - ref_b).abs()
    assert (diff <= bf16_ulp(torch.maximum(got.double().abs(), ref_b.abs())) + bound[(...,) + pad]).all(), what
    mismatch = (diff > 0).double().mean().item()
    assert mismatch <= frac, f"{what}: {mismatch:.3%} of the elements off the rounded float64 value"
    norm_ref = ref.norm(dim=dims)
    assert (err <= bound + 2.0 ** -8 * (norm_ref + bound)).all(), what


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rec_dtype", [BF16, F32], ids=["rec-bf16", "rec-fp32"])
@pytest.mark.parametrize("scratch_dtype", [F32, BF16], ids=["scratch-fp32", "scratch-bf16"])
def test_verify_matches_float64(monkeypatch, path, rec_dtype, scratch_dtype):
    args = op_case(rec_dtype=rec_dtype, scratch_dtype=scratch_dtype)
    rec_before = args.recurrent_state.clone()
    spare_before = args.intermediate_state[:, B].clone()
    ref_out, ref_states, h0 = reference(args)
    out = run_op(path, monkeypatch, args)
    assert out.dtype == BF16 and out.shape == (L, B, D, HV, V)
    assert same_bits(args.recurrent_state, rec_before)  # never writes the committed states
    assert same_bits(args.intermediate_state[:, B], spare_before)  # nor the spare scratch row
    n = ACTIVE
    state_b, out_b = op_bounds(ref_states[:, :n], h0[:, :n], op_values(args)[:, :n])
    got = kernels.scratch_blocks(args.intermediate_state)[:, args.ssm_state_indices[:n].long()]
    assert_close_to_float64(got, ref_states[:, :n], state_b, STATE_FRAC, "states")
    assert_close_to_float64(out[:, :n], ref_out[:, :n], out_b, OUT_FRAC, "outputs")
    # The padded row computed from the NaN dummy: visible in its outputs and scratch blocks.
    assert torch.isnan(out[:, n:]).all() and torch.isnan(args.intermediate_state[:, n:B]).all()


def test_verify_in_float64_is_the_definition(monkeypatch):
    """compute_dtype float64 (the torch path; the C kernel is fp32 only) against the naive loops:
    the op's bound at u = 2^-53, with fp32 scratch the store then rounds to fp32."""
    args = op_case(scratch_dtype=F32)
    ref_out, ref_states, h0 = reference(args)
    monkeypatch.setattr(kernels, "USE_NATIVE", True)  # uses_native declines float64 itself
    assert not kernels.uses_native(args, F64)
    out = kernels.recurrent_gated_delta_rule(args, compute_dtype=F64)
    assert out.dtype == BF16
    n = ACTIVE
    state_b, _ = op_bounds(ref_states[:, :n], h0[:, :n], op_values(args)[:, :n], U64)
    got = kernels.scratch_blocks(args.intermediate_state)[:, args.ssm_state_indices[:n].long()].double()
    # The fp32 store adds half an fp32 ulp per element: <= u32 ||h|| in norm.
    err = (got - ref_states[:, :n]).norm(dim=(-1, -2))
    assert (err <= state_b + U32 * ref_states[:, :n].norm(dim=(-1, -2))).all()
    assert torch.equal(out[:, :n], ref_out[:, :n].to(BF16))  # the float64 outputs, cast once
    # Negative control: the fp32 op is not that close (its error is ~1e-7, not ~1e-16 + store).
    args32 = op_case(scratch_dtype=F32)
    kernels.recurrent_gated_delta_rule(args32)
    got32 = kernels.scratch_blocks(args32.intermediate_state)[:, args32.ssm_state_indices[:n].long()].double()
    assert not torch.equal(got32, got)


# State flow (docs/semantics.md §6) with 4 rows and per-block sentinels: committed slot s holds
# random values + s / 4, scratch block i random values - (i + 1) / 8; every candidate start differs.
FLOW_SLOTS = [4, 1, 3, 5]
FLOW_IDX = [[0, 1, 2, 3],  # num_accepted 1: i = 0, aligned -> committed slot 4 (SGLang's form)
            [4, 5, 6, 7],  # num_accepted 3: i = 6 -> scratch block 6 (then overwrites block 6 at t = 2)
            [9, 8, 10, 11],  # num_accepted 2: i = 8, 8 % 4 == 0 -> committed slot 3 though num_accepted > 1
            [13, 12, 14, 15]]  # num_accepted 1: i = 13, not aligned -> scratch block 13, not committed
FLOW_ACC = [1, 3, 2, 1]
FLOW_START = [("committed", 4), ("scratch", 6), ("committed", 3), ("scratch", 13)]


def flow_case(seed: int = 40) -> VerifyArgs:
    nb = len(FLOW_SLOTS)
    args = op_case(seed, slots=FLOW_SLOTS)
    rec = random_bits_(torch.empty(L, NSLOT, HV, V, K, dtype=BF16), seed)  # slots nobody reads: any bits
    scratch = random_bits_(torch.empty(L, nb + 1, D, HV, V, K, dtype=BF16), seed + 1)
    blocks = kernels.scratch_blocks(scratch)
    for s in set(FLOW_SLOTS):
        rec[:, s] = bf16_grid((L, HV, V, K), seed + 10 + s, scale=0.3) + s / 4
    for i in (0, 4, 6, 8, 9, 13):  # the blocks a row starts from, or could wrongly: finite
        blocks[:, i] = bf16_grid((L, HV, V, K), seed + 20 + i, scale=0.3) - (i + 1) / 8
    idx = torch.tensor(FLOW_IDX, dtype=I32)
    return clone_args(args, recurrent_state=rec, intermediate_state=scratch, ssm_state_indices=idx,
                      num_accepted_tokens=torch.tensor(FLOW_ACC, dtype=I32))


@pytest.mark.parametrize("path", PATHS)
def test_verify_reads_where_the_indices_say_and_writes_only_the_named_blocks(monkeypatch, path):
    args = flow_case()
    assert [start_of(args, b) for b in range(4)] == FLOW_START  # the case is what it claims
    starts = {b: block(args, FLOW_START[b]) for b in range(4)}
    rec_before = as_bits(args.recurrent_state).clone()
    scratch_before = as_bits(kernels.scratch_blocks(args.intermediate_state)).clone()
    wrong = {  # per row, the other places it could have started from
        b: [("committed", FLOW_SLOTS[b]), ("scratch", FLOW_IDX[b][FLOW_ACC[b] - 1]), ("scratch", FLOW_IDX[b][0])]
        for b in range(4)}
    wrong_blocks = {b: [block(args, w) for w in wrong[b] if w != FLOW_START[b]] for b in range(4)}
    assert all(wrong_blocks.values()) and all(torch.isfinite(w).all() for ws in wrong_blocks.values() for w in ws)
    out = run_op(path, monkeypatch, args)
    blocks = kernels.scratch_blocks(args.intermediate_state)
    for b in range(4):
        ref_states, ref_out = chain(args, b, starts[b])
        state_b, out_b = op_bounds(ref_states[:, None], starts[b][:, None], op_values(args)[:, b:b + 1])
        got = blocks[:, FLOW_IDX[b]][:, None]
        assert_close_to_float64(got, ref_states[:, None], state_b, STATE_FRAC, f"row {b} states")
        assert_close_to_float64(out[:, b:b + 1], ref_out[:, None], out_b, OUT_FRAC, f"row {b} outputs")
        for h_wrong in wrong_blocks[b]:  # negative control: any other start is far outside the bound
            alt, _ = chain(args, b, h_wrong)
            assert ((got.double() - alt[:, None]).norm(dim=(-1, -2)) > 10 * state_b).any(), b
    # Only the named blocks were written (every one of them), the committed states never.
    named = sorted(i for row in FLOW_IDX for i in row)
    others = [i for i in range(blocks.shape[1]) if i not in named]
    assert torch.equal(as_bits(blocks[:, others]), scratch_before[:, others])
    assert (as_bits(blocks[:, named]) != scratch_before[:, named]).flatten(2).any(-1).all()
    assert torch.equal(as_bits(args.recurrent_state), rec_before)


def test_verify_runs_every_token_of_a_row():
    args = op_case()
    args.actual_seq_lengths[0] = D - 1
    with pytest.raises(ValueError, match="actual_seq_lengths"):
        kernels.recurrent_gated_delta_rule(args)


@pytest.mark.parametrize("rounding", ["rne", "truncate", "stochastic"])
def test_verify_store_rounding_modes(monkeypatch, rounding):
    """The stored state is round(h32) of the op's own fp32 state: rne the torch cast, truncation
    toward zero, stochastic one of the two bf16 neighbours (sometimes the far one, reproducible per
    key). Outputs use the fp32 state and do not depend on the rounding. The torch path throughout:
    the C kernel sums in another order, so its h32 is not the torch path's bit for bit."""
    monkeypatch.setattr(kernels, "USE_NATIVE", False)
    a32 = op_case(scratch_dtype=F32)
    out32 = kernels.recurrent_gated_delta_rule(a32)
    a16 = op_case(scratch_dtype=BF16, rounding=rounding, key=11)
    out16 = kernels.recurrent_gated_delta_rule(a16)
    n, idx = ACTIVE, a32.ssm_state_indices[:ACTIVE].long()
    h32 = kernels.scratch_blocks(a32.intermediate_state)[:, idx]
    got = kernels.scratch_blocks(a16.intermediate_state)[:, idx]
    assert same_bits(out16[:, :n], out32[:, :n])
    trunc = _ref_round(h32, "truncate")
    if rounding == "rne":
        assert same_bits(got, h32.to(BF16))
    elif rounding == "truncate":
        assert torch.equal(got.double(), trunc)
        assert not same_bits(got, h32.to(BF16))  # not RNE
    else:
        away = torch.copysign(trunc.abs() + bf16_ulp(h32), trunc)
        assert ((got.double() == trunc) | (got.double() == away)).all()
        assert not same_bits(got, h32.to(BF16)) and not torch.equal(got.double(), trunc)
        again = op_case(scratch_dtype=BF16, rounding=rounding, key=11)
        kernels.recurrent_gated_delta_rule(again)
        assert same_bits(kernels.scratch_blocks(again.intermediate_state)[:, idx], got)  # same key, same bits
        other = op_case(scratch_dtype=BF16, rounding=rounding, key=12)
        kernels.recurrent_gated_delta_rule(other)
        assert not same_bits(kernels.scratch_blocks(other.intermediate_state)[:, idx], got)


def test_verify_regression_variants_differ_from_the_op(monkeypatch):
    """The mutant catalogue's precision regressions (drift.plug.mutants) must be visible:
    beta rounded to bf16 after the sigmoid leaves the fp32 bound; keeping the running state in
    bf16 between tokens changes tokens 1.. but not token 0; with an fp32 scratch it is a no-op."""
    monkeypatch.setattr(kernels, "USE_NATIVE", False)
    n = ACTIVE
    args = op_case(scratch_dtype=F32)
    _, ref_states, h0 = reference(args)
    state_b, _ = op_bounds(ref_states[:, :n], h0[:, :n], op_values(args)[:, :n])
    idx = args.ssm_state_indices[:n].long()

    def states(a):
        return kernels.scratch_blocks(a.intermediate_state)[:, idx]

    good = clone_args(args)
    out_good = kernels.recurrent_gated_delta_rule(good)
    assert ((states(good).double() - ref_states[:, :n]).norm(dim=(-1, -2)) <= state_b).all()
    bad = clone_args(args)
    out_bad = MUTANTS["beta_bf16"].fn(bad)
    assert not same_bits(out_bad, out_good)
    assert ((states(bad).double() - ref_states[:, :n]).norm(dim=(-1, -2)) > state_b).any()
    # fp32 scratch: nothing to round between tokens.
    ret = clone_args(args)
    assert same_bits(MUTANTS["round_every_token"].fn(ret), out_good)
    assert same_bits(states(ret), states(good))
    # bf16 scratch: token 0 is the same; later tokens start from a rounded state.
    a16 = op_case(scratch_dtype=BF16)
    g16, r16 = clone_args(a16), clone_args(a16)
    o_g = kernels.recurrent_gated_delta_rule(g16)
    o_r = MUTANTS["round_every_token"].fn(r16)
    assert same_bits(o_g[:, :n, 0], o_r[:, :n, 0]) and not same_bits(o_g[:, :n, 1:], o_r[:, :n, 1:])
    s_g, s_r = states(g16), states(r16)
    assert same_bits(s_g[:, :, 0], s_r[:, :, 0]) and not same_bits(s_g[:, :, 1:], s_r[:, :, 1:])


@pytest.mark.parametrize("rounding", ["rne", "stochastic"])
def test_rounding_every_token_is_sequential_decode(rounding):
    """The round_every_token mutant (one-token calls of the op) computes what sequential decode
    (gdn_decode) does from the same start: the state rounded to the store dtype after every token,
    each store keyed by its token (kernels.store_key), the outputs of the unrounded state. Rows
    start where the indices say (flow_case: committed slots and scratch blocks), so the check also
    covers where the mutant reads its first state."""
    args = flow_case()
    args = replace(args, rounding=rounding, key=7)
    n = len(FLOW_SLOTS)
    h0 = torch.stack([block(args, start_of(args, b)) for b in range(n)], 1)  # [L, n, HV, V, K]
    q, k, v, decay, beta = args.inputs()
    blocks_dtype = kernels.scratch_blocks(args.intermediate_state).dtype
    caps = [([t] * n, torch.zeros(h0.shape, dtype=blocks_dtype)) for t in range(D)]
    seq_out = kernels.gdn_decode(h0.to(blocks_dtype).clone(), torch.arange(n), q, k, v, decay, beta,
                                 torch.full((n,), D), rounding, args.key, captures=caps)
    got = clone_args(args)
    out = MUTANTS["round_every_token"].fn(got)
    assert same_bits(out, seq_out.to(BF16))
    written = kernels.scratch_blocks(got.intermediate_state)
    for t, (_, cap) in enumerate(caps):
        assert same_bits(written[:, args.ssm_state_indices[:, t].long()], cap)
    # Negative control: the op itself keeps the running state in fp32, which differs after token 0.
    op = clone_args(args)
    assert not same_bits(kernels.recurrent_gated_delta_rule(op), seq_out.to(BF16))


LAYOUT_CFG = dict(num_layers=2, head_k_dim=16, head_v_dim=8, flow="npu-accepted")


def _layout_run(layout: str, monkeypatch, path: str, logical: bool = False):
    """The op on a StatePool of ``layout`` whose raw contents are the same for every layout, with
    VerifyArgsBuilder's arguments (accepted flow: rows 0, 2, 3 continue from scratch blocks).
    Returns (outputs, raw scratch, raw committed states)."""
    cfg = small_cfg(layout=layout, **LAYOUT_CFG)
    pool = StatePool(cfg, torch.device("cpu"))
    Lc, S, HVc, Vc, Kc = pool.states.shape
    N, Dc = cfg.num_rows, cfg.num_draft_tokens
    pool.states.copy_(bf16_grid((Lc, S, HVc, Vc, Kc), 50, scale=0.3))
    pool.states[:, 0] = float("nan")
    pool.scratch.copy_(bf16_grid(tuple(pool.scratch.shape), 51, scale=0.3))
    builder = VerifyArgsBuilder(cfg, pool, NpuRule(), accept_counts=True)  # the npu-accepted flow's arguments
    builder.accepted(torch.tensor([2, 0, 3, 1, -1]))  # starts: blocks 2, committed, 11, 13; padded: committed
    mix = bf16_grid((Lc, N, Dc, cfg.conv_channels), 52).to(BF16)
    beta = bf16_grid((Lc, N, Dc, HVc), 53).to(BF16)
    g = kernels.gdn_gating(torch.randn(Lc, N, Dc, HVc, generator=gen(54)) * 0.5, a_log_for(layers=Lc),
                           torch.zeros(Lc, HVc))
    args = builder.build(mix, beta, g)
    assert args.recurrent_state is pool.temporal and args.intermediate_state is pool.intermediate_ssm
    if logical:  # what a layout-confused op would read: the committed states by their logical view
        args = replace(args, recurrent_state=pool.temporal.contiguous())
    out = run_op(path, monkeypatch, args)
    return out, pool.scratch.clone(), pool.states.clone()


@pytest.mark.parametrize("path", PATHS)
def test_verify_layouts_agree_through_raw_state(monkeypatch, path):
    """A state's meaning is its raw memory (docs/semantics.md §4): every transposed-view layout,
    holding the same raw contents, give bit-identical outputs and raw scratch."""
    base = _layout_run("contiguous", monkeypatch, path)
    for layout in [name for name in LAYOUTS if name != "contiguous"]:
        got = _layout_run(layout, monkeypatch, path)
        for a, b in zip(base, got):
            assert same_bits(a, b), layout
    # Negative control: reading the transposed committed states logically changes the result.
    wrong = _layout_run("transposed", monkeypatch, path, logical=True)
    assert not same_bits(wrong[0][:, :4], base[0][:, :4])


def test_verify_stochastic_rounding_does_not_depend_on_layer_chunking(monkeypatch):
    """The random bits hash each element's global index (store_state's offset): how many layers
    the op processes at once (a performance setting) must not change which way a value rounds."""
    monkeypatch.setattr(kernels, "USE_NATIVE", False)

    def run(chunk_bytes, key=5):
        monkeypatch.setattr(kernels, "STATE_CHUNK_BYTES", chunk_bytes)
        args = op_case(rounding="stochastic", key=key)
        out = kernels.recurrent_gated_delta_rule(args)
        return out, args.intermediate_state

    whole, per_layer = run(4 << 20), run(1)  # 1 byte: one layer per chunk
    assert kernels._layer_chunk((B, HV, V, K)) == 1  # (the monkeypatch took)
    assert same_bits(whole[0], per_layer[0]) and same_bits(whole[1], per_layer[1])
    # Negative controls: a different key changes the rounding, and so would a chunk hashing
    # its elements from offset 0 (layer 1 stored on its own).
    assert not same_bits(run(4 << 20, key=6)[1], whole[1])
    h = torch.randn(L, 64, generator=gen(60))
    full, alone = torch.empty(L, 64, dtype=BF16), torch.empty(64, dtype=BF16)
    kernels.store_state(full, h, "stochastic", key=3)
    kernels.store_state(alone, h[1], "stochastic", key=3)
    assert not same_bits(alone, full[1])
    kernels.store_state(alone, h[1], "stochastic", key=3, offset=64)
    assert same_bits(alone, full[1])


# ------------------------------------------------------------ sequential decode
def _decode_case(state_dtype):
    """Committed states [L, NSLOT, HV, V, K] (slot 0 NaN) and the op's fp32 inputs of B rows."""
    args = op_case(rec_dtype=state_dtype)
    q, k, v, decay, beta = args.inputs(F32)
    return args.recurrent_state, q, k, v, decay, beta


def test_gdn_decode_rounds_after_every_token():
    """Sequential decode of a bf16 state: the state rounded to bf16 (RNE) after each token.
    Rows process 4, 2 and 0 tokens."""
    state, q, k, v, decay, beta = _decode_case(BF16)
    before = state.clone()
    slots, num = [4, 1, 3], [D, 2, 0]
    kernels.gdn_decode(state, torch.tensor(slots), q, k, v, decay, beta, torch.tensor(num))
    ref_final, _ = naive.gdn_decode(before[:, slots], q, k, v, decay, beta, num, BF16)
    for n, s in enumerate(slots[:2]):
        got, ref = state[:, s].double(), ref_final[:, n]
        # Each side rounds after every token; they can only part where fp32 and float64
        # straddle a bf16 rounding boundary (fraction ~4e-4 per token, <= 1% allowed;
        # skipping the per-token rounding moves most elements).
        assert (got != ref).double().mean() < 0.01
        # Rigorous norm bound: per token the fp32 error (gdn_state_bound: the inputs are the same
        # fp32 values on both sides) plus at most one bf16 ulp (<= 2^-7 relative) per element
        # where the roundings part.
        h_norm = ref.norm(dim=(-1, -2))
        v_norm = v[:, n].double().norm(dim=-1).amax(1)
        tol = num[n] * (gdn_state_bound(1, K, h_norm, v_norm) + 2.0 ** -7 * h_norm)
        assert ((got - ref).norm(dim=(-1, -2)) <= tol).all()
    # A row with no tokens: identity tokens (decay 1, beta 0) are exact, bit-identical.
    assert same_bits(state[:, 3], before[:, 3])
    others = [s for s in range(NSLOT) if s not in slots]
    assert same_bits(state[:, others], before[:, others])
    # Negative control: without the per-token rounding (fp32 state, rounded once at the end).
    once = before.float()
    kernels.gdn_decode(once, torch.tensor(slots), q, k, v, decay, beta, torch.tensor(num))
    assert (once[:, 4].to(BF16) != state[:, 4]).double().mean() > 0.01


def test_gdn_decode_without_rounding_and_capture_match_float64():
    """fp32 state (nothing to round) and the float64 path the twin uses, with a capture of
    the state after a chosen token and the squared norms after every token."""
    state, q, k, v, decay, beta = _decode_case(F32)
    num, capture = [D, 3, 0], [1, 2, -1]
    h0 = state[:, SLOTS].clone()
    ref_final, _ = naive.gdn_decode(h0, q, k, v, decay, beta, num, F64)
    ref_cap = [naive.gdn_decode(h0, q, k, v, decay, beta, [c + 1] * B, F64)[0][:, n]
               for n, c in enumerate(capture)]
    for cd, u in ((F32, U32), (F64, U64)):
        st = state.clone().to(cd)
        cap = torch.zeros(L, B, HV, V, K, dtype=cd)
        norms = torch.zeros(L, B, D, HV, dtype=cd)
        kernels.gdn_decode(st, torch.tensor(SLOTS), q, k, v, decay, beta, torch.tensor(num),
                           compute_dtype=cd, captures=((capture, cap),), norms_out=norms)
        for n, s in enumerate(SLOTS[:-1]):
            ref = ref_final[:, n]
            v_norm = v[:, n].double().norm(dim=-1).amax(1)
            tol = gdn_state_bound(num[n], K, ref.norm(dim=(-1, -2)), v_norm, u)
            assert ((st[:, s].double() - ref).norm(dim=(-1, -2)) <= tol).all()
            rc = ref_cap[n]
            tol_c = gdn_state_bound(capture[n] + 1, K, rc.norm(dim=(-1, -2)), v_norm, u)
            assert ((cap[:, n].double() - rc).norm(dim=(-1, -2)) <= tol_c).all()
            # ||S||^2 after the last token: a sum of V K squares, <= V K u relative.
            want = st[:, s].double().square().sum((-1, -2))
            assert ((norms[:, n, num[n] - 1].double() - want).abs() <= V * K * u * want).all()
        assert (cap[:, B - 1] == 0).all()  # capture -1: untouched


# ------------------------------------------------------------ conv rollback
def _conv_pool(layout: str):
    """bf16 conv states [L, NSLOT, W, C]: contiguous, a transposed view, or a channel slice."""
    vals = torch.arange(L * NSLOT * W * C, dtype=F32).reshape(L, NSLOT, W, C) % 251
    if layout == "contiguous":
        conv = vals.to(BF16)
    elif layout == "transposed":  # [L, S, C, W] storage
        conv = torch.zeros(L, NSLOT, C, W, dtype=BF16).transpose(2, 3)
        conv.copy_(vals)
    else:  # every other channel of a wider buffer
        conv = torch.zeros(L, NSLOT, W, 2 * C, dtype=BF16)[..., ::2]
        conv.copy_(vals)
    assert conv.is_contiguous() == (layout == "contiguous")
    conv[:, 0] = float("nan")  # dummy slot
    return conv


ROLLBACK_SLOTS = [3, 1, 5, 0]  # the last is a padded row on the dummy slot (step -1)
CONV_LAYOUTS = ["contiguous", "transposed", "channel_slice"]


def _check_rollback(kernel, layout, steps):
    conv = _conv_pool(layout)
    ref = conv.clone().contiguous()
    state = torch.tensor(ROLLBACK_SLOTS)
    step = torch.tensor(steps)
    out = kernel(conv, state, step, D)
    naive.conv_state_rollback(ref, state, step, D)
    return out is conv and same_bits(conv.contiguous(), ref), conv, ref


@pytest.mark.parametrize("layout", CONV_LAYOUTS)
@pytest.mark.parametrize("step", list(range(-1, D)))
def test_conv_state_rollback_matches_definition(layout, step):
    ok, conv, _ = _check_rollback(kernels.conv_state_rollback, layout, [step, step, step, -1])
    assert ok
    orig = _conv_pool(layout)
    if step in (-1, D - 1):  # nothing to shift
        assert same_bits(conv.contiguous(), orig.contiguous())
    else:  # the shift really happened (the test is not vacuous)
        assert not same_bits(conv.contiguous(), orig.contiguous())


@pytest.mark.parametrize("layout", CONV_LAYOUTS)
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
    conv, x, weight = _conv_case("channel-major")
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
def _ssm_pair(ssm_layout: str, inter_layout: str, dtype=BF16):
    """Committed [L, NSLOT, HV, V, K] and scratch [L, B+1, D, HV, V, K] as drift's pools hand them
    out: 'transposed' = a transposed view of [K, V] storage, 'contiguous' = dense [V, K]."""
    def make(shape_vk, layout, seed):
        vals = bf16_grid(shape_vk, seed)
        if layout == "transposed":
            t = torch.empty(shape_vk[:-2] + (K, V), dtype=dtype).transpose(-1, -2)
            t.copy_(vals)
            return t
        return vals.to(dtype)
    ssm = make((L, NSLOT, HV, V, K), ssm_layout, 40)
    ssm[:, 0] = float("nan")
    inter = make((L, B + 1, D, HV, V, K), inter_layout, 41)
    return ssm, inter


MOVE_DST = [2, 5, 0, 3]  # row 2 is padded (dummy slot, step -1)
MOVE_STEPS = [3, 0, -1, 1]
MOVE_SRC = [0, 1, 2, 0]  # two rows may read the same scratch row
MOVE_ARGS = tuple(torch.tensor(a) for a in (MOVE_DST, MOVE_SRC, MOVE_STEPS))
LAYOUT_PAIRS = [("transposed", "transposed"), ("contiguous", "transposed"), ("transposed", "contiguous"),
                ("contiguous", "contiguous")]


@pytest.mark.parametrize("ssm_layout, inter_layout", LAYOUT_PAIRS)
def test_move_intermediate_cache_is_a_raw_block_copy(ssm_layout, inter_layout):
    ssm, inter = _ssm_pair(ssm_layout, inter_layout)
    before = ssm.clone()
    ref = ssm.clone()
    assert kernels.move_intermediate_cache(ssm, inter, *MOVE_ARGS) is ssm
    naive.move_intermediate_cache(ref, inter, *MOVE_ARGS)
    assert same_bits(ssm, ref)
    assert same_bits(ssm[:, 0], before[:, 0])  # -1 row: the dummy keeps its NaN bits
    for s in (1, 4):  # slots nobody names
        assert same_bits(ssm[:, s], before[:, s])
    for d, r, st in zip(MOVE_DST, MOVE_SRC, MOVE_STEPS):
        if st >= 0:
            assert same_bits(raw_state(ssm)[:, d], raw_state(inter)[:, r, st])  # the raw memory
            # The logical copy exactly where the layouts agree (docs/semantics.md §3).
            assert torch.equal(ssm[:, d], inter[:, r, st]) == (ssm_layout == inter_layout)


def test_a_logical_copy_across_layouts_is_caught():
    """Negative control (the regression sgl-kernel-npu #748 reverted, drift's commit_logically
    mutant): a mover honouring the destination's logical strides differs from the raw copy when
    committed state and scratch differ in layout."""
    ssm, inter = _ssm_pair("transposed", "contiguous")
    logical = ssm.clone()
    for d, r, st in zip(MOVE_DST, MOVE_SRC, MOVE_STEPS):
        if st >= 0:
            logical[:, d] = inter[:, r, st]
    ref = ssm.clone()
    naive.move_intermediate_cache(ref, inter, *MOVE_ARGS)
    assert not same_bits(logical, ref)


def test_move_intermediate_cache_has_no_upper_bound_on_the_step():
    """Only step < 0 is skipped: the block read is the flat one src * D + step (the real kernel
    checks no upper bound); past the whole scratch drift raises IndexError."""
    ssm, inter = _ssm_pair("contiguous", "contiguous")
    def one(v):
        return torch.tensor([v])

    kernels.move_intermediate_cache(ssm, inter, one(3), one(0), one(D + 1))  # = row 1, step 1
    assert same_bits(ssm[:, 3], inter[:, 1, 1])
    with pytest.raises(IndexError):
        kernels.move_intermediate_cache(ssm, inter, one(3), one(B), one(D))  # flat (B+1) * D: past the end
    with pytest.raises(IndexError):
        kernels.move_intermediate_cache(ssm, inter, one(NSLOT), one(0), one(0))
    before = ssm.clone()
    kernels.move_intermediate_cache(ssm, inter, one(3), one(B + 5), one(-2))  # skipped: not even checked
    assert same_bits(ssm, before)


def test_move_intermediate_cache_refuses_to_cast():
    ssm, _ = _ssm_pair("transposed", "transposed", BF16)
    _, inter = _ssm_pair("transposed", "transposed", F32)
    with pytest.raises(ValueError, match=r"does not cast.*bfloat16.*float32"):
        kernels.move_intermediate_cache(ssm, inter, torch.tensor([1]), torch.tensor([0]), torch.tensor([0]))


def test_move_intermediate_cache_rejects_bad_shapes():
    ssm, inter = _ssm_pair("contiguous", "contiguous")
    with pytest.raises(ValueError, match="state shapes differ"):
        kernels.move_intermediate_cache(ssm, inter[..., :4], torch.tensor([1]), torch.tensor([0]),
                                        torch.tensor([0]))
    with pytest.raises(ValueError, match="expects"):
        kernels.move_intermediate_cache(ssm[0], inter, torch.tensor([1]), torch.tensor([0]), torch.tensor([0]))


def test_gating_computes_its_parameters_once_and_again_after_they_change():
    """gdn_gating keeps dt_bias and -exp(A_log) in float64 per pair of parameter tensors: its output is the
    definition's, bit for bit, on the first call, on a repeated call, and after A_log changes in place
    (its version bumps: the stale -exp(A_log) would give the old gates) or a new tensor takes its place."""
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(2, 3, 4, 6, generator=gen).to(torch.bfloat16)
    A_log = torch.randn(2, 6, generator=gen)
    dt_bias = torch.randn(2, 6, generator=gen)

    def definition():
        z = a.double() + dt_bias.double()[:, None, None, :]
        sp = torch.where(z > kernels.SOFTPLUS_THRESHOLD, z,
                         torch.log1p(torch.exp(torch.clamp(z, max=kernels.SOFTPLUS_THRESHOLD))))
        return (-torch.exp(A_log.double())[:, None, None, :] * sp).float()

    first = kernels.gdn_gating(a, A_log, dt_bias)
    assert torch.equal(first, definition()) and torch.equal(kernels.gdn_gating(a, A_log, dt_bias), first)
    A_log.add_(0.5)
    changed = kernels.gdn_gating(a, A_log, dt_bias)
    assert not torch.equal(changed, first) and torch.equal(changed, definition())
    A_log = A_log.clone().sub_(0.25)
    assert torch.equal(kernels.gdn_gating(a, A_log, dt_bias), definition())
