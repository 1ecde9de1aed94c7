"""Checks of a run: each consumes :class:`~drift.check.compare.MetricsChunk` s and ends in a
:class:`CheckResult` (verdict, worst value, its limit, and where it happened).

The semantic threshold ``SEMANTIC_TOL`` separates a wrong state from a rounded one:

* A semantic error (committing the wrong draft step or slot, skipping a commit,
  a stale conv window) puts the committed state at least one token's update away
  from the truth. On ci-small such errors measure 0.39 to 1.85 relative (median over
  steps, per head; 1.29 to 4.8 at their worst) -- order one.
* bf16 rounding drift of a correct implementation stays near
  ``sqrt(kappa) * u / sqrt(1 - rho^2)`` (docs/bounds.md): 0.0030 to 0.0124 on ci-small
  (fastest to slowest head, 4,096 steps); even the biased truncation store reaches 0.16.

``SEMANTIC_TOL = 0.25`` sits between the two: above everything rounding produces on the
PR-gating presets (truncation included), below every semantic error measured. The
fine-grained precision verdict is the bound check's (:mod:`drift.check.bounds`).
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ..checkpoint import Stateful
from ..errors import ConfigError
from ..simulate import StopRun
from .compare import MetricsChunk
from .metrics import norm_floor, rel_err
from .registry import CHECKS, CheckSpec, RunContext
from .result import CheckResult, locate

SEMANTIC_TOL = 0.25
# Golden validation of the float64 twin: both are float64 computations of the same truth
# by two code paths, the golden stored as float32, so they differ by the float32 storage
# rounding, <= 2^-24 ~ 6e-8 relative to the projection's scale. 1e-6 leaves a 16x margin;
# any change to the stream, the parameters or the math moves them by order one.
GOLDEN_TOL = 1e-6


class Check(Stateful):
    """Base consumer: tracks the worst value and the first place it crossed the limit."""

    key = "check"  # its registry key (drift.check.registry); the title comes from there
    measures: tuple[str, ...] = ()  # what it reads of each chunk (drift/check/measures.py); () = every measure
    _state = ("worst", "worst_where", "first_fail", "seen")

    @property
    def name(self) -> str:
        return CHECKS.title(self.key) if self.key in CHECKS else self.key

    def __init__(self, limit: Optional[float] = None):
        self.limit = limit
        self.worst = -math.inf
        self.worst_where = ""
        self.first_fail: Optional[str] = None
        self.seen = 0

    def start(self, comparison) -> None:
        self.floor = norm_floor(comparison.sim.cfg.head_v_dim)

    def _update(self, values: np.ndarray, step0: int, bad: Optional[np.ndarray] = None,
                dims: tuple[str, ...] = ("layer", "row", "head")) -> None:
        if values.size == 0:
            return
        self.seen += values.shape[0]
        flat = np.nan_to_num(values, nan=np.inf)
        i = np.unravel_index(int(np.argmax(flat)), flat.shape)
        if flat[i] > self.worst:
            self.worst, self.worst_where = float(values[i]), locate(i, step0, dims)
        bad = (flat > self.limit) if bad is None else bad
        if self.first_fail is None and bad.any():
            self.first_fail = locate(tuple(np.argwhere(bad)[0]), step0, dims)

    def consume(self, chunk: MetricsChunk) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def finish(self) -> None:
        pass

    def result(self) -> CheckResult:
        if self.seen == 0:
            return CheckResult(self.name, False, None, self.limit, "",
                               "no step was compared (a check that saw nothing cannot pass)")
        ok = self.first_fail is None
        detail = "" if ok else f"first over the limit at {self.first_fail}"
        return CheckResult(self.name, ok, self.worst, self.limit, self.worst_where, detail)


class FiniteCheck(Check):
    """Committed states stay finite; the first NaN/Inf ends the run, named by step, layer, row, head."""

    key = "finite_states"
    measures = ("state",)

    def consume(self, chunk: MetricsChunk) -> None:
        bad = ~chunk.finite
        self.seen += chunk.count
        if bad.any() and self.first_fail is None:
            self.first_fail = locate(tuple(np.argwhere(bad)[0]), chunk.step0)
            raise StopRun(f"non-finite committed state at {self.first_fail}")

    def result(self) -> CheckResult:
        if self.seen == 0:
            return super().result()
        ok = self.first_fail is None
        return CheckResult(self.name, ok, None, None, self.first_fail or "",
                           "" if ok else f"NaN or Inf first at {self.first_fail}")


class StateCheck(Check):
    """Committed state of every active row vs the twin, relative Frobenius per (layer, head)."""

    key = "committed_state"
    measures = ("state",)

    def __init__(self, limit: float = SEMANTIC_TOL):
        super().__init__(limit)

    def consume(self, chunk: MetricsChunk) -> None:
        self._update(rel_err(chunk.err2, chunk.ref2, self.floor), chunk.step0)


class OutputCheck(Check):
    """Outputs of the accepted tokens vs the twin's, relative per (layer, head)."""

    key = "outputs"
    measures = ("outputs",)

    def __init__(self, limit: float = SEMANTIC_TOL):
        super().__init__(limit)

    def consume(self, chunk: MetricsChunk) -> None:
        self._update(rel_err(chunk.out_err2, chunk.out_ref2, self.floor), chunk.step0)


