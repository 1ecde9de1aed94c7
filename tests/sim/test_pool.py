"""drift.sim.pool: SGLang MambaPool layout, slot bookkeeping, sentinels and the harness the
update under test receives as ``self``. K = 16 != V = 8 so a K/V swap shows."""

from __future__ import annotations

import pytest
import torch

from helpers import same_bits, small_cfg
from drift.config import PROFILES
from drift.layouts import LAYOUTS
from drift.flows.copy_commit.harness import SGLangHarness
from drift.sim.pool import StatePool, raw_state

CPU = torch.device("cpu")


def _pool(profile=None, **kw):
    cfg = small_cfg(head_k_dim=16, head_v_dim=8, profile=profile, **kw)
    return cfg, StatePool(cfg, CPU)


def test_ascend_profile_is_sglang_0523s_plain_contiguous_pool():
    """SGLang 0.5.23 MambaPool (docs/semantics.md §4): temporal [L, S, HV, V, K] and
    intermediate_ssm [L, rows + 1, D, HV, V, K] plain contiguous, conv [L, S, W, C] contiguous."""
    cfg, p = _pool()
    L, S, N, D, HV, K, V = (cfg.num_layers, cfg.num_slots, cfg.num_rows, cfg.num_draft_tokens,
                            cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim)
    assert cfg.profile == "ascend" and cfg.layout == "contiguous"
    assert p.temporal.shape == (L, S, HV, V, K) and p.temporal.is_contiguous()
    assert p.intermediate_ssm.shape == (L, N + 1, D, HV, V, K) and p.intermediate_ssm.is_contiguous()
    assert p.conv.shape == (L, S, cfg.conv_window, cfg.conv_channels) and p.conv.is_contiguous()
    assert p.temporal.dtype == p.intermediate_ssm.dtype == p.conv.dtype == torch.bfloat16
    assert p.states is p.temporal and p.scratch is p.intermediate_ssm  # raw meaning = the tensors


@pytest.mark.parametrize("profile", list(PROFILES))
def test_every_profile_allocates_its_layout(profile):
    """Each tensor the layout says is a transposed view is one (of [K, V] storage for temporal and
    scratch, of [C, W] for conv) and every other is dense: ascend-transposed has all three
    transposed, ascend-mixed only the committed state (tests/test_config.py pins the registry)."""
    cfg, p = _pool(profile=profile)
    layout = LAYOUTS[PROFILES[profile].layout]
    K, V = cfg.head_k_dim, cfg.head_v_dim
    for t, transposed in ((p.temporal, layout.state_kv_storage), (p.intermediate_ssm, layout.scratch_kv_storage),
                          (p.conv, layout.conv_channel_major)):
        assert t.is_contiguous() is not transposed
        assert t.transpose(-1, -2).is_contiguous() is transposed
    assert p.temporal.shape[-2:] == p.intermediate_ssm.shape[-2:] == (V, K)
    assert p.conv.shape[-2:] == (cfg.conv_window, cfg.conv_channels)
    # The raw meaning reinterprets the same memory as dense [V, K] blocks (a view).
    assert p.states.is_contiguous() and p.states.data_ptr() == p.temporal.data_ptr()
    assert p.scratch.is_contiguous() and p.scratch.data_ptr() == p.intermediate_ssm.data_ptr()


def test_raw_state_reads_a_block_as_its_memory_holds_it():
    """raw_state of a transposed view is the storage read row-major, not the logical view; of a
    dense tensor it is the tensor itself; a block that is dense in neither order is refused."""
    storage = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)  # [n, K=3, V=4] storage
    view = storage.transpose(-1, -2)  # logical [n, V=4, K=3]
    raw = raw_state(view)
    assert raw.shape == (2, 4, 3) and raw.data_ptr() == storage.data_ptr()
    assert torch.equal(raw.reshape(-1), storage.reshape(-1))  # memory order
    assert not torch.equal(raw, view)  # the logical view disagrees (control)
    dense = torch.zeros(2, 4, 3)
    assert raw_state(dense) is dense
    with pytest.raises(ValueError, match="not dense"):
        raw_state(torch.zeros(2, 8, 6)[:, ::2, ::2])


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
    h = SGLangHarness(p)
    idx = h.linear_attn_backend.forward_metadata.mamba_cache_indices
    assert idx.dtype == torch.int32 and idx.tolist() == p.row_slots.tolist()
    params = h.linear_attn_backend.req_to_token_pool.get_speculative_mamba2_params_all_layers()
    assert isinstance(params.conv, list) and params.conv[0] is p.conv
    assert params.temporal is p.temporal and params.intermediate_ssm is p.intermediate_ssm
    assert params.intermediate_conv_window == []  # CUDA only
    # Writes through the returned tensors land in the pool (what the update relies on).
    slot = int(p.request_slots[0])
    params.temporal[:, slot] = 1.5
    assert (p.states[:, slot] == 1.5).all()
    with pytest.raises(AttributeError, match=r"self\.model_runner.*drift's harness does not provide"):
        h.model_runner


def test_harness_backend_objects_have_no_other_attributes():
    _, p = _pool()
    be = SGLangHarness(p).linear_attn_backend
    with pytest.raises(AttributeError):
        be.forward_metadata.query_start_loc = None  # __slots__: nothing silently invented
    with pytest.raises(AttributeError):
        be.req_to_token_pool.mamba_pool


def test_state_pools_are_independent():
    cfg, p = _pool()
    q = StatePool(cfg, CPU)
    p.temporal[:, int(p.request_slots[0])] = 2.0
    assert same_bits(q.temporal[:, int(q.request_slots[0])], torch.zeros_like(q.temporal[:, 0]))
