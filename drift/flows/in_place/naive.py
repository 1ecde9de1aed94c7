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


def conv(flow, x: torch.Tensor, weight: torch.Tensor, drafts=None) -> torch.Tensor:
    """:func:`drift.sim.kernels.conv_verify_at` (vLLM's speculative conv update) in loops: row b on a
    block reads the Kc-1 inputs at offset ``num_accepted - 1`` of its first block's buffer and leaves
    ``[old[offset + 1 : offset + Kc-1], x_0 .. x_{D-1}]`` (the first ``Kc-2 + length`` columns);
    rows on the NULL block are skipped. Returns mix_qkv float64 holding bf16 values ``[L, N, D, C]``."""
    h, buf = flow.harness, flow.pool.conv
    L, _, W, C = buf.shape
    N, D, Kc = x.shape[1], x.shape[2], weight.shape[-1]
    out = torch.zeros(L, N, D, C, dtype=F64, device=x.device)
    for n in flow._valid_rows.tolist():
        slot = int(h.spec_state_indices_tensor[n, 0])
        off = max(int(h.num_accepted_tokens[n]) - 1, 0)
        written = Kc - 2 + (D if drafts is None else int(drafts[n]))
        for l in range(L):
            old = buf[l, slot].clone()
            shifted = [old[min(off + j, W - 1)] for j in range(W)]
            out[l, n] = naive.conv_mix(torch.stack(shifted[:Kc - 1])[None, None], x[l, n][None, None],
                                       weight[l][None])[0, 0]
            new = shifted[1:Kc - 1] + [x[l, n, t].to(buf.dtype) for t in range(D)]
            for j in range(min(written, W)):
                buf[l, slot, j] = new[j]
    return out


def update(flow, last: torch.Tensor, track, steps) -> None:
    """The kind's built-in update (``vllm-0.33.0``, drift/flows/in_place/updates.py) as per-request
    loops: each row's accept count (``last + 1``; 1 for the padded rows), the align copy of a tracked
    row's boundary block and conv columns (its accept count reset to 1 where the boundary is the
    running block), then the builder's state indices from the block table (padded rows NULL).
    last / steps int64 ``[N]``; track int64 ``[N]`` or None (tracking off): drift bench's naive step."""
    h = flow.harness
    R, N = h.num_spec_decodes, len(last)
    lasts = last.tolist()
    for n in range(N):
        h.num_accepted_tokens[n] = max(lasts[n] + 1, 0) if n < R else 1
    if track is not None:
        ssm, conv_state = h.ssm_state, h.conv_state
        W = conv_state.shape[2]
        for r in range(R):
            st = int(steps[r])
            bias = max(st, 0)
            run = int(h.spec_state_indices_tensor[r, 0])
            same = st >= 0 and bias == int(h.num_draft_tokens[r])
            dest = int(track[r]) if st >= 0 and not same else run
            src = int(h.spec_state_indices_tensor[r, bias]) if st >= 0 else run
            for l in range(ssm.shape[0]):
                ssm[l, dest] = ssm[l, src].clone()
                old = conv_state[l, run].clone()
                for j in range(W - bias):
                    conv_state[l, dest, j] = old[j + bias]
            if same:
                h.num_accepted_tokens[r] = 1
    for r in range(N):
        if r < R:
            h.spec_state_indices_tensor[r] = h.block_table[r]
        else:
            h.spec_state_indices_tensor[r] = 0  # NULL_BLOCK_ID (vllm/v1/core/kv_cache_utils.py)
