"""drift.flows.in_place.updates: vLLM 0.33.0's per-step bookkeeping, and its prefix-cache align copy in
particular (mamba_utils.postprocess_mamba_fused_kernel; docs/semantics.md §6).

One verify of the portable op through the vllm flow leaves every token's state in its block; the
align copy must then put the boundary token's state (and its conv window) into the right block:
the row's align block, or the running block when the boundary is the row's last verified token
(where the accept count becomes 1). Every comparison is bit for bit: the copy moves stored bits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import same_bits
from drift.config import preset
from drift.plug.loader import load_update
from drift.sim import kernels
from drift.flows.in_place.flow import InPlaceBlockFlow
from drift.sim.stream import StreamParams
from drift.flows.in_place.updates import vllm_0330

CPU = torch.device("cpu")
I64 = torch.int64
# Per active row (ci-small: R = 4, D = 4, one padded row): tokens verified, accepted, step tracked.
#   row 0: all 4 verified, 3 accepted, boundary after token 1 -> its align block, from block idx[0, 1];
#   row 1: 2 accepted, no boundary                             -> nothing written;
#   row 2: all 4 accepted, boundary after token 3 (the last)   -> the running block idx[2, 0], n = 1;
#   row 3: 1 verified (ragged), boundary after it (token 0)    -> the running block itself: no copy, n = 1.
DRAFTS = (4, 4, 4, 1)
ACCEPTED = (3, 2, 4, 1)
TRACKED = (1, -1, 3, 0)


def _verified_flow(seed: int = 11):
    """The vllm flow of ci-small after one verify of the portable op (seeded random inputs): the
    cache holds each token's state at ``block_table[r, t]`` and the conv cache the verify's columns.
    Returns (cfg, flow, per-token states [L, blocks, HV, V, K] bf16, conv cache [L, blocks, W, C])."""
    cfg = preset("ci-small", flow="vllm")
    flow = InPlaceBlockFlow(cfg, CPU)
    L, R, N, D = cfg.num_layers, cfg.num_requests, cfg.num_rows, cfg.num_draft_tokens
    HV, V, K, C = cfg.num_v_heads, cfg.head_v_dim, cfg.head_k_dim, cfg.conv_channels
    g = torch.Generator().manual_seed(seed)
    flow.load_start((0.1 * torch.randn(L, R, HV, V, K, generator=g)).to(cfg.torch_ssm_dtype),
                    torch.randn(L, R, cfg.conv_kernel - 1, C, generator=g))
    drafts = torch.tensor(DRAFTS + (D,) * (N - R), dtype=torch.int32)
    mix = flow.conv_verify(torch.randn(L, N, D, C, generator=g).to(torch.bfloat16),
                           StreamParams.generate(cfg).conv_weight, drafts)
    beta = torch.randn(L, N, D, HV, generator=g).to(torch.bfloat16)
    gate = -torch.rand(L, N, D, HV, generator=g, dtype=torch.float32)
    kernels.recurrent_gated_delta_rule(flow.verify_args(mix, beta, gate, cfg.store_rounding, 0, drafts))
    return cfg, flow, flow.pool.states.clone(), flow.pool.conv.clone()


def _step_inputs(cfg):
    """``(last [N], track steps [N])`` int64 as the simulation passes them (padded rows -1)."""
    pad = (-1,) * cfg.num_padded
    return (torch.tensor(tuple(a - 1 for a in ACCEPTED) + pad, dtype=I64), torch.tensor(TRACKED + pad, dtype=I64))


def test_the_align_copy_puts_the_boundary_tokens_state_and_window_into_its_destination_block():
    cfg, flow, per_token, conv0 = _verified_flow()
    pool, h = flow.pool, flow.harness
    idx, align = pool.block_table_host, pool.track_slots
    Km1, W = cfg.conv_kernel - 1, cfg.conv_window
    # The test tells blocks apart: the boundary token's state is not its neighbours'.
    assert not same_bits(per_token[:, idx[0, 1]], per_token[:, idx[0, 2]])
    last, steps = _step_inputs(cfg)
    vllm_0330(h, last, pool.row_track_slots, steps)
    states, conv = pool.states, pool.conv
    # row 0: the state after token 1 into its align block; the window after token 1 into its first Kc-1 columns
    assert same_bits(states[:, align[0]], per_token[:, idx[0, 1]])
    assert same_bits(conv[:, align[0], :Km1], conv0[:, idx[0, 0], 1:1 + Km1])
    # row 2: the state after its last token into the running block, its conv shifted left by 3 in place
    assert same_bits(states[:, idx[2, 0]], per_token[:, idx[2, 3]])
    assert same_bits(conv[:, idx[2, 0], :W - 3], conv0[:, idx[2, 0], 3:])
    assert same_bits(conv[:, idx[2, 0], W - 3:], conv0[:, idx[2, 0], W - 3:])  # the columns past the copy kept
    # accept counts: the runner's (accepted tokens), 1 where the copy went to the running block, 1 for padding
    assert h.num_accepted_tokens.tolist() == [3, 2, 1, 1] + [1] * cfg.num_padded
    # nothing else moved: rows 1 and 3 copy nothing (row 3's destination is its own running block)
    written = [align[0], idx[2, 0]]
    rest = np.setdiff1d(np.arange(pool.num_blocks), written)
    assert same_bits(states[:, rest], per_token[:, rest]) and same_bits(conv[:, rest], conv0[:, rest])
    # the flow reports what the destinations hold, and the blocks it may write are exactly these
    track = np.array(TRACKED)
    rows, got, win, bits_bad, _ = flow.tracked_snapshot(track)
    assert rows.tolist() == [0, 2, 3] and bits_bad.tolist() == [0, 0, 0]
    assert same_bits(got[:, 0], per_token[:, idx[0, 1]]) and same_bits(got[:, 2], per_token[:, idx[3, 0]])
    assert same_bits(win[:, 1], conv0[:, idx[2, 0], 3:3 + Km1])
    touched = flow.touched(track[None], np.array(DRAFTS)[None])
    assert sorted(np.nonzero(touched[0])[0].tolist()) == sorted([align[0], idx[2, 0], idx[3, 0]])


def test_copying_the_last_accepted_tokens_block_is_caught_by_the_snapshot():
    cfg, flow, per_token, _ = _verified_flow()
    pool = flow.pool
    last, steps = _step_inputs(cfg)
    load_update("mutant:vllm_align_wrong_block")(flow.harness, last, pool.row_track_slots, steps)
    idx = pool.block_table_host
    assert same_bits(pool.states[:, pool.track_slots[0]], per_token[:, idx[0, 2]])  # n - 1 = 2, not the boundary's 1
    rows, _, _, bits_bad, _ = flow.tracked_snapshot(np.array(TRACKED))
    assert bits_bad[0] > 0 and bits_bad[1:].tolist() == [0, 0]  # rows 2, 3: boundary at the last accepted token


def test_without_tracking_nothing_is_copied():
    cfg, flow, per_token, conv0 = _verified_flow()
    last, _ = _step_inputs(cfg)
    vllm_0330(flow.harness, last, None, None)  # track_interval 0: the simulation passes None (align mode off)
    assert same_bits(flow.pool.states, per_token) and same_bits(flow.pool.conv, conv0)
    assert flow.harness.num_accepted_tokens.tolist()[:cfg.num_requests] == list(ACCEPTED)


@pytest.mark.parametrize("drafts", ["full", "ragged"])
def test_the_stream_boundary_is_vllms_block_boundary(drafts):
    """drift's track step with interval I is vLLM's align copy with block size I (docs/semantics.md §6):
    postprocess_mamba_fused_kernel copies where ``aligned_new_computed >= num_tokens_running_state``,
    with bias ``aligned_new_computed - num_tokens_running_state``; here by the kernel's own formulas."""
    from drift.sim.stream import InputStream
    cfg = preset("ci-small", flow="vllm", drafts=drafts)
    chunk = InputStream(cfg, CPU).chunk(256)
    I = cfg.track_interval
    pre, acc, d = chunk.pre, chunk.accept, chunk.drafts_host
    num_computed, num_scheduled, num_draft = pre, d, d - 1
    running = num_computed + num_scheduled - num_draft
    new = running + acc - 1
    aligned = new // I * I
    want = np.where(aligned >= running, aligned - running, -1)
    assert (chunk.track_host == want).all() and (want >= 0).sum() > 20
    # the destination column is the running one exactly where drift copies into the running block
    src_col = -(-(num_computed + num_scheduled) // I) - 1
    same = (want >= 0) & (aligned // I - 1 == src_col)
    assert (same == ((want >= 0) & (want == num_draft))).all() and same.any()


@pytest.mark.parametrize("shift, fails", [(1, True), (0, False)])
def test_an_accept_count_past_the_rows_blocks_fails_the_run_naming_the_update(shift, fails):
    """An update that leaves num_accepted_tokens one too high (D + 1 once a row accepts all D) is the
    update's regression (exit 1), said as such, not an IndexError inside drift's comparison; the same
    bookkeeping without the shift (the control) passes."""
    from drift.errors import UpdateRaised
    from drift.flows.in_place.updates import bookkeeping, kept_tokens
    from drift.runner import run_checked
    from drift.runspec import RunSpec

    def accept(self, last):
        R = self.num_spec_decodes
        self.num_accepted_tokens[:R].copy_(kept_tokens(last)[:R] + shift)
        self.num_accepted_tokens[R:].fill_(1)

    run = RunSpec(preset="ci-small", flow="vllm", steps=32, lifecycle="fixed",
                  update=bookkeeping(accept=accept, name=f"accept_plus{shift}")).resolve()
    if not fails:
        assert run_checked(run, sync_scan=False).passed
        return
    with pytest.raises(UpdateRaised, match=r"accept_plus1\) left num_accepted_tokens = 5 in row \d, outside "
                                           r"0\.\.D = 4: .*past the row's 4 blocks.*, at decode step \d+"):
        run_checked(run, sync_scan=False)
