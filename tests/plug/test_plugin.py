"""drift against the code that ships -- the SGLang-style method from a file spec, the
pytest plugin run from another directory, device markers, and the NPU verify-op adapter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dataclasses import replace

import pytest
import torch

from drift.flows.copy_commit.rule import NpuRule
from drift.sim import kernels
from drift.config import GATE_PRESETS, preset
from drift.flows.registry import FLOWS
from drift.dtypes import as_bits
from drift.errors import LoadError
from drift.runner import run_checked
from drift.runspec import resolve
from drift.plug.loader import load_kernel
from drift.plug.npu_op import npu_op_adapter
from drift.sim.kernels import VerifyArgs
from drift.check.registry import CHECKS

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
METHOD = "AscendHybridLinearAttnBackend.update_mamba_state_after_mtp_verify"
GOOD = f"{FIXTURES / 'ascend_backend.py'}:{METHOD}"
FAKE_OP = f"npu-op:{FIXTURES / 'fake_npu_op.py'}:recurrent_gated_delta_rule"
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """A copy of the good fixture broken the way a refactor might: the conv windows are rolled
    back before the track step, so the working slot's rolled-back window is what it copies into
    the track slot."""
    src = (FIXTURES / "ascend_backend.py").read_text()
    rollback = "        rollback_rows(batch)\n"
    anchor = "        commit_all(batch)\n"
    assert src.count(rollback) == 1 and src.count(anchor) == 1
    bad = src.replace(rollback, "").replace(anchor, anchor + rollback)
    path = tmp_path_factory.mktemp("broken") / "ascend_backend_broken.py"
    path.write_text(bad)
    return f"{path}:{METHOD}"


def by_name(rep):
    return {c.key: c for c in rep.checks}


# The PR suite's horizon, and the nightly twin's (as tests/check/test_precision.py).
@pytest.mark.parametrize("steps", [512, pytest.param(4096, marks=pytest.mark.nightly)])
def test_sglang_style_method_passes_every_check(steps):
    rep = run_checked(resolve(preset("ci-small"), GOOD), steps=steps)
    assert rep.passed, [c.to_dict() for c in rep.checks if c.failed]
    assert by_name(rep)["host_syncs"].passed and by_name(rep)["golden"].verdict == "PASS"


# The plug-in machinery, not the horizon: the broken copy shows at the first tracking event (step
# 1); 64 steps are four track intervals of ci-small at the least acceptance (drift/jobs/teeth.py).
WIRING_STEPS = 64


def test_broken_copy_of_it_fails_tracked_snapshots(broken):
    rep = run_checked(resolve(preset("ci-small"), broken), steps=WIRING_STEPS)
    checks = by_name(rep)
    assert not checks["tracked_snapshots"].passed
    assert "conv window" in checks["tracked_snapshots"].detail
    assert checks["committed_state"].passed  # the commit itself is right


def _pytest(*args, cwd):
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)


def test_engine_ci_runs_the_gate_with_its_own_update(tmp_path, broken):
    """What an engine's CI does: pytest --pyargs drift from its own repository, here with two
    updates in one run (--drift-update repeats): SGLang's method passes all three gate tests on both
    gate shapes, the broken copy of it fails precision only (its syncs are the same)."""
    run = _pytest("--pyargs", "drift", "--drift-update", GOOD, "--drift-update", broken, "--drift-steps",
                  str(WIRING_STEPS), "-rfs", cwd=tmp_path)
    assert run.returncode == 1, run.stdout[-3000:]
    # each gate test on each of the gate's shapes (GATE_PRESETS): the broken copy fails precision on both
    assert "2 failed, 10 passed" in run.stdout and "skipped" in run.stdout, run.stdout[-3000:]  # cuda/npu skip
    failed = [line for line in run.stdout.splitlines() if line.startswith("FAILED")]
    assert [p for p in GATE_PRESETS if any(f"test_update_keeps_precision[{p}-" in f for f in failed)] \
        == list(GATE_PRESETS) and len(failed) == 2, failed
    assert CHECKS.title("tracked_snapshots") in run.stdout
    assert "ascend_backend_broken.py" in run.stdout  # the failure names the broken copy's file
    if not torch.cuda.is_available():  # a device nobody asked for skips, naming it
        assert "did not ask for (--drift-device cuda)" in run.stdout


def test_device_marker_fails_when_asked_and_absent(tmp_path):
    """(That it skips, naming the device, unless asked: the engine-CI test above.)"""
    if torch.cuda.is_available():
        pytest.fail("this test needs a machine without CUDA (it checks the absent-device path)")
    asked = _pytest("--pyargs", "drift", "-k", "cuda", "--drift-device", "cuda", cwd=tmp_path)
    # drift run exits 2 for an absent device: a usage error before any test runs (exit 4)
    assert asked.returncode == 4 and "drift: error: device='cuda' requested" in asked.stdout + asked.stderr, asked


# A test that records, in the process that runs it, what drift's plugin left for OpenMP.
OPENMP_PROBE = """
import json, os, torch
def test_probe(tmp_path_factory):
    facts = {"policy": os.environ.get("OMP_WAIT_POLICY"), "threads": torch.get_num_threads()}
    with open(os.environ["PROBE_OUT"], "a") as f:
        f.write(json.dumps({"worker": os.environ.get("PYTEST_XDIST_WORKER"), **facts}) + "\\n")
