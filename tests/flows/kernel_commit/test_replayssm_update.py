"""drift.flows.kernel_commit.updates: SGLang 0.5.23's ReplaySSM commit, part by part (docs/semantics.md §6)."""

from __future__ import annotations

import pytest
import torch

from helpers import same_bits
from drift.check.registry import find_result
from drift.config import preset
from drift.flows.registry import FLOWS
from drift.flows.kernel_commit import updates as rs
from drift.runner import run_checked
from drift.sim import kernels
from drift.flows.registry import state_flow
from drift.flows.kernel_commit.pool import fold_records, gather_records
from drift.runspec import resolve

CPU = torch.device("cpu")
FLOW = next(f for f in FLOWS if FLOWS[f].kind == "kernel-commit")


def _harness(ssm_dtype="bfloat16"):
    cfg = preset("ci-small", flow=FLOW, ssm_dtype=ssm_dtype)
    flow = state_flow(cfg, CPU)
    gen = torch.Generator().manual_seed(3)
    L, N, D = cfg.num_layers, cfg.num_rows, cfg.num_draft_tokens
    mix = torch.randn(L, N, D, cfg.conv_channels, generator=gen).to(torch.bfloat16)
    beta = torch.randn(L, N, D, cfg.num_v_heads, generator=gen).to(torch.bfloat16)
    g = (-0.05 * torch.rand(L, N, D, cfg.num_v_heads, generator=gen)).to(torch.float32)
    flow.pool.states[:, flow.pool.active_slots] = torch.randn(
        flow.pool.states[:, flow.pool.active_slots].shape, generator=gen).to(flow.pool.temporal.dtype)
    kernels.recurrent_gated_delta_rule(flow.verify_args(mix, beta, g, "rne", 0))
    return cfg, flow


@pytest.mark.parametrize("ssm_dtype,flush", [("bfloat16", [1, 1, 1, 1]), ("float32", [0, 0, 0, 1])])
def test_the_cursors_advance_by_the_accept_length_and_flag_the_rows_to_fold(ssm_dtype, flush):
    cfg, flow = _harness(ssm_dtype)
    h, D = flow.harness, cfg.num_draft_tokens
    RL = flow.pool.ring_len
    mp = h.mamba_pool
    mp.replayssm_spec_write_pos[:4] = torch.tensor([0, 3, RL - 2 * D - 1, RL - 2 * D], dtype=torch.int32)
    accept = torch.tensor([1, 2, 1, 1] + [0] * (cfg.num_rows - 4))
    c = rs.Commit(h, accept, accept - 1, None, None)
    rs.advance_cursors(c)
    assert mp.replayssm_spec_write_pos[:4].tolist() == [1, 5, RL - 2 * D, RL - 2 * D + 1]
    # fold_every_commit (a 16-bit checkpoint): every committed row folds; fp32: a row folds once
    # write_pos + 2 D would pass the ring (_advance_gdn_spec_cursors_kernel's early flush).
    assert mp.replayssm_is_flush[:4].tolist() == flush
    assert mp.replayssm_spec_write_pos[-1] == 0  # the padded rows' slot: nothing committed


def test_the_fold_writes_the_accepted_state_into_the_checkpoint_and_restarts_the_ring():
    cfg, flow = _harness()
    h, pool, R = flow.harness, flow.pool, cfg.num_requests
    before = pool.states.clone()
    replay = pool.replay_indices[:R]
    d, k, g = gather_records(pool, replay, pool.cache_base.index_select(0, replay), cfg.num_v_heads)
    h0 = pool.states.index_select(1, pool.active_slots).float()
    last = torch.tensor([0, 3, 1, 2] + [-1] * (cfg.num_rows - R))
    rs.sglang_0523_replayssm(h, last, None, None)
    want = fold_records(h0, d, k, g, (last[:R] + 1)).to(torch.bfloat16)
    got = pool.states[:, pool.active_slots]
    # The compensated fold (bf16 high + low parts, four fp32 products) and drift's plain fp32 fold
    # agree to fp32 rounding; rounded to bf16 they differ by one ulp in a handful of entries at most
    # (measured: none on this case; 0.1% allowed).
    assert (got != want).float().mean() <= 1e-3
    assert (pool.write_pos[:R] == 0).all() and (pool.is_flush[:R] == 0).all()
    assert pool.cache_base[:R].tolist() == (last[:R] + 1).tolist()  # the ring restarts past the history
    others = torch.ones(pool.states.shape[1], dtype=torch.bool)
    others[pool.active_slots] = False
    assert same_bits(pool.states[:, others], before[:, others])  # no other slot written (dummy 0 included)


