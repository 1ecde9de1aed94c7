"""The documentation states only what a run measured (issue 32 item 9): every duration, count and
sample output of README.md and docs/reference.md is rendered from docs/measured.json
(scripts/doc_runs.py, written by ``python scripts/update_readme.py --measure``)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parents[1]
FIX = "run python scripts/update_readme.py --measure {names} (or without --measure after a text edit)"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, CHECKOUT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


doc_runs = _module("doc_runs")
update_readme = _module("update_readme")
README, REFERENCE = CHECKOUT / "README.md", CHECKOUT / "docs" / "reference.md"
# A stated duration: a number and a unit of time ("25 s", "4 min", "0.3 s", "2 hours").
DURATION = re.compile(r"\b\d+(?:[.,]\d+)?\s?(?:s|ms|min|minutes?|hours?)\b")
BLOCK = re.compile(r"<!-- drift:([\w-]+) -->.*?<!-- /drift:\1 -->", re.S)


def test_the_measured_blocks_are_the_records_rendering():
    readme, reference = README.read_text(), REFERENCE.read_text()
    want_readme, want_reference = update_readme.measured_sections(readme, reference)
    assert readme == want_readme, "README.md's measured blocks are stale: " + FIX.format(names="")
    assert reference == want_reference, "docs/reference.md's durations are stale: " + FIX.format(names="")


def _durations_outside_blocks(text: str) -> list[str]:
    # Code spans and blocks are commands and quoted output, not statements of how long things take.
    prose = re.sub(r"```.*?```|`[^`\n]*`", "", BLOCK.sub("", text), flags=re.S)
    return [m.group(0) for m in DURATION.finditer(prose)]


@pytest.mark.parametrize("doc", [README, REFERENCE], ids=lambda p: p.name)
def test_no_duration_is_stated_by_hand(doc):
    assert _durations_outside_blocks(doc.read_text()) == [], f"{doc.name} states these outside a generated block"


def test_a_hand_written_duration_is_caught():
    """The negative control of the test above."""
    assert _durations_outside_blocks("The gate takes 22 s.\n<!-- drift:durations -->\n25 s\n"
                                     "<!-- /drift:durations -->\n`--steps 512 s`") == ["22 s"]


@pytest.mark.parametrize("name", doc_runs.SAMPLED_IN_README)
def test_the_quoted_output_is_what_the_code_prints(name, tmp_path):
    """The README quotes these runs' lines as recorded; the code must still print exactly them."""
    run = doc_runs.BY_NAME[name]
    res = subprocess.run(run.argv, cwd=tmp_path, env=doc_runs.run_env(), capture_output=True, text=True,
                         timeout=900)
    now = doc_runs.sampled(run, res.stdout + res.stderr)
    recorded = doc_runs.load_record()["runs"][name]["quiet"]
    assert (res.returncode, now) == (recorded["rc"], recorded["sample"]), \
        f"the README's sample of {run.shown} is stale: " + FIX.format(names=name)


def test_the_stated_test_count_is_the_suites(request):
    """The count the README states is what the suite collects now, with the extras installed here
    (the record says which ones it was measured with: a different set collects a different count)."""
    recorded = doc_runs.load_record()["runs"]["collect"]
    extras = doc_runs.installed_extras()
    if extras != recorded["extras"]:
        pytest.skip(f"the count was recorded with {recorded['extras']} installed; this environment has {extras}")
    run = doc_runs.BY_NAME["collect"]
    res = subprocess.run(run.argv, cwd=CHECKOUT, env=doc_runs.run_env(), capture_output=True, text=True,
                         timeout=900)
    assert doc_runs.sampled(run, res.stdout) == recorded["quiet"]["sample"], \
        "the stated test count is stale: " + FIX.format(names="collect")


@pytest.mark.parametrize("argv,code", [(["--help"], 0), (["-h"], 0), (["--help-onyl"], 2)])
def test_update_readme_answers_help_and_refuses_an_unknown_option_without_running(argv, code, monkeypatch, capsys):
    """scripts/update_readme.py with no option measures for minutes and rewrites the docs: ``--help``
    prints its docstring and a misspelt option is refused (exit 2), neither writing anything (every
    writer and measurement is replaced by one that fails the test)."""
    def refuse(*args, **kwargs):
        raise AssertionError("update_readme.py wrote or measured something")

    for name in ("atomic_write_text", "render_designs", "measure_designs", "measured_sections"):
        monkeypatch.setattr(update_readme, name, refuse)
    monkeypatch.setattr(update_readme.doc_runs, "measure", refuse)
    assert update_readme.main(argv) == code
    out, err = capsys.readouterr()
    assert ("--help-only" in out and "--designs-only" in out) if code == 0 else ("unknown option --help-onyl" in err)
