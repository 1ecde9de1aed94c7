"""One checked run: simulation + float64 twin + checks, gathered into a :class:`RunReport`."""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from .bounds import BoundCheck, GrowthCheck
from .checks import Check, CheckResult, core_checks, untouched_result
from .compare import Comparison
from .config import Config
from .simulate import RunInfo, Simulation


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
        return all(c.passed for c in self.checks) and self.info.stopped_early is None

    def to_dict(self) -> dict:
        info = self.info
        return {
            "schema": 1,
            "verdict": "pass" if self.passed else "fail",
            "config": self.config.to_dict(),
            "run": {"steps": info.steps, "wall_s": round(info.wall_s, 3),
                    "steps_per_s": round(info.steps / info.wall_s, 2) if info.wall_s > 0 else None,
                    "mode": info.mode, "update": info.update, "kernels": info.kernels,
                    "device": info.device, "stopped_early": info.stopped_early, **info.meta},
            "reference": self.reference,
            "checks": [c.to_dict() for c in self.checks],
            "versions": versions(),
            **self.extra,
        }


def versions() -> dict:
    from . import __version__
    return {"drift": __version__, "torch": torch.__version__, "numpy": np.__version__,
            "python": platform.python_version()}


def run_checked(cfg: Config, update="sync_free", mode: str = "mtp", steps: Optional[int] = None,
                checks: Optional[Sequence[Check]] = None,
                progress: Optional[Callable[[int, int], None]] = None,
                verify_kernel=None, golden=None) -> RunReport:
    """Run ``cfg`` through ``update`` and apply ``checks`` (default: the semantic checks, the
    drift bound and the growth exponent). ``golden``: as for :class:`Comparison`."""
    post = []
    if checks is None:
        bound = BoundCheck()
        checks = core_checks() + [bound]
        post = [GrowthCheck(bound)]
    checks = list(checks)
    comparison = Comparison(checks, golden=golden)
    sim = Simulation(cfg, update, mode=mode, observers=[comparison], verify_kernel=verify_kernel)
    info = sim.run(steps, progress=progress)
    if sim.update is not None:
        info.meta["update_spec"] = sim.update.spec
        info.meta["update_source"] = sim.update.source
    results = [c.result() for c in checks] + [p.result() for p in post]
    if mode == "mtp":
        results.append(untouched_result(info.untouched_violation, info.steps))
    if info.stopped_early:
        results.append(CheckResult("run completed", False, None, None, "", f"stopped early: {info.stopped_early}"))
    return RunReport(cfg, info, results, comparison.reference_description())