def test_a_track_slot_gets_the_state_at_the_tracked_step():
    cfg, flow = _harness()
    h, pool, R, N = flow.harness, flow.pool, cfg.num_requests, cfg.num_rows
    replay = pool.replay_indices[:R]
    d, k, g = gather_records(pool, replay, pool.cache_base.index_select(0, replay), cfg.num_v_heads)
    h0 = pool.states.index_select(1, pool.active_slots).float()
    last = torch.full((N,), -1)
    last[:R] = 3
    steps = torch.full((N,), -1)
    steps[1] = 1  # row 1 crosses a boundary after its second token
    rs.sglang_0523_replayssm(h, last, pool.row_track_slots, steps)
    want = fold_records(h0, d, k, g, torch.full((R,), 2))[:, 1].to(torch.bfloat16)
    got = pool.states[:, pool.row_track_slots[1]]
    assert (got != want).float().mean() <= 1e-3  # as the checkpoint fold above
    assert not same_bits(got, pool.states[:, pool.active_slots[1]])  # not the accepted state (step 3)


def _track_one_short(c):
    # a track fold one record short: the state before the boundary token
    rs.fold_checkpoints(rs.replace(c, steps=torch.where(c.steps >= 0, c.steps - 1, c.steps)) if c.track is not None
                        else c)


def test_the_tracked_check_catches_a_track_fold_one_record_short():
    cfg = preset("ci-small", flow=FLOW, steps=96)
    good = run_checked(resolve(cfg), sync_scan=False)
    assert find_result(good.checks, "tracked_snapshots").passed
    bad_update = rs.SGLANG_0523_REPLAYSSM.but(fold=_track_one_short).build("track-one-short")
    bad = run_checked(resolve(cfg, bad_update), sync_scan=False)
    res = find_result(bad.checks, "tracked_snapshots")
    assert not res.passed, res.to_dict()


@pytest.mark.parametrize("ssm_dtype,flush", [("bfloat16", [1, 1, 1, 1]), ("float32", [0, 1, 0, 0])])
@pytest.mark.parametrize("tracked", [[-1, -1, -1, -1], [-1, 1, -1, -1], [2, 0, 1, -1]], ids=["none", "one", "three"])
def test_folding_only_the_rows_that_store_gives_every_slot_the_bits_of_the_whole_batchs_fold(
        monkeypatch, ssm_dtype, flush, tracked):
    """On host tensors the commit folds only the rows it stores to (updates.py: _folds_by_row): the flushing
    rows' checkpoints and the tracked rows' track slots. Every slot of the pool, the padded rows' dummy
    included, must hold the bits the kernel's whole-batch fold leaves, with none, one or several rows
    tracked and some rows not flushing."""
    pools = []
    for by_row in (True, False):
        cfg, flow = _harness(ssm_dtype)
        h, pool, N = flow.harness, flow.pool, cfg.num_rows
        h.mamba_pool.replayssm_is_flush[:4] = torch.tensor(flush, dtype=torch.int8)
        monkeypatch.setattr(rs, "_folds_by_row", (lambda *a, _orig=rs._folds_by_row: _orig(*a)) if by_row
                            else (lambda *a: False))
        steps = torch.full((N,), -1)
        steps[:4] = torch.tensor(tracked)
        last = torch.full((N,), -1)
        last[:cfg.num_requests] = 2
        c = rs.Commit(h, last + 1, last, pool.row_track_slots, steps)
        rs.fold_checkpoints(c)
        pools.append(pool.states.clone())
    assert same_bits(*pools)


