"""The comparison's worker thread (drift/check/pipeline.py): items in order, errors handed back,
bounded memory, no thread left behind; and a pipelined run's figures equal, field for field, those of
the same run compared on the main thread (a worker that loses one step is seen)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from drift.check import compare, pipeline
from drift.check.pipeline import OrderedWorker, worth_a_worker
from drift.config import preset
from drift.runner import TIMINGS, run_checked
from drift.runspec import resolve


def test_items_are_handled_in_order_on_another_thread():
    seen, threads = [], set()
    worker = OrderedWorker(lambda i: (seen.append(i), threads.add(threading.current_thread().name)), limit=3)
    for i in range(50):
        worker.submit(i)
    worker.drain()
    assert seen == list(range(50)) and threads == {"drift-worker"}


def test_a_handlers_error_reaches_the_caller_and_the_items_after_it_are_dropped():
    seen = []

    def handle(i):
        if i == 3:
            raise ValueError("bad item 3")
        seen.append(i)

    worker = OrderedWorker(handle, limit=100)
    # It reaches the caller at its next submit or at the drain, whichever comes first: the worker may
    # fail on item 3 before the last items are submitted (it did under load, in a CI rehearsal).
    with pytest.raises(ValueError, match="bad item 3") as info:
        for i in range(8):
            worker.submit(i)
        worker.drain()
    assert any(f.name == "handle" for f in info.traceback)  # the handler's own frame
    assert seen == [0, 1, 2]
    with pytest.raises(ValueError, match="bad item 3"):  # it stays raised: the rest no longer follows
        worker.submit(9)


def test_submit_waits_while_limit_items_wait():
    gate, handled = threading.Event(), []
    worker = OrderedWorker(lambda i: (gate.wait(5), handled.append(i)), limit=2)
    worker.submit(0)  # taken by the thread, which waits on the gate
    worker.submit(1)
    worker.submit(2)  # two wait: the next submit must block
    done = threading.Event()
    threading.Thread(target=lambda: (worker.submit(3), done.set()), daemon=True).start()
    assert not done.wait(0.3)  # still blocked: memory stays bounded
    gate.set()
    assert done.wait(5)
    worker.drain()
    assert handled == [0, 1, 2, 3]


def test_an_idle_worker_ends_and_a_later_submit_starts_another(monkeypatch):
    monkeypatch.setattr(pipeline, "IDLE_S", 0.05)
    seen = []
    worker = OrderedWorker(seen.append, limit=4, name="drift-idle-test")
    worker.submit(1)
    worker.drain()
    deadline = time.monotonic() + 5
    while any(t.name == "drift-idle-test" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.name == "drift-idle-test" for t in threading.enumerate())  # an abandoned run leaves none
    worker.submit(2)
    worker.drain()
    assert seen == [1, 2]


def test_close_ends_the_thread_at_once_finishing_the_item_in_hand(monkeypatch):
    """close() joins the thread, long before IDLE_S: the item in hand is finished, the queued ones are
    dropped, a drain returns at once, and a later submit starts a new thread."""
    monkeypatch.setattr(pipeline, "IDLE_S", 30.0)  # only close() can end the thread within this test
    gate, started, handled = threading.Event(), threading.Event(), []
    worker = OrderedWorker(lambda i: (started.set(), gate.wait(5), handled.append(i)), limit=8, name="drift-close-test")
    for i in range(5):
        worker.submit(i)
    assert started.wait(5)  # item 0 is in hand (on a loaded box the thread may start late)
    closed = threading.Event()
    threading.Thread(target=lambda: (worker.close(), closed.set()), daemon=True).start()
    assert not closed.wait(0.2)  # it waits for item 0, in hand (held on the gate for up to 5 s)
    gate.set()
    assert closed.wait(5)
    assert handled == [0] and not any(t.name == "drift-close-test" for t in threading.enumerate())
    worker.drain()  # nothing left to wait for
    t0 = time.monotonic()
    worker.close()  # twice: a no-op
    worker.submit(7)
    worker.drain()
    worker.close()  # an idle thread ends at once, not after IDLE_S
    # Bound: these calls take milliseconds; an idle thread left to end by itself would take IDLE_S = 30 s.
    # 5 s sits between the two with room for a loaded box's scheduling delays.
    assert handled == [0, 7] and time.monotonic() - t0 < 5
    assert not any(t.name == "drift-close-test" for t in threading.enumerate())


def test_close_from_the_workers_own_handler_only_asks(monkeypatch):
    """A handler that closes its worker ends the thread after its item: the queue behind it is dropped and
    nothing joins itself (a self-join raises, and the drain would hand that error back)."""
    monkeypatch.setattr(pipeline, "IDLE_S", 30.0)
    gate, handled, workers = threading.Event(), [], []

    def handle(i):
        if i == "hold":  # keeps the thread until every item is queued
            gate.wait(5)
            return
        handled.append(i)
        if i == 1:
            workers[0].close()

    workers.append(OrderedWorker(handle, limit=8, name="drift-self-close-test"))
    for i in ("hold", 0, 1, 2, 3):
        workers[0].submit(i)
    gate.set()
    workers[0].drain()
    workers[0].close()  # joins the thread, which ends after item 1
    assert handled == [0, 1] and not any(t.name == "drift-self-close-test" for t in threading.enumerate())


def test_a_runs_end_leaves_no_worker_thread(monkeypatch):
    monkeypatch.setattr(pipeline, "IDLE_S", 30.0)  # only the run's end can end the thread within this test
    monkeypatch.setattr(compare, "worth_a_worker", lambda *devices: True)
    monkeypatch.setattr(compare.Comparison, "forked", False)  # the thread (tests/check/test_forked.py: the process)
    rep = run_checked(resolve(preset("ci-small", steps=32)), sync_scan=False)
    assert rep.to_dict()["run"]["pace"]["thread"] == "worker"
    assert not any(t.name == "drift-comparison" for t in threading.enumerate())


_EXIT_SCRIPT = """
import atexit, sys, threading
@atexit.register  # registered before drift's hook, so it runs after it (atexit runs last-in first-out)
def live_at_finalization():
    print("LIVE", sorted(t.name for t in threading.enumerate() if t.name.startswith("drift-")), flush=True)
