"""A result's identity covers what decided it (drift/jobs/identity.py): the code of an update and of
every module it imports outside drift and the standard library, by content; the checks with their
limits; the extensions. ``--resume`` redoes an entry when any of them changed, and a baseline pairs
entries by configuration, not by the update's path."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from drift.cli import main
from drift.errors import EXIT_FAIL, EXIT_PASS
from drift.jobs import identity, nightly
from drift.plug.loader import load_update

pytestmark = pytest.mark.xdist_group("nightly")
NIGHTLY = ["nightly", "--preset", "ci-small", "--variant", "rne", "--layers", "1", "--steps", "16", "--quiet"]

# An update whose logic lives in a sibling module, beside a package one of its functions imports.
UPDATE = '''import json
import numpy
from drift_idtest_helper import commit


def update(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track):
    return commit(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track)


def later():
    from drift_idtest_pkg.deep import FACTOR  # imported only when called: the walk reads it from the source
    return FACTOR
'''
HELPER = '''from drift.flows.registry import UPDATES


def commit(self, *args):
    return UPDATES["sglang-0.5.23"].fn(self, *args)
'''
DROPPED = '''def commit(self, *args):
    return None  # the commit dropped
'''


def write_update(d: Path) -> str:
    """The UPDATE file and its sibling modules in ``d``; returns its spec."""
    (d / "drift_idtest_pkg").mkdir(parents=True)
    (d / "upd.py").write_text(UPDATE)
    (d / "drift_idtest_helper.py").write_text(HELPER)
    (d / "drift_idtest_pkg" / "__init__.py").write_text("from . import other\n")
    (d / "drift_idtest_pkg" / "other.py").write_text("X = 1\n")
    (d / "drift_idtest_pkg" / "deep.py").write_text("from .other import X\nFACTOR = X\n")
    (d / "unrelated.py").write_text("Y = 2\n")  # beside it, imported by nothing
    return f"{d / 'upd.py'}:update"


@pytest.fixture
def fresh_modules():
    """Forget the test's update modules after it (and between its runs: the CLI is a new process each time)."""
    def forget():
        for name, mod in list(sys.modules.items()):
            if name.startswith(("drift_idtest_", "drift_plugin_")) and "/pytest-" in (getattr(mod, "__file__", "") or ""):
                del sys.modules[name]
    yield forget
    forget()


def test_the_code_identity_is_every_module_the_update_imports_by_content(tmp_path, fresh_modules):
    spec = write_update(tmp_path)
    code = identity.update_identity(load_update(spec))
    assert set(code["modules"]) == {identity.FILE_MODULE, "drift_idtest_helper", "drift_idtest_pkg",
                                    "drift_idtest_pkg.deep", "drift_idtest_pkg.other"}  # not json, not drift
    assert set(code["packages"]) == {"numpy"}  # an installed package: by its version, not walked
    (tmp_path / "unrelated.py").write_text("Y = 3\n")  # negative control: a file nothing imports
    fresh_modules()
    assert identity.update_identity(load_update(spec)) == code
    (tmp_path / "drift_idtest_pkg" / "other.py").write_text("X = 2\n")  # two imports deep, never imported yet
    fresh_modules()
    changed = identity.update_identity(load_update(spec))
    assert identity.differences(code, changed) == [
        f"modules.drift_idtest_pkg.other {code['modules']['drift_idtest_pkg.other']!r} -> "
        f"{changed['modules']['drift_idtest_pkg.other']!r}"]


def test_the_checks_identity_names_each_check_with_its_limit(toy, monkeypatch):
    cfg = nightly.Entry("ci-small", 0, "sglang-0.5.23", "rne", 16, 1).config("cpu")
    before = identity.checks_identity(cfg, "mtp")
    assert before["committed_state"] == {"limit": 0.25} and "host_syncs" in before
    assert "host_syncs" not in identity.checks_identity(cfg, "sequential")  # an MTP-only check
    from drift.plug.extensions import load_extensions

    load_extensions()
    monkeypatch.setenv("TOY_CHECK_LIMIT", "1e-9")
    assert identity.checks_identity(cfg, "mtp")["toy_state_error"] == {"limit": 1e-9}


def test_resume_redoes_an_entry_whose_sibling_module_changed(tmp_path, capsys, fresh_modules):
    spec = write_update(tmp_path / "code")
    out = tmp_path / "rep"
    assert main(NIGHTLY + ["--update", spec, "--report", str(out)]) == EXIT_PASS
    fresh_modules()
    assert main(NIGHTLY + ["--update", spec, "--report", str(out), "--resume"]) == EXIT_PASS
    assert "redoing" not in capsys.readouterr().err  # negative control: unchanged code is reused
    (tmp_path / "code" / "drift_idtest_helper.py").write_text(DROPPED)
    fresh_modules()
    assert main(NIGHTLY + ["--update", spec, "--report", str(out), "--resume"]) == EXIT_FAIL  # redone: it fails
    err = capsys.readouterr().err
    assert "redoing" in err and "update.modules.drift_idtest_helper" in err
    (entry,) = json.loads((out / "report.json").read_text())["entries"].values()
    assert entry["verdict"] == "fail"


