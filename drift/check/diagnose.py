"""Where a precision failure comes from: after a run whose committed state left its limit (the
committed-state check or the drift bound), the first out-of-bound (step, layer, row, head) is
replayed and the call that wrote it named, with its file and line, and what would cause it.

The replay is a fresh :class:`~drift.simulate.Simulation` of the same resolved run: the input stream
is counter-based and every kernel deterministic, so it reproduces the run bit for bit (the nightly's
resume relies on the same). It runs eagerly to the failing step, chunked as the run was, with a
float64 twin beside it; during that one step a dispatch mode (:class:`WriteRecorder`) reads the
element's committed state -- ``flow.committed_states()[layer, row, head]``, whatever the flow kind
keeps it in -- after every torch op that writes (an op whose schema marks an argument written: ``x.copy_``, ``out=``), and the verify scratch
where the pool has one, and keeps each op that changed it with the code-under-test frames that
issued it (drift.syncs.detector.code_frames, the sync detector's attribution). Code the dispatcher
does not see (the native C kernel, a compiled one) is caught at the call's boundary.

The cause compares the committed value with what it could have been, all float64 truths of the
twin at that step: the state after each draft token of that row (the accept count names one),
every other row's, and the row's state before the step. Within ``SEMANTIC_TOL`` of the right one
(the threshold between a rounded and a wrong state, drift/check/checks.py) it is the store
rounding, told one-sided or not by its error in units in the last place; nearest another token's,
the wrong step; another row's, the wrong slot; the state before the step, a skipped commit; none,
a value none of the candidates holds.

Off the hot path: run only after a failure (drift/runner.py), at most one replay to the first
failing step; a passing run's report is unchanged.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from ..compat import TorchDispatchMode
from ..errors import code_frames, display_path
from ..runspec import Resolved
from ..sim import kernels
from ..sim.twin import F64, Float64Twin
from ..simulate import ResumePoint, Simulation, StopRun
from .checks import SEMANTIC_TOL
from .compare import restart_lanes

STATE_CHECKS = ("committed_state", "drift_bound")  # the checks whose first failure is a committed state
_AT = re.compile(r"step (\d+), layer (\d+), row (\d+), head (\d+)")
# the replay's own frames and drift's calling wrappers (the simulation loop, the update's loader)
_HARNESS_FILES = tuple(os.path.normcase(os.path.abspath(sys.modules[m].__file__))
                       for m in (__name__, Simulation.__module__, "drift.plug.loader"))
_TORCH = os.path.dirname(torch.__file__) + os.sep
_NATIVE_SOURCE = os.path.join(os.path.dirname(kernels.__file__), "_native", "gdn_verify.c")
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _internal(filename: str) -> bool:
    """torch's (and torch_npu's) frames, and the replay's own (this module, the simulation loop, the loader)."""
    npu = sys.modules.get("torch_npu")
    if filename.startswith(_TORCH) or (npu is not None and filename.startswith(os.path.dirname(npu.__file__) + os.sep)):
        return True
    return os.path.normcase(os.path.abspath(filename)) in _HARNESS_FILES


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT[t.element_size()])


@dataclass
class Write:
    """One op that changed a probed tensor: ``call`` 'the update' or 'the verify kernel'; ``op`` the
    aten op (or 'native code'); ``stack`` 'path:line in function', innermost first; ``changed``
    probe name -> the elements it changed (host bool, the probe's shape)."""

    call: str
    op: str
    stack: tuple[str, ...]
    changed: dict = field(default_factory=dict, repr=False)

    @property
    def where(self) -> str:
        return self.stack[0].split(" in ")[0] if self.stack else "<unknown>"

    def describe(self) -> str:
        outer = "".join(f", from {f}" for f in self.stack[1:3])
        return f"{self.call} at {self.stack[0] if self.stack else '<unknown>'} ({self.op}{outer})"


