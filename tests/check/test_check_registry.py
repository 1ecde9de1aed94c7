"""The check registry (drift/check/registry.py): one entry per check, the run built from it, the
README's table generated from it, and a check added from outside the package by one registry line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import drift.check  # noqa: F401  (registers the built-in checks)
from drift.check.checks import Check
from drift.check.registry import CHECKS, SHAPES, CheckSpec, checks_markdown, find_result, result_key
from drift.config import preset
from drift.runner import run_checked
from drift.runspec import resolve

README = Path(__file__).resolve().parents[2] / "README.md"
CFG = preset("ci-small", steps=48)


def test_every_entry_is_whole_and_titles_are_unique():
    specs = CHECKS.in_order()
    assert len({s.title for s in specs}) == len(specs) and len({s.order for s in specs}) == len(specs)
    for s in specs:
        assert s.shape in SHAPES and s.fails_when and all(n in CHECKS for n in s.needs), s.key
    with pytest.raises(ValueError, match="needs build"):  # control: an entry without its hook is refused
        CheckSpec("x", "x", 1, "x", "consumer")


def test_a_run_reports_every_applicable_check_by_key_in_registry_order():
    rep = run_checked(resolve(CFG), sync_scan=True)
    keys = [c.key for c in rep.checks]
    expected = [s.key for s in CHECKS.in_order()
                if s.key not in ("mtp_vs_sequential", "run_completed")  # not asked / the run completed
                and (s.key != "request_starts" or CFG.serving.churn)]  # a lifecycle's events only
    assert keys == expected
    assert all(c.name == CHECKS.title(c.key) for c in rep.checks)
    d = rep.to_dict()["checks"]
    assert result_key(d[0]) == keys[0] and find_result(d, "drift_bound")["name"] == CHECKS.title("drift_bound")
    # A report written before results carried keys is still read by title.
    assert result_key({"name": CHECKS.title("host_syncs")}) == "host_syncs"


def test_readme_table_is_generated_from_the_registry():
    text = README.read_text()
    start, end = "<!-- drift:checks -->", "<!-- /drift:checks -->"
    assert start in text and end in text, "README.md lacks the checks markers"
    assert text.split(start, 1)[1].split(end, 1)[0].strip() == checks_markdown(), \
        "README checks table is stale: run python scripts/update_readme.py"


class LargestStateMagnitude(Check):
    """A toy check from outside drift: every committed state entry's relative error stays below a
    limit that a correct run easily meets (the semantic tolerance's own scale) -- or, with a tiny
    limit, that no run meets."""

    key = "toy_state_error"

    def consume(self, chunk) -> None:
        self._update(np.sqrt(chunk.err2 / np.maximum(chunk.ref2, 1e-300)), chunk.step0)


@pytest.mark.parametrize("limit,passes", [(0.25, True), (1e-9, False)])
def test_a_check_registered_from_outside_runs_and_gates(limit, passes):
    # 0.25: SEMANTIC_TOL (drift/check/checks.py), far above bf16 rounding on ci-small (~0.01);
    # 1e-9: below any bf16 store's error, so the negative control must fail.
    spec = CheckSpec("toy_state_error", "toy state error", 65, "a toy", "consumer",
                     build=lambda ctx: LargestStateMagnitude(limit))
    with CHECKS.temporary(spec.key, spec):
        rep = run_checked(resolve(CFG), sync_scan=False)
    toy = find_result(rep.checks, "toy_state_error")
    assert toy is not None and toy.name == "toy state error" and toy.passed is passes
    assert rep.passed is passes
    assert "toy_state_error" not in CHECKS  # the temporary entry is gone
