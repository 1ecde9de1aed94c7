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
from ..dtypes import as_bits
from ..errors import ConfigError
from ..registry import Registry
from ..sim import kernels, naive
from ..sim.kernels import VerifyArgs, VerifyRule
from ..sim.pool import STALE
from .fold_model import FoldRounding
from .registry import FLOWS, flows_of, updates_of
from .slots import Held, MambaSlots

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
    # A churning lifecycle (drift/lifecycles.py): whether the kind models it (:meth:`admit`, :meth:`release`,
    # :meth:`arrange`), and the engine's batch row order (drift.sim.serving.BATCH_ORDERS).
    SERVES: ClassVar[bool] = False
    BATCH_ORDER: ClassVar[str] = "append"

    def __init__(self, cfg: Config, device: torch.device):
        self.cfg, self.device = cfg, device
        flow = FLOWS[cfg.flow] if cfg.flow in FLOWS else None
        self.settings: Mapping[str, Any] = flow.settings if flow is not None and flow.kind == self.name else {}
        self.pool = self.POOL(cfg, device)
        self.harness = self.HARNESS(self.pool)
        self.rule: VerifyRule = self.make_rule()
        # Each lane's batch row (the fixed batch: lane r is row r); a churning lifecycle rewrites it.
        self.lane_rows_host = np.arange(cfg.num_requests, dtype=np.int64)
        self.rows = cfg.num_rows  # the rows passed this step (the graph bucket under churn)

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

    def unreadable_update(self) -> str:
        """What the update under test just left that the engine's next verify cannot read (an index past
        the blocks it may address), as a phrase ("left ..."); "" when nothing. The simulation fails the
        run on it (UpdateRaised, exit 1: the update's regression), before anything reads the index."""
        return ""

    def kernel_slots(self) -> np.ndarray:
        """int64 ``[n]``: the slots whose committed state the verify kernel writes by the kind's rule.
        The slot guard (drift/simulate.py: SlotGuard) holds every other slot's state, and every slot's
        conv window (the conv verify runs before the kernel), bit-identical across the kernel's call.
        None here: a kind whose verify stores its results elsewhere (a scratch, a ring) overrides nothing."""
        return np.zeros(0, np.int64)

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
        against the state the snapshot must equal bit for bit, 0 where there is none to compare[,
        reference])``: ``reference`` (optional) None, or what :meth:`reference_mismatches` counts more
        mismatches from where the comparison runs (new tensors, which later steps do not change)."""

    def reference_mismatches(self, states: torch.Tensor, reference) -> torch.Tensor:
        """Per snapshot, its elements outside the exact reference :meth:`tracked_snapshot` gathered for
        ``states`` (int64 ``[n]``): for a kind whose snapshots have one beyond a bit-for-bit twin."""
        raise NotImplementedError(f"flow kind {self.name!r} gathers no reference for its tracked snapshots")

    # ------------------------------------------------------------ a churning lifecycle
    def start_serving(self, bookkeeping=None, extend=None) -> None:
        """Begin a churning lifecycle: every slot free, no lane running (``bookkeeping``: the engine's
        bookkeeping class to run instead of the kind's own, a serving mutant's; ``extend``: drift's model of
        the engine's prefill, see :class:`MambaPoolFlow`)."""
        raise NotImplementedError(f"flow kind {self.name!r} does not model a churning lifecycle")

    def admit(self, lane: int, request: int, start) -> None:
        """Request ``request`` starts in ``lane`` (``start``: a :class:`drift.sim.serving.Start`): the
        engine's bookkeeping gives it what it holds and restores a prefix hit's snapshot (request
        ``start.source``'s, which the prefix cache keeps), and the engine's extend stores the state after
        its tokens ``start.p0 .. start.p1 - 1`` from what its slot then holds."""
        raise NotImplementedError

    def release(self, lane: int, request: int, finished: bool, keep_snapshot: bool) -> None:
        """Request ``request`` leaves ``lane`` (finished, or preempted): the engine's bookkeeping frees what
        it held; with ``keep_snapshot`` its last tracked snapshot stays in the prefix cache (which keeps
        the lifecycle's ``prefix_cache`` newest, freeing the oldest)."""
        raise NotImplementedError

    def arrange(self, lanes_of_rows: np.ndarray, scheduled: Optional[np.ndarray] = None) -> None:
        """The batch of the next step: ``lanes_of_rows [B]`` the lane in each row (-1 padded), ``B`` the
        graph bucket; ``scheduled [R]`` the tokens each lane's request runs in it (the root token and its
        drafts; None: D); the engine's builder fills the step's index buffers from it."""
        raise NotImplementedError

    def cached_snapshot(self, request: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The snapshot the prefix cache keeps for finished request ``request``: state ``[L, HV, V, K]``
        (state dtype) and conv inputs ``[L, Kc-1, C]``."""
        raise NotImplementedError

    def start_slot(self, lane: int) -> int:
        """The slot (or block) ``lane``'s request's next verify reads its state from (for messages)."""
        raise NotImplementedError

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
        return kernels.conv_verify(self.pool.conv, self.pool.row_slots[: x.shape[1]], x, weight)

    def naive_conv(self, x: torch.Tensor, weight: torch.Tensor, drafts=None) -> torch.Tensor:
        return naive.conv_verify(self.pool.conv, self.pool.row_slots[: x.shape[1]].tolist(), x, weight)

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
        """The request slots at every step, and the track slot of a row tracked that step (under churn:
        the slots of the requests running now, and the track slot of a lane tracked)."""
        pool = self.pool
        t = np.zeros((track_host.shape[0], pool.temporal.shape[1]), dtype=bool)
        if self.cfg.serving.churn:
            live = self.lane_request >= 0
            t[:, self.lane_slot[live]] = True
            steps, lanes = np.nonzero(track_host >= 0)
            t[steps, self.lane_track[lanes]] = True
            return t
        t[:, pool.request_slots] = True
        rows, idx = np.nonzero(track_host >= 0)
        t[rows, pool.track_slots[idx]] = True
        return t

    # ------------------------------------------------------------ a churning lifecycle (docs/semantics.md §12)
    # A kind built on these slots declares SERVES = True itself once its own pool, rule and indices follow the
    # batch its bookkeeping forms (a kind from outside that extends this class does not inherit the claim).
    SLOTS = MambaSlots  # the engine's bookkeeping: SGLang 0.5.23's request rows and mamba slots (drift/flows/slots.py)

    def start_serving(self, bookkeeping=None, extend=None) -> None:
        """``extend(start, state0, window0) -> (state, window)``: drift's prefill model (exact
        float64 from what the slot holds, drift.sim.twin.extend), which the simulation supplies."""
        R = self.cfg.num_requests
        self.slots = (bookkeeping or self.SLOTS)(self.pool, R)
        self.extend = extend
        self.held: dict[int, Held] = {}  # lane -> what its request holds
        self.lane_slot = np.zeros(R, np.int64)
        self.lane_track = np.zeros(R, np.int64)
        self.lane_request = np.full(R, -1, np.int64)
        self.cache: dict[int, int] = {}  # request -> the slot holding its snapshot (the tree's), oldest first
        self.fresh: set[int] = set()  # lanes admitted since the last arrange
        self.restored: dict[int, int] = {}  # lane -> bits of a prefix hit's restore that differ from the snapshot

    def store_start(self, slot: int, state: torch.Tensor, window: torch.Tensor) -> None:
        """The extend's store into ``slot``: the state in the state dtype (round to nearest), and the conv
        window at the end of the buffer with its first D-1 rows stale (NaN: a read of them shows), as
        :meth:`load_start` does."""
        cfg, pool = self.cfg, self.pool
        pool.states[:, slot] = state.to(pool.device).to(pool.temporal.dtype)
        W, Km1 = cfg.conv_window, cfg.conv_kernel - 1
        buf = torch.full((cfg.num_layers, W, cfg.conv_channels), STALE, dtype=pool.conv.dtype, device=pool.device)
        buf[:, W - Km1:] = window.to(pool.device, pool.conv.dtype)
        pool.conv[:, slot] = buf

    def admit(self, lane: int, request: int, start) -> None:
        """SGLang's admission of a request (drift/flows/slots.py): its row and slots, then -- before the
        extend -- the deferred clear of a fresh working slot or the copy of a prefix hit's tree slot into
        it; then the extend of its prompt (or, resuming, of everything it holds) from what the slot
        holds: the state unconditionally (the chunked GDN prefill reads ``initial_state =
        ssm_states[cache_indices]``), the conv window only after a prefix (``has_initial_state =
        extend_prefix_lens > 0``)."""
        cfg, pool = self.cfg, self.pool
        held = self.slots.alloc(prefix_hit=start.source >= 0)
        if start.source >= 0:
            self.slots.copy_from(self.slots.match(self.cache, start.source), held.work)
            # The restore, bit for bit, against the snapshot the cache keeps for the source (the slot drift
            # recorded when the source finished, untouched since: the slot guard holds it).
            snap = self.cache[start.source]
            self.restored[lane] = int((as_bits(pool.states[:, held.work]) != as_bits(pool.states[:, snap])).sum()
                                      + (as_bits(pool.conv[:, held.work]) != as_bits(pool.conv[:, snap])).sum())
        elif held.needs_clear:
            self.slots.clear_slots([held.work])
        state0 = pool.states[:, held.work].to(torch.float64).cpu()
        window0 = (pool.conv[:, held.work, cfg.conv_window - (cfg.conv_kernel - 1):].to(torch.float64).cpu()
                   if start.source >= 0 else None)
        state, window = self.extend(start, state0, window0)
        self.store_start(held.work, state, window)
        pool.temporal[:, held.track] = STALE  # no snapshot yet: a read of it shows
        pool.conv[:, held.track] = STALE
        self.held[lane] = held
        self.fresh.add(lane)
        self.lane_slot[lane], self.lane_track[lane], self.lane_request[lane] = held.work, held.track, request
        pool.active_slots[lane], pool.lane_track_slots[lane] = held.work, held.track
        pool.own(held.work, f"the slot of request {request} (lane {lane})")
        pool.own(held.track, f"the track slot of request {request} (lane {lane})")

    def release(self, lane: int, request: int, finished: bool, keep_snapshot: bool) -> None:
        pool, held = self.pool, self.held.pop(lane)
        pool.disown(held.work)
        if keep_snapshot:  # donated to the tree: the prefix cache keeps the newest ones
            self.cache[request] = held.track
            pool.own(held.track, f"the prefix cache's snapshot of request {request}")
        else:
            pool.disown(held.track)
        self.slots.free(held, keep_track=keep_snapshot)
        while len(self.cache) > self.cfg.serving.prefix_cache:  # the oldest snapshot evicted
            slot = self.cache.pop(next(iter(self.cache)))
            pool.disown(slot)
            self.slots.free_slots([slot])
        self.lane_request[lane] = -1
        pool.active_slots[lane] = 0
        pool.lane_track_slots[lane] = 0

    def serving_state_dict(self) -> dict:
        """The serving bookkeeping's state between chunks (drift.checkpoint): the engine's free lists (and
        whatever else its bookkeeping object keeps), what each lane holds, the cache, the index buffers."""
        pool = self.pool
        slots = {k: v for k, v in vars(self.slots).items() if k != "pool"}
        return {"slots": slots, "held": [[lane, h.row, h.work, h.track, int(h.needs_clear)] for lane, h in self.held.items()],
                "lane_slot": self.lane_slot, "lane_track": self.lane_track, "lane_request": self.lane_request,
                "cache": [[q, slot] for q, slot in self.cache.items()], "fresh": sorted(self.fresh),
                "lane_rows": self.lane_rows_host, "rows": self.rows,
                "owners": [[k, v] for k, v in pool.owners.items()], "previous": [[k, v] for k, v in pool.previous.items()],
                "buffers": {name: t for name, t in self.serving_buffers().items()}}

    def load_serving_state_dict(self, st: dict) -> None:
        pool = self.pool
        for k, v in st["slots"].items():
            setattr(self.slots, k, v)
        self.held = {int(lane): Held(int(r), int(w), int(t), bool(c)) for lane, r, w, t, c in st["held"]}
        self.lane_slot, self.lane_track, self.lane_request = st["lane_slot"], st["lane_track"], st["lane_request"]
        self.cache = {int(q): int(slot) for q, slot in st["cache"]}
        self.fresh = set(int(x) for x in st["fresh"])
        self.lane_rows_host, self.rows = st["lane_rows"], int(st["rows"])
        pool.owners = {int(k): v for k, v in st["owners"]}
        pool.previous = {int(k): v for k, v in st["previous"]}
        for name, t in self.serving_buffers().items():
            t.copy_(st["buffers"][name])

    def serving_buffers(self) -> dict[str, torch.Tensor]:
        """The persistent index buffers the serving bookkeeping rewrites (a kind adds its own)."""
        pool = self.pool
        return {"row_slots": pool.row_slots, "row_track_slots": pool.row_track_slots,
                "active_slots": pool.active_slots, "lane_track_slots": pool.lane_track_slots}

    def cached_snapshot(self, request: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The snapshot the prefix cache keeps for ``request``: its state ``[L, HV, V, K]`` (state dtype) and
        the Kc-1 conv inputs ``[L, Kc-1, C]`` it holds."""
        cfg, pool, slot = self.cfg, self.pool, self.cache[request]
        return pool.states[:, slot], pool.conv[:, slot, cfg.conv_window - (cfg.conv_kernel - 1):]

    def start_slot(self, lane: int) -> int:
        """The slot ``lane``'s request's next verify reads (for messages)."""
        return int(self.lane_slot[lane])

    def arrange(self, lanes_of_rows: np.ndarray, scheduled: Optional[np.ndarray] = None) -> None:
        cfg, pool = self.cfg, self.pool
        B, N = len(lanes_of_rows), cfg.num_rows
        live = lanes_of_rows >= 0
        rows, trk = np.zeros(B, np.int64), np.zeros(N, np.int64)  # padded rows: the dummy slot 0 (NPU)
        rows[live] = self.lane_slot[lanes_of_rows[live]]
        trk[:B][live] = self.lane_track[lanes_of_rows[live]]
        previous = self.lane_rows_host.copy()
        self.lane_rows_host = np.zeros(cfg.num_requests, np.int64)
        self.lane_rows_host[lanes_of_rows[live]] = np.nonzero(live)[0]
        # The engine's metadata of the step (its running rows first, the graph bucket's padding after them).
        self.slots.replay_metadata(pool.row_slots, rows.tolist(), int((~live).sum()))
        pool.row_track_slots.copy_(torch.from_numpy(trk))
        self.rows = B
        moved_from = np.array([previous[lane] if lane >= 0 and lane not in self.fresh else -1 for lane in lanes_of_rows],
                              np.int64)
        self.fresh.clear()
        self.arranged(lanes_of_rows, moved_from)

    def arranged(self, lanes_of_rows: np.ndarray, moved_from: np.ndarray) -> None:
        """The kind's own index buffers for the batch :meth:`arrange` formed: ``lanes_of_rows [B]`` and, per
        row, the row its request held at the last step (``moved_from [B]``, -1 for a request that starts
        and for padded rows)."""

    def committed_states(self) -> torch.Tensor:
        return self.pool.states.index_select(1, self.pool.active_slots)  # index_select: a seventh of [:, idx]'s time

    def committed_windows(self) -> torch.Tensor:
        cfg, pool = self.cfg, self.pool
        return pool.conv.index_select(1, pool.active_slots)[:, :, cfg.conv_window - (cfg.conv_kernel - 1):]

    def track_windows(self, lanes_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The track slots of lanes ``lanes_t`` (int64 ``[n]``) and the Kc-1 conv inputs they hold."""
        cfg, pool = self.cfg, self.pool
        tslots = pool.lane_track_slots[lanes_t]
        return tslots, pool.conv[:, tslots, cfg.conv_window - (cfg.conv_kernel - 1):].clone()
