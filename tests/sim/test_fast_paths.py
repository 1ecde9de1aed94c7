"""The row-copy fast paths of drift.sim.kernels give exactly what their definitions give.

move_intermediate_cache (a raw block copy, docs/semantics.md §3) and conv_state_rollback are pure
copies, so they must match the loops in drift.sim.naive bit for bit (NaN payloads included) on
every layout pair, through the host-index path (plain CPU tensors), the device path (switched on
for CPU tensors with ``kernels.HOST_INDEX_PATHS = False``, and on drift's virtual device, where
it must also be free of host-device syncs) and the generic fallback for views that do not flatten
into rows. conv_verify and the verify op's torch path were made faster without changing their
arithmetic; what that relies on (same bits on every path, whatever the layer chunking) is pinned
here. Every comparison is bit-exact: no tolerance.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers import same_bits
from drift.flows.copy_commit.rule import NpuRule
from drift.config import preset
from drift.dtypes import as_bits
from drift.layouts import LAYOUTS
from drift.sim import kernels, naive
from drift.sim.kernels import VerifyArgs
from drift.sim.pool import StatePool, raw_state
from drift.syncs.detector import SyncDetector, detect_syncs, host_data, to_virtual

STEPS = {  # last_steps of the 5 batch rows (D = 4): -1 skips; a step >= D is NOT skipped (no upper bound)
    "mixed": [3, 0, -1, 2, -1],
    "track-like": [-1, -1, 2, -1, -1],
    "all-skipped": [-1, -1, -1, -1, -1],
    "all-committed": [0, 1, 2, 3, 3],
    "past-D": [4, 1, -3, 0, -1],  # row 0 reads flat block 0 * 4 + 4: scratch row 1, step 0
}
# (layout, ssm dtype): every registered layout in bf16 (together every pair of the two block
# layouts, test_the_pools_cover_every_layout_pair), and fp32.
POOLS = [(name, "bfloat16") for name in LAYOUTS] + [("contiguous", "float32")]




def random_bits_(t: torch.Tensor, gen: torch.Generator) -> None:
    """Fill t with random bit patterns (NaNs and infs included)."""
    b = as_bits(t)
    info = torch.iinfo(b.dtype)
    b.copy_(torch.randint(info.min, info.max, t.shape, generator=gen, dtype=torch.int64).to(b.dtype))


def pool_for(layout: str, ssm_dtype: str) -> StatePool:
    """ci-small with 3 layers, every state filled with random bits."""
    cfg = preset("ci-small", layout=layout, ssm_dtype=ssm_dtype, num_layers=3)
    pool = StatePool(cfg, torch.device("cpu"))
    gen = torch.Generator().manual_seed(7)
    random_bits_(pool.temporal, gen)
    random_bits_(pool.intermediate_ssm, gen)
    random_bits_(pool.conv, gen)
    return pool


def test_the_pools_cover_every_layout_pair():
    pairs = set()
    for layout, dt in POOLS:
        pool = pool_for(layout, dt)
        pairs.add((pool.temporal.is_contiguous(), pool.intermediate_ssm.is_contiguous()))
    assert pairs == {(True, True), (False, False), (False, True), (True, False)}


@pytest.mark.parametrize("steps", list(STEPS))
@pytest.mark.parametrize("layout,ssm_dtype", POOLS)
def test_move_intermediate_cache_is_the_definition(monkeypatch, layout, ssm_dtype, steps):
    pool = pool_for(layout, ssm_dtype)
    last = torch.tensor(STEPS[steps], dtype=torch.int64)
    src = torch.arange(5, dtype=torch.int64)
    for dst in (pool.row_slots, pool.row_track_slots):
        want = pool.temporal.clone()
        naive.move_intermediate_cache(want, pool.intermediate_ssm, dst, src, last)
        if steps != "all-skipped":  # the case moves something (not vacuous)
            assert not same_bits(want, pool.temporal)
        # On drift's virtual device (in-place writes land in got): the device path, no host sync.
        got = pool.temporal.clone()
        report = detect_syncs(kernels.move_intermediate_cache, got, pool.intermediate_ssm, dst, src, last)
        assert report.clean, report.events
        assert same_bits(got, want)
        for host in (True, False):  # plain CPU tensors: the host-index row copies, then the device path
            monkeypatch.setattr(kernels, "HOST_INDEX_PATHS", host)
            out = pool.temporal.clone()
            assert kernels.move_intermediate_cache(out, pool.intermediate_ssm, dst, src, last) is out
            assert same_bits(out, want), host
            # Slot-strided views (every other slot of a wider buffer): both paths, same bits.
            Lp, Sp, HVp, Vp, Kp = out.shape
            if pool.temporal.is_contiguous():
                wide = torch.zeros(Lp, 2 * Sp, HVp, Vp, Kp, dtype=out.dtype)
            else:  # keep the block layout: a transposed view of [K, V] storage
                wide = torch.zeros(Lp, 2 * Sp, HVp, Kp, Vp, dtype=out.dtype).transpose(-1, -2)
            strided = wide[:, ::2]
            strided.copy_(pool.temporal)
            kernels.move_intermediate_cache(strided, pool.intermediate_ssm, dst, src, last)
            assert same_bits(strided, want), host
            assert same_bits(raw_state(strided), raw_state(want)), host


@pytest.mark.parametrize("host", [True, False])
def test_move_intermediate_cache_writes_through_a_slot_sliced_view(monkeypatch, host):
    """The real kernel addresses slots through the tensor's slot stride, so a view of the first S
    slots of a larger buffer is written in place like any other view."""
    monkeypatch.setattr(kernels, "HOST_INDEX_PATHS", host)
    pool = pool_for("contiguous", "bfloat16")
    L, S = pool.temporal.shape[:2]
    big = torch.zeros((L, S + 2) + tuple(pool.temporal.shape[2:]), dtype=pool.temporal.dtype)
    view = big[:, :S]
    view.copy_(pool.temporal)
    want = pool.temporal.clone()
    args = (pool.row_slots, torch.arange(5), torch.tensor(STEPS["mixed"]))
    naive.move_intermediate_cache(want, pool.intermediate_ssm, *args)
    kernels.move_intermediate_cache(view, pool.intermediate_ssm, *args)
    assert same_bits(view, want)


@pytest.mark.parametrize("host", [True, False])
def test_move_intermediate_cache_refuses_a_cast_on_both_paths(monkeypatch, host):
    monkeypatch.setattr(kernels, "HOST_INDEX_PATHS", host)
    pool = pool_for("contiguous", "bfloat16")
    one = torch.tensor([1])
    with pytest.raises(ValueError, match="does not cast"):
        kernels.move_intermediate_cache(pool.temporal, pool.intermediate_ssm.float(), one, one * 0, one * 0)


@pytest.mark.parametrize("steps", list(STEPS))
def test_conv_state_rollback_is_the_definition(monkeypatch, steps):
    gen = torch.Generator().manual_seed(3)
    L, S, W, C = 3, 11, 6, 48
    slots = torch.tensor([3, 5, 7, 9, 0], dtype=torch.int64)
    step = torch.tensor(STEPS[steps], dtype=torch.int64)  # rollback does skip steps >= D
    layouts = {
        "contiguous": torch.empty(L, S, W, C, dtype=torch.bfloat16),
        "transposed": torch.empty(L, S, C, W, dtype=torch.bfloat16).transpose(-1, -2),
        "slot-strided": torch.empty(L, 2 * S, W, C, dtype=torch.bfloat16)[:, ::2],
        "float32": torch.empty(L, S, W, C, dtype=torch.float32),
    }
    for name, conv in layouts.items():
        random_bits_(conv, gen)
        want = conv.clone()
        naive.conv_state_rollback(want, slots, step, 4)
        for host in (True, False):  # the host-index path, then the device path on the CPU
            monkeypatch.setattr(kernels, "HOST_INDEX_PATHS", host)
            out = conv.clone()
            kernels.conv_state_rollback(out, slots, step, 4)
            assert same_bits(out, want), (name, host)
        report = detect_syncs(kernels.conv_state_rollback, conv, slots, step, 4)  # virtual device
        assert report.clean, report.events
        assert same_bits(conv, want), name


CONV_LAYOUTS = ["contiguous", "channel-major", "slot-strided"]


@pytest.mark.parametrize("layout", CONV_LAYOUTS)
def test_conv_verify_paths_agree_with_the_loops(monkeypatch, layout):
    """Whole-slot row copies (dense [W, C] or channel-major [C, W] windows) and the generic
    index_select path (slot-strided), host and device, all give the naive loops' bits."""
    gen = torch.Generator().manual_seed(5)
    L, S, W, C, N, D, Kc = 2, 11, 6, 48, 5, 4, 4
    x = torch.randn(L, N, D, C, generator=gen).to(torch.bfloat16)
    weight = torch.randn(L, C, Kc, generator=gen).to(torch.bfloat16).to(torch.float32)
    slots = [3, 5, 7, 9, 0]
    vals = torch.randn(L, S, W, C, generator=gen).to(torch.bfloat16)

    def make():
        if layout == "contiguous":
            t = torch.empty(L, S, W, C, dtype=torch.bfloat16)
        elif layout == "channel-major":
            t = torch.empty(L, S, C, W, dtype=torch.bfloat16).transpose(-1, -2)
        else:
            t = torch.zeros(L, 2 * S, W, C, dtype=torch.bfloat16)[:, ::2]
        t.copy_(vals)
        return t

    loops = vals.clone()
    want = naive.conv_verify(loops, slots, x, weight)  # float64 holding the bf16 outputs
    slot_t = torch.tensor(slots, dtype=torch.int64)
    for host in (True, False):
        monkeypatch.setattr(kernels, "HOST_INDEX_PATHS", host)
        conv = make()
        got = kernels.conv_verify(conv, slot_t, x, weight)
        assert got.dtype == torch.bfloat16 and torch.equal(got.double(), want), host
        assert same_bits(conv, loops), host
    conv = make()
    det = SyncDetector()
    got = host_data(det.run(kernels.conv_verify, *to_virtual((conv, slot_t, x, weight))))
    assert det.report.clean, det.report.events
    assert torch.equal(got.double(), want) and same_bits(conv, loops)


