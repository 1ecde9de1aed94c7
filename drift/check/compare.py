"""Comparison of a run against its float64 twin (validated against golden data), step by step.

:class:`Comparison` is the observer: it advances the twin with each step's true inputs,
validates the twin against the golden trajectory where one exists, and reduces the
differences on the device into per-step arrays that it hands, one chunk of steps at a
time, as a :class:`MetricsChunk` to its consumers (checks, bound model, curves).
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence

import numpy as np
import torch

from ..checkpoint import saveable
from ..devices import supports_float64
from ..sim.twin import F64, Float64Twin
from ..simulate import StopRun
from .golden import Golden, load_golden
from .measures import MEASURES, Batch, declared

BATCH_BYTES = 64 << 20  # per-step snapshots held between comparisons (a batch is at most a chunk)


class MetricsChunk:
    """Per-step reductions for ``count`` steps from ``step0`` (host numpy arrays).

    The arrays of the measures the run computes (drift/check/measures.py): per head ``[S, L, R,
    HV]`` float64, flags ``[S, L, R, HV]`` bool, per row ``[S, R]`` float64; ``pre``, ``accept``,
    ``track`` ``[S, R]`` int are the host schedule (track = -1 when not tracked). An array no
    active check declared is not there, and asking for it names the measure to declare.
    """

    def __init__(self, step0: int, count: int, arrays: dict[str, np.ndarray]):
        self.step0, self.count, self.arrays = step0, count, arrays

    def __getattr__(self, name: str) -> np.ndarray:
        try:
            return self.__dict__["arrays"][name]
        except KeyError:
            owner = next((m.key for m in MEASURES.values() if name in m.arrays), None)
            if owner is None:
                raise AttributeError(name) from None
            raise AttributeError(f"{name!r} belongs to measure {owner!r}, which no check of this run declared: "
                                 f"add it to the reading check's `measures`") from None

    @property
    def steps(self) -> np.ndarray:
        return self.step0 + np.arange(self.count)


class Consumer(Protocol):
    measures: tuple[str, ...]  # the measures it reads (drift/check/measures.py)

    def start(self, comparison: "Comparison") -> None: ...
    def consume(self, chunk: MetricsChunk) -> None: ...
    def finish(self) -> None: ...


class Comparison:
    """Observer advancing a :class:`~drift.sim.twin.Float64Twin` with the run and computing, at
    every step, the measures its consumers declare (drift/check/measures.py) -- and only those.

    golden: a :class:`~drift.check.golden.Golden`, ``None`` to look one up for the config, or
    ``False`` for none. The twin runs on the run's device, or on the CPU when that device
    lacks float64 (NPU). fail_fast: end the run (StopRun) after the first chunk in which a
    consumer recorded a failure (its ``first_fail``).
    """

    fail_fast = False

    def __init__(self, consumers: Sequence[Consumer] = (), golden: Golden | None | bool = None):
        self.consumers = list(consumers)
        self._golden_arg = golden
        self.golden: Optional[Golden] = None
        self.golden_note = ""
        self.sim = None
        # Called as listener(step, twin) once the twin has advanced through decode step ``step`` (the
        # twin runs per batch, after the steps: an observer that needs the truth at a step asks here).
        self.twin_listeners = []

    # -------------------------------------------------------------- lifecycle
    def on_start(self, sim) -> None:
        self.sim = sim
        cfg = sim.cfg
        if self._golden_arg is None:
            self.golden, self.golden_note = load_golden(cfg)
        elif self._golden_arg is False:
            self.golden, self.golden_note = None, "golden not requested"
        else:
            self.golden, self.golden_note = self._golden_arg, self._golden_arg.describe()
        dev = sim.device if supports_float64(sim.device) else torch.device("cpu")
        self.ref_device = dev
        self.twin = Float64Twin(cfg, sim.stream.params, dev, sim.prefill_state, sim.prefill_window)
        S, L, R, HV = sim.stream.chunk_steps, cfg.num_layers, cfg.num_requests, cfg.num_v_heads
        self.measures = declared(self.consumers)
        self.keep_states = any(m.states for m in self.measures)
        self.keep_deltas = any(m.deltas for m in self.measures)
        self.buf: dict[str, torch.Tensor] = {}
        for m in self.measures:
            self.buf.update({k: torch.zeros(S, L, R, HV, dtype=F64, device=dev) for k in m.head})
            self.buf.update({k: torch.ones(S, L, R, HV, dtype=torch.bool, device=dev) for k in m.flags})
            self.buf.update({k: torch.zeros(S, R, dtype=F64, device=dev) for k in m.row})
        self._host: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []
        self._snap = None  # per-step snapshots of the current batch (allocated at the first step)
        self._pending = []
        self.golden_positions = 0  # committed positions validated against golden
        self.golden_checkpoints = 0
        self.golden_limit = None
        self.beyond_golden_steps = 0
        if self.golden is not None:
            ga = self.golden.arrays
            self.gold = {k: torch.from_numpy(ga[k]).to(dev, F64) for k in
                         ("proj_state", "state_norm", "proj_out", "proj_u", "proj_w", "proj_wo")}
            self.golden_ckpt = {int(p): i for i, p in enumerate(ga["ckpt_pos"])}
            self.golden_limit = self.golden.max_position
        for m in self.measures:
            if m.start is not None:
                m.start(self)
        for c in self.consumers:
            c.start(self)

    # ------------------------------------------------------------------- step
    def _marks(self, pre: np.ndarray, accept: np.ndarray) -> Optional[np.ndarray]:
        """Draft step at which each row passes a golden checkpoint position this step (-1: none)."""
        if self.golden is None or "gold_ckpt_dev" not in self.buf:
            return None
        mark = np.full(len(pre), -1, np.int64)
        for r, (p0, acc) in enumerate(zip(pre, accept)):
            for c in range(int(p0) + 1, int(p0 + acc) + 1):
                if c in self.golden_ckpt:
                    mark[r] = c - int(p0) - 1
        return mark if (mark >= 0).any() else None

    def _views(self, view) -> dict[str, torch.Tensor]:
        """What a step leaves to compare, as views of the run (its device, its dtypes): committed
        states, outputs and conv windows of the active rows, and the step's true inputs."""
        flow, R = self.sim.flow, self.sim.cfg.num_requests
        return {"run": flow.committed_states(), "out": view.out[:, :R], "win": flow.committed_windows(),
                "x": view.x[:, :R], "a": view.a[:, :R], "b": view.b[:, :R]}

    def on_step(self, view) -> None:
        """Snapshot the step (a few device copies); the comparison itself runs once per batch of
        up to ``batch`` steps (:data:`BATCH_BYTES` of snapshots, at most a chunk)."""
        views = self._views(view)
        if self._snap is None:  # the twin's committed state of each step is held too, when kept
            per_step = sum(t.numel() * t.element_size() for t in views.values()) + (
                self.twin.state.numel() * self.twin.state.element_size() if self.keep_states else 0)
            self.batch = int(max(1, min(self.sim.stream.chunk_steps, BATCH_BYTES // max(per_step, 1))))
            self._snap = {k: torch.empty((self.batch, *t.shape), dtype=t.dtype, device=t.device)
                          for k, t in views.items()}
        j = len(self._pending)
        for k, t in views.items():
            self._snap[k][j].copy_(t)
        extra = {m.key: m.snapshot(self, view) for m in self.measures if m.snapshot is not None}
        self._host.append((view.step, view.pre.copy(), view.accept.copy(), view.track.copy()))
        self._pending.append((view.index, view.pre.copy(), view.accept.copy(), view.track.copy(), extra,
                              view.step))
        if len(self._pending) == self.batch:
            self._process()

    def _process(self) -> None:
        """Advance the twin through the buffered steps, keeping its values at each (with the
        committed states when a measure reads them), then let each measure compute over the batch
        (``on_batch``); a measure with an ``on_step`` hook (and each twin listener) is also called
        after every step, with the twin at that step."""
        n = len(self._pending)
        if n == 0:
            return
        twin, dev, D = self.twin, self.ref_device, self.sim.cfg.num_draft_tokens
        pending = self._pending
        batch = Batch(
            n=n, snap={k: v[:n].to(dev) for k, v in self._snap.items()}, idx=[p[0] for p in pending],
            pre=np.stack([p[1] for p in pending]), accept=np.stack([p[2] for p in pending]),
            marks=[self._marks(p[1], p[2]) for p in pending],
            extra={m.key: [p[4][m.key] for p in pending] for m in self.measures if m.snapshot is not None})
        stepwise = [m.on_step for m in self.measures if m.on_step is not None]

        def after_twin_step(j: int) -> None:
            for listener in self.twin_listeners:
                listener(pending[j][5], twin)
            for on_step in stepwise:
                on_step(self, batch, j)

        batch.twin = twin.advance_batch(batch.snap["x"], batch.snap["a"], batch.snap["b"], batch.accept,
                                        np.stack([p[3] for p in pending]), batch.marks,
                                        after_twin_step if stepwise or self.twin_listeners else None,
                                        keep_states=self.keep_states, keep_deltas=self.keep_deltas)
        batch.m = torch.arange(D, device=dev)[None, None, :] < torch.from_numpy(batch.accept).to(dev)[:, :, None]
        batch.rows = torch.tensor(batch.idx, dtype=torch.int64, device=dev)
        for m in self.measures:
            if m.on_batch is not None:
                m.on_batch(self, batch)
        self._pending.clear()

    # ------------------------------------------------------------------ flush
    def flush(self) -> None:
        self._process()
        if not self._host:
            return
        n = len(self._host)
        arrays = {k: v[:n].cpu().numpy().copy() for k, v in self.buf.items()}
        for k, v in self.buf.items():
            v[:n] = 1 if v.dtype == torch.bool else 0  # flags start True, sums at 0
        arrays["pre"] = np.stack([h[1] for h in self._host])
        arrays["accept"] = np.stack([h[2] for h in self._host])
        arrays["track"] = np.stack([h[3] for h in self._host])
        chunk = MetricsChunk(self._host[0][0], n, arrays)
        self._host.clear()
        stop = None
        for c in self.consumers:  # every consumer sees the chunk, even after a fatal finding
            try:
                c.consume(chunk)
            except StopRun as why:
                stop = stop or why
        if stop is None and self.fail_fast:
            failed = [c for c in self.consumers if getattr(c, "first_fail", None)]
            if failed:
                stop = StopRun(f"fail-fast: {failed[0].name} first over its limit at {failed[0].first_fail}")
        if stop is not None:
            raise stop

    def on_end(self) -> None:
        for c in self.consumers:
            c.finish()

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Counters and the twin's state (taken between chunks, after a flush)."""
        return {"golden_positions": self.golden_positions, "golden_checkpoints": self.golden_checkpoints,
                "beyond_golden_steps": self.beyond_golden_steps,
                "twin_state": saveable(self.twin.state), "twin_window": saveable(self.twin.window),
                "consumers": [c.state_dict() if hasattr(c, "state_dict") else None for c in self.consumers],
                **({"measures": carried} if (carried := {m.key: st for m in self.measures
                                                         if m.save is not None and (st := m.save(self))}) else {})}

    def load_state_dict(self, state: dict) -> None:
        self.golden_positions = state["golden_positions"]
        self.golden_checkpoints = state["golden_checkpoints"]
        self.beyond_golden_steps = state["beyond_golden_steps"]
        self.twin.state.copy_(state["twin_state"])
        self.twin.window = state["twin_window"].to(self.twin.window.device)
        for c, cs in zip(self.consumers, state["consumers"]):
            if cs is not None:
                c.load_state_dict(cs)
        for m in self.measures:
            if m.load is not None and m.key in state.get("measures", {}):
                m.load(self, state["measures"][m.key])

    def reference_description(self) -> str:
        dev = self.ref_device
        if self.golden is None:
            return f"float64 twin computed alongside on {dev} ({self.golden_note}; falling back to the twin)"
        text = (f"{self.golden_note}; float64 twin on {dev} validated against it at "
                f"{self.golden_positions} committed positions and {self.golden_checkpoints} checkpoints")
        if self.beyond_golden_steps:
            text += (f"; {self.beyond_golden_steps} steps reached past golden position {self.golden_limit} "
                     "and were checked against the float64 twin alone")
        return text