"""


def _openmp_probe(tmp_path, policy, argv):
    """Run the probe test under ``argv`` with ``OMP_WAIT_POLICY`` ``policy`` (None: unset) and no
    thread setting inherited; returns (the probe's facts, the run). OMP_DISPLAY_ENV=VERBOSE has
    GNU OpenMP print, in each process, what it read when torch loaded it (GOMP_SPINCOUNT 0 passive)."""
    (tmp_path / "test_probe.py").write_text(OPENMP_PROBE)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMP_", "PYTEST_XDIST_")) and k != "PYTEST_ADDOPTS"}
    env.update({"PROBE_OUT": str(tmp_path / "probe.jsonl"), "OMP_DISPLAY_ENV": "VERBOSE"},
               **({"OMP_WAIT_POLICY": policy} if policy else {}))
    run = subprocess.run([sys.executable, *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    import json

    return [json.loads(line) for line in (tmp_path / "probe.jsonl").read_text().splitlines()], run


def _gnu_openmp() -> bool:
    """torch runs GNU OpenMP (libgomp) in this process (Linux: its mapped libraries)."""
    maps = Path("/proc/self/maps")
    return maps.exists() and "libgomp" in maps.read_text()


@pytest.mark.parametrize("policy", [None, "ACTIVE"], ids=["unset", "the-users-active"])
def test_the_gate_lets_idle_openmp_threads_sleep_in_every_xdist_worker(tmp_path, policy):
    """pytest-xdist workers import the plugin afresh: OMP_WAIT_POLICY reaches the worker that runs
    the test, and the OpenMP runtime of every process read it. The user's ACTIVE stands (control)."""
    [probe], run = _openmp_probe(tmp_path, policy, ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "1",
                                                    "test_probe.py"])
    assert probe["worker"] == "gw0" and probe["policy"] == (policy or "PASSIVE"), probe
    spins = [line.split("=")[1].strip() for line in run.stderr.splitlines() if "GOMP_SPINCOUNT" in line]
    if _gnu_openmp():  # what GNU OpenMP itself read, in the controller and the worker
        assert len(spins) >= 2 and set(spins) == ({"'0'"} if policy is None else {"'30000000000'"}), spins


@pytest.mark.parametrize("policy", [None, "ACTIVE"], ids=["unset", "the-users-active"])
def test_the_gate_takes_one_openmp_thread_where_torch_was_imported_before_it(tmp_path, policy):
    """torch loaded (two threads) before pytest imports the plugin: too late for the environment in
    this process, so one intra-op thread; the user's ACTIVE keeps both (control)."""
    code = ("import sys, torch, pytest; torch.set_num_threads(2); "
            "sys.exit(pytest.main(['-p', 'no:cacheprovider', 'test_probe.py']))")
    [probe], run = _openmp_probe(tmp_path, policy, ["-c", code])
    assert probe == {"worker": None, "policy": policy or "PASSIVE", "threads": 1 if policy is None else 2}, probe
    assert ("1 intra-op thread" in run.stdout) == (policy is None), run.stdout[:2000]


