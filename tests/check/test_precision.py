"""Precision direction: bf16 drift over thousands of decode steps stays within the
bound derived in docs/bounds.md; known precision failures leave it.

Every run here is checked against the golden trajectory (through the validated float64
twin) at every committed position.
"""

from __future__ import annotations

import numpy as np
import pytest

from drift.check.bounds import GROWTH_LIMIT
from drift.config import preset
from drift.runner import capture_snapshots, run_checked
from drift.runspec import resolve

# Every long-horizon test runs twice: a short twin in the PR suite (its 3-minute budget) and the
# 4,096 steps of the precision gate under the nightly marker (pytest -m nightly), same assertions. The
# stagnation twin needs 1,024 steps to leave the bound (measured below); the others 512.
PR_STEPS, STAGNATION_PR_STEPS, LONG_STEPS = 512, 1024, 4096
HORIZONS = [pytest.param(PR_STEPS, id=f"pr{PR_STEPS}"),
            pytest.param(LONG_STEPS, id=f"long{LONG_STEPS}", marks=pytest.mark.nightly)]
STAGNATION_HORIZONS = [pytest.param(STAGNATION_PR_STEPS, id=f"pr{STAGNATION_PR_STEPS}"),
                       pytest.param(LONG_STEPS, id=f"long{LONG_STEPS}", marks=pytest.mark.nightly)]
FP32_TOL = 1e-5  # fp32 state vs golden (fp32 arithmetic gives ~1e-7 to 1e-6)


def row(rep, name):
    return next(c for c in rep.checks if c.key == name)


def assert_golden_reference(rep):
    g = row(rep, "golden")
    assert g.verdict == "PASS", g.detail
    assert "validated against it" in rep.reference


# The tests using it share one xdist worker (--dist loadgroup), so each horizon's runs happen once.
BF16_RUNS_GROUP = pytest.mark.xdist_group("precision-bf16-runs")


@pytest.fixture(scope="module", params=HORIZONS)
def bf16_runs(request):
    return {impl: run_checked(resolve(preset("ci-small"), impl), steps=request.param, sync_scan=False)
            for impl in ("sglang-32130", "sglang-0.5.23")}


@pytest.mark.parametrize("steps", HORIZONS)
def test_fp32_state_profile_matches_golden(steps):
    rep = run_checked(resolve(preset("ci-small").with_profile("fp32"), "sglang-0.5.23"), steps=steps, sync_scan=False)
    assert_golden_reference(rep)
    state = row(rep, "committed_state")
    assert state.worst is not None and state.worst <= FP32_TOL, state.worst
    assert rep.passed, [c.to_dict() for c in rep.checks if c.failed]


@BF16_RUNS_GROUP
@pytest.mark.parametrize("impl", ["sglang-32130", "sglang-0.5.23"])
def test_bf16_drift_within_bound(bf16_runs, impl):
    rep = bf16_runs[impl]
    assert_golden_reference(rep)
    bound = row(rep, "drift_bound")
    assert bound.passed and 0 < bound.worst <= 1.0, bound.to_dict()
    per_head = np.array(bound.extra["bound"]["worst_ratio_per_head"])
    assert per_head.shape == (2, 4) and (per_head <= 1.0).all()
    growth = row(rep, "growth_exponent")
    assert growth.passed and growth.worst <= GROWTH_LIMIT
    prone = np.array(bound.extra["bound"]["stagnation_prone"])
    assert not prone.any()  # ci-small's slowest head (0.995/token) decays ~1.2% per step
    # Conv windows equal the truth bit for bit at every step; over the long horizon the twin's
    # windows are also compared with golden checkpoints (positions 4096 and 8192 are reached).
    conv = row(rep, "conv_windows")
    assert conv.passed and conv.worst == 0
    if rep.info.steps >= LONG_STEPS:
        assert "0 checkpoints" not in row(rep, "golden").detail
    assert rep.passed


@BF16_RUNS_GROUP
def test_sync_free_and_device_select_commit_identical_states(bf16_runs):
    a, b = bf16_runs["sglang-32130"], bf16_runs["sglang-0.5.23"]
    assert row(a, "committed_state").worst == row(b, "committed_state").worst
    assert row(a, "drift_bound").extra["bound"]["curves"] == row(b, "drift_bound").extra["bound"]["curves"]


@pytest.mark.parametrize("steps", HORIZONS)
def test_mtp_and_sequential_both_bounded_and_divergence_reported(steps):
    cfg = preset("ci-small")
    mtp = run_checked(resolve(cfg, "sglang-0.5.23"), steps=steps, vs_sequential=True, sync_scan=False)
    seq = run_checked(resolve(cfg, mode="sequential"), steps=steps)
    for rep in (mtp, seq):
        assert_golden_reference(rep)
        assert row(rep, "drift_bound").passed and rep.passed
    div = row(mtp, "mtp_vs_sequential")
    assert div.verdict == "info" and div.worst > 0
    # The two errors are independent roundings of the same truth: their difference is at most
    # their sum, and far from zero (MTP rounds once per step, sequential once per token).
    worst_sum = row(mtp, "committed_state").worst + row(seq, "committed_state").worst
    assert div.worst <= worst_sum
    assert row(seq, "committed_state").worst > row(mtp, "committed_state").worst * 0.5


