"""Plots read at a glance: each plots the gated quantity (per head, the worst error / bound over
layers and rows) with the bound line at 1, names the update, kernel and flow in its title, draws
only the comparisons that ran, and prints no warning."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from drift.check.registry import find_result
from drift.cli import main
from drift.jobs.plots import nightly_figures, planned_plots, run_figure


@pytest.fixture(scope="module")
def run_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    assert main(["run", "--steps", "48", "--quiet", "--report", str(out)]) == 0
    return json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def nightly_report(tmp_path_factory):
    """Two variants only: round to nearest and fp32 states (no sequential decode)."""
    out = tmp_path_factory.mktemp("nightly")
    assert main(["nightly", "--preset", "ci-small", "--steps", "32", "--variant", "rne", "--variant", "fp32",
                 "--report", str(out), "--quiet"]) == 0
    return json.loads((out / "report.json").read_text())


def _bound_lines(fig) -> list[bool]:
    """Per axis: does it carry the horizontal line at 1?"""
    return [any(np.allclose(line.get_ydata(), 1.0) and len(set(line.get_xdata())) == 2 for line in ax.lines)
            for ax in fig.axes]


def test_run_plot_draws_the_worst_ratio_with_the_bound_line(run_report):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a legend (or any) warning fails the test
        fig = run_figure(run_report)
    title = fig._suptitle.get_text()
    assert "update sglang-0.5.23" in title and "kernel portable" in title and "flow sglang" in title
    assert all(_bound_lines(fig)) and len(fig.axes) == run_report["config"]["num_v_heads"]
    bound = find_result(run_report["checks"], "drift_bound")["bound"]["curves"]["bound_ratio"]
    worst = np.asarray(bound["max"]).max(axis=1)  # [bins, heads]: max over layers (rows already)
    low = fig.axes[0].get_ylim()[0]
    for h, ax in enumerate(fig.axes):
        np.testing.assert_allclose(ax.lines[0].get_ydata(), np.maximum(worst[:, h], low))
        assert ax.get_ylim()[1] > 1.0 > ax.get_ylim()[0]  # the line at 1 is in view


def test_nightly_draws_only_the_comparisons_that_ran(nightly_report):
    assert planned_plots(nightly_report["entries"]) == ["drift_vs_step.png", "rounding_modes.png"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        figs = nightly_figures(nightly_report)
    assert set(figs) == {"drift_vs_step.png", "rounding_modes.png"}  # no sequential: no MTP-vs-sequential plot
    rounding = figs["rounding_modes.png"]._suptitle.get_text()
    assert "round to nearest" in rounding and "fp32 state" in rounding and "stochastic" not in rounding
    for fig in figs.values():
        title = fig._suptitle.get_text()
        assert "update sglang-0.5.23" in title and "kernel " in title and "flow sglang" in title
        assert all(_bound_lines(fig))


@pytest.mark.parametrize("variants, plots", [
    (("rne", "stochastic", "fp32", "sequential"), ["drift_vs_step.png", "mtp_vs_sequential.png", "rounding_modes.png"]),
    (("rne", "sequential"), ["drift_vs_step.png", "mtp_vs_sequential.png"]),
    (("rne",), ["drift_vs_step.png"]),
    ((), []),
])
def test_planned_plots_follow_the_variants_present(variants, plots):
    entries = {v: {"entry": {"variant": v, "preset": "ci-small", "seed": 0}} for v in variants}
    assert planned_plots(entries) == plots