def test_the_rows_are_folded_alone_only_where_finding_them_is_no_sync_and_the_store_is_per_row():
    """A stochastic store draws by each element's place in the batch, and a row on an accelerator or on the
    sync scan's virtual device cannot be found without a host read: the whole batch is folded there."""
    host, meta = torch.ones(4, dtype=torch.bool), torch.ones(4, dtype=torch.bool, device="meta")
    assert rs._folds_by_row(torch.bfloat16, "rne", host, None)
    assert rs._folds_by_row(torch.float32, "stochastic", host, host)  # an fp32 checkpoint: the store is a cast
    assert not rs._folds_by_row(torch.bfloat16, "stochastic", host, None)
    assert not rs._folds_by_row(torch.bfloat16, "rne", meta, None)
    assert not rs._folds_by_row(torch.bfloat16, "rne", host, meta)


def _full_ring(options=(), store_rounding="rne"):
    """A ci-small ReplaySSM pool whose ring holds random records at random cursors: rows with 0 to 13
    records of history (longer than a verify's: the ring-full cadence's), every row flagged to fold."""
    cfg = preset("ci-small", flow=FLOW, flow_options=options, store_rounding=store_rounding)
    flow = state_flow(cfg, CPU)
    gen, pool = torch.Generator().manual_seed(11), flow.pool
    for ring in pool.ring_tensors().values():
        if ring.is_floating_point():
            ring.copy_(torch.randn(ring.shape, generator=gen).to(ring.dtype))
    pool.ring_g.copy_(-0.1 * torch.rand(pool.ring_g.shape, generator=gen))
    pool.states[:, pool.active_slots] = torch.randn(pool.states[:, pool.active_slots].shape,
                                                    generator=gen).to(pool.temporal.dtype)
    R = cfg.num_requests
    pool.cache_base[:R] = torch.tensor([3, 15, 0, 9], dtype=torch.int32)
    pool.write_pos[:R] = torch.tensor([13, 0, 4, 7], dtype=torch.int32)
    pool.is_flush[:R] = 1
    return cfg, flow


def _fold_with(monkeypatch, span, options=(), store_rounding="rne", in_place=None):
    """The pool's states after one fold whose ring read is ``span(ring_len, *lengths)`` records (and whose sums
    are made in place or not where ``in_place`` says; default: as on host tensors)."""
    cfg, flow = _full_ring(options, store_rounding)
    monkeypatch.setattr(rs, "_records_folded", span)
    if in_place is not None:
        monkeypatch.setattr(rs, "_in_place", lambda t: in_place)
    N = cfg.num_rows
    last, steps = torch.full((N,), -1), torch.full((N,), -1)
    last[:cfg.num_requests] = torch.tensor([3, 0, 2, 1])
    steps[:cfg.num_requests] = torch.tensor([1, -1, 0, 1])
    rs.fold_checkpoints(rs.Commit(flow.harness, last + 1, last, flow.pool.row_track_slots, steps))
    return flow.pool.states.clone()


def WHOLE_RING(ring_len, rings, *lengths):
    """The kernel's grid: every record of the ring."""
    return None


DESIGNS = [
    ((), "rne"),  # SGLang 0.5.23's design
    ((), "stochastic"),  # the whole batch folded (no row alone), each element's draw by its place
    ((("fold-contraction", "tf32"),), "rne"),  # one rounded-operand product
    ((("ring-records", "fp32"),), "rne"),  # no low parts
]
DESIGN_IDS = ["sglang", "stochastic", "tf32", "fp32-records"]


@pytest.mark.parametrize("options,store_rounding", DESIGNS, ids=DESIGN_IDS)
def test_folding_only_the_records_of_the_longest_history_gives_the_bits_of_the_whole_rings_fold(
        monkeypatch, options, store_rounding):
    """On host tensors the folds read each row's first ``max(history)`` records, not the whole ring
    (updates.py: _records_folded): the records past a row's history weigh exactly 0, so every slot must hold
    the bits of the whole ring's fold, for each contraction and store."""
    short = _fold_with(monkeypatch, rs._records_folded, options, store_rounding)
    whole = _fold_with(monkeypatch, WHOLE_RING, options, store_rounding)
    assert same_bits(short, whole)


