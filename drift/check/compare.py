"""Comparison of a run against its float64 twin (validated against golden data), step by step.

:class:`Comparison` is the observer: it advances the twin with each step's true inputs,
validates the twin against the golden trajectory where one exists, and reduces the
differences on the device into per-step arrays that it hands, one chunk of steps at a
time, as a :class:`MetricsChunk` to its consumers (checks, bound model, curves).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import numpy as np
import torch

from ..checkpoint import restore, saveable
from ..devices import supports_float64
from ..errors import ConfigError
from ..sim.twin import F64, Float64Twin
from ..simulate import StopRun
from .golden import Golden, load_golden
from .measures import MEASURES, Batch, declared
from .forked import ForkedWorker, fork_refusal
from .pipeline import OrderedWorker, worth_a_worker

# Steps the comparison's process lets wait before it compares them (it compared after every message of
# SEND_EVERY = 4 steps): its per-batch costs (the twin's input stage, the measures' stacking) are paid
# once per 16 steps. Default runs alternated with 4: user CPU 15.9-18.7 s against 17.5-19.7 s; 48 made the
# simulation wait longer at each chunk's end (1.2-1.4 s against 0.6-0.8 s). Figures unchanged (the
# comparison is batch-size invariant; report.json equal), 2026-12-07.
HANDED_BATCH = 16
BATCH_BYTES = 64 << 20  # per-step snapshots held between comparisons (a batch is at most a chunk)
# Where the comparison runs (Comparison.pace's "thread"): "process" a forked child (drift.check.forked),
# "worker" a thread (drift.check.pipeline), "simulation" the simulation's own thread. DRIFT_COMPARISON
# asks for one ("process", "thread", "serial"); unset or "auto": the first this run and process allow.
COMPARISON_CHOICES = ("auto", "process", "thread", "serial")


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


@dataclass
class TakenStep:
    """One decode step as the comparison took it when the step ended (:meth:`Comparison._take`).

    views: the run's committed states, outputs, conv windows and true inputs per lane (the run's device
    and dtypes; copies where the step is compared on the worker); pre / accept / track ``[R]`` host int;
    starts: StepView.starts; lanes: (request, start, source, live) host ``[R]`` under a churning
    lifecycle, else None; extra: what each measure's ``snapshot`` took of the run.
    """

    step: int
    index: int  # the step's row in its input chunk
    pre: np.ndarray
    accept: np.ndarray
    track: np.ndarray
    starts: dict
    lanes: Optional[tuple]
    views: dict
    extra: dict


class Consumer(Protocol):
    measures: tuple[str, ...]  # the measures it reads (drift/check/measures.py)

    def start(self, comparison: "Comparison") -> None: ...
    def consume(self, chunk: MetricsChunk) -> None: ...
    def finish(self) -> None: ...


def restart_lanes(twin: Float64Twin, sim, starts: dict, snapshot_truth: dict) -> None:
    """A float64 twin's lanes whose request starts at this step begin at its true start
    (``starts``: lane -> (Start, true state, true window), StepView.starts): a prefill's (given), a
    prefix hit's (its source's snapshot truth, ``snapshot_truth[source] = (position, state, window)``,
    extended by the hit's own prompt tokens); a resumed request's truth is the twin's own."""
    from ..sim.serving import START_PREFILL, START_PREFIX
    from ..sim.twin import extend

    lanes, states, windows = [], [], []
    for lane, (start, state, window) in sorted(starts.items()):
        if start.code == START_PREFILL:
            lanes.append(lane), states.append(state), windows.append(window)
        elif start.code == START_PREFIX:
            P, s_truth, w_truth = snapshot_truth[start.source]
            assert P == start.p0, (P, start)
            st, wd = extend(sim.cfg, sim.stream.tokens, sim.stream.params, [start.request], [start.p0],
                            [start.p1], torch.device("cpu"), s_truth[:, None], w_truth[:, None])
            lanes.append(lane), states.append(st[:, 0]), windows.append(wd[:, 0])
    if lanes:
        twin.reset_lanes(np.asarray(lanes), torch.stack(states, 1), torch.stack(windows, 1))


