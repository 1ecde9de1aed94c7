"""docs/extending.md holds: a kernel, a check and a profile registered from outside the package
(tests/fixtures/toy_extension.py, one registry line each, loaded through $DRIFT_EXTENSIONS) run
through ``drift run`` and through the pytest plugin end to end, and a failing toy check fails both."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from drift.cli import main
from drift.errors import EXIT_FAIL, EXIT_PASS
from drift.plug import extensions
from helpers import TOY_EXTENSION as TOY

RUN = ["run", "--steps", "32", "--profile", "toy-profile", "--kernel", "toy-kernel", "--quiet"]


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
