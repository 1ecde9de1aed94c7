"""drift.flows.kernel_commit.design: the kernel-commit design's options (ring records, fold
contraction, fold cadence; docs/semantics.md §6) -- what each choice allocates, writes and folds,
that the defaults are SGLang 0.5.23's bit for bit, and that code written for SGLang's design alone
is refused under another."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers import digest, run_sim, same_bits
from drift.cli import main
from drift.config import ConfigError, flow_options, preset
from drift.dtypes import round_mantissa
from drift.errors import LoadError
from drift.flows.fold_model import FoldSchedule
from drift.flows.base import default_choice
from drift.flows.kernel_commit import design as dz
from drift.flows.kernel_commit import naive
from drift.flows.kernel_commit import updates as rs
from drift.flows.kernel_commit.pool import ReplaySlots
from drift.flows.registry import FLOWS, state_flow
from drift.runspec import resolve
from drift.sim import kernels

CPU = torch.device("cpu")
FLOW = next(f for f in FLOWS if FLOWS[f].kind == "kernel-commit")
F32, BF16 = torch.float32, torch.bfloat16


def _cfg(steps=8, profile=None, **options):
    cfg = preset("ci-small", flow=FLOW, steps=steps, flow_options=flow_options(**options))
    return cfg.with_profile(profile) if profile else cfg


def test_every_choice_cites_who_makes_it_and_each_option_has_one_default():
    for option, reg in dz.OPTIONS.items():
        assert [c.name for c in reg.values() if c.default] == [default_choice(reg).name], option
        for c in reg.values():
            assert c.description and ("sglang 0.5.23" in c.used_by.lower() or "flashinfer" in c.used_by.lower()), c


def test_the_defaults_are_sglangs_and_setting_them_explicitly_changes_no_bit():
    """The empty design and SGLang's choices named one by one run bit for bit alike (the kind's
    defaults are the engine's); negative control: a non-default choice changes the trajectory."""
    explicit = {o: default_choice(reg).name for o, reg in dz.OPTIONS.items()}
    runs = [_cfg(16), _cfg(16, **{o.replace("-", "_"): v for o, v in explicit.items()}),
            _cfg(16, fold_contraction="tf32")]
    digests = [[] for _ in runs]
    for cfg, out in zip(runs, digests):
        run_sim(cfg, None, on_step=lambda sim, view, out=out: out.append(digest(sim.pool.temporal, view.out)))
    assert digests[0] == digests[1]
    assert digests[0] != digests[2]


@pytest.mark.parametrize("records", list(dz.RING_RECORDS))
def test_the_ring_follows_sglangs_allocation_rule_for_each_record_dtype(records):
    """memory_pool.py: low-part rings (replayssm_rawv / rawk) exist where the records have a low
    part -- SGLang's ring whenever its dtype is not fp32 -- and are None otherwise; the verify writes
    each record as the choice stores it (high plus low part reproduces the fp32 value to the
    choice's precision)."""
    choice = dz.RING_RECORDS[records]
    cfg = _cfg(ring_records=records)
    flow = state_flow(cfg, CPU)
    pool, h = flow.pool, flow.harness
    assert pool.ring_d.dtype == pool.ring_k.dtype == choice.dtype and pool.ring_g.dtype == F32
    assert (pool.ring_d_lo is not None) == (pool.ring_k_lo is not None) == choice.low_part
    assert h.spec_state.replayssm_rawv is pool.ring_d_lo and h.commit_design.records is choice
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4096, generator=gen) * 0.3
    x = x[x.abs() >= 2.0 ** -14]  # fp16's normal range (below it the range limit shows, next lines)
    hi, lo = pool.design.split_records(x)
    back = hi.float() + (0.0 if lo is None else lo.float())
    rel = ((back - x).abs() / x.abs()).max().item()
    assert rel <= 2.0 ** -choice.bits, (records, rel)  # half an ulp of the record's precision, at most
    assert records == "fp32" or rel > 0  # a 16-bit record rounds (the check above can fail)
    tiny = torch.full((1,), 3e-6)  # a subnormal fp16: its spacing 2^-24, not the value's 2^-11 relative
    hi, lo = pool.design.split_records(tiny)
    tiny_rel = ((hi.float() + (0.0 if lo is None else lo.float()) - tiny).abs() / tiny).item()
    assert (tiny_rel > 2.0 ** -choice.bits) == (records == "fp16"), tiny_rel


@pytest.mark.parametrize("value,why", [("every:8", "overflow the ring"), ("every:1", "N = 1"),
                                       ("every", "not known"), ("weekly", "not known")])
def test_a_cadence_without_a_derived_bound_is_refused(value, why):
    with pytest.raises(ConfigError, match=why):
        resolve(_cfg(fold_cadence=value))
    assert resolve(_cfg(fold_cadence="every:4")).cfg.flow_option("fold-cadence") == "every:4"  # control: 4 D = 16


def test_flow_options_must_be_sorted_pairs():
    with pytest.raises(ConfigError, match="sorted by name"):
        preset("ci-small", flow_options=(("ring-records", "fp16"), ("fold-cadence", "ring-full")))
    assert preset("ci-small", flow_options=flow_options({"ring-records": "fp16", "fold-cadence": "ring-full"}))


