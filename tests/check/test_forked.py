"""The comparison in a forked process (drift/check/forked.py) and what crosses to it (drift/check/wire.py):
every step arrives whole and in order through the shared ring, even when the child is slower; the child's
error and its death reach the simulation as one clear error; closing leaves no process behind; a run
compared there has the figures of the same run compared on the simulation's thread (a process that loses
one step is seen), and so has a run resumed from a checkpoint it took.

Forking needs a process with no other thread, which pytest-xdist's workers are not: each case runs in a
fresh interpreter (``python -c``), where drift forks as ``drift run`` does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from helpers import python_json
from drift.check.forked import fork_refusal, os_threads
from drift.check.wire import Placed, pack, unpack
from drift.sim.serving import Start

# A fresh interpreter forks only with one OpenBLAS thread, as the drift command sets it (drift/openmp.py:
# blas_defaults): numpy's pool would refuse the fork wherever the suite's own environment does not limit it
# (run without pytest-xdist, whose workers pass on OMP_NUM_THREADS=1, tests/conftest.py).
ONE_BLAS_THREAD = {"OPENBLAS_NUM_THREADS": "1"}


# ------------------------------------------------------------------------------------------ the wire
def test_the_wire_restores_every_type_it_takes_bit_for_bit():
    value = {"none": None, "flags": (True, False, np.bool_(True)), 3: -2 ** 63, "f": float("-0.0"), "nan": float("nan"),
             "s": "naïve", "list": [1, [2.5, ()]], "i64": np.arange(6, dtype=np.int64).reshape(2, 3),
             "b": np.array([True, False]), "empty": np.empty((0, 4), np.float32),
             "bf16": torch.tensor([1.0, -3.140625, 1e-38], dtype=torch.bfloat16),
             "view": torch.arange(24, dtype=torch.float64).view(2, 3, 4).transpose(0, 2),  # not contiguous
             "none_left": torch.empty(0, 3, dtype=torch.int32), "start": Start(lane=1, request=7, code=2, p0=3, p1=9)}
    back = unpack(pack(value))
    assert list(back) == list(value)
    assert back["none"] is None and back["flags"] == (True, False, True) and back[3] == -2 ** 63
    assert str(back["f"]) == "-0.0" and back["nan"] != back["nan"] and back["s"] == "naïve"
    assert back["list"] == [1, [2.5, ()]] and back["start"] == value["start"]
    for key in ("i64", "b", "empty"):
        assert back[key].dtype == value[key].dtype and np.array_equal(back[key], value[key]), key
    for key in ("bf16", "view", "none_left"):
        assert back[key].dtype == value[key].dtype and back[key].shape == value[key].shape, key
        assert torch.equal(back[key].view(-1).view(torch.uint8) if back[key].numel() else back[key],
                           value[key].contiguous().view(-1).view(torch.uint8) if value[key].numel() else value[key])


@pytest.mark.parametrize("bad", [{1, 2}, np.array(["a"], dtype=object), b"bytes", {(1, 2): 3}],
                         ids=["set", "object-array", "bytes", "tuple-key"])
def test_the_wire_refuses_what_it_does_not_take_naming_it(bad):
    with pytest.raises(TypeError, match="cannot send a"):
        pack({"ok": 1, "bad": bad})


def test_a_placed_tensor_crosses_as_its_place_and_is_read_back_by_the_receiver():
    """Only a Placed's place crosses (its offset, dtype and shape: tens of bytes); the receiver's ``placed`` reads it back, and
    bytes holding one are refused where there is no shared memory to read it from."""
    shared = torch.arange(32768, dtype=torch.bfloat16)
    where = Placed(offset=128, dtype=torch.bfloat16, shape=(4, 8))
    data = pack({"snapshot": where, "rows": (1, 2)})
    assert len(data) < 200 and where.nbytes == 64
    back = unpack(data, placed=lambda p: shared.view(torch.uint8)[p.offset:p.offset + p.nbytes].view(p.dtype).view(p.shape).clone())
    assert torch.equal(back["snapshot"], shared[64:96].view(4, 8)) and back["rows"] == (1, 2)
    with pytest.raises(ValueError, match="no shared memory"):
        unpack(data)


def test_the_wire_refuses_bytes_it_did_not_make():
    data = pack((1, "two"))
    with pytest.raises(ValueError, match="bytes left"):
        unpack(data + b"N")
    with pytest.raises(ValueError, match="unknown tag"):
        unpack(b"?" + data)


# ------------------------------------------------------------------------------------- the process
def test_no_fork_while_another_thread_runs():
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert "other Python thread" in fork_refusal()
    finally:
        stop.set()
        thread.join()
    assert python_json("import json; from drift.check.forked import fork_refusal; print(json.dumps(fork_refusal()))",
                       **ONE_BLAS_THREAD) is None  # a fresh interpreter, one thread: it may fork


_WORKER = """
import json, os, signal, sys, time
import numpy as np, torch
from drift.check import forked
from drift.check.forked import ComparisonProcessError, ForkedWorker