# A test that records, in the process that runs it, MKL's code path and what the environment says of it.
MKL_PROBE = """
import json, os, torch
from drift.mkl import mkl_mode
def test_probe():
    a = torch.ones(16, 16); a @ a
    with open(os.environ["PROBE_OUT"], "a") as f:
        f.write(json.dumps({"worker": os.environ.get("PYTEST_XDIST_WORKER"), "env": os.environ.get("MKL_CBWR"),
                            "mode": mkl_mode()}) + "\\n")
"""


@pytest.mark.parametrize("session, users, pinned", [
    (["test_probe.py"], None, False),  # another project's session: its numbers are its own
    (["test_probe.py", "--drift-steps", "8"], None, True),  # a drift option makes it drift's
    (["test_probe.py", "--drift-steps", "8", "-n", "1"], None, True),  # and its xdist worker's
    (["test_probe.py", "--drift-steps", "8"], "AVX2", False),  # the user's choice stands
], ids=["other-project", "drift-option", "drift-option-xdist", "the-users-choice"])
def test_the_plugin_pins_mkl_in_drifts_sessions_only(tmp_path, session, users, pinned):
    """drift's pytest sessions run MKL on the code path every x86 CPU shares (drift/mkl.py), set before any
    test computes and reaching xdist's workers; a session that is not drift's, where the plugin is merely
    installed, keeps MKL's own choice, and so does a user who set MKL_CBWR."""
    (tmp_path / "test_probe.py").write_text(MKL_PROBE)
    env = {k: v for k, v in os.environ.items() if k not in ("MKL_CBWR", "PYTEST_ADDOPTS")
           and not k.startswith("PYTEST_XDIST_")}
    env.update({"PROBE_OUT": str(tmp_path / "probe.jsonl")}, **({"MKL_CBWR": users} if users else {}))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *session], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    import json

    [probe] = [json.loads(line) for line in (tmp_path / "probe.jsonl").read_text().splitlines()]
    assert probe["worker"] == ("gw0" if "-n" in session else None)
    if probe["mode"] == "none":  # a torch without MKL: nothing to pin, the environment still says it
        assert probe["env"] == ("COMPATIBLE" if pinned else users)
    elif pinned:
        assert probe == {**probe, "env": "COMPATIBLE", "mode": "COMPATIBLE"}
    else:  # MKL's own path, or the user's: on a CPU not Intel's, MKL reads an Intel path's name back as AUTO
        # (an AMD EPYC, family 26: MKL_CBWR=AVX2 reads back AUTO), so the user's name or AUTO, never drift's pin
        assert probe["env"] == users and probe["mode"] in {users or "AUTO", "AUTO"}, probe


@pytest.mark.parametrize("args, pyargs, drifts", [
    (["drift"], True, True), (["drift.test_gate"], True, True), (["drift::test_gate.py"], True, True),
    (["drift"], False, False),  # a folder named drift, not the package
    (["drifter"], True, False), (["tests"], True, False), ([], False, False),
])
def test_a_session_is_drifts_when_it_names_drifts_package(args, pyargs, drifts):
    """What the MKL pin and the xdist preflight key on (``--drift-*`` options: the live test above)."""
    from drift import pytest_plugin

    class Config:
        def __init__(self):
            self.args = args

        def getoption(self, name, default=None):
            return pyargs if name == "pyargs" else default

    assert pytest_plugin._drifts_session(Config()) is drifts
    # the same rule on the raw command line, read at import (the OpenBLAS default, before numpy loads)
    assert pytest_plugin.drifts_command_line((["--pyargs"] if pyargs else []) + args + ["-q"]) is drifts


@pytest.mark.parametrize("argv, drifts", [
    (["-q", "--drift-steps", "512", "tests"], True), (["--drift-update=x:y"], True),
    (["-q", "tests/test_drift_things.py"], False), (["--pyargs", "drifter", "--drift"], False),
])
def test_the_command_line_is_drifts_with_a_drift_option(argv, drifts):
    from drift import pytest_plugin

    assert pytest_plugin.drifts_command_line(argv) is drifts


