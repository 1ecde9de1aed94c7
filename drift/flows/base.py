"""What a flow kind must provide (:class:`FlowKind`), the harness every kind's update gets as
``self`` (:class:`Harness`), and what the kinds that keep SGLang's MambaPool slots share
(:class:`MambaPoolFlow`). docs/extending.md ("A new flow kind") walks through a new one.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Optional

import numpy as np
import torch

from ..config import Config
from ..errors import ConfigError
from ..registry import Registry
from ..sim import kernels, naive
from ..sim.kernels import VerifyArgs, VerifyRule
from ..sim.pool import STALE
from .fold_model import FoldRounding
from .registry import FLOWS, flows_of, updates_of

F64 = torch.float64
# What code under test declares (its ``FLOW_OPTIONS`` attribute) when it reads the run's flow options
# from its harness or verify rule and so implements every choice (drift's renderings, the portable op).
EVERY_CHOICE = "*"


@dataclass(frozen=True)
class OptionChoice:
    """One choice of a flow kind's option (:attr:`FlowKind.OPTIONS`): ``name`` (what ``--<option>``
    takes; ``name:N`` when ``takes_arg``, N an integer >= 1), what it does, ``used_by`` (the engine
    and kernel that make this choice: file and version), ``default`` (the kind's default: the engine
    as modelled). A kind subclasses it with the numbers its code and the bound read."""

    name: str
    description: str
    used_by: str
    default: bool = False
    takes_arg: bool = False


@dataclass(frozen=True)
class DesignConfig:
    """One configuration of a kind's design space, as its trade-off table and the nightly run it:
    ``label``, the flow ``options`` it sets (name -> value; {} = the defaults), the checkpoint
    (state) dtype -- a profile's ``ssm_dtype`` -- and the store rounding (``rne``, or ``stochastic``
    declared), and a ``note`` on who ships it."""

    label: str
    options: Mapping[str, str]
    ssm_dtype: str = "bfloat16"
    store_rounding: str = "rne"
    note: str = ""


def default_choice(choices: Registry) -> OptionChoice:
    """The default of an option's choices (the one marked ``default``, else the first)."""
    return next((c for c in choices.values() if c.default), choices.values()[0])


def option_choice(options: Mapping[str, Registry], cfg: Config, option: str) -> tuple[OptionChoice, Optional[int]]:
    """The choice ``cfg`` makes for ``option`` of ``options`` (a kind's OPTIONS; its default when
    unset) and its argument (None unless the choice ``takes_arg``); ConfigError naming the option and
    the allowed values."""
    reg = options[option]
    value = cfg.flow_option(option)
    if value is None:
        return default_choice(reg), None
    name, colon, arg = value.partition(":")
    allowed = ", ".join(f"{n}:N" if reg[n].takes_arg else n for n in reg)
    if name not in reg or reg[name].takes_arg != bool(colon):
        raise ConfigError(f"flow option {option}={value!r} (--{option}) is not known; allowed: {allowed}")
    if not colon:
        return reg[name], None
    if not arg.isdigit() or int(arg) < 1:
        raise ConfigError(f"flow option {option}={value!r} (--{option}): {name}:N takes an integer N >= 1; "
                          f"allowed: {allowed}")
    return reg[name], int(arg)


def implements(declared: Any, option: str, choice: str) -> bool:
    """Whether code declaring ``FLOW_OPTIONS = declared`` implements ``choice`` of ``option``:
    :data:`EVERY_CHOICE`, or a mapping option -> the choice names it implements. Code declaring
    nothing implements the defaults alone (the engine's code, written for its own design)."""
    if declared == EVERY_CHOICE:
        return True
    return isinstance(declared, Mapping) and choice in tuple(declared.get(option, ()))


class Harness:
    """Base of the object the update under test receives as ``self`` (a kind's harness subclasses
    it): exactly what the engine's code reads, laid out as the deployment lays it out.

    ``ATTRIBUTES``: what an engine class's instance gets attached (a ``Class.method`` spec, drift/plug);
    ``PROVIDED`` / ``HOW_TO_PROVIDE``: named in the error of an attribute it lacks, whose ``obj``
    is the harness object read, so a caller can tell "drift lacks it" from a bug of the update;
    ``BUILT_FROM_POOL``: it holds only the pool's tensors (the sync scan rebuilds it over a virtual
    pool; a harness with buffers of its own is moved onto the virtual device instead).
    """

    ATTRIBUTES: ClassVar[tuple[str, ...]] = ()
    PROVIDED: ClassVar[str] = ""
    HOW_TO_PROVIDE: ClassVar[str] = ""
    BUILT_FROM_POOL: ClassVar[bool] = True

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"the update under test read self.{name}, which drift's harness does not provide; "
                             f"it provides {self.PROVIDED}. To provide it: {self.HOW_TO_PROVIDE}.",
                             name=name, obj=self)

    def objects(self) -> tuple:
        """The harness's own objects (itself and the objects under it): an attribute missing on one
        of these is something drift lacks, not a bug of the update."""
        return (self,)


