"""The copy-commit kind's verify rule in loops (:class:`~drift.flows.copy_commit.rule.NpuRule`), float64:
the definition the portable op is tested against under this kind (docs/semantics.md §5-§6)."""

from __future__ import annotations

import torch

from ...sim import naive
from ...sim.kernels import VerifyArgs, scratch_blocks
from ...sim.pool import raw_state

F64 = torch.float64


def verify(args: VerifyArgs, dtype: torch.dtype = F64, store=None) -> torch.Tensor:
    """Row b starts at ``i = ssm_state_indices[b, num_accepted[b] - 1]`` -- the committed state
    ``recurrent_state[cache_indices[b]]`` when ``i % S == 0``, else scratch block ``i`` -- runs its
    S tokens in ``dtype`` and stores the state after token t, mapped through ``store`` (default: a
    cast to the scratch dtype), into scratch block ``ssm_state_indices[b, t]``. Returns outputs
    ``[L, B, S, HV, V]`` in ``dtype``."""
    L, B, S, HV, V, K = args.dims
    rec, blocks = raw_state(args.recurrent_state), scratch_blocks(args.intermediate_state)

    def start(l: int, b: int) -> torch.Tensor:
        i = int(args.ssm_state_indices[b, int(args.num_accepted_tokens[b]) - 1])
        return rec[l, int(args.cache_indices[b])] if i % S == 0 else blocks[l, i]

    def dest(l: int, b: int, t: int):
        return blocks[l], int(args.ssm_state_indices[b, t])

    return naive.verify_rows(args, start, dest, dtype, store)


def update(flow, last: torch.Tensor, track, steps) -> None:
    """The kind's built-in update (``sglang-0.5.23``, drift/flows/copy_commit/updates.py) as per-request
    loops over ``flow``'s pool: the commit copy of each row's accepted scratch block, the tracked rows'
    copy into their track slot with the verify-time conv window, then the conv rollback of both
    (:func:`drift.sim.naive.move_intermediate_cache`, :func:`drift.sim.naive.conv_state_rollback`).
    last / steps int64 ``[N]``; track int64 ``[N]`` (the track slots) or None (tracking off): drift
    bench's naive step."""
    pool, D = flow.pool, flow.cfg.num_draft_tokens
    src = torch.arange(len(last), dtype=torch.int64, device=pool.device)
    naive.move_intermediate_cache(pool.temporal, pool.intermediate_ssm, pool.row_slots, src, last)
    if track is not None:
        naive.move_intermediate_cache(pool.temporal, pool.intermediate_ssm, track, src, steps)
        slots = pool.row_slots.tolist()
        for n, (step, tslot) in enumerate(zip(steps.tolist(), track.tolist())):
            if step >= 0:  # the verify-time window, before the working slot rolls back
                for l in range(pool.conv.shape[0]):
                    pool.conv[l, tslot] = pool.conv[l, slots[n]]
    naive.conv_state_rollback(pool.conv, pool.row_slots, last, D)
    if track is not None:
        naive.conv_state_rollback(pool.conv, track, steps, D)
