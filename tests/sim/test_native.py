"""drift.sim.native: the C kernel behind kernels.recurrent_gated_delta_rule on the CPU, against the
float64 definition and the torch-op path; and the library's other entries: the float64 twin's decode
(one step against its numpy replay, a batch of steps against its steps one by one) and the slot
guard's byte comparison (against the torch path's).

Cases are VerifyArgs of SGLang's form (dense ``[.., V, K]`` blocks, the scratch
``[L, rows + 1, D, HV, V, K]`` addressed by flat block ``row * D + step``), some rows continuing
from scratch blocks (the accepted flow) and a padded row on the NaN dummy slot 0. Every
comparison first asserts that the native path really ran (tests/sim/test_kernels.py ``run_op`` spies
on the call), so a missing compiler fails here instead of quietly testing the torch path twice.
Set ``DRIFT_NATIVE=0`` to opt out of the native kernel (these tests then skip, saying so).

Tolerances: against float64, tests/sim/test_kernels.py's derived bound (``op_bounds``: per token
(K + 6) u32 (||h|| + ||v||) for the fp32 recurrence plus (2K + 18) u32 (..) for the fp32 inputs).
The native and torch paths share their fp32 inputs (``VerifyArgs.inputs``) and differ only in the
recurrence's summation order, each within ``conftest.gdn_state_bound`` (t (K + 6) u32 (||h|| + ||v||))
of the exact recurrence on those inputs: so they differ by at most twice that (triangle
inequality). bf16 stores and outputs agree except where a rounding boundary separates the two
float32 values (a fraction ~1e-6 / 2^-8 ~ 4e-4 of the elements at most; measured on these cases,
3 seeds per shape: at most 0.007% of the states and 0.03% of the outputs; 1% allowed). Measured
against the bounds themselves: native vs float64 at most 1.4% of op_bounds, native vs torch at
most 0.8% of the pair bound; a bf16-rounded beta exceeds op_bounds (test_a_beta_rounded_to_bf16_is_caught).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

from helpers import U32, as_bits, bf16_ulp, gdn_state_bound, same_bits
from drift.flows.copy_commit.rule import NpuRule
from drift.plug.mutants import MUTANTS
from drift.sim import kernels, native
from drift.sim.kernels import VerifyArgs
from drift.sim.pool import raw_state
from test_kernels import assert_close_to_float64, op_bounds, op_values, reference, run_op

pytestmark = pytest.mark.skipif(not native.enabled(), reason="DRIFT_NATIVE=0 turns the native kernel off")

F32, BF16, I32 = torch.float32, torch.bfloat16, torch.int32
SLOTS = [4, 1, 6, 0]  # the last row is padded: the dummy slot 0 holds NaN
ACCEPTED = [1, 3, 2, 1]  # rows 1 and 2 continue from scratch blocks 1 * D + 2 and 2 * D + 1
FRAC = 0.01  # rounding-boundary mismatches allowed (module docstring)


def make_case(K=32, V=32, L=3, D=4, HK=1, HV=3, S=8, rec_dtype=BF16, scratch_dtype=BF16, seed=0,
              rounding="rne") -> VerifyArgs:
    """Committed states [L, S, HV, V, K] (~0.3 per element, bf16 values; slot 0 NaN), a finite scratch
    [L, N+1, D, HV, V, K] (its spare row NaN), bf16 mix and beta logits, g for decays 0.4 .. 0.999."""
    N = len(SLOTS)
    gen = torch.Generator().manual_seed(seed)
    # Values on the bf16 grid in either dtype: a case's fp32 and bf16 variants hold the same states.
    rec = (torch.randn(L, S, HV, V, K, generator=gen) * 0.3).to(BF16).to(rec_dtype)
    rec[:, 0] = float("nan")
    scratch = (torch.randn(L, N + 1, D, HV, V, K, generator=gen) * 0.3).to(BF16).to(scratch_dtype)
    scratch[:, N] = float("nan")
    mix = torch.randn(L, N, D, 2 * HK * K + HV * V, generator=gen).to(BF16)
    beta = torch.randn(L, N, D, HV, generator=gen).to(BF16)
    decay = torch.linspace(0.4, 0.999, HV).expand(L, N, D, HV) ** torch.rand(L, N, D, HV, generator=gen)
    return VerifyArgs(mix, beta, torch.log(decay), rec, scratch, torch.tensor(SLOTS, dtype=I32),
                      torch.arange(N * D, dtype=I32).view(N, D), torch.tensor(ACCEPTED, dtype=I32),
                      torch.full((N,), D, dtype=I32), HK, HV, K ** -0.5, rounding, rule=NpuRule())


def fresh(args: VerifyArgs, **changes) -> VerifyArgs:
    """The same case with its own copy of the scratch (runs must not share it)."""
    return replace(args, intermediate_state=args.intermediate_state.clone(), **changes)


def written(args: VerifyArgs, rows: int) -> torch.Tensor:
    """The blocks the first ``rows`` rows wrote: [L, rows, D, HV, V, K]."""
    return kernels.scratch_blocks(args.intermediate_state)[:, args.ssm_state_indices[:rows].long()]


# V = 80: not a multiple of 16 lanes; K = 24: not a whole number of 16-lane vectors (the kernel's
# row-at-a-time path); V = 40: a last group of 8 rows after 2 of the kernel's 16-row groups.
@pytest.mark.parametrize("K,V", [(32, 32), (16, 80), (128, 128), (24, 40)])
@pytest.mark.parametrize("rec_dtype", [BF16, F32], ids=["rec-bf16", "rec-fp32"])
def test_native_matches_float64_and_the_torch_path(monkeypatch, K, V, rec_dtype):
    L = 1 if K == 128 else 2
    args = make_case(K, V, L=L, rec_dtype=rec_dtype, scratch_dtype=F32)
    rec_before = as_bits(args.recurrent_state).clone()
    spare_before = as_bits(args.intermediate_state[:, -1]).clone()
    ref_out, ref_states, h0 = reference(args)
    a_n, a_t = fresh(args), fresh(args)
    out_n = run_op("native", monkeypatch, a_n)
    out_t = run_op("torch", monkeypatch, a_t)
    assert out_n.dtype == BF16 and out_n.shape == (L, len(SLOTS), 4, 3, V)
    assert torch.equal(as_bits(args.recurrent_state), rec_before)  # verify never writes the committed state
    assert torch.equal(as_bits(a_n.intermediate_state[:, -1]), spare_before)  # nor the spare scratch row
    n = len(SLOTS) - 1
    state_b, out_b = op_bounds(ref_states[:, :n], h0[:, :n], op_values(args)[:, :n])
    got_n, got_t = written(a_n, n), written(a_t, n)
    assert_close_to_float64(got_n, ref_states[:, :n], state_b, FRAC, "native states")
    assert_close_to_float64(out_n[:, :n], ref_out[:, :n], out_b, FRAC, "native outputs")
    # Native against torch: twice the recurrence bound (module docstring).
    h_norm = torch.maximum(h0[:, :n].norm(dim=(-1, -2))[:, :, None], ref_states[:, :n].norm(dim=(-1, -2)).amax(2, True))
    v_norm = op_values(args)[:, :n].norm(dim=-1).amax(2, keepdim=True)
    t = torch.arange(1, 5, dtype=torch.float64)[None, None, :, None]
    pair = 2 * gdn_state_bound(t, K, h_norm, v_norm)
    diff = (got_n.double() - got_t.double()).norm(dim=(-1, -2))
    assert (diff <= pair).all(), f"native vs torch {(diff / pair).max():.3g} x the bound"
    # bf16 outputs: equal but for rounding boundaries, never more than an ulp + the pair's output bound apart.
    o_n, o_t = out_n[:, :n].double(), out_t[:, :n].double()
    out_pair = K ** -0.5 * (pair + 2 * K * U32 * h_norm)
    assert ((o_n - o_t).abs() <= bf16_ulp(torch.maximum(o_n.abs(), o_t.abs())) + out_pair[..., None]).all()
    assert (o_n != o_t).double().mean() <= FRAC
    # The padded row computes from the NaN dummy, as the torch path does: visible, not skipped.
    assert torch.isnan(out_n[:, n:]).all() and torch.isnan(written(a_n, len(SLOTS))[:, n:]).all()


def test_native_bf16_stores_are_torch_casts_of_its_float32_states(monkeypatch):
    """Same kernel, same arithmetic, two scratch dtypes: the bf16 scratch must hold exactly
    torch's round-to-nearest-even cast of the float32 one, NaN included (the C kernel writes
    every NaN as 0xFFFF, the bits torch's vectorised cast gives)."""
    a32 = make_case(scratch_dtype=F32)
    a16 = replace(a32, intermediate_state=a32.intermediate_state.to(BF16))
    out32 = run_op("native", monkeypatch, a32)
    out16 = run_op("native", monkeypatch, a16)
    s32, s16 = written(a32, len(SLOTS)), written(a16, len(SLOTS))
    assert torch.isnan(s32[:, -1]).all()  # the padded row's NaN states are part of the comparison
    assert same_bits(s16, s32.to(BF16))
    assert same_bits(out16, out32)  # outputs use the fp32 state, not the stored one
    # Negative control: a truncating store would not be the cast.
    trunc = (as_bits(s32[:, :-1]) & -65536).view(F32).to(BF16)
    assert not same_bits(s16[:, :-1], trunc)


