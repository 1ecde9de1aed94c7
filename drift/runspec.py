"""One run spec: what a checked run is asked to do, assembled and resolved once for every entry point.

The ``drift`` command, the pytest plugin and the nightly each read the shared options
(drift/options.py: ``--preset --steps --seed --device --profile --rounding --pattern --drafts --flow
--draft-tokens --key-heads --value-heads --lifecycle --track-interval --update --update-factory --kernel --mode --trace
--loop --no-graph``; ``--drift-`` prefixed in pytest) into a :class:`RunSpec`; :meth:`RunSpec.config` turns
it into the validated :class:`Config` and :meth:`RunSpec.resolve` into a :class:`Resolved` run (the
code under test loaded and accepted by the config's flow kind), which is all the layers below take.
Every rule that ties options together
(``--loop`` needs ``--trace``; a trace fixes the model) is written here, once, naming the options
as the caller spells them (``prefix``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .config import Config, flow_options, preset, spread_decays
from .devices import resolve_device
from .errors import ConfigError, LoadError
from .flows.registry import FLOW_KINDS, FLOWS, check, default_update, flows_of
from .lifecycles import DEFAULT_LIFECYCLE
from .plug.loader import Kernel, Update, entry_flow_options, load_kernel, load_update

# Spec field -> the Config field it sets (None: not a Config field).
CONFIG_FIELDS = {"steps": "steps", "seed": "seed", "device": "device", "rounding": "store_rounding",
                 "pattern": "pattern", "drafts": "drafts", "flow": "flow", "lifecycle": "lifecycle",
                 "track_interval": "track_interval"}


@dataclass(frozen=True)
class RunSpec:
    """A run as asked: ``None`` means "the preset's" (or the default named in drift/options.py).

    ``layers`` cuts the preset (or trace) to its first N GDN layers (bench, nightly); ``prefix`` is
    how the caller spells options in messages ("" for ``drift``, "drift-" for pytest).
    """

    preset: str = "ci-small"
    steps: Optional[int] = None
    seed: Optional[int] = None
    device: str = "cpu"
    profile: Optional[str] = None
    rounding: Optional[str] = None
    pattern: Optional[str] = None
    drafts: Optional[str] = None
    flow: Optional[str] = None
    draft_tokens: Optional[int] = None
    key_heads: Optional[int] = None
    value_heads: Optional[int] = None
    lifecycle: Optional[str] = None  # None: drift.lifecycles.DEFAULT_LIFECYCLE (fixed with a trace)
    track_interval: Optional[int] = None
    update: Optional[str] = None
    update_factory: Optional[str] = None
    kernel: Optional[str] = None
    mode: str = "mtp"
    trace: Optional[str] = None
    loop: bool = False
    no_graph: bool = False
    layers: Optional[int] = None
    flow_options: tuple[tuple[str, str], ...] = ()  # Config.flow_options: each kind option given (--<name>)
    prefix: str = ""

    @classmethod
    def from_options(cls, get: Callable[[str], Any], prefix: str = "", **fixed: Any) -> "RunSpec":
        """The spec from an option getter: ``get("no-graph")`` returns that option's value, or
        None when the entry point does not have it; ``fixed`` overrides (e.g. ``layers``). Each flow
        kind's options (``--ring-records`` ...) given become ``flow_options``."""
        values = {}
        for f in dataclasses.fields(cls):
            if f.name in ("prefix", "layers", "flow_options"):
                continue
            v = get(f.name.replace("_", "-"))
            if v is not None:
                values[f.name] = v
        names = dict.fromkeys(o for kind in FLOW_KINDS.values() for o in kind.OPTIONS)
        given = {o: get(o) for o in names}
        values["flow_options"] = flow_options({o: v for o, v in given.items() if v is not None})
        return cls(**{**values, **fixed, "prefix": prefix})

    def opt(self, name: str) -> str:
        """The option as the caller spells it: ``--loop`` or ``--drift-loop``."""
        return f"--{self.prefix}{name}"

    def config(self) -> Config:
        """The validated Config: the preset, its profile, the options given, the trace (read and
        validated here, before any work), the layer cut; the device resolved (DeviceUnavailable
        when absent). ConfigError names the option to change."""
        cfg = preset(self.preset)
        if self.profile:
            cfg = cfg.with_profile(self.profile)
        changes = {field: getattr(self, name) for name, field in CONFIG_FIELDS.items()
                   if getattr(self, name) is not None}
        if self.lifecycle is None:  # a trace records one sequence per request: the fixed batch
            changes["lifecycle"] = "fixed" if self.trace else DEFAULT_LIFECYCLE
        if self.no_graph:
            changes["graph_mode"] = False
        if self.flow_options:
            changes["flow_options"] = flow_options(dict(self.flow_options))
        changes.update(self._shape_changes(cfg))
        if self.loop and not self.trace:
            raise ConfigError(f"{self.opt('loop')} needs {self.opt('trace')} FILE: it wraps the positions of a "
                              "replayed trace")
        if self.trace:
            from .sim.stream import load_trace

            steps = changes.pop("steps", None)
            cfg = cfg.replace(**changes) if changes else cfg
            cfg = Config.from_trace(load_trace(self.trace), cfg, steps=steps, loop=self.loop)
        elif changes:
            cfg = cfg.replace(**changes)
        if self.layers is not None and self.layers < cfg.num_layers:
            cfg = cfg.replace(num_layers=self.layers)
        resolve_device(cfg.device)
        return cfg

    def _shape_changes(self, cfg: Config) -> dict:
        """The Config fields ``--draft-tokens`` / ``--key-heads`` / ``--value-heads`` set. D takes the
        preset's acceptance rates of the first D - 1 draft positions; other value heads take per-head
        decays spread as :func:`drift.config.spread_decays` does. ConfigError names the option."""
        out: dict = {}
        if self.trace and (self.key_heads is not None or self.value_heads is not None):
            raise ConfigError(f"{self.opt('key-heads')} / {self.opt('value-heads')} with {self.opt('trace')}: "
                              "the trace fixes the model's heads; drop them, or drop the trace for a synthetic stream")
        D = self.draft_tokens
        if D is not None:
            if not 2 <= D <= len(cfg.acceptance) + 1:
                raise ConfigError(f"{self.opt('draft-tokens')} {D} is invalid for preset {cfg.name}; allowed: 2 .. "
                                  f"{len(cfg.acceptance) + 1} (the preset has acceptance rates for "
                                  f"{len(cfg.acceptance)} draft positions; MTP verifies at least one draft)")
            out.update(num_draft_tokens=D, acceptance=tuple(cfg.acceptance[:D - 1]))
        HK = cfg.num_k_heads if self.key_heads is None else self.key_heads
        HV = cfg.num_v_heads if self.value_heads is None else self.value_heads
        if (HK, HV) != (cfg.num_k_heads, cfg.num_v_heads):
            if HV % HK:
                raise ConfigError(f"{self.opt('value-heads')} {HV} is not a multiple of {self.opt('key-heads')} {HK} "
                                  "(preset " + cfg.name + f": {cfg.num_k_heads} key, {cfg.num_v_heads} value heads); "
                                  "allowed: value heads = m * key heads, as the models' linear attention has them")
            out.update(num_k_heads=HK, num_v_heads=HV)
            if HV != cfg.num_v_heads:
                out["decays"] = spread_decays(cfg.decays, HV)
        return out

    def resolve(self) -> "Resolved":
        """The run: :meth:`config` with the update and kernel loaded and accepted by its flow kind
        (:func:`resolve`; without ``flow`` an update written for another kind runs in its own flow)."""
        cfg, update = self.config(), self.update
        if self.update_factory:  # the Class.method's self built by the user's make(harness)
            update = load_update(update if update is not None else default_update(check(cfg).name),
                                 factory=self.update_factory, opt=self.opt)
        return resolve(cfg, update, self.kernel, self.mode, choose_flow=self.flow is None, opt=self.opt,
                       lifecycle_default=self.lifecycle is None)


