"""The state-flow registries (docs/semantics.md §6), each the one place its facts live:

* :data:`FLOW_KINDS`: the flow kinds, each a :class:`drift.flows.base.FlowKind` subclass (one
  package under ``drift/flows/``: its pool, harness, verify rule, naive reference, validation);
* :data:`FLOWS`: the flows, one per engine modelled (:class:`Flow`: engine, version, files, kind);
  an entry naming an unknown kind, or settings its kind does not read, is refused when registered;
* :data:`UPDATES`: the built-in updates (:class:`BuiltinUpdate`), each declaring the kinds it is
  written for (the harness it reads) and whether it is their default.

And the lookups every entry point uses: :func:`check` (a config's flow kind, its rules checked),
:func:`state_flow` (a run's machinery), :func:`flows_of`, :func:`updates_of`, :func:`default_update`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from ..config import Config
from ..errors import ConfigError
from ..registry import Registry


@dataclass(frozen=True)
class Flow:
    """How one engine keeps MTP state between verify steps (docs/semantics.md §6): ``engine`` the
    engine and version modelled (or why none runs it); ``files`` the shipped files the model is read
    from; ``kind`` its state machinery (:data:`FLOW_KINDS`); ``ragged`` whether the engine verifies rows
    with fewer than D drafts (``--drafts ragged``); ``settings`` what its kind reads of it
    (``FlowKind.SETTINGS`` names them)."""

    name: str
    description: str
    engine: str
    files: tuple[str, ...]
    kind: str
    ragged: bool = False
    settings: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BuiltinUpdate:
    """A built-in update under test: ``fn`` called as every update is; ``kinds`` the flow kinds it is
    written for (their harness is what it reads); ``default``: the update a run of those kinds puts
    under test when none is named."""

    name: str
    description: str
    fn: Callable
    kinds: tuple[str, ...]
    default: bool = False


class KindRegistry(Registry[type]):
    """:data:`FLOW_KINDS`: a kind is registered under its own ``name``, complete (no abstract member
    left), or refused naming what it lacks."""

    def register(self, name: str, entry: type) -> type:
        if not inspect.isclass(entry) or getattr(entry, "name", None) != name:
            raise ConfigError(f"flow kind {name!r}: register a FlowKind subclass whose name is {name!r} "
                              f"(got {entry!r}); see docs/extending.md, 'A new flow kind'")
        missing = sorted(getattr(entry, "__abstractmethods__", ()))
        if missing:
            raise ConfigError(f"flow kind {name!r} does not implement {', '.join(missing)} "
                              "(drift.flows.base.FlowKind lists what a kind provides)")
        return super().register(name, entry)


class FlowRegistry(Registry[Flow]):
    """:data:`FLOWS`: a flow's kind must be registered, its settings read by that kind, and ragged
    drafts taken only where the kind's verify rule is ragged."""

    def register(self, name: str, entry: Flow) -> Flow:
        if entry.kind not in FLOW_KINDS:
            raise ConfigError(f"flow {name!r} names kind {entry.kind!r}, which is not a registered flow kind; "
                              f"kinds: {', '.join(FLOW_KINDS)}")
        kind = FLOW_KINDS[entry.kind]
        unknown = sorted(set(entry.settings) - set(kind.SETTINGS))
        if unknown:
            raise ConfigError(f"flow {name!r} sets {', '.join(unknown)}, which kind {entry.kind!r} does not read; "
                              f"its settings: {', '.join(kind.SETTINGS) or 'none'}")
        if entry.ragged and not kind.RULE.ragged:
            raise ConfigError(f"flow {name!r} takes ragged drafts, but kind {entry.kind!r} verifies by the "
                              f"{kind.RULE.name} rule, which runs every row's D tokens")
        return super().register(name, entry)