FAKE_LEGACY = FIXTURES / "fake_legacy_npu_op.py"


def _op_case(seed=3, L=2, slots=7, B=3, S=4, HK=1, HV=2, K=16, V=16):
    """VerifyArgs over a small random pool, built as SGLang's Ascend backend builds them."""
    g = torch.Generator().manual_seed(seed)
    C = 2 * HK * K + HV * V
    rec = torch.randn(L, slots, HV, V, K, generator=g).to(BF16)
    inter = torch.randn(L, B + 1, S, HV, V, K, generator=g).to(BF16)
    args = VerifyArgs(torch.randn(L, B, S, C, generator=g).to(BF16), torch.randn(L, B, S, HV, generator=g).to(BF16),
                      -torch.rand(L, B, S, HV, generator=g), rec, inter, torch.tensor([4, 1, 0], dtype=torch.int32),
                      torch.arange(B * S, dtype=torch.int32).view(B, S), torch.ones(B, dtype=torch.int32),
                      torch.full((B,), S, dtype=torch.int32), HK, HV, K ** -0.5, rule=NpuRule())
    return args


def _clone(args):
    return replace(args, recurrent_state=args.recurrent_state.clone(), intermediate_state=args.intermediate_state.clone())


@pytest.mark.parametrize("num_accepted", [[1, 1, 1], [3, 1, 4]], ids=["sglang-flow", "accepted-flow"])
def test_npu_adapter_calls_the_op_as_sglang_does(num_accepted):
    """npu-op:<stand-in> through the adapter gives drift's portable op's results (states within one
    bf16 rounding, outputs within the bf16 output rounding: the same fp32 math summed in another
    order); and each call gets exactly what ascend_gdn_backend.py passes."""
    ref = _op_case()
    ref = replace(ref, num_accepted_tokens=torch.tensor(num_accepted, dtype=torch.int32))
    got = _clone(ref)
    ref_out = kernels.recurrent_gated_delta_rule(ref)
    calls = []

    def spy(*a, **kw):
        calls.append((a, kw))
        return load_kernel_op()(*a, **kw)

    out = npu_op_adapter(spy)(got)
    # Same math in fp32 in another order: a stored state can land on the other side of a bf16
    # rounding boundary (one bf16 ulp, 2^-7 relative at most); outputs likewise.
    torch.testing.assert_close(got.intermediate_state.float(), ref.intermediate_state.float(), rtol=2 ** -7, atol=1e-3)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=2 ** -7, atol=2e-3)
    assert torch.equal(as_bits(got.recurrent_state), as_bits(ref.recurrent_state))  # never written
    L, B, S, HV, V, K = ref.dims
    assert len(calls) == L
    a, kw = calls[0]
    assert a[0].dtype == BF16 and tuple(a[0].shape) == (B, S, ref.mix_qkv.shape[-1]) and a[0].is_contiguous()
    assert tuple(a[1].shape) == (ref.recurrent_state.shape[1], HV, V, K)  # the layer's temporal
    assert kw["beta"].dtype == BF16 and kw["g"].dtype == torch.float32 and kw["scale"] == K ** -0.5
    for name in ("actual_seq_lengths", "ssm_state_indices", "cache_indices", "num_accepted_tokens"):
        assert kw[name].dtype == torch.int32, name
    assert tuple(kw["ssm_state_indices"].shape) == (B, S) and (kw["nk"], kw["nv"]) == (ref.nk, ref.nv)
    assert tuple(kw["intermediate_state"].shape) == ((B + 1) * S, HV, K, V)  # viewed (-1, HV, K, V)
    # Negative control: an op that reads its blocks as [K, V] (the transposed order) is caught.
    wrong = _clone(ref)
    npu_op_adapter(_transposing(load_kernel_op()))(wrong)
    assert (wrong.intermediate_state.float() - ref.intermediate_state.float()).abs().max() > 0.1


def load_kernel_op():
    from drift.plug.specs import resolve_spec

    return resolve_spec(FAKE_OP[len("npu-op:"):], "kernel")


def _transposing(op):
    def run(mix, rec, **kw):
        st = rec.transpose(-1, -2).contiguous()  # reads the blocks as [K, V]
        return op(mix, st, **kw)
    return run


