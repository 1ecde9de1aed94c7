"""drift.native: the C kernel behind kernels.gdn_verify on the CPU, against the torch-op path and float64.

Cases store states the way the npu pool layout hands them to the kernel: dense ``[K, V]``
blocks (``pool.ssm_kv``), the scratch a row slice of a larger buffer (``inter_kv[:, :N]``).
Every comparison first asserts that the native path really ran (:func:`native_case`), so a
missing compiler fails here instead of quietly testing the torch path twice. Set
``DRIFT_NATIVE=0`` to opt out of the native kernel (these tests then skip, saying so).

Tolerances: the two paths are both float32 computations of the same recurrence, each within
``conftest.gdn_state_bound`` (tests/test_kernels.py docstring: t (K + 6) u32 (||h|| + ||v||) per
head after t tokens) of the float64 result; so they differ by at most twice that (triangle inequality).
bf16 stores agree except where a rounding boundary separates the two float32 values (a
fraction ~1e-6 / 2^-8 ~ 3e-4 of the elements; 1% allowed, as in test_kernels).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import as_bits, bf16_ulp, same_bits, verify_bounds
from drift.sim import kernels, naive, native

pytestmark = pytest.mark.skipif(not native.enabled(), reason="DRIFT_NATIVE=0 turns the native kernel off")

SLOTS = [4, 1, 6, 0]  # the last row is padded: the dummy slot 0 holds NaN


def make_case(K=32, V=32, L=3, N=4, D=4, HV=3, S=8, state_dtype=torch.bfloat16,
              inter_dtype=torch.bfloat16, seed=0):
    """States ``[L, S, HV, K, V]`` dense, scratch ``[L, N+1, D, HV, K, V]`` (NaN), inputs as the
    simulator feeds them (q, k l2-normalised, q scaled by K^-1/2; decays from 0.4 to 0.999)."""
    gen = torch.Generator().manual_seed(seed)
    state = (torch.randn(L, S, HV, K, V, generator=gen) * 0.3).to(state_dtype)
    state[:, 0] = float("nan")
    inter = torch.full((L, N + 1, D, HV, K, V), float("nan"), dtype=inter_dtype)
    q = F.normalize(torch.randn(L, N, D, HV, K, generator=gen), dim=-1) * K ** -0.5
    k = F.normalize(torch.randn(L, N, D, HV, K, generator=gen), dim=-1)
    v = torch.randn(L, N, D, HV, V, generator=gen)
    decay = torch.linspace(0.4, 0.999, HV).expand(L, N, D, HV) ** torch.rand(L, N, D, HV, generator=gen)
    beta = torch.rand(L, N, D, HV, generator=gen)
    return state, inter, q, k, v, torch.log(decay), beta


def run_path(path: str, monkeypatch, state, inter, q, k, v, g, beta, **kw):
    """kernels.gdn_verify through ``path`` ('native' or 'torch'); returns (out, scratch rows)."""
    monkeypatch.setattr(kernels, "USE_NATIVE", path == "native")
    scratch = inter[:, : q.shape[1]]
    if path == "native":
        assert native.supports(state, scratch, kw.get("rounding", "rne"), torch.float32), native.status()
    out = kernels.gdn_verify(state, torch.tensor(SLOTS[: q.shape[1]]), q, k, v, g, beta, scratch, **kw)
    return out, scratch


@pytest.mark.parametrize("K,V", [(32, 32), (16, 80), (128, 128)])  # V=80: not a multiple of 16 lanes
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
def test_native_matches_float64_and_the_torch_path(monkeypatch, K, V, state_dtype):
    L = 1 if K == 128 else 3
    state, inter32, q, k, v, g, beta = make_case(K, V, L=L, state_dtype=state_dtype, inter_dtype=torch.float32)
    before = state.clone()
    out_n, got_n = run_path("native", monkeypatch, state, inter32, q, k, v, g, beta)
    assert same_bits(state, before)  # verify never writes the committed state
    assert torch.isnan(inter32[:, -1]).all()  # the spare scratch row is untouched
    out_t, got_t = run_path("torch", monkeypatch, state, inter32.clone(), q, k, v, g, beta)
    n = len(SLOTS) - 1
    ref, ref_out = naive.gdn_verify(state[:, SLOTS[:n]], q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n])
    bound, out_bound = verify_bounds(ref, v[:, :n])
    err_n = (got_n[:, :n].double() - ref).norm(dim=(-1, -2))
    assert (err_n <= bound).all(), f"native state error {err_n.max():.3g} > bound {bound.min():.3g}"
    assert ((got_n[:, :n].double() - got_t[:, :n].double()).norm(dim=(-1, -2)) <= 2 * bound).all()
    assert ((out_n[:, :n].double() - ref_out).norm(dim=-1) <= out_bound).all()
    assert ((out_n[:, :n] - out_t[:, :n]).double().norm(dim=-1) <= 2 * out_bound).all()
    # The padded row computes from the NaN dummy, as the torch path does: visible, not skipped.
    assert torch.isnan(out_n[:, n:]).all() and torch.isnan(got_n[:, n:]).all()


def test_native_bf16_stores_are_torch_casts_of_its_float32_states(monkeypatch):
    """Same kernel, same arithmetic, two scratch dtypes: the bf16 scratch must hold exactly
    torch's round-to-nearest-even cast of the float32 one, NaN included."""
    state, inter32, q, k, v, g, beta = make_case(inter_dtype=torch.float32)
    _, inter16, *_ = make_case(inter_dtype=torch.bfloat16)
    out32, s32 = run_path("native", monkeypatch, state, inter32, q, k, v, g, beta)
    out16, s16 = run_path("native", monkeypatch, state, inter16, q, k, v, g, beta)
    assert same_bits(s16, s32.to(torch.bfloat16))
    assert torch.equal(out16.nan_to_num(7.0), out32.nan_to_num(7.0))  # outputs use the fp32 state