from drift.check import pipeline
pipeline.IDLE_S = 30.0
worker = pipeline.OrderedWorker(lambda i: threading.Event().wait(0.2), limit=8, name="drift-exit-test")
for i in range(5):
    worker.submit(i)  # abandoned: neither drained nor closed, and the process ends now
if sys.argv[1:] == ["unhooked"]:
    atexit.unregister(pipeline.close_all)
"""


@pytest.mark.parametrize("hooked", [True, False], ids=["drift's-exit-hook", "without-it"])
def test_no_worker_thread_runs_into_the_interpreters_finalization(hooked):
    """A daemon thread still running at finalization is ended inside whatever C call it is in; inside a
    tensor's deallocation that aborts the process (exit 134 after a passing gate, one run in ten). drift's
    atexit hook closes every live worker first: an abandoned one is gone when the last atexit hook runs.
    The control, without the hook, must see it still there."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, *([] if hooked else ["unhooked"])],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    live = next(line for line in proc.stdout.splitlines() if line.startswith("LIVE"))
    assert live == ("LIVE []" if hooked else "LIVE ['drift-exit-test']"), live


def test_a_worker_only_where_it_has_a_core_to_itself(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)  # this suite's own workers
    monkeypatch.setattr(pipeline.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert worth_a_worker(cpu, cpu)
        assert not worth_a_worker(cpu, torch.device("cuda"))  # an accelerator's queue overlaps already
        torch.set_num_threads(2)
        assert not worth_a_worker(cpu)  # torch's own threads take the cores
        torch.set_num_threads(1)
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
        assert not worth_a_worker(cpu)  # two test workers on two CPUs: each has one
        monkeypatch.setattr(pipeline.os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
        assert worth_a_worker(cpu)  # two each
        monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT")
        monkeypatch.setattr(pipeline.os, "sched_getaffinity", lambda pid: {0}, raising=False)
        assert not worth_a_worker(cpu)  # one CPU: nothing to overlap with
    finally:
        torch.set_num_threads(before)


def test_the_time_the_submitter_waits_for_the_worker_is_counted():
    """A worker slower than its submitter (0.02 s an item, room for one) makes it wait about 0.02 s per
    item beyond the first two; a fast one (room for all) waits only for its drain: ``waited_s`` tells them apart."""
    slow = OrderedWorker(lambda i: time.sleep(0.02), limit=1)
    for i in range(10):
        slow.submit(i)
    slow.drain()
    fast = OrderedWorker(lambda i: None, limit=100)
    for i in range(10):
        fast.submit(i)
    fast.drain()
    # Bound: with room for one, the 10th submit returns only once item 8 is taken, after items 0-7 were
    # handled (each sleep lasts at least 0.02 s: 0.16 s), and the drain lasts until items 8 and 9 are
    # (0.04 s more): the submitter waits at least 0.2 s less its own microseconds of work; the assert asks
    # 0.144 s. The fast worker waits only for ten no-op handlings at its drain: far under half of that.
    assert slow.waited_s >= 8 * 0.02 * 0.9 and fast.waited_s < slow.waited_s / 2, (slow.waited_s, fast.waited_s)


def test_a_run_reports_where_its_comparison_ran_and_the_wait_for_it(monkeypatch, tmp_path):
    from drift.jobs.report import summary_markdown

    run = resolve(preset("ci-small", steps=64))
    monkeypatch.setattr(compare, "worth_a_worker", lambda *devices: True)
    monkeypatch.setattr(compare.Comparison, "forked", False)  # the thread (tests/check/test_forked.py: the process)
    piped = run_checked(run, sync_scan=False)
    monkeypatch.setattr(compare.Comparison, "pipelined", False)
    plain = run_checked(run, sync_scan=False)
    pace = piped.to_dict()["run"]["pace"]
    assert pace["thread"] == "worker" and pace["simulation_waited_s"] >= 0.0, pace
    assert plain.to_dict()["run"]["pace"] == {"thread": "simulation", "simulation_waited_s": 0.0}
    assert "the comparison ran on a worker thread, and the simulation waited" in summary_markdown(piped)
    assert "the comparison ran on the simulation's thread" in summary_markdown(plain)


def _figures(rep) -> dict:
    d = rep.to_dict()
    d["run"] = {k: v for k, v in d["run"].items() if k not in TIMINGS}
    return d


class _LosesOneStep(OrderedWorker):
    """A broken pipeline: the 100th step it is handed is never compared."""

    count = 0

    def submit(self, item):
        type(self).count += 1
        if type(self).count != 100:
            super().submit(item)


@pytest.mark.parametrize("lifecycle", ["fixed", "serving"])
def test_a_pipelined_run_has_the_same_figures(monkeypatch, lifecycle):
    run = resolve(preset("ci-small", steps=300, lifecycle=lifecycle))
    monkeypatch.setattr(compare.Comparison, "pipelined", False)
    plain = run_checked(run, sync_scan=False)
    monkeypatch.setattr(compare.Comparison, "pipelined", True)
    monkeypatch.setattr(compare, "worth_a_worker", lambda *devices: True)  # whatever this box's cores
    monkeypatch.setattr(compare.Comparison, "forked", False)  # the thread (tests/check/test_forked.py: the process)
    where = set()
    take = compare.Comparison._compare_step
    monkeypatch.setattr(compare.Comparison, "_compare_step",
                        lambda self, step: (where.add(threading.current_thread().name), take(self, step))[1])
    piped = run_checked(run, sync_scan=False)
    assert where == {"drift-comparison"}  # every step compared on the worker
    assert plain.passed and _figures(piped) == _figures(plain), lifecycle
    monkeypatch.setattr(compare, "OrderedWorker", _LosesOneStep)
    _LosesOneStep.count = 0
    lossy = run_checked(run, sync_scan=False)
    assert _figures(lossy) != _figures(plain)  # the comparison of figures sees a step gone missing