MODES = ("mtp", "sequential")


@dataclass(frozen=True)
class Resolved:
    """A run ready to go, resolved once at the boundary (:meth:`RunSpec.resolve`, :func:`resolve`): the
    validated config, the update and the verify kernel loaded and accepted by the config's flow kind,
    and the decode mode. The simulation, the runner, the sync scan, the cost model, the nightly and
    the plugin take only these."""

    cfg: Config
    update: Update
    kernel: Kernel
    mode: str = "mtp"

    @property
    def kind(self) -> type:
        """The flow kind of ``cfg.flow`` (a :class:`drift.flows.base.FlowKind` subclass)."""
        return FLOW_KINDS[FLOWS[self.cfg.flow].kind]

    def replace(self, **changes: Any) -> "Resolved":
        """The same code under test on ``cfg.replace(**changes)``, checked again (a changed flow must
        still take the update and the kernel)."""
        return resolve(self.cfg.replace(**changes), self.update, self.kernel, self.mode)


def resolve(cfg: Config, update: Any = None, kernel: Any = None, mode: str = "mtp", choose_flow: bool = False,
            opt: Callable[[str], str] = lambda name: f"--{name}", lifecycle_default: bool = False) -> Resolved:
    """``cfg`` with the code under test loaded (drift/plug/loader.py) and checked against its flow kind:
    the flow and the kind's rules (:func:`drift.flows.registry.check`), the update written for that
    kind (None: the kind's default), the kernel accepted by it (``FlowKind.accepts``). With
    ``choose_flow`` (the run named no flow) an update written for other kinds picks its own flow: a
    mutant's, else the first of its first kind. LoadError / ConfigError (exit 2) name what to pass;
    ``opt(name)`` spells an option as the caller does. ``lifecycle_default``: the lifecycle was not asked
    for, so a flow whose kind models no churn runs the fixed batch (an asked-for one is refused there)."""
    if mode not in MODES:
        raise ConfigError(f"mode={mode!r} is not known; allowed: {', '.join(MODES)}")
    upd = None if update is None else load_update(update)
    if choose_flow and upd is not None and upd.kinds and cfg.flow in FLOWS and FLOWS[cfg.flow].kind not in upd.kinds:
        cfg = cfg.replace(flow=upd.flow or flows_of(upd.kinds[0])[0])
    if lifecycle_default and cfg.serving.churn and cfg.flow in FLOWS and not FLOW_KINDS[FLOWS[cfg.flow].kind].SERVES:
        cfg = cfg.replace(lifecycle="fixed")  # the default lifecycle where the flow's kind models no other
    kind = check(cfg)
    if upd is None:
        upd = load_update(default_update(kind.name))
    if upd.kinds and kind.name not in upd.kinds:
        mine = [f for k in upd.kinds for f in flows_of(k)]
        raise LoadError(f"update {upd.spec} is written for the {' and '.join(upd.kinds)} flow kind "
                        f"({', '.join(mine)}), not for {opt('flow')} {cfg.flow} ({kind.name}): pass {opt('flow')} "
                        f"{upd.flow or mine[0]}, or an update written for {kind.name} ({', '.join(kind.updates())})")
    known, declared = entry_flow_options(kernel)
    if mode == "mtp" and known:  # a built-in kernel's design is known before it loads (the engine absent)
        ok, why = kind.accepts_design(cfg, f"the verify kernel {kernel}", declared)
        if not ok:
            raise LoadError(f"{opt('flow')} {cfg.flow} ({kind.name}): {why}")
    k = load_kernel(kernel)
    if mode == "mtp":
        ok, why = kind.accepts(k)
        if not ok:
            raise LoadError(f"{opt('flow')} {cfg.flow} ({kind.name}): {why}")
        for what, declared in ((f"the update {upd.spec}", upd.flow_options),
                               (f"the verify kernel {k.name}", k.flow_options)):
            ok, why = kind.accepts_design(cfg, what, declared)
            if not ok:
                raise LoadError(f"{opt('flow')} {cfg.flow} ({kind.name}): {why}")
    return Resolved(cfg, upd, k, mode)