@pytest.mark.parametrize("options,store_rounding", DESIGNS, ids=DESIGN_IDS)
def test_a_fold_whose_sums_are_made_in_place_gives_the_bits_of_the_fold_as_written(
        monkeypatch, options, store_rounding):
    """On host tensors the fold sums in place (updates.py: _in_place); elsewhere, and in the trade-off table's
    bytes model, it runs as written: every slot must hold the same bits either way, the whole ring read."""
    done = [_fold_with(monkeypatch, WHOLE_RING, options, store_rounding, in_place) for in_place in (True, False)]
    assert same_bits(*done)


def test_a_fold_that_sums_its_products_in_another_order_is_caught_by_that_comparison(monkeypatch):
    """The negative control: the same products summed last to first move the bits, so the comparison above
    sees a sum made in another order, not just a missing term."""
    as_written = _fold_with(monkeypatch, WHOLE_RING, in_place=False)
    monkeypatch.setattr(rs, "_sum_of_products", lambda products, in_place: sum(
        rs.contract(u, k) for u, k in reversed(products)))
    assert not same_bits(as_written, _fold_with(monkeypatch, WHOLE_RING, in_place=True))


def test_the_fold_sums_in_place_on_host_tensors_only():
    assert rs._in_place(torch.zeros(2)) and not rs._in_place(torch.zeros(2, device="meta"))


def test_a_fold_one_record_short_of_the_longest_history_is_caught_by_that_comparison(monkeypatch):
    """The negative control: the folds reading one record fewer than the longest history move the bits."""
    one_short = _fold_with(monkeypatch, lambda ring_len, rings, *lengths: max(int(t.max()) for t in lengths) - 1)
    assert not same_bits(one_short, _fold_with(monkeypatch, WHOLE_RING))


def test_the_folds_read_the_longest_history_on_host_tensors_and_the_whole_ring_elsewhere():
    host, meta = torch.tensor([0, 5, 3]), torch.tensor([0, 5, 3], device="meta")
    finite = (torch.zeros(2, 16, 4), None)
    assert rs._records_folded(16, finite, host, torch.tensor([7, 0, 0])) == 7
    assert rs._records_folded(16, finite, host, None) == 5
    assert rs._records_folded(16, finite, torch.zeros(3, dtype=torch.int64)) == 1  # one zero-weight record
    assert rs._records_folded(16, finite, torch.tensor([40])) == 16  # never past the ring
    assert rs._records_folded(16, finite, meta) is None and rs._records_folded(16, finite, host, meta) is None
    for dtype in (torch.bfloat16, torch.float16, torch.float32):  # the ring-records choices' dtypes
        for bad in (float("nan"), float("inf"), float("-inf")):  # 0 * a non-finite record: NaN in the kernel
            for place in (0, 77, 2 * 16 * 4 - 1):
                ring = torch.zeros(2 * 16 * 4, dtype=dtype)
                ring[place] = bad
                assert rs._records_folded(16, (None, ring.view(2, 16, 4)), host) is None, (dtype, bad, place)


def test_a_non_finite_record_past_every_history_poisons_the_fold_as_the_kernels_does(monkeypatch):
    """SGLang's kernel multiplies every record of the ring by its weight, 0 past a row's history: a NaN record
    there (a stale one, from a state that went non-finite) makes the fold NaN. The fold on host tensors reads
    the whole ring then, and every slot holds the whole ring's bits; reading the longest history alone would
    not (the negative control)."""
    def planted(span):
        cfg, flow = _full_ring()
        pool = flow.pool
        row = 2  # 4 records of history from cache_base 0: position 14 is past every row's history (13 at most)
        pool.ring_d[:, row, :, 14] = float("nan")
        monkeypatch.setattr(rs, "_records_folded", span)
        N = cfg.num_rows
        last = torch.full((N,), -1)
        last[:cfg.num_requests] = torch.tensor([3, 0, 2, 1])
        rs.fold_checkpoints(rs.Commit(flow.harness, last + 1, last, None, None))
        return pool.states.clone()

    whole, on_host = planted(WHOLE_RING), planted(rs._records_folded)
    assert torch.isnan(whole.float()).any()
    assert same_bits(on_host, whole)
    longest = planted(lambda ring_len, rings, *lengths: max(int(t.max()) for t in lengths if t is not None))
    assert not same_bits(longest, whole)