class ConvWindowCheck(Check):
    """The last Kc-1 rows of every request's conv buffer equal the true inputs, bit for bit."""

    key = "conv_windows"
    measures = ("conv",)

    def __init__(self):
        super().__init__(0.0)

    def consume(self, chunk: MetricsChunk) -> None:
        self._update(chunk.conv_bad.astype(np.float64), chunk.step0, dims=("row",))


class TrackCheck(Check):
    """Tracked snapshots: the SSM state equals what the run held at the boundary (bit-exact),
    the conv window equals the true window there (bit-exact), and the state is within the
    semantic threshold of the twin's boundary state."""

    key = "tracked_snapshots"
    measures = ("tracked",)
    _state = Check._state + ("tracked", "bits_fail", "conv_fail")

    def __init__(self, limit: float = SEMANTIC_TOL):
        super().__init__(limit)
        self.tracked = 0
        self.bits_fail: Optional[str] = None
        self.conv_fail: Optional[str] = None

    def start(self, comparison) -> None:
        super().start(comparison)
        sim = comparison.sim
        self.enabled = sim.cfg.track_interval > 0 and sim.mode == "mtp" and sim.flow.tracks
        self.flow_untracked = sim.mode == "mtp" and not sim.flow.tracks
        # A trace replayed without --loop ends where the trace ends: a longer run is not possible.
        self.fixed_horizon = bool(sim.cfg.trace) and not sim.cfg.trace_loop
        self.interval = sim.cfg.track_interval
        self.horizon, self.steps_seen = sim.cfg.steps, 0

    def consume(self, chunk: MetricsChunk) -> None:
        if not self.enabled:
            return
        tracked = chunk.track >= 0  # [S, R]
        self.tracked += int(tracked.sum())
        self.steps_seen = max(self.steps_seen, chunk.step0 + tracked.shape[0])
        rel = rel_err(chunk.trk_err2, chunk.trk_ref2, self.floor)
        rel = np.where(tracked[:, None, :, None], rel, 0.0)
        self._update(rel, chunk.step0)
        for arr, attr in ((chunk.trk_bits_bad, "bits_fail"), (chunk.trk_conv_bad, "conv_fail")):
            bad = (arr > 0) & tracked
            if getattr(self, attr) is None and bad.any():
                s, r = np.argwhere(bad)[0]
                setattr(self, attr, f"step {chunk.step0 + int(s)}, row {int(r)}")

    def result(self) -> CheckResult:
        if not self.enabled and getattr(self, "flow_untracked", False):
            return CheckResult(self.name, True, None, None, "", "not applicable: this state flow models no "
                               "prefix-cache copies (its tracks = False)", extra={"applicable": False})
        if not self.enabled:
            return CheckResult(self.name, True, None, None, "", "not applicable: tracking off "
                               "(track_interval = 0) or sequential decode", extra={"applicable": False})
        if self.tracked == 0 and self.fixed_horizon:  # the run cannot be lengthened: not exercised, not gated
            return CheckResult(self.name, True, None, self.limit, "",
                               f"not exercised: no tracking boundary (track interval {self.interval}) within the "
                               "positions of this trace; pass --loop with more --steps to run past its end, or a "
                               "preset with a shorter track interval", extra={"applicable": False})
        if self.tracked == 0 and self.steps_seen < self.horizon:  # stopped early (fail-fast): another check failed
            return CheckResult(self.name, True, None, self.limit, "",
                               f"not exercised: the run stopped at step {self.steps_seen}, before a tracking "
                               "boundary", extra={"applicable": False})
        if self.tracked == 0:  # the stream's schedule alone decides it, not the code under test: a usage error
            raise ConfigError(no_tracking_boundary(self.interval, self.horizon))
        res = super().result()
        msgs = [res.detail] if res.detail else []
        if self.bits_fail:
            msgs.append(f"tracked SSM state differs from the state held at the boundary ({self.bits_fail})")
        if self.conv_fail:
            msgs.append(f"tracked conv window differs from the true window ({self.conv_fail})")
        res.passed = res.passed and not self.bits_fail and not self.conv_fail
        res.detail = "; ".join(msgs) or f"{self.tracked} snapshots compared"
        return res


