"""One run spec: what a checked run is asked to do, assembled once for every entry point.

The ``drift`` command, the pytest plugin and the nightly each read the shared options
(drift/options.py: ``--preset --steps --seed --device --profile --rounding --pattern --drafts --flow
--update --kernel --mode --trace --loop --no-graph``; ``--drift-`` prefixed in pytest) into a
:class:`RunSpec`, and :meth:`RunSpec.config` turns it into the validated :class:`Config`. Every
rule that ties options together (``--loop`` needs ``--trace``; a trace fixes the model) is
written here, once, naming the options as the caller spells them (``prefix``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .config import Config, preset
from .devices import resolve_device
from .errors import ConfigError

# Spec field -> the Config field it sets (None: not a Config field).
CONFIG_FIELDS = {"steps": "steps", "seed": "seed", "device": "device", "rounding": "store_rounding",
                 "pattern": "pattern", "drafts": "drafts", "flow": "flow"}


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
    update: Optional[str] = None
    kernel: Optional[str] = None
    mode: str = "mtp"
    trace: Optional[str] = None
    loop: bool = False
    no_graph: bool = False
    layers: Optional[int] = None
    prefix: str = ""

    @classmethod
    def from_options(cls, get: Callable[[str], Any], prefix: str = "", **fixed: Any) -> "RunSpec":
        """The spec from an option getter: ``get("no-graph")`` returns that option's value, or
        None when the entry point does not have it; ``fixed`` overrides (e.g. ``layers``)."""
        values = {}
        for f in dataclasses.fields(cls):
            if f.name in ("prefix", "layers"):
                continue
            v = get(f.name.replace("_", "-"))
            if v is not None:
                values[f.name] = v
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
        if self.no_graph:
            changes["graph_mode"] = False
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