# ------------------------------------------------------------------ the verify op
def op_args(seed: int, L: int, S: int, N: int, D: int, HV: int, K: int, V: int, inter_dtype=torch.bfloat16,
            slots=None, accepted=None, rounding="rne", key=0) -> VerifyArgs:
    """VerifyArgs with HK = HV (C = (2K + V) HV), bf16 committed states (slot 0 the NaN dummy) and a
    finite scratch [L, N+1, D, HV, V, K]; ``accepted`` sets num_accepted_tokens (rows then start
    from scratch blocks b * D + n - 1 where n - 1 is not 0)."""
    gen = torch.Generator().manual_seed(seed)
    rec = (torch.randn(L, S, HV, V, K, generator=gen) * 0.3).to(torch.bfloat16)
    rec[:, 0] = float("nan")
    inter = (torch.randn(L, N + 1, D, HV, V, K, generator=gen) * 0.3).to(inter_dtype)
    mix = torch.randn(L, N, D, (2 * K + V) * HV, generator=gen).to(torch.bfloat16)
    beta = torch.randn(L, N, D, HV, generator=gen).to(torch.bfloat16)
    g = -torch.rand(L, N, D, HV, generator=gen)
    slots = list(range(1, N + 1)) if slots is None else slots
    acc = torch.ones(N, dtype=torch.int32) if accepted is None else torch.tensor(accepted, dtype=torch.int32)
    return VerifyArgs(mix, beta, g, rec, inter, torch.tensor(slots, dtype=torch.int32),
                      torch.arange(N * D, dtype=torch.int32).view(N, D), acc, torch.full((N,), D, dtype=torch.int32),
                      HV, HV, K ** -0.5, rounding, key, rule=NpuRule())