class UpdateRegistry(Registry[BuiltinUpdate]):
    """:data:`UPDATES`: an update's kinds must be registered, with at most one default each."""

    def register(self, name: str, entry: BuiltinUpdate) -> BuiltinUpdate:
        unknown = [k for k in entry.kinds if k not in FLOW_KINDS]
        if not entry.kinds or unknown:
            raise ConfigError(f"update {name!r} must name the flow kinds it is written for; "
                              f"{'unknown: ' + ', '.join(unknown) if unknown else 'none given'} (kinds: "
                              f"{', '.join(FLOW_KINDS)})")
        taken = [k for k in entry.kinds if entry.default and _default_of(k)]
        if taken:
            raise ConfigError(f"update {name!r} is the default of {', '.join(taken)}, which already has one "
                              f"({', '.join(_default_of(k) for k in taken)})")
        return super().register(name, entry)


FLOW_KINDS: KindRegistry = KindRegistry("flow kind")
FLOWS: FlowRegistry = FlowRegistry("flow")
UPDATES: UpdateRegistry = UpdateRegistry("update")
# Sequential (non-MTP) decode keeps one state per request, however the engine keeps MTP state:
# the plain slot pool of SGLang's MambaPool, with its conv window.
SEQUENTIAL_KIND = "copy-commit"


def _default_of(kind: str) -> str:
    return next((n for n, u in UPDATES.items() if kind in u.kinds and u.default), "")


def flows_of(kind: str) -> tuple[str, ...]:
    """The flows of kind ``kind``, in registry order."""
    return tuple(n for n, f in FLOWS.items() if f.kind == kind)


def updates_of(kind: str) -> tuple[str, ...]:
    """The built-in updates written for kind ``kind``: its default first, then registry order."""
    mine = [n for n, u in UPDATES.items() if kind in u.kinds]
    return tuple(sorted(mine, key=lambda n: not UPDATES[n].default))


def default_update(kind: str) -> str:
    """The built-in update a run of kind ``kind`` puts under test when none is named (ConfigError
    when the kind registered none)."""
    name = _default_of(kind)
    if not name:
        raise ConfigError(f"flow kind {kind!r} has no default update (a BuiltinUpdate with default=True in "
                          "drift.flows.UPDATES); pass --update")
    return name


def check(cfg: Config) -> type:
    """The flow kind of ``cfg.flow`` (its :class:`drift.flows.base.FlowKind` subclass), after the
    flow's and the kind's rules for ``cfg``: the flow is registered, ragged drafts only where the
    engine verifies varlen, the flow options the kind reads (``FlowKind.OPTIONS``) and the kind's own
    ``validate``. ConfigError names what to change."""
    flow = FLOWS[cfg.flow]
    if cfg.drafts == "ragged" and not flow.ragged:
        raise ConfigError(f"drafts='ragged' under flow={cfg.flow!r}: that flow verifies every row's D draft tokens "
                          f"(modelled on: {flow.engine}); allowed with ragged drafts: "
                          f"{', '.join(f for f in FLOWS if FLOWS[f].ragged)}")
    kind = FLOW_KINDS[flow.kind]
    if cfg.serving.churn and not kind.SERVES:
        raise ConfigError(f"lifecycle={cfg.lifecycle!r} under flow={cfg.flow!r}: kind {kind.name!r} does not model "
                          "requests that come and go; allowed: lifecycle='fixed', or a flow whose kind does ("
                          + ", ".join(f for f in FLOWS if FLOW_KINDS[FLOWS[f].kind].SERVES) + ")")
    kind.validate_options(cfg)
    kind.validate(cfg)
    return kind


def state_flow(cfg: Config, device: torch.device, mode: str = "mtp"):
    """One run's state machinery for ``cfg`` on ``device``: an instance of its flow kind (its pool,
    harness and verify rule); sequential decode gets the plain slot pool (:data:`SEQUENTIAL_KIND`)."""
    kind = check(cfg) if mode == "mtp" else FLOW_KINDS[SEQUENTIAL_KIND]
    return kind(cfg, device)
