"""The in-place kind's verify rule: vLLM 0.33.0's ``fused_recurrent_gated_delta_rule`` over one state
cache (``vllm/third_party/flash_linear_attention/ops/fused_recurrent.py``, ``IS_SPEC_DECODING``;
docs/semantics.md §6)."""

from __future__ import annotations

import torch

from ...sim.kernels import Plan, VerifyArgs, VerifyRule


class BlockRule(VerifyRule):
    """Row b starts from block ``i = ssm_state_indices[b, num_accepted[b] - 1]`` of the cache (the
    scratch is the cache itself); a row with ``i <= 0`` (``NULL_BLOCK_ID``) is skipped: no read, no
    store, its outputs zero. The state after token t is stored in place into block
    ``ssm_state_indices[b, t]`` unless that index is ``<= 0`` or t is past the row's length (varlen
    rows: ``actual_seq_lengths``, 1..S)."""

    name = "blocks"
    ragged = True

    def plan(self, args: VerifyArgs) -> Plan:
        S = args.mix_qkv.shape[2]
        start = args.accepted_index()
        idx = args.ssm_state_indices.to(start.dtype)
        run = start > 0
        lengths = args.actual_seq_lengths.to(device=idx.device, dtype=torch.int64)
        stores = (idx > 0) & (torch.arange(S, device=idx.device)[None, :] < lengths[:, None]) & run[:, None]
        return Plan(start=start, from_committed=torch.zeros_like(run), run=run, dest=idx, stores=stores)
