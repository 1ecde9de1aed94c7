"""The errors drift raises, and the one mapping from an error to a process exit code.

Exit codes (``drift`` and every sub-command): 0 every check passed; 1 a check failed (or the
code under test raised, which is a failed check); 2 the input was bad (usage, config, a
plug-in spec, golden data, a checkpoint or trace file, a device that is absent, code under test
that reads something drift's harness does not provide). Every
:class:`DriftError` carries its exit code; a message names the cause and the fix.
"""

from __future__ import annotations

import contextlib
import dis
import os
import posix
import signal
import sys
import types
from typing import Callable, Optional

EXIT_PASS, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class DriftError(Exception):
    """Base of drift's own errors; ``exit_code`` is what the command line exits with."""

    exit_code = EXIT_USAGE


class ConfigError(DriftError, ValueError):
    """A config field or command-line value is outside what it allows."""


class LoadError(DriftError, ValueError):
    """A plug-in spec (update or verify kernel) could not be turned into a callable."""


class HarnessLacks(LoadError):
    """The code under test read something drift's harness does not provide: drift could not run
    it (exit 2), which is not a regression it measured."""


class GoldenError(DriftError, RuntimeError):
    """Golden data is missing, corrupted or does not match the config."""


class DataError(DriftError, RuntimeError):
    """A file drift reads (checkpoint, report, trace) is damaged or of the wrong kind."""


class WriteError(DriftError, OSError):
    """An output could not be written (a full disk, no permission); nothing partial is left."""


class DeviceUnavailable(DriftError, RuntimeError):
    """The requested accelerator is not present on this machine."""


class UpdateRaised(DriftError, RuntimeError):
    """The code under test (an update, or a plugged verify kernel) raised or returned what it must
    not: reported as a failed run naming the code, the step and what was wrong, not a crash."""

    exit_code = EXIT_FAIL


def exit_code(exc: BaseException) -> int:
    """The exit code for ``exc``: its own for a :class:`DriftError`, else none (re-raise)."""
    return exc.exit_code if isinstance(exc, DriftError) else EXIT_FAIL


class Terminated(BaseException):
    """SIGTERM, raised in the main thread like KeyboardInterrupt is for SIGINT: every atomic write
    in flight removes its temporary file, nothing half-written is left, and drift exits 143."""


# The signal that interrupted drift, once one has. Python runs a signal handler between any two
# bytecodes, also inside a weakref callback or a __del__, where the exception it raises is
# swallowed ("Exception ignored in ..."): measured, SIGTERM landing in importlib's module-lock
# callback let a regen-golden run finish with exit 0. So the interrupt is also remembered, and
# raise_if_interrupted() raises it again where drift can act on it (before every write, between
# chunks of steps, at the end of the command).
_PENDING: list[int] = []


def interrupt(signum: int, frame=None) -> None:
    """The signal handler drift installs for SIGINT and SIGTERM (drift/cli.py: main)."""
    if not _PENDING:
        _PENDING.append(signum)
    raise_if_interrupted()


def raise_if_interrupted() -> None:
    """Raise KeyboardInterrupt (SIGINT) or Terminated (SIGTERM) if one was received."""
    if _PENDING:
        raise KeyboardInterrupt() if _PENDING[0] == signal.SIGINT else Terminated()


def clear_interrupt() -> None:
    _PENDING.clear()


# ------------------------------------------------------------ code that ends the process
_RAISE = dis.opmap["RAISE_VARARGS"]


def ended_by_code(exc: BaseException) -> bool:
    """Whether ``exc`` is code under test (an update, a kernel, an extension) ending the process
    rather than a signal: a ``SystemExit`` (``sys.exit``, ``exit()``), any other ``BaseException``
    that is not an ``Exception`` (``GeneratorExit``, a class of the code's own), or a
    ``KeyboardInterrupt`` that code raised. Under drift's handler (:func:`interrupt`) a signal is one it recorded;
    elsewhere (pytest) a signal's KeyboardInterrupt lands on whatever instruction ran, code's on
    its ``raise`` statement."""
    if isinstance(exc, SystemExit):
        return True
    if isinstance(exc, Terminated) or isinstance(exc, Exception):
        return False  # drift's own signal exception; an Exception does not end the process that way
    if not isinstance(exc, KeyboardInterrupt):
        return True  # GeneratorExit or a BaseException of the code's own: only code raises those
    if _PENDING:
        return False
    if signal.getsignal(signal.SIGINT) is interrupt:
        return True  # drift's handler records every signal: this one is not
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False
    code = tb.tb_frame.f_code.co_code
    return 0 <= tb.tb_lasti < len(code) and code[tb.tb_lasti] == _RAISE


