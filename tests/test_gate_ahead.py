"""drift/gate_ahead.py: the gate's precision runs made in a process of their own report what the runs made
in their tests report; a run that raised there, or a child that died, leaves the run to the test; the
session's end ends the child. Each case in a fresh interpreter (an xdist worker has threads, which refuse
the fork)."""

from __future__ import annotations

from helpers import python_json

_OUTCOMES = """
import json, os, signal
from drift import preset
from drift.gate_ahead import RunsAhead, ahead_refusal, failures_text
from drift.runner import run_checked
from drift.runspec import RunSpec

def run(update):
    return RunSpec(preset="ci-small", steps=48, update=update).resolve()

runs = [("good", run("sglang-0.5.23")), ("bad", run("mutant:step_plus1"))]
here = {key: (lambda rep: [rep.passed, failures_text(rep), ""])(run_checked(r, sync_scan=False)) for key, r in runs}
refusal = ahead_refusal([r for _, r in runs])
ahead = RunsAhead([(key, r, {}) for key, r in runs])
there = {key: list(ahead.outcome(key)) for key in ("bad", "good")}  # out of order: the earlier one is kept
never = ahead.outcome("never")
ahead.close()

raising = RunsAhead([("raises", run("sglang-0.5.23"), {"no_such_argument": 1})])
raised = raising.outcome("raises")
raising.close()

killed = RunsAhead([("killed", RunSpec(preset="ci-small", steps=4096).resolve(), {})])
os.kill(killed.pid, signal.SIGKILL)
lost = killed.outcome("killed")
killed.close()
try:
    os.waitpid(killed.pid, os.WNOHANG)
    reaped = False
except ChildProcessError:
    reaped = True
print(json.dumps({"here": here, "there": there, "refusal": refusal, "never": never, "raised": raised,
                  "lost": lost, "reaped": reaped}))
"""


def test_a_run_made_ahead_reports_what_the_run_made_here_reports():
    out = python_json(_OUTCOMES, OPENBLAS_NUM_THREADS="1")
    assert out["refusal"] is None
    assert out["there"] == out["here"]
    assert out["here"]["good"][0] is True and out["here"]["bad"][0] is False
    assert "committed state" in out["here"]["bad"][1]
    assert out["never"] is None  # not among its runs: the test makes it
    assert out["raised"] is None  # raised in the child: the test makes it, and raises what it raises
    assert out["lost"] is None and out["reaped"]  # the child died: the test makes it; closed, it is reaped
