"""drift.flows.copy_commit.backend: the verify op's arguments as SGLang 0.5.23's Ascend backend builds them, and
where the op then starts each row (docs/semantics.md §6)."""

from __future__ import annotations

import pytest
import torch

from helpers import run_sim, small_cfg
from drift.dtypes import as_bits
from drift.flows.registry import state_flow

CPU = torch.device("cpu")
I32 = torch.int32


def _builder(**kw):
    cfg = small_cfg(8, **kw)
    flow = state_flow(cfg, CPU)  # the copy-commit kind: its pool and its VerifyArgsBuilder
    return cfg, flow.pool, flow.args


def _start(args):
    """Where the copy-commit rule starts each row: (start block or slot, from the committed state)."""
    plan = args.plan()
    return plan.start, plan.from_committed


def _args(cfg, b):
    L, N, D, C, HV = cfg.num_layers, cfg.num_rows, cfg.num_draft_tokens, cfg.conv_channels, cfg.num_v_heads
    return b.build(torch.zeros(L, N, D, C, dtype=torch.bfloat16), torch.zeros(L, N, D, HV, dtype=torch.bfloat16),
                   torch.zeros(L, N, D, HV))


@pytest.mark.parametrize("graph_mode", [True, False], ids=["graph", "eager"])
def test_sglang_arguments(graph_mode):
    """prepare_gdn_inputs (eager) and _replay_metadata + the graph branch of
    fused_recurrent_gated_delta_rule_update build the same values: ones, full lengths,
    arange(B * S) viewed (B, S), the rows' slots (padded rows on slot 0), all int32."""
    cfg, pool, b = _builder(graph_mode=graph_mode)
    a = _args(cfg, b)
    N, D = cfg.num_rows, cfg.num_draft_tokens
    assert a.cache_indices.dtype == a.ssm_state_indices.dtype == a.num_accepted_tokens.dtype == I32
    assert a.actual_seq_lengths.dtype == I32
    assert a.cache_indices.tolist() == pool.row_slots.tolist() and a.cache_indices.tolist()[-1] == 0
    assert torch.equal(a.ssm_state_indices, torch.arange(N * D, dtype=I32).view(N, D))
    assert a.num_accepted_tokens.tolist() == [1] * N and a.actual_seq_lengths.tolist() == [D] * N
    assert a.recurrent_state is pool.temporal and a.intermediate_state is pool.intermediate_ssm
    assert a.scale == cfg.head_k_dim ** -0.5 and (a.nk, a.nv) == (cfg.num_k_heads, cfg.num_v_heads)


def test_sglang_arguments_make_every_verify_start_from_the_committed_state():
    """With SGLang 0.5.23's arguments i = ssm_state_indices[b, 0] = b * S, so i % S == 0 for every
    row: the op reads temporal[cache_indices[b]], whatever happened before."""
    cfg, pool, b = _builder()
    b.accepted(torch.tensor([3, 0, 2, 1, -1]))  # the accepted flow's memory is not used by this flow
    start, from_committed = _start(_args(cfg, b))
    assert from_committed.all() and start.tolist() == [r * cfg.num_draft_tokens for r in range(cfg.num_rows)]


def test_accepted_flow_continues_from_the_previous_steps_scratch():
    """num_accepted_tokens = the previous step's accept_len (1 after prefill and for padded rows):
    a row that accepted n > 1 tokens starts from its scratch block b*S + n - 1."""
    cfg, pool, b = _builder(flow="npu-accepted")
    start, from_committed = _start(_args(cfg, b))
    assert from_committed.all()  # the first step starts from the prefill's committed state
    b.accepted(torch.tensor([3, 0, 2, 1, -1]))  # accept lengths 4, 1, 3, 2; a padded row
    a = _args(cfg, b)
    assert a.num_accepted_tokens.tolist() == [4, 1, 3, 2, 1]
    start, from_committed = _start(a)
    D = cfg.num_draft_tokens
    assert from_committed.tolist() == [False, True, False, False, True]
    assert start.tolist() == [0 * D + 3, 1 * D, 2 * D + 2, 3 * D + 1, 4 * D]


def _scribble_on(which: str):
    """An update that commits correctly, then overwrites one kind of state of every active row with
    garbage (finite): what the next verify reads shows in the run."""
    from drift.flows.registry import UPDATES

    def update(self, last, track_idx, track_steps):
        UPDATES["sglang-0.5.23"].fn(self, last, track_idx, track_steps)
        pool = self._drift_pool
        if which == "scratch":
            pool.scratch[:, : pool.cfg.num_requests] = 7.0
        else:
            pool.states[:, pool.active_slots] = 7.0
    return update


def _outputs(cfg, update):
    outs = []
    run_sim(cfg, update, on_step=lambda sim, view: outs.append(view.out.clone()))
    return torch.stack(outs)


@pytest.mark.parametrize("flow, reads", [("sglang", {"committed"}), ("npu-accepted", {"scratch"})])
def test_what_each_flow_reads(flow, reads):
    """The verify's outputs show what it read. In SGLang's flow it reads only committed states
    (scribbling on the scratch after the commit changes no output); with real accepted counts and
    every row accepting D tokens it reads only the previous step's scratch after the first step."""
    cfg = small_cfg(24, flow=flow, pattern="all-D")
    base = _outputs(cfg, "sglang-0.5.23")
    for which in ("committed", "scratch"):
        got = _outputs(cfg, _scribble_on(which))
        changed = not torch.equal(as_bits(got), as_bits(base))
        assert changed == (which in reads), (flow, which)


def test_checkpoint_keeps_the_accepted_flow_memory():
    """A resumed accepted-flow run must know the accept lengths of the step before the checkpoint."""
    cfg, pool, b = _builder(flow="npu-accepted")
    b.accepted(torch.tensor([3, 0, 2, 1, -1]))
    state = b.state_dict()
    _, _, fresh = _builder(flow="npu-accepted")
    assert fresh.prev_accept.tolist() == [1] * cfg.num_rows
    fresh.load_state_dict(state)
    assert fresh.prev_accept.tolist() == [4, 1, 3, 2, 1]
