"""Request lifecycles end to end (drift/lifecycles.py, docs/semantics.md §12): serving runs of the SGLang
flows pass with the released updates; a churning lifecycle with no events reproduces the fixed batch's
figures; each serving mutant is caught; the report says which events ran."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import resumed_from_checkpoint
from drift.check.registry import find_result
from drift.config import preset
from drift.jobs.report import summary_text
from drift.jobs.teeth import evaluate_mutant
from drift.lifecycles import LIFECYCLES, Lifecycle
from drift.plug.mutants import MUTANTS
from drift.runner import run_checked
from drift.runspec import RunSpec, resolve

SGLANG_FLOWS = ("sglang", "npu-accepted", "sglang-replayssm")
SERVING_MUTANTS = [n for n, m in MUTANTS.items() if (m.config or {}).get("lifecycle") == "serving"]


@pytest.mark.parametrize("name", ["ci-small", "ci-heads"])
@pytest.mark.parametrize("flow", SGLANG_FLOWS)
def test_a_serving_run_passes_with_the_released_update(name, flow):
    rep = run_checked(resolve(preset(name, lifecycle="serving", flow=flow, steps=320)))
    assert rep.passed, [(c.name, c.where, c.detail) for c in rep.checks if c.failed]
    ev = rep.info.meta["events"]
    assert ev["starts"]["prefill"] and ev["starts"]["prefix hit"] and ev["ends"]["finish"]
    starts = find_result(rep.checks, "request_starts")
    assert starts.passed and starts.applicable and "request starts" in starts.detail


def test_the_default_run_is_serving_and_a_trace_keeps_the_fixed_batch():
    assert RunSpec().config().lifecycle == "serving"
    assert RunSpec(lifecycle="fixed").config().lifecycle == "fixed"


def _figures(rep) -> dict:
    return {c.key: (c.passed, c.worst, c.where) for c in rep.checks
            if c.key not in ("request_starts", "untouched_slots", "host_syncs", "graph_capture", "golden")}


def test_a_lifecycle_without_events_reproduces_the_fixed_batch_bit_for_bit():
    """The serving machinery (schedule, slot bookkeeping, per-step batch, lane resets) with no event --
    every request lives the whole horizon, the bucket holds the fixed batch's rows -- gives the fixed
    batch's figures exactly: the same states, outputs and bounds. Its negative control: the serving
    lifecycle's figures differ."""
    base = preset("ci-small", steps=160)
    R = base.num_requests
    steady = Lifecycle("steady", "no events", churn=True, mean_steps=10**9, min_steps=10**9,
                       buckets=(R + base.num_padded,))
    with LIFECYCLES.temporary("steady", steady):
        fixed = run_checked(resolve(base))
        same = run_checked(resolve(base.replace(lifecycle="steady")))
    assert fixed.passed and same.passed
    assert _figures(same) == _figures(fixed)
    other = run_checked(resolve(base.replace(lifecycle="serving")))
    assert _figures(other) != _figures(fixed)


@pytest.mark.parametrize("name", SERVING_MUTANTS)
def test_each_serving_mutant_is_caught_in_its_flow(name):
    row = evaluate_mutant(name, preset("ci-small", steps=512))
    assert row["caught"], row
    assert row["flow"] == MUTANTS[name].flow


def test_the_serving_mutants_cover_the_issue_s_classes():
    assert {"slot_not_cleared", "prefix_wrong_snapshot", "stale_rows_after_reorder", "stale_padded_rows",
            "replay_cursor_not_reset"} <= set(SERVING_MUTANTS)


def test_a_start_that_reads_another_start_names_the_slot_and_both_holders():
    rep = run_checked(resolve(preset("ci-small", lifecycle="serving", steps=480), "mutant:slot_not_cleared"))
    res = find_result(rep.checks, "request_starts")
    assert res.failed
    assert "slot" in res.where and "previous holder: the slot of request" in res.detail, res.detail


def test_the_report_names_the_lifecycle_and_its_events():
    rep = run_checked(resolve(preset("ci-small", lifecycle="serving", steps=200)))
    text = summary_text(rep)
    line = next(ln for ln in text.splitlines() if ln.startswith("lifecycle "))
    ev = rep.info.meta["events"]
    assert f"{ev['requests']} requests" in line and "prefix hit" in line and "graph buckets" in line
    fixed = summary_text(run_checked(resolve(preset("ci-small", steps=16))))
    assert "lifecycle fixed: one request per lane" in fixed


def test_idle_lanes_compare_nothing():
    """A lane between requests adds nothing to any check (its sums read 0): the worst state error of a
    serving run is a live lane's."""
    rep = run_checked(resolve(preset("ci-small", lifecycle="serving", steps=256)))
    state = find_result(rep.checks, "committed_state")
    assert state.passed and np.isfinite(state.worst) and state.worst > 0


def test_a_serving_run_resumed_from_a_checkpoint_gives_the_same_figures(tmp_path):
    """The nightly resumes a churning lifecycle from a checkpoint file (no pickle): schedule, slot bookkeeping,
    lanes and the bound's snapshot envelopes all come back, so the figures equal an uninterrupted run's. The
    negative control: resuming into a run of another seed gives other figures."""
    from drift import checkpoint
    from drift.runner import CheckedRun

    cfg = preset("ci-small", lifecycle="serving", steps=512)
    path = tmp_path / "ckpt.pt"
    whole_rep, rep = resumed_from_checkpoint(cfg, path, 256)
    assert _figures(rep) == _figures(whole_rep)
    assert rep.info.meta["events"] == whole_rep.info.meta["events"]
    other = CheckedRun(resolve(cfg.replace(seed=3)))
    other_rep = other.report(other.run(resume_state=checkpoint.load(path)), sync_scan=False)
    assert _figures(other_rep) != _figures(whole_rep)
