"""The kernel-commit kind's verify rule in loops (:class:`~drift.flows.kernel_commit.rule.RingRule`),
float64: the definition the portable op is tested against under this kind (docs/semantics.md §6)."""

from __future__ import annotations

import math

import torch

from ...sim import naive
from ...sim.kernels import VerifyArgs
from ...sim.pool import STALE, raw_state
from .pool import split_hi_lo

F64, F32 = torch.float64, torch.float32


def fold(h: torch.Tensor, d: torch.Tensor, k: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """One head's records folded into ``h`` ``[V, K]`` one at a time, ``h <- e^{g_c} h + d_c k_c^T``
    (d ``[n, V]``, k ``[n, K]``, g ``[n]``), in h's dtype."""
    for c in range(d.shape[0]):
        h = h * math.exp(float(g[c])) + torch.outer(d[c].to(h.dtype), k[c].to(h.dtype))
    return h


def verify(args: VerifyArgs, dtype: torch.dtype = F64, store=None) -> torch.Tensor:
    """Over ``args.rule.pool``: row b with checkpoint slot ``state_indices[b] >= 0`` and ``is_flush``
    clear starts from its checkpoint with its ring's first ``write_pos`` records (in logical order
    from ``cache_base``, high plus low part) folded in (:func:`fold`), runs its S tokens in
    ``dtype``, and writes token t's record (the delta and the key head's normalised key, each split
    into a bf16 high and low part, and g in fp32) at ring position ``(cache_base + write_pos + t) &
    (RL - 1)`` while ``write_pos + t < RL``. A padded row's outputs are zero, a flush row's NaN (no
    records). ``store`` is unused (the verify stores no state). Returns outputs ``[L, B, S, HV, V]``."""
    pool = args.rule.pool
    L, B, S, HV, V, K = args.dims
    group, RL = HV // args.nk, pool.ring_len
    rec = raw_state(args.recurrent_state)
    slot = [int(x) for x in pool.state_indices.tolist()]
    ring = [int(x) for x in pool.replay_indices.tolist()]

    def runs(b: int) -> bool:
        return slot[b] >= 0 and int(pool.is_flush[ring[b]]) == 0

    def phys(b: int, c: int) -> int:
        return (int(pool.cache_base[ring[b]]) + c) & (RL - 1)

    def start(l: int, b: int) -> torch.Tensor:
        r, n = ring[b], int(pool.write_pos[ring[b]])
        cs = [phys(b, c) for c in range(n)]
        out = []
        for hd in range(HV):
            kh = hd // group
            d = pool.ring_d[l, r, hd, cs].to(F64) + pool.ring_d_lo[l, r, hd, cs].to(F64)
            k = pool.ring_k[l, r, kh, cs].to(F64) + pool.ring_k_lo[l, r, kh, cs].to(F64)
            out.append(fold(rec[l, slot[b], hd].to(dtype), d, k, pool.ring_g[l, r, hd, cs]))
        return torch.stack(out)

    deltas = torch.zeros(L, B, S, HV, V, dtype=dtype)
    out = naive.verify_rows(args, start, lambda l, b, t: None, dtype, run=runs, deltas=deltas)
    for b in range(B):
        if not slot[b] >= 0:
            continue
        if not runs(b):
            out[:, b] = STALE
            continue
        wp = int(pool.write_pos[ring[b]])
        for t in range(S):
            if wp + t >= RL:
                break
            p = phys(b, wp + t)
            for l in range(L):
                for hd in range(HV):
                    hi, lo = split_hi_lo(deltas[l, b, t, hd].to(F32))
                    pool.ring_d[l, ring[b], hd, p], pool.ring_d_lo[l, ring[b], hd, p] = hi, lo
                    pool.ring_g[l, ring[b], hd, p] = float(args.g[l, b, t, hd])
                for kh in range(args.nk):
                    _, k, _ = naive.head_inputs(args.mix_qkv[l, b, t], args.nk, K, HV, V, args.scale)
                    hi, lo = split_hi_lo(k[kh * group].to(F32))
                    pool.ring_k[l, ring[b], kh, p], pool.ring_k_lo[l, ring[b], kh, p] = hi, lo
    return out