def test_native_and_torch_bf16_stores_agree_but_for_rounding_boundaries(monkeypatch):
    args = make_case()
    a_n, a_t = fresh(args), fresh(args)
    run_op("native", monkeypatch, a_n)
    run_op("torch", monkeypatch, a_t)
    n = len(SLOTS) - 1
    a, b = written(a_n, n).double(), written(a_t, n).double()
    diff = (a - b).abs()
    # The two kernels sum the K-term dot products h_r.k in different fp32 orders: they differ by at
    # most 2 gamma_K sum_c |h_rc k_c| <= 2 K U32 ||h_r|| (||k|| = 1, Higham's gamma_K ~ K U32); a
    # token moves h_r by beta (<= 1) times that along k (|k_c| <= 1); D tokens add up (decay and
    # I - beta k k^T do not grow it); ||h_r|| <= sqrt(K) max |h|. A near-cancelling element sees that
    # absolute slack, not one relative to itself; every other element stays within one bf16 ulp.
    D, K = a.shape[2], a.shape[-1]
    slack = D * 2 * K * U32 * K ** 0.5 * torch.maximum(a.abs(), b.abs()).amax((-1, -2), keepdim=True)
    assert (diff <= bf16_ulp(torch.maximum(a.abs(), b.abs())) + slack).all()
    assert (diff > 0).double().mean() < FRAC
    # Every block the rows name was written (the scratch was finite random values before).
    assert not (a == kernels.scratch_blocks(args.intermediate_state)[:, args.ssm_state_indices[:n].long()].double()).all()


