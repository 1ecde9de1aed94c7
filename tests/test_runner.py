"""drift.runner: one checked run gathered into a RunReport (the verdict drift run exits on)."""

from __future__ import annotations

import json

from helpers import checks_of, small_cfg
from drift.check.result import CheckResult
from drift.runner import RunReport
from drift.simulate import RunInfo


def test_mtp_run_adds_the_untouched_slot_and_graph_verdicts_sequential_does_not():
    mtp = checks_of(small_cfg(20))["report"]
    seq = checks_of(small_cfg(20), mode="sequential")["report"]
    assert [c.key for c in mtp.checks][-2:] == ["untouched_slots", "graph_capture"]
    assert not {"untouched_slots", "graph_capture"} & {c.key for c in seq.checks}
    assert mtp.info.meta["update_spec"] == "sglang-0.5.23" and "copy_commit/updates.py" in mtp.info.meta["update_source"]
    assert seq.info.update == "(sequential decode)"


def _report(checks, stopped=None):
    info = RunInfo(steps=3, wall_s=0.0, mode="mtp", update="x", kernels="k", device="cpu", stopped_early=stopped)
    return RunReport(small_cfg(3), info, checks, "ref")


def test_verdict_needs_every_check_and_a_complete_run():
    ok, bad = CheckResult("a", True, 0.1, 1.0), CheckResult("b", False, float("nan"), 1.0)
    assert _report([ok]).passed
    assert not _report([ok, bad]).passed
    assert not _report([ok], stopped="NaN at step 2").passed  # all checks passed, run cut short


def test_report_dict_is_strict_json():
    inf = float("inf")
    extra = {"bound": {"worst_ratio_per_head": [[inf, 1.0]], "growth": (float("nan"),)}}
    rep = _report([CheckResult("b", False, float("nan"), inf, extra=extra)])
    d = rep.to_dict()
    text = json.dumps(d, allow_nan=False)  # NaN / inf must not leak into JSON, extras included
    c = json.loads(text)["checks"][0]
    assert c["worst"] is None and c["limit"] is None
    assert c["bound"] == {"worst_ratio_per_head": [[None, 1.0]], "growth": [None]}
    assert d["schema"] == 1 and d["verdict"] == "fail" and d["run"]["steps_per_s"] is None
    assert set(d["versions"]) == {"drift", "torch", "numpy", "python", "mkl"}
