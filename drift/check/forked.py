"""The comparison in a forked child process, fed each step through shared memory.

A worker thread (drift.check.pipeline) overlaps the comparison's torch and C calls with the simulation's,
but both threads run Python between microsecond-sized calls and take turns holding the interpreter's lock:
on a default run the thread hid about 4 of the comparison's 8 s. A forked child has its own interpreter
and runs on the other core. It starts as a copy of the process at the run's first step (the comparison,
its twin and measures as they are then), so nothing but each step's data has to cross:

* a ring of ``slots`` steps in anonymous shared memory (``mmap``, not ``/dev/shm``), holding each step's
  tensors (the run's committed states, outputs, windows, true inputs) and its host integers; the
  simulation copies into slot ``i % slots`` once the child has released it;
* a pipe carrying, every :data:`SEND_EVERY` steps, what else those steps left (the starts of requests,
  the measures' snapshots: drift.check.wire, no pickle), and the questions that need an answer (a
  chunk's arrays at each flush, a lane's truth, a checkpoint's state);
* a pipe back carrying acknowledgements (slots released), answers, and the child's error, if any.

The child compares the same steps in the same order with the same operations: the figures are the
thread's, bit for bit. It compares the steps of each message as it comes (less left to do at a flush),
so where a batch of compared steps ends is fixed by the messages, never by timing.

Where it is not safe to fork it is not done (:func:`fork_refusal`): off Linux, and while another thread
runs in the process (a lock it holds would stay held in the child forever; Python 3.12 warns for the same
reason). The child ignores SIGINT (the simulation's process handles an interrupt and closes the pipe), dies
of SIGTERM, ends when the pipe closes, and never returns into the parent's code (``os._exit``).
"""

from __future__ import annotations

import collections
import mmap
import os
import signal
import struct
import sys
import threading
import time
import traceback
import weakref
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from .wire import Placed, pack_parts, unpack

SEND_EVERY = 4  # steps whose small data go to the child in one message
MAX_SLOTS = 64  # steps the simulation may run ahead of the child
RING_BYTES = 64 << 20  # at most this much shared memory per run (fewer slots for bigger steps)
# Per slot, shared memory for the step's larger tensors besides its views (a tracked snapshot, a start's
# truth): written there at submit, only their place crosses the pipe. Through the pipe, ci-small's
# default run sent 174 MB (2,266 tracked snapshots of 64 KiB), 2.4 s of the simulation's thread in
# writev (2026-12-07). What does not fit goes through the pipe as before.
SPILL_BYTES = 1 << 20
PLACE_MIN_BYTES = 4096  # smaller tensors go through the pipe
END_WAIT_S = 10.0  # how long closing waits for the child to exit before killing it
_FRAME = struct.Struct("<Q")
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 16, 1024)
_ALIGN = 64
# Every live child's handle (a ForkedWorker, drift.syncs.process.ScanProcess): ``_fds()`` its open pipe
# ends, ``_finalize`` what reaps it; a later child closes the pipes and detaches the finalizers.
LIVE_CHILDREN: weakref.WeakSet = weakref.WeakSet()


class ComparisonProcessError(RuntimeError):
    """The comparison's process failed (its traceback in the message) or ended without a word."""


def os_threads(status: str = "/proc/self/status") -> int:
    """Threads of this process as Linux counts them (a library's own threads too), 0 where unknown."""
    try:
        with open(status) as f:
            return next((int(line.split()[1]) for line in f if line.startswith("Threads:")), 0)
    except (OSError, ValueError, IndexError):
        return 0


def fork_refusal() -> Optional[str]:
    """Why the comparison cannot be forked off here, or None when it can: only a process with one thread
    forks (another's lock would stay held in the child; Python 3.12 warns for the same reason). The message
    names the pools that likely run (:func:`_pools`): torch's OpenMP pool after an op on more than one thread,
    numpy's OpenBLAS pool unless ``OPENBLAS_NUM_THREADS=1`` (the ``drift`` command sets it, drift/openmp.py)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return f"no fork on {sys.platform}"
    if threading.active_count() > 1:
        return f"{threading.active_count() - 1} other Python thread(s) run in this process"
    threads = os_threads()
    if threads != 1:
        return (f"{threads - 1} other thread(s) run in this process ({_pools()})" if threads
                else "its threads cannot be counted")
    return None


def _pools() -> str:
    """Which library's pool of threads likely runs here, and how it is kept from starting."""
    said = []
    torch_threads = torch.get_num_threads()
    if torch_threads > 1:
        said.append(f"torch's OpenMP pool, which an op on {torch_threads} threads starts: torch.set_num_threads(1) "
                    "before the first op, as drift's runs do (drift.openmp.run_threads)")
    if "numpy" in sys.modules and os.environ.get("OPENBLAS_NUM_THREADS") != "1":
        said.append("numpy's OpenBLAS pool, which starts when numpy loads: OPENBLAS_NUM_THREADS=1 before it, "
                    "as the drift command sets it (drift/openmp.py)")
    return "; or ".join(said) if said else "a library's pool of threads"


