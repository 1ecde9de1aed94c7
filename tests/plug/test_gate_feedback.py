"""The PR gate under pytest stops at the first failing chunk with -x / --drift-fail-fast, and
shows progress per chunk of steps even with -q (drift/pytest_plugin.py: drift_fail_fast,
drift_progress)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

# 1024 steps are four chunks of ci-small (256 steps each, drift/sim/stream.py: InputStream.chunk_steps):
# a fail-fast stop shows as fewer progress lines than a full run's.
STEPS = 1024
PROGRESS = re.compile(r"^drift: \S+test_update_keeps_precision\S*: step (\d+)/(\d+) ", re.M)


def _gate(tmp_path, *args, steps=STEPS):
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "drift",
                           "-k", "precision", "--drift-preset", "ci-small", "--drift-steps", str(steps), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)


def _steps_shown(out: str, steps: int = STEPS) -> list[int]:
    return [int(done) for done, total in PROGRESS.findall(out) if int(total) == steps]


@pytest.mark.parametrize("stop", [["-x"], ["--drift-fail-fast"]], ids=["x", "drift-fail-fast"])
def test_an_off_by_one_stops_the_gate_at_its_first_chunk(tmp_path, stop):
    res = _gate(tmp_path, "--drift-update", "mutant:step_plus1", *stop)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out[-3000:]
    assert "stopped early: fail-fast: committed state first over its limit at step 0" in out, out[-3000:]
    assert _steps_shown(out) == [], out[-3000:]  # stopped inside the first chunk, before its progress line
    assert "Traceback" not in out


def test_without_fail_fast_the_gate_runs_every_step_and_says_so(tmp_path):
    """The control: the same mutant without -x runs the whole horizon, one progress line per chunk."""
    res = _gate(tmp_path, "--drift-update", "mutant:step_plus1")
    out = res.stdout + res.stderr
    assert res.returncode == 1, out[-3000:]
    assert "stopped early" not in out
    assert _steps_shown(out) == [256, 512, 768, 1024], out[-3000:]


def test_a_passing_gate_shows_its_progress_with_q(tmp_path):
    """Two chunks with -q: a line for each; one chunk with -qq, which would print its line at step 256."""
    res = _gate(tmp_path, steps=512)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert _steps_shown(out, 512) == [256, 512], out[-3000:]
    assert _gate(tmp_path, "-qq", steps=256).stdout.count("drift: ") == 0  # -qq: silent, as asked
