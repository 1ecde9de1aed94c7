"""Built-in implementations of ``update_mamba_state_after_mtp_verify`` (the code under test).

Each is written as a method body of SGLang's Ascend backend, called as
``fn(backend, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track, **extra)``
and takes its kernels from ``sgl_kernel_npu.mamba.mamba_state_update_triton`` (the real
package when installed, drift's portable kernels through the shim otherwise).

- ``guarded``: sglang #31659. A precision guard ``(last_steps == 0).all().item()`` that
  skips the commit copy when every row accepted only its root token: a host sync on
  every step, and a lost token update whenever it fires. It never fires while the batch
  carries padded rows (their step is -1).
- ``sync_free``: sglang #32130. The guard removed; the tracking path still selects
  tracked rows with a boolean mask (``t[mask]`` is a nonzero: a sync every step with
  tracking on).
- ``device_select``: sglang 0.5.23 style. Tracking by ``torch.where`` and an
  unconditional copy (a self-copy for untracked rows): no sync anywhere.
"""

from __future__ import annotations

from typing import Callable

import torch

from .loader import sgl_kernels


def _common(self, last_correct_step_indices):
    N = last_correct_step_indices.shape[0]
    dst = self.linear_attn_backend.forward_metadata.mamba_cache_indices[:N].to(torch.int64)
    caches = self.linear_attn_backend.req_to_token_pool.get_speculative_mamba2_params_all_layers()
    src = torch.arange(N, device=dst.device, dtype=torch.int64)
    last = last_correct_step_indices.to(torch.int64)
    return dst, src, last, caches.conv[0], caches.temporal, caches.intermediate_ssm


def _masked_tracking_and_rollback(k, conv, ssm, inter, dst, src, last, mamba_track_indices,
                                  mamba_steps_to_track):
    """Tracking and conv rollback as in sglang #31659 and #32130: the tracked rows are selected
    with a boolean mask (indexing by a mask is a nonzero: a sync on every step with tracking on)."""
    D = inter.shape[2]
    if mamba_track_indices is not None:
        track = mamba_track_indices.to(torch.int64)
        steps = mamba_steps_to_track.to(torch.int64)
        k.move_intermediate_cache(ssm, inter, track, src, steps)
        mask = steps >= 0
        # Track the verify-time conv window before the working slot is rolled back.
        track_sel = track[mask]  # boolean-mask indexing: a sync
        if track_sel.numel() > 0:
            conv[:, track_sel] = conv[:, dst[mask]]
    if dst.numel() > 0:
        k.conv_state_rollback(conv, dst, last, D)
    if mamba_track_indices is not None and mamba_track_indices.numel() > 0:
        k.conv_state_rollback(conv, mamba_track_indices.to(torch.int64),
                              mamba_steps_to_track.to(torch.int64), D)


def guarded(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track, model=None):
    """sglang #31659: precision guard with ``.item()``; boolean-mask tracking."""
    k = sgl_kernels()
    dst, src, last, conv, ssm, inter = _common(self, last_correct_step_indices)
    all_step0 = (last == 0).all().item()  # host-device sync on every decode step
    if not all_step0:
        k.move_intermediate_cache(ssm, inter, dst, src, last)
    _masked_tracking_and_rollback(k, conv, ssm, inter, dst, src, last, mamba_track_indices,
                                  mamba_steps_to_track)


def sync_free(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track, model=None):
    """sglang #32130: guard removed; tracking still selects rows with a boolean mask."""
    k = sgl_kernels()
    dst, src, last, conv, ssm, inter = _common(self, last_correct_step_indices)
    k.move_intermediate_cache(ssm, inter, dst, src, last)
    _masked_tracking_and_rollback(k, conv, ssm, inter, dst, src, last, mamba_track_indices,
                                  mamba_steps_to_track)


def device_select(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track,
                  model=None):
    """Device-side tracking: ``torch.where`` select and an unconditional copy; no sync."""
    k = sgl_kernels()
    dst, src, last, conv, ssm, inter = _common(self, last_correct_step_indices)
    k.move_intermediate_cache(ssm, inter, dst, src, last)
    D = inter.shape[2]
    if mamba_track_indices is not None:
        track = mamba_track_indices.to(torch.int64)
        steps = mamba_steps_to_track.to(torch.int64)
        k.move_intermediate_cache(ssm, inter, track, src, steps)
        # Untracked rows copy their track slot onto itself.
        conv_src = torch.where(steps >= 0, dst, track)
        conv[:, track] = conv[:, conv_src]
    k.conv_state_rollback(conv, dst, last, D)
    if mamba_track_indices is not None:
        k.conv_state_rollback(conv, mamba_track_indices.to(torch.int64),
                              mamba_steps_to_track.to(torch.int64), D)


BUILTINS: dict[str, Callable] = {
    "guarded": guarded,
    "sync_free": sync_free,
    "device_select": device_select,
}
DEFAULT_UPDATE = "sync_free"
