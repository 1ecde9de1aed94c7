"""drift.flows.kernel_commit.flow: the kernel-commit flow, SGLang 0.5.23's ReplaySSM spec verify (docs/semantics.md §6).

The verify keeps no per-token state: it writes compact records to a ring, and the commit folds
the accepted ones into the checkpoint. In exact arithmetic the fold of a row's first t + 1 records
is the recurrent op's state after token t, so the tests hold the ring against the portable op.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers import same_bits
from drift.check.registry import find_result
from drift.config import preset
from drift.flows.registry import FLOWS
from drift.runner import run_checked
from drift.sim import kernels
from drift.flows.registry import state_flow
from drift.flows.kernel_commit.flow import KernelCommitFlow
from drift.flows.kernel_commit.rule import RingRule
from drift.flows.kernel_commit.pool import (NULL_SLOT, effective_states, fold_records, gather_records,
                              ring_length)
from drift.runspec import resolve

CPU = torch.device("cpu")
FLOW = next(f for f in FLOWS if FLOWS[f].kind == "kernel-commit")
F32, BF16 = torch.float32, torch.bfloat16


def _step_inputs(cfg, seed=0):
    """One verify step's inputs: mix bf16 [L, N, D, C], beta logits bf16 and g fp32 [L, N, D, HV]."""
    gen = torch.Generator().manual_seed(seed)
    L, N, D = cfg.num_layers, cfg.num_rows, cfg.num_draft_tokens
    mix = torch.randn(L, N, D, cfg.conv_channels, generator=gen).to(BF16)
    beta = torch.randn(L, N, D, cfg.num_v_heads, generator=gen).to(BF16)
    g = (-0.05 * torch.rand(L, N, D, cfg.num_v_heads, generator=gen)).to(F32)
    return mix, beta, g


def _flows(cfg):
    """The kernel-commit flow and a copy-commit flow over the same seeded checkpoint."""
    ring = state_flow(cfg.replace(flow=FLOW), CPU)
    copy = state_flow(cfg.replace(flow="sglang"), CPU)
    gen = torch.Generator().manual_seed(7)
    start = torch.randn(copy.pool.states[:, copy.pool.active_slots].shape, generator=gen).to(copy.pool.temporal.dtype)
    for f in (ring, copy):
        f.pool.states[:, f.pool.active_slots] = start
    return ring, copy


@pytest.fixture
def cfg():
    return preset("ci-small", steps=8)


def test_the_ring_replays_the_recurrent_ops_states_and_outputs(cfg):
    ring, copy = _flows(cfg)
    assert isinstance(ring, KernelCommitFlow)
    mix, beta, g = _step_inputs(cfg)
    out_ring = kernels.recurrent_gated_delta_rule(ring.verify_args(mix, beta, g, "rne", 0))
    args = copy.verify_args(mix, beta, g, "rne", 0)
    out_copy = kernels.recurrent_gated_delta_rule_torch(args)
    R = cfg.num_requests
    # The window starts from the same bf16 checkpoint and runs the same fp32 token loop: outputs agree bit for bit.
    assert same_bits(out_ring[:, :R], out_copy[:, :R])
    assert (out_ring[:, R:] == 0).all()  # padded rows (slot -1): nothing computed, zeros as the kernel stores
    pool = ring.pool
    replay = pool.replay_indices[:R]
    d, k, gg = gather_records(pool, replay, pool.cache_base.index_select(0, replay), cfg.num_v_heads)
    h0 = pool.states.index_select(1, pool.active_slots).to(F32)
    scratch = kernels.scratch_blocks(copy.pool.intermediate_ssm)
    for t in range(cfg.num_draft_tokens):
        got = fold_records(h0, d, k, gg, torch.full((R,), t + 1)).to(BF16)
        want = scratch[:, args.ssm_state_indices[:R, t].long()]
        # The fold differs from the recurrence by fp32 rounding and the records' 16-bit (high + low)
        # precision: ~2^-16 of the state's scale in absolute terms (an entry that cancels to near zero
        # keeps that absolute error). After both are rounded to bf16 they differ by at most one bf16
        # ulp (<= eps * |want|) plus that absolute term, in a few entries (measured: under 0.1% on ci-small).
        tol = torch.finfo(BF16).eps * want.float().abs() + 2.0 ** -16 * want.float().abs().max()
        assert ((got.float() - want.float()).abs() <= tol).all(), t
        assert (got != want).float().mean() < 0.01, t
    # Negative control: folding one record too many is not the state after token 0.
    wrong = fold_records(h0, d, k, gg, torch.full((R,), 2)).to(BF16)
    assert not same_bits(wrong, scratch[:, args.ssm_state_indices[:R, 0].long()])


