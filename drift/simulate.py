"""The simulation loop: stream -> conv verify -> GDN verify -> update under test -> observers.

One :class:`Simulation` holds a pool, a harness and an input stream on one device and
runs decode steps through them. Each step:

1. the verify window ``[root, d1 .. d(D-1)]`` of every row comes from the stream;
2. the input stages: the verify conv produces the op's ``mix_qkv`` and rolls each slot's conv
   buffer, the gating its ``g`` (docs/semantics.md §10);
3. the verify op (the kernel under test) writes the state after every token into
   ``intermediate_ssm``, its arguments built as SGLang's Ascend backend builds them
   (by the flow's argument builder in its kind's package, docs/semantics.md §5-§6);
4. the update under test commits (``mtp`` mode) -- or, in ``sequential`` mode, the
   accepted tokens are decoded one by one with the state stored after each;
5. the slot guard checks that every slot neither committed nor tracked this step is
   bit-identical to before the update, and every slot no row owns (the dummy and spare slots)
   to before the verify kernel;
6. observers see the step (:class:`StepView`); they accumulate on the device and are
   flushed once per chunk of steps, so memory does not grow with the horizon (the next chunk's
   inputs are made while they flush: :meth:`Simulation._prefetch_chunk`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence

import numpy as np
import torch

from .checkpoint import restore, saveable
from .dtypes import as_bits
from .devices import resolve_device
from .errors import ENDS_PROCESS, DriftError, UpdateRaised, ended_by_code, raise_if_interrupted, what_raised
from .flows.registry import state_flow
from .plug.adapter import output_problem
from .runspec import Resolved
from .sim import kernels, native
from .sim.graph import GraphStatus, StepGraph
from .sim.pool import StatePool
from .sim.shim import kernels_in_use
from .sim.serving import END_FINISH, END_NAMES, START_NAMES, START_PREFILL, START_PREFIX, START_RESUME, ServingSchedule
from .sim.stream import InputStream
from .sim.twin import extend, prefill

FIRST_CHUNK = 16  # a fail-fast run's first chunk, in steps (Simulation.chunk_size)


class StopRun(Exception):
    """Raised by an observer to end the run early (a fatal finding such as NaN)."""


@dataclass
class StepView:
    """What observers see of one decode step (device tensors unless noted).

    x ``[L, N, D, C]``, a / b ``[L, N, D, HV]``: the verify windows of all N rows.
    last_steps / track_steps ``[N]`` int64 as passed to the update. out ``[L, N, D, HV, V]``
    bf16 outputs of the verify op. Host (numpy) ``[R]``: pre (seq_len before), accept, track (-1 = none).
    """

    step: int
    index: int  # position within the current chunk
    x: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    last_steps: torch.Tensor
    track_steps: torch.Tensor
    out: torch.Tensor
    pre: np.ndarray
    accept: np.ndarray
    track: np.ndarray
    # Under a churning lifecycle (None for the fixed batch, whose lane r is row r): the step's row of
    # each lane (device int64 [R], idle lanes 0), its schedule (drift.sim.serving.ScheduleChunk) and
    # index there, and the true start of each lane whose request starts here: lane -> (state [L, HV,
    # V, K], window [L, Kc-1, C]) float64, for prefill and resume starts (a prefix hit's truth is its
    # source's, which the comparison keeps).
    lane_rows: Optional[torch.Tensor] = None
    schedule: Optional[object] = None
    starts: dict = field(default_factory=dict)

    def by_lane(self, t: torch.Tensor) -> torch.Tensor:
        """``t [L, N, ...]`` (per batch row) as ``[L, R, ...]`` per lane."""
        R = self.pre.shape[0]
        return t[:, :R] if self.lane_rows is None else t.index_select(1, self.lane_rows)


class Observer(Protocol):
    def on_start(self, sim: "Simulation") -> None: ...
    def on_step(self, view: StepView) -> None: ...
    def flush(self) -> None: ...
    def on_end(self) -> None: ...
    # optional: abandon() -> None, called instead of on_end when the run raises (ends what runs beside it)
    # optional: begin_flush() -> None, called at each chunk's end before flush: start the chunk's work
    # elsewhere (the comparison's process); run makes the next chunk's inputs before calling flush


def _slot_words(bits: torch.Tensor) -> torch.Tensor:
    """``bits [L, S, ...]`` (an integer view of a pool tensor) as a view whose last dimension is
    dense: int64 words where its bytes allow, else the elements themselves. A transposed layout
    is read in storage order (its last two dimensions swapped back), so no comparison copies."""
    for view in (bits, bits.transpose(-1, -2)):
        if view.stride(-1) == 1:
            try:
                return view.view(torch.int64)
            except RuntimeError:  # the row's bytes are not a whole number of aligned words
                return view
    return bits


def _changed_slots(now: torch.Tensor, before: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
    """``[S]`` bool: the slots (dimension 1) in which the words ``now`` and ``before`` differ. On plain
    dense CPU tensors, the C kernel compares each slot's bytes layer by layer (``memcmp``, stopping at
    a slot's first difference; drift.sim.native.changed_slots); elsewhere (a device, the virtual one)
    the comparison lands in ``flags`` (bool, their shape, contiguous), read eight flags at a time as
    int64 where its shape allows: half the time of ``any()`` over the flags themselves."""
    if kernels.native_takes(now, before):
        return native.changed_slots(now, before)
    torch.ne(now, before, out=flags)
    flat = flags.flatten(2)
    if flat.shape[-1] % 8 == 0:
        return flat.view(torch.int64).amax(2).amax(0) != 0
    return flat.any(2).any(0)


class SlotGuard:
    """Bit-exact check that the code under test leaves every slot it should not touch as it was:
    the update every slot it neither commits nor tracks, and the verify kernel every slot its flow
    kind does not let it write (``flow.kernel_slots()``: none where the verify stores to a scratch
    or a ring, the rows' blocks where it stores in place), the slots no row owns included, and every
    slot's conv window.

    Per step it records, per slot, whether the temporal state or the conv window changed across the
    verify kernel's call or across the update's (untouched slots). Device-side; read at flush.
    """

    CALLS = ("verify kernel", "update")  # the calls it compares across, in the order a step makes them

    def __init__(self, pool: StatePool, capacity: int, kernel_slots: Optional[np.ndarray] = None):
        self.pool = pool
        # 8-byte words over each slot's memory: any changed bit changes its word, and a quarter of
        # the bf16 elements to compare (the order inside a slot does not matter to "changed?").
        self._t_words, self._c_words = (_slot_words(t) for t in pool.bits())
        self._before_t = torch.empty_like(self._t_words)
        self._before_c = torch.empty_like(self._c_words)
        self._flags_t = torch.empty(self._t_words.shape, dtype=torch.bool, device=pool.device)
        self._flags_c = torch.empty(self._c_words.shape, dtype=torch.bool, device=pool.device)
        S = pool.temporal.shape[1]
        self._stored: Optional[np.ndarray] = None  # [S] bool: the slots the verify kernel stores to
        self.keep(kernel_slots)
        # [call, step, slot]: call 0 the verify kernel, 1 the update (untouched slots)
        self.violations = torch.zeros(len(self.CALLS), capacity, S, dtype=torch.bool, device=pool.device)
        self._kernel_changed = torch.zeros(S, dtype=torch.bool, device=pool.device)
        self.first: Optional[dict] = None  # first violation seen: step, slot, role, call

    def keep(self, kernel_slots: Optional[np.ndarray]) -> None:
        """The slots the verify kernel stores to (``kernel_slots``); it must keep every other slot's state:
        all of them (``_kept`` None), or an index (it stores in place). Every conv window is kept (the conv
        verify runs before the kernel). A churning lifecycle calls it again whenever the batch changes."""
        S = self.pool.temporal.shape[1]
        slots = np.asarray(kernel_slots if kernel_slots is not None else [], np.int64)
        stored = np.zeros(S, bool)
        stored[slots[(slots >= 0) & (slots < S)]] = True
        if self._stored is not None and np.array_equal(stored, self._stored):
            return  # called at every step of a churning lifecycle; the batch's blocks rarely change
        self._stored = stored
        kept = np.flatnonzero(~stored)  # ascending, as the index_select and index_copy_ below take them
        self._kept = None if len(kept) == S else torch.from_numpy(kept.astype(np.int64)).to(self.pool.device)
        self._kept_t = None if self._kept is None else self._t_words.index_select(1, self._kept)
        self._flags_k = None if self._kept is None else torch.empty(self._kept_t.shape, dtype=torch.bool,
                                                                     device=self.pool.device)

    def before_verify(self) -> None:
        """Before the verify kernel's call: the words of every slot (or, where the kernel stores in
        place, of the slots it must keep) and every conv window."""
        if self._kept is None:
            self._before_t.copy_(self._t_words)
        else:
            torch.index_select(self._t_words, 1, self._kept, out=self._kept_t)
        self._before_c.copy_(self._c_words)

    def before(self) -> None:
        """After the verify kernel's call, before the update's: which slot the kernel changed that it
        must keep. Where it may change none, the words from before it stay the update's baseline
        (:meth:`after` leaves the slots the kernel changed to its flag): one copy a step, not two."""
        changed = _changed_slots(self._c_words, self._before_c, self._flags_c)  # [S]
        if self._kept is None:
            changed |= _changed_slots(self._t_words, self._before_t, self._flags_t)
        else:
            now = self._t_words.index_select(1, self._kept)
            kept_changed = _changed_slots(now, self._kept_t, self._flags_k)
            changed.index_copy_(0, self._kept, changed.index_select(0, self._kept) | kept_changed)
            self._before_t.copy_(self._t_words)  # the blocks the kernel stored to: the update's baseline
        self._kernel_changed.copy_(changed)

    def after(self, index: int | torch.Tensor, touched: torch.Tensor) -> None:
        """Record step ``index`` of the chunk (a host int, or a 1-element int64 device tensor in a
        captured step); touched ``[S]`` bool: the slots the update may write."""
        changed = (_changed_slots(self._t_words, self._before_t, self._flags_t)
                   | _changed_slots(self._c_words, self._before_c, self._flags_c))  # [S]
        both = torch.stack([self._kernel_changed, changed & ~touched & ~self._kernel_changed])  # [2, S]
        if isinstance(index, torch.Tensor):
            self.violations.index_copy_(1, index, both[:, None])
        else:
            self.violations[:, index] = both

    def flush(self, step0: int, count: int, offset: int = 0) -> None:
        """Read flags ``[offset, offset + count)`` (steps ``step0 ..``) and clear them."""
        v = self.violations[:, offset:offset + count].cpu().numpy()  # [call, step, slot]
        if self.first is None and v.any():
            s = int(np.nonzero(v.any((0, 2)))[0][0])  # the first step; at it, the call made first
            call = int(np.nonzero(v[:, s].any(1))[0][0])
            slot = int(np.nonzero(v[call, s])[0][0])
            self.first = {"step": step0 + s, "slot": slot, "role": self.pool.slot_role(slot),
                          "call": self.CALLS[call]}
        self.violations[:, offset:offset + count] = False


class StageClock:
    """Wall seconds spent in each stage of eager decode steps (``drift bench``'s profile).

    ``lap(stage)`` adds the time since the previous lap (or :meth:`start`) to ``seconds[stage]``,
    after waiting for the device's queued work, so each stage is charged its own device time.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = {}
        self._t = time.perf_counter()

    def _now(self) -> float:
        if self.device.type != "cpu":
            getattr(torch, self.device.type).synchronize()
        return time.perf_counter()

    def start(self) -> None:
        self._t = self._now()

    def lap(self, stage: str) -> None:
        t = self._now()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + t - self._t
        self._t = t


class EventCounts:
    """What a churning lifecycle did in a run, for its report (``RunInfo.meta["events"]``)."""

    def __init__(self):
        self.requests: set[int] = set()
        self.starts = {name: 0 for name in START_NAMES.values()}
        self.ends = {name: 0 for name in END_NAMES.values()}
        self.buckets: set[int] = set()
        self.padded: set[int] = set()
        self.row_moves = 0
        self._rows: Optional[np.ndarray] = None

    def add(self, plan, s: int) -> None:
        req = plan.request[s]
        self.requests.update(int(q) for q in req[req >= 0])
        for code, name in START_NAMES.items():
            self.starts[name] += int((plan.start[s] == code).sum())
        for code, name in END_NAMES.items():
            self.ends[name] += int((plan.end[s] == code).sum())
        self.buckets.add(int(plan.bucket[s]))
        self.padded.add(int(plan.bucket[s] - (req >= 0).sum()))
        rows = plan.row[s]
        if self._rows is not None:
            same_request = (rows >= 0) & (self._rows >= 0) & (plan.start[s] == 0)
            self.row_moves += int((same_request & (rows != self._rows)).sum())
        self._rows = rows.copy()

    def to_dict(self) -> dict:
        return {"requests": len(self.requests), "starts": dict(self.starts), "ends": dict(self.ends),
                "buckets": sorted(self.buckets), "padded_rows": sorted(self.padded), "row_moves": self.row_moves}


@dataclass
class ResumePoint:
    """Where each active row starts instead of its prompt (a prefix-cache hit, a checkpoint).

    positions ``[R]`` int: seq_len of each row; state ``[L, R, HV, K, V]`` (the state dtype's
    values to load, bit for bit) and window ``[L, R, Kc-1, C]``; true_state / true_window:
    the float64 truth at those positions, where the twin starts.
    """

    positions: np.ndarray
    state: torch.Tensor
    window: torch.Tensor
    true_state: torch.Tensor
    true_window: torch.Tensor


@dataclass
class RunInfo:
    """What a finished run reports about itself."""

    steps: int
    wall_s: float
    mode: str
    update: str
    kernels: str
    device: str
    stopped_early: Optional[str] = None
    verify_kernel: str = ""
    untouched_violation: Optional[dict] = None
    meta: dict = field(default_factory=dict)


class Simulation:
    """MTP (or sequential) decode of a :class:`~drift.runspec.Resolved` run: its config, through its
    update (mtp mode) and its verify kernel, in its flow kind's machinery (drift/flows).
    """

    def __init__(self, run: Resolved, observers: Sequence[Observer] = (), check_untouched: bool = True,
                 device: Optional[torch.device] = None, start: Optional[ResumePoint] = None,
                 graph: Optional[bool] = None):
        if not isinstance(run, Resolved):
            raise TypeError(f"Simulation takes a resolved run (drift.runspec.resolve), not {type(run).__name__}")
        self.resolved = run
        cfg = self.cfg = run.cfg
        mode = self.mode = run.mode
        self.device = device if device is not None else resolve_device(cfg.device)
        self.flow = state_flow(cfg, self.device, mode)  # pool, harness, verify rule (drift/flows)
        self.pool: StatePool = self.flow.pool
        self.harness = self.flow.harness
        self.update = run.update if mode == "mtp" else None
        self.kernel = run.kernel
        self.serving = cfg.serving.churn
        schedule = None
        if self.serving:  # requests come and go: the schedule, in the engine's batch order
            if start is not None:
                raise ValueError("a resume point starts the fixed batch's rows; a churning lifecycle starts its own")
            schedule = ServingSchedule(cfg, self.flow.BATCH_ORDER)
        self.stream = InputStream(cfg, self.device, schedule=schedule)
        self.params = self.stream.params.to(self.device)
        self.observers = list(observers)
        self.ramp = False  # set by a fail-fast run: chunk_size ramps up from FIRST_CHUNK
        self.guard = (SlotGuard(self.pool, self.stream.chunk_steps, self.flow.kernel_slots())
                      if (check_untouched and mode == "mtp") else None)
        self._ended: list[tuple] = []  # (lane, request, END_*, its snapshot kept) after the last step
        self.events = EventCounts()
        self.start_findings: list[dict] = []  # requests whose first verify read another start (_check_starts)
        self.starts_checked = 0
        if self.serving:  # every lane starts empty; the schedule's first step admits the first requests
            self.lengths = [0] * cfg.num_requests
            shape = (cfg.num_layers, cfg.num_requests, cfg.num_v_heads, cfg.head_v_dim, cfg.head_k_dim)
            self.prefill_state = torch.zeros(shape, dtype=torch.float64)
            self.prefill_window = torch.zeros(cfg.num_layers, cfg.num_requests, cfg.conv_kernel - 1,
                                              cfg.conv_channels, dtype=torch.float64)
            self._truths: dict = {}
            self.flow.start_serving(getattr(run.update, "serving", None), extend=self._extend)
        elif start is None:
            self.lengths = [self.stream.prefill_len(r) for r in range(cfg.num_requests)]
            self.prefill_state, self.prefill_window = prefill(cfg, self.stream.tokens, self.stream.params,
                                                              self.lengths, torch.device("cpu"))
            stored = self.prefill_state.to(self.device).to(self.pool.temporal.dtype)
            window = self.prefill_window
        else:
            self.lengths = [int(p) for p in start.positions]
            self.stream.pos = np.asarray(start.positions, np.int64).copy()
            self.prefill_state, self.prefill_window = start.true_state, start.true_window
            stored, window = start.state.to(self.device), start.window
        if not self.serving:
            self._load_start(stored, window)
        self.step = 0
        self._chunk = None
        self._next_chunk = None  # the stream's next chunk, made ahead while the observers flush (run)
        self._truths_ahead: dict = {}  # (request, prompt length) -> its prefill's truth, made with its chunk
        self._touched_chunk = None
        self._in_chunk = 0
        self._guard_read = 0
        self._static = None  # the captured step's persistent inputs (see _graph_step)
        self._graph = self._make_graph(cfg.graph_mode if graph is None else graph)
        # Set to a StageClock to time the stages of eager steps (a captured step is not split).
        self.clock: Optional[StageClock] = None

    def _lap(self, stage: str) -> None:
        if self.clock is not None and self._graph.api is None:
            self.clock.lap(stage)

    def _make_graph(self, requested: bool) -> StepGraph:
        """The step's device graph (docs/semantics.md §11): SGLang's graph mode captures the
        decode; ``graph`` False (``--no-graph``) or a per-step host input runs it eagerly."""
        why = ""
        if not requested:
            why = "eager: graph mode off (--no-graph)"
        elif self.mode != "mtp":
            why = "eager: sequential decode is the reference shadow, never captured"
        elif self.cfg.store_rounding == "stochastic":
            why = "eager: stochastic rounding keys its noise by the host's step counter"
        elif self.serving:
            why = "eager: the serving lifecycle changes the batch between steps (its graph buckets are not captured)"
        return StepGraph(self.device, self._graph_body, enabled=not why, why_not=why)

    @property
    def graph_status(self) -> GraphStatus:
        """How the decode steps ran: captured and replayed, eagerly, or capture failed (and why)."""
        return self._graph.status

    def _load_start(self, stored: torch.Tensor, window: torch.Tensor) -> None:
        """The starting state as prefill leaves it, where the flow keeps it (drift/flows/registry.py)."""
        self.flow.load_start(stored, window)

    # ------------------------------------------------------------------ loop
    def run(self, steps: Optional[int] = None,
            progress: Optional[Callable[[int, int], None]] = None,
            resume_state: Optional[dict] = None,
            checkpoint: Optional[Callable[[int, dict], None]] = None,
            checkpoint_every: int = 0) -> RunInfo:
        """Run to ``steps`` (default: the config's) decode steps in total.

        resume_state: a snapshot handed to ``checkpoint`` earlier; the run continues from it.
        checkpoint(done, snapshot) is called at the first chunk boundary after every
        ``checkpoint_every`` steps, with the state of the simulation and of every observer.
        Chunk boundaries depend only on (done, total), so a resumed run sees the same ones.
        """
        cfg = self.cfg
        total = cfg.steps if steps is None else steps
        for obs in self.observers:
            obs.on_start(self)
        done = 0
        if resume_state is not None:
            self.load_state_dict(resume_state["sim"])
            for obs, st in zip(self.observers, resume_state["observers"]):
                if st is not None:
                    obs.load_state_dict(st)
            done = int(resume_state["done"])
        t0 = time.perf_counter()
        if self.clock is not None:
            self.clock.start()
        stopped = None
        next_ckpt = (done // checkpoint_every + 1) * checkpoint_every if checkpoint_every else None
        try:
            while done < total:
                raise_if_interrupted()  # between chunks: a swallowed interrupt still ends the run
                done += self.advance(min(self.chunk_size(done), total - done))
                for obs in self.observers:
                    begin = getattr(obs, "begin_flush", None)
                    if begin is not None:
                        begin()
                checkpoint_due = (checkpoint is not None and next_ckpt is not None and done >= next_ckpt
                                  and done < total)
                if done < total and not checkpoint_due:  # a checkpoint holds the stream where the steps stand
                    self._prefetch_chunk(min(self.chunk_size(done), total - done))
                for obs in self.observers:
                    obs.flush()
                self._lap("observers: flush")
                if progress is not None:
                    progress(done, total)
                if checkpoint_due:
                    self._flush_guard()
                    checkpoint(done, {"done": done, "sim": self.state_dict(),
                                      "observers": [obs.state_dict() if hasattr(obs, "state_dict") else None
                                                    for obs in self.observers]})
                    next_ckpt = (done // checkpoint_every + 1) * checkpoint_every
        except StopRun as why:
            stopped = str(why)
            for obs in self.observers:
                obs.flush()
        except BaseException:  # the run is abandoned: what an observer runs beside it ends now (abandon)
            for obs in self.observers:
                abandon = getattr(obs, "abandon", None)
                if abandon is not None:
                    abandon()
            raise
        self._flush_guard()
        for obs in self.observers:
            obs.on_end()
        return RunInfo(
            steps=done, wall_s=time.perf_counter() - t0, mode=self.mode,
            update=self.update.description if self.update else "(sequential decode)",
            kernels=kernels_in_use(), device=str(self.device), stopped_early=stopped,
            verify_kernel=self.verify_description(),
            untouched_violation=self.guard.first if self.guard else None,
            meta={"graph": self.graph_status.state, "graph_note": self.graph_status.note,
                  "lifecycle": self.cfg.lifecycle, **({"events": self.events.to_dict()} if self.serving else {})})

    def chunk_size(self, done: int) -> int:
        """Steps in the chunk that starts after ``done``: the stream's chunk, or, in a fail-fast run
        (``ramp``), ``FIRST_CHUNK`` steps and then as many as are done (16, 16, 32, 64, ...) up to
        the stream's, so a regression that fails at its first steps stops after 16 of them, not 256,
        while a long run keeps the stream's chunks (one flush each). A function of ``done`` alone, so
        a resumed run sees the same boundaries."""
        if not self.ramp:
            return self.stream.chunk_steps
        return min(self.stream.chunk_steps, max(FIRST_CHUNK, done))

    def verify_description(self) -> str:
        """Which GDN verify ran: the portable kernel (native C or torch ops) or a plugged one, by name."""
        if self.mode != "mtp":
            return "none (sequential decode)"
        if not self.kernel.portable:
            return self.kernel.description
        cfg = self.cfg
        args = self.flow.verify_args(torch.empty(cfg.num_layers, cfg.num_rows, cfg.num_draft_tokens, cfg.conv_channels,
                                                 device="meta"), None, None, cfg.store_rounding, 0)
        if kernels.uses_native(args):
            return "portable, native C kernel (CPU)"
        return "portable, torch ops"

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Pool tensors, stream position and step counters (between chunks only)."""
        if self._next_chunk is not None:
            raise RuntimeError("drift: a checkpoint after the next chunk was made ahead (a bug in drift)")
        pool = self.pool
        return saveable({"temporal": pool.temporal, "conv": pool.conv, "inter": pool.intermediate_ssm,
                         "flow": self.flow.state_dict(),
                         "stream_pos": self.stream.pos, "stream_step": self.stream.step, "step": self.step,
                         "guard_first": self.guard.first if self.guard is not None else None,
                         "serving": self._serving_state() if self.serving else None})

    def _serving_state(self) -> dict:
        """A churning lifecycle's own state: the schedule, the flow's bookkeeping, what the run found so far."""
        ev = self.events
        return {"schedule": self.stream.schedule.state_dict(), "flow": self.flow.serving_state_dict(),
                "ended": [list(map(int, e)) for e in self._ended], "starts_checked": self.starts_checked,
                "start_findings": self.start_findings,
                "events": {"requests": sorted(ev.requests), "starts": ev.starts, "ends": ev.ends,
                           "buckets": sorted(ev.buckets), "padded": sorted(ev.padded), "row_moves": ev.row_moves,
                           "rows": ev._rows}}

    def _load_serving_state(self, st: dict) -> None:
        self.stream.schedule.load_state_dict(st["schedule"])
        self.flow.load_serving_state_dict(st["flow"])
        self._ended = [(a, b, c, bool(d)) for a, b, c, d in st["ended"]]
        self.starts_checked, self.start_findings = int(st["starts_checked"]), list(st["start_findings"])
        ev, e = self.events, st["events"]
        ev.requests, ev.starts, ev.ends = set(e["requests"]), dict(e["starts"]), dict(e["ends"])
        ev.buckets, ev.padded, ev.row_moves, ev._rows = set(e["buckets"]), set(e["padded"]), e["row_moves"], e["rows"]
        if self.guard is not None:
            self.guard.keep(self.flow.kernel_slots())

    def load_state_dict(self, state: dict) -> None:
        pool = self.pool
        pool.temporal.copy_(state["temporal"])
        pool.conv.copy_(state["conv"])
        pool.intermediate_ssm.copy_(state["inter"])
        self.flow.load_state_dict(state.get("flow") or {"verify_args": state.get("verify_args")})
        self.stream.pos = restore(state["stream_pos"])
        self.stream.step = int(state["stream_step"])
        self.step = int(state["step"])
        if self.guard is not None:
            self.guard.first = state["guard_first"]
        if self.serving:
            self._load_serving_state(restore(state["serving"]))
        self._chunk, self._next_chunk, self._in_chunk, self._guard_read = None, None, 0, 0
        self._truths_ahead = {}

    def advance(self, count: int) -> int:
        """Run ``count`` more steps (observers see each; they are not flushed here).

        Steps come from the current input chunk; a new chunk is fetched when it is used up.
        Lockstep shadows (e.g. a sequential twin of an MTP run) call this one step at a time.
        """
        done = 0
        while done < count:
            if self._chunk is None or self._in_chunk == self._chunk.count:
                self._flush_guard()
                self._guard_read = 0
                want = min(self.stream.chunk_steps, count - done)
                if self._next_chunk is not None:  # made ahead (_prefetch_chunk): the stream's next chunk
                    self._chunk, self._next_chunk = self._next_chunk, None
                    if self._chunk.count != want:
                        raise RuntimeError(f"drift: the chunk made ahead holds {self._chunk.count} steps, the "
                                           f"simulation asked for {want} (a bug in drift)")
                else:
                    self._chunk = self.stream.chunk(want)
                # Under churn the slots a step may touch are known only once its events ran (_step).
                self._touched_chunk = (self._touched(self._chunk) if self.guard is not None and not self.serving
                                       else None)
                self._in_chunk = 0
                self._lap("input stream")
            self._step(self._chunk, self._in_chunk, self._touched_chunk)
            self._in_chunk += 1
            done += 1
        return done

    def _prefetch_chunk(self, count: int) -> None:
        """Make the next chunk of ``count`` steps' inputs now, where the current one is used up: run calls
        it between asking its observers for the chunk just run and taking their answers (the comparison's
        process finishes its last steps meanwhile). The stream's own work, the same chunk :meth:`advance`
        would make next; a run that stops here never uses it."""
        if self._chunk is not None and self._in_chunk == self._chunk.count and self._next_chunk is None:
            self._next_chunk = self.stream.chunk(min(self.stream.chunk_steps, count))
            plan = self._next_chunk.schedule
            for s in range(self._next_chunk.count if plan is not None else 0):  # its prefills' truths too
                for start in plan.starts(s):
                    if start.code == START_PREFILL:
                        self._truths_ahead[(start.request, start.p1)] = self._prefill_truth(start)
            self._lap("input stream")

    def _serve(self, chunk, s: int) -> dict:
        """The events before step ``s`` of ``chunk``, in the engine's order: the requests that ended
        after the last step release what they hold, the ones that start here are admitted (the engine's
        bookkeeping; a prefix hit restores its source's snapshot; the extend stores the state after its
        tokens), and the batch of the step is formed (its rows, padded to the graph bucket). Returns the
        starts handed to observers (StepView.starts): lane -> (Start, true state, true window), the
        truth given for prefill starts (a resume's is the twin's own; a prefix hit's its source's)."""
        plan = chunk.schedule
        self._truths = {}
        for lane, request, end, kept in self._ended:
            self.flow.release(lane, request, finished=end == END_FINISH, keep_snapshot=kept)
        starts = {}
        begun = plan.starts(s)
        for start in begun:
            truth = self._prefilled(start) if start.code == START_PREFILL else (None, None)
            starts[start.lane] = (start, *truth)
            self.flow.admit(start.lane, start.request, start)
        self.flow.arrange(plan.lanes[s, :chunk.rows(s)], scheduled=chunk.drafts_host[s])
        if self.guard is not None:  # the blocks this step's verify stores to (a kind that stores in place)
            self.guard.keep(self.flow.kernel_slots())
        self._check_starts(begun)
        self._ended = [(r, int(plan.request[s, r]), int(plan.end[s, r]), bool(plan.kept[s, r]))
                       for r in np.nonzero(plan.end[s])[0].tolist()]
        self.events.add(plan, s)
        return starts

    def _prefilled(self, start) -> tuple[torch.Tensor, torch.Tensor]:
        """The true state ``[L, HV, V, K]`` and window ``[L, Kc-1, C]`` (float64, CPU) after a prompt."""
        key = (start.request, start.p1)
        if key not in self._truths:  # kept for the step's starts (the start, its extend, its check)
            ahead = self._truths_ahead.pop(key, None)  # made with its chunk (_prefetch_chunk)
            self._truths[key] = ahead if ahead is not None else self._prefill_truth(start)
        return self._truths[key]

    def _prefill_truth(self, start) -> tuple[torch.Tensor, torch.Tensor]:
        state, window = extend(self.cfg, self.stream.tokens, self.stream.params, [start.request], [0], [start.p1],
                               torch.device("cpu"))
        return state[:, 0], window[:, 0]

    def _true_start(self, start) -> tuple[torch.Tensor, torch.Tensor]:
        """The truth (float64, CPU) a prefill or a resume stores: the prefill's (computed once), a resume's
        from an observer's twin (``lane_truth``), else a prefill of everything the request holds."""
        if start.code == START_RESUME:
            for obs in self.observers:
                have = getattr(obs, "lane_truth", None)
                got = have(start.lane) if have is not None else None
                if got is not None:
                    return got
        return self._prefilled(start)

    def _extend(self, start, state0: torch.Tensor, window0: Optional[torch.Tensor]):
        """drift's model of the engine's extend (the prefill kernel): the state and window after the
        start's tokens, exact from what the slot held (``state0 [L, HV, V, K]``, ``window0 [L, Kc-1, C]``
        or None: zeros), float64 on the CPU; the flow stores it once in the state dtype. From an empty
        slot it is the truth (:meth:`_true_start`)."""
        if window0 is None and start.p0 == 0 and not bool(state0.any()):
            return self._true_start(start)
        state, window = extend(self.cfg, self.stream.tokens, self.stream.params, [start.request], [start.p0],
                               [start.p1], torch.device("cpu"), state0[:, None],
                               None if window0 is None else window0[:, None])
        return state[:, 0], window[:, 0]

    def _check_starts(self, begun: list) -> None:
        """Each request that starts here must find, where its first verify reads it, exactly the start a
        correct engine stores: its true start rounded once (a prefill, a resume: a cleared slot extended
        from zeros), or the extend of the snapshot the prefix cache keeps for its source (a prefix hit).
        A mismatch -- a slot that kept its previous holder's state, a restore from the wrong snapshot, an
        index that points elsewhere -- is recorded with the step, the slot and both holders (the check
        ``request_starts``). Host-side, between steps: drift's own bookkeeping, not the hot path."""
        if not begun:
            return
        pool, flow = self.pool, self.flow
        got_states, got_windows = flow.committed_states(), flow.committed_windows()
        for start in begun:
            if start.code == START_PREFIX:
                snap, snap_window = flow.cached_snapshot(start.source)
                state, window = extend(self.cfg, self.stream.tokens, self.stream.params, [start.request],
                                       [start.p0], [start.p1], torch.device("cpu"), snap.to(torch.float64).cpu()[:, None],
                                       snap_window.to(torch.float64).cpu()[:, None])
                state, window = state[:, 0], window[:, 0]
            else:
                state, window = self._true_start(start)
            want = as_bits(state.to(pool.device).to(pool.temporal.dtype))
            bad = int((as_bits(got_states[:, start.lane]) != want).sum())
            restore_bad = getattr(flow, "restored", {}).pop(start.lane, 0) if start.code == START_PREFIX else 0
            bad_window = int((got_windows[:, start.lane].to(torch.float64).cpu() != window).sum())
            self.starts_checked += 1
            if (bad or bad_window or restore_bad) and len(self.start_findings) < 20:
                slot = flow.start_slot(start.lane)
                self.start_findings.append({
                    "step": self.step, "lane": start.lane, "request": start.request, "start": START_NAMES[start.code],
                    "source": start.source, "slot": slot, "holder": pool.slot_role(slot),
                    "previous": pool.previous.get(slot, ""), "state_bits": bad, "window_values": bad_window,
                    "restore_bits": restore_bad})

    def _flush_guard(self) -> None:
        """Read the slot guard's per-step flags for the steps of the current chunk run so far."""
        if self.guard is not None and self._chunk is not None and self._in_chunk > self._guard_read:
            self.guard.flush(self._chunk.step0 + self._guard_read, self._in_chunk - self._guard_read,
                             offset=self._guard_read)
            self._guard_read = self._in_chunk

    def _touched(self, chunk) -> torch.Tensor:
        """``[count, S]`` bool: slots the update may write at each step of the chunk."""
        return torch.from_numpy(self.flow.touched(chunk.track_host, chunk.drafts_host)).to(self.device)

    def _step(self, chunk, s: int, touched: Optional[torch.Tensor]) -> None:
        starts: dict = {}
        lane_rows = None
        if self.serving:  # between steps, as the engine's scheduler: requests leave and join, the batch forms
            starts = self._serve(chunk, s)
            B = chunk.rows(s)
            lane_rows = torch.from_numpy(np.maximum(chunk.schedule.row[s], 0)).to(self.device)
            step_touched = (torch.from_numpy(self.flow.touched(chunk.track_host[s:s + 1], chunk.drafts_host[s:s + 1])[0])
                            .to(self.device) if self.guard is not None else None)
            out = self._compute(chunk.x[s][:, :B], chunk.a[s][:, :B], chunk.b[s][:, :B], chunk.last_steps[s][:B],
                                chunk.track_steps[s][:B], s, step_touched, chunk.drafts[s][:B])
        elif self._graph.api is not None and not self._graph.status.failed:
            out = self._graph_step(chunk, s, touched)
        else:
            out = self._compute(chunk.x[s], chunk.a[s], chunk.b[s], chunk.last_steps[s], chunk.track_steps[s],
                                s, touched[s] if touched is not None else None, chunk.drafts[s])
        if self.mode == "mtp":  # here, not in _compute: a captured step may not read the device from the host
            unreadable = self.flow.unreadable_update()
            if unreadable:
                raise UpdateRaised(f"the update under test ({self.update.spec}) {unreadable}, at decode step "
                                   f"{self.step}")
        view = StepView(step=self.step, index=s, x=chunk.x[s], a=chunk.a[s], b=chunk.b[s],
                        last_steps=chunk.last_steps[s], track_steps=chunk.track_steps[s], out=out,
                        pre=chunk.pre[s], accept=chunk.accept[s], track=chunk.track_host[s],
                        lane_rows=lane_rows, schedule=chunk.schedule, starts=starts)
        for obs in self.observers:
            obs.on_step(view)
        self._lap("observers: per step")
        self.step += 1

    def _graph_step(self, chunk, s: int, touched: Optional[torch.Tensor]) -> torch.Tensor:
        """Step s of ``chunk`` through the captured graph. The chunk's inputs are copied once into
        persistent buffers; the graph reads step ``idx`` (a device counter it advances itself), so
        a replay needs no host input at all. Returns the persistent output buffer."""
        st = self._static
        if st is None or st["chunk"] is not chunk:
            if st is None:
                cap = self.stream.chunk_steps
                st = self._static = {name: torch.empty((cap, *t.shape[1:]), dtype=t.dtype, device=self.device)
                                     for name, t in self._chunk_inputs(chunk, touched).items()}
                st["idx"] = torch.zeros(1, dtype=torch.int64, device=self.device)
                st["out"] = None
            for name, t in self._chunk_inputs(chunk, touched).items():
                st[name][: t.shape[0]].copy_(t)
            st["chunk"] = chunk
            st["idx"].fill_(s)
        self._graph()
        return st["out"]

    def _chunk_inputs(self, chunk, touched: Optional[torch.Tensor]) -> dict:
        inputs = {"x": chunk.x, "a": chunk.a, "b": chunk.b, "last": chunk.last_steps, "trk": chunk.track_steps,
                  "drafts": chunk.drafts}
        if touched is not None:
            inputs["touched"] = touched
        return inputs

    def _graph_body(self) -> None:
        """One decode step on the persistent inputs at ``idx``; the output lands in ``out``."""
        st = self._static
        i = st["idx"]
        pick = {name: st[name].index_select(0, i)[0] for name in ("x", "a", "b", "last", "trk", "touched", "drafts")
                if name in st}
        out = self._compute(pick["x"], pick["a"], pick["b"], pick["last"], pick["trk"], i, pick.get("touched"),
                            pick["drafts"])
        if st["out"] is None:  # the warm-up call (eager) allocates the persistent output
            st["out"] = torch.empty_like(out)
        st["out"].copy_(out)
        i.add_(1)

    def _verify(self, args) -> torch.Tensor:
        """The verify kernel's call. A plugged kernel is code under test: one that raises, or
        returns anything but a bf16 ``[L, B, S, HV, V]`` tensor, fails the run (UpdateRaised, exit
        1) naming the kernel, the step and (through the NPU op adapter) the layer."""
        fn = self.kernel
        if fn.portable:
            return fn(args)
        name = f"the verify kernel under test ({fn.name})"
        try:
            out = fn(args)
        except UpdateRaised as exc:
            raise UpdateRaised(f"{name} failed at decode step {self.step}, {exc}") from exc
        except DriftError:  # drift could not run it: exit 2, not a failed check
            raise
        except (Exception, *ENDS_PROCESS) as exc:
            if not isinstance(exc, Exception) and not ended_by_code(exc):
                raise  # a signal
            raise UpdateRaised(f"{name} raised {what_raised(exc)} at decode step {self.step} (one call for all "
                               f"{self.cfg.num_layers} layers)") from exc
        L, B, S, HV, V, _ = args.dims
        problem = output_problem(out, (L, B, S, HV, V), exact=True)
        if problem:
            raise UpdateRaised(f"{name} {problem} at decode step {self.step} (one call for all {L} layers)")
        return out

    def _compute(self, x, a, b, last, trk, s, touched, drafts) -> torch.Tensor:
        """The step proper: conv verify, gating, verify op, the update (or sequential decode), the
        slot guard. s: the step's index in the chunk (host int, or device tensor when captured);
        drafts ``[N]``: the tokens each row verifies (all D unless the stream is ragged)."""
        cfg, pool, prm = self.cfg, self.pool, self.params
        mix = self.flow.conv_verify(x, prm.conv_weight, drafts)  # bf16 [L, N, D, C]
        g = kernels.gdn_gating(a, prm.A_log, prm.dt_bias)  # fp32 [L, N, D, HV]
        beta = b.to(torch.bfloat16)  # the beta logit, on the bf16 grid already
        self._lap("conv verify, gating")
        if self.mode == "mtp":
            if self.guard is not None:
                self.guard.before_verify()
            out = self._verify(self.flow.verify_args(mix, beta, g, cfg.store_rounding, self.step, drafts,
                                                     (a, prm.A_log, prm.dt_bias)))
            self.flow.after_verify(last)
            self._lap("verify op")
            if self.guard is not None:
                self.guard.before()
                self._lap("slot guard")
            track_idx = pool.row_track_slots[: last.shape[0]] if cfg.track_interval > 0 else None
            track_steps = trk if cfg.track_interval > 0 else None
            try:
                self.update(self.harness, last, track_idx, track_steps)
            except DriftError:  # drift could not run it (HarnessLacks): exit 2, not a failed check
                raise
            except (Exception, *ENDS_PROCESS) as exc:  # sys.exit or a raised KeyboardInterrupt fail it too
                if not isinstance(exc, Exception) and not ended_by_code(exc):
                    raise  # a signal
                raise UpdateRaised(f"the update under test ({self.update.spec}) raised {what_raised(exc)} at "
                                   f"decode step {self.step}") from exc
            self._lap("update")
            if self.guard is not None:
                self.guard.after(s, touched)
                self._lap("slot guard")
            return out
        q, k, v, decay, bt = kernels.op_inputs(mix, beta, g, cfg.num_k_heads, cfg.head_k_dim, cfg.num_v_heads,
                                               cfg.head_v_dim, cfg.head_k_dim ** -0.5)
        num = torch.clamp(last + 1, min=0)
        out = kernels.gdn_decode(pool.states, pool.row_slots, q, k, v, decay, bt, num,
                                 rounding=cfg.store_rounding, key=self.step).to(torch.bfloat16)
        kernels.conv_state_rollback(pool.conv, pool.row_slots, last, cfg.num_draft_tokens)
        return out
