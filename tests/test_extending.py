"""docs/extending.md holds: a kernel, a check and a profile registered from outside the package
(tests/fixtures/toy_extension.py, one registry line each, loaded through $DRIFT_EXTENSIONS) run
through ``drift run`` and through the pytest plugin end to end, and a failing toy check fails both;
and a new flow kind (tests/fixtures/toy_flow_kind.py: one class and one registry line, its flow,
update and mutant one line each) runs through ``drift run``, the plugin, ``drift mutants`` and a
short nightly, with no edit inside drift/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from drift.cli import main
from drift.errors import EXIT_FAIL, EXIT_PASS
from drift.flows.registry import FLOW_KINDS, FLOWS, UPDATES
from drift.plug import extensions
from drift.plug.mutants import MUTANTS
from helpers import TOY_EXTENSION as TOY, loaded_for_one_test

TOY_KIND = Path(__file__).resolve().parent / "fixtures" / "toy_flow_kind.py"
RUN = ["run", "--steps", "32", "--profile", "toy-profile", "--kernel", "toy-kernel", "--quiet"]


@pytest.fixture
def toy_kind(monkeypatch):
    """The toy flow kind loaded for one test; its kind, flow, update and mutant removed afterwards."""
    yield from loaded_for_one_test(monkeypatch, TOY_KIND, (FLOW_KINDS, FLOWS, UPDATES, MUTANTS))


def test_drift_run_uses_the_toy_kernel_check_and_profile(toy, tmp_path, capsys):
    assert main(RUN + ["--report", str(tmp_path)]) == EXIT_PASS, capsys.readouterr().err
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["config"]["profile"] == "toy-profile" and rep["config"]["layout"] == "scratch-transposed"
    toy_row = next(c for c in rep["checks"] if c["key"] == "toy_state_error")
    assert toy_row["verdict"] == "PASS" and toy_row["name"] == "toy state error"
    toy_module = next(m for m in sys.modules.values() if getattr(m, "__file__", None) == str(TOY))
    assert len(toy_module.CALLS) >= 32  # the toy kernel ran every step (one call per step)


def test_a_failing_toy_check_fails_the_run(toy, monkeypatch, capsys):
    # 1e-9: below any bf16 store's relative error (2^-9), so the toy check must fail.
    monkeypatch.setenv("TOY_CHECK_LIMIT", "1e-9")
    assert main(RUN) == EXIT_FAIL
    assert capsys.readouterr().out.rstrip().endswith("FAIL: toy state error")


def test_without_the_extension_the_names_are_unknown(capsys):
    with pytest.raises(SystemExit) as exc:
        main(RUN)
    assert exc.value.code == 2 and "profile 'toy-profile' is not known" in capsys.readouterr().err


@pytest.mark.parametrize("limit,expect", [("0.25", 0), ("1e-9", 1)])
def test_the_plugin_runs_the_gate_through_the_toy_entries(tmp_path, limit, expect):
    env = {**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}, extensions.ENV: str(TOY),
           "TOY_CHECK_LIMIT": limit}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "drift",
                          "-k", "keeps_precision", "--drift-steps", "32", "--drift-profile", "toy-profile",
                          "--drift-kernel", "toy-kernel"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == expect, run.stdout[-3000:] + run.stderr[-2000:]
    if expect:
        assert "toy state error" in run.stdout


# ------------------------------------------------------------------------------ a new flow kind
KIND_RUN = ["run", "--flow", "toy-gather", "--steps", "48", "--quiet"]


def test_a_flow_kind_from_outside_runs_through_drift_run(toy_kind, tmp_path, capsys):
    assert main(KIND_RUN + ["--report", str(tmp_path)]) == EXIT_PASS, capsys.readouterr().out
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["config"]["flow"] == "toy-gather" and rep["run"]["update"] == "toy-gather-commit"
    tracked = next(c for c in rep["checks"] if c["key"] == "tracked_snapshots")
    assert tracked["verdict"] == "PASS" and "snapshots compared" in tracked["detail"]  # compared, not n/a


def test_its_update_committing_the_wrong_step_fails(toy_kind, monkeypatch, capsys):
    # Negative control: the same kind and update, the commit one step early.
    monkeypatch.setenv("TOY_GATHER_STEP_SHIFT", "-1")
    assert main(KIND_RUN) == EXIT_FAIL
    assert "committed state" in capsys.readouterr().out.splitlines()[-1]


def test_its_mutant_is_caught_and_runs_in_its_flow_without_flow(toy_kind, capsys):
    assert main(["mutants", "--mutant", "toy_gather_one_late", "--steps", "64", "--json", "--quiet"]) == EXIT_PASS
    [row] = json.loads(capsys.readouterr().out)
    assert row["caught"] and row["flow"] == "toy-gather" and "committed_state" in row["caught_by"]
    assert main(["run", "--update", "mutant:toy_gather_one_late", "--steps", "48", "--quiet"]) == EXIT_FAIL


def test_a_short_nightly_runs_the_kind(toy_kind, tmp_path):
    out = tmp_path / "nightly"
    assert main(["nightly", "--flow", "toy-gather", "--preset", "ci-small", "--steps", "32", "--variant", "rne",
                 "--report", str(out), "--quiet"]) == EXIT_PASS
    rep = json.loads((out / "report.json").read_text())
    [entry] = rep["entries"].values() if isinstance(rep["entries"], dict) else rep["entries"]
    assert entry["config"]["flow"] == "toy-gather" and entry["verdict"] == "pass"


@pytest.mark.parametrize("shift,expect", [("0", 0), ("-1", 1)])
def test_the_plugin_gates_the_kinds_update(tmp_path, shift, expect):
    env = {**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}, extensions.ENV: str(TOY_KIND),
           "TOY_GATHER_STEP_SHIFT": shift}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "drift",
                          "--drift-flow", "toy-gather", "--drift-steps", "32"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == expect, run.stdout[-3000:] + run.stderr[-2000:]