@pytest.mark.parametrize("rounding", ["rne", "stochastic"])
def test_verify_does_not_depend_on_the_layer_chunk(monkeypatch, rounding):
    """The torch path processes STATE_CHUNK_BYTES worth of layers at a time; stochastic rounding
    hashes each element's global index, so the chunking changes no bit."""
    monkeypatch.setattr(kernels, "USE_NATIVE", False)
    L, S, N, D, HV, K, V = 5, 9, 3, 4, 2, 32, 16
    runs = []
    per_layer = N * HV * V * K * 4  # fp32 bytes of one layer's running states
    for chunk_bytes in (1, 3 * per_layer, 1 << 30):  # 1, 3 and all layers per chunk
        monkeypatch.setattr(kernels, "STATE_CHUNK_BYTES", chunk_bytes)
        assert kernels._layer_chunk((N, HV, V, K)) == {1: 1, 3 * per_layer: 3}.get(chunk_bytes, (1 << 30) // per_layer)
        args = op_args(13, L, S, N, D, HV, K, V, slots=[4, 1, 0], accepted=[2, 1, 1], rounding=rounding, key=9)
        runs.append((kernels.recurrent_gated_delta_rule(args), args.intermediate_state))
    for out, inter in runs[1:]:
        assert same_bits(out, runs[0][0]) and same_bits(inter, runs[0][1])
    assert runs[0][0].shape == (L, N, D, HV, V) and runs[0][0].dtype == torch.bfloat16


def test_verify_host_and_device_gathers_agree(monkeypatch):
    """The torch-op path gathers the start states by host-read indices on plain CPU tensors (one
    converting copy per row) and by index_select / where elsewhere, and stores by host-read
    indices or index_copy_: the same values, so the same bits, with rows starting from committed
    states (a repeated slot, the padded row on the NaN dummy) and from scratch blocks. The same
    device path on drift's virtual device makes no host-device sync (the step is graph-capturable).
    (The native kernel needs host indices; tests/sim/test_native.py covers it.)"""
    L, S, N, D, HV, K, V = 3, 9, 4, 4, 2, 32, 16
    monkeypatch.setattr(kernels, "USE_NATIVE", False)

    def case():
        return op_args(17, L, S, N, D, HV, K, V, slots=[4, 1, 4, 0], accepted=[1, 3, 4, 1])

    runs = []
    for host in (True, False):
        monkeypatch.setattr(kernels, "HOST_INDEX_PATHS", host)
        args = case()
        runs.append((kernels.recurrent_gated_delta_rule(args), args.intermediate_state))
    (out_h, inter_h), (out_d, inter_d) = runs
    assert same_bits(out_h, out_d) and same_bits(inter_h, inter_d)
    assert torch.isnan(out_h[:, 3]).all() and not torch.isnan(out_h[:, :3]).any()  # dummy row only
    # Negative control: rows 1 and 2 start from scratch blocks, and that shows.
    wrong = case()
    wrong = replace(wrong, num_accepted_tokens=torch.ones(N, dtype=torch.int32))
    assert not same_bits(kernels.recurrent_gated_delta_rule(wrong)[:, 1:3], out_h[:, 1:3])
    # The device path on the virtual device.
    args = case()
    fields = ("mix_qkv", "beta", "g", "recurrent_state", "intermediate_state", "cache_indices", "ssm_state_indices",
              "num_accepted_tokens", "actual_seq_lengths")
    tensors = to_virtual(tuple(getattr(args, f) for f in fields))

    def op(*ts):
        return kernels.recurrent_gated_delta_rule(replace(args, **dict(zip(fields, ts))))

    det = SyncDetector()
    out_v = host_data(det.run(op, *tensors))
    assert det.report.clean, det.report.events
    assert same_bits(out_v, out_h) and same_bits(args.intermediate_state, inter_h)


@pytest.mark.parametrize("host", [True, False])
def test_update_kernels_refuse_out_of_range_indices(monkeypatch, host):
    """A negative slot must not wrap around to the last slot (Python indexing would), and a flat
    scratch index past the buffer must not read past it: both paths raise IndexError (the device
    path through torch's index check)."""
    monkeypatch.setattr(kernels, "HOST_INDEX_PATHS", host)
    pool = pool_for("contiguous", "bfloat16")
    S = pool.temporal.shape[1]
    R, D = pool.intermediate_ssm.shape[1:3]
    def one(v):
        return torch.tensor([v], dtype=torch.int64)

    for bad in (-1, S):
        with pytest.raises(IndexError):
            kernels.move_intermediate_cache(pool.temporal, pool.intermediate_ssm, one(bad), one(0), one(1))
        with pytest.raises(IndexError):
            kernels.conv_state_rollback(pool.conv, one(bad), one(0), 4)
    for src, step in ((R - 1, D), (R, 0), (-1, 0)):  # flat R * D and -D: outside the scratch
        with pytest.raises(IndexError):
            kernels.move_intermediate_cache(pool.temporal, pool.intermediate_ssm, one(1), one(src), one(step))
    # Past D but inside the scratch: no error, the flat block (no upper bound on the step).
    kernels.move_intermediate_cache(pool.temporal, pool.intermediate_ssm, one(1), one(R - 2), one(D))
    assert same_bits(raw_state(pool.temporal)[:, 1], raw_state(pool.intermediate_ssm)[:, R - 1, 0])


@pytest.mark.parametrize("host", [True, False])
def test_skipped_rows_are_not_bounds_checked(monkeypatch, host):
    """The real kernel returns at ``last_steps[i] < 0`` before it computes any address
    (docs/semantics.md §3), so a skipped row's indices are never used, whatever they hold."""
    monkeypatch.setattr(kernels, "HOST_INDEX_PATHS", host)
    pool = pool_for("contiguous", "bfloat16")
    S, R = pool.temporal.shape[1], pool.intermediate_ssm.shape[1]
    before = pool.temporal.clone()
    for dst, src in ((1, R + 7), (S + 3, 0), (-1, -1)):
        kernels.move_intermediate_cache(pool.temporal, pool.intermediate_ssm, torch.tensor([dst]),
                                        torch.tensor([src]), torch.tensor([-1]))
    assert same_bits(pool.temporal, before)
