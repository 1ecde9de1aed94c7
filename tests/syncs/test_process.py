"""The host-sync scan in a process of its own (drift/syncs/process.py): it finds what the scan in the run's
own process finds, field for field, for an update that passes and one that syncs, without the run's
process importing what the scan imports; a run that scans there reports what a run that scans here
reports (a sync stops it before its precision checks); a scan that raises there raises here; a child
that dies or is abandoned leaves nothing behind; where forking is not safe, the run scans in-process.

Forking needs a process with no other thread, which pytest-xdist's workers are not: the cases that fork
run in a fresh interpreter (``python -c``), as ``drift run`` does.
"""

from __future__ import annotations

import os
import threading

import pytest

from helpers import python_json
from drift import preset
from drift.runspec import resolve
from drift.syncs import process


_SAME = """
import json, os, signal, sys
from drift import preset
from drift.runspec import resolve
from drift.syncs.process import ScanProcess, scan_refusal
from drift.syncs.scan import RUN_SAMPLE, sync_check

out = {}
for spec in ("sglang-0.5.23", "sglang-32130"):
    run = resolve(preset("ci-small", steps=512), spec)
    scan = ScanProcess(run, RUN_SAMPLE, stop_on_sync=False)
    there = scan.result().to_dict()
    scan.close()
    imported = "torch.distributed.tensor" in sys.modules  # what the virtual device's first op imports
    killed = ScanProcess(run, RUN_SAMPLE, stop_on_sync=False)  # a child that dies before it answers
    os.kill(killed.pid, signal.SIGKILL)
    instead = killed.result().to_dict()  # the scan made here instead
    out[spec] = {"refusal": scan_refusal(run), "imported": imported, "there": there, "instead": instead,
                 "here": sync_check(run, sample=RUN_SAMPLE).to_dict(), "left": os.path.exists(f"/proc/{killed.pid}")}
print(json.dumps(out))
"""


def test_the_scan_in_a_process_finds_what_the_scan_here_finds():
    out = python_json(_SAME, OPENBLAS_NUM_THREADS="1")
    passing, syncing = out["sglang-0.5.23"], out["sglang-32130"]
    assert passing["here"]["passed"] and not syncing["here"]["passed"]  # the pair the comparison needs
    assert "copy_commit/updates.py" in syncing["here"]["where"]
    for case in (passing, syncing):
        assert case["refusal"] is None and case["there"] == case["here"] and case["instead"] == case["here"]
        assert not case["left"]
    assert not passing["imported"]  # the run's process imported nothing of the scan's


_AGAIN = """
import json, sys
from drift import preset
from drift.runspec import resolve
from drift.syncs.process import scan_beside
from drift.syncs.scan import RUN_SAMPLE

run = resolve(preset("ci-small", steps=64), "sglang-0.5.23")
imported, results = [], []
for _ in range(3):
    scan = scan_beside(run, RUN_SAMPLE, stop_on_sync=False)
    imported.append("torch.distributed.tensor" in sys.modules)
    results.append(scan.result().to_dict())
    scan.close()
print(json.dumps({"imported": imported, "same": all(r == results[0] for r in results), "passed": results[0]["passed"]}))
"""


def test_a_process_that_scans_again_imports_what_its_children_import_once_itself():
    """The first scan leaves torch's import to its child (a single run's thread is spared it); from the second
    on this process imported it first, so the children inherit it. Fails where every child imports it again
    (nothing imported here) or where the first run pays it here."""
    out = python_json(_AGAIN, OPENBLAS_NUM_THREADS="1")
    assert out["imported"] == [False, True, True]
    assert out["same"] and out["passed"]


_RUN = """
import json, sys
from drift import preset
from drift.runner import TIMINGS, run_checked
from drift.runspec import resolve
from drift.syncs import process
from drift.syncs.scan import RUN_SAMPLE

forked = []
class Spy(process.ScanProcess):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        forked.append(self.pid)
import drift.runner
process.ScanProcess = Spy
simulated = []
class Checked(drift.runner.CheckedRun):
    def run(self, *args, **kwargs):
        info = super().run(*args, **kwargs)
        simulated.append([info.steps, info.stopped_early, self.sim.ramp])
        return info
drift.runner.CheckedRun = Checked
if sys.argv[1] == "here":
    process.scan_refusal = lambda run: "scanned here: the control"
run = resolve(preset("ci-small", steps=int(sys.argv[3])), sys.argv[2])
rep = run_checked(run, sync_first=True, sync_sample=RUN_SAMPLE, diagnose=False)
d = rep.to_dict()
d["run"] = {k: v for k, v in d["run"].items() if k not in TIMINGS}
print(json.dumps({"forked": len(forked), "figures": d, "simulated": simulated}))
"""


