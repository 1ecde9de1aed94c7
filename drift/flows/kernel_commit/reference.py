"""The exact reference of a ReplaySSM tracked snapshot, mid-window included (docs/semantics.md §6,
"Tracked snapshots").

SGLang 0.5.23's commit (``gdn_replayssm_compact_commit_kernel``, drift/flows/kernel_commit/updates.py)
writes a tracked row's track slot as the fold of the row's checkpoint before the commit and the first
``m = write_pos_before + step + 1`` records of its ring: the checkpoint folded to the tracked token,
wherever that token falls in the ring's window. drift keeps the checkpoints the commit starts from
(the flow's ``after_verify``) and the ring still holds the records (a fold's finish only moves
``cache_base`` past them), so the snapshot's reference is a function of the run's own bits, computed
in float64 by drift's fold (drift.flows.kernel_commit.pool.fold_records), not the update's:
``track == fold(checkpoint_before, records[0:m])``.

That is an equality in exact arithmetic. The run computes it in fp32 and stores it in the checkpoint
dtype, so an element may differ by (u = 2^-24, fp32's unit roundoff):

* the store: half an ulp of the snapshot's element in the checkpoint dtype to nearest, one ulp for a
  declared stochastic store;
* the fp32 accumulation of ``m + 1`` terms, and the fp32 exponentials and prefix sums of the decay
  weights: ``gamma_{m + 4} A`` with gamma_j = j u / (1 - j u) (Higham, Accuracy and Stability of
  Numerical Algorithms, §3.1) and ``A = e^G |h| + sum_c e^(G - G_c) |d_c| |k_c|``, the sum of the terms'
  magnitudes (computed exactly as the same fold of their absolute values);
* the contraction's products: ``2 u_op A``, ``u_op`` the design's operand rounding (2^-bits for
  rounded operands; 2^-(2 p) for SGLang's split into two parts of a p-bit record dtype; 0 for fp32),
  and, where a split part falls below the record dtype's normal range (an fp16 ring's small decayed
  deltas), ``2 t sum_c |k_c|`` with t half its subnormal spacing.

An element is outside when it differs by more than ``MARGIN`` times that sum (the bound is a worst
case: the margin only guards the calibration, tests/flows/kernel_commit/test_snapshot_reference.py,
where the largest ratio over every design stays below 1 / MARGIN of it while a snapshot one record
short is outside by orders of magnitude).
"""

from __future__ import annotations

import torch

from ...dtypes import store_dtype
from .design import CommitDesign
from .pool import ReplayPool, fold_records, gather_records

F64 = torch.float64
U32 = 2.0 ** -24  # fp32 unit roundoff
MARGIN = 4.0


def _ulp(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The spacing of a ``bits``-bit mantissa grid (the implicit bit included) at each element of x."""
    _, e = torch.frexp(x)
    return torch.where(x == 0, torch.zeros_like(x), torch.exp2((e - bits).to(x.dtype)))


def operand_unit(design: CommitDesign) -> float:
    """The relative rounding of one contraction operand in ``design``'s fold."""
    c = design.contraction
    if c.split:
        return 2.0 ** (-2 * store_dtype(design.records.dtype).mantissa_bits)
    return 0.0 if c.bits is None else 2.0 ** -c.bits


def subnormal_unit(design: CommitDesign) -> float:
    """The absolute rounding of one split part where it falls below the record dtype's normal range:
    half its subnormal spacing (fp16: 2^-25; bf16 has fp32's range, where it is negligible); 0 for a
    fold that does not split."""
    if not design.contraction.split:
        return 0.0
    fi = torch.finfo(design.records.dtype)
    return 0.5 * fi.smallest_normal * fi.eps


def snapshot_reference(pool: ReplayPool, ring_rows: torch.Tensor, wp_before: torch.Tensor, accept: torch.Tensor,
                       step: torch.Tensor, before: torch.Tensor, nv: int) -> tuple:
    """What a tracked snapshot's reference folds, gathered from the run's pool (in the run's process,
    :meth:`~drift.flows.kernel_commit.flow.KernelCommitFlow.tracked_snapshot`): ``(before, d, k, g, m)``,
    new tensors that later steps do not change.

    ring_rows int64 ``[m]`` (the rows' ring slots), wp_before ``[m]`` (their ``write_pos`` before the
    commit), accept ``[m]`` (tokens the commit accepted, the bonus included), step ``[m]`` (the tracked
    draft step); before ``[L, m, HV, V, K]``: the checkpoints the commit started from, in the checkpoint
    dtype. Returned: before; the ring's records from the first at the commit, fp32 d ``[L, m, HV, RL,
    V]``, k ``[L, m, HV, RL, K]``, g ``[L, m, HV, RL]`` (:func:`gather_records`); m int64 ``[m]``, the
    records folded to the tracked token. Read after the commit: a row that folded has its records behind
    ``cache_base`` (its ``write_pos`` is 0), one that did not ahead of it."""
    RL = pool.ring_len
    wp_before, accept, step = (t.to(torch.int64) for t in (wp_before, accept, step))
    n, m = wp_before + accept, wp_before + step + 1
    folded = (pool.write_pos.index_select(0, ring_rows) == 0) & (n > 0)
    base = pool.cache_base.index_select(0, ring_rows).to(torch.int64)
    first = torch.where(folded, base - n, base) & (RL - 1)  # the ring's first record at the commit
    return (before, *gather_records(pool, ring_rows, first, nv), m)


def snapshot_deviation(design: CommitDesign, got: torch.Tensor, reference: tuple) -> torch.Tensor:
    """Each tracked snapshot's elements against their reference, in units of the rounding the fold may
    add (float64 ``[L, m, HV, V, K]``; an element within it is at most 1): ``got [L, m, HV, V, K]``, the
    track slots the commit wrote in the checkpoint dtype, against the fold in float64 of
    :func:`snapshot_reference`'s gathered checkpoints and records."""
    before, d, k, g, m = reference
    d, k, g = (t.to(F64) for t in (d, k, g))
    h = before.to(F64)
    ref, size = fold_records(*(torch.cat((t, t.abs()), 1) for t in (h, d, k)), torch.cat((g, g), 1),
                             torch.cat((m, m))).split(len(m), 1)  # size: the terms' magnitudes, A
    got = got.to(F64)
    half = 1.0 if design.store_rounding == "stochastic" else 0.5  # of an ulp
    store = half * _ulp(got, store_dtype(design.checkpoint_dtype).mantissa_bits)
    j = (m + 4).to(F64)[None, :, None, None, None]
    live = (torch.arange(g.shape[-1], device=g.device)[None, :] < m[:, None])[None, :, None, :, None]
    keys = (k.abs() * live).sum(3)[:, :, :, None, :]  # sum_c |k_c| over the folded records [L, m, HV, 1, K]
    bound = store + (j * U32 / (1 - j * U32) + 2 * operand_unit(design)) * size + 2 * subnormal_unit(design) * keys
    err = (got - ref).abs()
    return torch.where(err == 0, torch.zeros_like(err), err / bound)


def snapshot_outside(design: CommitDesign, got: torch.Tensor, reference: tuple) -> torch.Tensor:
    """Per tracked row (:func:`snapshot_deviation`'s arguments), the elements outside ``MARGIN`` times
    the rounding the fold may add (int64 ``[m]``; 0: the snapshot is its checkpoint folded to the token)."""
    return (snapshot_deviation(design, got, reference) > MARGIN).sum((0, 2, 3, 4))