def test_native_and_torch_bf16_stores_agree_but_for_rounding_boundaries(monkeypatch):
    state, inter, q, k, v, g, beta = make_case()
    _, s_n = run_path("native", monkeypatch, state, inter, q, k, v, g, beta)
    _, s_t = run_path("torch", monkeypatch, state, inter.clone(), q, k, v, g, beta)
    a, b = s_n[:, :-1].double(), s_t[:, :-1].double()
    diff = (a - b).abs()
    assert (diff <= bf16_ulp(torch.maximum(a.abs(), b.abs()))).all()
    assert (diff > 0).double().mean() < 0.01


def test_a_beta_rounded_to_bf16_is_caught(monkeypatch):
    """Negative control: the same comparison sees a bf16-class input error (vLLM #53877)
    in the native result; the float32 bound is not so loose that it hides one."""
    state, inter, q, k, v, g, beta = make_case(inter_dtype=torch.float32)
    _, good = run_path("native", monkeypatch, state, inter, q, k, v, g, beta)
    _, bad = run_path("native", monkeypatch, state, inter.clone(), q, k, v, g,
                      beta.to(torch.bfloat16).float())
    n = len(SLOTS) - 1
    ref, _ = naive.gdn_verify(state[:, SLOTS[:n]], q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n])
    bound, _ = verify_bounds(ref, v[:, :n])
    assert ((good[:, :n].double() - ref).norm(dim=(-1, -2)) <= bound).all()
    assert ((bad[:, :n].double() - ref).norm(dim=(-1, -2)) > bound).any()


def test_native_bits_do_not_depend_on_the_thread_count(monkeypatch):
    state, inter, q, k, v, g, beta = make_case(L=5)
    runs = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(torch, "get_num_threads", lambda t=threads: t)
        out, s = run_path("native", monkeypatch, state, inter.clone(), q, k, v, g, beta)
        runs.append((as_bits(out), as_bits(s)))
    for out, s in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(s, runs[0][1])


def test_what_the_native_kernel_leaves_to_the_torch_path():
    state, inter, *_ = make_case()
    scratch = inter[:, :4]
    assert native.supports(state, scratch, "rne", torch.float32)
    assert not native.supports(state, scratch, "stochastic", torch.float32)  # bf16 SR: torch path
    assert native.supports(state, inter.float()[:, :4], "stochastic", torch.float32)  # fp32: exact store
    assert not native.supports(state, scratch, "rne", torch.float64)
    assert not native.supports(state.transpose(-1, -2), scratch, "rne", torch.float32)  # [V, K] storage
    assert not native.supports(state.half(), scratch, "rne", torch.float32)


def test_native_rejects_inconsistent_shapes():
    state, inter, q, k, v, g, beta = make_case()
    f32 = [t.contiguous() for t in (q, k, v, torch.exp(g), beta)]
    out = torch.empty_like(f32[2])
    with pytest.raises(ValueError, match="inconsistent shapes"):
        native.gdn_verify(state, [4, 1, 6, 99], *f32, inter[:, :4], out)  # slot 99 is not in the pool
    with pytest.raises(ValueError, match="inconsistent shapes"):
        native.gdn_verify(state, SLOTS, *f32, inter[:, :3], out)
    with pytest.raises(ValueError, match="inconsistent shapes"):  # v too short: would read past it
        native.gdn_verify(state, SLOTS, f32[0], f32[1], f32[2][..., :-1].contiguous(), *f32[3:], inter[:, :4], out)
    with pytest.raises(ValueError, match="inconsistent shapes"):
        native.gdn_verify(state, SLOTS, *f32[:3], f32[3][:, :, :2].contiguous(), f32[4], inter[:, :4], out)
    with pytest.raises(ValueError, match="dense float32"):
        native.gdn_verify(state, SLOTS, *f32[:4], beta.double(), inter[:, :4], out)


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
    assert sorted(p.name for p in tmp_path.iterdir()) == libs  # no temporary files left behind
