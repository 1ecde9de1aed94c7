"""Comparison of a run against its float64 twin, step by step.

:class:`Comparison` is the observer: it advances the twin with each step's true
inputs and reduces the differences on the device into per-step arrays, which it
hands, one chunk of steps at a time, as a :class:`MetricsChunk` to its consumers
(the checks of :mod:`drift.checks`, the bound model, the curve recorder).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch

from .devices import supports_float64
from .reference import F64, Float64Twin


@dataclass
class MetricsChunk:
    """Per-step reductions for ``count`` steps from ``step0`` (host numpy arrays).

    ``[S, L, R, HV]`` float64: err2 / ref2 (committed state, squared Frobenius norms of
    run - twin and of twin), run2 (of run), out_err2 / out_ref2 (outputs of the accepted
    tokens), trk_err2 / trk_ref2 (tracked state vs twin at the boundary);
    finite ``[S, L, R, HV]`` bool (run state has no NaN/Inf).
    ``[S, R]`` int: conv_bad (window elements differing from the twin), trk_bits_bad
    (tracked state elements differing from what the run held at the boundary),
    trk_conv_bad; pre, accept, track (host schedule; track = -1 when not tracked).
    """

    step0: int
    count: int
    err2: np.ndarray
    ref2: np.ndarray
    run2: np.ndarray
    finite: np.ndarray
    out_err2: np.ndarray
    out_ref2: np.ndarray
    conv_bad: np.ndarray
    trk_err2: np.ndarray
    trk_ref2: np.ndarray
    trk_bits_bad: np.ndarray
    trk_conv_bad: np.ndarray
    pre: np.ndarray
    accept: np.ndarray
    track: np.ndarray

    @property
    def steps(self) -> np.ndarray:
        return self.step0 + np.arange(self.count)


class Consumer(Protocol):
    def start(self, sim) -> None: ...
    def consume(self, chunk: MetricsChunk) -> None: ...
    def finish(self) -> None: ...


_PER_HEAD = ("err2", "ref2", "run2", "out_err2", "out_ref2", "trk_err2", "trk_ref2")
_PER_ROW = ("conv_bad", "trk_bits_bad", "trk_conv_bad")


class Comparison:
    """Observer comparing committed states, tracked snapshots, conv windows and outputs
    of the active rows with a :class:`~drift.reference.Float64Twin` at every step."""

    def __init__(self, consumers: Sequence[Consumer] = ()):
        self.consumers = list(consumers)
        self.sim = None

    def on_start(self, sim) -> None:
        self.sim = sim
        cfg = sim.cfg
        dev = sim.device if supports_float64(sim.device) else torch.device("cpu")
        self.ref_device = dev
        self.twin = Float64Twin(cfg, sim.stream.params, dev, sim.prefill_state, sim.prefill_window)
        S, L, R, HV = sim.stream.chunk_steps, cfg.num_layers, cfg.num_requests, cfg.num_v_heads
        self._buf = {k: torch.zeros(S, L, R, HV, dtype=F64, device=dev) for k in _PER_HEAD}
        self._buf["finite"] = torch.ones(S, L, R, HV, dtype=torch.bool, device=dev)
        self._buf.update({k: torch.zeros(S, R, dtype=torch.int64, device=dev) for k in _PER_ROW})
        self._host: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []
        self._step0 = None
        for c in self.consumers:
            c.start(sim)

    def on_step(self, view) -> None:
        sim, cfg, twin, buf, i = self.sim, self.sim.cfg, self.twin, self._buf, view.index
        pool, R, dev = sim.pool, cfg.num_requests, self.ref_device
        if self._step0 is None:
            self._step0 = view.step
        self._host.append((view.step, view.pre.copy(), view.accept.copy(), view.track.copy()))
        twin.advance(view.x[:, :R], view.a[:, :R], view.b[:, :R], view.accept, view.track)
        run = pool.ssm_kv[:, pool.active_slots].to(dev, F64)  # [L, R, HV, K, V]
        buf["err2"][i] = (run - twin.state).square().sum((-1, -2))
        buf["ref2"][i] = twin.state.square().sum((-1, -2))
        buf["run2"][i] = run.square().sum((-1, -2))
        buf["finite"][i] = torch.isfinite(run).all(-1).all(-1)
        # Outputs of the accepted tokens only.
        acc = torch.from_numpy(view.accept).to(dev)
        m = (torch.arange(cfg.num_draft_tokens, device=dev)[None, :] < acc[:, None])  # [R, D]
        o_run = view.out[:, :R].to(dev, F64)
        m5 = m[None, :, :, None, None]
        buf["out_err2"][i] = ((o_run - twin.out) * m5).square().sum((2, 4))
        buf["out_ref2"][i] = (twin.out * m5).square().sum((2, 4))
        Km1 = cfg.conv_kernel - 1
        win = pool.conv[:, pool.active_slots, cfg.conv_window - Km1:].to(dev, F64)
        buf["conv_bad"][i] = (win != twin.window).sum((0, 2, 3))
        tracked = view.track >= 0
        if sim.mode == "mtp" and tracked.any():
            rows = np.nonzero(tracked)[0]
            rows_t = torch.from_numpy(rows).to(sim.device)
            tslots = pool.row_track_slots[rows_t]
            got = pool.ssm_kv[:, tslots]  # [L, n, HV, K, V] in the state dtype
            held = pool.inter_kv[:, rows_t, torch.from_numpy(view.track[rows]).to(sim.device)]
            bits = lambda t: t.view({2: torch.int16, 4: torch.int32}[t.element_size()])
            rows_d = torch.from_numpy(rows).to(dev)
            buf["trk_bits_bad"][i].index_copy_(0, rows_d, (bits(got) != bits(held)).sum((0, 2, 3, 4)).to(dev))
            got64 = got.to(dev, F64)
            ref = twin.track_state[:, rows_d]
            buf["trk_err2"][i][:, rows_d] = (got64 - ref).square().sum((-1, -2))
            buf["trk_ref2"][i][:, rows_d] = ref.square().sum((-1, -2))
            twin_w = pool.conv[:, tslots, cfg.conv_window - Km1:].to(dev, F64)
            buf["trk_conv_bad"][i].index_copy_(0, rows_d, (twin_w != twin.track_window[:, rows_d]).sum((0, 2, 3)))

    def flush(self) -> None:
        if not self._host:
            return
        n = len(self._host)
        arrays = {k: v[:n].cpu().numpy().copy() for k, v in self._buf.items()}
        for k, v in self._buf.items():
            v[:n] = 1 if k == "finite" else 0
        chunk = MetricsChunk(
            step0=self._host[0][0], count=n,
            pre=np.stack([h[1] for h in self._host]), accept=np.stack([h[2] for h in self._host]),
            track=np.stack([h[3] for h in self._host]), **arrays)
        self._host.clear()
        for c in self.consumers:
            c.consume(chunk)

    def on_end(self) -> None:
        for c in self.consumers:
            c.finish()
