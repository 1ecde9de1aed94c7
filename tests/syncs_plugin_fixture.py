"""Plug-in fixtures for the sync tests, written like SGLang's Ascend backend method: a class
method taking ``model`` and ``req_pool_indices``, kernels imported from
``sgl_kernel_npu.mamba.mamba_state_update_triton`` (drift's shim on a machine without it).

``DeviceSideBackend`` is sync-free; ``ListBackend`` reads the track steps on the host with
``.tolist()`` (a sync on every tracking-enabled step).
"""

import torch
from sgl_kernel_npu.mamba.mamba_state_update_triton import conv_state_rollback, move_intermediate_cache


class DeviceSideBackend:
    def update_mamba_state_after_mtp_verify(self, last_correct_step_indices, mamba_track_indices,
                                            mamba_steps_to_track, model, req_pool_indices=None):
        n = last_correct_step_indices.shape[0]
        dst = self.linear_attn_backend.forward_metadata.mamba_cache_indices[:n].to(torch.int64)
        caches = self.linear_attn_backend.req_to_token_pool.get_speculative_mamba2_params_all_layers()
        conv, ssm, inter = caches.conv[0], caches.temporal, caches.intermediate_ssm
        src = torch.arange(n, device=dst.device, dtype=torch.int64)
        last = last_correct_step_indices.to(torch.int64)
        move_intermediate_cache(ssm, inter, dst, src, last)
        if mamba_track_indices is not None:
            track = mamba_track_indices.to(torch.int64)
            steps = mamba_steps_to_track.to(torch.int64)
            move_intermediate_cache(ssm, inter, track, src, steps)
            conv[:, track] = conv[:, torch.where(steps >= 0, dst, track)]
        conv_state_rollback(conv, dst, last, inter.shape[2])
        if mamba_track_indices is not None:
            conv_state_rollback(conv, mamba_track_indices.to(torch.int64), mamba_steps_to_track.to(torch.int64),
                                inter.shape[2])


class ListBackend(DeviceSideBackend):
    def update_mamba_state_after_mtp_verify(self, last_correct_step_indices, mamba_track_indices,
                                            mamba_steps_to_track, model, req_pool_indices=None):
        if mamba_steps_to_track is not None:
            tracked = [i for i, s in enumerate(mamba_steps_to_track.tolist()) if s >= 0]  # host read: a sync
            del tracked
        # The harness is ``self`` (not a ListBackend): call the parent method explicitly.
        DeviceSideBackend.update_mamba_state_after_mtp_verify(
            self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track, model, req_pool_indices)
