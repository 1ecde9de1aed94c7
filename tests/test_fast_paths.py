"""The row-copy fast paths of drift.kernels give exactly what their definitions give.

move_intermediate_cache and conv_state_rollback are pure copies, so they must match the
loops in drift.naive bit for bit (NaN payloads included) on every layout, through the fast
row path and the generic fallback alike. conv_verify/conv_silu and gdn_verify were made
faster without changing their arithmetic; what that relies on is pinned here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from drift.sim import kernels, naive
from drift.config import preset
from drift.sim.pool import StatePool
from drift.syncs.detector import detect_syncs

STEPS = {  # last_steps of the 5 batch rows (D = 4): -1 skips, D is out of range (skips too)
    "mixed": [3, 0, -1, 2, -1],
    "track-like": [-1, -1, 2, -1, -1],
    "all-skipped": [-1, -1, -1, -1, -1],
    "all-committed": [0, 1, 2, 3, 3],
    "out-of-range": [4, 1, -3, 0, -1],
}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def random_bits_(t: torch.Tensor, gen: torch.Generator) -> None:
    """Fill t with random bit patterns (NaNs and infs included)."""
    b = bits(t)
    info = torch.iinfo(b.dtype)
    b.copy_(torch.randint(info.min, info.max, t.shape, generator=gen, dtype=torch.int64).to(b.dtype))


def pool_for(layout: str, ssm_dtype: str) -> StatePool:
    cfg = preset("ci-small", layout=layout, ssm_dtype=ssm_dtype, num_layers=3)
    pool = StatePool(cfg, torch.device("cpu"))
    gen = torch.Generator().manual_seed(7)
    random_bits_(pool.temporal, gen)
    random_bits_(pool.intermediate_ssm, gen)
    random_bits_(pool.conv, gen)
    return pool


@pytest.mark.parametrize("steps", list(STEPS))
@pytest.mark.parametrize("layout,ssm_dtype", [("npu", "bfloat16"), ("contiguous", "bfloat16"),
                                              ("npu", "float32")])
def test_move_intermediate_cache_is_the_definition(layout, ssm_dtype, steps):
    pool = pool_for(layout, ssm_dtype)
    last = torch.tensor(STEPS[steps], dtype=torch.int64)
    src = torch.arange(5, dtype=torch.int64)
    for dst in (pool.row_slots, pool.row_track_slots):
        want = pool.temporal.clone()
        naive.move_intermediate_cache(want, pool.intermediate_ssm, dst, src, last)
        got = pool.temporal.clone()
        # On drift's virtual device (in-place writes land in got): no host-device sync.
        report = detect_syncs(kernels.move_intermediate_cache, got, pool.intermediate_ssm, dst, src, last)
        assert report.clean, report.events
        assert torch.equal(bits(got), bits(want))
        # Plain CPU tensors: the host-index row copies.
        host = pool.temporal.clone()
        kernels.move_intermediate_cache(host, pool.intermediate_ssm, dst, src, last)
        assert torch.equal(bits(host), bits(want))
        # Slot-strided views do not flatten into rows: the generic device path (virtual device)
        # and the host path.
        wide = torch.zeros((got.shape[0], 2 * got.shape[1]) + tuple(got.shape[2:]), dtype=got.dtype)
        for run_on_host in (False, True):
            strided = wide[:, ::2]
            strided.copy_(pool.temporal)
            if run_on_host:
                kernels.move_intermediate_cache(strided, pool.intermediate_ssm, dst, src, last)
            else:
                assert detect_syncs(kernels.move_intermediate_cache, strided, pool.intermediate_ssm, dst,
                                    src, last).clean
            assert torch.equal(bits(strided), bits(want))


@pytest.mark.parametrize("steps", list(STEPS))
def test_conv_state_rollback_is_the_definition(steps):
    gen = torch.Generator().manual_seed(3)
    L, S, W, C = 3, 11, 6, 48
    slots = torch.tensor([3, 5, 7, 9, 0], dtype=torch.int64)
    step = torch.tensor(STEPS[steps], dtype=torch.int64)
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
        host = conv.clone()  # plain CPU tensors: the host-index path
        kernels.conv_state_rollback(host, slots, step, 4)
        assert torch.equal(bits(host), bits(want)), name
        report = detect_syncs(kernels.conv_state_rollback, conv, slots, step, 4)  # the device path
        assert report.clean, report.events
        assert torch.equal(bits(conv), bits(want)), name


def test_conv_verify_row_and_generic_paths_agree_with_the_loops():
    gen = torch.Generator().manual_seed(5)
    L, S, W, C, N, D, Kc = 2, 11, 6, 48, 5, 4, 4
    x = torch.randn(L, N, D, C, generator=gen).to(torch.bfloat16)
    weight = torch.randn(L, C, Kc, generator=gen).to(torch.bfloat16).to(torch.float32)
    slots = [3, 5, 7, 9, 0]
    dense = torch.randn(L, S, W, C, generator=gen).to(torch.bfloat16)
    strided = torch.zeros(L, 2 * S, W, C, dtype=torch.bfloat16)[:, ::2]  # generic path
    strided.copy_(dense)
    loops = dense.clone()
    want = naive.conv_verify(loops, slots, x, weight, dtype=torch.float32)
    slot_t = torch.tensor(slots, dtype=torch.int64)
    got = kernels.conv_verify(dense, slot_t, x, weight)
    got_strided = kernels.conv_verify(strided, slot_t, x, weight)
    assert torch.equal(bits(dense), bits(loops)) and torch.equal(bits(strided), bits(loops))
    assert torch.equal(got, got_strided)
    # Same taps in the same order; the loops' silu is x * sigmoid(x), F.silu's differs in
    # float32 rounding of the exp and the division: up to 4 ulp (2^-23 each) relative, plus
    # 2^-24 absolute for outputs near zero (measured: at most ~3 ulp).
    assert torch.allclose(got, want, rtol=4 * 2.0**-23, atol=2.0**-24)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(2, 5, 4, 48, 4), (3, 2, 8, 16, 4), (1, 3, 1, 8, 2)])
def test_conv_silu_keeps_einsum_values_and_layout(dtype, shape):
    """split_qkv reduces over C in memory order, so the layout is part of the result."""
    L, N, n, C, Kc = shape
    gen = torch.Generator().manual_seed(11)
    window = torch.randn(L, N, Kc - 1, C, generator=gen, dtype=dtype)
    x = torch.randn(L, N, n, C, generator=gen, dtype=dtype)
    weight = torch.randn(L, C, Kc, generator=gen)
    seq = torch.cat([window, x], dim=2)
    ref = F.silu(torch.einsum("lndck,lck->lndc", seq.unfold(2, Kc, 1), weight.to(dtype)))
    got = kernels.conv_silu(window, x, weight, dtype)
    assert torch.equal(got, ref)
    assert got.permute(0, 3, 1, 2).is_contiguous()  # memory order [L, C, N, D]


def test_gdn_verify_does_not_depend_on_the_layer_chunk(monkeypatch):
    gen = torch.Generator().manual_seed(13)
    L, S, N, D, HV, K = 5, 9, 3, 4, 2, 32
    state = torch.randn(L, S, HV, K, K, generator=gen).to(torch.bfloat16)
    q = F.normalize(torch.randn(L, N, D, HV, K, generator=gen), dim=-1) * K**-0.5
    k = F.normalize(torch.randn(L, N, D, HV, K, generator=gen), dim=-1)
    v = torch.randn(L, N, D, HV, K, generator=gen)
    g, beta = -torch.rand(L, N, D, HV, generator=gen), torch.rand(L, N, D, HV, generator=gen)
    slots = torch.tensor([4, 1, 0], dtype=torch.int64)
    runs = []
    for chunk_bytes in (1, 3 * N * HV * K * K * 4, 1 << 30):  # 1, 3 and all layers per chunk
        monkeypatch.setattr(kernels, "STATE_CHUNK_BYTES", chunk_bytes)
        inter = torch.zeros(L, N, D, HV, K, K, dtype=torch.bfloat16)
        runs.append((kernels.gdn_verify(state, slots, q, k, v, g, beta, inter), inter))
    for out, inter in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(bits(inter), bits(runs[0][1]))
    assert runs[0][0].shape == (L, N, D, HV, K) and runs[0][0].is_contiguous()


def test_gdn_verify_host_and_device_gathers_agree(monkeypatch):
    """The torch-op path gathers the committed states by host-read slots on plain CPU tensors
    (one converting copy per row) and by index_select elsewhere: the same values, so the same
    bits after. (The native kernel needs host slots; tests/test_native.py covers it.)"""
    gen = torch.Generator().manual_seed(17)
    L, S, N, D, HV, K = 3, 9, 4, 4, 2, 32
    state = torch.randn(L, S, HV, K, K, generator=gen).to(torch.bfloat16)
    state[:, 0] = float("nan")  # the dummy slot
    q = F.normalize(torch.randn(L, N, D, HV, K, generator=gen), dim=-1) * K**-0.5
    k = F.normalize(torch.randn(L, N, D, HV, K, generator=gen), dim=-1)
    v = torch.randn(L, N, D, HV, K, generator=gen)
    g, beta = -torch.rand(L, N, D, HV, generator=gen), torch.rand(L, N, D, HV, generator=gen)
    slots = torch.tensor([4, 1, 4, 0], dtype=torch.int64)  # a repeated slot, and the padded row
    monkeypatch.setattr(kernels, "USE_NATIVE", False)
    runs = []
    for host in (True, False):
        monkeypatch.setattr(kernels, "HOST_INDEX_PATHS", host)
        inter = torch.zeros(L, N, D, HV, K, K, dtype=torch.bfloat16)
        runs.append((kernels.gdn_verify(state, slots, q, k, v, g, beta, inter), inter))
    (out_h, inter_h), (out_d, inter_d) = runs
    assert torch.equal(bits(out_h), bits(out_d)) and torch.equal(bits(inter_h), bits(inter_d))
    assert torch.isnan(out_h[:, 3]).all() and not torch.isnan(out_h[:, :3]).any()  # dummy row only


@pytest.mark.parametrize("host", [True, False])
def test_update_kernels_refuse_out_of_range_slots(monkeypatch, host):
    """A negative slot must not wrap around to the last slot (Python indexing would): both
    paths raise (the device path through torch's index check)."""
    monkeypatch.setattr(kernels, "HOST_INDEX_PATHS", host)
    pool = pool_for("npu", "bfloat16")
    S = pool.temporal.shape[1]
    one = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    for bad in (-1, S):
        with pytest.raises(IndexError):
            kernels.move_intermediate_cache(pool.temporal, pool.intermediate_ssm, one(bad), one(0), one(1))
        with pytest.raises(IndexError):
            kernels.conv_state_rollback(pool.conv, one(bad), one(0), 4)
