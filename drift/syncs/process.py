"""The host-sync scan in a process of its own, beside the simulation (:func:`drift.runner.run_checked`).

The scan costs a run about 0.6-0.8 s of its main thread on a 2-core box, most of it importing
``torch.distributed.tensor``: torch 2.13's C++ imports it at the first operation on any tensor subclass
with ``__torch_dispatch__`` (the virtual device's). Forked at the point where the run would scan, a child
holds the run as it is then, scans it (:func:`drift.syncs.scan.sync_check`, the same call) and sends the
result back as :mod:`drift.check.wire` bytes (no pickle), while the parent simulates. The result is the
in-process scan's: the same code on the same state.

Forked only where it is safe and the same: on the CPU with no accelerator pass to make (a CUDA or NPU
runtime does not survive a fork) and in a process with one thread (:func:`drift.check.forked.fork_refusal`);
elsewhere the caller scans in-process, as before. Where the child could not finish the scan (it raised,
or ended without a result), the parent scans in-process, so an update that raises under the scan raises
here exactly as it did. As an observer of the simulation, :meth:`ScanProcess.flush` ends the run at the
next chunk once a sync was found (``stop_on_sync``), which keeps ``drift run``'s "report at once".
"""

from __future__ import annotations

import importlib
import select
from dataclasses import fields
from typing import Optional

from ..check.forked import ReportingChild, fork_refusal, read_message, write_message
from ..check.result import CheckResult
from ..runspec import Resolved
from ..simulate import StopRun
from .scan import _device_pass, sync_check

def _readable(fd: int) -> bool:
    """Whether ``fd`` has bytes to read, or its writer closed it, now (``poll``: any descriptor number,
    where ``select`` refuses those past 1023)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def scan_refusal(run: Resolved) -> Optional[str]:
    """Why ``run``'s scan cannot run in a forked process, or None when it can."""
    if _device_pass(run.cfg, "auto") is not None:
        return "the scan makes an accelerator pass (its runtime does not survive a fork)"
    return fork_refusal()


# Scans this process has forked. A process that scans again (``drift mutants``: 43 runs, ``drift tradeoff``,
# the nightly's shards) imports ``torch.distributed.tensor`` itself before its second fork, once (0.4 s),
# so every later child inherits it: each child imported it again, about 1 s of a core a run, 41% of the
# CPU of ten 128-step mutant runs (py-spy, 2026-12-07, docs/speed.md). A single run (``drift run``) keeps
# the import in its one child, off the simulation's thread.
_scans_forked = 0


def _children_inherit_torchs_import() -> None:
    """From this process's second forked scan on, ``torch.distributed.tensor`` imported here first."""
    global _scans_forked
    if _scans_forked:
        importlib.import_module("torch.distributed.tensor")  # the children's import, made once
    _scans_forked += 1


def scan_beside(run: Resolved, sample: int, stop_on_sync: bool) -> Optional["ScanProcess"]:
    """The scan of ``run`` in a :class:`ScanProcess`, or None where the run must scan in its own process:
    a :func:`scan_refusal`, or a fork or pipe the system refuses (EAGAIN, ENOMEM, EMFILE)."""
    if scan_refusal(run) is not None:
        return None
    _children_inherit_torchs_import()
    try:
        return ScanProcess(run, sample, stop_on_sync)
    except OSError:
        return None


class ScanProcess(ReportingChild):
    """``sync_check(run, sample=sample)`` in a forked child (construct it where the run would scan).

    ``result()`` waits for it; ``flush()`` (an observer's) raises StopRun once a failed result is in,
    when ``stop_on_sync``; ``close()`` ends the child. An observer's other calls do nothing."""

    def __init__(self, run: Resolved, sample: int, stop_on_sync: bool):
        self.run, self.sample, self.stop_on_sync = run, sample, stop_on_sync
        self._result: Optional[CheckResult] = None
        self._raised: Optional[BaseException] = None  # what the scan here raised (raised again when asked)

        def scan_and_send(out: int) -> None:
            try:
                res = sync_check(run, sample=sample)
                message = ("result", {f.name: getattr(res, f.name) for f in fields(res)})
            except BaseException:  # the parent scans again, in-process, and raises what the scan raised
                message = ("raised",)
            write_message(out, message)

        super().__init__(scan_and_send)

    def _take(self, block: bool) -> Optional[CheckResult]:
        """The result once it is in (waiting for it when ``block``); an unfinished scan is made here."""
        if self._result is None and not self._closed:
            if not block and not _readable(self._in):
                return None
            try:
                message = read_message(self._in)
            except (EOFError, ValueError, TypeError):  # ended without a result, or a message that does not unpack
                message = ("raised",)
            self.close()
            if message[0] == "result":
                self._result = CheckResult(**message[1])
        if self._raised is not None:
            raise self._raised
        if self._result is None:  # the child raised or died: the scan again, here (what it raises, raised)
            try:
                self._result = sync_check(self.run, sample=self.sample)
            except BaseException as exc:
                self._raised = exc
                raise
        return self._result

    def result(self) -> CheckResult:
        """The scan's result, waiting for the child."""
        return self._take(block=True)

    # -------------------------------------------------------- as an observer of the simulation
    def on_start(self, sim) -> None:
        pass

    def on_step(self, view) -> None:
        pass

    def flush(self) -> None:
        """At each chunk's end: where the result is in and found a sync, end the run (``stop_on_sync``)."""
        res = self._take(block=False) if self.stop_on_sync else None
        if res is not None and res.failed:
            self.stop_on_sync = False  # once: the run's end flushes its observers again
            raise StopRun(f"host sync: {res.where}")

    def on_end(self) -> None:
        pass

    def abandon(self) -> None:
        pass
