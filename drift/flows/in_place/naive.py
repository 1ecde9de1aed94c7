"""The in-place kind's verify rule in loops (:class:`~drift.flows.in_place.rule.BlockRule`), float64:
the definition the portable op is tested against under this kind (docs/semantics.md §6)."""

from __future__ import annotations

import torch

from ...sim import naive
from ...sim.kernels import VerifyArgs, scratch_blocks

F64 = torch.float64


def verify(args: VerifyArgs, dtype: torch.dtype = F64, store=None) -> torch.Tensor:
    """Row b starts from cache block ``i = ssm_state_indices[b, num_accepted[b] - 1]`` and is skipped
    when ``i <= 0`` (the NULL block); it runs its ``actual_seq_lengths[b]`` tokens in ``dtype`` and
    stores the state after token t into block ``ssm_state_indices[b, t]`` when that index is ``> 0``.
    Returns outputs ``[L, B, S, HV, V]`` in ``dtype`` (zero for a skipped row and past a row's length)."""
    blocks = scratch_blocks(args.intermediate_state)  # the cache, [L, blocks, HV, V, K]

    def first(b: int) -> int:
        return int(args.ssm_state_indices[b, max(int(args.num_accepted_tokens[b]), 1) - 1])

    def dest(l: int, b: int, t: int):
        i = int(args.ssm_state_indices[b, t])
        return (blocks[l], i) if i > 0 else None

    return naive.verify_rows(args, lambda l, b: blocks[l, first(b)], dest, dtype, store, run=lambda b: first(b) > 0)
