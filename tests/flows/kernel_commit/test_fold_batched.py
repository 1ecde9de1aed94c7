"""The ReplaySSM commit's fold in one pass (drift/flows/kernel_commit/updates.py: fold_checkpoints,
compensated_fold) against the fold as it was written before, two passes of four einsums: the same
bits on every commit of a real run, the track slots' folds included; a fold summing its four
products in another order differs (the control: the comparison can fail)."""

from __future__ import annotations

import pytest
import torch

from helpers import same_bits
from drift.config import preset
from drift.flows.kernel_commit import updates as rs
from drift.flows.kernel_commit.pool import over_value_heads
from drift.flows.registry import FLOWS
from drift.runspec import resolve
from drift.sim.pool import raw_state
from drift.simulate import Simulation

F32, BF16 = torch.float32, torch.bfloat16
FLOW = next(f for f in FLOWS if FLOWS[f].kind == "kernel-commit")


def _ring(t, slots, base):
    """The ring read in logical order as it was: index_select, then a gather by expanded indices."""
    RL = t.shape[3]
    phys = (base.to(torch.int64)[:, None] + torch.arange(RL)) & (RL - 1)
    rows = t.index_select(1, slots)
    idx = phys[None, :, None, :].expand(rows.shape[0], -1, rows.shape[2], -1)
    if rows.dim() == 5:
        idx = idx[..., None].expand(*idx.shape, rows.shape[4])
    return rows.gather(3, idx)


def _weights(g, length):
    RL = g.shape[-1]
    live = (torch.arange(RL)[None, :] < length.to(torch.int64)[:, None])[None, :, None, :]
    gm = torch.where(live, g, torch.zeros_like(g))
    prefix = torch.cumsum(gm, -1)
    total = prefix[..., -1:]
    return total, torch.where(live, torch.exp(total - prefix), torch.zeros_like(g))


def _einsum_fold(old, d, kh, kl, g, length, order=((0, 0), (0, 1), (1, 0), (1, 1))):
    total, decay = _weights(g, length)
    upd = d * decay[..., None]
    hi = upd.to(BF16).to(F32)
    lo = (upd - hi).to(BF16).to(F32)
    us, ks = (hi, lo), (kh, kl)
    delta = sum(torch.einsum("lnhcv,lnhck->lnhvk", us[u], ks[k]) for k, u in order)
    return old * torch.exp(total)[..., None] + delta


def _two_pass_fold(c, fold=_einsum_fold):
    """fold_checkpoints as it was: the checkpoint's fold and the track slot's, each its own pass."""
    ss, mp = c.h.spec_state, c.h.mamba_pool
    sidx, slot = c.h.state_batch_indices, c.h.req_pool_indices
    valid = sidx > -1
    safe = torch.where(valid, sidx, torch.zeros_like(sidx))
    n_hist = mp.replayssm_spec_write_pos.index_select(0, slot).to(torch.int64)
    active = valid & (mp.replayssm_is_flush.index_select(0, slot) != 0)
    temporal = raw_state(ss.temporal)
    old_raw = temporal.index_select(1, safe)
    old = old_raw.to(F32)
    base = mp.replayssm_cache_base.index_select(0, slot)
    take = lambda t: _ring(t, slot, base).to(F32)  # noqa: E731
    HV = ss.replayssm_g.shape[2]
    kh, kl = (over_value_heads(take(t), HV) for t in (ss.replayssm_k, ss.replayssm_rawk))
    d, g = take(ss.replayssm_d) + take(ss.replayssm_rawv), take(ss.replayssm_g)
    new = fold(old, d, kh, kl, g, n_hist).to(temporal.dtype)
    if c.track is not None:
        has = valid & (c.track > -1) & (c.steps >= 0)
        tslot = torch.where(has, c.track, torch.zeros_like(c.track))
        tnew = fold(old, d, kh, kl, g, torch.clamp(n_hist - c.accept + c.steps + 1, min=0)).to(temporal.dtype)
        temporal.index_copy_(1, tslot, torch.where(has[None, :, None, None, None], tnew, temporal.index_select(1, tslot)))
    temporal.index_copy_(1, safe, torch.where(active[None, :, None, None, None], new, old_raw))


@pytest.fixture(scope="module")
def commits():
    """Every commit of a 48-step run (ci-small, a bf16 checkpoint: a fold at every commit, a track
    boundary every 16 steps), as the fold sees it: the pool's ring and checkpoint after the advance."""
    cfg = preset("ci-small", flow=FLOW, steps=48)
    got = []

    def capture(c):
        pool = c.h._drift_pool
        got.append(({k: t.clone() for k, t in pool.ring_tensors().items()}, pool.temporal.clone(), c))
        rs.fold_checkpoints(c)

    sim = Simulation(resolve(cfg), observers=(), check_untouched=False, graph=False)
    build = rs.SGLANG_0523_REPLAYSSM.but(fold=capture).build("capture")
    sim.update = lambda *args: build(*args)
    sim.advance(cfg.steps)
    return sim.pool, got


def _fold_each(pool, commits, fold):
    out = []
    for ring, temporal, c in commits:
        for name, t in pool.ring_tensors().items():
            t.copy_(ring[name])
        pool.temporal.copy_(temporal)
        fold(c)
        out.append(pool.temporal.clone())
    return out


def test_the_one_pass_fold_gives_the_two_pass_folds_bits(commits):
    pool, got = commits
    assert sum(c.track is not None and bool((c.steps >= 0).any()) for _, _, c in got) >= 2  # track folds too
    new = _fold_each(pool, got, rs.fold_checkpoints)
    old = _fold_each(pool, got, _two_pass_fold)
    assert all(same_bits(a, b) for a, b in zip(new, old))
    assert not all(same_bits(a, t) for a, (_, t, _) in zip(new, got))  # the folds wrote something


def test_a_fold_summing_its_products_in_another_order_differs(commits):
    pool, got = commits
    new = _fold_each(pool, got, rs.fold_checkpoints)
    other = _fold_each(pool, got, lambda c: _two_pass_fold(
        c, lambda *a: _einsum_fold(*a, order=((1, 1), (1, 0), (0, 1), (0, 0)))))
    assert not all(same_bits(a, b) for a, b in zip(new, other))