def no_tracking_boundary(interval: int, steps: int) -> str:
    """The usage error of a run whose schedule crosses no tracking boundary (TrackCheck; the preflight
    finds it first where it can: drift.runner.preflight)."""
    return (f"tracking is on (every {interval} positions) but no tracking boundary fell within the {steps} "
            "steps run, so the tracked-snapshot check would compare nothing: lengthen the run (--steps), or turn "
            "tracking off (--track-interval 0)")


class GoldenCheck(Check):
    """The float64 twin agrees with the golden trajectory: projections at every committed
    position and accepted output, full states and conv windows at checkpoints. Under a churning
    lifecycle lane by lane, each lane against its request's golden rows (drift/check/golden.py), the
    twin's fresh lane at every start included, and the run's starts against the schedule the golden
    data was made for; a place is named by step, lane (``row``) and request."""

    key = "golden"
    measures = ("golden",)
    _state = Check._state + ("ckpt_fail", "sched_fail")

    def __init__(self, tol: float = GOLDEN_TOL):
        super().__init__(tol)
        self.ckpt_fail: Optional[str] = None
        self.sched_fail: Optional[str] = None

    def start(self, comparison) -> None:
        super().start(comparison)
        self.comparison = comparison

    @staticmethod
    def _request(chunk: MetricsChunk, where: str, s: int, r: int) -> str:
        """``where`` with the request lane ``r`` ran at chunk step ``s`` (a churning lifecycle)."""
        if "request" not in chunk.arrays:
            return where
        return f"{where} (request {int(chunk.request[s, r])})"

    def consume(self, chunk: MetricsChunk) -> None:
        if self.comparison.golden is None:
            return
        dev = np.fmax(chunk.gold_dev, chunk.gold_out_dev)  # NaN (past the horizon) ignored
        covered = np.isfinite(dev)
        worst, first = self.worst, self.first_fail
        values = np.where(covered, dev, 0.0)
        self._update(values, chunk.step0)
        if "request" in chunk.arrays:  # name the request of the lane (row) where it happened
            if self.worst != worst:
                s, _, r, _ = np.unravel_index(int(np.argmax(np.nan_to_num(values, nan=np.inf))), values.shape)
                self.worst_where = self._request(chunk, self.worst_where, s, r)
            if first is None and self.first_fail is not None:
                s, _, r, _ = np.argwhere(values > self.limit)[0]
                self.first_fail = self._request(chunk, self.first_fail, s, r)
        self.seen -= chunk.count
        self.seen += int(covered.any(axis=(1, 2, 3)).sum())
        ck = np.where(chunk.gold_ckpt_bad > 0, np.inf, chunk.gold_ckpt_dev)
        if self.ckpt_fail is None and (ck > self.limit).any():
            s, r = np.argwhere(ck > self.limit)[0]
            self.ckpt_fail = self._request(chunk, f"step {chunk.step0 + int(s)}, row {int(r)}", s, r)
        sched = chunk.arrays.get("gold_sched_bad")
        if self.sched_fail is None and sched is not None and (sched > 0).any():
            s, r = np.argwhere(sched > 0)[0]
            self.sched_fail = self._request(chunk, f"step {chunk.step0 + int(s)}, row {int(r)}", s, r)

    def result(self) -> CheckResult:
        comp = self.comparison
        if comp.golden is None:
            return CheckResult(self.name, True, None, None, "", f"not applicable: {comp.golden_note}; "
                               "the float64 twin is the reference", extra={"applicable": False})
        res = super().result()
        hint = (f"if the generator or the trace changed on purpose: {comp.golden.regen_hint}"
                if getattr(comp.golden, "regen_hint", "") else
                f"if the generator or the preset changed on purpose: drift regen-golden --preset {comp.golden.name} --force")
        if self.ckpt_fail:
            res.passed = False
            res.detail = (res.detail + "; " if res.detail else "") + f"checkpoint state/window differs ({self.ckpt_fail})"
        if self.sched_fail:
            res.passed = False
            res.detail = ((res.detail + "; " if res.detail else "") + "the run's requests differ from those the golden "
                          f"data was made for ({self.sched_fail}): the lifecycle's schedule changed")
            hint = hint.replace("the preset changed", "the preset or the lifecycle changed")
        if not res.passed:
            res.detail += f"; the twin disagrees with {comp.golden.path.name}: {hint}"
        else:
            res.detail = f"{comp.golden_positions} positions, {comp.golden_checkpoints} checkpoints"
        return res


