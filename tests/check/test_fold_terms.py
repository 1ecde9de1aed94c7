"""The kernel-commit design's bound terms (docs/bounds.md §9): the float64 twin's per-token deltas,
the fold_terms measure, and the BoundCheck built from a design -- each term what holds its design
within the bound (negative control: the same run judged without the term fails), SGLang's default
adding none, and the measure's carried state surviving a checkpoint."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from drift import checkpoint
from drift.check.bounds import BoundCheck, fold_rounding_of
from drift.check.registry import RunContext
from drift.config import flow_options, preset
from drift.flows.fold_model import FoldSchedule
from drift.flows.registry import FLOWS
from drift.runner import CheckedRun, run_checked
from drift.runspec import resolve
from drift.sim import kernels

FLOW = next(f for f in FLOWS if FLOWS[f].kind == "kernel-commit")
F64 = torch.float64


def _run(steps, profile="ascend", rounding="rne", **options):
    cfg = preset("ci-small", flow=FLOW, steps=steps, store_rounding=rounding,
                 flow_options=flow_options(**options)).with_profile(profile)
    return resolve(cfg)


def _worst(run, fold="design", steps=None):
    """The worst bound ratio of ``run`` judged with its design's terms (``fold="design"``), none
    (None), or a FoldRounding given."""
    fr = fold_rounding_of(RunContext(run.cfg, run.mode)) if fold == "design" else fold
    bound = BoundCheck(fold=fr)
    run_checked(run, steps=steps, checks=[bound], golden=False, sync_scan=False, diagnose=False)
    return bound.worst


def test_the_twins_deltas_rebuild_its_states():
    """S_end = e^G S_0 + sum_t w_t d_t k_t^T over a step's accepted tokens (w_t their decay to the
    end): the deltas and keys the twin exposes are the recurrence's, to float64 rounding. Negative
    control: leaving one token's delta out breaks the identity."""
    gen = torch.Generator().manual_seed(2)
    L, N, D, HV, K, V = 2, 3, 4, 2, 16, 16
    state = torch.randn(L, N, HV, V, K, generator=gen, dtype=F64)
    k = torch.nn.functional.normalize(torch.randn(L, N, D, HV, K, generator=gen, dtype=F64), dim=-1)
    q, v = torch.randn(L, N, D, HV, K, generator=gen, dtype=F64), torch.randn(L, N, D, HV, V, generator=gen, dtype=F64)
    decay = torch.rand(L, N, D, HV, generator=gen, dtype=F64) * 0.5 + 0.5
    beta = torch.rand(L, N, D, HV, generator=gen, dtype=F64)
    take = torch.tensor([4, 2, 1])
    start = state.clone()
    deltas = torch.empty(L, N, D, HV, V, dtype=F64)
    kernels.gdn_decode(state, torch.arange(N), q, k, v, decay, beta, take, compute_dtype=F64, deltas_out=deltas)
    live = (torch.arange(D)[None, :] < take[:, None])[None, :, :, None]
    logd = torch.where(live, decay.log(), torch.zeros_like(decay))
    w = torch.exp(torch.flip(torch.cumsum(torch.flip(logd, [2]), 2), [2]) - logd) * live
    rebuilt = start * torch.exp(logd.sum(2))[..., None, None] + torch.einsum("lndh,lndhv,lndhk->lnhvk", w, deltas, k)
    assert torch.allclose(rebuilt, state, rtol=0, atol=1e-12 * state.abs().max().item())
    assert (deltas[:, 1, 2:] == 0).all()  # past a row's accepted tokens: no delta
    w[:, 0, 1] = 0
    broken = start * torch.exp(logd.sum(2))[..., None, None] + torch.einsum("lndh,lndhv,lndhk->lnhvk", w, deltas, k)
    assert not torch.allclose(broken, state, rtol=0, atol=1e-6)


def test_sglangs_default_design_adds_no_term():
    """SGLang 0.5.23's design, bf16 or fp32 checkpoint: the bound is §1-§5's, no fold_terms measure."""
    for profile in ("ascend", "fp32"):
        run = _run(8, profile)
        assert BoundCheck(fold=fold_rounding_of(RunContext(run.cfg, run.mode))).measures == BoundCheck.measures
    tf32 = _run(8, "fp32", fold_contraction="tf32")
    assert "fold_terms" in BoundCheck(fold=fold_rounding_of(RunContext(tf32.cfg, tf32.mode))).measures


