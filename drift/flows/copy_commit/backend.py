"""The verify op's arguments, built the way SGLang 0.5.23's Ascend GDN backend builds them.

``AscendGDNAttnBackend`` (``srt/hardware_backend/npu/attention/ascend_gdn_backend.py``) calls
``torch.ops.npu.recurrent_gated_delta_rule`` per layer with index tensors it prepares once per
batch (docs/semantics.md §5-§6):

* eager (``prepare_gdn_inputs``): ``num_accept_tokens = ones([bs], int32)``,
  ``actual_seq_lengths = ones([bs], int32) * draft_token_num``,
  ``ssm_state_indices = arange(cache_indices.shape[0] * seq_len, int32)``;
* graph mode (``fused_recurrent_gated_delta_rule_update`` with ``self.graph_mode``):
  ``num_accept_tokens = full([bs], 1)``, ``actual_seq_lengths = full([bs], seq_len)`` and
  ``ssm_state_indices = forward_metadata.mamba_cache_indices_gdn``, the persistent buffer that
  ``_replay_metadata`` (``ascend_hybrid_linear_attn_backend.py``) fills with
  ``arange(bs * draft_token_num)``;
* ``cache_indices = forward_metadata.mamba_cache_indices`` (padded rows on slot 0).

With these every row starts from its committed state (the ``sglang`` flow). The ``npu-accepted``
flow passes the previous step's accept lengths as ``num_accepted_tokens`` (an argument form the
op supports): a row then continues from the previous step's scratch block.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ...config import Config
from ...sim.kernels import VerifyArgs, VerifyRule
from ...sim.pool import StatePool

I32 = torch.int32


class VerifyArgsBuilder:
    """Builds :class:`~drift.sim.kernels.VerifyArgs` for ``pool`` each step (``cfg.graph_mode``;
    ``accept_counts``: pass the previous step's accept lengths, the ``npu-accepted`` flow's
    setting). Index tensors live on the pool's device and are built without reading device data,
    so a step that builds them can be captured in a device graph."""

    def __init__(self, cfg: Config, pool: StatePool, rule: VerifyRule, accept_counts: bool = False):
        self.cfg, self.pool, self.rule, self.accept_counts = cfg, pool, rule, accept_counts
        dev, N, D = pool.device, cfg.num_rows, cfg.num_draft_tokens
        self.cache_indices = pool.row_slots.to(I32)  # forward_metadata.mamba_cache_indices
        if cfg.graph_mode:
            # _replay_metadata: state_indices_list_gdn[bs - 1].copy_(arange(bs * draft_token_num))
            self.ssm_state_indices = torch.full((N * D,), -1, dtype=I32, device=dev)
            self.ssm_state_indices.copy_(torch.arange(N * D, dtype=I32, device=dev))
            self.num_accepted = torch.full((N,), 1, dtype=I32, device=dev)
            self.actual_seq_lengths = torch.full((N,), D, dtype=I32, device=dev)
        else:
            # prepare_gdn_inputs
            self.num_accepted = torch.ones([N], dtype=I32, device=dev)
            self.actual_seq_lengths = torch.ones([N], dtype=I32, device=dev) * D
            self.ssm_state_indices = torch.arange(self.cache_indices.shape[0] * D, dtype=I32, device=dev)
        self.scale = cfg.head_k_dim ** -0.5
        # The npu-accepted flow: accept lengths of the previous step (1 after prefill: the start state
        # is the committed one).
        self.prev_accept = torch.ones(N, dtype=I32, device=dev)

    def build(self, mix_qkv: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, rounding: str = "rne",
              key: int = 0, gate_inputs: Optional[tuple] = None) -> VerifyArgs:
        """The arguments of this step's verify: mix_qkv bf16 ``[L, N, D, C]``, beta (logits) bf16 and
        g fp32 ``[L, N, D, HV]`` (gate_inputs: what g was computed from, :class:`VerifyArgs`)."""
        cfg, pool = self.cfg, self.pool
        B, D = mix_qkv.shape[1], cfg.num_draft_tokens  # the step's rows: every row, or its graph bucket
        num_accepted = self.prev_accept if self.accept_counts else self.num_accepted
        return VerifyArgs(mix_qkv, beta, g, pool.temporal, pool.intermediate_ssm, self.cache_indices[:B],
                          self.ssm_state_indices[:B * D].view(B, D), num_accepted[:B],
                          self.actual_seq_lengths[:B], cfg.num_k_heads, cfg.num_v_heads, self.scale, rounding, key,
                          rule=self.rule, gate_inputs=gate_inputs)

    def accepted(self, last_steps: torch.Tensor) -> None:
        """Record this step's accepted steps (int ``[B]``, -1 for padded rows) for the next step's
        ``num_accepted_tokens`` in the npu-accepted flow: ``max(last + 1, 1)``, on the device."""
        self.prev_accept[: last_steps.shape[0]].copy_(torch.clamp(last_steps + 1, min=1).to(I32))

    def follow(self, moved_from) -> None:
        """A new batch (a churning lifecycle; ``moved_from [B]`` host int: the row each row's request held
        at the last step, -1 new or padded). The accepted-count form continues a row from its previous
        scratch block ``b * S + n - 1``, which is row b's: a request that kept its row keeps its count, any
        other row gets 1 (its committed state, which the commit copy left holding the accepted state)."""
        B = len(moved_from)
        stays = torch.from_numpy(np.asarray(moved_from) == np.arange(B)).to(self.prev_accept.device)
        self.prev_accept[:B] = torch.where(stays, self.prev_accept[:B], torch.ones_like(self.prev_accept[:B]))
        self.prev_accept[B:] = 1

    def state_dict(self) -> dict:
        return {"prev_accept": self.prev_accept.cpu().clone()}

    def load_state_dict(self, state: Optional[dict]) -> None:
        if state is not None:
            self.prev_accept.copy_(state["prev_accept"])
