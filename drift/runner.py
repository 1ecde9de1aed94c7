"""One checked run: simulation + float64 twin + checks, gathered into a :class:`RunReport`."""

from __future__ import annotations

import functools
import inspect
import platform
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from .check.bounds import BoundCheck
from .check.checks import Check, no_tracking_boundary
from .check.compare import Comparison
from .check.registry import CHECKS, RunContext
from .check.result import CheckResult
from .config import Config
from .errors import ENDS_PROCESS, ConfigError, DriftError, LoadError, ended_by_code, raised_at, what_raised
from .mkl import mkl_mode
from .openmp import run_threads
from .runspec import Resolved
from .sim.shim import kernels_in_use
from .sim.twin import F64
from .simulate import ResumePoint, RunInfo, Simulation
from .syncs.process import scan_beside
from .syncs.scan import sync_check
from .version import __version__


@dataclass
class RunReport:
    """Everything a run found: config, run info, one result per check."""

    config: Config
    info: RunInfo
    checks: list[CheckResult]
    reference: str
    extra: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not any(c.failed for c in self.checks) and self.info.stopped_early is None

    def to_dict(self) -> dict:
        info = self.info
        return {
            "schema": 1,
            "verdict": "pass" if self.passed else "fail",
            "config": {**self.config.to_dict(), "profile": self.config.profile},
            "run": {"steps": info.steps, "wall_s": round(info.wall_s, 3),
                    "steps_per_s": round(info.steps / info.wall_s, 2) if info.wall_s > 0 else None,
                    "mode": info.mode, "update": info.update, "kernels": info.kernels,
                    "verify_kernel": info.verify_kernel,
                    "device": info.device, "stopped_early": info.stopped_early, **info.meta},
            "reference": self.reference,
            "checks": [c.to_dict() for c in self.checks],
            "versions": versions(),
            **self.extra,
        }


#: report.json ``run`` fields that time the run: two runs with the same figures differ in them.
TIMINGS = ("wall_s", "steps_per_s", "pace")


def versions() -> dict:
    return {"drift": __version__, "torch": torch.__version__, "numpy": np.__version__,
            "python": platform.python_version(), "mkl": mkl_mode()}


