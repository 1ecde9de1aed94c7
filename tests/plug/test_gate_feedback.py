"""The PR gate under pytest stops at the first failing chunk with -x / --drift-fail-fast, and
shows progress per chunk of steps even with -q (drift/pytest_plugin.py: drift_fail_fast,
drift_progress)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid

import pytest

from helpers import BAD_UPDATES

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


_HOLD_A_THREAD = "import threading\nthreading.Thread(target=threading.Event().wait, daemon=True).start()\n"


def _failure_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(("FAILED", "E ")) or "noisy_commit_next_step:" in line]


def test_precision_runs_made_ahead_fail_as_runs_made_in_their_tests(tmp_path):
    """The gate's precision runs are made ahead, in a process of their own, while the sync tests run
    (drift/gate_ahead.py); a session with another thread may not fork and makes each in its test (a
    plugin holding a thread, loaded with -p). Both report the same failures, and -v says where the runs
    were made."""
    (tmp_path / "hold_a_thread.py").write_text(_HOLD_A_THREAD)
    args = ("-vv", "-k", "sync or precision", "--drift-update", f"{BAD_UPDATES}:noisy_commit_next_step", "-rf")
    ahead = _gate(tmp_path, *args, steps=256)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    here = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "hold_a_thread",
                           "--pyargs", "drift", "--drift-preset", "ci-small", "--drift-steps", "256", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert ahead.returncode == here.returncode == 1, (ahead.stdout + here.stdout)[-3000:]
    assert "drift: precision runs: 1 made ahead, in a process of their own" in ahead.stdout, ahead.stdout[-3000:]
    assert "drift: precision runs: each made in its test: 1 other Python thread(s)" in here.stdout, here.stdout[-3000:]
    assert _failure_lines(ahead.stdout) == _failure_lines(here.stdout) != []
    # the update's prints, one a step: the failed test's captured output, wherever the run was made
    ahead_said, here_said = ([line for line in res.stdout.split("Captured stdout call", 1)[-1].splitlines()
                              if "own print" in line] for res in (ahead, here))
    assert ahead_said == here_said and len(ahead_said) >= 256, ahead.stdout[-3000:]
    assert _steps_shown(ahead.stdout, 256) == _steps_shown(here.stdout, 256) == [256]


def _marked(mark: str) -> list[int]:
    """The processes whose environment holds ``mark``."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mark.encode() in f.read():
                    found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (the run made ahead forks on Linux only)")
def test_x_ends_the_runs_made_ahead_with_the_session(tmp_path):
    """With -x a sync stops the gate in seconds though its precision run, made ahead over 100,000 steps, had
    just begun: the session's end kills and reaps its process (one left running would go on simulating,
    orphaned, holding pytest's output open), and no progress of it is printed."""
    mark = f"DRIFT_TEST_MARK={uuid.uuid4().hex}"
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env[mark.split("=")[0]] = mark.split("=")[1]
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "drift", "-x",
                          "-k", "sync or precision", "--drift-preset", "ci-small", "--drift-steps", "100000",
                          "--drift-update", "sglang-31659"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    left = _marked(mark)
    out = res.stdout + res.stderr
    assert res.returncode == 1 and "1 failed" in out, out[-3000:]
    assert "test_update_is_sync_free" in out and "aten._local_scalar_dense" in out, out[-3000:]
    assert left == [], left
    assert _steps_shown(out, 100_000) == [], out[-3000:]