def test_the_stand_in_loses_writes_to_a_non_contiguous_intermediate():
    """op_host copies a non-contiguous intermediate_state before taking its pointer: the op's
    stores land in the copy. The stand-in keeps that (its writes to a transposed view are lost)."""
    args = _op_case()
    op = load_kernel_op()
    inter = args.intermediate_state[0].transpose(-1, -2)  # [rows, S, HV, K, V]: not contiguous
    before = inter.clone()
    op(args.mix_qkv[0], args.recurrent_state[0], beta=args.beta[0], scale=args.scale,
       actual_seq_lengths=args.actual_seq_lengths, ssm_state_indices=args.ssm_state_indices, nk=args.nk,
       nv=args.nv, intermediate_state=inter, cache_indices=args.cache_indices,
       num_accepted_tokens=args.num_accepted_tokens, g=args.g[0])
    assert torch.equal(as_bits(inter), as_bits(before))
    contiguous = args.intermediate_state[0].clone()
    op(args.mix_qkv[0], args.recurrent_state[0], beta=args.beta[0], scale=args.scale,
       actual_seq_lengths=args.actual_seq_lengths, ssm_state_indices=args.ssm_state_indices, nk=args.nk,
       nv=args.nv, intermediate_state=contiguous, cache_indices=args.cache_indices,
       num_accepted_tokens=args.num_accepted_tokens, g=args.g[0])
    assert not torch.equal(as_bits(contiguous), as_bits(args.intermediate_state[0]))  # control


COPY_COMMIT = [f for f in FLOWS if FLOWS[f].kind == "copy-commit"]  # the NPU op's argument rule


def test_the_npu_adapter_is_refused_where_the_flow_reads_arguments_another_way():
    # vLLM's flow hands the op vLLM's block rule, which the NPU op does not implement: exit 2, not a misread
    vllm_like = [f for f in FLOWS if FLOWS[f].kind == "in-place"]
    with pytest.raises(LoadError, match="implements the npu rule, not the blocks rule this flow verifies by: run it under --flow sglang"):
        run_checked(resolve(preset("ci-small", flow=vllm_like[0]), kernel=load_kernel(FAKE_OP)), steps=1, sync_scan=False)


@pytest.mark.parametrize("flow", COPY_COMMIT)
def test_simulation_through_the_npu_adapter(flow):
    """Every check passes through the adapter with the stand-in op, in both flows (a wrong argument
    shows within the first track intervals: WIRING_STEPS)."""
    rep = run_checked(resolve(preset("ci-small", flow=flow), "sglang-0.5.23", kernel=load_kernel(FAKE_OP)), steps=WIRING_STEPS, sync_scan=False)
    assert rep.passed, [c.to_dict() for c in rep.checks if c.failed]
    assert by_name(rep)["golden"].verdict == "PASS"


def test_legacy_adapter_maps_onto_the_older_op():
    """npu-legacy's adapter around a CPU stand-in of torch_npu.npu_recurrent_gated_delta_rule:
    the same states as drift's op but for its post-sigmoid beta in bf16 (the rounding vLLM
    #53877 describes), which moves them by about 2^-9 relative (negative control: not bit-equal)."""
    from drift.plug.npu_op import legacy_adapter
    from drift.plug.specs import resolve_spec

    ref = _op_case()
    got = _clone(ref)
    kernels.recurrent_gated_delta_rule(ref)
    legacy_adapter(resolve_spec(f"{FAKE_LEGACY}:recurrent_gated_delta_rule", "kernel"))(got)
    torch.testing.assert_close(got.intermediate_state.float(), ref.intermediate_state.float(), rtol=2 ** -6, atol=1e-2)
    assert not torch.equal(got.intermediate_state, ref.intermediate_state)


def test_kernel_specs_fail_clearly(cpu_only):
    with pytest.raises(LoadError, match="NPU"):
        load_kernel("npu")
    with pytest.raises(LoadError, match="NPU"):
        load_kernel("npu-legacy")
    with pytest.raises(LoadError, match="not a kernel mutant"):
        load_kernel("mutant:step_plus1")
    with pytest.raises(LoadError, match="not found"):
        load_kernel("nowhere.py:f")
    with pytest.raises(LoadError, match="is not a built-in"):
        load_kernel("portabel")
    assert load_kernel(None).fn is kernels.recurrent_gated_delta_rule
    assert load_kernel("portable").fn is kernels.recurrent_gated_delta_rule