class CheckedRun:
    """A simulation of a :class:`~drift.runspec.Resolved` run wired to its checks: every applicable
    check of the registry (drift/check/registry.py) in report order -- the float64 twin
    (golden-validated), the semantic checks, the drift bound and what reads it, the sequential shadow
    when asked, and the run-level verdicts -- unless ``checks`` replaces the per-step ones. ``run``
    then ``results`` / ``report``.

    golden: as for :class:`Comparison`. vs_sequential: also run the stream through sequential
    decode in lockstep and report the divergence. start / env2_start: resume every row from a
    :class:`ResumePoint` with the bound envelope it carries there.
    """

    def __init__(self, run: Resolved, checks: Optional[Sequence[Check]] = None, golden=None,
                 vs_sequential: bool = False, start: Optional[ResumePoint] = None,
                 env2_start: Optional[np.ndarray] = None, observers: Sequence = (), fail_fast: bool = False):
        cfg, mode = self.cfg, self.mode = run.cfg, run.mode
        self.resolved = run
        self.ctx = RunContext(cfg, mode, vs_sequential, env2_start)
        specs = [s for s in CHECKS.in_order() if s.applies(self.ctx)]
        if checks is not None:  # the caller's per-step checks replace the registry's
            specs = [s for s in specs if s.shape in ("observer", "run")]
            self.ctx.checks.update({getattr(c, "key", f"check{i}"): c for i, c in enumerate(checks)})
        for spec in specs:
            if spec.shape != "run":
                missing = [k for k in spec.needs if k not in self.ctx.checks]
                if missing:
                    raise ValueError(f"check {spec.key!r} needs {missing}, which is not in this run")
                origin = extension_of(spec)
                if origin:
                    built = self.ctx.checks[spec.key] = build_extension_check(spec, origin, self.ctx)
                    for hook in ("start", "consume", "finish", "result"):
                        if callable(getattr(built, hook, None)):
                            setattr(built, hook, guarded(spec, origin, hook, getattr(built, hook)))
                else:
                    self.ctx.checks[spec.key] = spec.build(self.ctx)
        self.specs = specs
        self.checks = [c for c in self.ctx.checks.values() if hasattr(c, "consume")]
        self.bound: Optional[BoundCheck] = self.ctx.checks.get("drift_bound")
        self.comparison = Comparison(self.checks, golden=golden)
        self.comparison.fail_fast = fail_fast
        shadows = [self.ctx.checks[s.key] for s in specs if s.shape == "observer"]
        self.sim = Simulation(run, observers=[self.comparison, *shadows, *observers], start=start)
        self.sim.ramp = fail_fast  # short first chunks: an early failure stops early
        self.ctx.sim, self.ctx.comparison = self.sim, self.comparison

    def run(self, steps: Optional[int] = None, **kwargs) -> RunInfo:
        """``Simulation.run`` (progress, resume_state, checkpoint, checkpoint_every pass through)."""
        info = self.sim.run(steps, **kwargs)
        info.meta["pace"] = self.comparison.pace()
        if self.sim.update is not None:
            info.meta["update_spec"] = self.sim.update.spec
            info.meta["update_source"] = self.sim.update.source
        return info

    def results(self, info: RunInfo, sync_scan: bool = True,
                syncs: Optional[CheckResult] = None) -> list[CheckResult]:
        """One result per check in report order, each tagged with its registry key; the host-sync
        scan of the update runs when ``sync_scan`` (``syncs``: its result when it already ran)."""
        ctx = self.ctx
        ctx.info, ctx.results = info, {}
        if syncs is not None:
            ctx.sync_scan = lambda: syncs
        else:
            ctx.sync_scan = (lambda: sync_check(self.resolved)) if sync_scan else None
        registered = {s.key for s in self.specs}
        for key, obj in ctx.checks.items():
            if key not in registered:  # a caller's own per-step check
                res = obj.result()
                res.key = res.key or key
                ctx.results[key] = res
        for spec in self.specs:
            origin = extension_of(spec) if spec.shape == "run" else ""
            hook = guarded(spec, origin, "result", spec.result) if origin else spec.result
            res = hook(ctx) if spec.shape == "run" else ctx.checks[spec.key].result()
            if res is not None:
                res.key = spec.key
                ctx.results[spec.key] = res
        return list(ctx.results.values())

    def report(self, info: RunInfo, sync_scan: bool = True, syncs: Optional[CheckResult] = None) -> RunReport:
        return RunReport(self.cfg, info, self.results(info, sync_scan, syncs),
                         self.comparison.reference_description())


def extension_of(spec) -> str:
    """The file of the module outside drift that registered check ``spec`` (its build or result
    hook's), '' for drift's own checks."""
    hook = spec.result if spec.shape == "run" else spec.build
    module = getattr(hook, "__module__", "") or ""
    if module == "drift" or module.startswith("drift."):
        return ""
    try:
        return inspect.getsourcefile(hook) or module
    except TypeError:
        return module