def test_records_land_at_the_cursor_and_wrap_and_stop_at_the_ring_end(cfg):
    ring, _ = _flows(cfg)
    pool, D, RL = ring.pool, cfg.num_draft_tokens, ring.pool.ring_len
    assert RL == ring_length(D) == 16 and RL >= 2 * D
    pool.cache_base[0], pool.write_pos[0] = RL - 2, 0  # row 0: wraps past the end of its ring
    pool.cache_base[1], pool.write_pos[1] = 3, RL - 1  # row 1: room for one record only
    before = {n: t.clone() for n, t in pool.ring_tensors().items()}
    kernels.recurrent_gated_delta_rule(ring.verify_args(*_step_inputs(cfg), "rne", 0))
    written = (pool.ring_g != before["ring_g"]).any(0).any(1)  # [slots, RL]
    want = torch.zeros_like(written)
    want[0, [(RL - 2 + t) % RL for t in range(D)]] = True
    want[1, (3 + RL - 1) % RL] = True
    for r in range(2, cfg.num_requests):
        want[r, :D] = True
    assert torch.equal(written, want)  # the padded rows' spare slot (last) is never written
    # The cursors belong to the commit: the verify only reads them.
    assert same_bits(pool.write_pos, before["write_pos"]) and same_bits(pool.cache_base, before["cache_base"])


def test_a_flushing_row_is_left_uninitialised_and_writes_nothing(cfg):
    ring, _ = _flows(cfg)
    pool = ring.pool
    pool.is_flush[1] = 1  # the flush launch, which the spec path never runs, would own this row
    before = pool.ring_g.clone()
    out = kernels.recurrent_gated_delta_rule(ring.verify_args(*_step_inputs(cfg), "rne", 0))
    assert out[:, 1].isnan().all() and not out[:, 0].isnan().any()
    assert same_bits(pool.ring_g[:, 1], before[:, 1]) and not same_bits(pool.ring_g[:, 0], before[:, 0])


def test_the_next_verify_starts_from_checkpoint_plus_the_rings_history(cfg):
    ring, _ = _flows(cfg.replace(ssm_dtype="float32"))
    pool, R = ring.pool, cfg.num_requests
    kernels.recurrent_gated_delta_rule(ring.verify_args(*_step_inputs(cfg), "rne", 0))
    replay = pool.replay_indices[:R]
    h0 = pool.states.index_select(1, pool.active_slots).to(F32)
    assert same_bits(effective_states(pool, replay, pool.active_slots, cfg.num_v_heads), h0)  # empty rings
    pool.write_pos[:R] = 2
    got = effective_states(pool, replay, pool.active_slots, cfg.num_v_heads)
    d, k, g = gather_records(pool, replay, pool.cache_base.index_select(0, replay), cfg.num_v_heads)
    assert same_bits(got, fold_records(h0, d, k, g, torch.full((R,), 2)))
    assert not same_bits(got, h0)  # negative control: the history moved it


def test_padded_rows_carry_the_null_slot_and_a_ring_slot_of_their_own(cfg):
    pool = state_flow(cfg.replace(flow=FLOW), CPU).pool
    R, N = cfg.num_requests, cfg.num_rows
    assert N > R, "ci-small carries a padded row"
    assert (pool.state_indices[R:] == NULL_SLOT).all() and (pool.state_indices[:R] > 0).all()
    assert (pool.replay_indices[R:] == R).all() and torch.equal(pool.replay_indices[:R], torch.arange(R))