def _run(where: str, spec: str, steps: int) -> dict:
    return python_json(_RUN.replace("sys.argv[1]", repr(where)).replace("sys.argv[2]", repr(spec))
                       .replace("int(sys.argv[3])", str(steps)), OPENBLAS_NUM_THREADS="1")


@pytest.mark.parametrize("spec, steps", [("sglang-0.5.23", 320), ("sglang-32130", 2048)], ids=["passes", "syncs"])
def test_a_run_that_scans_in_a_process_reports_what_a_run_that_scans_here_reports(spec, steps):
    there, here = _run("process", spec, steps), _run("here", spec, steps)
    assert there["forked"] == 1 and here["forked"] == 0
    assert there["figures"] == here["figures"]
    checks = {c["key"]: c for c in there["figures"]["checks"]}
    if spec == "sglang-32130":  # the sync stopped the run: the precision checks are not reported
        assert checks["host_syncs"]["verdict"] == "FAIL" and checks["precision_checks"]["verdict"] == "n/a"
        assert there["figures"]["run"]["steps"] == 0 and here["simulated"] == []  # here: the scan came first
        # there: the run began, on fail-fast's short first chunks, and stopped once the scan's result was in
        [[simulated, why, ramp]] = there["simulated"]
        assert simulated < steps and why.startswith("host sync: ") and ramp, there["simulated"]
    else:  # the short first chunks move where checks run, not what they find (tests/test_fail_fast.py)
        assert checks["host_syncs"]["verdict"] == "PASS" and there["figures"]["run"]["steps"] == steps
        assert there["simulated"] == [[steps, None, True]] and here["simulated"] == [[steps, None, False]]


_RAISES = """
import json
from drift import preset
from drift.errors import UpdateRaised
from drift.runner import run_checked
from drift.runspec import resolve
from drift.syncs import process

calls = []
def update(self, last_correct_step_indices, mamba_track_indices=None, mamba_steps_to_track=None):
    calls.append(1)
    raise ValueError("the update raised")
update.__module__ = "user_update"
run = resolve(preset("ci-small", steps=64), update)
said = {}
for where in ("process", "here"):
    if where == "here":  # the control: the scan in the run's own process
        process.scan_refusal = lambda run: "here"
    assert (process.scan_refusal(run) is None) == (where == "process")
    try:
        run_checked(run, sync_first=True)
    except UpdateRaised as exc:
        said[where] = str(exc)
print(json.dumps(said))
"""


def test_an_update_that_raises_in_the_scans_process_raises_here():
    said = python_json(_RAISES, OPENBLAS_NUM_THREADS="1")
    assert "ValueError('the update raised')" in said["process"] and "host-sync scan" in said["process"], said
    assert said["process"] == said["here"]


def test_where_forking_is_not_safe_the_run_scans_in_its_own_process(monkeypatch):
    run = resolve(preset("ci-small", steps=64))
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert "other Python thread" in process.scan_refusal(run)
    finally:
        stop.set()
        thread.join()
    monkeypatch.setattr(process, "fork_refusal", lambda: None)
    assert process.scan_refusal(run) is None  # the control: one thread, no accelerator
    monkeypatch.setattr(process, "_device_pass", lambda cfg, device: "cuda")
    assert "accelerator pass" in process.scan_refusal(run)


def test_a_fork_the_system_refuses_leaves_the_scan_in_the_runs_process(monkeypatch):
    """fork() or a pipe refused (EAGAIN, ENOMEM, EMFILE): the run scans in its own process, with the same row."""
    from drift import runner

    run = resolve(preset("ci-small", steps=48), "sglang-32130")
    plain = runner.run_checked(run, sync_first=True)  # this worker has threads: scanned here

    def refused(*args, **kwargs):
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(process, "scan_refusal", lambda run: None)  # as a one-thread process would be
    monkeypatch.setattr(process.ScanProcess, "__init__", refused)
    rep = runner.run_checked(run, sync_first=True)
    row = lambda r: next(c for c in r.to_dict()["checks"] if c["key"] == "host_syncs")
    assert row(rep) == row(plain) and row(rep)["verdict"] == "FAIL" and rep.info.steps == 0


def test_the_result_is_polled_on_any_descriptor_number():
    """``select`` refuses a descriptor past 1023, which a process with many files open hands out; ``poll``
    does not. Nothing written: not readable; written, or its writer closed: readable."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    r, w = os.pipe()
    high = min(soft - 1, 1500)
    try:
        os.dup2(r, high)
        for fd in (r, high):
            assert not process._readable(fd)
        os.write(w, b"x")
        assert process._readable(r) and process._readable(high)
        os.read(r, 1)
        os.close(w)
        w = None
        assert process._readable(r)  # the writer's end: readable (EOF)
    finally:
        for fd in (r, high, w):
            if fd is not None:
                os.close(fd)
