"""drift's PR gate for the code under test: ``pytest --pyargs drift [--drift-update SPEC ...]``.

Every implementation named with --drift-update (default: the built-in sglang-0.5.23) gets
the full PR-gating checks on --drift-preset (default: each of drift.config.GATE_PRESETS, ci-small
and ci-heads -- 2 key heads over 4 value heads, D = 2): precision against golden over the preset's
horizon, and freedom from host syncs with tracking on and off. Tests
marked ``cuda`` / ``npu`` run the same on that device when --drift-device asks for it.
"""

from __future__ import annotations

import sys

import pytest

from drift.gate_ahead import failures_text
from drift.runner import run_checked
from drift.syncs.detector import SyncDetector
from drift.syncs.scan import RUN_SAMPLE, sync_check


# First (pytest runs a module's tests in order; with -x a sync stops the gate in seconds): the
# scan's representative steps plus real steps sampled over the preset's horizon.
@pytest.mark.parametrize("tracking", [True, False], ids=["tracking", "no-tracking"])
def test_update_is_sync_free(drift_run, tracking):
    if tracking and drift_run.cfg.track_interval == 0:  # --drift-track-interval 0: the no-tracking test is this one
        pytest.skip("tracking is off in this run (--drift-track-interval 0): the no-tracking test scans it")
    run = drift_run if tracking else drift_run.replace(track_interval=0)
    res = sync_check(run.replace(device="cpu"), sample=RUN_SAMPLE)
    if not res.applicable:  # an engine's objects on real device buffers, and no accelerator here: said, not passed
        pytest.skip(res.detail)
    if not res.passed:  # drift's message alone (an assert would print the result's repr too)
        pytest.fail(f"{run.update.spec}: {res.where}; {res.detail}", pytrace=False)


def test_update_keeps_precision(drift_run, drift_golden, drift_fail_fast, drift_progress, drift_ahead):
    drift_golden(drift_run.cfg)  # PR-gating presets must have golden data; fails, never skips
    outcome = drift_ahead()  # the same run made while the sync tests ran (drift/gate_ahead.py), where it was
    if outcome is None:
        rep = run_checked(drift_run, sync_scan=False, fail_fast=drift_fail_fast, progress=drift_progress)
        passed, failures = rep.passed, failures_text(rep)
    else:
        passed, failures, said = outcome
        sys.stdout.write(said)  # what the run wrote there: this test's captured output
    if not passed:  # drift's message alone (an assert would print the whole RunReport's repr too)
        pytest.fail(f"{drift_run.update.spec}: {failures}", pytrace=False)


def _device_run(run):
    cfg = run.cfg
    rep = run_checked(run.replace(steps=min(cfg.steps, 512)), sync_scan=False)
    assert rep.info.device.startswith(cfg.device), rep.info.device
    assert rep.passed, f"{run.update.spec} on {cfg.device}: {failures_text(rep)}"


@pytest.mark.cuda
def test_cuda_simulation_and_sync_debug_mode(drift_run):
    """The CUDA path: the simulation on the GPU, and the update under the sync detector with
    torch.cuda.set_sync_debug_mode('error') armed."""
    _device_run(drift_run)
    res = sync_check(drift_run)
    assert any("cuda" in d for d in res.extra["detectors"]), res.extra["detectors"]
    assert res.passed, res.detail
    import torch

    det = SyncDetector()
    with det:
        torch.ones(2, device="cuda").sum().item()  # a positive control on the real device
    assert det.report.events, "the CUDA sync detector missed .item()"


@pytest.mark.npu
def test_npu_simulation_and_sync_debug_mode(drift_run):
    """The NPU path: the simulation on the NPU (real sgl_kernel_npu kernels when installed),
    and the update under torch.npu.set_sync_debug_mode('error')."""
    _device_run(drift_run)
    res = sync_check(drift_run)
    assert any("npu" in d for d in res.extra["detectors"]), res.extra["detectors"]
    assert res.passed, res.detail