def test_sglangs_own_kernels_are_refused_under_another_design(capsys):
    """SGLang's Triton verify and commit implement SGLang 0.5.23's design alone: exit 2 naming the
    option, before the engine is imported; the same code under the default design resolves."""
    commit = "drift.plug.replayssm_engine:sglang_commit"
    for argv, what in (([f"--update", commit], "the update"), (["--kernel", "sglang-replayssm-triton"], "verify kernel")):
        assert main(["run", "--flow", FLOW, "--fold-contraction", "tf32", "--steps", "4", "--quiet", *argv]) == 2
        err = capsys.readouterr().err
        assert what in err and "fold-contraction=tf32" in err and "FLOW_OPTIONS" in err
    with pytest.raises(LoadError, match="ring-records=fp16"):
        resolve(_cfg(ring_records="fp16"), commit)
    assert resolve(_cfg(), commit).update.spec == commit  # control: SGLang's own design


def _harness(cfg, seed=3):
    flow = state_flow(cfg, CPU)
    gen = torch.Generator().manual_seed(seed)
    L, N, D = cfg.num_layers, cfg.num_rows, cfg.num_draft_tokens
    mix = torch.randn(L, N, D, cfg.conv_channels, generator=gen).to(BF16)
    beta = torch.randn(L, N, D, cfg.num_v_heads, generator=gen).to(BF16)
    g = (-0.05 * torch.rand(L, N, D, cfg.num_v_heads, generator=gen)).to(F32)
    flow.pool.states[:, flow.pool.active_slots] = torch.randn(
        flow.pool.states[:, flow.pool.active_slots].shape, generator=gen).to(flow.pool.temporal.dtype)
    kernels.recurrent_gated_delta_rule(flow.verify_args(mix, beta, g, "rne", 11))
    return flow


DESIGNS = [dict(), dict(ring_records="fp32"), dict(ring_records="bf16"), dict(ring_records="fp16"),
           dict(fold_contraction="fp32"), dict(fold_contraction="tf32"), dict(fold_contraction="bf16"),
           dict(ring_records="fp32", fold_contraction="tf32", fold_cadence="every-commit")]


@pytest.mark.parametrize("profile", ["ascend", "fp32"])
@pytest.mark.parametrize("options", DESIGNS, ids=lambda o: "+".join(f"{k}={v}" for k, v in o.items()) or "sglang")
def test_the_fold_is_the_loop_reference_of_its_design(options, profile):
    """The update's vectorised fold against drift bench's per-record loops (naive.update) in the same
    design, from the same ring: the same rounded operands and stores, summed in another order (fp32
    rounding, then one bf16 boundary at most on a 16-bit checkpoint). SGLang's split contraction is
    held to the loops' plain fp32 fold: its products are exact to 2^-16, below the bf16 store."""
    cfg = _cfg(8, profile, **{**options, "fold_cadence": "every-commit"})
    mine = _harness(cfg)
    ref = copy.deepcopy(mine)
    R, N = cfg.num_requests, cfg.num_rows
    last = torch.tensor([0, 3, 1, 2] + [-1] * (N - R))
    old = mine.pool.states[:, mine.pool.active_slots].clone()
    rs.sglang_0523_replayssm(mine.harness, last, None, None)
    naive.update(ref, last, None, None)
    got, want = (f.pool.states[:, f.pool.active_slots].double() for f in (mine, ref))
    assert not same_bits(got.float(), old.float())  # the fold wrote
    if profile == "ascend":
        assert (got != want).double().mean() <= 1e-3
    else:
        assert ((got - want).norm() / want.norm()).item() <= 2e-6  # fp32 sums of 4 x 64 products
    assert mine.pool.write_pos.tolist() == ref.pool.write_pos.tolist() and (mine.pool.write_pos[:R] == 0).all()


def test_a_rounded_contraction_differs_from_fp32_by_its_operand_rounding():
    """Negative control of the comparison above: TF32 operands against fp32 ones, the same ring and
    checkpoint (fp32): they differ by about the operands' 2^-11, far past the 2e-6 the test allows."""
    outs = []
    for contraction in ("fp32", "tf32"):
        flow = _harness(_cfg(8, "fp32", fold_contraction=contraction, fold_cadence="every-commit"))
        rs.sglang_0523_replayssm(flow.harness, torch.tensor([3] * 4 + [-1]), None, None)
        outs.append(flow.pool.states[:, flow.pool.active_slots].double())
    assert ((outs[0] - outs[1]).norm() / outs[0].norm()).item() > 1e-5


def test_tf32_operands_are_rounded_to_an_11_bit_mantissa_to_nearest():
    x = torch.tensor([1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, 1.0 + 2 ** -10 + 2 ** -11 + 2 ** -13, -(1.0 + 2 ** -11)])
    # ties to even (1 + 2^-11 -> 1, 1 + 3 2^-11 -> 1 + 2^-9), above a tie up, either sign
    assert round_mantissa(x, 11).tolist() == [1.0, 1.0 + 2 ** -9, 1.0 + 2 ** -9, -1.0]
    d = dz.CommitDesign.of(_cfg(fold_contraction="tf32"))
    assert d.operand(x).tolist() == round_mantissa(x, 11).tolist()
    assert dz.CommitDesign.of(_cfg(fold_contraction="fp32")).operand(x) is x