def test_a_beta_rounded_to_bf16_is_caught(monkeypatch):
    """Negative control: the same comparison sees a bf16-class input error (vLLM #53877) in the
    native result; the float32 bound is not so loose that it hides one. The C kernel is called
    directly with the op's inputs, beta rounded to bf16 after the sigmoid."""
    args = make_case(scratch_dtype=F32)
    n = len(SLOTS) - 1
    _, ref_states, h0 = reference(args)
    state_b, _ = op_bounds(ref_states[:, :n], h0[:, :n], op_values(args)[:, :n])
    results = []
    for beta_dtype in (F32, BF16):
        a = fresh(args)
        call = _native_args(a)
        call["beta"] = call["beta"].to(beta_dtype).to(F32)
        native.recurrent_gated_delta_rule(**call)
        results.append((written(a, n).double() - ref_states[:, :n]).norm(dim=(-1, -2)))
    good, bad = results
    assert (good <= state_b).all()
    assert (bad > state_b).any()


def test_native_bits_do_not_depend_on_the_thread_count(monkeypatch):
    args = make_case(L=5)
    runs = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(torch, "get_num_threads", lambda t=threads: t)
        a = fresh(args)
        out = run_op("native", monkeypatch, a)
        runs.append((as_bits(out), as_bits(a.intermediate_state)))
    for out, s in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(s, runs[0][1])


LANES = 16  # the C kernel's lane-split sums (gdn_verify.c: NL)


def _decode_f64_arithmetic(state, ntok, q, k, v, decay, beta, cap_steps, lane_order=range(LANES)):
    """drift_decode_f64's documented arithmetic in numpy float64, one IEEE rounding per operation
    (nothing fused): per row, ``h <- d h`` with ``s = h . k``, then ``h <- h + u k`` with ``o = h . q``
    and ``u = (v - s) beta``; each dot (and ``||h_r||^2``) summed in LANES lanes (lane j: columns j,
    j + LANES, ..), the lanes added in ``lane_order``, then the columns past the last whole group one
    by one; the rows' ``||h_r||^2`` added in row order; a token past ``ntok`` runs as an identity
    (decay 1, beta 0). Returns the state, outputs, norms and the capture at ``cap_steps``."""
    S = state.numpy().copy()
    q, k, v, decay, beta = (t.numpy() for t in (q, k, v, decay, beta))
    L, R, D, HV, K = q.shape
    out, norms, cap = np.empty(v.shape), np.empty(decay.shape), np.zeros(S.shape)
    whole = K // LANES * LANES

    def lanes(p):  # [V, K] products -> [V] sums, in the kernel's order
        acc = np.zeros((p.shape[0], LANES))
        for c in range(0, whole, LANES):
            acc = acc + p[:, c:c + LANES]
        s = np.zeros(p.shape[0])
        for j in lane_order:
            s = s + acc[:, j]
        for c in range(whole, K):
            s = s + p[:, c]
        return s

    for l, r, hv in np.ndindex(L, R, HV):
        h = S[l, r, hv]
        for t in range(D):
            active = t < ntok[r]
            d, bt = (decay[l, r, t, hv], beta[l, r, t, hv]) if active else (1.0, 0.0)
            h[:] = h * d
            u = (v[l, r, t, hv] - lanes(h * k[l, r, t, hv])) * bt
            h[:] = h + u[:, None] * k[l, r, t, hv]
            out[l, r, t, hv] = lanes(h * q[l, r, t, hv])
            n2 = 0.0
            for row_norm in lanes(h * h):
                n2 = n2 + row_norm
            norms[l, r, t, hv] = n2
            if cap_steps[r] == t:
                cap[l, r, hv] = h
    return S, out, norms, cap


# K = 32: whole 16-lane groups (the kernel's rows-at-a-time path where the CPU has AVX-512), V = 20:
# two groups of 8 rows and 4 rows one by one; K = 24: the row-at-a-time path with a tail of columns.
@pytest.mark.parametrize("K,V", [(32, 20), (24, 20)])
def test_the_float64_decode_is_its_documented_arithmetic_bit_for_bit(K, V):
    """The twin's C decode against its arithmetic replayed in numpy (above): the same bits, state,
    outputs, norms and capture. Control: the lanes added in another order differ."""
    L, R, D, HV = 2, 3, 4, 2
    gen = torch.Generator().manual_seed(11)
    F64 = torch.float64
    state = torch.randn(L, R, HV, V, K, dtype=F64, generator=gen) * 0.3
    q = torch.randn(L, R, D, HV, K, dtype=F64, generator=gen) * K ** -0.5
    k = torch.nn.functional.normalize(torch.randn(L, R, D, HV, K, dtype=F64, generator=gen), dim=-1)
    v = torch.randn(L, R, D, HV, V, dtype=F64, generator=gen)
    decay, beta = (torch.rand(L, R, D, HV, dtype=F64, generator=gen) for _ in range(2))
    ntok, cap_steps = [4, 1, 3], [2, -1, 0]
    got = state.clone()
    out, norms, cap = torch.empty_like(v), torch.empty_like(decay), torch.zeros_like(state)
    native.decode_f64(got, ntok, q, k, v, decay, beta, out, norms, [(cap_steps, cap)])
    ref = _decode_f64_arithmetic(state, ntok, q, k, v, decay, beta, cap_steps)
    for name, a, b in zip(("state", "out", "norms", "capture"), (got, out, norms, cap), ref):
        assert np.array_equal(a.numpy(), b), name
    other = _decode_f64_arithmetic(state, ntok, q, k, v, decay, beta, cap_steps, lane_order=range(LANES)[::-1])
    assert not np.array_equal(out.numpy(), other[1]) and not np.array_equal(got.numpy(), other[0])


