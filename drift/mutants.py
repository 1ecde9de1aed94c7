"""Catalogue of known regressions: each a plug-in the checks must catch.

A mutant is an update under test (the ``update_mamba_state_after_mtp_verify`` plug point)
or a verify-kernel variant (the ``verify_kernel`` plug point), with a one-line
description and the thread it is modelled on. Update mutants are written like the
built-ins (SGLang method bodies using the sgl_kernel_npu kernels); each differs from
``device_select`` in one realistic way. Load one as ``mutant:<name>`` wherever an update
spec is accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import kernels
from .loader import sgl_kernels
from .updates import guarded

BF16 = torch.bfloat16


@dataclass(frozen=True)
class Mutant:
    name: str
    direction: str  # "sync", "semantics" or "precision"
    kind: str  # "update" or "kernel"
    description: str
    thread: str  # the public thread it is modelled on ('' when none)
    fn: Callable
    config: Optional[dict] = None  # config overrides the mutant needs to show (e.g. tracking on)


def _parts(self, last):
    N = last.shape[0]
    dst = self.linear_attn_backend.forward_metadata.mamba_cache_indices[:N].to(torch.int64)
    c = self.linear_attn_backend.req_to_token_pool.get_speculative_mamba2_params_all_layers()
    src = torch.arange(N, device=dst.device, dtype=torch.int64)
    return dst, src, last.to(torch.int64), c.conv[0], c.temporal, c.intermediate_ssm


def _track(k, conv, ssm, inter, dst, src, track, steps):
    """device_select's tracking path (sync free)."""
    if track is None:
        return
    track, steps = track.to(torch.int64), steps.to(torch.int64)
    k.move_intermediate_cache(ssm, inter, track, src, steps)
    conv[:, track] = conv[:, torch.where(steps >= 0, dst, track)]


def _rollback(k, conv, dst, last, D, track, steps):
    k.conv_state_rollback(conv, dst, last, D)
    if track is not None:
        k.conv_state_rollback(conv, track.to(torch.int64), steps.to(torch.int64), D)


def _update(commit: Callable, rollback: Callable = _rollback) -> Callable:
    """An update that tracks and rolls back like device_select but commits with ``commit``."""
    def update(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track, model=None):
        k = sgl_kernels()
        dst, src, last, conv, ssm, inter = _parts(self, last_correct_step_indices)
        commit(k, ssm, inter, dst, src, last)
        _track(k, conv, ssm, inter, dst, src, mamba_track_indices, mamba_steps_to_track)
        rollback(k, conv, dst, last, inter.shape[2], mamba_track_indices, mamba_steps_to_track)
    return update


# ------------------------------------------------------------------------ syncs
def _commit_any_branch(k, ssm, inter, dst, src, last):
    if bool((last >= 0).any()):  # bool(t): a sync
        k.move_intermediate_cache(ssm, inter, dst, src, last)


def _commit_mask_slots(k, ssm, inter, dst, src, last):
    valid = last >= 0
    k.move_intermediate_cache(ssm, inter, dst[valid], src[valid], last[valid])  # boolean-mask indexing


def _commit_tolist(k, ssm, inter, dst, src, last):
    for i, step in enumerate(last.tolist()):  # .tolist(): a sync
        if step >= 0:
            ssm[:, dst[i]] = inter[:, i, step]


def _commit_nonzero(k, ssm, inter, dst, src, last):
    rows = torch.nonzero(last >= 0).squeeze(1)  # nonzero: a sync
    k.move_intermediate_cache(ssm, inter, dst[rows], src[rows], last[rows])


# -------------------------------------------------------------------- semantics
def _commit_plus1(k, ssm, inter, dst, src, last):
    D = inter.shape[2]
    k.move_intermediate_cache(ssm, inter, dst, src, torch.where(last >= 0, (last + 1).clamp(max=D - 1), last))


def _commit_minus1(k, ssm, inter, dst, src, last):
    k.move_intermediate_cache(ssm, inter, dst, src, torch.where(last > 0, last - 1, last))


def _commit_skip_step0(k, ssm, inter, dst, src, last):
    k.move_intermediate_cache(ssm, inter, dst, src, torch.where(last == 0, torch.full_like(last, -1), last))


def _commit_reshape(k, ssm, inter, dst, src, last):
    # reshape of the transposed [HV, V, K] view cannot be a view: it copies, and the copy is written.
    flat = ssm.reshape(ssm.shape[0], ssm.shape[1], -1)
    vals = inter[:, src, last.clamp(min=0)].reshape(ssm.shape[0], len(src), -1)
    flat[:, dst] = torch.where((last >= 0)[None, :, None], vals, flat[:, dst])


def _rollback_off_by_one(k, conv, dst, last, D, track, steps):
    _rollback(k, conv, dst, torch.where(last >= 0, (last + 1).clamp(max=D - 1), last), D, track, steps)


def _rollback_contiguous(k, conv, dst, last, D, track, steps):
    _rollback(k, conv.contiguous(), dst, last, D, track, steps)  # a copy when conv is strided


