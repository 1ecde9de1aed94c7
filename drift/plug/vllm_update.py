"""drift's rendering of vLLM 0.33.0's per-step MTP state bookkeeping: the code under test of the
``vllm`` flow (docs/semantics.md §6), the built-in update ``vllm-0.33.0``.

vLLM keeps no commit copy: after the verify, the accept count alone says which block the next
step starts from. Two places compute it, and drift runs them as one update, called after each
verify as every update is (``fn(self, last_correct_step_indices, mamba_track_indices,
mamba_steps_to_track)``, ``self`` a :class:`drift.sim.flows.BlockHarness`):

* ``vllm/v1/worker/gpu_model_runner.py: _update_states_after_model_execute``:
  ``num_accepted_tokens.gpu[:num_reqs] = (output_token_ids != -1).sum(dim=1)`` -- on the device;
  a row's kept tokens are its accepted draft steps plus one (``last + 1``), none for a padded row;
* ``vllm/v1/attention/backends/gdn_attn.py: GDNAttentionMetadataBuilder.build`` (the CUDA-graph
  path): ``num_accepted_tokens[:num_spec_decodes]`` copied into its persistent buffer and
  ``[num_spec_decodes:].fill_(1)``; ``spec_state_indices_tensor[:num_spec_decodes] =
  block_table[:, :num_spec + 1]`` and ``[num_spec_decodes:].fill_(NULL_BLOCK_ID)``.

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


def builder_state_indices(self) -> None:
    """GDNAttentionMetadataBuilder.build: the spec state indices from the block table, padded rows NULL."""
    R = self.num_spec_decodes
    self.spec_state_indices_tensor[:R].copy_(self.block_table[:R])
    self.spec_state_indices_tensor[R:].fill_(NULL_BLOCK_ID)


def bookkeeping(accept=runner_accept_counts, indices=builder_state_indices, name: str = "vllm-0.33.0"):
    """The update of the vllm flow from its two parts (a mutant replaces one of them)."""
    def update(self, last_correct_step_indices, mamba_track_indices=None, mamba_steps_to_track=None):
        accept(self, last_correct_step_indices)
        indices(self)

    update.__name__ = update.__qualname__ = name.replace("-", "_").replace(".", "")
    update.__doc__ = f"{name}: vLLM 0.33.0's per-step bookkeeping (drift/plug/vllm_update.py)."
    return update


vllm_0330 = bookkeeping()
