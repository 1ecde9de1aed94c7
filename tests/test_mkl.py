"""drift/mkl.py: MKL pinned to the code path every x86 CPU shares, the user's choice kept, and said so
where MKL ran before drift could pin it. (Which pytest sessions it applies to: tests/plug/test_plugin.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import drift.mkl as mkl


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(mkl, "_APPLIED", None)  # what an earlier call in this process did


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if k != mkl.ENV}


def _in_a_fresh_process(code: str, env=None) -> dict:
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=_clean_env() if env is None else env)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_users_mkl_cbwr_stands():
    env = {mkl.ENV: "AVX2,STRICT"}
    said = mkl.mkl_defaults(env, modules={})
    assert env == {mkl.ENV: "AVX2,STRICT"} and "the user's" in said


def test_before_torch_loads_the_environment_is_enough():
    env = {}
    assert mkl.mkl_defaults(env, modules={}) == "MKL_CBWR=COMPATIBLE" and env == {mkl.ENV: "COMPATIBLE"}


def test_the_command_runs_mkl_on_the_pinned_path_and_the_report_says_so():
    """drift's command pins MKL before torch loads; report.json's versions name the path the run took. The
    control: the same process without the pin runs on MKL's own choice (AUTO), or has no MKL at all."""
    code = ("import json, sys\n"
            "from drift.mkl import mkl_defaults, mkl_mode\n"
            "pinned = '--pin' in sys.argv\n"
            "said = mkl_defaults() if pinned else ''\n"
            "import torch\n"
            "a = torch.ones(16, 16); a @ a\n"
            "from drift.runner import versions\n"
            "print(json.dumps({'said': said, 'mode': mkl_mode(), 'versions': versions()['mkl']}))\n")
    pinned = _in_a_fresh_process(code.replace("sys.argv", "['--pin']"))
    unpinned = _in_a_fresh_process(code)
    if pinned["mode"] == "none":  # a torch without MKL (not x86): nothing to pin, and the report says so
        assert unpinned["mode"] == "none" and pinned["versions"] == "none"
        return
    assert pinned == {"said": "MKL_CBWR=COMPATIBLE", "mode": "COMPATIBLE", "versions": "COMPATIBLE"}
    assert unpinned["mode"] == "AUTO" and unpinned["versions"] == "AUTO"


@pytest.mark.parametrize("ran_first", [False, True], ids=["torch-imported", "mkl-already-ran"])
def test_where_torch_was_imported_first_mkl_is_told_in_the_process_unless_it_already_ran(ran_first):
    """torch imported before the pin (a conftest, another plugin): MKL has not chosen yet and takes it; once
    an MKL call ran, its path is fixed for the process, and the line says so and how to pin it earlier."""
    code = ("import json, torch\n"
            + ("a = torch.ones(16, 16); a @ a\n" if ran_first else "")
            + "from drift.mkl import mkl_defaults, mkl_mode\n"
              "said = mkl_defaults()\n"
              "a = torch.ones(16, 16); a @ a\n"
              "import os\n"
              "print(json.dumps({'said': said, 'mode': mkl_mode(), 'env': os.environ.get('MKL_CBWR')}))\n")
    got = _in_a_fresh_process(code)
    assert got["env"] == "COMPATIBLE"  # child processes start pinned either way
    if got["mode"] == "none":
        assert "this torch has no MKL" in got["said"]
    elif ran_first:
        assert got["mode"] == "AUTO" and "already run on its AUTO path" in got["said"], got
        assert "before starting Python" in got["said"]
    else:
        assert got == {"said": "MKL_CBWR=COMPATIBLE", "mode": "COMPATIBLE", "env": "COMPATIBLE"}


@pytest.mark.parametrize("mode, warned", [("AUTO", True), ("AVX2,STRICT", True), ("COMPATIBLE", False),
                                          ("none", False)])
def test_a_run_off_the_pinned_path_says_so_in_its_summary_and_report(monkeypatch, mode, warned):
    """A run whose MKL took another path than drift pins (the user's MKL_CBWR, or MKL ran before the pin)
    says so under its header and in report.md, so its figures are not read against a record made on the
    pinned path; on the pinned path, or without MKL, nothing is added."""
    from drift.config import preset
    from drift.jobs.report import summary_markdown, summary_text
    from drift.runner import run_checked
    from drift.runspec import resolve

    monkeypatch.setattr("drift.runner.mkl_mode", lambda: mode)
    rep = run_checked(resolve(preset("ci-small", steps=16)), sync_scan=False)
    assert rep.to_dict()["versions"]["mkl"] == mode
    line = f"MKL: {mode}, not COMPATIBLE"
    assert (line in summary_text(rep)) == warned and (line in summary_markdown(rep)) == warned
    assert ("MKL:" in summary_text(rep) + summary_markdown(rep)) == warned
