"""A background worker that runs one function over items in the order they were submitted.

The comparison hands it each step the simulation ran (:meth:`drift.check.compare.Comparison.on_step`)
so that the float64 twin and the measures run on a second core while the simulation computes the
next steps. Torch and drift's C kernels release the GIL while they compute, so the two threads
overlap. The same operations run in the same order on the same values: the figures do not change.

Rules that keep it safe:

* ``submit`` blocks once ``limit`` items wait (memory stays bounded: each holds one step's copies);
* ``drain`` waits until every submitted item was handled, then raises the first error a handler
  raised (with its own traceback), as does every later ``submit`` or ``drain``: the items after it
  are dropped unhandled (what they would compare no longer follows from what was compared);
* ``close`` ends the thread at once and joins it (a run's end: ``Comparison.on_end``); the thread also
  ends after :data:`IDLE_S` seconds without work, so an abandoned run (its caller raised between steps)
  leaves no thread behind; the next ``submit`` starts a new one;
* no worker thread outlives the interpreter's shutdown: an ``atexit`` hook closes every live one. A
  daemon thread still running at finalization is ended inside whatever C call it is in, and ending it
  inside a torch tensor's deallocation (C++, noexcept) aborts the process ("terminate called without an
  active exception", exit 134): a passing ``pytest --pyargs drift`` failed so, one run in ten, when its
  last run ended less than ``IDLE_S`` before the process did.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable, Optional

import torch

IDLE_S = 0.5  # a worker with nothing to do for this long ends (a later submit starts another)
_LIVE: "weakref.WeakSet[OrderedWorker]" = weakref.WeakSet()  # workers whose thread may be running


@atexit.register
def close_all() -> None:
    """Close every worker whose thread may still run (:meth:`OrderedWorker.close`): at exit, before the
    interpreter's finalization, which would end a daemon thread wherever it is."""
    for worker in list(_LIVE):
        worker.close()


def worth_a_worker(*devices: torch.device) -> bool:
    """Whether a background thread can take work off this process's main thread: every device is the
    CPU (an accelerator's queue already overlaps host and device), torch computes on one intra-op thread
    (more would contend with the worker for the cores, drift.openmp.run_threads), and this process has
    at least two CPUs to itself: those it may run on, shared out among pytest-xdist's workers when it
    is one of them (``PYTEST_XDIST_WORKER_COUNT``: each runs its own tests on the same CPUs)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    try:
        sharing = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    except ValueError:
        sharing = 1
    return all(d.type == "cpu" for d in devices) and torch.get_num_threads() == 1 and cpus // sharing >= 2


class OrderedWorker:
    """Runs ``handle(item)`` for each submitted item, in order, on one background thread."""

    def __init__(self, handle: Callable[[Any], None], limit: int, name: str = "drift-worker"):
        self._handle = handle
        self._limit = max(1, int(limit))
        self._name = name
        self._items: deque = deque()
        self._busy = 0  # submitted and not yet handled (or dropped)
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self._closing = False  # close() asked the thread to end
        self._cond = threading.Condition()
        self.waited_s = 0.0  # how long the submitting thread waited for the worker (room, or a drain)

    def submit(self, item: Any) -> None:
        """Queue ``item`` (waiting while ``limit`` items wait); raises a handler's earlier error."""
        with self._cond:
            self._wait_while(lambda: len(self._items) >= self._limit and self._error is None)
            self._raise_error()
            self._items.append(item)
            self._busy += 1
            if self._thread is None:
                self._closing = False
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
                _LIVE.add(self)
            self._cond.notify_all()

    def drain(self) -> None:
        """Wait until every submitted item was handled; raise the first error a handler raised."""
        with self._cond:
            self._wait_while(lambda: self._busy)
            self._raise_error()

    def close(self) -> None:
        """End the thread now and join it: the item in hand is finished, those still queued are dropped
        unhandled (a run that ended, or was abandoned, compares nothing more). A later ``submit``
        starts a new thread. Safe to call twice; from the worker's own handler it only asks (the thread
        ends after that item, and stays listed for the exit hook until it has)."""
        with self._cond:
            self._busy -= len(self._items)
            self._items.clear()
            self._closing = True
            thread = self._thread
            self._cond.notify_all()
        if thread is threading.current_thread():
            return
        if thread is not None:
            thread.join()
        _LIVE.discard(self)

    def _wait_while(self, blocked: Callable[[], Any]) -> None:
        """Under the lock: wait while ``blocked()``, adding the time to :attr:`waited_s`."""
        if blocked():
            t0 = time.perf_counter()
            while blocked():
                self._cond.wait()
            self.waited_s += time.perf_counter() - t0

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._items:
                    self._cond.wait_for(lambda: bool(self._items) or self._closing, timeout=IDLE_S)
                    if not self._items:
                        self._thread = None  # under the lock: a submit from now on starts another
                        return
                item = self._items.popleft()
                failed = self._error is not None
                self._cond.notify_all()  # a submit waiting for room
            if not failed:
                try:
                    self._handle(item)
                except BaseException as exc:  # handed to the caller at its next submit or drain
                    with self._cond:
                        self._error = self._error or exc
            item = None  # the step's tensors are freed here, never as the thread ends
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()