@pytest.mark.parametrize("options,profile", [(dict(), "ascend"), (dict(), "fp32"), (dict(fold_cadence="ring-full"), None),
                                             (dict(fold_cadence="every:3"), None),
                                             (dict(fold_cadence="every-commit"), "fp32")])
def test_the_cursors_fold_when_the_declared_cadence_says(options, profile):
    """Over a seeded accept schedule, the rows the update's cursors flag to fold (is_flush after the
    advance) are those drift.flows.fold_model.FoldSchedule derives from the design's numbers alone --
    the bound's independent account of when folds happen."""
    cfg = _cfg(8, profile, **options)
    flow = _harness(cfg)
    h, R, N = flow.harness, cfg.num_requests, cfg.num_rows
    schedule = FoldSchedule(flow.pool.design.fold_rounding(), R)
    rng = np.random.default_rng(5)
    seen = []
    for _ in range(40):
        accept = torch.tensor(list(rng.integers(1, cfg.num_draft_tokens + 1, R)) + [0] * (N - R))
        c = rs.Commit(h, accept, accept - 1, None, None)
        rs.advance_cursors(c)
        got = (flow.pool.is_flush[:R] != 0).numpy()
        want = schedule.step(accept[:R].numpy())
        seen.append(got.copy())
        assert (got == want).all(), (got, want)
        rs.fold_checkpoints(c)
        rs.finish_folds(c)
    folds = np.array(seen)
    assert folds.any() and (flow.pool.design.folds_every_commit or not folds.all())


@pytest.mark.parametrize("options,profile", [(dict(), "fp32"), (dict(fold_cadence="every:3"), None)])
def test_idle_rows_and_fresh_rows_fold_as_the_schedule_says(options, profile):
    """Under a churning lifecycle: an idle row (accept 0) commits nothing, and a request row handed out
    afresh (ReplaySlots.fresh_row: SGLang's alloc zeroes its cursors) starts a new count -- the
    schedule's ``restart``. Negative control: a schedule that misses the restarts disagrees."""
    cfg = _cfg(8, profile, **options)  # SGLang's fp32 checkpoint folds when the ring is full
    flow = _harness(cfg)
    h, R, N = flow.harness, cfg.num_requests, cfg.num_rows
    fr = flow.pool.design.fold_rounding()
    schedule, blind = FoldSchedule(fr, R), FoldSchedule(fr, R)
    rng = np.random.default_rng(7)
    disagreed = False
    for _ in range(60):
        fresh = np.nonzero(rng.random(R) < 0.15)[0]
        for row in fresh:
            ReplaySlots.fresh_row(SimpleNamespace(pool=flow.pool), int(row))
        schedule.restart(fresh)
        acc = rng.integers(1, cfg.num_draft_tokens + 1, R) * (rng.random(R) > 0.25)  # a quarter idle
        accept = torch.tensor(list(acc) + [0] * (N - R))
        c = rs.Commit(h, accept, accept - 1, None, None)
        rs.advance_cursors(c)
        got = (flow.pool.is_flush[:R] != 0).numpy()
        assert (got == schedule.step(acc)).all()
        disagreed |= not (got == blind.step(acc)).all()
        rs.fold_checkpoints(c)
        rs.finish_folds(c)
    assert disagreed


def test_a_schedule_of_another_cadence_disagrees():
    """Negative control: the every-commit schedule against ring-full cursors."""
    cfg = _cfg(8, fold_cadence="ring-full")
    every = FoldSchedule(dz.CommitDesign.of(_cfg(8)).fold_rounding(), cfg.num_requests)
    full = FoldSchedule(dz.CommitDesign.of(cfg).fold_rounding(), cfg.num_requests)
    steps = [np.full(cfg.num_requests, 2)] * 8
    assert not all((every.step(a) == full.step(a)).all() for a in steps)


def test_a_declared_stochastic_fold_stores_the_track_slot_and_the_checkpoint_alike():
    """A row tracked at its last accepted step gets the same records folded into both slots; the
    stochastic store draws its noise from the step and the element's place in the fold, not the slot,
    so both get the same bits -- and bits a round-to-nearest store would not give."""
    flows = [_harness(_cfg(8).replace(store_rounding=r)) for r in ("stochastic", "rne")]
    R, N = 4, 5
    last = torch.tensor([3] * R + [-1])
    steps = torch.tensor([3] * R + [-1])
    for f in flows:
        rs.sglang_0523_replayssm(f.harness, last, f.pool.row_track_slots, steps)
    sto, rne = flows
    ck = sto.pool.states[:, sto.pool.active_slots]
    assert same_bits(sto.pool.states[:, sto.pool.row_track_slots[:R]], ck)
    assert not same_bits(ck, rne.pool.states[:, rne.pool.active_slots])
