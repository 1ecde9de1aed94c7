"""The kernel-commit kind's verify rule in loops (:class:`~drift.flows.kernel_commit.rule.RingRule`),
float64: the definition the portable op is tested against under this kind (docs/semantics.md §6)."""

from __future__ import annotations

import math

import torch

from ...sim import naive
from ...sim.kernels import VerifyArgs, round_to
from ...sim.pool import STALE, raw_state

F64, F32 = torch.float64, torch.float32


def fold(h: torch.Tensor, d: torch.Tensor, k: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """One head's records folded into ``h`` ``[V, K]`` one at a time, ``h <- e^{g_c} h + d_c k_c^T``
    (d ``[n, V]``, k ``[n, K]``, g ``[n]``), in h's dtype."""
    for c in range(d.shape[0]):
        h = h * math.exp(float(g[c])) + torch.outer(d[c].to(h.dtype), k[c].to(h.dtype))
    return h


def rounded_fold(h: torch.Tensor, d: torch.Tensor, k: torch.Tensor, g: torch.Tensor, operand) -> torch.Tensor:
    """fp32 ``e^{G} h + sum_c operand(w_c d_c) operand(k_c)^T`` one record at a time, ``w_c = e^{G - G_c}``
    (``G_c`` the sum of g through record c): a fold whose contraction rounds its operands
    (``operand``: the design's, drift/flows/kernel_commit/design.py)."""
    n = d.shape[0]
    total = float(g[:n].sum()) if n else 0.0
    out = h * math.exp(total)
    for c in range(n):
        w = math.exp(float(g[c + 1:n].sum()))
        out = out + torch.outer(operand((d[c] * w).to(F32)), operand(k[c].to(F32)))
    return out


def _record(ring, lo, *index) -> torch.Tensor:
    """A ring record as float64: its high part plus its low part where the ring has one."""
    return ring[index].to(F64) + (0.0 if lo is None else lo[index].to(F64))


def verify(args: VerifyArgs, dtype: torch.dtype = F64, store=None) -> torch.Tensor:
    """Over ``args.rule.pool``: row b with checkpoint slot ``state_indices[b] >= 0`` and ``is_flush``
    clear starts from its checkpoint with its ring's first ``write_pos`` records (in logical order
    from ``cache_base``, high plus low part) folded in (:func:`fold`), runs its S tokens in
    ``dtype``, and writes token t's record (the delta and the key head's normalised key as the
    design stores them -- SGLang's: each split into a bf16 high and low part -- and g in fp32) at ring position ``(cache_base + write_pos + t) &
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
            d = _record(pool.ring_d, pool.ring_d_lo, l, r, hd, cs)
            k = _record(pool.ring_k, pool.ring_k_lo, l, r, kh, cs)
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
                    hi, lo = pool.design.split_records(deltas[l, b, t, hd].to(F32))
                    pool.ring_d[l, ring[b], hd, p] = hi
                    if lo is not None:
                        pool.ring_d_lo[l, ring[b], hd, p] = lo
                    pool.ring_g[l, ring[b], hd, p] = float(args.g[l, b, t, hd])
                for kh in range(args.nk):
                    _, k, _ = naive.head_inputs(args.mix_qkv[l, b, t], args.nk, K, HV, V, args.scale)
                    hi, lo = pool.design.split_records(k[kh * group].to(F32))
                    pool.ring_k[l, ring[b], kh, p] = hi
                    if lo is not None:
                        pool.ring_k_lo[l, ring[b], kh, p] = lo
    return out


def update(flow, last: torch.Tensor, track, steps) -> None:
    """The kind's built-in update (``sglang-0.5.23-replayssm``, drift/flows/kernel_commit/updates.py) as
    per-row loops, in the run's design (``pool.design``): advance each row's cursors by its accept
    length (the cadence sets ``is_flush``), fold a flushing row's records into its checkpoint one at
    a time (:func:`fold` in fp32 for SGLang's split contraction, :func:`rounded_fold` for the others;
    the fold store as the design declares it) and a tracked row's first ``write_pos - n + step + 1``
    into its track slot, restart a folded row's ring, then the conv rollback (the tracked rows'
    verify-time window first). last / steps int64 ``[N]``; track int64 ``[N]`` or None (tracking off):
    drift bench's naive step."""
    pool, h = flow.pool, flow.harness
    design = pool.design
    RL, D, group = pool.ring_len, flow.cfg.num_draft_tokens, flow.cfg.num_v_heads // flow.cfg.num_k_heads
    temporal = raw_state(pool.temporal)
    L, HV, V, K = temporal.shape[0], temporal.shape[2], temporal.shape[3], temporal.shape[4]
    N = len(last)
    lasts = last.tolist()
    rows = [(b, int(pool.state_indices[b]), int(pool.replay_indices[b]), max(lasts[b] + 1, 0)) for b in range(len(lasts))]
    for b, slot, r, n in rows:  # advance
        wp, base, flush = int(pool.write_pos[r]), int(pool.cache_base[r]), int(pool.is_flush[r]) != 0
        new_wp = n if flush else wp + n
        pool.cache_base[r] = (base + wp) & (RL - 1) if (n > 0 and flush) else base
        pool.write_pos[r] = new_wp
        if h.fold_every_commit:
            pool.is_flush[r] = int(new_wp > 0)
        elif design.every:
            pool.commits_since_fold[r] = int(pool.commits_since_fold[r]) + int(n > 0)
            pool.is_flush[r] = int(int(pool.commits_since_fold[r]) >= design.every and new_wp > 0)
        else:
            pool.is_flush[r] = int(new_wp + 2 * D > RL)

    def store(x: torch.Tensor, b: int, l: int, hd: int) -> torch.Tensor:
        # the element offset of (l, b, hd) in the update's [L, N, HV, V, K] fold: the same noise
        return round_to(x, temporal.dtype, design.store_rounding, h.fold_key, ((l * N + b) * HV + hd) * V * K)

    for b, slot, r, n in rows:  # fold
        if slot < 0:
            continue
        wp, flush = int(pool.write_pos[r]), int(pool.is_flush[r]) != 0
        tracked = track is not None and int(track[b]) >= 0 and int(steps[b]) >= 0
        cs = [(int(pool.cache_base[r]) + c) & (RL - 1) for c in range(RL)]
        for l in range(L):
            for hd in range(HV):
                old = temporal[l, slot, hd].to(F32)
                d = _record(pool.ring_d, pool.ring_d_lo, l, r, hd).to(F32)
                k = _record(pool.ring_k, pool.ring_k_lo, l, r, hd // group).to(F32)
                g = pool.ring_g[l, r, hd]

                def folded(count):
                    keep = cs[:min(max(count, 0), RL)]
                    if design.contraction.split:
                        return store(fold(old, d[keep], k[keep], g[keep]), b, l, hd).to(temporal.dtype)
                    return store(rounded_fold(old, d[keep], k[keep], g[keep], design.operand), b, l, hd
                                 ).to(temporal.dtype)
                if tracked:
                    temporal[l, int(track[b]), hd] = folded(wp - n + int(steps[b]) + 1)
                if flush:
                    temporal[l, slot, hd] = folded(wp)
    for b, slot, r, n in rows:  # finish
        if slot >= 0 and int(pool.is_flush[r]) != 0:
            pool.cache_base[r] = (int(pool.cache_base[r]) + int(pool.write_pos[r])) & (RL - 1)
            pool.write_pos[r] = 0
            pool.is_flush[r] = 0
            if pool.commits_since_fold is not None:
                pool.commits_since_fold[r] = 0
    slots = [max(slot, 0) for _, slot, _, _ in rows]  # padded rows: the dummy, step -1 skips
    if track is not None:
        for b, tslot in enumerate(track.tolist()):
            if int(steps[b]) >= 0:
                pool.conv[:, tslot] = pool.conv[:, slots[b]].clone()
    naive.conv_state_rollback(pool.conv, torch.tensor(slots), last, D)
    if track is not None:
        naive.conv_state_rollback(pool.conv, track, steps, D)
