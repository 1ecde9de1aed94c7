"""SGLang 0.5.23's ReplaySSM pool (docs/semantics.md §6): the checkpoint, conv windows, the ring of
per-token records and its cursors (:class:`ReplayPool`), what the commit path reads
(:class:`ReplayHarness`), and the ring's reads: its circular order, the decay weights and the fold
of records into a state. Read from ``sglang/srt/mem_cache/memory_pool.py: MambaPool`` (ring shapes
and dtypes; no ``intermediate_ssm``: "the verify kernel never writes per-draft snapshots") and
``sglang/kernels/ops/attention/linear/gdn_replayssm_spec_decode.py`` (the cursors' addressing)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch

from ...config import Config
from ...devices import on_host
from ...fileio import check_memory
from ...sim.pool import StatePool
from ..base import Harness
from ..slots import MambaSlots
from .design import CommitDesign, ring_length  # noqa: F401  (ring_length: the pool's ring, here too)

F32, BF16, I32 = torch.float32, torch.bfloat16, torch.int32
NULL_SLOT = -1  # spec_utils.py: null_block_id=-1, "SGLang: valid slots >= 0, padding == -1"


class ReplayPool(StatePool):
    """The checkpoint ``temporal`` and conv windows of :class:`StatePool` (no verify scratch), and the
    ring, one slot per request plus one for padded rows (``num_slots = spec_state_size + 1``), in the
    run's design (``design``, :class:`~drift.flows.kernel_commit.design.CommitDesign`; SGLang 0.5.23's
    by default):

    ``ring_d`` ``[L, R + 1, HV, RL, V]`` and ``ring_k`` ``[L, R + 1, H, RL, K]`` in the record dtype
    (``replayssm_d`` / ``replayssm_k``); their low parts ``ring_d_lo`` / ``ring_k_lo`` (``replayssm_rawv``
    / ``replayssm_rawk``), allocated only for a ring whose records have one (SGLang: when the ring dtype
    is not fp32, memory_pool.py), else None; ``ring_g`` fp32 ``[L, R + 1, HV, RL]`` (``replayssm_g``);
    cursors ``write_pos`` int32, ``cache_base`` int32, ``is_flush`` int8 ``[R + 1]``, and under an
    ``every:N`` cadence drift's ``commits_since_fold`` int32 ``[R + 1]`` (else None). Batch rows:
    ``state_indices`` int64 ``[N]`` (the request's checkpoint slot; padded rows -1) and
    ``replay_indices`` int64 ``[N]`` (its ring slot; padded rows the spare one)."""

    def __init__(self, cfg: Config, device: torch.device):
        L, R, N = cfg.num_layers, cfg.num_requests, cfg.num_rows
        H, HV, K, V = cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim
        self.design = design = CommitDesign.of(cfg)
        self.ring_len = RL = design.ring_len
        rec, parts = design.records.dtype, 2 if design.records.low_part else 1
        check_memory(L * (R + 1) * RL * (parts * rec.itemsize * (HV * V + H * K) + 4 * HV),
                     f"the ReplaySSM ring of {cfg.name} ({L} layers, {R + 1} slots of {RL} records)")
        super().__init__(cfg, device, scratch=False)
        self.ring_d = torch.zeros((L, R + 1, HV, RL, V), dtype=rec, device=device)
        self.ring_d_lo = torch.zeros_like(self.ring_d) if design.records.low_part else None
        self.ring_k = torch.zeros((L, R + 1, H, RL, K), dtype=rec, device=device)
        self.ring_k_lo = torch.zeros_like(self.ring_k) if design.records.low_part else None
        self.ring_g = torch.zeros((L, R + 1, HV, RL), dtype=F32, device=device)
        self.write_pos = torch.zeros(R + 1, dtype=I32, device=device)
        self.cache_base = torch.zeros(R + 1, dtype=I32, device=device)
        self.is_flush = torch.zeros(R + 1, dtype=torch.int8, device=device)
        self.commits_since_fold = torch.zeros(R + 1, dtype=I32, device=device) if design.every else None
        live = torch.arange(N, device=device) < R
        self.state_indices = torch.where(live, self.row_slots, torch.full_like(self.row_slots, NULL_SLOT))
        self.replay_indices = torch.clamp(torch.arange(N, dtype=torch.int64, device=device), max=R)
        # Each lane's ring slot (the fixed batch: lane r's row r; under churn its request's request-pool row).
        self.lane_ring_rows = self.replay_indices[:R].clone()

    def ring_tensors(self) -> dict[str, torch.Tensor]:
        """The ring and its cursors by name (those the design allocates)."""
        named = {"ring_d": self.ring_d, "ring_d_lo": self.ring_d_lo, "ring_k": self.ring_k,
                 "ring_k_lo": self.ring_k_lo, "ring_g": self.ring_g, "write_pos": self.write_pos,
                 "cache_base": self.cache_base, "is_flush": self.is_flush,
                 "commits_since_fold": self.commits_since_fold}
        return {name: t for name, t in named.items() if t is not None}


class ReplaySlots(MambaSlots):
    """SGLang 0.5.23's bookkeeping under the spec ring (``--enable-linear-replayssm-spec``): the ring and its
    cursors belong to the request-pool row (``replay_indices = req_pool_indices``), and
    ``HybridReqToTokenPool.alloc`` zeroes a freshly handed-out row's cursors
    (``srt/mem_cache/memory_pool.py``: ``spec_write_pos.index_fill_(0, fresh_rows, 0)``, and
    ``replayssm_cache_base`` / ``replayssm_is_flush`` likewise); ``copy_from`` touches neither ring nor
    cursors, and nothing resets them at free (docs/semantics.md §12)."""

    def fresh_row(self, row: int) -> None:
        pool = self.pool
        for cursor in (pool.write_pos, pool.cache_base, pool.is_flush):
            cursor.index_fill_(0, torch.tensor([row], device=cursor.device), 0)
        if pool.commits_since_fold is not None:  # drift's own counter of the every:N cadence, with the cursors
            pool.commits_since_fold.index_fill_(0, torch.tensor([row], device=pool.device), 0)


class ReplayHarness(Harness):
    """What SGLang 0.5.23's ReplaySSM commit path reads (``spec_utils.py:
    commit_mamba_states_after_verify``), for the update under test as ``self``:

    * ``spec_state``: ``.temporal`` (the checkpoint ``[L, slots, HV, V, K]``), ``.conv`` (a list of
      ``[L, slots, W, C]``), ``.replayssm_d`` / ``.replayssm_rawv`` / ``.replayssm_k`` /
      ``.replayssm_rawk`` / ``.replayssm_g`` (the ring, :class:`ReplayPool`);
    * ``mamba_pool``: ``.replayssm_spec_write_pos``, ``.replayssm_cache_base``, ``.replayssm_is_flush``;
    * ``state_batch_indices`` int64 ``[N]`` (``req_pool.get_mamba_indices``; padded rows -1),
      ``req_pool_indices`` int64 ``[N]`` (the ring slots, ``replay_indices``);
    * ``draft_token_num`` (host int) and ``fold_every_commit`` (host bool: SGLang's ``temporal.dtype !=
      float32``, or the declared cadence's "every commit");

    and drift's own: ``commit_design`` (the run's :class:`~drift.flows.kernel_commit.design.CommitDesign`:
    ring records, fold contraction, fold cadence, checkpoint dtype, fold store rounding; SGLang 0.5.23's
    by default), ``fold_key`` (host int: the step's key of a declared stochastic fold store) and, under
    an ``every:N`` cadence, ``mamba_pool.replayssm_commits_since_fold``. SGLang's own commit reads
    neither; the low-part rings are None where the design has none (as SGLang's pool leaves them for
    an fp32 ring).
    """

    ATTRIBUTES = ("spec_state", "mamba_pool", "state_batch_indices", "req_pool_indices", "draft_token_num",
                  "fold_every_commit", "commit_design")
    PROVIDED = (", ".join(f"self.{a}" for a in ATTRIBUTES)
                + " (SGLang's ReplaySSM commit path, docs/semantics.md §6)")
    HOW_TO_PROVIDE = "extend drift.flows.kernel_commit.pool.ReplayHarness"

    def __init__(self, pool: ReplayPool):
        self._drift_pool = pool
        self.spec_state = SimpleNamespace(temporal=pool.temporal, conv=[pool.conv], replayssm_d=pool.ring_d,
                                          replayssm_rawv=pool.ring_d_lo, replayssm_k=pool.ring_k,
                                          replayssm_rawk=pool.ring_k_lo, replayssm_g=pool.ring_g)
        self.mamba_pool = SimpleNamespace(replayssm_spec_write_pos=pool.write_pos,
                                          replayssm_cache_base=pool.cache_base, replayssm_is_flush=pool.is_flush)
        if pool.commits_since_fold is not None:
            self.mamba_pool.replayssm_commits_since_fold = pool.commits_since_fold
        self.state_batch_indices = pool.state_indices
        self.req_pool_indices = pool.replay_indices
        self.draft_token_num = pool.cfg.num_draft_tokens
        self.commit_design = pool.design
        self.fold_every_commit = pool.design.folds_every_commit
        self.fold_key = 0

    def objects(self) -> tuple:
        return (self, self.spec_state, self.mamba_pool)


# ------------------------------------------------------------------------------- ring reads
def in_ring_order(t: torch.Tensor, slots: torch.Tensor, base: torch.Tensor, span: Optional[int] = None) -> torch.Tensor:
    """A ring tensor ``[L, ring slots, h, RL, ...]`` read for rows in ``slots`` (int64 ``[B]``) in
    logical order: record c of row b is at position ``(base[b] + c) & (RL - 1)`` (the cursors'
    circular addressing). Returns ``[L, B, h, S, ...]`` in ``t``'s dtype (a gather, not a view): each
    row's first ``S = span`` records (default: the whole ring, ``RL``)."""
    RL = t.shape[3]
    S = RL if span is None else span
    phys = (base.to(torch.int64)[:, None] + torch.arange(S, device=base.device)) & (RL - 1)  # [B, S]
    rows = t.index_select(1, slots)
    idx = phys[None, :, None, :].expand(rows.shape[0], -1, rows.shape[2], -1)
    if rows.dim() == 5:
        idx = idx[..., None].expand(*idx.shape, rows.shape[4])
    return rows.gather(3, idx)


def over_value_heads(k: torch.Tensor, nv: int) -> torch.Tensor:
    """Key-head records ``[L, B, H, RL, K]`` repeated over each key head's value-head group: ``[L, B, nv, RL, K]``."""
    group = nv // k.shape[2]
    return k.repeat_interleave(group, dim=2) if group > 1 else k


def decay_weights(g: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For a row's first ``length`` records (int ``[B]``) of log-decays ``g [L, B, HV, RL]``: the total
    ``G`` ``[L, B, HV, 1]`` and each record's weight ``e^{G - G_c}`` (``G_c`` the inclusive prefix
    sum; 0 past ``length``) ``[L, B, HV, RL]``, in fp32."""
    RL = g.shape[-1]
    live = (torch.arange(RL, device=g.device)[None, :] < length.to(torch.int64)[:, None])[None, :, None, :]
    gm = torch.where(live, g, torch.zeros_like(g))
    prefix = torch.cumsum(gm, -1)
    total = prefix[..., -1:]
    return total, torch.where(live, torch.exp(total - prefix), torch.zeros_like(g))


def record_values(hi: torch.Tensor, lo) -> torch.Tensor:
    """A record as fp32: its high part plus its low part where the ring has one (the sum is exact:
    both in the record dtype, the low part below the high part's last bit)."""
    return hi.to(F32) if lo is None else hi.to(F32) + lo.to(F32)


def gather_records(pool: ReplayPool, replay: torch.Tensor, base: torch.Tensor, nv: int):
    """Each row's ring in logical order (:func:`in_ring_order`), in fp32 (:func:`record_values`): d
    ``[L, B, HV, RL, V]``, k ``[L, B, HV, RL, K]`` (key heads repeated over their value-head group), g
    ``[L, B, HV, RL]``."""
    def take(t):
        return None if t is None else in_ring_order(t, replay, base)

    d = record_values(take(pool.ring_d), take(pool.ring_d_lo))
    k = record_values(take(pool.ring_k), take(pool.ring_k_lo))
    return d, over_value_heads(k, nv), take(pool.ring_g)


def fold_records(h0: torch.Tensor, d: torch.Tensor, k: torch.Tensor, g: torch.Tensor,
                 length: torch.Tensor) -> torch.Tensor:
    """``e^{G} h0 + sum_{c < length} e^{G - G_c} d_c k_c^T`` in fp32 (:func:`decay_weights`): the state
    after a row's first ``length`` records. h0 ``[L, B, HV, V, K]`` fp32; d, k, g from
    :func:`gather_records`; length int ``[B]``. A row with length 0 gets h0 exactly."""
    total, w = decay_weights(g, length)
    return h0 * torch.exp(total)[..., None] + contract(d * w[..., None], k)


def contract(u: torch.Tensor, k: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``sum_c u_c k_c^T`` per row and head: u ``[L, B, HV, RL, V]``, k ``[L, B, HV, RL, K]`` ->
    ``[L, B, HV, V, K]``: ``einsum("lbhcv,lbhck->lbhvk")``'s one batched product (the same bits and
    the same bytes) without einsum's dispatch, a tenth of a millisecond a call at ci-small's size.
    ``out``: a contiguous fp32 ``[L, B, HV, V, K]`` to write it into (the same product), returned."""
    a, b = u.flatten(0, 2).transpose(1, 2), k.flatten(0, 2)
    if out is not None:
        torch.bmm(a, b, out=out.view(-1, u.shape[4], k.shape[4]))
        return out
    return torch.bmm(a, b).view(*u.shape[:3], u.shape[4], k.shape[4])


def effective_states(pool: ReplayPool, replay: torch.Tensor, slots: torch.Tensor, nv: int) -> torch.Tensor:
    """fp32 ``[L, B, HV, V, K]``: what a row's verify starts from -- its checkpoint with the records
    still in its ring (``write_pos`` of them) folded in. Rows with an empty ring get the checkpoint
    exactly; on plain CPU tensors a batch whose rings are all empty skips the fold."""
    h0 = pool.states.index_select(1, slots).to(F32)
    wp = pool.write_pos.index_select(0, replay)
    if on_host(wp) and int(wp.max()) == 0:  # host tensors: reading them is no sync
        return h0
    d, k, g = gather_records(pool, replay, pool.cache_base.index_select(0, replay), nv)
    return fold_records(h0, d, k, g, wp)


def put_records(ring: torch.Tensor, slot: torch.Tensor, phys: torch.Tensor, store: torch.Tensor, val: torch.Tensor) -> None:
    """``ring[:, slot[b, t], :, phys[b, t]] = val[:, b, t]`` where ``store[b, t]``, without a host read:
    a position not stored gets back what it holds. ring ``[L, slots, h, RL, ...]``; val ``[L, B, S, h, ...]``."""
    view = ring.movedim(3, 2)  # [L, slots, RL, h, ...]
    held = view[:, slot, phys]  # [L, B, S, h, ...]
    mask = store.view(1, *store.shape, *([1] * (val.dim() - 3)))
    view[:, slot, phys] = torch.where(mask, val.to(ring.dtype), held)