def guarded(spec, origin: str, hook: str, fn: Callable) -> Callable:
    """``fn`` (hook ``hook`` of an extension's check ``spec``) with what it raises -- or a
    ``sys.exit`` -- turned into one LoadError (exit 2) naming the check, the extension and the line:
    drift could not run that check, which is not a regression it measured. A ``result`` hook must
    return a CheckResult (a ``run`` check's may return None: nothing to report); anything else is
    refused the same way, not dropped from the report or left to crash it."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            out = fn(*args, **kwargs)
        except DriftError:
            raise
        except (Exception, *ENDS_PROCESS) as exc:
            if not isinstance(exc, Exception) and not ended_by_code(exc):
                raise  # a signal
            raise LoadError(f"check {spec.key!r} of the extension {origin} raised {exc!r} at {raised_at(exc)} in its "
                            f"{hook}, so drift could not run it (not a regression); fix it or remove it from "
                            "DRIFT_EXTENSIONS") from exc
        if hook == "result" and not (isinstance(out, CheckResult) or (out is None and spec.shape == "run")):
            raise LoadError(f"check {spec.key!r} of the extension {origin}: its result returned "
                            f"{type(out).__name__}, not a drift.check.result.CheckResult, so drift has no verdict "
                            "of it (not a regression); return one (docs/extending.md: A check) or remove it from "
                            "DRIFT_EXTENSIONS")
        return out
    return call


def build_extension_check(spec, origin: str, ctx: RunContext):
    """An extension's check ``spec`` built for ``ctx`` (its build :func:`guarded`), refused (exit 2)
    unless it has the hooks its shape is read through: ``consume`` and ``result`` for a consumer,
    ``result`` otherwise."""
    built = guarded(spec, origin, "build", spec.build)(ctx)
    needs = ("consume", "result") if spec.shape == "consumer" else ("result",)
    missing = [h for h in needs if not callable(getattr(built, h, None))]
    if missing:
        raise LoadError(f"check {spec.key!r} of the extension {origin}: its build returned {type(built).__name__}, "
                        f"which has no {' or '.join(f'{h}()' for h in missing)}, so drift cannot run it (not a "
                        f"regression); a {spec.shape} check's build returns "
                        f"{'a drift.check.checks.Check' if spec.shape == 'consumer' else 'an object with result()'} "
                        "(docs/extending.md: A check), or remove it from DRIFT_EXTENSIONS")
    return built


def preflight(run: Resolved) -> Resolved:
    """What a run is refused for (exit 2) before any check runs, beyond resolving it: its states
    must fit this machine, (MTP) its update must read only what drift's harness provides -- found
    by calling it on the host-sync scan's representative steps (virtual device), as the scan that
    starts every ``drift run`` does, and asking its ``preflight(cfg)`` where it has one (LoadError:
    a config it cannot run) -- and every check must build. An update that raises there is
    code under test failing, a regression the run itself reports (exit 1), not refused here.
    Returns ``run``."""
    from .sim.pool import check_fits
    from .syncs.scan import scan_update
    from .errors import UpdateRaised

    check_fits(run.cfg)
    refuse = getattr(run.update.fn, "preflight", None) if run.update is not None else None
    if refuse is not None and run.mode == "mtp":  # what the update itself cannot run (drift/plug/vllm_engine.py)
        refuse(run.cfg)
    # On the run's thread count: a matmul on more threads starts OpenMP's pool, whose idle threads then
    # keep the run from forking its comparison (drift.check.forked.fork_refusal)
    with run_threads(run.cfg):
        if run.mode == "mtp":
            try:
                scan_update(run, device=None)
            except UpdateRaised:
                pass
        checked = CheckedRun(run)  # every check built (an extension's that raises there is refused now)
    if _crosses_no_tracking_boundary(checked.sim):
        raise ConfigError(no_tracking_boundary(run.cfg.track_interval, run.cfg.steps))
    return run


def _crosses_no_tracking_boundary(sim: Simulation) -> bool:
    """Whether ``sim``'s run tracks (MTP, a flow that tracks, an interval) and yet its stream's schedule
    crosses no tracking boundary in its steps: TrackCheck's usage error, found before any step runs. Each
    step commits at least one token, so a run of at least ``track_interval`` steps crosses one; a shorter
    one reads its schedule's chunks (host arrays, nothing simulated). A trace that ends first is not
    refused (its check says not exercised)."""
    cfg = sim.cfg
    if (sim.mode != "mtp" or not sim.flow.tracks or cfg.track_interval <= 0 or cfg.steps >= cfg.track_interval
            or (cfg.trace and not cfg.trace_loop)):
        return False
    done = 0
    while done < cfg.steps:
        chunk = sim.stream.chunk(min(sim.stream.chunk_steps, cfg.steps - done))
        if (chunk.track_host >= 0).any():
            return False
        done += chunk.count
    return True


def run_checked(run: Resolved, steps: Optional[int] = None, checks: Optional[Sequence[Check]] = None,
                progress: Optional[Callable[[int, int], None]] = None, golden=None, vs_sequential: bool = False,
                start: Optional[ResumePoint] = None, env2_start: Optional[np.ndarray] = None,
                observers: Sequence = (), sync_scan: bool = True, sync_first: bool = False,
                fail_fast: bool = False, sync_sample: int = 0, diagnose: bool = True) -> RunReport:
    """Run the resolved ``run`` under every check (see :class:`CheckedRun`) and report.
    sync_scan: also run the update on the virtual accelerator and fail on any host sync; the scan
    runs as the simulation starts, in a process of its own where it can (drift/syncs/process.py),
    else before it, in this one (a sync fails the run whatever else it finds).
    sync_first: when the scan finds a sync, report at once (the precision checks not run).
    fail_fast: stop the simulation at the end of the first chunk in which a check failed.
    sync_sample: real steps of the run's horizon the scan re-checks beyond its representative ones.
    diagnose: when a state check failed, replay to its first out-of-bound state and name what wrote
    it (report ``extra["diagnosis"]``, :func:`diagnose_report`); the catalogues that only count
    verdicts turn it off. A small run takes one intra-op thread (drift/openmp.py: run_threads)."""
    with run_threads(run.cfg):
        syncs, beside, t0 = None, None, time.perf_counter()
        if sync_scan and run.mode == "mtp":
            beside = scan_beside(run, sync_sample, stop_on_sync=sync_first)  # the scan while this process simulates
            if beside is None:  # where it cannot fork: the scan here, first
                syncs = sync_check(run, sample=sync_sample)
                if syncs.failed and sync_first:
                    return sync_failed_report(run, syncs, time.perf_counter() - t0)
        try:
            try:
                checked = CheckedRun(run, checks, golden, vs_sequential, start, env2_start,
                                     [*observers, beside] if beside is not None else observers, fail_fast)
                if beside is not None and sync_first:  # short first chunks: a sync stops the run soon after it is found
                    checked.sim.ramp = True
                info = checked.run(steps, progress=progress)
            except Exception:  # the scan came first: what it raised, or a sync it found (sync_first), stands
                if beside is not None and sync_first and beside.result().failed:
                    return sync_failed_report(run, beside.result(), time.perf_counter() - t0)
                raise
            if beside is not None:
                syncs = beside.result()
                if syncs.failed and sync_first:  # the run stopped at the chunk the result came in
                    return sync_failed_report(run, syncs, time.perf_counter() - t0)
        finally:
            if beside is not None:
                beside.close()
        rep = checked.report(info, sync_scan, syncs)
        if diagnose and not rep.passed:
            diagnosis = diagnose_report(run, checked, steps, start)
            if diagnosis is not None:
                rep.extra["diagnosis"] = diagnosis
        return rep


def diagnose_report(run: Resolved, checked: CheckedRun, steps: Optional[int] = None,
                    start: Optional[ResumePoint] = None) -> Optional[dict]:
    """The diagnosis of a failed run's first out-of-bound committed state (drift/check/diagnose.py),
    as report.json's ``diagnosis``; None when no state check failed. A diagnosis that cannot be made
    says why; it never changes the verdict."""
    from .check.diagnose import diagnose_failure, first_state_failure

    if run.mode != "mtp" or first_state_failure(checked.ctx.checks) is None:
        return None
    try:
        found = diagnose_failure(run, checked.ctx.checks, steps if steps is not None else run.cfg.steps, start)
    except DriftError:
        raise
    except Exception as exc:  # the verdict stands; the diagnosis says it could not be made
        return {"text": f"no diagnosis: the replay raised {what_raised(exc)}"}
    return found.to_dict() if found is not None else None


def sync_failed_report(run: Resolved, syncs: CheckResult, wall_s: float) -> RunReport:
    """The report of a run stopped by the host-sync scan before its first decode step."""
    cfg, update = run.cfg, run.update
    skipped = CheckResult("precision checks", True, None, None, "",
                          "not run: the host-sync scan runs first and a sync fails the run at once "
                          "(drift run --all-checks runs every check anyway)", {"applicable": False},
                          key="precision_checks")
    info = RunInfo(steps=0, wall_s=wall_s, mode="mtp", update=update.description, kernels=kernels_in_use(),
                   device=str(cfg.device), verify_kernel=run.kernel.description,
                   meta={"update_spec": update.spec, "update_source": update.source,
                         "graph_note": "not run: stopped after the host-sync scan"})
    return RunReport(cfg, info, [syncs, skipped], "not run (stopped after the host-sync scan)")


class SnapshotCatcher:
    """Observer + consumer: after ``after_step``, grabs each active row's first tracked snapshot
    (state bits, conv window, the twin's truth there, the bound envelope) as a ResumePoint.

    Put it after the Comparison in the observers and after the BoundCheck in its consumers.
    """

    def __init__(self, comparison: Comparison, bound: BoundCheck, after_step: int):
        self.comparison, self.bound, self.after = comparison, bound, after_step
        self.rows: dict[int, dict] = {}

    # observer side
    def on_start(self, sim) -> None:
        self.sim = sim

    def on_step(self, view) -> None:
        if view.step < self.after:
            return
        if not (view.track >= 0).any():
            return
        # What the flow's tracked slots hold (SGLang's track slot, or vLLM's align destination).
        rows, states, windows = self.sim.flow.tracked_snapshot(view.track)[:3]
        for i, r in enumerate(rows.tolist()):
            if r in self.rows:
                continue
            self.rows[r] = {
                "position": int(view.pre[r] + view.track[r] + 1), "step": view.step, "index": view.index,
                "state": states[:, i].clone(), "window": windows[:, i].clone(),
                "true_state": None, "true_window": None, "env2": None}

    def on_twin_step(self, step: int, twin) -> None:
        """The truth at each snapshot, once the comparison's twin has reached its step."""
        for r, snap in self.rows.items():
            if snap["step"] == step and snap["true_state"] is None:
                snap["true_state"] = twin.track_state[:, r].clone()
                snap["true_window"] = twin.track_window[:, r].clone()

    def flush(self) -> None:
        pass

    def on_end(self) -> None:
        pass

    # consumer side (after the BoundCheck has processed the chunk)
    def start(self, comparison) -> None:
        pass

    def consume(self, chunk) -> None:
        for r, snap in self.rows.items():
            if snap["env2"] is None and chunk.step0 <= snap["step"] < chunk.step0 + chunk.count:
                s = snap["step"] - chunk.step0
                prev = self.bound.last_env2[s - 1] if s > 0 else self._carry
                # The snapshot is one store after the previous commit: at most the larger of the
                # envelopes around it, plus one rounding of the snapshot itself.
                snap["env2"] = np.maximum(prev[:, r], self.bound.last_env2[s][:, r])
        self._carry = self.bound.last_env2[-1].copy()

    def finish(self) -> None:
        pass

    def resume_point(self) -> tuple[ResumePoint, np.ndarray]:
        cfg = self.sim.cfg
        missing = [r for r in range(cfg.num_requests) if r not in self.rows]
        if missing:
            raise RuntimeError(f"rows {missing} were never tracked after step {self.after}: run longer")
        rows = [self.rows[r] for r in range(cfg.num_requests)]
        stack = lambda k, dt=None: torch.stack([x[k] for x in rows], 1)
        point = ResumePoint(positions=np.array([x["position"] for x in rows], np.int64),
                            state=stack("state"), window=stack("window").to(F64),
                            true_state=stack("true_state").cpu(), true_window=stack("true_window").cpu())
        env2 = np.stack([x["env2"] for x in rows], 1)  # [L, R, HV]
        return point, env2


def capture_snapshots(run: Resolved, after_step: int = 256,
                      steps: Optional[int] = None) -> tuple[RunReport, ResumePoint, np.ndarray]:
    """Run ``run`` (checked) and capture every row's first tracked snapshot after ``after_step``:
    the prefix-cache entry a later request with the same prefix would load (cache hit)."""
    if run.cfg.track_interval <= 0:
        raise ValueError("capture_snapshots needs tracking on (track_interval > 0)")
    checked = CheckedRun(run)
    catcher = SnapshotCatcher(checked.comparison, checked.bound, after_step)
    checked.comparison.consumers.append(catcher)
    checked.comparison.twin_listeners.append(catcher.on_twin_step)
    checked.sim.observers.append(catcher)
    info = checked.run(steps)
    point, env2 = catcher.resume_point()
    return checked.report(info, sync_scan=False), point, env2
