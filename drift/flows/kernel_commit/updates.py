"""drift's rendering of SGLang 0.5.23's ReplaySSM commit: the code under test of the
``sglang-replayssm`` flow (docs/semantics.md §6), the built-in update ``sglang-0.5.23-replayssm``.

``sglang/srt/speculative/spec_utils.py: commit_mamba_states_after_verify`` (the GDN branch taken
when ``mamba_pool.replayssm_cache_base`` exists) runs, after each verify:

1. **advance** (``commit_gdn_replayssm_spec`` / ``_advance_gdn_spec_cursors_kernel``,
   ``gdn_replayssm_spec_decode.py``): per ring slot, with n the accept length (the bonus token
   included; 0 for a padded row): ``new_wp = n if is_flush else write_pos + n``, ``cache_base``
   moved past the history when a flush row commits, ``is_flush = new_wp > 0`` under
   ``fold_every_commit`` (``temporal.dtype != float32``) else ``new_wp + 2 D > RL`` -- or, under a
   declared ``every:N`` cadence, once N commits have passed since the row's last fold;
2. **fold** (``commit_gdn_replayssm_circular`` / ``gdn_replayssm_compact_commit_kernel``): a row
   whose ``is_flush`` is set gets ``temporal = old * e^{G} + sum_t k_t (d_t e^{G - G_t})^T`` over
   its ``write_pos`` records (d = high + low part; the decayed update split into bf16 high and low
   parts again, each multiplied by the key's high and low parts in fp32 -- or, in another declared
   design, the contraction that design names), stored in the checkpoint dtype (to nearest, or by a
   declared stochastic rounding); a tracked row's track slot gets the same fold over
   ``write_pos - n + step + 1`` records, from the same old checkpoint;
3. **finish** (``_finish_gdn_replayssm_circular_fold_kernel``): a folded row's ring restarts past
   its history: ``cache_base += write_pos (mod RL)``, ``write_pos = is_flush = 0``;
4. **conv**: the usual accept rollback of the working slots and the tracked window
   (``fused_conv_window_scatter_with_mask``; drift: the NPU window's rollback, the same inputs).

Called as every update is (``fn(self, last_correct_step_indices, mamba_track_indices,
mamba_steps_to_track)``, ``self`` a :class:`drift.flows.kernel_commit.pool.ReplayHarness`), in the run's
declared design (``self.commit_design``: drift/flows/kernel_commit/design.py; SGLang 0.5.23's by
default). No host sync: every step is device tensors and host ints the harness fixes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from ...devices import on_host
from ...sim import kernels
from ...sim.pool import raw_state
from ...sim.shim import sgl_kernels
from ..base import EVERY_CHOICE
from .pool import contract, decay_weights, in_ring_order, over_value_heads

F32, BF16 = torch.float32, torch.bfloat16
NULL = -1  # spec_utils.py: null_block_id=-1


@dataclass
class Commit:
    """What one commit reads: accept int64 ``[N]`` (n, 0 for a padded row), last / steps int64
    ``[N]`` (accepted / tracked draft step, -1 none), track int64 ``[N]`` or None (tracking off)."""

    h: object
    accept: torch.Tensor
    last: torch.Tensor
    track: Optional[torch.Tensor]
    steps: Optional[torch.Tensor]

    @property
    def ring_len(self) -> int:
        return self.h.spec_state.replayssm_g.shape[-1]


# ------------------------------------------------------------------------------ 1. advance
def advance_cursors(c: Commit) -> None:
    """``_advance_gdn_spec_cursors_kernel`` over every row whose ring slot is valid (> -1)."""
    mp, RL, D = c.h.mamba_pool, c.ring_len, c.h.draft_token_num
    slot = c.h.req_pool_indices
    wp = mp.replayssm_spec_write_pos.index_select(0, slot).to(torch.int64)
    base = mp.replayssm_cache_base.index_select(0, slot).to(torch.int64)
    flush = mp.replayssm_is_flush.index_select(0, slot) != 0
    n = c.accept
    new_base = torch.where((n > 0) & flush, (base + wp) & (RL - 1), base)
    new_wp = torch.where(flush, n, wp + n)
    every = c.h.commit_design.every
    if c.h.fold_every_commit:
        nxt = new_wp > 0
    elif every:  # drift's every:N cadence: a commit counter per ring slot, reset by the fold's finish
        since = mp.replayssm_commits_since_fold.index_select(0, slot).to(torch.int64) + (n > 0).to(torch.int64)
        mp.replayssm_commits_since_fold.index_copy_(0, slot, since.to(torch.int32))
        nxt = (since >= every) & (new_wp > 0)
    else:
        nxt = new_wp + 2 * D > RL
    mp.replayssm_spec_write_pos.index_copy_(0, slot, new_wp.to(torch.int32))
    mp.replayssm_cache_base.index_copy_(0, slot, new_base.to(torch.int32))
    mp.replayssm_is_flush.index_copy_(0, slot, nxt.to(torch.int8))


# ------------------------------------------------------------------------------ 2. fold
def _records(c: Commit, span: Optional[int] = None):
    """Each row's ring in logical order from ``cache_base`` (:func:`drift.flows.kernel_commit.pool.in_ring_order`, the
    kernel's circular addressing), its first ``S = span`` records (default: the ring, ``RL``): d (high +
    low where the ring has a low part, fp32) ``[L, N, HV, S, V]``, the key's high part and its low part
    (None without one; fp32, repeated over value heads) ``[L, N, HV, S, K]``, g ``[L, N, HV, S]``."""
    ss, mp = c.h.spec_state, c.h.mamba_pool
    slot = c.h.req_pool_indices
    base = mp.replayssm_cache_base.index_select(0, slot)

    def take(t):
        return None if t is None else in_ring_order(t, slot, base, span).to(F32)

    HV = ss.replayssm_g.shape[2]
    kh, kl = (None if t is None else over_value_heads(take(t), HV) for t in (ss.replayssm_k, ss.replayssm_rawk))
    d = take(ss.replayssm_d) if ss.replayssm_rawv is None else take(ss.replayssm_d) + take(ss.replayssm_rawv)
    return d, kh, kl, take(ss.replayssm_g)


def compensated_fold(old, d, kh, kl, g, length, parts: torch.dtype = BF16):
    """The compact commit's fold of a row's first ``length [N]`` records onto ``old`` fp32
    ``[L, N, HV, V, K]`` (weights: :func:`drift.flows.kernel_commit.pool.decay_weights`): the decayed update split
    into high and low parts in ``parts`` (SGLang: the ring's dtype, ``k_cache.dtype.element_ty``; bf16),
    the products with the key's parts (its low part: None when the ring keeps none) accumulated in fp32
    (``tl.dot``: 16-bit operands, fp32 accumulation). An fp32 ``parts`` leaves no low part."""
    total, decay = decay_weights(g, length)
    upd = d * decay[..., None]  # [L, N, HV, S, V]: the S records read (updates._records)
    hi = upd.to(parts).to(F32)
    in_place = _in_place(old)
    us = (hi,) if parts == F32 else (hi, (upd.sub_(hi) if in_place else upd - hi).to(parts).to(F32))
    delta = _sum_of_products([(u, k) for k in ((kh,) if kl is None else (kh, kl)) for u in us], in_place)
    return _decayed_plus(old, total, delta, in_place)


def _in_place(t: torch.Tensor) -> bool:
    """Whether a fold makes its sums in place: on host tensors, where each fresh state-sized temporary costs
    (at 45 layers and K = V = 128 one is above glibc's mmap threshold: a page fault on every page written).
    The same operations on the same operands in the same order, so the same bits; on an accelerator and
    under the sync scan's virtual device the fold runs as written, whose new outputs the trade-off table's
    bytes model counts (drift/syncs/costmodel.py: BYTES_MODEL)."""
    return on_host(t)


def _sum_of_products(products: list, in_place: bool) -> torch.Tensor:
    """``sum(contract(u, k) for u, k in products)``: Python's sum, left to right from 0; in place, the sums
    in one fp32 state-sized buffer and every later product in another."""
    if not in_place:
        return sum(contract(u, k) for u, k in products)
    delta = contract(*products[0]).add_(0)  # sum()'s start: 0 + the first term (-0.0 becomes +0.0)
    term = torch.empty_like(delta) if len(products) > 1 else None
    for u, k in products[1:]:
        delta.add_(contract(u, k, out=term))
    return delta


def _decayed_plus(old: torch.Tensor, total: torch.Tensor, delta: torch.Tensor, in_place: bool) -> torch.Tensor:
    """``old * e^{G} + delta`` (``total``: G ``[L, N, HV, 1]``), the sum in place where ``in_place``."""
    decayed = old * torch.exp(total)[..., None]
    return decayed.add_(delta) if in_place else decayed + delta


def rounded_fold(operand: Callable, old, d, kh, kl, g, length):
    """A fold whose contraction rounds both operands -- the decayed update and the key as the ring
    holds it -- with ``operand`` (the design's: TF32, bf16, or fp32 as they are), one product
    accumulated in fp32."""
    total, decay = decay_weights(g, length)
    key = kh if kl is None else kh + kl
    delta = contract(operand(d * decay[..., None]), operand(key))
    return _decayed_plus(old, total, delta, _in_place(old))


def design_fold(design) -> Callable:
    """The fold of ``design`` (drift/flows/kernel_commit/design.py): SGLang's split contraction in the
    record dtype, or the rounded-operand one."""
    if design.contraction.split:
        return lambda old, d, kh, kl, g, length: compensated_fold(old, d, kh, kl, g, length, design.records.dtype)
    return lambda old, d, kh, kl, g, length: rounded_fold(design.operand, old, d, kh, kl, g, length)


def store_fold(new: torch.Tensor, dtype: torch.dtype, rounding: str, key: int) -> torch.Tensor:
    """fp32 folded states ``[L, N, HV, V, K]`` stored in the checkpoint dtype: to nearest (a cast), or
    by stochastic rounding keyed by the step (``fold_key``) and each element's place in ``new``, so a
    row's checkpoint and its track slot get the same bits from the same values."""
    if rounding == "rne" or dtype == new.dtype:
        return new.to(dtype)
    out = torch.empty(new.shape, dtype=dtype, device=new.device)
    kernels.store_state(out, new.contiguous(), rounding, key)
    return out


def fold_checkpoints(c: Commit, fold: Optional[Callable] = None, rounding: Optional[str] = None) -> None:
    """``gdn_replayssm_compact_commit_kernel``: fold rows whose ``is_flush`` is set into their
    checkpoint and tracked rows into their track slot; other slots keep their bits. ``fold`` (default:
    the design's, :func:`design_fold`) and ``rounding`` (default: the design's fold store) replace a
    part of it (a mutant)."""
    design = c.h.commit_design
    fold = fold or design_fold(design)
    rounding = rounding or design.store_rounding
    ss, mp = c.h.spec_state, c.h.mamba_pool
    sidx, slot = c.h.state_batch_indices, c.h.req_pool_indices
    valid = sidx > NULL
    safe = torch.where(valid, sidx, torch.zeros_like(sidx))  # slot 0: the dummy, written back as it is
    n_hist = mp.replayssm_spec_write_pos.index_select(0, slot).to(torch.int64)
    active = valid & (mp.replayssm_is_flush.index_select(0, slot) != 0)
    temporal = raw_state(ss.temporal)  # the kernel addresses the checkpoint by pointer: [HV, V, K] memory order
    old_raw = temporal.index_select(1, safe)
    track_hist = None
    if c.track is not None:
        has = valid & (c.track > NULL) & (c.steps >= 0)
        track_hist = torch.clamp(n_hist - c.accept + c.steps + 1, min=0)
    rings = (ss.replayssm_d, ss.replayssm_rawv, ss.replayssm_k, ss.replayssm_rawk)
    d, kh, kl, g = _records(c, _records_folded(c.ring_len, rings, n_hist, track_hist))
    by_row = _folds_by_row(temporal.dtype, rounding, active, c.track)
    old = None if by_row else old_raw.to(F32)  # fp32 [L, N, HV, V, K]; folding by row converts the picked rows alone

    def stored(picked: torch.Tensor, hist: torch.Tensor, slots: torch.Tensor, held: Callable[[], torch.Tensor]):
        """``(slots, states)`` to write: the fold of the first ``hist [N]`` records, stored, where ``picked [N]``,
        and ``held()`` (what the slots hold) elsewhere -- or, folding by row, the picked rows' slots and folds
        alone; None when no row is picked."""
        if not by_row:
            new = store_fold(fold(old, d, kh, kl, g, hist), temporal.dtype, rounding, c.h.fold_key)
            return slots, torch.where(picked[None, :, None, None, None], new, held())
        rows = torch.nonzero(picked).flatten()
        if rows.numel() == 0:
            return None

        def pick(t, dim):
            return None if t is None else t.index_select(dim, rows)

        new = fold(pick(old_raw, 1).to(F32), pick(d, 1), pick(kh, 1), pick(kl, 1), pick(g, 1), pick(hist, 0))
        return pick(slots, 0), store_fold(new, temporal.dtype, rounding, c.h.fold_key)

    if c.track is not None:
        tslot = torch.where(has, c.track, torch.zeros_like(c.track))
        write = stored(has, track_hist, tslot, lambda: temporal.index_select(1, tslot))
        if write is not None:
            temporal.index_copy_(1, *write)
    write = stored(active, n_hist, safe, lambda: old_raw)  # the checkpoints as the commit found them
    if write is not None:
        temporal.index_copy_(1, *write)


def _records_folded(ring_len: int, rings: tuple, *lengths: Optional[torch.Tensor]) -> Optional[int]:
    """How many records of each row's ring the folds read: on host tensors (reading them is no sync) the
    longest history folded (``lengths``, int64 ``[N]`` each; at least 1, never past the ring), else None, the
    whole ring (as the kernel's grid covers it; on an accelerator and under the host-sync scan's virtual
    device). The kernel loads the whole ring and weighs records past a row's history 0: a finite record
    so weighed adds exact zeros, so over fewer records the contraction's fp32 sums add the same products in
    the same order and the folds have the same bits; a non-finite one makes the fold NaN (0 * inf), so
    where any record of ``rings`` (the ring's delta and key parts, the records that meet the zero weights;
    None where absent) is not finite the whole ring is read, as the kernel reads it (the tests:
    tests/flows/kernel_commit/test_replayssm_update.py). SGLang's default ring (16 records) folds at most D
    of them at every commit: a quarter of the ring on ci-small."""
    lengths = tuple(t for t in lengths if t is not None)
    if not on_host(*lengths):
        return None
    span = min(ring_len, max([1, *(int(t.max()) for t in lengths if t.numel())]))
    # the largest magnitude of each: NaN where one is NaN (max propagates it), inf where one is infinite (a
    # tenth of isfinite(t).all()'s time on bf16)
    if span < ring_len and not all(bool(torch.isfinite(t.abs().max())) for t in rings if t is not None):
        return None
    return span


def _folds_by_row(dtype: torch.dtype, rounding: str, *rows: Optional[torch.Tensor]) -> bool:
    """Whether a commit may fold only the rows whose checkpoint or track slot it stores to: where finding
    them is no sync -- host tensors (plain CPU ``torch.Tensor``s; on an accelerator, and under the host-sync
    scan's virtual device, every row is folded, as the kernel's grid does) -- and each row's stored fold
    has the same bits alone as in the batch: a store to nearest (a row's fold is elementwise, and one
    matrix product per row and head, its own), not a stochastic store, which draws by each element's
    place in the batch. A row is tracked once in ``track_interval`` steps: the track fold of the tracked
    rows alone is a fraction of the batch's (about half of this flow's commit, on ci-small)."""
    if not (rounding == "rne" or dtype == F32):
        return False
    return on_host(*(t for t in rows if t is not None))


# ------------------------------------------------------------------------------ 3. finish
def finish_folds(c: Commit) -> None:
    """``_finish_gdn_replayssm_circular_fold_kernel``: a folded row's ring restarts past its history."""
    mp, RL = c.h.mamba_pool, c.ring_len
    slot = c.h.req_pool_indices
    valid = c.h.state_batch_indices > NULL
    wp = mp.replayssm_spec_write_pos.index_select(0, slot)
    base = mp.replayssm_cache_base.index_select(0, slot)
    done = valid & (mp.replayssm_is_flush.index_select(0, slot) != 0)
    mp.replayssm_cache_base.index_copy_(0, slot, torch.where(done, (base + wp) & (RL - 1), base))
    mp.replayssm_spec_write_pos.index_copy_(0, slot, torch.where(done, torch.zeros_like(wp), wp))
    mp.replayssm_is_flush.index_copy_(0, slot, torch.where(done, torch.zeros_like(done, dtype=torch.int8),
                                                           mp.replayssm_is_flush.index_select(0, slot)))
    since = getattr(mp, "replayssm_commits_since_fold", None)  # drift's every:N counter
    if since is not None:
        since.index_copy_(0, slot, torch.where(done, torch.zeros_like(wp), since.index_select(0, slot)))


# ------------------------------------------------------------------------------ 4. conv
def conv_rollback(c: Commit) -> None:
    """The conv accept-rollback of the working slots; the tracked rows' verify-time window copied to
    their track slot first and rolled back to the tracked step (as the copy-commit flows)."""
    k, conv, D = sgl_kernels(), c.h.spec_state.conv[0], c.h.draft_token_num
    sidx = c.h.state_batch_indices
    dst = torch.where(sidx > NULL, sidx, torch.zeros_like(sidx))  # padded rows: the dummy, step -1 skips
    if c.track is not None:
        conv[:, c.track] = conv[:, torch.where(c.steps >= 0, dst, c.track)]
    k.conv_state_rollback(conv, dst, c.last, D)
    if c.track is not None:
        k.conv_state_rollback(conv, c.track, c.steps, D)


@dataclass(frozen=True)
class ReplayCommit:
    """The commit as its four parts (a mutant replaces one)."""

    advance: Callable = advance_cursors
    fold: Callable = fold_checkpoints
    finish: Callable = finish_folds
    conv: Callable = conv_rollback

    def but(self, **parts) -> "ReplayCommit":
        return replace(self, **parts)

    def build(self, name: str) -> Callable:
        recipe = self

        def update(self, last_correct_step_indices, mamba_track_indices=None, mamba_steps_to_track=None):
            last = last_correct_step_indices.to(torch.int64)
            track = None if mamba_track_indices is None else mamba_track_indices.to(torch.int64)
            steps = None if mamba_steps_to_track is None else mamba_steps_to_track.to(torch.int64)
            c = Commit(self, torch.clamp(last + 1, min=0), last, track, steps)  # accept_lens incl. the bonus
            recipe.advance(c)
            recipe.fold(c)
            recipe.finish(c)
            recipe.conv(c)

        update.__name__ = update.__qualname__ = name.replace("-", "_").replace(".", "")
        update.__doc__ = f"{name}: SGLang 0.5.23's ReplaySSM commit (drift/flows/kernel_commit/updates.py)."
        update.FLOW_OPTIONS = EVERY_CHOICE  # it reads the design through self.commit_design
        return update


SGLANG_0523_REPLAYSSM = ReplayCommit()
sglang_0523_replayssm = SGLANG_0523_REPLAYSSM.build("sglang-0.5.23-replayssm")