case = sys.argv[1] if len(sys.argv) > 1 else os.environ["CASE"]
if case == "unguarded":  # a ring that does not wait for the child to release a slot
    forked.ForkedWorker._wait_for_room = lambda self: None
seen = []
def on_step(views, host, meta):
    if meta == "boom":
        raise ValueError(f"boom at step {host[0]}")
    time.sleep(0.002 if meta == "slow" or isinstance(meta, dict) else 0)
    if isinstance(meta, dict):
        meta = [float(t.double().mean()) if t is not None else None for t in meta.values()]
    seen.append([int(host[0]), float(views["x"].double().sum()), meta])
worker = ForkedWorker({"x": torch.zeros(3, dtype=torch.bfloat16)}, 1, on_step, lambda: None,
                      {"seen": lambda _: seen, "pid": lambda _: os.getpid()})
pid = worker.ask("pid")
out = {"slots": worker.ring.slots, "pid": pid}
try:
    if case in ("order", "unguarded"):
        for i in range(200):  # exact in bfloat16: integers to 256
            worker.submit({"x": torch.full((3,), float(i), dtype=torch.bfloat16)}, np.array([i]), "slow")
        out["seen"] = worker.ask("seen")
        out["waited_s"] = worker.waited_s
    elif case == "error":
        for i in range(10):
            worker.submit({"x": torch.zeros(3, dtype=torch.bfloat16)}, np.array([i]), "boom" if i == 5 else None)
        worker.ask("seen")
    elif case == "placed":  # larger tensors of a step's data go to the slot's shared spill bytes
        sent = []
        real_write = forked.write_message
        forked.write_message = lambda fd, m: sent.append(len(forked.pack_parts(m)) and sum(
            p.nbytes if isinstance(p, memoryview) else len(p) for p in forked.pack_parts(m))) or real_write(fd, m)
        for i in range(200):
            meta = {"big": torch.full((32768,), float(i), dtype=torch.bfloat16),  # 64 KiB: placed
                    "small": torch.full((4,), float(i)),  # through the pipe
                    "huge": torch.full((forked.SPILL_BYTES // 8 + 1,), float(i), dtype=torch.float64) if i % 50 == 0 else None}
            worker.submit({"x": torch.full((3,), float(i), dtype=torch.bfloat16)}, np.array([i]), meta)
        out["seen"] = worker.ask("seen")
        out["sent_bytes"] = sum(sent)
    elif case == "killed":
        os.kill(pid, signal.SIGKILL)
        worker.ask("seen")
except ComparisonProcessError as exc:
    out["error"] = str(exc)
worker.close()
out["child_left"] = os.path.exists(f"/proc/{pid}")
print(json.dumps(out))
"""


def test_every_step_reaches_the_process_whole_and_in_order_even_when_it_is_slower():
    out = python_json(_WORKER, CASE="order")
    assert out["seen"] == [[i, 3.0 * i, "slow"] for i in range(200)]
    assert out["slots"] < 200 and out["waited_s"] > 0  # the ring filled: the simulation waited for room
    assert not out["child_left"]


def test_a_steps_larger_tensors_reach_the_process_through_shared_memory_whole_and_in_order():
    """A step's larger tensors (its tracked snapshots, its starts' truths) are written into its slot's spill
    bytes and only their place is sent; a smaller one, and one larger than the spill, go through the pipe.
    Every value arrives as sent while the ring is full (a slot's spill is not written again before the
    child took it); the pipe carries less than one step's large tensor per step."""
    out = python_json(_WORKER, CASE="placed")
    want = [[i, 3.0 * i, [float(i), float(i), float(i) if i % 50 == 0 else None]] for i in range(200)]
    assert out["seen"] == want
    huge = 4 * (1 << 20) + 8  # the four steps whose third tensor exceeds the spill: through the pipe
    assert out["sent_bytes"] < huge + 200 * 4096, out["sent_bytes"]


def test_a_ring_that_does_not_wait_for_the_process_is_seen():  # the negative control of the one above
    out = python_json(_WORKER, CASE="unguarded")
    assert len(out["seen"]) == 200  # as many steps arrive...
    assert out["seen"] != [[i, 3.0 * i, "slow"] for i in range(200)]  # ...but slots were overwritten before read


def test_the_processes_error_reaches_the_simulation_with_its_traceback():
    out = python_json(_WORKER, CASE="error")
    assert "the comparison's process failed" in out["error"] and "ValueError: boom at step 5" in out["error"]
    assert not out["child_left"]


def test_a_process_that_dies_is_said_not_waited_for():
    out = python_json(_WORKER, CASE="killed")
    assert "ended unexpectedly (signal 9)" in out["error"], out
    assert not out["child_left"]


# ------------------------------------------------------------------------------------------ runs
_RUN = """
import json, os, sys
from drift import preset
from drift.check import forked
from drift.runner import TIMINGS, run_checked
from drift.runspec import resolve

lifecycle, lose = sys.argv[1], int(sys.argv[2])
if lose:  # a broken hand-over: step `lose` never reaches the process
    submit, count = forked.ForkedWorker.submit, [0]
    def lossy(self, *args):
        count[0] += 1
        if count[0] != lose:
            submit(self, *args)
    forked.ForkedWorker.submit = lossy
rep = run_checked(resolve(preset("ci-small", steps=300, lifecycle=lifecycle)), sync_scan=False)
d = rep.to_dict()
pace = d["run"]["pace"]
d["run"] = {k: v for k, v in d["run"].items() if k not in TIMINGS}
print(json.dumps({"pace": pace, "passed": rep.passed, "figures": d}))
"""


def _run(lifecycle: str, where: str, lose: int = 0) -> dict:
    return python_json(_RUN.replace("sys.argv[1], int(sys.argv[2])", f"{lifecycle!r}, {lose}"), DRIFT_COMPARISON=where,
                       **ONE_BLAS_THREAD)


@pytest.mark.parametrize("lifecycle", ["fixed", "serving"])
def test_a_run_compared_in_a_process_has_the_same_figures(lifecycle):
    plain, forked = _run(lifecycle, "serial"), _run(lifecycle, "process")
    assert plain["pace"]["thread"] == "simulation" and forked["pace"]["thread"] == "process"
    assert plain["passed"] and forked["figures"] == plain["figures"]
    lossy = _run(lifecycle, "process", lose=100)
    assert lossy["pace"]["thread"] == "process" and lossy["figures"] != plain["figures"]


_RESUME = """
import json, sys
from pathlib import Path
from drift import checkpoint, preset
from drift.runner import CheckedRun
from drift.runspec import resolve

cfg, path = preset("ci-small", steps=320, lifecycle="serving"), Path(sys.argv[1])
whole = CheckedRun(resolve(cfg))
whole_rep = whole.report(whole.run(), sync_scan=False)
first = CheckedRun(resolve(cfg))
first.run(checkpoint=lambda done, snap: checkpoint.save(path, snap) if not path.exists() else None, checkpoint_every=128)
resumed = CheckedRun(resolve(cfg))
rep = resumed.report(resumed.run(resume_state=checkpoint.load(path)), sync_scan=False)
key = lambda r: {c.key: (c.passed, c.worst, c.where) for c in r.checks}
print(json.dumps({"same": key(rep) == key(whole_rep), "where": [first.comparison.pace()["thread"],
                  resumed.comparison.pace()["thread"]], "passed": rep.passed}))
"""


def test_a_checkpoint_taken_in_the_process_resumes_to_the_same_figures(tmp_path):
    code = _RESUME.replace("Path(sys.argv[1])", f"Path({str(tmp_path / 'ckpt.pt')!r})")
    # and one OpenMP thread, as under pytest-xdist: three runs of CheckedRun (no run_threads) on torch's own count
    # would start OpenMP's pool in the first, and its threads keep the later ones from forking
    out = python_json(code, DRIFT_COMPARISON="process", OMP_NUM_THREADS="1", **ONE_BLAS_THREAD)
    assert out == {"same": True, "where": ["process", "process"], "passed": True}


# ------------------------------------------------------------------------------ when it forks
def test_a_library_thread_keeps_the_process_from_forking(monkeypatch, tmp_path):
    from drift.check import forked

    status = tmp_path / "status"
    status.write_text("Name:\tpython\nThreads:\t3\nVmRSS:\t1 kB\n")
    assert forked.os_threads(str(status)) == 3 and forked.os_threads(str(tmp_path / "absent")) == 0
    said = _refusal(monkeypatch, threads=3, openblas="4", torch_threads=1)
    assert "2 other thread(s)" in said and "OPENBLAS_NUM_THREADS=1" in said and "OpenMP" not in said
    assert _refusal(monkeypatch, threads=1, openblas="4", torch_threads=1) is None


def _refusal(monkeypatch, threads: int, openblas: str, torch_threads: int):
    """fork_refusal() in a process of one Python thread and ``threads`` OS threads, under
    OPENBLAS_NUM_THREADS=``openblas`` and torch's ``torch_threads``."""
    from drift.check import forked

    monkeypatch.setattr(forked, "os_threads", lambda: threads)
    monkeypatch.setattr(forked.threading, "active_count", lambda: 1)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", openblas)
    monkeypatch.setattr(forked.torch, "get_num_threads", lambda: torch_threads)
    return forked.fork_refusal()


def test_the_refusal_names_the_pool_that_likely_runs(monkeypatch):
    """torch's OpenMP pool (an op on more threads than one starts it) is named with its fix; numpy's OpenBLAS
    only where OPENBLAS_NUM_THREADS is not 1; neither likely: a library's pool."""
    said = _refusal(monkeypatch, threads=2, openblas="1", torch_threads=2)
    assert "OpenMP pool" in said and "torch.set_num_threads(1)" in said and "OpenBLAS" not in said
    assert _refusal(monkeypatch, threads=2, openblas="1", torch_threads=1) == \
        "1 other thread(s) run in this process (a library's pool of threads)"


_GATE_THREADS = """
import json, torch
from drift import preset
from drift.check.forked import os_threads
from drift.runner import preflight
from drift.runspec import resolve
from drift.syncs.scan import sync_check

run = resolve(preset("ci-small", steps=64))  # torch's own thread count until a run takes one (run_threads)
preflight(run)
sync_check(run, sample=2)
after_gate = os_threads()
torch.set_num_threads(2)  # the control: two threads, and a matmul on them; OpenMP's pool starts
torch.randn(64, 64) @ torch.randn(64, 64)
print(json.dumps([after_gate, os_threads()]))
"""


def test_the_gates_scan_and_preflight_leave_the_process_able_to_fork():
    """The sync tests and the preflight run before the precision runs, on the run's one thread: no OpenMP
    pool starts, so each precision run can fork its comparison (a matmul on two threads, the control, does
    start one)."""
    # as an engine's CI runs the gate: no OMP_NUM_THREADS (this suite's xdist workers set it: a user's count
    # stands, drift.openmp.run_threads)
    after_gate, after_matmul = python_json(_GATE_THREADS, drop=("OMP_NUM_THREADS",), OPENBLAS_NUM_THREADS="1")
    assert after_gate == 1 and after_matmul > 1


def test_drift_run_compares_in_a_process_where_it_has_a_core_for_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST_", "OPENBLAS_", "DRIFT_COMPARISON"))}
    proc = subprocess.run([sys.executable, "-m", "drift", "run", "--steps", "32", "--quiet", "--report",
                           str(tmp_path)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pace = json.loads((tmp_path / "report.json").read_text())["run"]["pace"]
    assert pace["thread"] == ("process" if len(os.sched_getaffinity(0)) >= 2 else "simulation"), pace


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupted_run_ends_with_its_comparisons_process(tmp_path, sig, code):
    """A terminal's Ctrl-C or a CI runner's SIGTERM reaches the whole process group mid-run: the command
    exits with its one line and code, and its comparison's process is gone with it."""
    proc = subprocess.Popen([sys.executable, "-m", "drift", "run", "--report", str(tmp_path / "r")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "DRIFT_COMPARISON": "process"})
    def comparisons() -> list[int]:  # the comparison's child runs a reader thread; the scan's child, one thread
        return [c for c in _children(proc.pid) if os_threads(f"/proc/{c}/status") > 1]

    deadline = time.monotonic() + 120
    while not comparisons() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert comparisons(), "the run's comparison was not forked"  # the run is under way
    children = _children(proc.pid)  # the comparison's, and the host-sync scan's while it scans
    os.killpg(proc.pid, sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, f"stdout: {out!r}\nstderr: {err!r}"
    assert "Traceback" not in err and "interrupted" in err.strip().splitlines()[-1]
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{c}") for c in children) and time.monotonic() < deadline:  # init reaps an orphan
        time.sleep(0.05)
    assert not [c for c in children if os.path.exists(f"/proc/{c}")]


_ABANDONED = """
import json, os
import drift.simulate as simulate
from drift import preset
from drift.check import compare
from drift.runner import run_checked
from drift.runspec import resolve

if os.environ.get("NO_ABANDON"):  # the control: a comparison that is not told
    del compare.Comparison.abandon
step, kept = simulate.Simulation._step, []
def raising(self, *args, **kwargs):
    if self.step_count == 40:
        raise RuntimeError("the run raised")
    self.step_count += 1
    return step(self, *args, **kwargs)
simulate.Simulation._step, simulate.Simulation.step_count = raising, 0
for _ in range(2):
    try:
        run_checked(resolve(preset("ci-small", steps=128)), sync_scan=False)
    except RuntimeError as exc:
        kept.append(exc)  # with its traceback: the run's objects stay alive
pid = os.getpid()
print(json.dumps(open(f"/proc/{pid}/task/{pid}/children").read().split()))
"""


def test_a_run_that_raises_ends_its_comparisons_process_at_once():
    assert python_json(_ABANDONED, DRIFT_COMPARISON="process", OPENBLAS_NUM_THREADS="1") == []
    assert len(python_json(_ABANDONED, DRIFT_COMPARISON="process", OPENBLAS_NUM_THREADS="1", NO_ABANDON="1")) == 2


def test_a_fork_the_system_refuses_leaves_the_comparison_on_a_thread(monkeypatch):
    """fork(), a pipe or the shared memory refused (EAGAIN, ENOMEM): the run goes on, compared on the worker
    thread, with the same figures."""
    from drift import preset
    from drift.check import compare
    from drift.runner import run_checked
    from drift.runspec import resolve

    run = resolve(preset("ci-small", steps=48))
    monkeypatch.setenv("DRIFT_COMPARISON", "serial")
    plain = run_checked(run, sync_scan=False)

    def refused(*args, **kwargs):
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setenv("DRIFT_COMPARISON", "process")
    monkeypatch.setattr(compare, "fork_refusal", lambda: None)  # as a one-thread process would be
    monkeypatch.setattr(compare.ForkedWorker, "__init__", refused)
    rep = run_checked(run, sync_scan=False)
    assert rep.to_dict()["run"]["pace"]["thread"] == "worker"
    strip = lambda r: {k: v for k, v in r.to_dict().items() if k != "run"}
    assert strip(rep) == strip(plain) and rep.passed


def test_a_refused_fork_leaves_no_pipe_open(monkeypatch):
    from drift.check import forked

    def refused():
        raise BlockingIOError(11, "Resource temporarily unavailable")

    before = set(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(forked.os, "fork", refused)
    with pytest.raises(BlockingIOError):
        forked.ForkedWorker({"x": torch.zeros(2)}, 1, lambda *a: None, lambda: None, {})
    assert set(os.listdir("/proc/self/fd")) == before