def untouched_result(violation: Optional[dict], steps: int) -> CheckResult:
    """Verdict of the simulation's slot guard."""
    name = CHECKS.title("untouched_slots")
    if steps == 0:
        return CheckResult(name, False, None, None, "", "no step ran")
    if violation is None:
        return CheckResult(name, True, None, None, "",
                           "every slot neither committed nor tracked stayed bit-identical across the update, "
                           "and every slot the verify kernel does not store to across its call too")
    call = violation.get("call", "update")  # a checkpoint written before the guard covered the kernel: the update
    return CheckResult(name, False, None, None, f"step {violation['step']}",
                       f"the {call} wrote {violation['role']} (slot {violation['slot']}) "
                       f"at step {violation['step']}, which it must leave untouched")


def core_checks() -> list[Check]:
    """Semantic checks against the reference (golden-validated float64 twin)."""
    return [FiniteCheck(), GoldenCheck(), StateCheck(), OutputCheck(), ConvWindowCheck(), TrackCheck()]


def _mtp(ctx: RunContext) -> bool:
    return ctx.mode == "mtp"


def _stopped_early(ctx: RunContext) -> Optional[CheckResult]:
    if not ctx.info.stopped_early:
        return None  # reported only when the run did not complete
    return CheckResult(CHECKS.title("run_completed"), False, None, None, "", f"stopped early: {ctx.info.stopped_early}")


for _spec in (
    CheckSpec("finite_states", "finite states", 10, "a NaN/Inf committed state (the run stops, naming step, "
              "layer, row, head)", "consumer", build=lambda ctx: FiniteCheck()),
    CheckSpec("golden", "golden", 20, "the float64 twin disagrees with the golden data (stream, parameters or "
              "math changed)", "consumer", build=lambda ctx: GoldenCheck()),
    CheckSpec("committed_state", "committed state", 30, f"a state more than {SEMANTIC_TOL} relative from the "
              "truth: a semantic error (wrong step, slot, skipped commit)", "consumer", build=lambda ctx: StateCheck()),
    CheckSpec("outputs", "outputs", 40, f"outputs of accepted tokens more than {SEMANTIC_TOL} relative from the "
              "truth", "consumer", build=lambda ctx: OutputCheck()),
    CheckSpec("conv_windows", "conv windows", 50, "the committed conv window differs from the true inputs in any "
              "bit", "consumer", build=lambda ctx: ConvWindowCheck()),
    CheckSpec("tracked_snapshots", "tracked snapshots", 60, "a prefix-cache snapshot that is not bit-identical to "
              "the state at its boundary", "consumer", build=lambda ctx: TrackCheck()),
    CheckSpec("untouched_slots", "untouched slots", 110, "the update wrote a slot it neither commits nor tracks "
              "(the dummy slot included), or the verify kernel a slot its flow's verify does not store to (any, "
              "where it stores to a scratch or a ring)", "run", applies=_mtp,
              result=lambda ctx: untouched_result(ctx.info.untouched_violation, ctx.info.steps)),
    CheckSpec("run_completed", "run completed", 140, "the run stopped before its last step (reported only then)",
              "run", result=_stopped_early),
):
    CHECKS.add(_spec)
