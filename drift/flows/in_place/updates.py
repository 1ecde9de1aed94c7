"""drift's rendering of vLLM 0.33.0's per-step MTP state bookkeeping: the code under test of the
``vllm`` flow (docs/semantics.md §6), the built-in update ``vllm-0.33.0``.

vLLM keeps no commit copy: after the verify, the accept count alone says which block the next
step starts from. Two places compute it, and drift runs them as one update, called after each
verify as every update is (``fn(self, last_correct_step_indices, mamba_track_indices,
mamba_steps_to_track)``, ``self`` a :class:`drift.flows.registry.BlockHarness`):

* ``vllm/v1/worker/gpu_model_runner.py: _update_states_after_model_execute``:
  ``num_accepted_tokens.gpu[:num_reqs] = (output_token_ids != -1).sum(dim=1)`` -- on the device;
  a row's kept tokens are its accepted draft steps plus one (``last + 1``), none for a padded row;
* ``vllm/v1/attention/backends/gdn_attn.py: GDNAttentionMetadataBuilder.build`` (the CUDA-graph
  path): ``num_accepted_tokens[:num_spec_decodes]`` copied into its persistent buffer and
  ``[num_spec_decodes:].fill_(1)``; ``spec_state_indices_tensor[:num_spec_decodes] =
  block_table[:, :num_spec + 1]`` and ``[num_spec_decodes:].fill_(NULL_BLOCK_ID)``;
* with prefix caching (``mamba_cache_mode == "align"``), between the two:
  ``vllm/v1/worker/mamba_utils.py: postprocess_mamba_fused_kernel`` (launched by
  ``postprocess_mamba_align_gpu`` from ``_update_states_after_model_execute``) copies the state after
  a block-boundary token into the block-table column of that boundary and, when that column is
  the running one, resets the row's accept count to 1 (:func:`align_copy`; docs/semantics.md §6).

No host sync: every step is device tensors and host ints the harness fixes.
"""

from __future__ import annotations

import torch

NULL_BLOCK_ID = 0  # vllm/v1/core/kv_cache_utils.py (0.33.0)


def kept_tokens(last_correct_step_indices: torch.Tensor) -> torch.Tensor:
    """``(output_token_ids != -1).sum(1)`` from drift's accepted steps (-1: a padded row keeps none)."""
    return (last_correct_step_indices.to(torch.int64) + 1).clamp(min=0)


def runner_accept_counts(self, last_correct_step_indices) -> None:
    """gpu_model_runner._update_states_after_model_execute, then the builder's copy and padding."""
    R = self.num_spec_decodes
    self.num_accepted_tokens[:R].copy_(kept_tokens(last_correct_step_indices)[:R])
    self.num_accepted_tokens[R:].fill_(1)


def boundary_blocks(self, bias: torch.Tensor) -> torch.Tensor:
    """The block holding the state after the boundary token: spec column ``bias`` of each row
    (``_copy_mamba_state_block``'s temporal copy reads ``block_table[src_col + token_bias]``, src_col
    the running column); int64 ``[R]``."""
    idx = self.spec_state_indices_tensor[: self.num_spec_decodes].to(torch.int64)
    return idx.gather(1, bias[:, None]).squeeze(1)


def align_copy(self, mamba_track_indices, mamba_steps_to_track, source=boundary_blocks) -> None:
    """mamba_utils.postprocess_mamba_fused_kernel (vLLM 0.33.0), for the rows that decode speculatively.

    ``mamba_steps_to_track`` int64 ``[N]``: per row the accept-token bias ``aligned_new_computed -
    num_tokens_running_state`` where the kernel's ``needs_copy`` holds, else -1 (drift's stream
    computes it: the track rule with interval = the mamba block size, docs/semantics.md §6);
    ``mamba_track_indices`` int64 ``[N]``: the row's destination block when the boundary column
    ``aligned // block_size - 1`` is not the running one. The destination is the running block
    ``spec_state_indices_tensor[:, 0]`` when ``bias == num_draft_tokens`` (the boundary is the last
    verified token, ``src_block_idx == dest_block_idx``); there the accept count becomes 1, so the
    next verify reads the copied state at column 0 (``num_accepted_tokens_out``).

    Temporal state: block ``source`` (spec column ``bias``) copied whole to the destination. Conv
    state: the running block's columns ``bias:`` to the destination's ``:W - bias`` (its other
    columns kept). A row that copies nothing copies its running block onto itself with bias 0:
    the same bits, and no mask, so no host sync."""
    R = self.num_spec_decodes
    steps = mamba_steps_to_track[:R].to(torch.int64)
    bias = steps.clamp(min=0)
    run = self.spec_state_indices_tensor[:R, 0].to(torch.int64)
    copies = steps >= 0
    same = copies & (bias == self.num_draft_tokens[:R].to(torch.int64))
    dest = torch.where(copies & ~same, mamba_track_indices[:R].to(torch.int64), run)
    src = torch.where(copies, source(self, bias), run)
    self.ssm_state[:, dest] = self.ssm_state[:, src]
    conv = self.conv_state  # [L, blocks, W, C]
    W = conv.shape[2]
    cols = torch.arange(W, device=bias.device)[None, :] + bias[:, None]  # [R, W]: source column of each
    # Advanced indexing, not gather: gather of bf16 on the CPU rewrites NaN payloads (torch 2.x), and
    # a self-copy must leave every bit as it was.
    shifted = conv[:, run[:, None], cols.clamp(max=W - 1)]  # [L, R, W, C]
    conv[:, dest] = torch.where((cols < W)[None, :, :, None], shifted, conv[:, dest])
    self.num_accepted_tokens[:R].masked_fill_(same, 1)


def builder_state_indices(self) -> None:
    """GDNAttentionMetadataBuilder.build: the spec state indices from the block table, padded rows NULL."""
    R = self.num_spec_decodes
    self.spec_state_indices_tensor[:R].copy_(self.block_table[:R])
    self.spec_state_indices_tensor[R:].fill_(NULL_BLOCK_ID)


def bookkeeping(accept=runner_accept_counts, indices=builder_state_indices, align=align_copy,
                name: str = "vllm-0.33.0"):
    """The update of the vllm flow from its three parts (a mutant replaces one of them); the align
    copy runs when tracking is on (``mamba_track_indices`` given: prefix caching on)."""
    def update(self, last_correct_step_indices, mamba_track_indices=None, mamba_steps_to_track=None):
        accept(self, last_correct_step_indices)
        if mamba_track_indices is not None:
            align(self, mamba_track_indices, mamba_steps_to_track)
        indices(self)

    update.__name__ = update.__qualname__ = name.replace("-", "_").replace(".", "")
    update.__doc__ = f"{name}: vLLM 0.33.0's per-step bookkeeping (drift/flows/in_place/updates.py)."
    return update


vllm_0330 = bookkeeping()