def _commit_ok(k, ssm, inter, dst, src, last):
    k.move_intermediate_cache(ssm, inter, dst, src, last)


# ------------------------------------------------------------------- precision
def _kernel_truncate(state_kv, slots, q, k, v, g, beta, inter_kv, rounding="rne", key=0, **kw):
    return kernels.gdn_verify(state_kv, slots, q, k, v, g, beta, inter_kv, "truncate", key, **kw)


def _kernel_beta_bf16(state_kv, slots, q, k, v, g, beta, inter_kv, rounding="rne", key=0, **kw):
    return kernels.gdn_verify(state_kv, slots, q, k, v, g, beta.to(BF16).to(beta.dtype), inter_kv,
                              rounding, key, **kw)


def _kernel_round_every_token(state_kv, slots, q, k, v, g, beta, inter_kv, rounding="rne", key=0, **kw):
    """Keeps the running state in the storage dtype between the draft tokens."""
    D = q.shape[2]
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    st = state_kv
    cur = slots
    for t in range(D):
        sl = slice(t, t + 1)
        out[:, :, sl] = kernels.gdn_verify(st, cur, q[:, :, sl], k[:, :, sl], v[:, :, sl], g[:, :, sl],
                                           beta[:, :, sl], inter_kv[:, :, sl], rounding, key * 7 + t, **kw)
        st = inter_kv[:, :, t]  # the next token starts from the stored (rounded) state
        cur = torch.arange(q.shape[1], device=q.device)
    return out


def _kernel_padded_alias(state_kv, slots, q, k, v, g, beta, inter_kv, rounding="rne", key=0, **kw):
    """Padded graph rows write their scratch into request row 0's (after row 0 was written)."""
    out = kernels.gdn_verify(state_kv, slots, q, k, v, g, beta, inter_kv, rounding, key, **kw)
    rows = torch.arange(slots.shape[0], device=slots.device)
    last_pad = torch.where(slots == 0, rows, torch.full_like(rows, -1)).max()
    inter_kv[:, 0] = torch.where(last_pad >= 0, inter_kv[:, last_pad.clamp(min=0)], inter_kv[:, 0])
    return out


_TRACK = {"track_interval": 16}
MUTANTS: dict[str, Mutant] = {m.name: m for m in [
    Mutant("item_guard", "sync", "update", "precision guard (last_steps == 0).all().item() skips the commit",
           "sglang #31659", guarded),
    Mutant("any_branch", "sync", "update", "commit only `if bool((last >= 0).any())`", "", _update(_commit_any_branch)),
    Mutant("mask_slots", "sync", "update", "select committed rows with a boolean mask (dst[last >= 0])",
           "sglang #32130 tracking path", _update(_commit_mask_slots)),
    Mutant("tolist_steps", "sync", "update", "loop over last_steps.tolist() in Python", "", _update(_commit_tolist)),
    Mutant("nonzero_rows", "sync", "update", "find valid rows with torch.nonzero", "", _update(_commit_nonzero)),
    Mutant("step_plus1", "semantics", "update", "commit draft step last + 1 (off by one forward)", "",
           _update(_commit_plus1)),
    Mutant("step_minus1", "semantics", "update", "commit draft step last - 1 (off by one back)", "",
           _update(_commit_minus1)),
    Mutant("skip_step0", "semantics", "update", "skip the commit for rows at step 0 (device-side guard: "
           "sync free, loses a token's update)", "sglang #31659 intent", _update(_commit_skip_step0)),
    Mutant("rollback_shift", "semantics", "update", "conv rollback shifted by one row", "sglang #34794 class",
           _update(_commit_ok, _rollback_off_by_one)),
    Mutant("rollback_contiguous", "semantics", "update", "conv rollback on a .contiguous() copy of a strided "
           "tensor: silently a no-op", "sgl-kernel-npu #748", _update(_commit_ok, _rollback_contiguous)),
    Mutant("reshape_commit", "semantics", "update", "commit through reshape of the transposed state view: "
           "writes a temporary", "sgl-kernel-npu #748 class", _update(_commit_reshape)),
    Mutant("truncate_store", "precision", "kernel", "verify kernel stores states by truncation, not "
           "round-to-nearest", "", _kernel_truncate),
    Mutant("beta_bf16", "precision", "kernel", "beta rounded through bf16 in the verify kernel",
           "vLLM #53877, sglang #38975", _kernel_beta_bf16),
    Mutant("round_every_token", "precision", "kernel", "verify kernel rounds the running state to the "
           "store dtype after every draft token", "sglang #25587, sgl-kernel-npu #651", _kernel_round_every_token),
    Mutant("padded_alias_row0", "semantics", "kernel", "padded graph rows alias request 0's scratch slot",
           "sglang #26906 / #27202", _kernel_padded_alias),
]}


def get(name: str) -> Mutant:
    if name not in MUTANTS:
        raise KeyError(f"mutant {name!r} is not known; known: {', '.join(MUTANTS)}")
    return MUTANTS[name]
