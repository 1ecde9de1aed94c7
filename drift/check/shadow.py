"""The sequential shadow: the same stream through sequential (non-MTP) decode in lockstep, and
the MTP-vs-sequential divergence of the committed states (sglang #25587), reported, not gated."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

import numpy as np
import torch

from ..checkpoint import restore, saveable
from ..sim.twin import F64
from ..simulate import Simulation
from .metrics import DriftCurves
from .registry import CHECKS, CheckSpec
from .result import CheckResult, locate


class SequentialShadow:
    """Observer: runs the same stream through sequential (non-MTP) decode in lockstep and
    measures the MTP-vs-sequential divergence of the committed states (sglang #25587):
    ``||h_mtp - h_seq||_F / ||h_mtp||_F`` per (layer, row, head) and step."""

    name = property(lambda self: CHECKS.title("mtp_vs_sequential"))

    def __init__(self):
        self.worst = -math.inf
        self.where = ""
        self.final: Optional[np.ndarray] = None
        self.curves = None

    def on_start(self, sim) -> None:
        self.main = sim
        self.seq = Simulation(replace(sim.resolved, mode="sequential"), check_untouched=False, device=sim.device)
        cfg = sim.cfg
        self._buf = torch.zeros(sim.stream.chunk_steps, cfg.num_layers, cfg.num_requests, cfg.num_v_heads,
                                dtype=F64, device=sim.device)
        self._steps: list[int] = []
        self.curves = DriftCurves((cfg.num_layers, cfg.num_v_heads))

    def on_step(self, view) -> None:
        self.seq.advance(1)
        a = self.main.flow.committed_states().to(F64)
        b = self.seq.flow.committed_states().to(F64)
        self._buf[view.index] = (a - b).square().sum((-1, -2)).sqrt() / a.square().sum((-1, -2)).sqrt().clamp(min=1e-300)
        self._steps.append(view.step)

    def flush(self) -> None:
        if not self._steps:
            return
        n = len(self._steps)
        d = self._buf[:n].cpu().numpy()
        i = np.unravel_index(int(np.argmax(np.nan_to_num(d, nan=np.inf))), d.shape)
        if d[i] > self.worst:
            self.worst, self.where = float(d[i]), locate(i, self._steps[0])
        self.final = d[-1]
        self.curves.add("divergence", np.asarray(self._steps) + 1, d)
        self._steps.clear()

    def on_end(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {"worst": self.worst, "where": self.where, "final": saveable(self.final),
                "curves": self.curves.state_dict(), "seq": self.seq.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.worst, self.where, self.final = state["worst"], state["where"], restore(state["final"])
        self.curves.load_state_dict(state["curves"])
        self.seq.load_state_dict(state["seq"])

    def result(self):
        if self.final is None:
            return CheckResult(self.name, False, None, None, "", "no step ran")
        per_head = np.round(self.final.max(1), 5).tolist()
        return CheckResult(self.name, True, self.worst, None, self.where,
                           f"reported, not gated: committed-state divergence; final per (layer, head) {per_head}",
                           extra={"role": "info", "divergence": self.curves.to_dict()})


CHECKS.add(CheckSpec("mtp_vs_sequential", "MTP vs sequential", 100, "never (reported, not gated: the "
                     "MTP-vs-sequential divergence of the committed states, with `--vs-sequential`)", "observer",
                     build=lambda ctx: SequentialShadow(), applies=lambda ctx: ctx.vs_sequential))
