"""Run-level checks: verdicts taken from the finished run rather than from per-step metrics -- the
host-sync scan of the update (computed by drift.syncs.scan, handed in through the run context) and
the graph capture of the decode step (docs/semantics.md §11)."""

from __future__ import annotations

from typing import Optional

import torch

from ..sim.graph import GraphStatus
from .registry import CHECKS, CheckSpec, RunContext
from .result import CheckResult


def graph_result(status: GraphStatus, syncs: Optional[CheckResult], device: torch.device) -> CheckResult:
    """The "graph capture" check: could the decode step (update included) be captured as SGLang's
    graph mode captures it (docs/semantics.md §11)? On a device with graphs the capture answers;
    where there is none (a CPU) the host-syncs check on the virtual device answers the same
    question; with graph mode off (``--no-graph``) it is not asked."""
    name = CHECKS.title("graph_capture")
    extra = {"graph": status.state}
    if status.captured:
        return CheckResult(name, True, 0.0, 0.0, "", status.note, extra)
    if status.failed:
        return CheckResult(name, False, 1.0, 0.0, status.where or "(no line outside torch)",
                           f"{status.error}; {status.note}. A step that cannot be captured breaks SGLang's "
                           "graph mode: keep the update device-side (no .item(), bool(tensor), data-dependent "
                           "shapes).", extra)
    if status.note.startswith("eager: "):  # not requested, or a host input the step needs
        return CheckResult(name, True, None, None, "", status.note, {**extra, "applicable": False})
    if syncs is None:
        return CheckResult(name, True, None, None, "", f"{status.note}; the host-syncs scan was off",
                           {**extra, "applicable": False})
    # Reported, not gated: the host-syncs result above already gates the same finding.
    return CheckResult(name, syncs.passed, syncs.worst, syncs.limit, syncs.where,
                       f"{status.note}; the host-syncs check on the virtual device answers: "
                       f"{'no host sync, capturable' if syncs.passed else 'a host sync, which breaks capture'}",
                       {**extra, "answered_by": "host_syncs", "role": "info"})


def _mtp(ctx: RunContext) -> bool:
    return ctx.mode == "mtp"


for _spec in (
    CheckSpec("host_syncs", "host syncs", 120, "a host-device sync in the update, on the steps the scan runs "
              "(docs/semantics.md §8)", "run", applies=_mtp,
              result=lambda ctx: ctx.sync_scan() if ctx.sync_scan is not None else None),
    CheckSpec("graph_capture", "graph capture", 130, "on CUDA / NPU: the step (update included) cannot be captured "
              "in a device graph, naming the op and line; on a CPU answered by the host-syncs check (reported, not "
              "gated); not asked with `--no-graph`", "run", applies=_mtp,
              result=lambda ctx: graph_result(ctx.sim.graph_status, ctx.results.get("host_syncs"), ctx.sim.device)),
):
    CHECKS.add(_spec)
