"""The registry of checks: every check of a run is one :class:`CheckSpec`, registered by the module
that implements it, and this table is the only place its name, its place in the report, its
gating and its one-line "what fails it" live (the README's table is generated from it).

A check takes one of four shapes, and the run (drift/runner.py) treats each shape alike:

* ``consumer``: ``build(ctx)`` returns a chunk consumer (:class:`drift.check.checks.Check`) that the
  per-step comparison feeds with :class:`~drift.check.compare.MetricsChunk` s; its ``result()``
  is the verdict.
* ``derived``: ``build(ctx)`` returns an object whose ``result()`` reads the checks it ``needs``
  (``ctx.checks[key]``), e.g. the growth exponent reads the drift bound's curves.
* ``observer``: ``build(ctx)`` returns a simulation observer with a ``result()`` (the sequential
  shadow), added to the run only where ``applies``.
* ``run``: ``result(ctx)`` returns the verdict from the finished run (``ctx.info``, the update,
  the graph status), or None where it has nothing to report.

``applies(ctx)`` says where a check runs at all (mode, device, options). Jobs, reports and tests
refer to a check by its key, never by its title.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..registry import Registry

SHAPES = ("consumer", "derived", "observer", "run")


@dataclass
class RunContext:
    """What a check may read: the run's config and mode, what was asked, and (filled in as the run
    goes) the simulation, the comparison, the built checks by key and the finished run's info."""

    cfg: Any
    mode: str = "mtp"
    vs_sequential: bool = False
    env2_start: Any = None  # [L, R, HV] bound envelope to resume from (drift.runner)
    sync_scan: Optional[Callable[[], Any]] = None  # the host-sync scan of the update, None when off
    sim: Any = None
    comparison: Any = None
    checks: dict = field(default_factory=dict)  # key -> the built check object
    results: dict = field(default_factory=dict)  # key -> CheckResult, in report order
    info: Any = None  # drift.simulate.RunInfo once the run is over


def _always(ctx: RunContext) -> bool:
    return True


@dataclass(frozen=True)
class CheckSpec:
    """One check: ``key`` (how code refers to it), ``title`` (the report's name for it), ``order``
    (its row in the report), ``fails_when`` (one line for the README table), its ``shape``, and the
    hook of that shape (``build`` or ``result``)."""

    key: str
    title: str
    order: int
    fails_when: str
    shape: str
    build: Optional[Callable[[RunContext], Any]] = None
    result: Optional[Callable[[RunContext], Any]] = None
    needs: tuple[str, ...] = ()
    applies: Callable[[RunContext], bool] = _always

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"check {self.key!r}: shape {self.shape!r} is not one of {SHAPES}")
        hook = self.result if self.shape == "run" else self.build
        if hook is None:
            raise ValueError(f"check {self.key!r} of shape {self.shape!r} needs "
                             f"{'result' if self.shape == 'run' else 'build'}")


class CheckRegistry(Registry[CheckSpec]):
    """Checks in report order (by ``order``, then registration)."""

    def add(self, spec: CheckSpec) -> CheckSpec:
        return self.register(spec.key, spec)

    def in_order(self) -> list[CheckSpec]:
        return sorted(self.values(), key=lambda s: s.order)

    def title(self, key: str) -> str:
        return self[key].title


CHECKS = CheckRegistry("check")


def title(key: str) -> str:
    """The report's name of the check ``key``."""
    return CHECKS.title(key)


def result_key(result: Any) -> str:
    """The registry key of a check result (a CheckResult or its report dict); for a report written
    before results carried keys, the key whose title it has."""
    key = result.get("key") if isinstance(result, dict) else getattr(result, "key", "")
    if key:
        return key
    name = result.get("name") if isinstance(result, dict) else getattr(result, "name", "")
    return next((s.key for s in CHECKS.values() if s.title == name), "")


def find_result(results, key: str):
    """The result of check ``key`` among ``results`` (CheckResults or report dicts), or None."""
    return next((r for r in results if result_key(r) == key), None)


def checks_markdown() -> str:
    """The README's "What it checks" table, from the registry (tests keep the README fresh)."""
    rows = ["| check | what fails it |", "|---|---|"]
    rows += [f"| {s.title} | {s.fails_when} |" for s in CHECKS.in_order()]
    return "\n".join(rows)
