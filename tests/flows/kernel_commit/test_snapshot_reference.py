"""drift.flows.kernel_commit.reference: a ReplaySSM tracked snapshot, mid-window included, against its
exact reference (the run's own checkpoint before the commit folded to the tracked token in float64) --
within the rounding the fold may add in every design, and out of it for a snapshot a thousandth off."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import python_json, run_sim
from drift.config import flow_options, preset
from drift.flows.kernel_commit import reference

FLOW = "sglang-replayssm"
DESIGNS = [  # (profile, store rounding, design options): every cadence, contraction and ring record kind
    ("ascend", "rne", {}),  # bf16 checkpoint, fold every commit
    ("fp32", "rne", {}),  # fp32 checkpoint, folded when the ring fills: snapshots mid-window
    ("fp32", "rne", dict(fold_contraction="tf32")),
    ("ascend", "rne", dict(fold_cadence="every:3")),
    ("ascend", "stochastic", {}),
    ("fp32", "rne", dict(ring_records="fp16")),  # split parts below fp16's normal range
]


def _cfg(profile, rounding, options, steps=192, lifecycle="serving"):
    return preset("ci-small", flow=FLOW, steps=steps, lifecycle=lifecycle, store_rounding=rounding,
                  flow_options=flow_options(**options)).with_profile(profile)


def _mismatches(flow, snapshot) -> torch.Tensor:
    """A snapshot's bit mismatches as the comparison counts them: its own, and its reference's."""
    _, got, _, bits_bad, ref = snapshot
    return bits_bad + flow.reference_mismatches(got, ref)


def _deviations(cfg) -> list[float]:
    """The largest deviation of each tracked step's snapshots (in units of the derived rounding)."""
    seen = []

    def probe(sim, view):
        if (view.track >= 0).any():
            _, got, _, _, ref = sim.flow.tracked_snapshot(view.track)
            seen.append(float(reference.snapshot_deviation(sim.flow.pool.design, got, ref).max()))

    run_sim(cfg, None, on_step=probe)
    return seen


@pytest.mark.parametrize("profile,rounding,options", DESIGNS, ids=lambda x: str(x))
def test_every_snapshot_is_its_checkpoint_folded_to_the_token_within_the_derived_rounding(profile, rounding, options):
    """Under request churn (prefix hits, reused rows) every snapshot is within the derivation's worst case
    (at most 1; the check allows MARGIN = 4 times it). Calibration on this box: 0.99 at most (a bf16
    store's half ulp), 0.93 for rounded operands, 0.51 for an fp16 ring."""
    seen = _deviations(_cfg(profile, rounding, options))
    assert len(seen) > 20
    assert max(seen) <= 1.0, max(seen)


def test_a_snapshot_a_thousandth_off_is_outside_though_within_the_relative_limit():
    """Negative control: the first mid-window snapshot of an fp32 checkpoint, scaled by 1 + 1e-3 -- 250 times
    below the tracked-snapshot check's 0.25 relative limit -- is outside its reference in most elements;
    the snapshot as written is outside in none."""
    cfg = _cfg("fp32", "rne", {}, steps=64, lifecycle="fixed")
    found = []

    def probe(sim, view):
        flow, pool = sim.flow, sim.flow.pool
        if found or not (view.track >= 0).any():
            return
        lanes = np.nonzero(view.track >= 0)[0]
        mid = (pool.write_pos.index_select(0, pool.lane_ring_rows[torch.from_numpy(lanes)]) > 0).numpy()
        if not mid.any():
            return
        tslots, _ = flow.track_windows(torch.from_numpy(lanes))
        clean = _mismatches(flow, flow.tracked_snapshot(view.track))
        held = pool.states[:, tslots].clone()
        pool.states[:, tslots] = held * (1 + 1e-3)
        off = _mismatches(flow, flow.tracked_snapshot(view.track))
        pool.states[:, tslots] = held
        found.append((clean, off, mid, held[0, 0].numel() * held.shape[0]))

    run_sim(cfg, None, on_step=probe)
    (clean, off, mid, elements), = found
    assert (clean == 0).all()
    assert (off[torch.from_numpy(mid)] > elements // 2).all()


def test_the_reference_is_kept_only_where_the_run_tracks():
    """The checkpoints the commit starts from are copied per step only when tracking is on (their cost)."""
    from drift.flows.registry import state_flow

    on = state_flow(_cfg("fp32", "rne", {}, steps=8, lifecycle="fixed"), torch.device("cpu"))
    off = state_flow(_cfg("fp32", "rne", {}, steps=8, lifecycle="fixed").replace(track_interval=0), torch.device("cpu"))
    assert on._before is not None and on._before.shape[1] == on.cfg.num_requests
    assert off._before is None


_PLACED = """
import json
from drift import preset
from drift.runner import TIMINGS, run_checked
from drift.runspec import RunSpec

rep = run_checked(RunSpec(preset="ci-small", steps=192, flow="sglang-replayssm", profile="fp32", lifecycle="serving",
                          update=UPDATE).resolve(), sync_scan=False)
d = rep.to_dict()
where = d["run"]["pace"]["thread"]
d["run"] = {k: v for k, v in d["run"].items() if k not in TIMINGS}
print(json.dumps({"where": where, "figures": d,
                  "tracked": [c.to_dict() for c in rep.checks if c.name == "tracked snapshots"]}))
"""


@pytest.mark.parametrize("update", ["sglang-0.5.23-replayssm", "mutant:replay_track_one_short"])
def test_the_reference_counted_in_the_comparisons_process_is_the_one_counted_in_the_runs(update):
    """The snapshot's reference is gathered in the run's process and folded where the comparison runs
    (KernelCommitFlow.reference_mismatches): a run compared in a forked process reports what one compared
    in the simulation's thread reports, the update as shipped (snapshots within their reference) and a
    track slot one record short (outside it: the tracked-snapshot check fails in both)."""
    code = _PLACED.replace("UPDATE", repr(update))
    # one OpenBLAS thread, as the drift command sets it: numpy's pool would keep the interpreter from forking
    serial = python_json(code, DRIFT_COMPARISON="serial", OPENBLAS_NUM_THREADS="1")
    forked = python_json(code, DRIFT_COMPARISON="process", OPENBLAS_NUM_THREADS="1")
    assert (serial["where"], forked["where"]) == ("simulation", "process")
    assert forked["figures"] == serial["figures"]
    (tracked,) = serial["tracked"]
    assert tracked["failed"] == (update != "sglang-0.5.23-replayssm"), tracked
