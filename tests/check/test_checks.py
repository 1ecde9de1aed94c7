"""drift.checks: the core checks, each with a positive and a known-bad (negative) control.

Every check a test in this suite relies on is shown to fail on an update that is wrong in
the one way that check exists for (tests/fixtures/bad_updates.py), and to pass on a correct one.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from helpers import bad_spec, checks_of, small_cfg
from drift.config import PROFILES
from drift.errors import ConfigError
from drift.check.checks import SEMANTIC_TOL, Check, StateCheck, TrackCheck, untouched_result
from drift.check.compare import MetricsChunk
from drift.check.measures import MEASURES
from drift.check.metrics import rel_err

CORE = ("finite_states", "committed_state", "outputs", "conv_windows", "tracked_snapshots",
        "untouched_slots")

# 200 steps of the small config: the default pattern ('mixed') starts with 256 steps of the
# acceptance model, so every accept length 1..D occurs and each row crosses its track
# boundary (interval 16) about 18 times.
STEPS = 200


@pytest.fixture(scope="module")
def good():
    return checks_of(small_cfg(STEPS), "sglang-32130")


def test_correct_update_passes_every_core_check(good):
    for name in CORE:
        assert good[name].passed, (name, good[name])
    assert good["report"].passed
    # The committed-state worst case is bf16 rounding drift: drift.checks documents
    # 0.003 .. 0.0124 for RNE on ci-small over 4,096 steps (0.007 here at 200 steps), so a
    # quarter of the semantic threshold (0.0625) leaves a 5x margin over the long-run value
    # while the bad controls below sit 10x above the threshold.
    assert good["committed_state"].worst < SEMANTIC_TOL / 4


def test_positive_control_written_like_a_plugin_passes():
    """tests/fixtures/bad_updates.py:correct (the same code as the bad variants, no fault) passes:
    the negative controls fail because of their one fault, not their plumbing."""
    res = checks_of(small_cfg(STEPS), bad_spec("correct"))
    assert all(res[name].passed for name in CORE), [res[n] for n in CORE]


@pytest.mark.parametrize("variant, failing, passing, detail", [
    # Committing the state after a rejected draft: order-one state error.
    ("commit_next_step", "committed_state", ("conv_windows", "untouched_slots"), "first over the limit"),
    # No rollback: the window ends D-1-step tokens too late.
    ("skip_conv_rollback", "conv_windows", ("untouched_slots",), "first over the limit"),
    # Tracking one token too far: the snapshot is not the boundary state.
    ("track_next_step", "tracked_snapshots", ("committed_state", "conv_windows", "untouched_slots"),
     "tracked SSM state differs"),
    # Conv window copied to the track slot after the working slot was rolled back, then
    # rolled again: the window read from the wrong point (sglang #34794 class).
    ("track_conv_late", "tracked_snapshots", ("committed_state", "conv_windows", "untouched_slots"),
     "tracked conv window differs"),
    # A snapshot that is not bit-exact what the run held at the boundary, though within
    # rounding distance of the truth: only the bit-exact part of the check can see it.
    ("track_rescaled", "tracked_snapshots", ("committed_state", "conv_windows", "untouched_slots"),
     "tracked SSM state differs"),
    # Writing the dummy slot that padded rows point at.
    ("write_dummy_slot", "untouched_slots", ("committed_state", "conv_windows", "tracked_snapshots"),
     "wrote dummy slot 0 (slot 0) at step 0"),
    ("write_dummy_conv", "untouched_slots", ("committed_state", "conv_windows", "tracked_snapshots"),
     "wrote dummy slot 0 (slot 0) at step 0"),
    # Unconditional copy into untracked rows' track slots (no self-copy).
    ("track_unconditional", "untouched_slots", ("committed_state", "conv_windows"),
     "wrote track slot of row"),
])
def test_known_bad_update_fails_its_check(variant, failing, passing, detail):
    res = checks_of(small_cfg(STEPS), bad_spec(variant))
    assert not res[failing].passed, res[failing]
    assert detail in res[failing].detail, res[failing]
    assert not res["report"].passed
    for name in passing:  # the fault is confined to what the variant breaks
        assert res[name].passed, (name, res[name])
    if variant == "track_rescaled":  # the relative error stays rounding-sized: bits decide
        assert res[failing].worst < SEMANTIC_TOL / 4
    if variant in ("commit_next_step", "track_next_step"):
        # A semantic error is order one (one token's update or a rejected draft's: measured
        # 1.7 .. 6 here), far above the threshold, not a borderline miss.
        assert res[failing].worst > 2 * SEMANTIC_TOL


@pytest.mark.parametrize("profile", [p for p in PROFILES if p != small_cfg(STEPS).profile])  # that one: above
@pytest.mark.parametrize("variant", ["write_dummy_slot", "write_dummy_conv"])
def test_untouched_slot_writes_are_seen_in_every_layout(variant, profile):
    """The guard compares each slot's memory as words in storage order: a write into the dummy
    slot is seen whatever the layout (transposed views included) and the dtype."""
    res = checks_of(small_cfg(STEPS, profile), bad_spec(variant))
    assert not res["untouched_slots"].passed, res["untouched_slots"]
    assert "wrote dummy slot 0 (slot 0) at step 0" in res["untouched_slots"].detail


def test_nan_commit_stops_the_run_and_fails():
    cfg = small_cfg(300)  # more than one 256-step chunk: the run must not reach the end
    res = checks_of(cfg, bad_spec("commit_nan"))
    assert not res["finite_states"].passed
    assert "row 0" in res["finite_states"].detail
    rep = res["report"]
    assert rep.info.stopped_early and not rep.passed
    assert rep.info.steps < cfg.steps  # stopped at the end of the first chunk with a NaN
    assert "step 0" in rep.info.stopped_early
    assert not res["run_completed"].passed


def test_wrong_outputs_fail_the_output_check_only(good):
    """A verify kernel whose outputs are 1.5x too large (states untouched) fails 'outputs'."""
    from drift.sim.kernels import recurrent_gated_delta_rule

    def scaled(args):
        return recurrent_gated_delta_rule(args) * 1.5

    res = checks_of(small_cfg(STEPS), "sglang-32130", kernel=scaled)
    assert not res["outputs"].passed
    # |1.5 (o + e) - o| / |o| = 0.5 up to 1.5 |e| / |o|, where e is the correct run's own
    # rounding error (its 'outputs' worst, same stream and steps).
    assert abs(res["outputs"].worst - 0.5) <= 1.5 * good["outputs"].worst
    assert res["committed_state"].passed


# ------------------------------------------------------------------ unit behaviour
def test_rel_err_uses_the_norm_floor():
    err2, ref2 = np.array([4.0, 4.0]), np.array([100.0, 0.0])
    np.testing.assert_allclose(rel_err(err2, ref2, floor=1.0), [0.2, 2.0])


def _chunk(count=2, R=1, **over):
    """A MetricsChunk of zero errors (unit references), one layer and head, nothing tracked."""
    arrays = {k: np.zeros((count, 1, R, 1)) for m in MEASURES.values() for k in m.head}
    arrays.update({k: np.zeros((count, R), np.int64) for m in MEASURES.values() for k in m.row})
    arrays.update(ref2=np.ones((count, 1, R, 1)), finite=np.ones((count, 1, R, 1), bool),
                  pre=np.zeros((count, R), np.int64), accept=np.ones((count, R), np.int64),
                  track=np.full((count, R), -1, np.int64))
    arrays.update(over)
    return MetricsChunk(0, count, arrays)


class _Comparison:  # what Check.start reads: comparison.sim.cfg / .mode / .flow
    class sim:
        class cfg:
            head_v_dim = 16
            track_interval = 16
            steps = 2  # _chunk()'s steps: the whole run
            trace, trace_loop = "", False
        mode = "mtp"

        class flow:
            tracks = True  # a copy-commit flow: prefix-cache tracking modelled


def test_a_check_that_saw_nothing_fails():
    c = StateCheck()
    c.start(_Comparison)
    assert not c.result().passed


def test_state_check_locates_the_first_failure():
    c = StateCheck()
    c.start(_Comparison)
    err2 = np.zeros((3, 1, 1, 1))
    err2[2] = 1.0  # relative error 1 at step 2
    c.consume(_chunk(3, err2=err2, ref2=np.ones((3, 1, 1, 1))))
    r = c.result()
    assert not r.passed and r.worst == pytest.approx(1.0)
    assert "step 2" in r.detail


def test_track_check_with_tracking_on_but_no_boundary_is_a_usage_error():
    """The stream's schedule alone decides whether a boundary falls within the run: a run that can be
    lengthened and crossed none is refused (ConfigError: exit 2), naming --steps and --track-interval."""
    c = TrackCheck()
    c.start(_Comparison)
    c.consume(_chunk())
    with pytest.raises(ConfigError, match=r"no tracking boundary fell within the 2 steps run.*--track-interval 0"):
        c.result()


def test_track_check_of_a_run_stopped_before_a_boundary_is_not_exercised():
    """A fail-fast run that stopped (another check failed) before its first boundary: n/a, saying so, so the
    failure that stopped it is what the run reports."""
    class comparison:
        class sim(_Comparison.sim):
            class cfg(_Comparison.sim.cfg):
                steps = 4096

    c = TrackCheck()
    c.start(comparison)
    c.consume(_chunk())
    r = c.result()
    assert not r.failed and not r.applicable and "stopped at step 2, before a tracking boundary" in r.detail


@pytest.mark.parametrize("loop", [False, True])
def test_track_check_on_a_trace_that_cannot_reach_a_boundary_is_not_exercised(loop):
    """A trace replayed to its end cannot be lengthened: no boundary there is n/a, not a FAIL; a looped
    trace can run longer, so there it is the usage error (lengthen the run)."""
    class comparison:
        class sim(_Comparison.sim):
            class cfg(_Comparison.sim.cfg):
                trace, trace_loop = "t.npz", loop

    c = TrackCheck()
    c.start(comparison)
    c.consume(_chunk())
    if loop:
        with pytest.raises(ConfigError, match="lengthen the run"):
            c.result()
        return
    r = c.result()
    assert not r.failed and not r.applicable
    assert "not exercised" in r.detail and "--loop" in r.detail


def test_untouched_result_verdicts():
    assert untouched_result(None, 5).passed
    assert not untouched_result(None, 0).passed
    bad = untouched_result({"step": 3, "slot": 0, "role": "dummy slot 0"}, 5)
    assert not bad.passed and "dummy slot 0" in bad.detail


def test_base_check_treats_nan_as_worst():
    c = Check(limit=1.0)
    c.start(_Comparison)
    c._update(np.array([[0.5], [math.nan]]), 0, dims=("row",))
    assert c.first_fail == "step 1, row 0"