def test_a_run_passes_every_check_and_tracks_its_records(cfg):
    rep = run_checked(resolve(cfg.replace(flow=FLOW, steps=96)), sync_scan=False)
    assert rep.passed, [c.to_dict() for c in rep.checks if c.failed]
    tracked = find_result(rep.checks, "tracked_snapshots")
    assert tracked.extra.get("applicable", True) and "snapshots compared" in tracked.detail
    base = run_checked(resolve(cfg.replace(steps=96)), sync_scan=False)
    mine, theirs = (find_result(r.checks, "committed_state").worst for r in (rep, base))
    # Same maths, one bf16 rounding per step in both flows; the fold and the recurrence differ by
    # fp32 rounding, which moves a few bf16 roundings by an ulp: measured within 1% of the sglang
    # flow's worst on ci-small; 5% leaves room for the seed.
    assert abs(mine - theirs) <= 0.05 * theirs, (mine, theirs)


def test_an_fp32_checkpoint_keeps_history_and_folds_when_the_ring_fills(cfg):
    """fold_every_commit is off for an fp32 checkpoint: records stay in the ring until write_pos +
    2 D passes its length, then fold (spec_utils.py, _advance_gdn_spec_cursors_kernel)."""
    from drift.simulate import Simulation

    class Cursors:  # what the ring's cursors hold after each step
        def __init__(self):
            self.seen = []

        def on_start(self, sim):
            self.pool = sim.pool

        def on_step(self, view):
            p = self.pool
            self.seen.append((p.write_pos[:R].clone(), p.cache_base[:R].clone()))

        def flush(self):
            pass

        def on_end(self):
            pass

    R, D = cfg.num_requests, cfg.num_draft_tokens
    cursors = Cursors()
    sim = Simulation(resolve(cfg.replace(flow=FLOW, ssm_dtype="float32", steps=24)), observers=[cursors], check_untouched=False)
    sim.run()
    RL = sim.pool.ring_len
    wps = torch.stack([w for w, _ in cursors.seen])
    bases = torch.stack([b for _, b in cursors.seen])
    assert (wps > 0).any()  # history kept across steps
    assert (bases != 0).any()  # and folded when the ring filled: the ring restarted past it
    assert (wps + 2 * D <= RL).all()  # a ring that would overflow the next window was folded
    # Negative control: a 16-bit checkpoint folds every commit, so its rings are empty after each step.
    bf = Cursors()
    Simulation(resolve(cfg.replace(flow=FLOW, steps=8)), observers=[bf], check_untouched=False).run()
    assert all((w == 0).all() for w, _ in bf.seen)


def _verify_with_rows_not_run(cfg, monkeypatch, plain: bool, nudge: bool = False):
    """One ring verify with the padded row and a flushing row not run, on the host path (rows not run
    zeroed in the running state) or the device path (a ``where`` over the start states): outputs and ring."""
    ring, _ = _flows(cfg)
    ring.pool.is_flush[1] = 1  # left to the flush launch: not run
    ring.pool.write_pos[:cfg.num_requests] = torch.tensor([2, 0, 3, 1], dtype=torch.int32)  # start states are folds
    monkeypatch.setattr(kernels, "_plain", (lambda args, _real=kernels._plain: _real(args)) if plain
                        else (lambda args: False))
    if nudge:
        real_plan = RingRule.plan

        def nudged_plan(self, args):  # row 0's start states one fp32 ulp up
            plan = real_plan(self, args)
            states = plan.states.clone()
            states[:, 0] = torch.nextafter(states[:, 0], torch.full_like(states[:, 0], float("inf")))
            return replace(plan, states=states)

        monkeypatch.setattr(RingRule, "plan", nudged_plan)
    out = kernels.recurrent_gated_delta_rule_torch(ring.verify_args(*_step_inputs(cfg), "rne", 0))
    return out, *(t.clone() for t in ring.pool.ring_tensors().values())


def test_rows_not_run_start_from_zero_on_the_host_as_on_a_device(cfg, monkeypatch):
    """The host path zeroes a row not run in its running state instead of a ``where`` over every start state
    (kernels._torch_verify): the same bits in every output and every ring record, NaN outputs included."""
    host = _verify_with_rows_not_run(cfg, monkeypatch, plain=True)
    device = _verify_with_rows_not_run(cfg, monkeypatch, plain=False)
    assert torch.isnan(host[0][:, 1].float()).all()  # the flushing row: NaN outputs, as the rule leaves them
    assert all(same_bits(a, b) for a, b in zip(host, device))
    # Negative control: a run row's start states one ulp off move its outputs and records.
    nudged = _verify_with_rows_not_run(cfg, monkeypatch, plain=True, nudge=True)
    assert not all(same_bits(a, b) for a, b in zip(nudged, device))