class _NoDispatch:
    """Stand-in for torch's dispatch mode where this torch lacks it (drift/compat.py): no op is seen,
    so each call's changes are recorded at its boundary only (the call, not its line)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


_Mode = TorchDispatchMode if TorchDispatchMode is not None else _NoDispatch


def _writes(func) -> bool:
    schema = getattr(func, "_schema", None)
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


class WriteRecorder(_Mode):
    """Dispatch mode recording every write that changes one of ``probes`` (name -> a function
    returning the current values, any shape): after each op that writes an argument, each probe is
    read again and compared bit for bit. ``call`` says whose code runs (set by :meth:`calling`)."""

    def __init__(self, probes: dict[str, Callable[[], torch.Tensor]]):
        super().__init__()
        self.probes = probes
        self.last = {k: p() for k, p in probes.items()}
        self.writes: list[Write] = []
        self.call = ""
        self.boundary = None

    def _check(self, op: str, stack: tuple[str, ...]) -> None:
        changes = {}
        for name, probe in self.probes.items():
            now = probe()
            changed = (_bits(now) != _bits(self.last[name]))
            if bool(changed.any()):
                changes[name] = changed.cpu().numpy()
                self.last[name] = now
        if changes:
            self.writes.append(Write(self.call, op, stack, changes))

    def last_write(self, probe: str, index=()) -> Optional[Write]:
        """The last recorded write that changed ``probe`` (at ``index`` of it, when given)."""
        return next((w for w in reversed(self.writes) if probe in w.changed and w.changed[probe][index].any()), None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.call and _writes(func):
            frames = code_frames(sys._getframe(1), _internal, self.boundary)
            self._check(str(func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else func),
                        tuple(f"{display_path(p)}:{n} in {c}" for p, n, c in frames))
        return out

    def calling(self, call: str, fn: Callable, native: Callable[[], tuple[str, ...]]) -> Callable:
        """``fn`` with its writes labelled ``call``; a change no dispatched op made (native code) is
        recorded at its return, located by ``native()``."""
        def wrapped(*args, **kwargs):
            self.call, self.boundary = call, sys._getframe(0)
            try:
                return fn(*args, **kwargs)
            finally:
                self._check("native code (not a torch op)", native())
                self.call, self.boundary = "", None
        return wrapped


class _Labelled:
    """The update under test, called through the recorder (its name and spec read through)."""

    def __init__(self, update, call: Callable):
        self._update, self._call = update, call

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._update, name)


@dataclass
class Diagnosis:
    """What wrote the first out-of-bound committed state and why. ``call``: 'the update' or 'the
    verify kernel' (the call responsible); ``at``: its file:line; ``cause``: 'store rounding',
    'wrong step', 'wrong slot', 'skipped commit' or 'unexplained'; ``text``: the sentence a
    failure prints; ``writes``: every write of the element that step, in order."""

    check: str
    where: str
    call: str
    at: str
    op: str
    cause: str
    text: str
    writes: list[str]

    def to_dict(self) -> dict:
        return asdict(self)


def first_state_failure(checks: dict) -> Optional[tuple[str, int, int, int, int]]:
    """``(check key, step, layer, row, head)`` of the earliest first failure among the state checks
    of a run (``checks``: registry key -> consumer), or None."""
    found = []
    for key in STATE_CHECKS:
        m = _AT.search(getattr(checks.get(key), "first_fail", None) or "")
        if m:
            found.append((int(m.group(1)), key, *map(int, m.groups()[1:])))
    if not found:
        return None
    step, key, layer, row, head = min(found)
    return key, step, layer, row, head


class _Replay:
    """Observer of the replay: the float64 twin beside it, the recorder armed for step ``at``; at
    that step it keeps the candidate truths and stops the run."""

    def __init__(self, at: int, arm: Callable[[], None], disarm: Callable[[], None]):
        self.at, self.arm, self.disarm = at, arm, disarm
        self.candidates = None
        self.snapshots: dict = {}  # request -> (position, state, window) of its last tracked snapshot's truth

    def on_start(self, sim) -> None:
        self.sim = sim
        self.twin = Float64Twin(sim.cfg, sim.stream.params, torch.device("cpu"), sim.prefill_state,
                                sim.prefill_window)
        if self.at == 0:
            self.arm()

    def on_step(self, view) -> None:
        cfg, R, D = self.sim.cfg, self.sim.cfg.num_requests, self.sim.cfg.num_draft_tokens
        x, a, b = (view.by_lane(t).cpu() for t in (view.x, view.a, view.b))
        if view.starts:  # a churning lifecycle: the lanes whose request starts begin at its truth
            restart_lanes(self.twin, self.sim, view.starts, self.snapshots)
        if view.step == self.at:
            self.disarm()
            after = []
            for t in range(D):  # the truth after each draft token, from a copy of the twin
                twin = Float64Twin(cfg, self.sim.stream.params, torch.device("cpu"), self.twin.state, self.twin.window)
                twin.advance(x, a, b, np.full(R, D, np.int64), np.full(R, -1, np.int64), np.full(R, t, np.int64))
                after.append(twin.mark_state)
            self.candidates = {"before": self.twin.state.clone(), "after": torch.stack(after, 2),  # [L, R, D, ...]
                               "accept": view.accept.copy()}
            raise StopRun("diagnosed")
        self.twin.advance(x, a, b, view.accept, view.track)
        if view.schedule is not None:  # the truth of each tracked request's snapshot, for a later prefix hit
            for lane in np.nonzero(view.track >= 0)[0]:
                q = int(view.schedule.request[view.index, lane])
                self.snapshots[q] = (int(view.pre[lane] + view.track[lane] + 1), self.twin.track_state[:, lane].clone(),
                                     self.twin.track_window[:, lane].clone())
        if view.step + 1 == self.at:
            self.arm()

    def flush(self) -> None:
        pass

    def on_end(self) -> None:
        pass


def _rel(run: torch.Tensor, cand: torch.Tensor) -> float:
    return float((run - cand).norm() / cand.norm().clamp_min(1e-30))


def _rounding(run: torch.Tensor, true: torch.Tensor, dtype: torch.dtype) -> str:
    """The error of ``run`` against ``true`` (float64) in units in the last place of ``dtype``:
    its mean toward zero, and the share of the elements moved toward zero (round-to-nearest: half)."""
    err = run - true
    ulp = torch.exp2(torch.floor(torch.log2(true.abs().clamp_min(1e-30)))) * torch.finfo(dtype).eps
    toward = -(err * torch.sign(true)) / ulp  # > 0: toward zero
    moved = err != 0
    share = float((toward[moved] > 0).double().mean()) if bool(moved.any()) else 0.5
    mean = float(toward.mean())
    if share >= 0.75 or share <= 0.25:
        return (f"the store rounding: a one-sided error (mean {mean:+.2f} ulp toward zero; {share:.0%} of the "
                "moved elements moved toward zero, where round-to-nearest moves half): a truncating or "
                "directed store")
    return (f"the store rounding: the right state within rounding (mean {mean:+.2f} ulp toward zero, "
            f"{share:.0%} moved toward zero) but over its bound: more roundings, or a narrower dtype, than "
            "the bound assumes")


def _cause(value: torch.Tensor, cand: dict, row: int, layer: int, head: int,
           dtype: torch.dtype) -> tuple[str, str, tuple]:
    """(cause, sentence, (row, token) of the matching candidate or ()) for committed ``value``."""
    accept = cand["accept"]
    t_ok = int(accept[row]) - 1
    after = cand["after"][layer, :, :, head]  # [R, D, V, K]
    run = value.to(F64)
    options = [("right", row, t_ok, after[row, t_ok])]
    options += [("step", row, t, after[row, t]) for t in range(after.shape[1]) if t != t_ok]
    options += [("slot", r, t, after[r, t]) for r in range(after.shape[0]) if r != row for t in range(after.shape[1])]
    options.append(("before", row, -1, cand["before"][layer, row, head]))
    if not bool(torch.isfinite(run).all()):
        bad = int((~torch.isfinite(run)).sum())
        return "unexplained", (f"a non-finite value ({bad} of its {run.numel()} elements NaN or Inf), which no "
                               "candidate holds: a read of a stale or unowned slot"), ()
    dist = [(_rel(run, c), kind, r, t) for kind, r, t, c in options]
    d_ok = dist[0][0]
    best = min(dist)
    d, kind, r, t = best
    if kind == "right" and d <= SEMANTIC_TOL:
        return "store rounding", _rounding(run, after[row, t_ok], dtype), (row, t_ok)
    if d <= SEMANTIC_TOL and kind == "step":
        return "wrong step", (f"the wrong step: it holds the state after draft token {t} where the accept count "
                              f"says token {t_ok} ({d:.2g} relative from the former, {d_ok:.2g} from the latter)"), (r, t)
    if d <= SEMANTIC_TOL and kind == "slot":
        return "wrong slot", (f"the wrong slot: it holds row {r}'s state (after its draft token {t}), not row "
                              f"{row}'s ({d:.2g} relative from row {r}'s, {d_ok:.2g} from its own)"), (r, t)
    if d <= SEMANTIC_TOL and kind == "before":
        return "skipped commit", (f"a skipped commit: it holds the state from before this step ({d:.2g} relative), "
                                  f"not the one after draft token {t_ok}"), ()
    return "unexplained", (f"a value none of the candidates holds (the right state, after draft token {t_ok}, is "
                           f"{d_ok:.2g} relative away; the nearest candidate {d if kind != 'right' else d_ok:.2g}; "
                           f"candidates: every draft token of every row, the state before the step)"), ()


def diagnose(run: Resolved, check: str, step: int, layer: int, row: int, head: int,
             total: Optional[int] = None, start: Optional[ResumePoint] = None) -> Optional[Diagnosis]:
    """Replay ``run`` (``total`` steps as the run was asked for, chunked as it was; from ``start``
    where it resumed) to ``step`` and name what wrote committed state (layer, row, head) there.
    None for a sequential run (no update, no verify kernel)."""
    if run.mode != "mtp":
        return None
    sim = Simulation(run, check_untouched=False, graph=False, start=start)
    flow, pool = sim.flow, sim.pool
    probes = {"committed": lambda: flow.committed_states()[layer, row, head].clone()}
    scratch = getattr(pool, "scratch", None)
    shared = isinstance(scratch, torch.Tensor) and (scratch.untyped_storage().data_ptr()
                                                     == pool.temporal.untyped_storage().data_ptr())
    if isinstance(scratch, torch.Tensor) and scratch.dim() == 6 and not shared:  # a scratch of its own
        probes["scratch"] = lambda: pool.scratch[layer, :, :, head].clone()  # [rows + 1, D, V, K]
    probes["slots"] = lambda: pool.states[layer, :, head].clone()  # [S, V, K]: every slot of the pool
    holder: dict = {}

    def arm():
        rec = holder["rec"] = WriteRecorder(probes)
        sim._verify = rec.calling("the verify kernel", verify, kernel_where)
        sim.update = _Labelled(update, rec.calling("the update", update, lambda: (f"{update.spec} (native code)",)))
        rec.__enter__()
        holder["armed"] = True

    def disarm():
        if holder.pop("armed", False):
            holder["rec"].__exit__(None, None, None)
        sim._verify, sim.update = verify, update

    verify, update = sim._verify, sim.update

    def kernel_where() -> tuple[str, ...]:
        if run.kernel.portable:
            return (f"{display_path(_NATIVE_SOURCE)} (the portable native C kernel)",)
        return (f"{run.kernel.name} (native code)",)

    replay = _Replay(step, arm, disarm)
    sim.observers = [replay]
    try:
        sim.run(total if total is not None else run.cfg.steps)
    finally:
        disarm()  # a replay that raised mid-step leaves no dispatch mode behind
    if replay.candidates is None or "rec" not in holder:
        return None
    rec = holder["rec"]
    value = flow.committed_states()[layer, row, head]
    cause, sentence, match = _cause(value, replay.candidates, row, layer, head, pool.temporal.dtype)
    where = f"step {step}, layer {layer}, row {row}, head {head}"
    last = rec.last_write("committed")
    writes = [w.describe() for w in rec.writes if "committed" in w.changed]
    if last is None:
        text = f"{where}: {sentence}; no call changed it this step (it holds what an earlier step left)"
        return Diagnosis(check, where, "the update", "", "", cause, text, writes)
    blame, wrote = last, f"written by {last.describe()}"
    held = _held_in(value, probes, pool, rec, last)
    if held is not None:
        label, src = held
        if any(k in last.changed for k in ("scratch", "slots")):  # the last call copied the value
            wrote += f", copied from {label}, which {src.describe()} wrote"
        else:  # the last call chose which state is read; the value was written there before
            wrote = (f"read from {label}, which {src.describe()} wrote; the last change to which state is "
                     f"read: {last.describe()}")
        if cause in ("store rounding", "unexplained") and src.call == "the verify kernel":
            blame = src  # the right place, a wrong value: its writer
    text = f"{where}: {sentence}; {wrote}"
    if cause in ("wrong step", "skipped commit") and blame.call == "the verify kernel" and run.update is not None:
        # The kernel wrote that token's state where it should; which token's state is committed (the start
        # the next verify reads) is the update's bookkeeping -- an accept count that did not change this
        # step changed no probe, so the kernel's write is the last (vLLM's flow: the update sets the count).
        text += (f"; which token's state the next verify starts from is the update's bookkeeping: "
                 f"{run.update.spec}" + (f" at {display_path(run.update.source)}" if run.update.source else ""))
    return Diagnosis(check, where, blame.call, blame.where, blame.op, cause, text, writes)


def _held_in(value: torch.Tensor, probes: dict, pool, rec: WriteRecorder, last: Write) -> Optional[tuple]:
    """(label, its writer) of the first place besides the committed state that holds ``value`` bit
    for bit and that a call other than ``last`` wrote this step -- the verify scratch (row, draft
    token) first, then a pool slot -- or None."""
    for name in ("scratch", "slots"):
        if name not in probes:
            continue
        data = probes[name]()
        lead = data.dim() - value.dim()
        same = (_bits(data) == _bits(value)[(None,) * lead]).flatten(lead).all(-1)
        for hit in torch.nonzero(same).tolist():
            index = tuple(hit)
            src = rec.last_write(name, index)
            if src is None or src is last:
                continue
            if name == "scratch":
                return f"the verify scratch of row {index[0]}, draft token {index[1]}", src
            return f"slot {index[0]} ({pool.slot_role(index[0])})", src
    return None


def diagnose_failure(run: Resolved, checks: dict, total: Optional[int] = None,
                     start: Optional[ResumePoint] = None) -> Optional[Diagnosis]:
    """The diagnosis of a run's first state failure (:func:`first_state_failure` of ``checks``), or
    None when no state check failed."""
    first = first_state_failure(checks)
    if first is None:
        return None
    return diagnose(run, *first, total=total, start=start)