def test_resume_redoes_an_entry_when_an_extension_adds_a_check(tmp_path, capsys, monkeypatch, request):
    out = tmp_path / "rep"
    assert main(NIGHTLY + ["--report", str(out)]) == EXIT_PASS
    request.getfixturevalue("toy")  # from here on, $DRIFT_EXTENSIONS names the toy extension
    monkeypatch.setenv("TOY_CHECK_LIMIT", "1e-9")  # below any bf16 store's error: its check fails
    capsys.readouterr()
    assert main(NIGHTLY + ["--report", str(out), "--resume"]) == EXIT_FAIL
    err = capsys.readouterr().err
    assert "redoing" in err and "checks.toy_state_error.limit" in err
    assert main(NIGHTLY + ["--report", str(out), "--resume"]) == EXIT_FAIL  # the same set: reused, still failing
    assert "redoing" not in capsys.readouterr().err
    monkeypatch.setenv("TOY_CHECK_LIMIT", "0.25")  # its limit is part of the identity too
    assert main(NIGHTLY + ["--report", str(out), "--resume"]) == EXIT_PASS
    assert "checks.toy_state_error.limit 1e-09 -> 0.25" in capsys.readouterr().err


def _entry(preset: str, update: str, code: str) -> dict:
    """A report entry carrying just what pairing reads."""
    e = nightly.Entry(preset, 0, update, "rne", 16, 1)
    return {"identity": {"entry": {**e.__dict__}, "config": {"name": preset, "steps": 16, "trace": ""},
                         "update": {"modules": {identity.FILE_MODULE: code}}}}


def test_a_baseline_pairs_by_configuration_not_by_path():
    now = {"k": _entry("ci-small", "/new/place/upd.py:update", "aaa")}
    assert identity.pair(now, {"old": _entry("ci-small", "/old/upd.py:update", "aaa")}) == {"k": "old"}
    assert identity.pair(now, {"old": _entry("ci-small", "/old/upd.py:update", "bbb")}) == {"k": "old"}  # code changed
    two = {"a": _entry("ci-small", "/x/upd.py:update", "bbb"), "b": _entry("ci-small", "/y/upd.py:update", "aaa")}
    assert identity.pair(now, two) == {"k": "b"}  # two of that name: the one of the same code
    assert identity.pair(now, {"old": _entry("stagnation", "/new/place/upd.py:update", "aaa")}) == {}  # another preset
    assert identity.pair(now, {"old": _entry("ci-small", "/new/place/upd.py:other", "aaa")}) == {}  # another function
    assert identity.pair(now, {"k": {"checks": []}}) == {"k": "k"}  # a baseline older than identities: by key


def test_a_baseline_of_a_moved_update_file_is_compared(tmp_path, capsys, monkeypatch, fresh_modules):
    """The same code at another path: the trend compares them (it matched no entry on 4adf604), and the
    plot gets the baseline to overlay."""
    spec_a = write_update(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert main(NIGHTLY + ["--update", spec_a, "--report", str(tmp_path / "ra")]) == EXIT_PASS
    fresh_modules()
    seen = []
    real = nightly.nightly_plots
    monkeypatch.setattr(nightly, "nightly_plots", lambda rep, out, base=None: seen.append(base) or real(rep, out, base))
    spec_b = spec_a.replace(str(tmp_path / "a"), str(tmp_path / "b"))
    assert main(NIGHTLY + ["--update", spec_b, "--report", str(tmp_path / "rb"),
                           "--baseline", str(tmp_path / "ra" / "report.json")]) == EXIT_PASS
    assert "no trend" not in capsys.readouterr().err
    rep = json.loads((tmp_path / "rb" / "report.json").read_text())
    ((key, base),) = rep["trend_pairs"].items()
    assert key != base and rep["trend"] == [] and rep["trend_unmatched"] == []
    assert seen and seen[0]["entries"].keys() == {base}


def test_resume_redoes_an_entry_whose_figures_another_mkl_path_computed(tmp_path, capsys, monkeypatch):
    """What computes the figures is part of the identity: an entry finished under another MKL code path (or
    torch, numpy, Python, CPU architecture) is redone, naming it; the same path reuses it."""
    out = tmp_path / "rep"
    monkeypatch.setattr(identity, "versions", lambda: {"drift": "x", "torch": "t", "numpy": "n", "python": "p",
                                                       "mkl": "AUTO"})
    assert main(NIGHTLY + ["--report", str(out)]) == EXIT_PASS
    (entry,) = json.loads((out / "report.json").read_text())["entries"].values()
    assert entry["identity"]["numerics"] == {"machine": identity.platform.machine(), "torch": "t", "numpy": "n",
                                             "python": "p", "mkl": "AUTO"}
    capsys.readouterr()
    assert main(NIGHTLY + ["--report", str(out), "--resume"]) == EXIT_PASS
    assert "redoing" not in capsys.readouterr().err  # the control: the same numerics, reused
    monkeypatch.setattr(identity, "versions", lambda: {"drift": "x", "torch": "t", "numpy": "n", "python": "p",
                                                       "mkl": "COMPATIBLE"})
    assert main(NIGHTLY + ["--report", str(out), "--resume"]) == EXIT_PASS
    assert "redoing" in (err := capsys.readouterr().err) and "numerics.mkl 'AUTO' -> 'COMPATIBLE'" in err, err
