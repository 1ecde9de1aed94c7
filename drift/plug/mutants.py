"""Catalogue of known regressions: each a plug-in the checks must catch.

A mutant is an update under test (the ``update_mamba_state_after_mtp_verify`` plug point) or a
verify-kernel variant (the verify-kernel plug point), with a one-line description and the
thread it is modelled on. An update mutant is a flow's released update (``sglang-0.5.23``'s
recipe, ``vllm-0.33.0``'s bookkeeping, ``sglang-0.5.23-replayssm``'s commit) with exactly one part
replaced: the replacement is the bug; its entry names the flow it runs in. Load one as
``mutant:<name>`` wherever an update or kernel spec is accepted; :data:`MUTANTS` is a registry, so an
extension adds its own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import Callable, Optional

import torch

from ..config import PRESETS, find_profile, flow_options
from ..dtypes import round_mantissa
from ..flows.copy_commit.updates import SGLANG_0523, Batch, commit_all, commit_unless_all_step0, rollback_rows
from ..flows.in_place.updates import ServingParts, align_copy, bookkeeping, kept_tokens
from ..flows.kernel_commit import design
from ..flows.kernel_commit import updates as replay_parts
from ..flows.kernel_commit.pool import ReplaySlots
from ..flows.slots import Held, MambaSlots
from ..registry import Registry
from ..sim import kernels
from ..sim.kernels import VerifyArgs
from ..sim.pool import raw_state

BF16 = torch.bfloat16


@dataclass(frozen=True)
class Mutant:
    """One known regression: ``direction`` what it costs ("sync", "semantics" or "precision");
    ``target`` the plug point it replaces ("update" or "kernel"); ``thread`` the public thread it is
    modelled on ('' when none); ``config`` overrides under which the bug shows (a profile, a
    lifecycle); ``flow`` the flow it runs in (an update mutant is written for its flow's kind; '' for the
    run's flow); ``serving``: a serving mutant's bookkeeping (the engine's request and slot bookkeeping of a
    churning lifecycle with one line changed; its update is the flow's released one)."""

    name: str
    direction: str
    target: str
    description: str
    thread: str
    fn: Callable
    config: Optional[dict] = None
    flow: str = ""
    serving: Optional[type] = None  # the engine's serving bookkeeping with the bug (the update itself is released)


# ------------------------------------------------------------ commit parts: syncs
def commit_if_any(b: Batch) -> None:
    if bool((b.last >= 0).any()):  # bool(t): a sync
        commit_all(b)


def commit_masked_rows(b: Batch) -> None:
    valid = b.last >= 0
    b.k.move_intermediate_cache(b.ssm, b.inter, b.dst[valid], b.src[valid], b.last[valid])  # mask: a sync


def commit_python_loop(b: Batch) -> None:
    for i, step in enumerate(b.last.tolist()):  # .tolist(): a sync
        if step >= 0:
            b.ssm[:, b.dst[i]] = b.inter[:, i, step]


def commit_nonzero_rows(b: Batch) -> None:
    rows = torch.nonzero(b.last >= 0).squeeze(1)  # nonzero: a sync
    b.k.move_intermediate_cache(b.ssm, b.inter, b.dst[rows], b.src[rows], b.last[rows])


_LOG = logging.getLogger("drift.mutants")


def commit_logging_steps(b: Batch) -> None:
    # debug logging off or on, the f-string formats the device tensor first: its values reach the host
    _LOG.debug(f"committing draft steps {b.last}")
    commit_all(b)


# -------------------------------------------------------- commit parts: semantics
def one_step_late(steps: torch.Tensor, D: int) -> torch.Tensor:
    """Each draft step ``>= 0`` one later (at most the last, ``D - 1``); -1 (nothing) stays."""
    return torch.where(steps >= 0, (steps + 1).clamp(max=D - 1), steps)


def commit_next_step(b: Batch) -> None:
    b.k.move_intermediate_cache(b.ssm, b.inter, b.dst, b.src, one_step_late(b.last, b.D))


def commit_previous_step(b: Batch) -> None:
    b.k.move_intermediate_cache(b.ssm, b.inter, b.dst, b.src, torch.where(b.last > 0, b.last - 1, b.last))


def commit_skipping_step0(b: Batch) -> None:
    step = torch.where(b.last == 0, torch.full_like(b.last, -1), b.last)
    b.k.move_intermediate_cache(b.ssm, b.inter, b.dst, b.src, step)


def commit_through_reshape(b: Batch) -> None:
    # reshape of a transposed [HV, V, K] view cannot be a view: it copies, and the copy is written.
    flat = b.ssm.reshape(b.ssm.shape[0], b.ssm.shape[1], -1)
    vals = b.inter[:, b.src, b.last.clamp(min=0)].reshape(b.ssm.shape[0], len(b.src), -1)
    flat[:, b.dst] = torch.where((b.last >= 0)[None, :, None], vals, flat[:, b.dst])


# ------------------------------------------------------------- rollback parts
def rollback_shifted(b: Batch) -> None:
    rollback_rows(Batch(**{**vars(b), "last": one_step_late(b.last, b.D)}))


def rollback_on_contiguous_copy(b: Batch) -> None:
    rollback_rows(Batch(**{**vars(b), "conv": b.conv.contiguous()}))  # a copy when conv is strided


def _update(name: str, doc: str, **part) -> Callable:
    return SGLANG_0523.but(**part).build(f"mutant:{name}", doc)


def commit_logically(b: Batch) -> None:
    # A mover that honours the destination's logical strides (the regression sgl-kernel-npu #748
    # reverted): a second physical transpose wherever committed state and scratch differ in layout.
    vals = b.inter[:, b.src, b.last.clamp(min=0)]
    b.ssm[:, b.dst] = torch.where((b.last >= 0)[None, :, None, None, None], vals, b.ssm[:, b.dst])


# ------------------------------------------------------------------ precision
def _kernel_truncate(args: VerifyArgs) -> torch.Tensor:
    return kernels.recurrent_gated_delta_rule(replace(args, rounding="truncate"))


@dataclass
class _GivenInputs(VerifyArgs):
    """Verify arguments whose op inputs (q, k, v, decay, beta: :meth:`VerifyArgs.inputs`) are
    given rather than derived: how a kernel mutant changes what the unchanged op computes on."""

    given: tuple = ()

    def inputs(self, dtype: torch.dtype = kernels.F32):
        return tuple(x.to(dtype) for x in self.given)


def _given(args: VerifyArgs, given: tuple, **changes) -> _GivenInputs:
    return _GivenInputs(**{**{f.name: getattr(args, f.name) for f in fields(VerifyArgs)}, **changes}, given=given)


def _kernel_beta_bf16(args: VerifyArgs) -> torch.Tensor:
    """The op (its torch-op path) with beta rounded to bf16 after the sigmoid."""
    q, k, v, decay, beta = args.inputs()
    return kernels.recurrent_gated_delta_rule_torch(_given(args, (q, k, v, decay, beta.to(BF16).to(beta.dtype))))


def tile_key_heads(x: torch.Tensor, num_k_heads: int) -> torch.Tensor:
    """q or k ``[..., HV, K]`` as the op derives it (value head h reads key head h // (HV / HK)) remapped
    by tiling: value head h reads key head h % HK. The same tensor when HK is 1 (or HK = HV)."""
    group = x.shape[-2] // num_k_heads
    heads = x[..., ::group, :]  # [..., HK, K]: one row per key head
    return heads.repeat(*([1] * (x.dim() - 2)), group, 1)


def _kernel_heads_tiled(args: VerifyArgs) -> torch.Tensor:
    """The op (its torch-op path) with value heads mapped to key heads by tiling, not repeating."""
    q, k, v, decay, beta = args.inputs()
    return kernels.recurrent_gated_delta_rule_torch(
        _given(args, (tile_key_heads(q, args.nk), tile_key_heads(k, args.nk), v, decay, beta)))


def _kernel_round_every_token(args: VerifyArgs) -> torch.Tensor:
    """The op (its torch-op path) one draft token at a time: each token starts from the state the
    one before it stored (rounded to the scratch dtype), not from the running fp32 state.

    Token t of row b runs as a one-token call whose committed state is row b's running state and
    whose scratch is one private block per row, keyed so its store rounds as token t's does
    (:func:`drift.sim.kernels.token_key`); the stored blocks then go where ``ssm_state_indices[:, t]``
    says, and are the next token's running states.
    """
    L, B, S, HV, V, K = args.dims
    kernels.check_lengths(args)
    inputs = args.inputs()
    blocks = kernels.scratch_blocks(args.intermediate_state)
    rec = raw_state(args.recurrent_state)
    plan = args.plan()
    start, from_rec = plan.start, plan.from_committed
    dev = blocks.device
    running = torch.where(from_rec.to(dev)[None, :, None, None, None],
                          rec.index_select(1, args.cache_indices.to(device=rec.device, dtype=torch.int64)).to(dev),
                          blocks.index_select(1, start.to(dev)))
    rows = torch.arange(B, dtype=args.cache_indices.dtype, device=args.cache_indices.device)
    one = torch.ones_like(args.num_accepted_tokens)
    dst = args.ssm_state_indices.to(device=dev, dtype=torch.int64)
    outs = []
    for t in range(S):
        stored = torch.empty(L, B, 1, HV, V, K, dtype=blocks.dtype, device=dev)
        token = _given(args, tuple(x[:, :, t:t + 1] for x in inputs), mix_qkv=args.mix_qkv[:, :, t:t + 1],
                       beta=args.beta[:, :, t:t + 1], g=args.g[:, :, t:t + 1], recurrent_state=running,
                       intermediate_state=stored, cache_indices=rows, ssm_state_indices=rows[:, None],
                       num_accepted_tokens=one, actual_seq_lengths=one, key=kernels.token_key(args.key, t))
        outs.append(kernels.recurrent_gated_delta_rule_torch(token))
        running = stored[:, :, 0]
        blocks.index_copy_(1, dst[:, t], running)
    return torch.cat(outs, dim=2)


_kernel_round_every_token.RULES = ("npu",)  # one-token calls over SGLang's scratch rows


def _kernel_padded_alias(args: VerifyArgs) -> torch.Tensor:
    """Padded graph rows write their scratch into request row 0's (after row 0 was written)."""
    out = kernels.recurrent_gated_delta_rule(args)
    blocks = kernels.scratch_blocks(args.intermediate_state)
    slots = args.cache_indices
    rows = torch.arange(slots.shape[0], device=slots.device)
    last_pad = torch.where(slots == 0, rows, torch.full_like(rows, -1)).max()
    D = args.ssm_state_indices.shape[1]
    src = (last_pad.clamp(min=0) * D + torch.arange(D, device=slots.device)).to(torch.int64)
    keep = blocks[:, :D].clone()
    blocks[:, :D] = torch.where(last_pad >= 0, blocks.index_select(1, src), keep)
    return out


_kernel_padded_alias.RULES = ("npu",)  # SGLang's scratch rows: row r's blocks are r * D .. r * D + D - 1


# The bug shows on strided views (of the state, the scratch and the conv windows):
TRANSPOSED = {"profile": find_profile("state, scratch and conv as transposed views", lambda p, lay: (
    lay.state_kv_storage and lay.scratch_kv_storage and lay.conv_channel_major))}
# The bug shows where committed state and scratch differ in layout:
MIXED = {"profile": find_profile("committed state and scratch in different layouts",
                                 lambda p, lay: lay.state_kv_storage != lay.scratch_kv_storage)}
# The bug shows with more than one key head (ci-small's 4 value heads over 2: Qwen3-Next-80B's ratio).
TWO_KEY_HEADS = {"num_k_heads": 2}
# ------------------------------------------------------- the vllm flow's bookkeeping
def accept_one_ahead(self, last) -> None:
    # num_accepted_tokens one too high: the next verify starts from the block after the last accepted one
    R, D = self.num_spec_decodes, self.block_table.shape[1]
    self.num_accepted_tokens[:R].copy_((kept_tokens(last)[:R] + 1).clamp(max=D))
    self.num_accepted_tokens[R:].fill_(1)


def accept_never_refreshed(self, last) -> None:
    # the sampled counts never reach the buffer (the async-scheduling race gpu_model_runner guards against)
    self.num_accepted_tokens.fill_(1)


def accept_on_host(self, last) -> None:
    R = self.num_spec_decodes
    counts = [max(int(x) + 1, 0) for x in last[:R].tolist()]  # .tolist(): a sync
    self.num_accepted_tokens[:R].copy_(torch.tensor(counts, dtype=self.num_accepted_tokens.dtype))
    self.num_accepted_tokens[R:].fill_(1)


def padded_rows_read_row0(self) -> None:
    # padded rows keep request 0's blocks instead of NULL_BLOCK_ID: the kernel reads and writes them
    R = self.num_spec_decodes
    self.spec_state_indices_tensor[:R].copy_(self.block_table[:R])
    self.spec_state_indices_tensor[R:].copy_(self.block_table[:1].expand_as(self.spec_state_indices_tensor[R:]))


def last_accepted_blocks(self, bias) -> torch.Tensor:
    # the block the next step starts from, idx[b, n - 1] (preprocess_mamba's bias, num_accepted - 1),
    # instead of the boundary token's, idx[b, bias]: the snapshot holds the state after every accepted token
    R = self.num_spec_decodes
    idx = self.spec_state_indices_tensor[:R].to(torch.int64)
    return idx.gather(1, (self.num_accepted_tokens[:R].to(torch.int64) - 1).clamp(min=0)[:, None]).squeeze(1)


def align_from_last_accepted(self, mamba_track_indices, mamba_steps_to_track) -> None:
    align_copy(self, mamba_track_indices, mamba_steps_to_track, source=last_accepted_blocks)


def builder_counts_rows_on_host(self) -> None:
    # the builder counts its speculative rows from the block table on the device: int() is a sync
    R = int((self.block_table[:, 0] != 0).sum())
    self.spec_state_indices_tensor[:R].copy_(self.block_table[:R])
    self.spec_state_indices_tensor[R:].fill_(0)


VLLM = "vllm"  # the flow whose bookkeeping these mutants break (drift/flows/in_place)


# ------------------------------------------- the vllm flow's serving bookkeeping (MRV1, align mode)
def accept_left_behind(batch, src, dst) -> None:
    pass  # condense moves the row but not num_accepted_tokens_cpu: it keeps the hole's stale count


def accept_inherited(batch, row) -> None:
    pass  # add_request leaves num_accepted_tokens_cpu[row] as the row's previous occupant left it


def accept_kept_after_copy(batch, row) -> None:
    pass  # preprocess_mamba copies the state to column 0 of the new running block but keeps the count


def hit_one_column_early(runner, lane) -> int:
    prev = runner.mamba_state_idx.get(lane)  # a new request restores the snapshot of one block fewer
    return (runner.requests[lane].num_computed_tokens - 1) // runner.block_size - 1 if prev is None else prev


def builder_keeps_padded_tail(self) -> None:
    R = self.num_spec_decodes  # the padded rows' indices not refilled with NULL_BLOCK_ID (gdn_attn.py L623)
    self.spec_state_indices_tensor[:R].copy_(self.block_table[:R])


def _serving(name: str, **part) -> Callable:
    """The vllm flow's released update carrying serving parts with one replaced (``update.serving``)."""
    return bookkeeping(serving=ServingParts(**part), name=f"mutant:{name}")


# ------------------------------------------------------- the sglang-replayssm flow's commit parts
def ring_not_restarted(c) -> None:
    pass  # the finish launch dropped: write_pos keeps the folded records, the next verify folds them again


def advance_without_bonus(c) -> None:
    # accept_lens taken as the accepted draft steps, forgetting the bonus token they include
    replay_parts.advance_cursors(replace(c, accept=torch.clamp(c.accept - 1, min=0)))


def fold_high_parts_only(c) -> None:
    # a memory saving that drops the low-part rings (replayssm_rawv / rawk): records fold at bf16 precision
    def hi_only(old, d, kh, kl, g, length):
        return replay_parts.compensated_fold(old, d.to(BF16).to(torch.float32), kh, torch.zeros_like(kl), g, length)
    replay_parts.fold_checkpoints(c, hi_only)


def fold_if_any_flush(c) -> None:
    if bool((c.h.mamba_pool.replayssm_is_flush != 0).any()):  # skip the launch when nothing folds: a sync
        replay_parts.fold_checkpoints(c)


# ------------------------------------------------------- SGLang's serving bookkeeping (drift/flows/slots.py)
class SlotNotCleared(MambaSlots):
    """``HybridReqToTokenPool.alloc`` sets ``mamba_needs_clear = False``: the prefill's chunked kernel reads
    ``initial_state = ssm_states[cache_indices]`` unconditionally, so the new request starts from what the
    slot's previous holder left (its conv window is not read without a prefix)."""

    def alloc(self, prefix_hit: bool) -> Held:
        held = super().alloc(prefix_hit)
        held.needs_clear = False
        return held


class PrefixParentSnapshot(MambaSlots):
    """``finalize_match_result_in_cache`` takes the slot of the matched node's parent: the snapshot the tree
    kept before the one the prefix matched (another request's, a shorter prefix)."""

    def match(self, cache: dict, source: int) -> int:
        keys = list(cache)
        i = keys.index(source)
        return cache[keys[i - 1]] if i > 0 else cache[keys[-1]]


class IndicesRefreshedOnBucketChange(MambaSlots):
    """``_replay_metadata`` refreshes the captured ``state_indices`` buffer only when the graph bucket changes
    (``if self._last_bs != bs``): after a finish and a new request in the same bucket, or a retraction's
    reorder, row i keeps the slot of the request that held row i before."""

    _last_bs = -1

    def replay_metadata(self, indices: torch.Tensor, slots: list[int], padded: int) -> None:
        if len(slots) != self._last_bs:
            super().replay_metadata(indices, slots, padded)
            self._last_bs = len(slots)


class PaddedTailNotRefreshed(MambaSlots):
    """``_replay_metadata`` copies only the real rows' indices (``[: bs - num_padding]``): a padded row keeps the
    slot of the request that held that row in a fuller batch of the same bucket, and the verify's conv rolls that
    request's window (``causal_conv1d_update`` stores at the row's index)."""

    def replay_metadata(self, indices: torch.Tensor, slots: list[int], padded: int) -> None:
        real = len(slots) - padded
        indices[:real].copy_(torch.tensor(slots[:real], dtype=torch.int64))


class SpecCursorsNotReset(ReplaySlots):
    """``HybridReqToTokenPool.alloc`` without ``spec_write_pos.index_fill_(0, fresh_rows, 0)`` (and the
    ``cache_base`` / ``is_flush`` lines): a reused request row keeps its previous holder's ReplaySSM spec
    cursors, so the new request's verify folds records that are not its own (an fp32 checkpoint keeps records
    in the ring between folds)."""

    def fresh_row(self, row: int) -> None:
        pass


# The bug shows only where requests come and go; the fp32 checkpoint keeps records in the ring between folds.
SERVING = {"lifecycle": "serving"}
FP32 = find_profile("fp32 states", lambda p, lay: p.ssm_dtype == "float32")


def fold_tf32_operands(c) -> None:
    # the fold's contraction on TF32 tensor cores whatever the design declares (Triton's tl.dot default
    # input_precision for fp32 operands; FlashInfer's tcgen05 commit): both operands to an 11-bit mantissa
    tf32 = partial(round_mantissa, bits=11)
    replay_parts.fold_checkpoints(c, lambda old, d, kh, kl, g, n: replay_parts.rounded_fold(tf32, old, d, kh, kl, g, n))


def fold_twice(c) -> None:
    # the fold launched by the cadence check and again by the commit path before the ring restarts:
    # the second reads the checkpoint the first wrote and folds the same records into it again
    replay_parts.fold_checkpoints(c)
    replay_parts.fold_checkpoints(c)


def track_one_record_short(c) -> None:
    # the track slot's fold length one record short (write_pos - n + step, not + 1): the snapshot is the
    # state one token before the boundary it is filed under; its exact reference sees every such row
    replay_parts.fold_checkpoints(replace(c, steps=torch.where(c.steps > 0, c.steps - 1, c.steps)))


def fold_stochastic_store(c) -> None:
    # the fold stores the checkpoint by stochastic rounding while the run declares round to nearest
    replay_parts.fold_checkpoints(c, rounding="stochastic")


REPLAY = "sglang-replayssm"  # the flow whose commit these mutants break (drift/flows/kernel_commit)
SGLANG = "sglang"  # the flow of SGLang's commit-copy update, whose recipe the first mutants break


def _replay(name: str, **part) -> Callable:
    return replay_parts.SGLANG_0523_REPLAYSSM.but(**part).build(f"mutant:{name}")


# The designs the fold mutants run under (drift/flows/kernel_commit/design.py): a kernel that claims an
# fp32 fold of an fp32 checkpoint every commit (FlashInfer's simt commit, records as the verify computed
# them); an fp16 ring at the write scale of the stagnation preset (beta ~ 5e-5: beta_bias -10), where
# its records fall below fp16's normal range (2^-14) -- that range is not in the bound, so the design
# fails its own bound there while SGLang's bf16-split ring, of fp32's range, passes.
_FP32_STATE = find_profile("fp32 states in dense tensors", lambda p, lay: p.ssm_dtype == "float32" and lay.dense)
FP32_FOLD = {"profile": _FP32_STATE, "flow_options": flow_options({
    design.CONTRACTION_OPTION: "fp32", design.RING_RECORDS_OPTION: "fp32", design.CADENCE_OPTION: "every-commit"})}
FP16_RING_TINY_WRITES = {"profile": _FP32_STATE, "beta_bias": PRESETS["stagnation"].beta_bias,
                         "flow_options": flow_options({design.RING_RECORDS_OPTION: "fp16"})}


MUTANTS: Registry[Mutant] = Registry("mutant")
for _m in (
    Mutant("item_guard", "sync", "update", "precision guard (last_steps == 0).all().item() skips the commit",
           "sglang #31659", _update("item_guard", "guard with .item()", commit=commit_unless_all_step0), flow=SGLANG),
    Mutant("any_branch", "sync", "update", "commit only `if bool((last >= 0).any())`", "",
           _update("any_branch", "commit behind bool()", commit=commit_if_any), flow=SGLANG),
    Mutant("mask_slots", "sync", "update", "select committed rows with a boolean mask (dst[last >= 0])",
           "sglang #32130 tracking path", _update("mask_slots", "commit by mask", commit=commit_masked_rows), flow=SGLANG),
    Mutant("tolist_steps", "sync", "update", "loop over last_steps.tolist() in Python", "",
           _update("tolist_steps", "commit in a Python loop", commit=commit_python_loop), flow=SGLANG),
    Mutant("nonzero_rows", "sync", "update", "find valid rows with torch.nonzero", "",
           _update("nonzero_rows", "commit by nonzero", commit=commit_nonzero_rows), flow=SGLANG),
    Mutant("log_fstring", "sync", "update", "logger.debug(f\"... {last_steps}\") in the commit: formatting the "
           "device tensor copies it to the host every step", "",
           _update("log_fstring", "commit behind a formatted tensor", commit=commit_logging_steps), flow=SGLANG),
    Mutant("step_plus1", "semantics", "update", "commit draft step last + 1 (off by one forward)", "",
           _update("step_plus1", "commit one step late", commit=commit_next_step), flow=SGLANG),
    Mutant("step_minus1", "semantics", "update", "commit draft step last - 1 (off by one back)", "",
           _update("step_minus1", "commit one step early", commit=commit_previous_step), flow=SGLANG),
    Mutant("skip_step0", "semantics", "update", "skip the commit for rows at step 0 (device-side guard: "
           "sync free, loses a token's update)", "sglang #31659 intent",
           _update("skip_step0", "device-side guard", commit=commit_skipping_step0), flow=SGLANG),
    Mutant("rollback_shift", "semantics", "update", "conv rollback shifted by one row", "sglang #34794 class",
           _update("rollback_shift", "rollback off by one", rollback=rollback_shifted), flow=SGLANG),
    Mutant("rollback_contiguous", "semantics", "update", "conv rollback on a .contiguous() copy of a strided "
           "tensor: silently a no-op (ascend-transposed layout)", "sgl-kernel-npu #748",
           _update("rollback_contiguous", "rollback on a copy", rollback=rollback_on_contiguous_copy), TRANSPOSED, flow=SGLANG),
    Mutant("reshape_commit", "semantics", "update", "commit through reshape of the transposed state view: "
           "writes a temporary (ascend-transposed layout)", "sgl-kernel-npu #748 class",
           _update("reshape_commit", "commit through reshape", commit=commit_through_reshape), TRANSPOSED, flow=SGLANG),
    Mutant("logical_commit", "semantics", "update", "commit copies by logical index, honouring the destination's "
           "strides: a second transpose (ascend-mixed layout)", "sgl-kernel-npu #748",
           _update("logical_commit", "commit by logical index", commit=commit_logically), MIXED, flow=SGLANG),
    Mutant("truncate_store", "precision", "kernel", "verify kernel stores states by truncation, not "
           "round-to-nearest", "", _kernel_truncate),
    Mutant("beta_bf16", "precision", "kernel", "beta rounded to bf16 after the sigmoid in the verify kernel",
           "vLLM #53877, sglang #38975", _kernel_beta_bf16),
    Mutant("heads_tiled", "semantics", "kernel", "verify kernel maps value head h to key head h % HK (tiling) "
           "instead of h // (HV / HK) (repeat_interleave, fla's i_hv // (HV // H)); identical at one key head",
           "", _kernel_heads_tiled, TWO_KEY_HEADS),
    Mutant("round_every_token", "precision", "kernel", "verify kernel rounds the running state to the "
           "store dtype after every draft token", "sglang #25587, sgl-kernel-npu #651", _kernel_round_every_token),
    Mutant("vllm_start_plus1", "semantics", "update", "vllm flow: num_accepted_tokens one too high, so the next "
           "verify starts from the block after the last accepted one", "vllm gdn_attn.py class",
           bookkeeping(accept=accept_one_ahead, name="mutant:vllm_start_plus1"), flow=VLLM),
    Mutant("vllm_stale_accept", "semantics", "update", "vllm flow: num_accepted_tokens never refreshed from the "
           "sampled tokens (stays 1)", "vllm gpu_model_runner.py async-scheduling race",
           bookkeeping(accept=accept_never_refreshed, name="mutant:vllm_stale_accept"), flow=VLLM),
    Mutant("vllm_null_row_read", "semantics", "update", "vllm flow: padded rows get request 0's blocks instead "
           "of NULL_BLOCK_ID, so the kernel reads and overwrites them", "vllm NULL_BLOCK_ID padding",
           bookkeeping(indices=padded_rows_read_row0, name="mutant:vllm_null_row_read"), flow=VLLM),
    Mutant("vllm_accept_sync", "sync", "update", "vllm flow: accept counts computed on the host with .tolist()",
           "", bookkeeping(accept=accept_on_host, name="mutant:vllm_accept_sync"), flow=VLLM),
    Mutant("vllm_builder_sync", "sync", "update", "vllm flow: the metadata builder counts its speculative rows "
           "with int(tensor.sum()) on the device", "vllm gdn_attn.py builder",
           bookkeeping(indices=builder_counts_rows_on_host, name="mutant:vllm_builder_sync"), flow=VLLM),
    Mutant("vllm_align_wrong_block", "semantics", "update", "vllm flow: the prefix-cache align copy takes the "
           "last accepted token's block (n - 1), not the boundary token's", "vllm mamba_utils.py align-mode class",
           bookkeeping(align=align_from_last_accepted, name="mutant:vllm_align_wrong_block"), flow=VLLM),
    Mutant("vllm_condense_accept", "semantics", "update", "vllm flow, serving: InputBatch.condense moves a row "
           "without its num_accepted_tokens_cpu, so the moved request starts from a finished one's accept count",
           "vllm-ascend #13863 class", _serving("vllm_condense_accept", move_accept=accept_left_behind), SERVING, VLLM),
    Mutant("vllm_add_inherits_accept", "semantics", "update", "vllm flow, serving: add_request does not reset "
           "num_accepted_tokens_cpu, so a new request inherits its row's previous occupant's accept count "
           "(a prefix hit restores from the wrong column)", "vllm #48132 class",
           _serving("vllm_add_inherits_accept", reset_accept=accept_inherited), SERVING, VLLM),
    Mutant("vllm_migrate_keeps_accept", "semantics", "update", "vllm flow, serving: preprocess_mamba migrates the "
           "running state to a new block but keeps the accept count, so the next verify starts from a stale "
           "speculative block", "vllm mamba_utils.py align-mode class",
           _serving("vllm_migrate_keeps_accept", reset_after_copy=accept_kept_after_copy), SERVING, VLLM),
    Mutant("vllm_hit_wrong_column", "semantics", "update", "vllm flow, serving: preprocess_mamba takes a prefix "
           "hit's state one column early (num_computed // block_size - 2), restoring another prefix's snapshot",
           "vllm mamba_utils.py align-mode class",
           _serving("vllm_hit_wrong_column", prev_state_idx=hit_one_column_early), SERVING, VLLM),
    Mutant("vllm_stale_padded_rows", "semantics", "update", "vllm flow, serving: the GDN builder does not refill "
           "the padded rows' state indices with NULL_BLOCK_ID, so after the batch shrinks a padded row writes "
           "the blocks a request held there before", "vllm gdn_attn.py NULL padding",
           bookkeeping(indices=builder_keeps_padded_tail, name="mutant:vllm_stale_padded_rows"), SERVING, VLLM),
    Mutant("replay_no_restart", "semantics", "update", "sglang-replayssm flow: the ring is not restarted after "
           "a fold (the finish launch dropped), so the next verify folds the same records again", "",
           _replay("replay_no_restart", finish=ring_not_restarted), flow=REPLAY),
    Mutant("replay_no_bonus", "semantics", "update", "sglang-replayssm flow: the cursors advance by the accepted "
           "draft steps, forgetting the bonus token accept_lens includes", "sglang spec_utils.py accept_lens",
           _replay("replay_no_bonus", advance=advance_without_bonus), flow=REPLAY),
    Mutant("replay_high_only", "precision", "update", "sglang-replayssm flow: the fold drops the low-part "
           "records (replayssm_rawv / rawk), folding deltas and keys at bf16 precision", "",
           _replay("replay_high_only", fold=fold_high_parts_only), flow=REPLAY),
    Mutant("replay_fold_sync", "sync", "update", "sglang-replayssm flow: the fold launched only "
           "`if bool(is_flush.any())`", "", _replay("replay_fold_sync", fold=fold_if_any_flush), flow=REPLAY),
    Mutant("slot_not_cleared", "semantics", "update", "serving: a new request's mamba slot is not cleared before "
           "its prefill (mamba_needs_clear = False), so it starts from the slot's previous holder's state",
           "sglang HybridReqToTokenPool.alloc / clear_slots", _update("slot_not_cleared", "released; slot not cleared"),
           SERVING, flow=SGLANG, serving=SlotNotCleared),
    Mutant("prefix_wrong_snapshot", "semantics", "update", "serving: a prefix-cache hit restores the snapshot of "
           "the matched node's parent (an older cached snapshot, another prefix)", "sglang "
           "MambaComponent.finalize_match_result_in_cache", _update("prefix_wrong_snapshot", "released; wrong snapshot"),
           SERVING, flow=SGLANG, serving=PrefixParentSnapshot),
    Mutant("stale_rows_after_reorder", "semantics", "update", "serving: the step's mamba indices refreshed only "
           "when the graph bucket changes, so after requests leave and join (or a retraction reorders) a row "
           "commits into the slot of the request that held it before", "sglang _replay_metadata",
           _update("stale_rows_after_reorder", "released; stale indices"), SERVING, flow=SGLANG,
           serving=IndicesRefreshedOnBucketChange),
    Mutant("stale_padded_rows", "semantics", "update", "serving: the padded tail of the step's mamba indices not "
           "refreshed, so a padded row keeps a live request's slot and the verify's conv rolls its window",
           "sglang _replay_metadata; #26906 / #27202 class", _update("stale_padded_rows", "released; stale padding"),
           SERVING, flow=SGLANG, serving=PaddedTailNotRefreshed),
    Mutant("replay_cursor_not_reset", "semantics", "update", "serving, sglang-replayssm flow: a reused request "
           "row keeps its previous holder's spec ring cursors (fp32 checkpoint: records wait in the ring)",
           "sglang #28451 class (HybridReqToTokenPool.alloc)", _replay("replay_cursor_not_reset"),
           {**SERVING, "profile": FP32}, flow=REPLAY, serving=SpecCursorsNotReset),

    Mutant("replay_track_one_short", "semantics", "update", "sglang-replayssm flow, fp32 checkpoint: a tracked "
           "row's track slot folds one record fewer than its boundary token (a snapshot taken mid-window, one "
           "token early)", "gdn_replayssm_compact_commit_kernel track length class",
           _replay("replay_track_one_short", fold=track_one_record_short), {"profile": FP32}, flow=REPLAY),
    Mutant("replay_tf32_fold", "precision", "update", "sglang-replayssm flow: a fold that contracts on TF32 "
           "operands (11-bit mantissas) in a design that declares an fp32 fold of an fp32 checkpoint",
           "flashinfer #5314 (TF32 checkpoints not bitwise FP32)", _replay("replay_tf32_fold", fold=fold_tf32_operands),
           FP32_FOLD, flow=REPLAY),
    Mutant("replay_fp16_ring_tiny", "precision", "update", "sglang-replayssm flow: an fp16 ring at the stagnation "
           "preset's write scale (beta ~ 5e-5): its records fall below fp16's normal range (subnormal, or zero) "
           "and lose the precision its bound assumes", "flashinfer #4974 (fp16 rings)",
           _replay("replay_fp16_ring_tiny"), FP16_RING_TINY_WRITES, flow=REPLAY),
    Mutant("replay_fold_twice", "semantics", "update", "sglang-replayssm flow: a cadence bug launches the fold "
           "twice in one commit before the ring restarts, so the accepted records are folded into the "
           "checkpoint twice", "", _replay("replay_fold_twice", fold=fold_twice), flow=REPLAY),
    Mutant("replay_stochastic_fold", "precision", "update", "sglang-replayssm flow: the fold stores the checkpoint "
           "by stochastic rounding while the run declares round to nearest (--rounding rne)", "",
           _replay("replay_stochastic_fold", fold=fold_stochastic_store), flow=REPLAY),
    Mutant("padded_alias_row0", "semantics", "kernel", "padded graph rows alias request 0's scratch slot",
           "sglang #26906 / #27202", _kernel_padded_alias),
):
    MUTANTS.register(_m.name, _m)