@pytest.mark.parametrize("steps", HORIZONS)
def test_resumed_from_tracked_snapshot_stays_within_bound(steps):
    """Cache hit vs cache miss (sglang #33515): a request that loads the tracked snapshot
    decodes on within the bound, as the original (cache miss) request does."""
    cfg = preset("ci-small")
    original, point, env2 = capture_snapshots(resolve(cfg, "sglang-0.5.23"), after_step=steps // 2, steps=steps)
    assert original.passed and (point.positions % cfg.track_interval == 0).all()
    resumed = run_checked(resolve(cfg, "sglang-0.5.23"), steps=steps // 2, start=point, env2_start=env2, sync_scan=False)
    assert_golden_reference(resumed)
    assert row(resumed, "drift_bound").passed and resumed.passed


# What the stagnation blow-up reaches (bf16 round-to-nearest, sglang-0.5.23, seed 0), measured:
# bound ratio 1.21 / relative error 0.045 at 1,024 steps, ~3 / ~0.35 at 4,096; growth exponent
# 1.28 and ~1.4. The thresholds sit well below each (about half), well above a passing run (bound
# <= 1, error ~0.01, growth <= 0.6).
STAGNATION_FLOOR = {STAGNATION_PR_STEPS: (1.05, 0.02), LONG_STEPS: (2.0, 0.2)}


@pytest.fixture(scope="module", params=STAGNATION_HORIZONS)
def stagnation_rne(request):
    """The stagnation preset's bf16 round-to-nearest run (read by two tests)."""
    return request.param, run_checked(resolve(preset("stagnation"), "sglang-0.5.23"), steps=request.param, sync_scan=False)


def test_stagnation_blow_up_is_measured(stagnation_rne):
    """bf16 round-to-nearest on the stagnation preset: the slow head stops decaying and the
    error grows past the bound, faster than a random walk."""
    steps, rep = stagnation_rne
    bound = row(rep, "drift_bound")
    info = bound.extra["bound"]
    min_ratio, min_error = STAGNATION_FLOOR[steps]
    assert np.array(info["stagnation_prone"]).all()
    assert bound.worst > min_ratio  # past the bound
    assert max(info["growth_exponent"][0]) > 0.9  # faster than a random walk
    assert row(rep, "committed_state").worst > min_error  # growing garbage, not rounding


@pytest.mark.xfail(strict=True, reason="bf16 round-to-nearest stagnates at per-token decay ~0.999 "
                   "(docs/bounds.md); a fix (e.g. stochastic rounding in the verify kernel's store) "
                   "turns this into a visible XPASS")
def test_stagnation_rne_within_bound(stagnation_rne):
    assert row(stagnation_rne[1], "drift_bound").passed


@pytest.mark.parametrize("steps", STAGNATION_HORIZONS)
def test_stagnation_stochastic_rounding_within_bound(steps):
    rep = run_checked(resolve(preset("stagnation", store_rounding="stochastic"), "sglang-0.5.23"), steps=steps, sync_scan=False)
    assert_golden_reference(rep)
    assert row(rep, "drift_bound").passed, row(rep, "drift_bound").to_dict()


@pytest.mark.parametrize("steps", STAGNATION_HORIZONS)
def test_stagnation_fp32_state_within_bound(steps):
    rep = run_checked(resolve(preset("stagnation").with_profile("fp32"), "sglang-0.5.23"), steps=steps, sync_scan=False)
    assert row(rep, "drift_bound").passed
    assert row(rep, "committed_state").worst <= FP32_TOL


# ------------------------------------------------------------- negative controls
def test_truncation_store_fails_the_bound():
    rep = run_checked(resolve(preset("ci-small", store_rounding="truncate"), "sglang-0.5.23"), steps=PR_STEPS, sync_scan=False)
    assert not row(rep, "drift_bound").passed
    assert row(rep, "committed_state").passed  # small but biased: a precision failure, not a semantic one


# The PR twin is the mutant catalogue's run of skip_step0 (tests/jobs/test_teeth.py: caught by the
# committed-state check and the drift bound, as README's measured table shows, over 128 steps).
@pytest.mark.nightly
def test_skipping_step0_commits_fails():
    rep = run_checked(resolve(preset("ci-small"), "mutant:skip_step0"), steps=LONG_STEPS, sync_scan=False)
    assert not row(rep, "committed_state").passed and not row(rep, "drift_bound").passed


# #31659's guard, with and without padded rows in the batch: tests/jobs/test_teeth.py
# (test_tradeoff_reports_the_seesaw), on the trade-off's runs of the same configurations.