def write_message(fd: int, obj: Any) -> None:
    """One message: its length, then its parts, gathered by the kernel (no copy of a tensor's bytes here)."""
    parts = pack_parts(obj)
    parts.insert(0, _FRAME.pack(sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts)))
    while parts:
        batch = parts[:_IOV_MAX]
        done = os.writev(fd, batch)
        total = sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in batch)
        if done == total:
            del parts[:len(batch)]
            continue
        rest = memoryview(b"".join(batch))[done:]  # a partial write (a signal): the rest of the batch, in one
        while rest:
            rest = rest[os.write(fd, rest):]
        del parts[:len(batch)]


def _read_exact(fd: int, n: int) -> Optional[bytes]:
    parts, got = [], 0
    while got < n:
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def read_message(fd: int, placed: Optional[Callable[[Placed], torch.Tensor]] = None) -> Any:
    """The next message on ``fd``; EOFError where the other end closed. ``placed``: reads a tensor the
    sender put in shared memory (drift.check.wire.unpack)."""
    head = _read_exact(fd, _FRAME.size)
    body = None if head is None else _read_exact(fd, _FRAME.unpack(head)[0])
    if body is None:
        raise EOFError
    return unpack(body, placed)


class _Ring:
    """``slots`` steps' tensors (``views``: a dict of tensors ``[slots, *shape]``), host integers
    (``host``: int64 ``[slots, host_len]``) and ``spill`` bytes each for the larger tensors of a step's
    other data (:meth:`place`), in one anonymous shared mapping, which a fork shares."""

    def __init__(self, like: dict[str, torch.Tensor], host_len: int, slots: int, spill: int = 0):
        layout, size = [], 0
        for key, t in like.items():
            nbytes = slots * t.numel() * t.element_size()
            layout.append((key, t, size, nbytes))
            size += -(-nbytes // _ALIGN) * _ALIGN
        host_at = size
        size += -(-slots * host_len * 8 // _ALIGN) * _ALIGN
        self._spill_at, self._spill = size, spill
        size += slots * spill
        self._memory = mmap.mmap(-1, max(size, 1))  # MAP_SHARED | MAP_ANONYMOUS
        whole = torch.frombuffer(self._memory, dtype=torch.uint8)
        self._whole = whole
        self.slots = slots
        self.views = {key: whole[at:at + n].view(t.dtype).view(slots, *t.shape) for key, t, at, n in layout}
        self.host = whole[host_at:host_at + slots * host_len * 8].view(torch.int64).view(slots, host_len).numpy()

    def place(self, obj: Any, slot: int) -> Any:
        """``obj`` (a step's other data: tuples, lists, dicts, tensors, ...) with each plain CPU tensor of
        at least :data:`PLACE_MIN_BYTES` that still fits copied into ``slot``'s spill bytes and replaced by
        its :class:`drift.check.wire.Placed`; the rest as it was."""
        free = [0]

        def walk(o):
            if type(o) is torch.Tensor:
                n = o.numel() * o.element_size()
                if o.device.type == "cpu" and n >= PLACE_MIN_BYTES and free[0] + n <= self._spill:
                    at = self._spill_at + slot * self._spill + free[0]
                    self._whole[at:at + n].view(o.dtype).view(o.shape).copy_(o)
                    free[0] += -(-n // _ALIGN) * _ALIGN
                    return Placed(at, o.dtype, tuple(o.shape))
                return o
            if type(o) is tuple:
                return tuple(walk(v) for v in o)
            if type(o) is list:
                return [walk(v) for v in o]
            if type(o) is dict:
                return {k: walk(v) for k, v in o.items()}
            return o

        return walk(obj) if self._spill else obj

    def placed(self, where: Placed) -> torch.Tensor:
        """A copy of the tensor :meth:`place` put at ``where`` (its slot is written again once released)."""
        return self._whole[where.offset:where.offset + where.nbytes].view(where.dtype).view(where.shape).clone()


def fork_child(work: Callable[[], None], close_in_child: Sequence[int] = (),
               close_on_failure: Sequence[int] = ()) -> int:
    """Fork a child that runs ``work()`` and ends (``os._exit``: 0 where it returned, 1 where it raised),
    never returning into the caller's code; the child's pid. In the child, first: the pipes of every other
    live child (:data:`LIVE_CHILDREN`) and ``close_in_child`` closed, SIGINT ignored (the parent handles an
    interrupt), SIGTERM at its default. SIGINT and SIGTERM stay blocked across the fork: Python's at-fork
    hooks run in the child before its handlers are set, and an interrupt there would print a traceback.
    A failed fork (EAGAIN, ENOMEM) closes ``close_on_failure`` and raises."""
    inherited = [fd for child in list(LIVE_CHILDREN) for fd in child._fds()]
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        pid = os.fork()
    except BaseException:  # no child: nothing of it is left open
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        for fd in close_on_failure:
            os.close(fd)
        raise
    if pid == 0:  # the child: never returns
        status = 1
        try:
            for child in list(LIVE_CHILDREN):  # another child's pipes: not this child's to close at its end
                child._finalize.detach()
            for fd in (*close_in_child, *inherited):
                os.close(fd)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a SIGTERM ends the child, not drift's handler
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
            work()
            status = 0
        finally:
            os._exit(status)
    signal.pthread_sigmask(signal.SIG_SETMASK, held)
    return pid


class ForkedWorker:
    """The simulation's end of the comparison's process.

    like: one step's tensors (shapes and dtypes of every later step's), CPU; host_len: int64 per step.
    on_step(views, host, meta): the child's handling of one step (``views``: that step's tensors in the
    ring, valid until it returns; ``host``: its int64 row, a copy; ``meta``: what :meth:`submit` was given);
    after_steps(): the child's work after each message of :data:`SEND_EVERY` steps; answers: kind ->
    function(arg) -> a reply, for :meth:`ask`. The child is forked here: construct it after everything
    the child needs is in place.
    """

    def __init__(self, like: dict[str, torch.Tensor], host_len: int,
                 on_step: Callable[[dict, np.ndarray, Any], None], after_steps: Callable[[], None],
                 answers: dict[str, Callable[[Any], Any]]):
        per_step = sum(t.numel() * t.element_size() for t in like.values()) + 8 * host_len
        per_step += SPILL_BYTES
        self.ring = _Ring(like, host_len, max(2, min(MAX_SLOTS, RING_BYTES // max(per_step, 1))), SPILL_BYTES)
        self.waited_s = 0.0  # the simulation's time blocked on the child (a full ring, an answer)
        self._sent = self._released = 0
        self._metas: list = []
        to_child, from_child = os.pipe(), os.pipe()
        pid = fork_child(lambda: _serve(self.ring, to_child[0], from_child[1], on_step, after_steps, answers),
                         close_in_child=(to_child[1], from_child[0]), close_on_failure=(*to_child, *from_child))
        os.close(to_child[0])
        os.close(from_child[1])
        self.pid, self._out, self._in = pid, to_child[1], from_child[0]
        self._closed = False
        LIVE_CHILDREN.add(self)
        self._finalize = weakref.finalize(self, reap_child, pid, self._out, self._in)

    def _fds(self) -> tuple:
        return () if self._closed else (self._out, self._in)

    # ------------------------------------------------------------ the simulation's side
    def submit(self, views: dict[str, torch.Tensor], host: np.ndarray, meta: Any) -> None:
        """Hand one step to the child: its tensors and host row into the next slot, once the child released
        it; ``meta`` with the next :data:`SEND_EVERY` steps' (drift.check.wire's types)."""
        self._wait_for_room()
        slot = self._sent % self.ring.slots
        for key, t in views.items():
            self.ring.views[key][slot].copy_(t)
        self.ring.host[slot] = host
        self._metas.append(self.ring.place(meta, slot))
        self._sent += 1
        if len(self._metas) >= SEND_EVERY:
            self._push()

    def _wait_for_room(self) -> None:
        """Until the child released the slot the next step goes to (it copies a step out as it takes it)."""
        if self._sent - self._released >= self.ring.slots:
            self._wait(lambda: self._sent - self._released < self.ring.slots)

    def ask(self, kind: str, arg: Any = None) -> Any:
        """The child's answer to ``kind`` (``answers[kind](arg)`` there), after every step submitted."""
        self.ask_begin(kind, arg)
        return self.ask_end()

    def ask_begin(self, kind: str, arg: Any = None) -> None:
        """Send :meth:`ask`'s question, after every step submitted, and return; :meth:`ask_end` reads the
        answer (one question outstanding, no step submitted in between): the caller works meanwhile."""
        self._push()
        self._send(("ask", kind, arg))

    def ask_end(self) -> Any:
        """The answer to the question :meth:`ask_begin` sent."""
        return self._wait(None)

    def close(self) -> None:
        """End the child (it finishes nothing more) and wait for it; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        LIVE_CHILDREN.discard(self)
        self._finalize()

    def _push(self) -> None:
        if self._metas:
            metas, self._metas = self._metas, []
            self._send(("steps", metas))

    def _send(self, message) -> None:
        try:
            write_message(self._out, message)
        except (BrokenPipeError, ConnectionResetError):
            self._wait(None)  # the child's last words, or its exit status
            raise ComparisonProcessError("the comparison's process closed its pipe") from None

    def _wait(self, until: Optional[Callable[[], bool]]) -> Any:
        """Read the child's messages until ``until()`` holds, or (``until`` None) until its answer."""
        t0 = time.perf_counter()
        try:
            while True:
                try:
                    message = read_message(self._in)
                except EOFError:
                    status = self._finalize() or "closed"
                    self._closed = True
                    LIVE_CHILDREN.discard(self)
                    raise ComparisonProcessError(f"the comparison's process ended unexpectedly ({status})") from None
                if message[0] == "released":
                    self._released += message[1]
                    if until is not None and until():
                        return None
                elif message[0] == "answer":
                    return message[1]
                else:  # "error"
                    self.close()
                    raise ComparisonProcessError(f"the comparison's process failed:\n{message[1]}")
        finally:
            self.waited_s += time.perf_counter() - t0


def reap_child(pid: int, *fds: int) -> str:
    """Close the parent's ends of the child's pipes (the comparison's child reads the end of its input and
    exits) and wait for the child, killing it after :data:`END_WAIT_S`; how it ended."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    deadline = time.monotonic() + END_WAIT_S
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return "already reaped"
        if done:
            return (f"exit status {os.waitstatus_to_exitcode(status)}" if os.WIFEXITED(status)
                    else f"signal {-os.waitstatus_to_exitcode(status)}")
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            deadline = float("inf")
        time.sleep(0.005)


# ---------------------------------------------------------------- the child's side
class ReportingChild:
    """A forked child that reports to its parent over one pipe: ``work(out)`` runs in it and writes its
    messages (:func:`write_message`) to descriptor ``out``; the parent reads them from ``self._in``
    (:func:`read_message`). Forked here; among :data:`LIVE_CHILDREN` (a later fork closes its pipe in the
    new child) until :meth:`close`, which kills it where it still works and reaps it (so does collecting
    the object). The host-sync scan's process and the gate's runs made ahead are such children."""

    def __init__(self, work: Callable[[int], None]):
        self._closed = False
        r, w = os.pipe()
        self.pid = fork_child(lambda: work(w), close_in_child=(r,), close_on_failure=(r, w))
        os.close(w)
        self._in = r
        LIVE_CHILDREN.add(self)
        self._finalize = weakref.finalize(self, reap_child, self.pid, self._in)

    def _fds(self) -> tuple:
        return () if self._closed else (self._in,)

    def close(self) -> None:
        """End the child (work not finished is abandoned: killed) and reap it; safe to call twice."""
        if not self._closed:
            self._closed = True
            LIVE_CHILDREN.discard(self)
            try:
                os.kill(self.pid, signal.SIGKILL)  # where it still works; an ended child is a zombie until reaped
            except ProcessLookupError:
                pass
            self._finalize()


def _serve(ring: _Ring, inp: int, out: int, on_step, after_steps, answers) -> None:
    """The child's loop: a reader thread queues the simulation's messages (the pipe never fills while the
    child computes); the loop handles them in order, ``after_steps`` after each message of steps."""
    queue: collections.deque = collections.deque()
    ready = threading.Condition()

    def reader() -> None:
        while True:
            try:
                message = read_message(inp, ring.placed)
            except EOFError:
                message = ("end",)
            except BaseException:  # a message that does not unpack: said once, then the end
                message = ("broken", traceback.format_exc())
            with ready:
                queue.append(message)
                ready.notify()
            if message[0] in ("end", "broken"):
                return

    threading.Thread(target=reader, name="drift-comparison-reader", daemon=True).start()
    slot = 0
    try:
        while True:
            with ready:
                ready.wait_for(lambda: bool(queue))
                message = queue.popleft()
            kind = message[0]
            if kind == "steps":
                for meta in message[1]:
                    host = ring.host[slot].copy()
                    on_step({key: v[slot] for key, v in ring.views.items()}, host, meta)
                    slot = (slot + 1) % ring.slots
                write_message(out, ("released", len(message[1])))
                after_steps()
            elif kind == "ask":
                write_message(out, ("answer", answers[message[1]](message[2])))
            elif kind == "broken":
                raise RuntimeError(message[1])
            else:  # "end": the simulation closed the pipe
                return
    except BaseException:
        try:
            write_message(out, ("error", traceback.format_exc()))
        except OSError:
            pass
        raise
