"""drift/flows/copy_commit/naive.py: the copy-commit kind's verify rule (sgl-kernel-npu's op as SGLang
0.5.23 calls it), pinned by hand-worked examples from docs/semantics.md §6 (so a wrong definition
cannot make a wrong kernel pass). States are ``[V, K]`` blocks, the op's order; every expected
value is worked out here, not by calling drift."""

from __future__ import annotations

import math

import pytest
import torch

from drift.flows.copy_commit import naive
from drift.flows.copy_commit.rule import NpuRule
from drift.sim.kernels import VerifyArgs

F64, BF16 = torch.float64, torch.bfloat16


def _naive(mix, beta, g, rec, blocks, cache, idx, acc, lens, store=None):
    """The rule's naive verify on one head (nk = nv = 1, scale 1) over flat scratch ``blocks [1, I, 1, V, K]``
    (written in place), S = idx's columns."""
    S = idx.shape[1]
    inter = blocks.view(1, blocks.shape[1] // S, S, *blocks.shape[2:])
    args = VerifyArgs(mix, beta, g, rec, inter, cache, idx, acc, lens, 1, 1, 1.0, rule=NpuRule())
    return naive.verify(args, store=store)


def _one_head_args(B: int, S: int):
    """mix for HK = HV = 1, K = 2, V = 1 (C = 5): q = [0, 1], k = [1, 0] (before the norm), v = 2."""
    mix = torch.tensor([0.0, 1.0, 1.0, 0.0, 2.0], dtype=F64).expand(1, B, S, 5).clone()
    return mix


def test_recurrent_gated_delta_rule_start_rule_and_stores_by_hand():
    """docs/semantics.md §6, S = 2 tokens, 4 rows, 1 head, K = 2, V = 1. Row b starts at
    i = ssm_state_indices[b, num_accepted[b] - 1]: the committed state when i % S == 0, else the
    scratch block i; it stores the state after token t into block ssm_state_indices[b, t].

    With k = [1, 0] / sqrt(1 + 1e-6) =: c e1 and decay 1, one token maps a [1, 2] state
    h = [x, y] to [x + beta c (2 - c x), y]: the second column is untouched and so
    identifies the start block."""
    B, S = 4, 2
    mix = _one_head_args(B, S)
    beta_logit = torch.zeros(1, B, S, 1)  # beta = 1/2
    g = torch.zeros(1, B, S, 1)  # decay 1
    rec = torch.zeros(1, 3, 1, 1, 2, dtype=F64)
    rec[0, :, 0, 0, 1] = torch.tensor([100.0, 101.0, 102.0])  # committed slot s: y = 100 + s
    blocks = torch.zeros(1, 10, 1, 1, 2, dtype=F64)  # 5 rows x S: flat blocks 0..9
    blocks[0, :, 0, 0, 1] = torch.arange(10, dtype=F64)  # scratch block i: y = i
    rec_before, blocks_before = rec.clone(), blocks.clone()
    cache = torch.tensor([1, 2, 2, 1], dtype=torch.int32)
    idx = torch.tensor([[0, 1],  # num_accepted 1, i = 0: committed slot 1
                        [2, 3],  # num_accepted 2, i = 3 (odd): scratch block 3
                        [5, 4],  # num_accepted 2, i = 4 (4 % 2 == 0): committed slot 2
                        [7, 6]], dtype=torch.int32)  # num_accepted 1, i = 7: scratch block 7
    acc = torch.tensor([1, 2, 2, 1], dtype=torch.int32)
    lens = torch.full((B,), S, dtype=torch.int32)
    out = _naive(mix, beta_logit, g, rec, blocks, cache, idx, acc, lens)
    assert out.shape == (1, B, S, 1, 1) and out.dtype == F64
    start_y = [101.0, 3.0, 102.0, 7.0]
    c = 1.0 / math.sqrt(1.0 + 1e-6)
    for b in range(B):
        x = 0.0  # every start block has x = 0
        for t in range(S):
            x = x + 0.5 * c * (2.0 - c * x)
            blk = blocks[0, int(idx[b, t]), 0, 0]
            assert blk[1].item() == start_y[b], (b, t)
            assert blk[0].item() == pytest.approx(x, rel=1e-14)
            # o = S q with q = [0, 1] / sqrt(1 + 1e-6) (scale 1): the y column.
            assert out[0, b, t, 0, 0].item() == pytest.approx(start_y[b] * c, rel=1e-14)
    # Blocks no index names (8, 9: the spare row) and the committed states are untouched.
    assert torch.equal(blocks[:, 8:], blocks_before[:, 8:])
    assert torch.equal(rec, rec_before)


def test_recurrent_gated_delta_rule_store_hook_maps_only_the_stored_state():
    """``store`` rounds what is written; the running state (and so the outputs) stay exact."""
    B, S = 1, 2
    mix = _one_head_args(B, S)
    rec = torch.zeros(1, 1, 1, 1, 2, dtype=F64)
    rec[0, 0, 0, 0, 1] = 1.0 + 2.0 ** -12  # not a bf16 value
    args = (torch.zeros(1, B, S, 1), torch.zeros(1, B, S, 1), rec)
    idx = torch.tensor([[0, 1]], dtype=torch.int32)
    one = torch.ones(1, dtype=torch.int32)
    two = torch.full((1,), 2, dtype=torch.int32)
    exact = torch.zeros(1, 2, 1, 1, 2, dtype=F64)
    rounded = torch.zeros(1, 2, 1, 1, 2, dtype=F64)
    o1 = _naive(mix, *args, exact, torch.zeros(1, dtype=torch.int32), idx, one, two)
    o2 = _naive(mix, *args, rounded, torch.zeros(1, dtype=torch.int32), idx, one, two,
                store=lambda h: h.to(BF16).to(F64))
    assert torch.equal(o1, o2)
    assert exact[0, 1, 0, 0, 1].item() == 1.0 + 2.0 ** -12
    assert rounded[0, 1, 0, 0, 1].item() == 1.0  # 2^-12 is below half a bf16 ulp (2^-8)