def test_the_gate_runs_one_shape_at_a_time(tmp_path):
    """With -x a regression of the first preset stops the gate before the next preset is scanned: the
    gate's tests run preset by preset (its sync tests, then its precision test), where pytest alone
    would run every preset's sync tests first (the negative control: the order the module defines)."""
    import subprocess
    import sys

    import os

    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}  # as an engine's CI runs it
    out = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "drift", "--collect-only", "-q",
                          "-p", "no:cacheprovider"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env=env).stdout
    ids = [ln for ln in out.splitlines() if ln.startswith("test_gate.py::") and "cuda" not in ln and "npu" not in ln]
    presets = [ln.split("[")[1].split("-the-")[0] for ln in ids]
    assert presets == sorted(presets, key=presets.index) and presets[:3] == ["ci-small"] * 3, ids
    by_function = sorted(ids, key=lambda ln: ("keeps_precision" in ln))
    assert [ln.split("[")[1].split("-the-")[0] for ln in by_function][:3] != ["ci-small"] * 3


def test_the_plugin_narrows_assertion_rewriting_to_the_gate(monkeypatch):
    """pytest marks every module of a pytest11 plugin's wheel for assertion rewriting; the plugin
    unmarks drift and keeps drift.test_gate (drift/pytest_plugin.py: rewrite_only_the_gate), and
    leaves other plugins' marks and hooks of another kind alone."""
    from drift.pytest_plugin import rewrite_only_the_gate

    class AssertionRewritingHook:  # pytest's class name; the function finds it by that
        def __init__(self, marked):
            self._must_rewrite, self._marked_for_rewrite_cache = set(marked), {"drift.sim": True}

    other = type("OtherFinder", (), {"_must_rewrite": {"drift"}})()
    hook = AssertionRewritingHook({"drift", "xdist"})
    monkeypatch.setattr(sys, "meta_path", [other, hook])
    assert rewrite_only_the_gate()
    assert hook._must_rewrite == {"drift.test_gate", "xdist"} and hook._marked_for_rewrite_cache == {}
    assert other._must_rewrite == {"drift"}
    monkeypatch.setattr(sys, "meta_path", [other, AssertionRewritingHook({"xdist"})])
    assert not rewrite_only_the_gate()  # nothing of drift's marked (an editable install): nothing to do


def test_pytest_keeps_the_rewrite_marks_the_plugin_narrows():
    """The narrowing reads a private attribute of pytest's rewrite hook: this pytest still has it,
    so on a wheel install the plugin's narrowing is not a silent no-op."""
    hooks = [h for h in sys.meta_path if type(h).__name__ == "AssertionRewritingHook"]
    assert hooks, "pytest's assertion rewriting hook is not installed (run without --assert=plain)"
    assert all(isinstance(getattr(h, "_must_rewrite", None), set) for h in hooks)


@pytest.mark.parametrize("spec, flow, expected", [
    (None, "vllm", "vllm-0.33.0"), ("plus1_update.py:update", None, "plus1_update.update"),
    ("ci/my_backend.py:Backend.update", None, "my_backend.Backend.update"),
    ("sglang.srt.npu.ascend:Asc.update", None, "ascend.Asc.update"), ("mutant:step_plus1", None, "step_plus1"),
    ("vllm:builder", "vllm", "vllm-builder"), ("sglang-32130", None, "sglang-32130")])
def test_a_gate_tests_id_names_its_update(spec, flow, expected):
    """Two file specs with the same qualname were update0 / update1, and the vllm flow's default the-flows-update
    (a user trial): the id names the file or module and the qualname, or the built-in."""
    from drift.pytest_plugin import update_id

    assert update_id(spec, flow) == expected


