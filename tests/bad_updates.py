"""Known-bad variants of ``update_mamba_state_after_mtp_verify``: negative controls.

Written the way an SGLang backend method is (``self`` is drift's harness, kernels come
from ``sgl_kernel_npu.mamba.mamba_state_update_triton``, the drift shim here), and each
wrong in exactly one way, so the check that must catch it can be named:

=========================  ==============================  =========================
variant                    bug                             check that must fail
=========================  ==============================  =========================
``commit_next_step``       commits draft step last + 1     committed state
``skip_conv_rollback``     never rolls the conv window     conv windows
``track_next_step``        snapshots step + 1              tracked snapshots
``track_conv_late``        copies the conv window to the   tracked snapshots
                           track slot after the rollback
``track_rescaled``         snapshots the right step, then  tracked snapshots
                           scales it by 1 + 2^-6 (a few    (bit-exact part only:
                           bf16 ulps, rounding-sized)      the error is tiny)
``write_dummy_slot``       zeroes dummy slot 0's state     untouched slots
``write_dummy_conv``       zeroes dummy slot 0's conv      untouched slots
``track_unconditional``    copies into the track slot of   untouched slots
                           every active row, tracked or not
``commit_nan``             commits NaN into row 0          finite states
=========================  ==============================  =========================

``correct`` is the same code with no fault (positive control).
"""

from __future__ import annotations

import torch
from sgl_kernel_npu.mamba.mamba_state_update_triton import conv_state_rollback, move_intermediate_cache


def _update(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track, *,
            commit_shift=0, rollback=True, track_shift=0, track_conv_late=False,
            track_all=False):
    last = last_correct_step_indices.to(torch.int64)
    N = last.shape[0]
    backend = self.linear_attn_backend
    dst = backend.forward_metadata.mamba_cache_indices[:N].to(torch.int64)
    caches = backend.req_to_token_pool.get_speculative_mamba2_params_all_layers()
    conv, ssm, inter = caches.conv[0], caches.temporal, caches.intermediate_ssm
    D = inter.shape[2]
    src = torch.arange(N, dtype=torch.int64, device=dst.device)
    commit = torch.where(last >= 0, torch.clamp(last + commit_shift, max=D - 1), last)
    move_intermediate_cache(ssm, inter, dst, src, commit)
    if mamba_track_indices is not None:
        track = mamba_track_indices.to(torch.int64)
        steps = mamba_steps_to_track.to(torch.int64)
        tsteps = torch.where(steps >= 0, torch.clamp(steps + track_shift, max=D - 1), steps)
        if track_all:  # every active row copies into its track slot, crossing or not
            tsteps = torch.where(last >= 0, torch.clamp(tsteps, min=0), tsteps)
        move_intermediate_cache(ssm, inter, track, src, tsteps)
        conv_src = torch.where(steps >= 0, dst, track)
        if not track_conv_late:
            conv[:, track] = conv[:, conv_src]
    if rollback:
        conv_state_rollback(conv, dst, last, D)
    if mamba_track_indices is not None:
        if track_conv_late:
            conv[:, track] = conv[:, conv_src]
        conv_state_rollback(conv, track, steps, D)
    return caches


def correct(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track):
    _update(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track)


def commit_next_step(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track):
    _update(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track, commit_shift=1)


def skip_conv_rollback(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track):
    _update(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track, rollback=False)


def track_next_step(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track):
    _update(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track, track_shift=1)


def track_conv_late(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track):
    _update(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track,
            track_conv_late=True)


def track_rescaled(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track):
    caches = _update(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track)
    if mamba_track_indices is not None:
        tracked = mamba_track_indices[mamba_steps_to_track >= 0].to(torch.int64)
        caches.temporal[:, tracked] *= 1 + 2.0 ** -6


def track_unconditional(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track):
    _update(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track, track_all=True)


def write_dummy_slot(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track):
    caches = _update(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track)
    caches.temporal[:, 0] = 0.0


def write_dummy_conv(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track):
    caches = _update(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track)
    caches.conv[0][:, 0] = 0.0


def commit_nan(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track):
    caches = _update(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track)
    slot = self.linear_attn_backend.forward_metadata.mamba_cache_indices[0].to(torch.int64)
    caches.temporal[:, slot] = float("nan")
