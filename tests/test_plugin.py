"""Issue 6: drift against the code that ships -- the SGLang-style method from a file spec, the
pytest plugin run from another directory, device markers, and the NPU verify-op adapter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from drift.sim import kernels
from drift.config import preset
from drift.errors import LoadError
from drift.runner import run_checked
from drift.plug.loader import load_kernel
from drift.plug.npu_op import npu_op_adapter

FIXTURES = Path(__file__).resolve().parent / "fixtures"
METHOD = "AscendHybridLinearAttnBackend.update_mamba_state_after_mtp_verify"
GOOD = f"{FIXTURES / 'ascend_backend.py'}:{METHOD}"
FAKE_OP = f"npu-op:{FIXTURES / 'fake_npu_op.py'}:recurrent_gated_delta_rule"
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """A copy of the good fixture broken the way a refactor might: the working slot's conv
    window is rolled back before it is copied into the track slot."""
    src = (FIXTURES / "ascend_backend.py").read_text()
    rollback = "        conv_state_rollback(conv_states, dst, last_steps, draft_token_num)\n"
    anchor = "        draft_token_num = intermediate.shape[2]\n"
    assert src.count(rollback) == 1 and src.count(anchor) == 1
    bad = src.replace(rollback, "").replace(anchor, anchor + rollback)
    path = tmp_path_factory.mktemp("broken") / "ascend_backend_broken.py"
    path.write_text(bad)
    return f"{path}:{METHOD}"


def by_name(rep):
    return {c.name: c for c in rep.checks}


def test_sglang_style_method_passes_every_check():
    rep = run_checked(preset("ci-small"), GOOD, steps=1024)
    assert rep.passed, [c.to_dict() for c in rep.checks if c.failed]
    assert by_name(rep)["host syncs"].passed and by_name(rep)["golden"].verdict == "PASS"


def test_broken_copy_of_it_fails_tracked_snapshots(broken):
    rep = run_checked(preset("ci-small"), broken, steps=256)
    checks = by_name(rep)
    assert not checks["tracked snapshots"].passed
    assert "conv window" in checks["tracked snapshots"].detail
    assert checks["committed state"].passed  # the commit itself is right


def _pytest(*args, cwd):
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)


def test_engine_ci_runs_the_gate_with_its_own_update(tmp_path, broken):
    """What an engine's CI does: pytest --pyargs drift from its own repository."""
    ok = _pytest("--pyargs", "drift", "--drift-update", GOOD, "--drift-steps", "256", cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout[-3000:]
    assert "3 passed" in ok.stdout and "skipped" in ok.stdout  # precision + 2 sync tests; cuda/npu skip
    bad = _pytest("--pyargs", "drift", "--drift-update", broken, "--drift-steps", "256",
                  "-k", "precision", cwd=tmp_path)
    assert bad.returncode == 1 and "tracked snapshots" in bad.stdout


def test_device_marker_skips_unless_asked_and_fails_when_absent(tmp_path):
    if torch.cuda.is_available():
        pytest.fail("this test needs a machine without CUDA (it checks the absent-device path)")
    skipped = _pytest("--pyargs", "drift", "-k", "cuda", "-rs", cwd=tmp_path)
    assert skipped.returncode == 0 and "did not ask for (--drift-device cuda)" in skipped.stdout
    asked = _pytest("--pyargs", "drift", "-k", "cuda", "--drift-device", "cuda", cwd=tmp_path)
    assert asked.returncode == 1 and "was asked for but is absent" in asked.stdout


def test_npu_adapter_maps_onto_the_op_layout():
    """The adapter around a CPU stand-in of npu_recurrent_gated_delta_rule reproduces drift's
    kernel given the same bf16 inputs (the op's only dtype)."""
    g = torch.Generator().manual_seed(3)
    L, S, N, D, HV, K, V = 2, 6, 3, 4, 2, 16, 16
    state = torch.randn(L, S, HV, K, V, generator=g).to(BF16)
    slots = torch.tensor([4, 1, 0])
    q = torch.nn.functional.normalize(torch.randn(L, N, D, HV, K, generator=g), dim=-1).to(BF16).float()
    k = torch.nn.functional.normalize(torch.randn(L, N, D, HV, K, generator=g), dim=-1).to(BF16).float()
    v = torch.randn(L, N, D, HV, V, generator=g).to(BF16).float()
    gg = -torch.rand(L, N, D, HV, generator=g)
    beta = torch.rand(L, N, D, HV, generator=g).to(BF16).float()
    ref_inter = torch.zeros(L, N, D, HV, K, V, dtype=BF16)
    ref_out = kernels.gdn_verify(state, slots, q, k, v, gg, beta, ref_inter)
    inter = torch.zeros(L, N, D, HV, K, V, dtype=BF16)
    out = load_kernel(FAKE_OP)(state, slots, q, k, v, gg, beta, inter)
    # Same math in fp32 in another order: intermediates agree to one bf16 rounding (a value
    # on the other side of a rounding boundary), outputs to the op's bf16 output rounding.
    torch.testing.assert_close(inter.float(), ref_inter.float(), rtol=2 ** -7, atol=1e-3)
    torch.testing.assert_close(out, ref_out, rtol=2 ** -7, atol=2e-3)
    # Negative control: a layout mix-up (states passed as [K, V] instead of the op's [V, K]).
    wrong = npu_op_adapter(_fake_op_transposed)
    inter_w = torch.zeros_like(inter)
    wrong(state, slots, q, k, v, gg, beta, inter_w)
    assert (inter_w.float() - ref_inter.float()).abs().max() > 0.1


def _fake_op_transposed(query, key, value, state, **kw):
    from drift.plug.specs import resolve_spec

    op = resolve_spec(FAKE_OP[len("npu-op:"):], "kernel")
    st = state.transpose(-1, -2).contiguous()  # reads the blocks as [K, V]
    out = op(query, key, value, st, **kw)
    state.copy_(st.transpose(-1, -2))
    return out


def test_simulation_through_the_npu_adapter():
    """Semantics pass through the adapter; the op's bf16 inputs (beta among them, vLLM
    #53877's class) are what the drift bound then judges."""
    rep = run_checked(preset("ci-small"), "sglang-0.5.23", steps=256, verify_kernel=load_kernel(FAKE_OP),
                      sync_scan=False)
    checks = by_name(rep)
    for name in ("finite states", "golden", "committed state", "conv windows", "tracked snapshots",
                 "untouched slots"):
        assert checks[name].passed, checks[name].to_dict()


def test_kernel_specs_fail_clearly():
    with pytest.raises(LoadError, match="NPU"):
        load_kernel("npu")
    with pytest.raises(LoadError, match="not a kernel mutant"):
        load_kernel("mutant:step_plus1")
    with pytest.raises(LoadError, match="not found"):
        load_kernel("nowhere.py:f")
    assert load_kernel(None) is kernels.gdn_verify and load_kernel("portable") is kernels.gdn_verify
