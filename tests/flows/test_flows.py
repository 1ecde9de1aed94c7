"""The state flows (drift/flows), and vLLM's in-place block flow in particular (docs/semantics.md §6).

The vllm flow keeps no commit copy, yet its numerics are the copy-commit flow's: each step starts
from the stored (rounded once) state after the last accepted token, whichever buffer holds it. So
a run through it must reproduce the sglang flow's figures bit for bit -- a strong test of the
bookkeeping (a wrong start block, a NULL row read, a stale conv offset all move them). Its
prefix-cache align copy snapshots the same stored states at the same boundaries as SGLang's
tracking copy, so the tracked snapshots must match too."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers import blocks_case, same_bits
from drift.check.registry import find_result
from drift.config import preset
from drift.flows.registry import FLOWS
from drift.errors import HarnessLacks
from drift.runner import run_checked
from drift.sim import kernels
from drift.flows.in_place.flow import NULL_BLOCK_ID, InPlaceBlockFlow
from drift.flows.copy_commit.rule import NpuRule
from drift.flows.registry import FLOW_KINDS, check, state_flow
from drift.runspec import resolve

IN_PLACE = [f for f in FLOWS if FLOWS[f].kind == "in-place"]
COPY_COMMIT = [f for f in FLOWS if FLOWS[f].kind == "copy-commit"]
CPU = torch.device("cpu")


def test_every_flow_names_its_engine_files_and_kind():
    for name in FLOWS:
        f = FLOWS[name]
        assert f.engine and f.files and f.kind in FLOW_KINDS, name
        assert type(state_flow(preset("ci-small", flow=name), CPU)).name == f.kind


@pytest.mark.parametrize("flow", IN_PLACE)
def test_the_block_flow_reproduces_the_copy_commit_figures_bit_for_bit(flow):
    cfg = preset("ci-small", steps=96)
    ours = {c.key: c for c in run_checked(resolve(cfg.replace(flow=flow)), sync_scan=False).checks}
    theirs = {c.key: c for c in run_checked(resolve(cfg), sync_scan=False).checks}
    shared = list(theirs)
    assert len(shared) >= 9 and theirs["tracked_snapshots"].verdict == "PASS"  # compared, not n/a
    for key in shared:
        a, b = ours[key], theirs[key]
        assert (a.passed, a.worst, a.where) == (b.passed, b.worst, b.where), key
    assert all(ours[k].passed for k in shared), {k: ours[k].detail for k in shared if ours[k].failed}


@pytest.mark.parametrize("flow", IN_PLACE)
def test_the_block_flow_passes_ci_small_with_its_own_update_and_checks_its_align_snapshots(flow):
    rep = run_checked(resolve(preset("ci-small", steps=64, flow=flow)))
    assert rep.passed, [c.to_dict() for c in rep.checks if c.failed]
    assert rep.info.update == "vllm-0.33.0"
    tracked = find_result(rep.checks, "tracked_snapshots")
    assert tracked.verdict == "PASS" and "snapshots compared" in tracked.detail, tracked.to_dict()


@pytest.mark.parametrize("flow", IN_PLACE)
def test_an_align_copy_from_the_wrong_block_fails_the_tracked_snapshots_and_nothing_else(flow):
    rep = run_checked(resolve(preset("ci-small", steps=64, flow=flow), "mutant:vllm_align_wrong_block"), sync_scan=False)
    failed = {c.key for c in rep.checks if c.failed}
    assert failed == {"tracked_snapshots"}, failed  # the committed flow is untouched by the align copy
    assert "differs from the state held at the boundary" in find_result(rep.checks, "tracked_snapshots").detail


@pytest.mark.parametrize("flow", IN_PLACE)
def test_an_update_written_for_another_flow_is_refused_with_what_the_harness_has(flow):
    from drift.errors import LoadError
    from helpers import bad_spec
    # a built-in of the other kind: refused before anything runs, naming the flow to pass
    with pytest.raises(LoadError, match=f"sglang-0.5.23 is written for the copy-commit flow kind.*not for --flow {flow}.*"
                                        "pass --flow sglang"):
        run_checked(resolve(preset("ci-small", steps=4, flow=flow), "sglang-0.5.23"))
    with pytest.raises(LoadError, match="vllm-0.33.0 is written for the in-place flow kind"):  # and the other way round
        run_checked(resolve(preset("ci-small", steps=4, flow=COPY_COMMIT[0]), "vllm-0.33.0"))
    # a plug-in written for SGLang's backend: the block flow's harness says what it has
    with pytest.raises(HarnessLacks, match="num_accepted_tokens.*--flow sglang or npu-accepted provides "
                                           "self.linear_attn_backend"):
        run_checked(resolve(preset("ci-small", steps=4, flow=flow), bad_spec("correct")), sync_scan=False)


def test_the_block_pool_gives_each_request_its_own_blocks_and_padded_rows_the_null_block():
    cfg = preset("ci-small")
    pool = InPlaceBlockFlow(cfg, CPU).pool
    R, D = cfg.num_requests, cfg.num_draft_tokens
    owned = pool.block_table_host[:R].reshape(-1)
    assert len(set(owned.tolist())) == R * D and NULL_BLOCK_ID not in owned
    assert (pool.block_table_host[R:] == NULL_BLOCK_ID).all()
    assert torch.isnan(pool.states[:, NULL_BLOCK_ID].float()).all()  # a read of the NULL block shows


def _clone(args):
    cache = args.recurrent_state.clone()
    return replace(args, recurrent_state=cache, intermediate_state=cache.unsqueeze(2))


def _blocks_reference(args):  # noqa: C901
    """vLLM's fused_recurrent_gated_delta_rule by hand, row by row: a live row starts from block
    ``idx[b, n - 1]`` of the cache and stores the state after token t (round to nearest) in place into
    block ``idx[b, t]``; a row whose start index is <= 0 is skipped. Returns (cache, outputs fp32)."""
    cache = args.recurrent_state.clone()
    L, B, S, HV, V, K = args.dims
    q, k, v, decay, beta = args.inputs()
    out = torch.zeros(L, B, S, HV, V)
    for b in range(B):
        start = int(args.ssm_state_indices[b, int(args.num_accepted_tokens[b]) - 1])
        if start <= 0:
            continue
        h = cache[:, start].float().reshape(L * HV, V, K)
        for t in range(int(args.actual_seq_lengths[b])):  # a short row (ragged drafts) runs its own tokens
            o = torch.empty(L * HV, V)
            kernels._gdn_token(h, q[:, b, t].reshape(-1, K), k[:, b, t].reshape(-1, K), v[:, b, t].reshape(-1, V),
                               decay[:, b, t].reshape(-1), beta[:, b, t].reshape(-1), o)
            out[:, b, t] = o.view(L, HV, V)
            dst = int(args.ssm_state_indices[b, t])
            if dst > 0:
                cache[:, dst] = h.view(L, HV, V, K).to(cache.dtype)
    return cache, out


def _against_reference(monkeypatch, path: str, args):
    """Run ``args`` by ``path`` (the C kernel, the torch ops on the host, or the device path) and
    compare with :func:`_blocks_reference`; returns (the written args, the outputs)."""
    if path == "device":  # the gather/scatter path an accelerator takes
        monkeypatch.setattr(kernels, "HOST_INDEX_PATHS", False)
    run = kernels.recurrent_gated_delta_rule if path == "native" else kernels.recurrent_gated_delta_rule_torch
    got = _clone(args)
    out = run(got)
    ref, ref_out = _blocks_reference(args)
    if path == "native":
        # The C kernel sums in another order: its fp32 states differ by float32 noise (~2^-24 of the
        # terms), which moves a bf16 store by at most one bf16 ulp, 2^-7 relative. Outputs are bf16 of
        # fp32 values (half an ulp, 2^-8 relative, plus that noise); atol 1e-6 covers outputs that
        # cancel to near zero, where the noise of terms of order one (~1e-7) dominates: 10x margin.
        torch.testing.assert_close(got.recurrent_state.float(), ref.float(), rtol=2 ** -7, atol=0)
        torch.testing.assert_close(out.float(), ref_out, rtol=2 ** -7, atol=1e-6)
    else:  # the same torch ops in the same order: bit for bit
        assert same_bits(got.recurrent_state, ref) and torch.equal(out, ref_out.to(torch.bfloat16))
    return got, out


@pytest.mark.parametrize("path", ["native", "torch", "device"])
def test_the_block_rule_starts_at_the_accepted_block_skips_null_rows_and_writes_in_place(monkeypatch, path):
    args = blocks_case()
    got, out = _against_reference(monkeypatch, path, args)
    assert same_bits(got.recurrent_state[:, NULL_BLOCK_ID], args.recurrent_state[:, NULL_BLOCK_ID])  # never written
    assert (out[:, 2] == 0).all()  # the NULL row: skipped
    # Negative control: the npu rule on the same arguments starts row 0 elsewhere and writes the NULL block.
    npu = _clone(args)
    kernels.recurrent_gated_delta_rule_torch(replace(npu, rule=NpuRule()))
    assert not same_bits(npu.recurrent_state, _blocks_reference(args)[0])


def test_the_op_needs_the_flow_kinds_rule():
    with pytest.raises(ValueError, match="VerifyArgs.rule is None: the flow kind's verify rule says where"):
        kernels.recurrent_gated_delta_rule(replace(blocks_case(), rule=None))


@pytest.mark.parametrize("path", ["native", "torch", "device"])
def test_a_short_row_runs_and_stores_only_its_own_tokens(monkeypatch, path):
    args = replace(blocks_case(), actual_seq_lengths=torch.tensor([2, 4, 4], dtype=torch.int32))
    got, out = _against_reference(monkeypatch, path, args)
    assert (out[:, 0, 2:] == 0).all()  # row 0's tokens past its length: no output
    assert same_bits(got.recurrent_state[:, [1, 9]], args.recurrent_state[:, [1, 9]])  # row 0's tokens 2, 3: untouched
    # Negative control: the full-length call writes those blocks.
    full = _clone(args)
    kernels.recurrent_gated_delta_rule_torch(replace(full, actual_seq_lengths=torch.full((3,), 4, dtype=torch.int32)))
    assert not same_bits(full.recurrent_state[:, [1, 9]], args.recurrent_state[:, [1, 9]])


def test_the_conv_of_a_short_row_writes_only_its_own_columns():
    g = torch.Generator().manual_seed(2)
    L, N, D, C, Kc = 1, 2, 4, 6, 4
    W = Kc - 1 + D - 1
    conv = torch.randn(L, 3, W, C, generator=g).to(torch.bfloat16)
    x = torch.randn(L, N, D, C, generator=g).to(torch.bfloat16)
    w = torch.randn(L, C, Kc, generator=g)
    slots, offset, rows = torch.tensor([1, 2]), torch.tensor([1, 0]), torch.tensor([0, 1])
    got = conv.clone()
    kernels.conv_verify_at(got, slots, offset, x, w, rows, torch.tensor([1, 4]))
    full = conv.clone()
    kernels.conv_verify_at(full, slots, offset, x, w, rows)
    # row 0 verified 1 token: state_len shrinks to Kc-2+1 columns; the rest keep their old values
    assert same_bits(got[:, 1, :Kc - 1], full[:, 1, :Kc - 1]) and same_bits(got[:, 1, Kc - 1:], conv[:, 1, Kc - 1:])
    assert same_bits(got[:, 2], full[:, 2])  # row 1 verified all D
    assert not same_bits(full[:, 1, Kc - 1:], conv[:, 1, Kc - 1:])  # control: the full write moves them


@pytest.mark.parametrize("flow", [f for f in FLOWS if FLOWS[f].ragged])
def test_a_ragged_draft_stream_passes_and_a_kernel_that_runs_too_few_tokens_fails(flow):
    from drift.sim.stream import accept_lengths, draft_counts
    cfg = preset("ci-small", steps=96, flow=flow, drafts="ragged")
    d, acc = draft_counts(cfg, 0, 96), accept_lengths(cfg, 0, 96)
    assert (acc <= d).all() and (d < cfg.num_draft_tokens).mean() > 0.5 and (d == cfg.num_draft_tokens).any()
    rep = run_checked(resolve(cfg))
    assert rep.passed, [c.to_dict() for c in rep.checks if c.failed]

    def first_token_only(args):  # ignores the rows' lengths the other way: runs one token per row
        return kernels.recurrent_gated_delta_rule(replace(args, actual_seq_lengths=torch.ones_like(args.actual_seq_lengths)))

    bad = run_checked(resolve(cfg, kernel=first_token_only), sync_scan=False)
    assert find_result(bad.checks, "committed_state").failed


def test_ragged_drafts_are_refused_where_the_engine_verifies_all_d():
    from drift.errors import ConfigError
    for flow in [f for f in FLOWS if not FLOWS[f].ragged]:
        allowed = ", ".join(f for f in FLOWS if FLOWS[f].ragged)
        with pytest.raises(ConfigError) as err:
            check(preset("ci-small", flow=flow, drafts="ragged"))
        # one sentence whatever the flow's engine text says (npu-accepted's is "none: ..."): the flow, then
        # what it does, then the engine it is modelled on, then the choices
        assert str(err.value).startswith(f"drafts='ragged' under flow={flow!r}: that flow verifies every row's D "
                                         f"draft tokens (modelled on: {FLOWS[flow].engine}); allowed with ragged "
                                         f"drafts: {allowed}"), err.value


@pytest.mark.parametrize("flow", IN_PLACE)
def test_the_align_snapshot_is_sglangs_tracked_snapshot_and_a_cache_hit_resumes_from_it(flow):
    from drift.runner import capture_snapshots
    cfg = preset("ci-small")
    ours, point, env2 = capture_snapshots(resolve(cfg.replace(flow=flow)), after_step=48, steps=96)
    _, theirs, _ = capture_snapshots(resolve(cfg, "sglang-0.5.23"), after_step=48, steps=96)
    assert ours.passed and (point.positions == theirs.positions).all()
    assert same_bits(point.state, theirs.state) and torch.equal(point.window, theirs.window)
    resumed = run_checked(resolve(cfg.replace(flow=flow)), steps=48, start=point, env2_start=env2, sync_scan=False)
    assert resumed.passed, [c.to_dict() for c in resumed.checks if c.failed]