class ProcessExit(SystemExit):
    """``os._exit(status)`` called by code drift runs while :func:`no_process_exit` holds, raised in
    its place. ``os._exit`` ends the interpreter at once -- no handler, no output -- with the code's
    status: ``os._exit(0)`` from an update read as a passed run (measured). Raised instead, it fails
    the run naming the line, as ``sys.exit`` does. ``where``: the caller's ``file:line``."""

    def __init__(self, status, where: str):
        super().__init__(status)
        self.where = where

    def __repr__(self) -> str:
        return f"os._exit({self.code!r})"


_REAL_EXIT = os._exit


@contextlib.contextmanager
def no_process_exit():
    """While it holds, ``os._exit`` (and ``posix._exit``) called in this process raises
    :class:`ProcessExit` instead of ending it; a forked child's exits as it would (multiprocessing's
    fork start method ends its children that way). Nests; the previous functions come back after.
    Code that bound the function before (``from os import _exit``) is out of its reach."""
    pid = os.getpid()

    def _exit(status):
        if os.getpid() != pid:
            _REAL_EXIT(status)
        caller = sys._getframe(1)
        raise ProcessExit(status, f"{caller.f_code.co_filename}:{caller.f_lineno}")

    before = os._exit, posix._exit
    os._exit = posix._exit = _exit
    try:
        yield
    finally:
        os._exit, posix._exit = before


def raised_at(exc: BaseException, within: str = "") -> str:
    """``file:line`` where ``exc`` was raised (its traceback's innermost frame outside Python's frozen
    import machinery: an ``import`` that failed is named at its own line; for an ``os._exit`` the
    caller's); '' without one. ``within``: a file whose innermost frame is named instead when the
    exception passed through it (an extension's line, not the registry's that refused it)."""
    where = getattr(exc, "where", None)
    if isinstance(where, str) and where and not within:
        return where
    tb, found, innermost = exc.__traceback__, "", ""
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        here = f"{name}:{tb.tb_lineno}"
        if within and os.path.abspath(name) == os.path.abspath(within):
            found = here
        if not name.startswith("<frozen ") or not innermost:
            innermost = here
        tb = tb.tb_next
    if found or not innermost:
        return found
    return where if isinstance(where, str) and where else innermost


def code_frames(start: Optional[types.FrameType], internal: Callable[[str], bool],
                boundary: Optional[types.FrameType] = None, limit: int = 8) -> list[tuple[str, int, str]]:
    """The frames of the code under test from ``start`` outwards, innermost first, as ``(file, line,
    function)``: those whose file ``internal`` names skipped (torch's, the caller's own), at most
    ``limit``, stopping at ``boundary`` (the frame that made the call). The sync detector names a
    sync by them (drift/syncs/detector.py), the precision diagnosis a write (drift/check/diagnose.py)."""
    f, out = start, []
    while f is not None and len(out) < limit:
        fn = f.f_code.co_filename
        if not internal(fn):
            out.append((fn, f.f_lineno, f.f_code.co_name))
        if f is boundary:
            break
        f = f.f_back
    return out


def display_path(filename: str) -> str:
    """``filename`` relative to the working directory when inside it, else as given."""
    try:
        rel = os.path.relpath(filename)
    except ValueError:  # another drive (Windows)
        return filename
    return filename if rel.startswith(os.pardir) else rel


def what_raised(exc: BaseException) -> str:
    """``exc`` as a message says it: its repr and the line that raised it (``RuntimeError('x') (raised at
    f.py:3)``), and for one that would end the process, that too (``SystemExit(0) (which would end the
    process; raised at f.py:3)``)."""
    where = raised_at(exc)
    if isinstance(exc, Exception):
        return f"{exc!r} (raised at {where})" if where else repr(exc)
    return f"{exc!r} (which would end the process{'; raised at ' + where if where else ''})"


# What an ``except`` beside ``Exception`` catches for ended_by_code: every BaseException (SystemExit,
# KeyboardInterrupt, GeneratorExit, a code's own); ended_by_code tells a signal's from code's.
ENDS_PROCESS = (BaseException,)