@pytest.mark.parametrize("profile,options,term", [
    ("fp32", dict(fold_contraction="tf32", ring_records="fp32", fold_cadence="every-commit"), "operand_bits"),
    ("fp32", dict(fold_contraction="tf32"), "operand_bits"),  # ring-full: the pending records' path
    ("fp32", dict(ring_records="bf16"), "record_bits"),
])
def test_each_term_holds_its_design_within_the_bound(profile, options, term):
    """The design within its bound, and out of it when that term is dropped from the model: the term
    is what the derivation needs (over 96 steps of ci-small; the full calibration: docs/bounds.md §9)."""
    run = _run(96, profile, **options)
    fr = fold_rounding_of(RunContext(run.cfg, run.mode))
    assert _worst(run) < 1.0
    assert _worst(run, dataclasses.replace(fr, **{term: None})) > 1.5


def test_a_request_start_restarts_its_rows_fold_count(monkeypatch):
    """Under the serving lifecycle a request that takes a row starts with an empty ring (SGLang's alloc
    zeroes a fresh row's cursors): the fold_terms measure restarts that row's schedule and pending
    records, and a lazy TF32 design stays within its bound over 128 steps. Negative control: with the
    restart dropped the bound counts the previous request's records and misplaces the folds (26x here)."""
    cfg = preset("ci-small", flow=FLOW, steps=128, lifecycle="serving",
                 flow_options=flow_options(fold_contraction="tf32")).with_profile("fp32")
    assert _worst(resolve(cfg)) < 1.0
    monkeypatch.setattr(FoldSchedule, "restart", lambda self, rows: None)
    assert _worst(resolve(cfg)) > 2.0


def test_a_lazy_fold_of_a_bf16_checkpoint_stores_only_when_it_folds():
    """ring-full on a bf16 checkpoint: within the bound that stores at the folds (and rounds a compared
    state with records pending once); judged as if every step stored, the bound is looser (the
    envelope piles up roundings that never happen), never tighter."""
    run = _run(96, "ascend", fold_cadence="ring-full")
    fr = fold_rounding_of(RunContext(run.cfg, run.mode))
    lazy = _worst(run)
    assert lazy < 1.0
    every = _worst(run, dataclasses.replace(fr, when_full=False, every=1))
    assert every < lazy


def test_the_measures_carried_state_survives_a_checkpoint(tmp_path):
    """A run of a lazy TF32 design checkpointed at its first chunk boundary (step 256; through a file,
    weights_only) and resumed ends with the same results as the uninterrupted run: the fold schedule and
    the pending records are carried (Comparison.state_dict's "measures")."""
    steps = 300

    def checked():
        return CheckedRun(_run(steps, "fp32", fold_contraction="tf32"), golden=False)

    whole = checked()
    info = whole.run(steps)
    want = {r.key: r.worst for r in whole.results(info, sync_scan=False)}
    saved = []
    first = checked()
    first.run(steps, checkpoint=lambda done, snap: saved.append((done, snap)), checkpoint_every=256)
    done, snap = saved[0]
    assert "measures" in snap["observers"][0] and "fold_terms" in snap["observers"][0]["measures"]
    path = tmp_path / "ck.pt"
    checkpoint.save(path, snap)
    resumed = checked()
    info = resumed.run(steps, resume_state=checkpoint.load(path))
    got = {r.key: r.worst for r in resumed.results(info, sync_scan=False)}
    assert got["drift_bound"] == want["drift_bound"] and got == want
    # Control: a default-design run's checkpoint carries no measure state (its format is as before).
    plain = CheckedRun(resolve(preset("ci-small", flow=FLOW, steps=steps)), golden=False)
    snaps = []
    plain.run(steps, checkpoint=lambda d, s: snaps.append(s), checkpoint_every=256)
    assert "measures" not in snaps[-1]["observers"][0]