def test_with_tracking_off_the_gates_tracking_sync_test_says_the_other_one_scans_it(tmp_path):
    """--drift-track-interval 0: the tracking and no-tracking sync tests would scan the same run twice under
    a misleading id; the tracking one skips saying why, the no-tracking one and the precision test pass."""
    run = _pytest("--pyargs", "drift", "--drift-preset", "ci-small", "--drift-steps", "16", "--drift-lifecycle",
                  "fixed", "--drift-track-interval", "0", "-rs", cwd=tmp_path)
    assert run.returncode == 0 and "2 passed" in run.stdout, run.stdout[-2000:]
    assert "tracking is off in this run (--drift-track-interval 0): the no-tracking test scans it" in run.stdout


# A test module holding, alive to the end, an object in a reference cycle: only a collection frees it.
FREEZE_PROBE = """
import os
{imports}

class Cycle:  # what __del__ needs is its own: the modules may be torn down before the collection
    def __init__(self, path, opener):
        self.path, self.opener, self.me = path, opener, self

    def __del__(self):
        with self.opener(self.path, "w") as f:
            f.write("collected")

held = Cycle(os.environ["PROBE_OUT"], open)

def test_probe():
    pass
"""


@pytest.mark.parametrize("how, frozen", [
    (["-m", "pytest", "test_probe.py", "--drift-steps", "8"], True),  # drift's session, pytest's own process
    (["-m", "pytest", "test_probe.py", "--drift-steps", "8", "-n", "1"], True),  # and its xdist worker
    (["-m", "pytest", "test_probe.py"], False),  # another project's session: its exit is its own
    (["-c", "import sys, pytest; sys.exit(pytest.main(['test_probe.py', '--drift-steps', '8']))"], False),
], ids=["drift-session", "drift-session-xdist", "other-project", "inside-another-program"])
def test_drifts_session_in_a_process_of_its_own_ends_without_the_final_collections(tmp_path, how, frozen):
    """drift's session, in the pytest command's process or an xdist worker, freezes the objects alive at its
    end (drift/process_end.py: Python's final collections, 0.6 s a process, leave them alone); another
    project's session, and one inside a program that goes on (``pytest.main``), are left to Python."""
    (tmp_path / "test_probe.py").write_text(FREEZE_PROBE.format(imports=""))
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS" and not k.startswith("PYTEST_XDIST_")}
    env["PROBE_OUT"] = str(tmp_path / "collected.txt")
    argv = [*how, "-q", "-p", "no:cacheprovider"] if how[0] == "-m" else how
    run = subprocess.run([sys.executable, *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert (tmp_path / "collected.txt").exists() != frozen


def test_a_session_with_nanobinds_objects_keeps_pythons_exit_and_prints_no_leak_report(tmp_path):
    """Where a nanobind extension is loaded (triton's), drift's session exits as Python does: nanobind
    reports every one of its objects alive at the end as a leak (hundreds of stderr lines, seen once),
    and a frozen process leaves them alive."""
    pytest.importorskip("triton", reason="needs the triton extra (pip install '.[triton]'); CI installs it")
    (tmp_path / "test_probe.py").write_text(FREEZE_PROBE.format(imports="import triton"))
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS" and not k.startswith("PYTEST_XDIST_")}
    env["PROBE_OUT"] = str(tmp_path / "collected.txt")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_probe.py",
                          "--drift-steps", "8"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert (tmp_path / "collected.txt").exists()  # not frozen
    assert "leaked" not in run.stdout + run.stderr


def test_nanobind_is_told_by_its_functions_and_classes():
    """drift.process_end.nanobind_loaded: a module holding a function of type ``nb_func`` or a class of type
    ``nb_type_*`` (nanobind's metaclass) is nanobind's; plain modules are not."""
    import types

    from drift.process_end import nanobind_loaded

    nb_func = type("nb_func", (), {})
    nb_meta = type("nb_type_0", (type,), {})
    plain = types.ModuleType("plain")
    plain.f, plain.C = len, type("C", (), {})
    with_func, with_class = types.ModuleType("a"), types.ModuleType("b")
    with_func.f = nb_func()
    with_class.C = nb_meta("C", (), {})
    assert not nanobind_loaded({"plain": plain, "os": os})
    assert nanobind_loaded({"plain": plain, "a": with_func})
    assert nanobind_loaded({"b": with_class})