class Comparison:
    """Observer advancing a :class:`~drift.sim.twin.Float64Twin` with the run and computing, at
    every step, the measures its consumers declare (drift/check/measures.py) -- and only those.

    golden: a :class:`~drift.check.golden.Golden`, ``None`` to look one up for the config, or
    ``False`` for none. The twin runs on the run's device, or on the CPU when that device
    lacks float64 (NPU). fail_fast: end the run (StopRun) after the first chunk in which a
    consumer recorded a failure (its ``first_fail``). pipelined: compare each step while the simulation
    runs the next, where the run has a core for it (:meth:`_choose_where`); forked: do it in a forked
    process (drift.check.forked) where that is safe, else on a worker thread (drift.check.pipeline).
    The same figures either way: the same operations on the same values in the same order.
    """

    fail_fast = False
    pipelined = True
    forked = True

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
        self._host: list[tuple] = []
        self.age = np.zeros(R, np.int64)  # steps each lane's request has decoded (a churning lifecycle)
        self._snapshot_truth: "OrderedDict[int, tuple]" = OrderedDict()  # request -> (position, state, window)
        self._snapshot_cap = 4 * (R + cfg.serving.prefix_cache + 1)
        self._snap = None  # per-step snapshots of the current batch (allocated at the first step)
        self._pending = []
        self._worker: Optional[OrderedWorker | ForkedWorker] = None  # made at the first step
        self._chunk_asked = False  # begin_flush asked the process; flush takes the answer
        self._where = self._choose_where(sim.device, dev)
        self._pipelined = self._where != "simulation"
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

    def _choose_where(self, *devices: torch.device) -> str:
        """Where this run compares (:data:`COMPARISON_CHOICES`): a forked process where the run has a core
        for it (:func:`~drift.check.pipeline.worth_a_worker`) and every measure is drift's own (an
        extension's hooks may keep what its checks read on the comparison, which the child would not hand
        back); a worker thread where it may not fork; the simulation's thread where a twin listener
        watches (it runs with the twin and would race the observers that feed it) or an accelerator runs
        the steps. ``DRIFT_COMPARISON`` asks for one, whatever the cores."""
        choice = os.environ.get("DRIFT_COMPARISON", "").strip().lower() or "auto"
        if choice not in COMPARISON_CHOICES:
            raise ConfigError(f"DRIFT_COMPARISON={choice!r}: expected one of {', '.join(COMPARISON_CHOICES)} "
                              "(unset: auto)")
        if (choice == "serial" or not self.pipelined or self.twin_listeners
                or any(d.type != "cpu" for d in devices)
                or (choice == "auto" and not worth_a_worker(*devices))):
            return "simulation"
        hooks = [f for m in self.measures for f in (m.start, m.snapshot, m.twin_snapshot, m.on_step, m.on_batch,
                                                      m.save, m.load) if f is not None]
        own = all(getattr(f, "__module__", "").startswith("drift.") for f in hooks)
        return "process" if self.forked and own and choice != "thread" else "worker"

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
        states, outputs and conv windows of the lanes, and the step's true inputs (per lane)."""
        flow = self.sim.flow
        return {"run": flow.committed_states(), "out": view.by_lane(view.out), "win": flow.committed_windows(),
                "x": view.by_lane(view.x), "a": view.by_lane(view.a), "b": view.by_lane(view.b)}

    # ------------------------------------------------------------ a churning lifecycle
    def lane_truth(self, lane: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The twin's state ``[L, HV, V, K]`` and window ``[L, Kc-1, C]`` of ``lane`` after the last step the
        simulation ran (float64, CPU): what a resumed request's re-prefill must store."""
        if isinstance(self._worker, ForkedWorker):
            return self._worker.ask("lane", lane)
        self._drain()
        return self._lane_truth_here(lane)

    def _lane_truth_here(self, lane: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._process()
        return self.twin.state[:, lane].cpu(), self.twin.window[:, lane].cpu()

    def _start_lanes(self, starts: dict) -> None:
        """The twin's lanes whose request starts at this step begin at its true start: a prefill's (the
        simulation computed it), a prefix hit's (its source's snapshot truth, the twin's track state
        when the source was last tracked, extended by the hit's own prompt tokens); a resumed request's
        truth is the twin's own (nothing changes): :func:`restart_lanes`. ``starts``: StepView.starts."""
        from .measures import key_columns, row_concentration, state_rows2, ulp_sq

        self._process()  # the twin at the end of the last step
        restart_lanes(self.twin, self.sim, starts, self._snapshot_truth)
        for lane in starts:
            self.age[lane] = 0
        # The size of the start's one rounding (the bound's starting envelope, as a run's first store) and the
        # key-column shares of the state the step starts from: the true start's ulps in the state dtype
        # (the stored start is the truth rounded once).
        every = sorted(starts)
        idx = torch.from_numpy(np.asarray(every, np.int64)).to(self.twin.device)
        dtype = self.sim.pool.temporal.dtype
        u2 = ulp_sq(self.twin.state.index_select(1, idx).to(dtype).to(F64), dtype)  # [L, n, HV, V, K]
        self._start_ulps = {lane: (u2[:, i].sum((-1, -2)).cpu().numpy(), u2[:, i].square().sum((-1, -2)).cpu().numpy())
                            for i, lane in enumerate(every)}
        if getattr(self, "col_frac", None) is not None:
            self.col_frac.index_copy_(1, idx.to(self.col_frac.device), key_columns(u2).to(self.col_frac.device))
            rows = row_concentration(state_rows2(u2), u2.sum((-1, -2)))
            self.row_conc.index_copy_(1, idx.to(self.row_conc.device), rows.to(self.row_conc.device))

    def _keep_snapshot_truths(self, batch) -> None:
        """The twin's track state of every tracked request, by request id (the truth a prefix hit on it
        restores), the newest :data:`SNAPSHOT_TRUTHS` requests' kept."""
        for j, (rows_j, states) in batch.twin.tracked.items():
            req, pre, trk = batch.request[j], batch.pre[j], batch.track[j]
            window = batch.twin.track_window[j]
            for i, lane in enumerate(rows_j.tolist()):
                q = int(req[lane])
                self._snapshot_truth.pop(q, None)
                self._snapshot_truth[q] = (int(pre[lane] + trk[lane] + 1), states[:, i].cpu().clone(),
                                           window[:, lane].cpu().clone())
        while len(self._snapshot_truth) > self._snapshot_cap:
            self._snapshot_truth.pop(next(iter(self._snapshot_truth)))

    def on_step(self, view) -> None:
        """Take the step (:meth:`_take`: a few device copies) and compare it (:meth:`_compare_step`): in the
        comparison's process or on the worker thread where the run has one (:meth:`_choose_where`), else
        here."""
        if self._where == "process":
            self._hand_to_process(view)
            return
        if not self._pipelined:
            self._compare_step(self._take(view, copy=False))
            return
        step = self._take(view, copy=True)
        if self._worker is None:  # at most BATCH_BYTES of taken steps wait for it
            size = sum(t.numel() * t.element_size() for t in step.views.values())
            self._worker = OrderedWorker(self._compare_step, BATCH_BYTES // max(size, 1), "drift-comparison")
        self._worker.submit(step)

    def pace(self) -> dict:
        """Where the comparison ran and how long the simulation waited for it (report.json ``run.pace``,
        a timing like ``wall_s``): ``thread`` "process", "worker" or "simulation" (:data:`COMPARISON_CHOICES`),
        ``simulation_waited_s`` (seconds the simulation's thread spent waiting for the process or worker: room
        in its ring or queue, an answer, a flush; 0 without one).
        A wait near the run's wall time says the comparison, not the step, set the run's pace."""
        worker = getattr(self, "_worker", None)
        return {"thread": getattr(self, "_where", "simulation"),
                "simulation_waited_s": round(worker.waited_s, 3) if worker is not None else 0.0}

    def _drain(self) -> None:
        """Wait for the worker thread to compare every step taken so far (raising what it raised); the
        comparison's process is waited for by asking it (:meth:`ForkedWorker.ask`)."""
        if isinstance(self._worker, OrderedWorker):
            self._worker.drain()

    def _take(self, view, copy: bool) -> "TakenStep":
        """What the comparison needs of the step that just ran, taken before the next step changes the run:
        the run's views (copies when ``copy``: compared later, on the worker), the host schedule, and the
        snapshots of the measures that read the run (``Measure.snapshot``)."""
        plan, lanes = view.schedule, None
        if plan is not None:
            request = plan.request[view.index].copy()
            lanes = (request, plan.start[view.index].copy(), plan.source[view.index].copy(), request >= 0)
        views = self._views(view)
        if copy:
            views = {k: t.clone() for k, t in views.items()}
        return TakenStep(step=view.step, index=view.index, pre=view.pre.copy(), accept=view.accept.copy(),
                         track=view.track.copy(), starts=view.starts, lanes=lanes, views=views,
                         extra={m.key: m.snapshot(self, view) for m in self.measures if m.snapshot is not None})

    # ------------------------------------------------------------ the comparison's process
    def _host_row(self, view) -> np.ndarray:
        """A step's host integers as one int64 row: step, index, pre, accept, track ``[R]`` and, under a
        churning lifecycle, each lane's request, start, source and live ``[R]`` (:meth:`_take`'s lanes)."""
        parts = [np.array([view.step, view.index], np.int64), view.pre, view.accept, view.track]
        plan = view.schedule
        if plan is not None:
            request = plan.request[view.index]
            parts += [request, plan.start[view.index], plan.source[view.index], request >= 0]
        return np.concatenate([np.asarray(p).astype(np.int64, copy=False) for p in parts])

    def _hand_to_process(self, view) -> None:
        """The step's tensors and host row into the comparison's process's ring, and what else the step
        left (its starts, the measures' snapshots of the run) into its next message. The process is
        forked at the first step, with everything it compares with in place."""
        views = self._views(view)
        row = self._host_row(view)
        if self._worker is None:
            refusal = fork_refusal()
            if refusal is not None:  # a thread started since on_start: the worker thread instead
                self._where = "worker"
                self.on_step(view)
                return
            self._host_types = [np.asarray(a).dtype for a in (view.pre, view.accept, view.track)]
            plan = view.schedule
            if plan is not None:
                self._host_types += [plan.request.dtype, plan.start.dtype, plan.source.dtype, np.dtype(bool)]
            try:
                self._worker = ForkedWorker(views, len(row), self._compare_handed, self._process_handed,
                                            {"chunk": lambda _: self._chunk_payload(),
                                             "lane": self._lane_truth_here, "state": lambda _: self._own_state()})
            except OSError:  # no fork, pipe or shared memory to be had (EAGAIN, ENOMEM): the thread instead
                self._where = "worker"
                self.on_step(view)
                return
        extra = {m.key: m.snapshot(self, view) for m in self.measures if m.snapshot is not None}
        self._worker.submit(views, row, (view.starts, extra))

    def _process_handed(self) -> None:
        """In the comparison's process, after each message of steps: compare once HANDED_BATCH steps wait."""
        if len(self._pending) >= HANDED_BATCH:
            self._process()

    def _compare_handed(self, views: dict, row: np.ndarray, meta) -> None:
        """In the comparison's process: one step as :meth:`_hand_to_process` handed it."""
        R = self.sim.cfg.num_requests
        cols = [row[2 + i * R:2 + (i + 1) * R].astype(t) for i, t in enumerate(self._host_types)]
        lanes = tuple(cols[3:]) if len(cols) > 3 else None
        starts, extra = meta
        self._compare_step(TakenStep(step=int(row[0]), index=int(row[1]), pre=cols[0], accept=cols[1],
                                     track=cols[2], starts=starts, lanes=lanes, views=views, extra=extra))

    def _compare_step(self, step: "TakenStep") -> None:
        """Buffer the step; the comparison itself runs once per batch of up to ``batch`` steps
        (:data:`BATCH_BYTES` of snapshots, at most a chunk). Under a churning lifecycle a step where a
        request starts ends the batch before it (the twin's lane restarts)."""
        if step.lanes is not None:
            if step.starts:
                self._start_lanes(step.starts)
            request, start, source, live = step.lanes
            self.age = np.where(live, self.age + 1, self.age)
            L, HV = self.sim.cfg.num_layers, self.sim.cfg.num_v_heads
            start_ulp = np.zeros((2, L, len(live), HV))  # ulp^2 and ulp^4 sums of a start's rounding
            for lane, (u2, u4) in (self._start_ulps.items() if step.starts else ()):
                start_ulp[0, :, lane], start_ulp[1, :, lane] = u2, u4
            lifecycle = (request, start, source, np.where(live, self.age - 1, -1), live, start_ulp)
        else:
            lifecycle = None
        views = step.views
        if self._snap is None:  # the twin's committed state of each step is held too, when kept
            per_step = sum(t.numel() * t.element_size() for t in views.values()) + (
                self.twin.state.numel() * self.twin.state.element_size() if self.keep_states else 0)
            self.batch = int(max(1, min(self.sim.stream.chunk_steps, BATCH_BYTES // max(per_step, 1))))
            self._snap = {k: torch.empty((self.batch, *t.shape), dtype=t.dtype, device=t.device)
                          for k, t in views.items()}
        j = len(self._pending)
        for k, t in views.items():
            self._snap[k][j].copy_(t)
        extra = {**step.extra, **{m.key: m.twin_snapshot(self, step) for m in self.measures
                                  if m.twin_snapshot is not None}}
        self._host.append((step.step, step.pre, step.accept, step.track, lifecycle))
        self._pending.append((step.index, step.pre, step.accept, step.track, extra, step.step, lifecycle))
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
            extra={key: [p[4][key] for p in pending] for key in pending[0][4]})
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
        if pending[0][6] is not None:  # a churning lifecycle: which request each lane ran
            batch.request = np.stack([p[6][0] for p in pending])
            batch.track = np.stack([p[3] for p in pending])
            self._keep_snapshot_truths(batch)
        for m in self.measures:
            if m.on_batch is not None:
                m.on_batch(self, batch)
        if pending[0][6] is not None:  # an idle lane compares nothing: its sums read 0, its flags True
            idle = torch.from_numpy(~np.stack([p[6][4] for p in pending])).to(dev)  # [n, R]
            for buf in self.buf.values():
                rows = buf[batch.rows]  # [n, R] per row, [n, L, R, HV] per head
                mask = idle if rows.dim() == 2 else idle[:, None, :, None]
                fill = torch.ones_like(rows) if buf.dtype == torch.bool else torch.zeros_like(rows)
                buf[batch.rows] = torch.where(mask, fill, rows)
        self._pending.clear()

    # ------------------------------------------------------------------ flush
    def begin_flush(self) -> None:
        """Ask the comparison's process for the chunk's arrays now; :meth:`flush` takes them, so the
        simulation may work while the process finishes the chunk (Simulation.run makes the next chunk's
        inputs). Elsewhere nothing to do."""
        if isinstance(self._worker, ForkedWorker) and not self._chunk_asked:
            self._worker.ask_begin("chunk")
            self._chunk_asked = True

    def flush(self) -> None:
        """The chunk's arrays, from wherever the comparison runs, to every consumer."""
        if isinstance(self._worker, ForkedWorker):
            asked, self._chunk_asked = self._chunk_asked, False
            payload = self._worker.ask_end() if asked else self._worker.ask("chunk")
            if payload is None:
                return
            step0, n, arrays, counters = payload
            self.golden_positions, self.golden_checkpoints, self.beyond_golden_steps = counters
        else:
            self._drain()
            payload = self._chunk_payload()
            if payload is None:
                return
            step0, n, arrays, _ = payload
        self._consume(MetricsChunk(step0, n, arrays))

    def _chunk_payload(self) -> Optional[tuple]:
        """Every step taken so far compared: ``(first step, steps, arrays, golden counters)`` with the
        buffers reset for the next chunk; None when there was no step."""
        self._process()
        if not self._host:
            return None
        n = len(self._host)
        arrays = {k: v[:n].cpu().numpy().copy() for k, v in self.buf.items()}
        for k, v in self.buf.items():
            v[:n] = 1 if v.dtype == torch.bool else 0  # flags start True, sums at 0
        arrays["pre"] = np.stack([h[1] for h in self._host])
        arrays["accept"] = np.stack([h[2] for h in self._host])
        arrays["track"] = np.stack([h[3] for h in self._host])
        if self._host[0][4] is not None:  # a churning lifecycle: request, start (START_*), source, age, live [S, R]
            for i, name in enumerate(("request", "start", "source", "age", "live")):
                arrays[name] = np.stack([h[4][i] for h in self._host])
            ulps = np.stack([h[4][5] for h in self._host])  # [S, 2, L, R, HV]
            arrays["start_ulp2"], arrays["start_ulp4"] = ulps[:, 0], ulps[:, 1]
        step0 = self._host[0][0]
        self._host.clear()
        return step0, n, arrays, (self.golden_positions, self.golden_checkpoints, self.beyond_golden_steps)

    def _consume(self, chunk: MetricsChunk) -> None:
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
        try:
            self._drain()
        finally:  # the run's worker thread or process ends with the run (its close)
            if self._worker is not None:
                self._worker.close()
        for c in self.consumers:
            c.finish()

    def abandon(self) -> None:
        """The run raised (Simulation.run): its worker thread or process ends now, comparing nothing more,
        rather than when the comparison is garbage-collected (an exception kept with its traceback keeps
        it alive: a catalogue of raising mutants kept a process each)."""
        if self._worker is not None:
            self._worker.close()

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Counters and the twin's state (taken between chunks, after a flush), and the consumers'."""
        if isinstance(self._worker, ForkedWorker):
            own = self._worker.ask("state")
        else:
            self._drain()
            own = self._own_state()
        return {**own, "consumers": [c.state_dict() if hasattr(c, "state_dict") else None for c in self.consumers]}

    def _own_state(self) -> dict:
        """What the comparison itself carries (where it runs): counters, the twin, the lanes' ages, the
        measures' state."""
        return {"golden_positions": self.golden_positions, "golden_checkpoints": self.golden_checkpoints,
                "beyond_golden_steps": self.beyond_golden_steps,
                "twin_state": saveable(self.twin.state), "twin_window": saveable(self.twin.window),
                "age": saveable(self.age), "col_frac": saveable(getattr(self, "col_frac", None)),
                "row_conc": saveable(getattr(self, "row_conc", None)),
                "snapshot_truth": [[q, P, saveable(st), saveable(w)] for q, (P, st, w) in self._snapshot_truth.items()],
                **({"measures": carried} if (carried := {m.key: st for m in self.measures
                                                         if m.save is not None and (st := m.save(self))}) else {})}

    def load_state_dict(self, state: dict) -> None:
        self.golden_positions = state["golden_positions"]
        self.golden_checkpoints = state["golden_checkpoints"]
        self.beyond_golden_steps = state["beyond_golden_steps"]
        self.twin.state.copy_(state["twin_state"])
        self.twin.window = state["twin_window"].to(self.twin.window.device)
        if "age" in state:  # a churning lifecycle's lanes; the key-column shares the next step starts from
            self.age = restore(state["age"])
            self._snapshot_truth = OrderedDict((int(q), (int(P), st, w)) for q, P, st, w in state["snapshot_truth"])
            if state.get("col_frac") is not None and getattr(self, "col_frac", None) is not None:
                self.col_frac.copy_(state["col_frac"])
                if state.get("row_conc") is not None:
                    self.row_conc.copy_(state["row_conc"])
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
            past = (f"past the {self.golden.steps} steps the golden data was made for" if self.golden.serving
                    else f"past golden position {self.golden_limit}")
            text += f"; {self.beyond_golden_steps} steps reached {past} and were checked against the float64 twin alone"
        return text
