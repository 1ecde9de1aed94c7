"""Precision direction (issue 3): bf16 drift over thousands of decode steps stays within the
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

STEPS = 4096  # issue 3: at least 4,096 decode steps on ci-small
FP32_TOL = 1e-5  # issue 3 test 1: fp32 state vs golden (fp32 arithmetic gives ~1e-7 to 1e-6)


def row(rep, name):
    return next(c for c in rep.checks if c.name == name)


def assert_golden_reference(rep):
    g = row(rep, "golden")
    assert g.verdict == "PASS", g.detail
    assert "validated against it" in rep.reference


@pytest.fixture(scope="module")
def bf16_runs():
    return {impl: run_checked(preset("ci-small"), impl, steps=STEPS, sync_scan=False)
            for impl in ("sglang-32130", "sglang-0.5.23")}


def test_fp32_state_profile_matches_golden():
    rep = run_checked(preset("ci-small").with_profile("fp32"), "sglang-0.5.23", steps=STEPS, sync_scan=False)
    assert_golden_reference(rep)
    state = row(rep, "committed state")
    assert state.worst is not None and state.worst <= FP32_TOL, state.worst
    assert rep.passed, [c.to_dict() for c in rep.checks if c.failed]


@pytest.mark.parametrize("impl", ["sglang-32130", "sglang-0.5.23"])
def test_bf16_drift_within_bound(bf16_runs, impl):
    rep = bf16_runs[impl]
    assert_golden_reference(rep)
    bound = row(rep, "drift bound")
    assert bound.passed and 0 < bound.worst <= 1.0, bound.to_dict()
    per_head = np.array(bound.extra["bound"]["worst_ratio_per_head"])
    assert per_head.shape == (2, 4) and (per_head <= 1.0).all()
    growth = row(rep, "growth exponent")
    assert growth.passed and growth.worst <= GROWTH_LIMIT
    prone = np.array(bound.extra["bound"]["stagnation_prone"])
    assert not prone.any()  # ci-small's slowest head (0.995/token) decays ~1.2% per step
    # Conv windows equal the truth bit for bit at every step; the twin's windows were also
    # compared with the golden checkpoints (positions 4096, 8192 are reached).
    conv = row(rep, "conv windows")
    assert conv.passed and conv.worst == 0
    assert "0 checkpoints" not in row(rep, "golden").detail
    assert rep.passed


def test_sync_free_and_device_select_commit_identical_states(bf16_runs):
    a, b = bf16_runs["sglang-32130"], bf16_runs["sglang-0.5.23"]
    assert row(a, "committed state").worst == row(b, "committed state").worst
    assert row(a, "drift bound").extra["bound"]["curves"] == row(b, "drift bound").extra["bound"]["curves"]


def test_mtp_and_sequential_both_bounded_and_divergence_reported():
    cfg = preset("ci-small")
    mtp = run_checked(cfg, "sglang-0.5.23", steps=STEPS, vs_sequential=True, sync_scan=False)
    seq = run_checked(cfg, mode="sequential", steps=STEPS)
    for rep in (mtp, seq):
        assert_golden_reference(rep)
        assert row(rep, "drift bound").passed and rep.passed
    div = row(mtp, "MTP vs sequential")
    assert div.verdict == "info" and div.worst > 0
    # The two errors are independent roundings of the same truth: their difference is at most
    # their sum, and far from zero (MTP rounds once per step, sequential once per token).
    worst_sum = row(mtp, "committed state").worst + row(seq, "committed state").worst
    assert div.worst <= worst_sum
    assert row(seq, "committed state").worst > row(mtp, "committed state").worst * 0.5


def test_resumed_from_tracked_snapshot_stays_within_bound():
    """Cache hit vs cache miss (sglang #33515): a request that loads the tracked snapshot
    decodes on within the bound, as the original (cache miss) request does."""
    cfg = preset("ci-small")
    original, point, env2 = capture_snapshots(cfg, "sglang-0.5.23", after_step=STEPS // 2, steps=STEPS)
    assert original.passed and (point.positions % cfg.track_interval == 0).all()
    resumed = run_checked(cfg, "sglang-0.5.23", steps=STEPS // 2, start=point, env2_start=env2, sync_scan=False)
    assert_golden_reference(resumed)
    assert row(resumed, "drift bound").passed and resumed.passed


def test_stagnation_blow_up_is_measured():
    """bf16 round-to-nearest on the stagnation preset: the slow head stops decaying and the
    error grows past the bound (measured: relative error ~0.35 at 4,096 steps, growth ~1.4)."""
    rep = run_checked(preset("stagnation"), "sglang-0.5.23", sync_scan=False)
    bound = row(rep, "drift bound")
    info = bound.extra["bound"]
    assert np.array(info["stagnation_prone"]).all()
    assert bound.worst > 2.0  # more than twice the bound
    assert max(info["growth_exponent"][0]) > 0.9  # faster than a random walk
    assert row(rep, "committed state").worst > 0.2  # garbage, not rounding


@pytest.mark.xfail(strict=True, reason="bf16 round-to-nearest stagnates at per-token decay ~0.999 "
                   "(docs/bounds.md); a fix (e.g. stochastic rounding in the verify kernel's store) "
                   "turns this into a visible XPASS")
def test_stagnation_rne_within_bound():
    rep = run_checked(preset("stagnation"), "sglang-0.5.23", sync_scan=False)
    assert row(rep, "drift bound").passed


def test_stagnation_stochastic_rounding_within_bound():
    rep = run_checked(preset("stagnation", store_rounding="stochastic"), "sglang-0.5.23", sync_scan=False)
    assert_golden_reference(rep)
    assert row(rep, "drift bound").passed, row(rep, "drift bound").to_dict()


def test_stagnation_fp32_state_within_bound():
    rep = run_checked(preset("stagnation").with_profile("fp32"), "sglang-0.5.23", sync_scan=False)
    assert row(rep, "drift bound").passed
    assert row(rep, "committed state").worst <= FP32_TOL


# ------------------------------------------------------------- negative controls
def test_truncation_store_fails_the_bound():
    rep = run_checked(preset("ci-small", store_rounding="truncate"), "sglang-0.5.23", steps=1024, sync_scan=False)
    assert not row(rep, "drift bound").passed
    assert row(rep, "committed state").passed  # small but biased: a precision failure, not a semantic one


def test_skipping_step0_commits_fails():
    rep = run_checked(preset("ci-small"), "mutant:skip_step0", steps=1024, sync_scan=False)
    assert not row(rep, "committed state").passed and not row(rep, "drift bound").passed


def test_guarded_loses_updates_without_padded_rows_and_not_with_them():
    """#31659's guard skips the commit when every row accepted one token; with padded rows
    (step -1) in the batch it never fires."""
    no_pad = run_checked(preset("ci-small", num_padded=0), "sglang-31659", steps=1024, sync_scan=False)
    assert not row(no_pad, "committed state").passed and not row(no_pad, "drift bound").passed
    padded = run_checked(preset("ci-small"), "sglang-31659", steps=1024, sync_scan=False)
    assert row(padded, "committed state").passed and row(padded, "drift bound").passed