class FlowKind(abc.ABC):
    """A flow kind: the state machinery a family of engines shares (docs/semantics.md §6), one
    package ``drift/flows/<kind>/`` registered in :data:`drift.flows.registry.FLOW_KINDS` under
    :attr:`name`; the flows of :data:`~drift.flows.registry.FLOWS` name it. An instance is one run's
    machinery on one device: ``pool``, ``harness`` (the update's ``self``) and ``rule`` (the verify
    op's read/write rule, passed to the kernel in every ``VerifyArgs``).

    What a kind provides:

    * ``name``; ``RULE``, its :class:`~drift.sim.kernels.VerifyRule` class (``RULE.name`` is what a
      kernel names to declare it implements it); ``POOL`` and ``HARNESS``, its pool and harness
      classes (``HARNESS(pool)``); ``SETTINGS``, the flow-entry settings it reads (name -> meaning);
      ``tracks``, whether it keeps prefix-cache snapshots (the tracked-snapshot check reads them);
    * :meth:`accepts` (may this verify kernel run here, and why not) and :meth:`validate` (the
      kind's own rules on a config);
    * its built-in updates: :data:`~drift.flows.registry.UPDATES` entries whose ``kinds`` name it,
      one of them the default (:meth:`updates`, default first);
    * :meth:`naive`: its verify rule in float64 loops, the reference its tests hold the portable op to;
    * the per-run members below (abstract), each documented where it is declared.
    """

    name: ClassVar[str] = ""
    RULE: ClassVar[type]
    POOL: ClassVar[type]
    HARNESS: ClassVar[type]
    SETTINGS: ClassVar[dict[str, str]] = {}
    # The kind's own options (``Config.flow_options``; ``--<name>`` on the command line, generated):
    # option name -> a Registry of its choices (:class:`OptionChoice` entries, one the default).
    OPTIONS: ClassVar[dict[str, Registry]] = {}
    OPTION_TITLES: ClassVar[dict[str, str]] = {}  # option name -> what it chooses (its --help)
    # The configurations of the kind's design space its trade-off table shows (drift/jobs/teeth.py),
    # and those the nightly matrix runs by default: the ones whose trend a long horizon must show.
    TRADEOFF_DESIGNS: ClassVar[tuple[DesignConfig, ...]] = ()
    NIGHTLY_DESIGNS: ClassVar[tuple[DesignConfig, ...]] = ()
    tracks: ClassVar[bool] = True  # it keeps prefix-cache snapshots (:meth:`tracked_snapshot`); False: n/a

    def __init__(self, cfg: Config, device: torch.device):
        self.cfg, self.device = cfg, device
        flow = FLOWS[cfg.flow] if cfg.flow in FLOWS else None
        self.settings: Mapping[str, Any] = flow.settings if flow is not None and flow.kind == self.name else {}
        self.pool = self.POOL(cfg, device)
        self.harness = self.HARNESS(self.pool)
        self.rule: VerifyRule = self.make_rule()

    # ------------------------------------------------------------ what the kind says
    def make_rule(self) -> VerifyRule:
        """This run's verify rule (``RULE()``; a rule that reads the pool overrides)."""
        return self.RULE()

    @classmethod
    def accepts(cls, kernel) -> tuple[bool, str]:
        """Whether ``kernel`` (a loaded kernel, drift/plug/loader.py: ``Kernel``) may verify in this
        kind, and why not: the kernel answers for itself which rules it implements."""
        return kernel.verify(cls.RULE)

    @classmethod
    def validate(cls, cfg: Config) -> None:
        """The kind's own rules on ``cfg`` (ConfigError naming what to change); none by default."""

    # ------------------------------------------------------------ options
    @classmethod
    def default_choice(cls, option: str) -> OptionChoice:
        return default_choice(cls.OPTIONS[option])

    @classmethod
    def option_choice(cls, cfg: Config, option: str) -> tuple[OptionChoice, Optional[int]]:
        """The choice ``cfg`` makes for ``option`` (:func:`option_choice`)."""
        return option_choice(cls.OPTIONS, cfg, option)

    @classmethod
    def validate_options(cls, cfg: Config) -> None:
        """Every option ``cfg`` sets is one of this kind's, with a known choice (ConfigError naming
        the kinds that read an option this one does not, and the allowed values)."""
        from .registry import FLOW_KINDS

        for option, _ in cfg.flow_options:
            if option not in cls.OPTIONS:
                readers = [k for k in FLOW_KINDS if option in FLOW_KINDS[k].OPTIONS]
                where = (f"it is read under --flow {', '.join(f for k in readers for f in flows_of(k))}" if readers
                         else "no flow kind reads it")
                mine = ", ".join(cls.OPTIONS) or "none"
                raise ConfigError(f"flow option {option} (--{option}) does not apply to --flow {cfg.flow} (kind "
                                  f"{cls.name}, whose options are: {mine}); {where}")
            cls.option_choice(cfg, option)

    @classmethod
    def accepts_design(cls, cfg: Config, what: str, declared: Any) -> tuple[bool, str]:
        """Whether code under test declaring ``FLOW_OPTIONS = declared`` (:func:`implements`)
        implements every option ``cfg`` sets away from its default, and why not; ``what`` names
        the code (the update, the verify kernel)."""
        missing = [f"{option}={value}" for option, value in cfg.flow_options
                   if not cls.option_choice(cfg, option)[0].default
                   and not implements(declared, option, cls.option_choice(cfg, option)[0].name)]
        if not missing:
            return True, ""
        how = ("it declares no FLOW_OPTIONS, so it is taken to implement the engine's own design, the kind's "
               "defaults" if declared is None else f"it declares FLOW_OPTIONS = {declared!r}")
        return False, (f"{what} does not implement {', '.join(missing)} of flow kind {cls.name} ({how}): drop "
                       f"{' and '.join('--' + m.split('=')[0] for m in missing)} to run it as it ships, or give it "
                       "FLOW_OPTIONS naming the choices it implements (docs/extending.md)")

    @classmethod
    def fold_rounding(cls, cfg: Config) -> Optional[FoldRounding]:
        """What the drift bound reads of ``cfg``'s fold design (drift/flows/fold_model.py), None for
        a kind whose commit folds nothing (a copy or bookkeeping)."""
        return None

    @classmethod
    def updates(cls) -> tuple[str, ...]:
        """The built-in updates written for this kind, its default first."""
        return updates_of(cls.name)

    # drift bench's naive step (drift/jobs/bench.py): the kind's default update as per-request loops,
    # ``naive_update(flow, last, track, steps)`` (None: the kind is not benchmarked), and what a step
    # must move at the least in its state machinery (:meth:`bench_state_bytes`, described by STATE_BYTES).
    naive_update: ClassVar[Optional[Callable]] = None
    STATE_BYTES: ClassVar[str] = ""

    def naive_conv(self, x: torch.Tensor, weight: torch.Tensor, drafts=None) -> torch.Tensor:
        """:meth:`conv_verify` in loops (per layer, row, token and tap), moving the conv windows as it
        does; mix_qkv float64 holding bf16 values ``[L, N, D, C]`` (drift bench's naive step)."""
        raise NotImplementedError(f"flow kind {self.name!r} has no naive conv (drift bench does not time it)")

    # The bytes a design moves per decode step, modelled from the kernels' own storage (the trade-off
    # table of a kind with TRADEOFF_DESIGNS): :meth:`design_traffic`, described by DESIGN_TRAFFIC.
    DESIGN_TRAFFIC: ClassVar[str] = ""

    @classmethod
    def design_traffic(cls, cfg: Config, accept: np.ndarray) -> dict[str, float]:
        """Bytes per decode step (summed over layers and active requests) of ``cfg``'s design, by part,
        over the accept lengths ``accept`` (host int ``[steps, R]``, the bonus token included)."""
        raise NotImplementedError(f"flow kind {cls.name!r} has no design traffic model")

    @classmethod
    def bench_state_bytes(cls, cfg: Config) -> dict[str, int]:
        """The fewest bytes of states (and records) one decode step of ``cfg`` must read and write,
        by part (:data:`STATE_BYTES`); drift bench's bandwidth ratio counts them."""
        raise NotImplementedError(f"flow kind {cls.name!r} has no bytes model (drift bench does not time it)")

    @staticmethod
    @abc.abstractmethod
    def naive(args: VerifyArgs, dtype: torch.dtype = F64, store=None) -> torch.Tensor:
        """The verify under this kind's rule in loops (per layer, row, head, token), in ``dtype``: the
        states it stores mapped through ``store`` (default: a cast to the destination's dtype);
        returns the outputs ``[L, B, S, HV, V]`` in ``dtype``."""

    # ------------------------------------------------------------ one decode step
    @abc.abstractmethod
    def verify_args(self, mix, beta, g, rounding: str, key: int, drafts=None, gate=None) -> VerifyArgs:
        """The verify op's arguments this step, ``rule`` included: mix bf16 ``[L, N, D, C]``, beta bf16
        and g fp32 ``[L, N, D, HV]``; drafts int ``[N]`` (tokens each row verifies; None: all D);
        gate (a, A_log, dt_bias), the raw gate inputs."""

    @abc.abstractmethod
    def after_verify(self, last: torch.Tensor) -> None:
        """What the kind keeps of this step's accepted steps (int64 ``[N]``, -1 padded) before the update."""

    @abc.abstractmethod
    def conv_verify(self, x: torch.Tensor, weight: torch.Tensor, drafts=None) -> torch.Tensor:
        """The verify conv of x ``[L, N, D, C]`` over the kind's conv state: mix_qkv bf16 ``[L, N, D, C]``."""

    @abc.abstractmethod
    def load_start(self, stored: torch.Tensor, window: torch.Tensor) -> None:
        """The starting state as prefill leaves it: ``stored`` ``[L, R, HV, V, K]`` in the state dtype,
        ``window`` ``[L, R, Kc-1, C]`` the last Kc-1 conv inputs."""

    @abc.abstractmethod
    def touched(self, track_host: np.ndarray, drafts_host: Optional[np.ndarray] = None) -> np.ndarray:
        """``[count, slots]`` bool: the slots the update may write at each step (``track_host`` ``[count,
        R]`` host int, -1 untracked; ``drafts_host`` the tokens each row verifies)."""

    @abc.abstractmethod
    def committed_states(self) -> torch.Tensor:
        """``[L, R, HV, V, K]`` in the state dtype: the state each request's next verify starts from."""

    @abc.abstractmethod
    def committed_windows(self) -> torch.Tensor:
        """``[L, R, Kc-1, C]``: the conv inputs each request's next verify reads."""

    @abc.abstractmethod
    def tracked_snapshot(self, track: np.ndarray) -> tuple:
        """What the kind's tracked slots hold for the rows tracked this step (``track [R]`` host int,
        -1 none): ``(rows [n], states [L, n, HV, V, K], windows [L, n, Kc-1, C], bit mismatches [n]
        against the state the snapshot must equal bit for bit, 0 where there is none to compare)``."""

    @abc.abstractmethod
    def buffers(self) -> list[torch.Tensor]:
        """The persistent tensors a decode step writes besides the pool's (a captured step replays them)."""

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """The kind's own state between chunks (CPU tensors), for a checkpoint."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""


class MambaPoolFlow(FlowKind):
    """What the kinds that keep SGLang's MambaPool slots share (copy-commit, kernel-commit): one
    committed slot per request and one track slot, the NPU extended conv window rolled by the verify
    conv and rolled back by the update (``drift.sim.pool.StatePool``, docs/semantics.md §3-§4)."""

    def conv_verify(self, x: torch.Tensor, weight: torch.Tensor, drafts=None) -> torch.Tensor:
        return kernels.conv_verify(self.pool.conv, self.pool.row_slots, x, weight)

    def naive_conv(self, x: torch.Tensor, weight: torch.Tensor, drafts=None) -> torch.Tensor:
        return naive.conv_verify(self.pool.conv, self.pool.row_slots.tolist(), x, weight)

    def load_start(self, stored: torch.Tensor, window: torch.Tensor) -> None:
        """Stored once in the state dtype, the conv window at the end of the buffer, the first D-1
        rows stale (NaN: a read of them shows); the track slots NaN until a snapshot is taken."""
        cfg, pool = self.cfg, self.pool
        slots = pool.active_slots
        pool.states[:, slots] = stored
        W, Km1 = cfg.conv_window, cfg.conv_kernel - 1
        buf = torch.full((cfg.num_layers, cfg.num_requests, W, cfg.conv_channels), STALE,
                         dtype=pool.conv.dtype, device=pool.device)
        buf[:, :, W - Km1:] = window.to(pool.device, pool.conv.dtype)
        pool.conv[:, slots] = buf
        pool.temporal[:, pool.row_track_slots[: cfg.num_requests]] = STALE
        pool.conv[:, pool.row_track_slots[: cfg.num_requests]] = STALE

    def touched(self, track_host: np.ndarray, drafts_host: Optional[np.ndarray] = None) -> np.ndarray:
        """The request slots at every step, and the track slot of a row tracked that step."""
        pool = self.pool
        t = np.zeros((track_host.shape[0], pool.temporal.shape[1]), dtype=bool)
        t[:, pool.request_slots] = True
        rows, idx = np.nonzero(track_host >= 0)
        t[rows, pool.track_slots[idx]] = True
        return t

    def committed_states(self) -> torch.Tensor:
        return self.pool.states[:, self.pool.active_slots]

    def committed_windows(self) -> torch.Tensor:
        cfg, pool = self.cfg, self.pool
        return pool.conv[:, pool.active_slots, cfg.conv_window - (cfg.conv_kernel - 1):]

    def track_windows(self, rows_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The track slots of batch rows ``rows_t`` (int64 ``[n]``) and the Kc-1 conv inputs they hold."""
        cfg, pool = self.cfg, self.pool
        tslots = pool.row_track_slots[rows_t]
        return tslots, pool.conv[:, tslots, cfg.conv_window - (cfg.conv_kernel - 1):].clone()
