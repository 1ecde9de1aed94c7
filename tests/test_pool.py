"""drift.pool: SGLang MambaPool layout, slot bookkeeping, sentinels and the harness the
update under test receives as ``self``. K = 16 != V = 8 so a K/V swap shows."""

from __future__ import annotations

import pytest
import torch

from conftest import same_bits, small_cfg
from drift.sim.pool import Harness, StatePool

CPU = torch.device("cpu")


def _pool(**kw):
    cfg = small_cfg(head_k_dim=16, head_v_dim=8, **kw)
    return cfg, StatePool(cfg, CPU)


def test_npu_layout_is_a_transposed_view_of_kv_storage():
    cfg, p = _pool(layout="npu")
    L, S, N, D, HV, K, V = (cfg.num_layers, cfg.num_slots, cfg.num_rows, cfg.num_draft_tokens,
                            cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim)
    assert p.temporal.shape == (L, S, HV, V, K) and p.intermediate_ssm.shape == (L, N + 1, D, HV, V, K)
    assert not p.temporal.is_contiguous() and p.temporal.transpose(-1, -2).is_contiguous()
    assert not p.intermediate_ssm.is_contiguous() and p.inter_kv.is_contiguous()
    assert p.ssm_kv.shape == (L, S, HV, K, V) and p.ssm_kv.data_ptr() == p.temporal.data_ptr()
    # Conv windows: a transposed view of channel-major [L, S, C, W] storage, so code working
    # on a .contiguous() copy loses its writes (sgl-kernel-npu #748).
    assert p.conv.shape == (L, S, cfg.conv_window, cfg.conv_channels)
    assert not p.conv.is_contiguous() and p.conv.transpose(-1, -2).is_contiguous()
    assert p.temporal.dtype == p.intermediate_ssm.dtype == torch.bfloat16


def test_contiguous_layout_and_fp32_profile():
    cfg, p = _pool(ssm_dtype="float32", layout="contiguous")
    assert p.temporal.is_contiguous() and p.intermediate_ssm.is_contiguous()
    assert not p.ssm_kv.is_contiguous()  # the kernels' [K, V] orientation is the view here
    assert p.conv.is_contiguous()
    assert p.temporal.dtype == torch.float32 and p.conv.dtype == torch.bfloat16


def test_slots_partition_the_pool_around_the_dummy():
    cfg, p = _pool()
    req, trk, spare = (set(map(int, a)) for a in (p.request_slots, p.track_slots, p.spare_slots))
    assert len(req) == len(trk) == cfg.num_requests and len(spare) == cfg.spare_slots
    assert req | trk | spare == set(range(1, cfg.num_slots))  # every slot but the dummy 0
    assert not (req & trk or req & spare or trk & spare)
    R = cfg.num_requests
    assert p.row_slots.tolist() == p.request_slots.tolist() + [0] * cfg.num_padded
    assert p.row_track_slots.tolist() == p.track_slots.tolist() + [0] * cfg.num_padded
    assert p.row_slots.dtype == torch.int64 and p.active_slots.tolist() == p.row_slots[:R].tolist()
    # Seeded: the same config lays out the same slots; another seed another permutation.
    assert p.request_slots.tolist() == StatePool(cfg, CPU).request_slots.tolist()
    others = [StatePool(cfg.replace(seed=s), CPU).request_slots.tolist() for s in (1, 2, 3)]
    assert any(o != p.request_slots.tolist() for o in others)


def test_sentinels_make_stray_reads_and_writes_visible():
    cfg, p = _pool()
    assert torch.isnan(p.temporal[:, 0]).all() and torch.isnan(p.conv[:, 0]).all()
    assert torch.isnan(p.intermediate_ssm[:, -1]).all()  # the spare scratch row
    for s in p.spare_slots.tolist():
        assert (p.temporal[:, s] == 3.0 + s).all() and (p.conv[:, s] == -3.0 - s).all()
    assert p.slot_role(0) == "dummy slot 0"
    assert p.slot_role(int(p.request_slots[2])) == "request slot of row 2"
    assert p.slot_role(int(p.track_slots[1])) == "track slot of row 1"
    assert p.slot_role(int(p.spare_slots[0])) == "spare slot"


def test_bits_are_views_for_nan_safe_comparison():
    _, p = _pool()
    t_bits, c_bits = p.bits()
    assert t_bits.dtype == torch.int16 and c_bits.dtype == torch.int16
    saved = t_bits.clone()
    p.temporal[:, 0] = -p.temporal[:, 0]  # NaN -> NaN with the sign bit flipped
    assert not torch.equal(p.bits()[0], saved)  # seen, although NaN == NaN is False either way


def test_harness_exposes_exactly_what_the_sglang_method_reads():
    cfg, p = _pool()
    h = Harness(p)
    idx = h.linear_attn_backend.forward_metadata.mamba_cache_indices
    assert idx.dtype == torch.int32 and idx.tolist() == p.row_slots.tolist()
    params = h.linear_attn_backend.req_to_token_pool.get_speculative_mamba2_params_all_layers()
    assert isinstance(params.conv, list) and params.conv[0] is p.conv
    assert params.temporal is p.temporal and params.intermediate_ssm is p.intermediate_ssm
    assert params.intermediate_conv_window == []  # CUDA only
    # Writes through the returned tensors land in the pool (what the update relies on).
    slot = int(p.request_slots[0])
    params.temporal[:, slot] = 1.5
    assert (p.ssm_kv[:, slot] == 1.5).all()
    with pytest.raises(AttributeError, match=r"self\.model_runner.*drift's harness does not provide"):
        h.model_runner


def test_harness_backend_objects_have_no_other_attributes():
    _, p = _pool()
    be = Harness(p).linear_attn_backend
    with pytest.raises(AttributeError):
        be.forward_metadata.query_start_loc = None  # __slots__: nothing silently invented
    with pytest.raises(AttributeError):
        be.req_to_token_pool.mamba_pool


def test_state_pools_are_independent():
    cfg, p = _pool()
    q = StatePool(cfg, CPU)
    p.temporal[:, int(p.request_slots[0])] = 2.0
    assert same_bits(q.temporal[:, int(q.request_slots[0])], torch.zeros_like(q.temporal[:, 0]))