def _cpu_has_fma() -> bool:
    cpuinfo = "/proc/cpuinfo"
    return os.path.exists(cpuinfo) and any(line.startswith("flags") and " fma " in f" {line.split(':', 1)[-1]} "
                                           for line in open(cpuinfo))


@pytest.mark.parametrize("contract", ["off", "fast"])
def test_the_build_keeps_every_multiply_and_add_rounding_on_its_own(tmp_path, contract):
    """native.FLAGS holds -ffp-contract=off, so the library's arithmetic is the source's whatever the compiler's
    default (clang fuses ``a*b + c`` into one FMA unless told). A library built from the shipped flags (in a
    fresh process, its own cache) is the documented arithmetic bit for bit; the same flags with contraction
    forced on (``fast``) are not, on a CPU with FMA: the figures would follow the compiler."""
    code = ("import sys, numpy as np, torch\n"
            "from drift.sim import native\n"
            f"native.FLAGS = [f.replace('-ffp-contract=off', '-ffp-contract={contract}') for f in native.FLAGS]\n"
            "gen = torch.Generator().manual_seed(11)\n"
            "L, R, D, HV, K, V = 2, 3, 4, 2, 32, 20\n"
            "F64 = torch.float64\n"
            "state = torch.randn(L, R, HV, V, K, dtype=F64, generator=gen) * 0.3\n"
            "q = torch.randn(L, R, D, HV, K, dtype=F64, generator=gen) * K ** -0.5\n"
            "k = torch.nn.functional.normalize(torch.randn(L, R, D, HV, K, dtype=F64, generator=gen), dim=-1)\n"
            "v = torch.randn(L, R, D, HV, V, dtype=F64, generator=gen)\n"
            "decay, beta = (torch.rand(L, R, D, HV, dtype=F64, generator=gen) for _ in range(2))\n"
            "inputs = (state.clone(), q, k, v, decay, beta)\n"
            "out, norms = torch.empty_like(v), torch.empty_like(decay)\n"
            "native.decode_f64(state, [4, 1, 3], q, k, v, decay, beta, out, norms, [])\n"
            "assert native.status().startswith('native C kernel'), native.status()\n"
            "np.savez(sys.argv[1], *[t.numpy() for t in inputs], state.numpy(), out.numpy())\n")
    saved = tmp_path / "decode.npz"
    res = subprocess.run([sys.executable, "-c", code, str(saved)], env={**os.environ, "DRIFT_CACHE_DIR": str(tmp_path)},
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    with np.load(saved, allow_pickle=False) as z:
        state0, q, k, v, decay, beta, got_state, got_out = (torch.from_numpy(z[f"arr_{i}"]) for i in range(8))
    ref_state, ref_out, _, _ = _decode_f64_arithmetic(state0, [4, 1, 3], q, k, v, decay, beta, [-1, -1, -1])
    same = np.array_equal(got_state.numpy(), ref_state) and np.array_equal(got_out.numpy(), ref_out)
    assert same == (contract == "off" or not _cpu_has_fma())


def _steps_case(n=5, L=2, R=3, D=4, HV=2, K=32, V=20, seed=12):
    """n steps of the twin's decode inputs (float64, each step's shapes as decode_f64 takes them)."""
    gen = torch.Generator().manual_seed(seed)
    F64 = torch.float64
    state = torch.randn(L, R, HV, V, K, dtype=F64, generator=gen) * 0.3
    q = torch.randn(n, L, R, D, HV, K, dtype=F64, generator=gen) * K ** -0.5
    k = torch.nn.functional.normalize(torch.randn(n, L, R, D, HV, K, dtype=F64, generator=gen), dim=-1)
    v = torch.randn(n, L, R, D, HV, V, dtype=F64, generator=gen)
    decay, beta = (torch.rand(n, L, R, D, HV, dtype=F64, generator=gen) for _ in range(2))
    ntok = torch.randint(1, D + 1, (n, R), generator=gen)
    return state, ntok, q, k, v, decay, beta


def _stepped_decode(state, ntok, q, k, v, decay, beta, captures):
    """decode_f64 called once per step: states after each step, outputs, norms and the captures."""
    s, outs, norms, states, caps = state.clone(), torch.empty_like(v), torch.empty_like(decay), [], []
    for j in range(q.shape[0]):
        here = [(tok, torch.zeros_like(state)) for step, tok in captures if step == j]
        native.decode_f64(s, ntok[j].tolist(), q[j], k[j], v[j], decay[j], beta[j], outs[j], norms[j], here)
        states.append(s.clone())
        caps += [c for _, c in here]
    return torch.stack(states), outs, norms, caps


@pytest.mark.parametrize("K,V", [(32, 20), (24, 20)])
def test_a_batch_of_float64_decode_steps_is_its_steps_one_by_one_bit_for_bit(K, V):
    """decode_f64_steps (the comparison's batch of twin steps in one call) against decode_f64 called
    step by step: the same bits in every step's state, outputs and norms, and in each capture, two
    of them at one step and one at the last. Control: the same batch with two steps' token counts
    swapped differs, so equality here is not the steps' indifference to their order."""
    state, ntok, q, k, v, decay, beta = _steps_case(K=K, V=V)
    R = state.shape[1]
    captures = [(1, [2, -1, 0]), (1, [-1, 3, -1]), (4, [0, 0, 1])]
    want_states, want_out, want_norms, want_caps = _stepped_decode(state, ntok, q, k, v, decay, beta, captures)

    def batched(counts):
        s, out, norms = state.clone(), torch.empty_like(v), torch.empty_like(decay)
        states = torch.empty(q.shape[0], *state.shape, dtype=torch.float64)
        caps = [(step, tok, torch.zeros_like(state)) for step, tok in captures]
        native.decode_f64_steps(s, counts, q, k, v, decay, beta, out, norms, states, caps)
        return s, states, out, norms, [c for _, _, c in caps]

    s, states, out, norms, caps = batched(ntok)
    assert torch.equal(s, want_states[-1]) and torch.equal(states, want_states)
    assert torch.equal(out, want_out) and torch.equal(norms, want_norms)
    assert all(torch.equal(a, b) for a, b in zip(caps, want_caps)) and len(caps) == 3
    assert all(c[:, r].abs().sum() > 0 for (_, tok), c in zip(captures, caps) for r in range(R) if tok[r] >= 0)
    swapped = ntok.clone()
    swapped[[0, 1]] = ntok[[1, 0]]
    assert not torch.equal(ntok, swapped)
    assert not torch.equal(batched(swapped)[1], want_states)


def test_a_batch_of_decode_steps_rejects_inconsistent_arguments():
    """decode_f64_steps writes through raw pointers: each argument it trusts is checked."""
    state, ntok, q, k, v, decay, beta = _steps_case()
    out, norms = torch.empty_like(v), torch.empty_like(decay)
    n, R = ntok.shape
    ok = dict(state=state.clone(), num_tokens=ntok, q=q, k=k, v=v, decay=decay, beta=beta, out=out, norms=norms)
    native.decode_f64_steps(**ok)
    bad = {"token counts of one step too few": dict(num_tokens=ntok[:-1].contiguous()),
           "v of one step too few": dict(v=v[:-1].contiguous()),
           "states_out of one step too few": dict(states_out=torch.empty(n - 1, *state.shape, dtype=torch.float64)),
           "a capture past the batch": dict(captures=[(n, [0] * R, torch.zeros_like(state))]),
           "a capture of one row too few": dict(captures=[(0, [0] * (R - 1), torch.zeros_like(state))])}
    for what, change in bad.items():
        with pytest.raises(ValueError, match="decode_f64_steps"):
            native.decode_f64_steps(**{**ok, "state": state.clone(), **change})
            pytest.fail(f"accepted: {what}")
    with pytest.raises(ValueError, match="dense"):
        native.decode_f64_steps(**{**ok, "num_tokens": ntok.to(torch.int32)})


def test_what_the_native_kernel_leaves_to_the_torch_path(monkeypatch):
    """The C kernel takes plain dense CPU states of fp32 / bf16, fp32 compute and round-to-nearest
    stores (or none: an fp32 scratch stores exactly); everything else runs the torch path, and
    must give the same result it gives there."""
    args = make_case()
    rec, blocks = raw_state(args.recurrent_state), kernels.scratch_blocks(args.intermediate_state)
    assert native.supports(rec, blocks, "rne")
    assert not native.supports(rec, blocks, "stochastic")  # bf16 stochastic rounding: torch path
    assert not native.supports(rec, blocks, "truncate")
    assert native.supports(rec, blocks.float(), "stochastic")  # fp32 scratch: an exact store
    assert not native.supports(rec.half(), blocks, "rne") and not native.supports(rec, blocks.half(), "rne")
    assert not native.supports(rec[:, ::2], blocks, "rne")  # slot-strided committed states
    assert kernels.uses_native(args)
    assert not kernels.uses_native(args, torch.float64)  # fp64 compute
    assert not kernels.uses_native(replace(args, rounding="stochastic"))
    # A transposed view of [K, V] storage is a dense raw state: the C kernel takes it.
    tr = torch.empty(rec.shape[:-2] + rec.shape[-2:][::-1], dtype=rec.dtype).transpose(-1, -2)
    raw_state(tr).copy_(rec)
    assert kernels.uses_native(replace(args, recurrent_state=tr))
    monkeypatch.setattr(kernels, "HOST_INDEX_PATHS", False)
    assert not kernels.uses_native(args)  # the device path: no host indices
    monkeypatch.setattr(kernels, "HOST_INDEX_PATHS", True)
    monkeypatch.setattr(kernels, "USE_NATIVE", False)
    assert not kernels.uses_native(args)
    # A slot-strided committed state runs the torch path (run_op asserts no native call), same bits.
    wide = torch.empty((rec.shape[0], 2 * rec.shape[1]) + tuple(rec.shape[2:]), dtype=rec.dtype)[:, ::2]
    wide.copy_(rec)
    a_wide, a_dense = fresh(args, recurrent_state=wide), fresh(args)
    assert not kernels.uses_native(a_wide)
    out_w = run_op("torch", monkeypatch, a_wide)
    out_d = run_op("torch", monkeypatch, a_dense)
    assert same_bits(out_w, out_d) and same_bits(a_wide.intermediate_state, a_dense.intermediate_state)


@pytest.mark.parametrize("name", ["beta_bf16", "round_every_token"])
def test_the_catalogue_precision_regressions_run_the_torch_path(monkeypatch, name):
    """The mutant catalogue's beta_bf16 and round_every_token wrap the op's torch-op path
    (kernels.recurrent_gated_delta_rule_torch): the C kernel, which agrees with it only to float32
    rounding, is never called, so their figures do not depend on whether it builds."""
    args = make_case()
    assert kernels.uses_native(args)
    calls = []
    real = native.recurrent_gated_delta_rule
    monkeypatch.setattr(native, "recurrent_gated_delta_rule", lambda *a: (calls.append(1), real(*a))[1])
    MUTANTS[name].fn(fresh(args))
    assert not calls
    kernels.recurrent_gated_delta_rule(fresh(args))
    assert calls  # the spy does see the C kernel where the op runs it


def _native_args(args: VerifyArgs):
    """The C kernel's arguments for ``args`` (what kernels.recurrent_gated_delta_rule passes)."""
    L, B, S, HV, V, _ = args.dims
    plan = args.plan()
    start, from_rec = plan.start, plan.from_committed
    src = [s if f else i for s, f, i in zip(args.cache_indices.tolist(), from_rec.tolist(), start.tolist())]
    return dict(rec=raw_state(args.recurrent_state), blocks=kernels.scratch_blocks(args.intermediate_state),
                start=src, from_rec=from_rec.tolist(), dst=args.ssm_state_indices.long().tolist(),
                **dict(zip(("q", "k", "v", "decay", "beta"), (t.contiguous() for t in args.inputs(F32)))),
                out=torch.empty(L, B, S, HV, V, dtype=F32))


def test_native_rejects_inconsistent_arguments():
    """The C kernel reads and writes through raw pointers: every argument it trusts is checked."""
    args = make_case()
    ok = _native_args(args)
    native.recurrent_gated_delta_rule(**ok)  # the consistent call runs
    n_slots, n_blocks = ok["rec"].shape[1], ok["blocks"].shape[1]
    bad = {
        "committed slot past the pool": dict(start=[99, *ok["start"][1:]], from_rec=[True, *ok["from_rec"][1:]]),
        "start block past the scratch": dict(start=[n_blocks, *ok["start"][1:]], from_rec=[False, *ok["from_rec"][1:]]),
        "negative start": dict(start=[-1, *ok["start"][1:]]),
        "destination block past the scratch": dict(dst=[[0, 1, 2, n_blocks], *ok["dst"][1:]]),
        "destination below -1 (-1: not stored)": dict(dst=[[-2, 1, 2, 3], *ok["dst"][1:]]),
        "a destination list too short": dict(dst=[[0, 1, 2], *ok["dst"][1:]]),
        "one row too few": dict(start=ok["start"][:-1], from_rec=ok["from_rec"][:-1], dst=ok["dst"][:-1]),
        "v too short (would read past it)": dict(v=ok["v"][..., :-1].contiguous()),
        "decay of the wrong shape": dict(decay=ok["decay"][:, :, :2].contiguous()),
        "out of the wrong shape": dict(out=ok["out"][..., :-1].contiguous()),
        "scratch of another head shape": dict(blocks=ok["blocks"][..., :-1].contiguous()),
        "committed states of another layer count": dict(rec=ok["rec"][:1].contiguous()),
        "non-contiguous committed states": dict(rec=torch.empty((ok["rec"].shape[0], 2 * n_slots)
                                                                + tuple(ok["rec"].shape[2:]), dtype=BF16)[:, ::2]),
    }
    for what, change in bad.items():
        with pytest.raises(ValueError, match="inconsistent arguments"):
            native.recurrent_gated_delta_rule(**{**ok, **change})
            pytest.fail(f"accepted: {what}")
    with pytest.raises(ValueError, match="dense float32"):
        native.recurrent_gated_delta_rule(**{**ok, "beta": ok["beta"].double()})
    with pytest.raises(ValueError, match="dense float32"):
        native.recurrent_gated_delta_rule(**{**ok, "q": ok["q"].transpose(0, 1).contiguous().transpose(0, 1)})


def _fresh_status(tmp_path, **env) -> str:
    """native.status() in a fresh interpreter with an empty cache and ``env``."""
    code = "from drift.sim import native; print(native.status())"
    full = {**os.environ, "DRIFT_CACHE_DIR": str(tmp_path), **env}
    res = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def test_without_a_compiler_the_status_says_why_and_the_torch_path_runs(tmp_path):
    path_without_cc = str(tmp_path / "empty-bin")
    os.makedirs(path_without_cc)
    status = _fresh_status(tmp_path, CC="", PATH=path_without_cc)
    assert "no C compiler" in status and "torch-op path" in status
    failing = _fresh_status(tmp_path, CC="false")
    assert "build or load failed" in failing and "false" in failing
    assert "DRIFT_NATIVE=0" in _fresh_status(tmp_path, DRIFT_NATIVE="0")


def test_an_unwritable_cache_directory_falls_back_to_the_temporary_directory(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    (tmp_path / "tmp").mkdir()  # TMPDIR must exist for tempfile to use it
    status = _fresh_status(tmp_path, DRIFT_CACHE_DIR=str(blocker / "cache"), TMPDIR=str(tmp_path / "tmp"))
    assert status.startswith("native C kernel"), status
    assert list((tmp_path / "tmp").glob("drift-cache-*/gdn_verify-*.so"))


def test_the_build_is_cached_by_content(tmp_path):
    first = _fresh_status(tmp_path)
    assert first.startswith("native C kernel")
    if any("libgomp" in p for p in native._openmp_runtimes()):  # torch runs on libgomp: shared
        assert "torch's OpenMP threads" in first
    libs = sorted(p.name for p in tmp_path.glob("gdn_verify-*.so"))
    assert len(libs) == 1 and libs[0] in first
    assert _fresh_status(tmp_path) == first  # the second process loads the same file
    # no temporary files left behind: the library and the sha256 record of its bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(libs + [libs[0] + ".sha256"])


def test_a_damaged_cached_library_is_rebuilt_never_loaded(tmp_path):
    """A cached file cut to its first 4 KiB (or any bytes that do not hash to the build record)
    would kill the process inside ctypes (SIGBUS); it is rebuilt instead."""
    first = _fresh_status(tmp_path)
    (lib,) = tmp_path.glob("gdn_verify-*.so")
    whole = lib.read_bytes()
    lib.write_bytes(whole[:4096])
    assert _fresh_status(tmp_path) == first  # exit 0 (checked by _fresh_status), the kernel loaded
    assert lib.read_bytes() == whole or native._verified(lib)  # rebuilt: its bytes match the record again
    lib.write_bytes(whole)
    (tmp_path / (lib.name + ".sha256")).unlink()  # a library with no record is not trusted either
    assert _fresh_status(tmp_path) == first and native._verified(lib)


def test_changed_slots_flags_exactly_the_slots_whose_bytes_differ(monkeypatch):
    """The slot guard's C comparison (native.changed_slots, what drift.simulate._changed_slots runs on
    plain CPU tensors) against the torch path's word comparison: the same flags for single-byte
    changes anywhere in a slot -- its first byte in the first layer, its last byte in the last layer
    (after the early exit of every other slot) -- and for several slots at once; an unchanged copy
    flags none. On plain CPU tensors _changed_slots must take the C kernel (a spy counts the call)."""
    from drift.simulate import _changed_slots

    gen = torch.Generator().manual_seed(3)
    L, S, W = 3, 7, 40
    before = torch.randint(-2 ** 62, 2 ** 62, (L, S, W), dtype=torch.int64, generator=gen)
    cases = {"none": [], "first byte, first layer": [(0, 2, 0)], "last byte, last layer": [(L - 1, S - 1, 8 * W - 1)],
             "several slots": [(1, 0, 17), (2, 4, 100), (0, 4, 3), (1, 6, 8 * W - 8)]}
    for what, changes in cases.items():
        now = before.clone()
        raw = now.view(torch.uint8).view(L, S, 8 * W)
        for l, s, byte in changes:
            raw[l, s, byte] ^= 0x10
        want = torch.zeros(S, dtype=torch.bool)
        want[[s for _, s, _ in changes]] = True
        got = native.changed_slots(now, before)
        monkeypatch.setattr(kernels, "USE_NATIVE", False)
        torch_path = _changed_slots(now, before, torch.empty(now.shape, dtype=torch.bool))
        monkeypatch.setattr(kernels, "USE_NATIVE", True)
        assert torch.equal(got, want) and torch.equal(torch_path, want), what
        calls = []
        real = native.changed_slots
        monkeypatch.setattr(native, "changed_slots", lambda *a: calls.append(1) or real(*a))
        assert torch.equal(_changed_slots(now, before, torch.empty(now.shape, dtype=torch.bool)), want), what
        assert calls == [1], "the slot guard's comparison did not take the C kernel on plain CPU tensors"
        monkeypatch.setattr(native, "changed_slots", real)
    bf16 = torch.zeros(L, S, 5, dtype=torch.bfloat16)  # a slot of 10 bytes: not whole words
    changed = bf16.clone()
    changed[L - 1, 3, 4] = 1.0
    assert native.changed_slots(changed, bf16).nonzero().flatten().tolist() == [3]
    with pytest.raises(ValueError, match="changed_slots"):
        native.changed_slots(before, before[:, :-1].contiguous())
    with pytest.raises(ValueError, match="dense CPU"):
        native.changed_slots(before.transpose(0, 1), before.transpose(0, 1))


CONV_DTYPES = [BF16, F32, torch.float64]


def _conv_case(seed: int, L=2, N=5, D=4, C=48, Kc=4, dtypes=(BF16, BF16, BF16), scale=1.0):
    """window [L, N, Kc-1, C] (a strided view of a wider buffer, as conv_verify passes it), x [L, N, D, C]
    (channel-major storage for odd seeds) and weight [L, C, Kc] in the given dtypes."""
    gen = torch.Generator().manual_seed(seed)
    wd, xd, wtd = dtypes
    window = (torch.randn(L, N, Kc + 2, C, generator=gen) * scale).to(wd)[:, :, 3:]
    x = (torch.randn(L, N, D, C, generator=gen) * scale).to(xd)
    if seed % 2:
        x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
    weight = torch.randn(L, C, Kc, generator=gen).to(wtd)
    return window, x, weight


def _torch_conv_mix(monkeypatch, *args) -> torch.Tensor:
    monkeypatch.setattr(kernels, "USE_NATIVE", False)
    try:
        return kernels.conv_mix(*args)
    finally:
        monkeypatch.setattr(kernels, "USE_NATIVE", True)


@pytest.mark.parametrize("dtypes", [(BF16, BF16, BF16), (torch.float64, torch.float64, BF16), (F32, BF16, F32),
                                    (BF16, torch.float64, torch.float64)], ids=["bf16", "f64-inputs", "mixed", "f64-x"])
@pytest.mark.parametrize("scale", [1.0, 40.0, 1e-30], ids=["unit", "saturating", "subnormal-range"])
def test_the_native_conv_is_the_torch_conv_bit_for_bit(monkeypatch, dtypes, scale):
    """kernels.conv_mix on plain CPU tensors runs its taps and its SiLU's rounding in C
    (native.conv_taps, native.conv_silu_bf16; torch's exp between them): the same bf16 bits as the
    torch path for every input dtype the conv takes, strided windows, channel-major x, values whose
    SiLU saturates (exp(-acc) overflows to inf: -0.0) and values that round to float32 subnormals or
    zero. Taps are summed in order in both; the equality is exact, no tolerance. A spy asserts the C
    path ran; a conv with its taps the wrong way round differs (the comparison can fail; a SiLU in
    float32 instead of float64 or taps summed in reverse order do not change a bf16 bit here)."""
    calls = []
    real = native.conv_taps
    monkeypatch.setattr(native, "conv_taps", lambda *a: calls.append(1) or real(*a))
    for seed in range(4):
        args = _conv_case(seed, D=[1, 2, 4, 64][seed], dtypes=dtypes, scale=scale)
        got = kernels.conv_mix(*args)
        want = _torch_conv_mix(monkeypatch, *args)
        assert got.dtype == BF16 and same_bits(got, want), (seed, dtypes, scale)
    assert len(calls) == 4, "conv_mix did not take the C kernel on plain CPU tensors"
    window, x, weight = _conv_case(0)
    taps_flipped = _torch_conv_mix(monkeypatch, window, x, weight.flip(-1))  # tap m on token t - m
    assert not same_bits(taps_flipped, kernels.conv_mix(window, x, weight))


def test_a_nan_conv_output_is_rounded_by_torch(monkeypatch):
    """A NaN among the conv's results: the C rounding reports it (native.conv_silu_bf16 returns None) and
    conv_mix rounds that call with torch, whose cast gives a NaN the bits of where it falls in its
    vector loop (0xFFFF in the body, 0x7FC0 in the tail): the same bits as the torch path, inf inputs
    too."""
    window, x, weight = _conv_case(2, C=37, dtypes=(BF16, BF16, BF16))
    x[0, 0, 0, 0], x[1, 2, 1, 36] = float("nan"), float("inf")
    window[0, 1, 0, 5] = float("-inf")
    acc, neg = native.conv_taps(window, x, weight)
    assert native.conv_silu_bf16(acc, neg.exp_()) is None
    got, want = kernels.conv_mix(window, x, weight), _torch_conv_mix(monkeypatch, window, x, weight)
    assert got.float().isnan().any() and same_bits(got, want)


def _torch_store(monkeypatch, dst: torch.Tensor, h: torch.Tensor, key: int, offset: int) -> None:
    monkeypatch.setattr(kernels, "USE_NATIVE", False)
    try:
        kernels.store_state(dst, h, "stochastic", key, offset)
    finally:
        monkeypatch.setattr(kernels, "USE_NATIVE", True)


# keys past 2^32 and negative ones (the hash takes key mod 2^32), offsets past 2^32 (it takes the index mod 2^32)
@pytest.mark.parametrize("key, offset", [(0, 0), (7, 123), (2 ** 40 + 5, 2 ** 33 - 3), (-17, 9)],
                         ids=["zero", "small", "past-2^32", "negative-key"])
def test_the_native_stochastic_store_is_the_torch_store_bit_for_bit(monkeypatch, key, offset):
    """kernels.store_state's stochastic rounding on plain CPU tensors hashes and rounds in C
    (native.stochastic_bf16_bits; the cast to bf16 torch's): the same bf16 bits as its torch ops into a dense and a strided
    destination, over normal values of every scale, both zeros, subnormals, the largest finite floats
    (their rounding up carries into inf) and infinities. The equality is exact, no tolerance. A spy
    asserts the C path ran; a store keyed one off differs (the comparison can fail)."""
    calls = []
    real = native.stochastic_bf16_bits
    monkeypatch.setattr(native, "stochastic_bf16_bits", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(2, 5, 4, 64, 64, generator=gen) * torch.logspace(-40, 38, 64).view(1, 1, 1, 1, 64)
    flat = h.view(-1)
    flat[:8] = torch.tensor([0.0, -0.0, 1e-42, -1e-45, 3.4028235e38, -3.4028235e38, float("inf"), float("-inf")])
    for dst in (torch.empty(2, 5, 4, 64, 64, dtype=BF16), torch.empty(2, 5, 4, 64, 128, dtype=BF16)[..., ::2]):
        want = torch.empty_like(dst)
        kernels.store_state(dst, h, "stochastic", key, offset)
        _torch_store(monkeypatch, want, h, key, offset)
        assert same_bits(dst, want), (key, offset, dst.is_contiguous())
    assert len(calls) == 2, "store_state did not take the C kernel on plain CPU tensors"
    off_by_one = torch.empty_like(want)
    _torch_store(monkeypatch, off_by_one, h, key + 1, offset)
    assert not same_bits(off_by_one, want)


def test_nans_among_stochastic_stores_get_the_bits_torchs_cast_gives_them(monkeypatch):
    """NaNs among the values (the padded rows' states are NaN): C rounds every element, torch's cast turns
    the result into bf16 as on the torch path, where a NaN gets the bits of where it falls in its vector
    loop (0xFFFF in the body, 0x7FC0 in the tail): the same bits, NaNs at both ends of the tensor."""
    h = torch.randn(4, 64, 64, generator=torch.Generator().manual_seed(4))
    h[0, 0, 0], h[3, 63, 63], h[2, 5, 7] = float("nan"), float("nan"), -float("nan")
    got, want = torch.empty(4, 64, 64, dtype=BF16), torch.empty(4, 64, 64, dtype=BF16)
    kernels.store_state(got, h, "stochastic", 11, 0)
    _torch_store(monkeypatch, want, h, 11, 0)
    assert got.float().isnan().sum() == 3 and same_bits(got, want)
