"""The gate's precision runs made ahead, in a process of their own, while pytest runs its sync tests.

``pytest --pyargs drift`` runs each shape's sync tests first (with ``-x`` a sync stops the gate in
seconds), then its precision test. The sync tests cost pytest's process about a second (the scans, and
torch 2.13's import of ``torch.distributed.tensor`` at the virtual device's first operation), during which
the precision runs could already simulate. Forked when pytest has collected the gate (the plugin's
``pytest_collection_finish``), a child makes the precision runs in the order of their tests, each the
same :func:`drift.runner.run_checked` call the test makes on the same resolved run, and sends each one's
outcome back as :mod:`drift.check.wire` bytes (no pickle): whether it passed, the failures' text and what
the run wrote to stdout and stderr. The test then reads its outcome instead of running, writes that output
as its own (pytest captures it), and prints the run's progress, which the child sent as it went, through
pytest's terminal as its own run's.

Forked only where the comparison's own process may be (one thread, Linux: :func:`drift.check.forked.
fork_refusal`) and every run is on the CPU (an accelerator's runtime does not survive a fork). A run
that raised in the child, a child that died, or an outcome not yet sent when the session ends: the test
runs in pytest's process as before, so what it raises it raises there, with the same message. The
session's end kills and reaps the child (``-x`` stops the gate at a sync with the runs unfinished).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Callable, Optional

from .check.forked import ReportingChild, fork_refusal, read_message, write_message
from .errors import no_process_exit
from .runspec import Resolved


def failures_text(rep) -> str:
    """What a failed precision test prints of its run's report (drift.runner.RunReport): each failed check's
    detail and place, and the diagnosis where the report has one."""
    text = "; ".join(f"{c.name}: {c.detail} ({c.where})" for c in rep.checks if c.failed) or "none"
    diagnosis = rep.extra.get("diagnosis")
    return f"{text}\ndiagnosis: {diagnosis['text']}" if diagnosis else text


def ahead_refusal(runs: list[Resolved]) -> Optional[str]:
    """Why these runs cannot be made in a forked process, or None when they can."""
    on_device = [r.cfg.device for r in runs if r.cfg.device != "cpu"]
    if on_device:
        return f"a run on {on_device[0]} (its runtime does not survive a fork)"
    return fork_refusal()


def _own_output() -> Callable[[], str]:
    """In the child: stdout and stderr (the descriptors and Python's streams) into a file of its own, not the
    parent's (pytest's capture files, whose offsets it shares); returns ``said()``, what was written since
    the last call."""
    out = tempfile.TemporaryFile()
    for fd in (1, 2):
        os.dup2(out.fileno(), fd)
    sys.stdout = sys.stderr = open(1, "w", buffering=1, errors="backslashreplace", closefd=False)

    def said() -> str:
        sys.stdout.flush()
        out.seek(0)
        text = out.read().decode(errors="replace")
        out.seek(0)
        out.truncate()
        return text

    return said


class RunsAhead(ReportingChild):
    """``run_checked(run, sync_scan=False, **kwargs)`` for each ``(key, run, kwargs)`` of ``runs``, in order, in
    a forked child. :meth:`outcome` waits for one: ``(passed, failures, output)`` (:func:`failures_text`),
    or None where the test must run it itself. With ``progress`` the child sends each run's progress
    ``(done, total, elapsed_s)`` as it goes, which :meth:`outcome` hands on. Flush what the parent wrote
    before constructing it (the child inherits unflushed buffers)."""

    def __init__(self, runs: list[tuple[str, Resolved, dict]], progress: bool = False):
        from .runner import run_checked

        self._outcomes: dict[str, Optional[tuple[bool, str, str]]] = {}
        self._progress: dict[str, list[tuple[int, int, float]]] = {}  # sent before their test asked

        def run_all(w: int) -> None:
            said = _own_output()
            for key, run, kwargs in runs:
                t0 = time.perf_counter()

                def sent(done: int, total: int, key=key, t0=t0) -> None:
                    write_message(w, ("progress", key, done, total, time.perf_counter() - t0))

                try:
                    with no_process_exit():  # an update's os._exit raises, as in the test
                        rep = run_checked(run, sync_scan=False, progress=sent if progress else None, **kwargs)
                    message = ("outcome", key, bool(rep.passed), failures_text(rep), said())
                except BaseException:  # the test runs it again, in pytest's process, and raises what it raised
                    message = ("raised", key)
                write_message(w, message)

        super().__init__(run_all)

    def outcome(self, key: str, progress: Optional[Callable[[int, int, float], None]] = None
                ) -> Optional[tuple[bool, str, str]]:
        """``(passed, failures, output)`` of the run ``key`` once the child sent it (waiting for it, and handing
        its progress to ``progress(done, total, elapsed_s)`` as it comes); None where the child raised on it,
        ended without it, or never had it: the test makes the run itself. ``output``: what the run wrote to
        stdout and stderr (the update's prints, a library's warnings), for the test to write as its own."""
        def hand_on(k: str, done: int, total: int, elapsed: float) -> None:
            if k != key:
                self._progress.setdefault(k, []).append((done, total, elapsed))
            elif progress is not None:
                progress(done, total, elapsed)

        for step in self._progress.pop(key, []):
            hand_on(key, *step)
        while key not in self._outcomes and not self._closed:
            try:
                message = read_message(self._in)
            except (EOFError, ValueError, TypeError):  # ended, or a message that does not unpack
                self.close()
                break
            if message[0] == "progress":
                hand_on(*message[1:])
            else:
                self._outcomes[message[1]] = message[2:] if message[0] == "outcome" else None
        return self._outcomes.pop(key, None)
