"""The kernel-commit state flow: SGLang 0.5.23's ReplaySSM spec verify (docs/semantics.md §6).

With ``--enable-linear-replayssm-spec`` (GDN, a linear draft chain, CUDA Triton; NPU and CPU fall
back to the recurrent verify) SGLang keeps no per-token states. The verify kernel writes, for
every draft token, a compact record into a per-request ring: the delta ``d`` (``S <- e^g S + k
d^T``) and the L2-normalised key ``k``, each as a bf16 high part plus a bf16 low part, and the
log-decay ``g`` in fp32. The update under test only advances the ring's cursors and folds the
accepted records into the checkpoint (``temporal``); a rejected draft is rolled back by not
advancing past it. Read from the wheel:

* ``sglang/kernels/ops/attention/linear/gdn_replayssm_spec_decode.py``:
  ``gdn_replayssm_spec_circular_kernel`` (the verify, ``launch_mode="verify"``),
  ``commit_gdn_replayssm_spec`` / ``_advance_gdn_spec_cursors_kernel`` (cursors),
  ``commit_gdn_replayssm_circular`` / ``gdn_replayssm_compact_commit_kernel`` /
  ``_finish_gdn_replayssm_circular_fold_kernel`` (the fold and the ring reset);
* ``sglang/srt/speculative/spec_utils.py: commit_mamba_states_after_verify`` (the commit path:
  ``fold_every_commit = temporal.dtype != float32``, ``null_block_id=-1``);
* ``sglang/srt/layers/attention/linear/gdn_backend.py: _replayssm_target_verify`` (the call);
* ``sglang/srt/mem_cache/memory_pool.py: MambaPool`` (ring shapes and dtypes; no
  ``intermediate_ssm``: "the verify kernel never writes per-draft snapshots").

That is SGLang 0.5.23's design; the kind's options (``OPTIONS``: ring records, fold contraction,
fold cadence; drift/flows/kernel_commit/design.py) choose others, each judged by its own bound.

drift: :class:`~drift.flows.kernel_commit.pool.ReplayPool` (checkpoint, conv, ring, cursors; the ring
starts empty: prefill leaves no records), :class:`~drift.flows.kernel_commit.pool.ReplayHarness` (what
the commit path reads), :class:`~drift.flows.kernel_commit.rule.RingRule` (the verify's reads and
records around the recurrent op's maths) and :class:`KernelCommitFlow`. The update under test is
``sglang-0.5.23-replayssm`` (drift/flows/kernel_commit/updates.py).
"""

from __future__ import annotations

import numpy as np
import torch

from ...config import Config
from ...dtypes import as_bits
from ...sim import kernels
from ..base import MambaPoolFlow
from ..fold_model import FoldRounding, FoldSchedule
from .reference import snapshot_outside, snapshot_reference
from ..registry import FLOW_KINDS, FLOWS
from . import design, naive
from .pool import NULL_SLOT, ReplayHarness, ReplayPool, ReplaySlots, effective_states
from .rule import RingRule

I32 = torch.int32


class KernelCommitFlow(MambaPoolFlow):
    """SGLang 0.5.23's ReplaySSM flow (the ``sglang-replayssm`` flow; module docstring). The conv
    window is kept and rolled back as in the copy-commit flows: SGLang's path keeps the usual conv
    accept-rollback ("skip only the SSM scatter", spec_utils.py)."""

    name = "kernel-commit"
    RULE, POOL, HARNESS = RingRule, ReplayPool, ReplayHarness
    SERVES = True  # requests come and go through SGLang 0.5.23's bookkeeping (drift/flows/slots.py)
    naive_update = staticmethod(naive.update)
    naive = staticmethod(naive.verify)
    OPTIONS = design.OPTIONS
    OPTION_TITLES = design.OPTION_TITLES
    TRADEOFF_DESIGNS = design.TRADEOFF_DESIGNS
    NIGHTLY_DESIGNS = design.NIGHTLY_DESIGNS
    STATE_BYTES = ("per active request and layer: read the checkpoint (the verify's start), write D records "
                   "(delta and key in the design's record dtype -- SGLang's: a bf16 high and low part each -- "
                   "and the fp32 log-decay), then the fold: read the D records and the checkpoint, write the "
                   "checkpoint, in the state dtype")

    @classmethod
    def bench_state_bytes(cls, cfg) -> dict[str, int]:
        rows, D = cfg.num_requests * cfg.num_layers, cfg.num_draft_tokens
        state = rows * cfg.num_v_heads * cfg.head_k_dim * cfg.head_v_dim * cfg.torch_ssm_dtype.itemsize
        per = design.CommitDesign.of(cfg).records.record_bytes
        record = rows * (per * (cfg.num_v_heads * cfg.head_v_dim + cfg.num_k_heads * cfg.head_k_dim) + 4 * cfg.num_v_heads)
        return {"checkpoint_read": state, "records_write": D * record, "fold": D * record + 2 * state}

    DESIGN_TRAFFIC = ("per step, summed over layers and active requests, in the design's storage dtypes: ring -- "
                      "the verify writes D records (delta HV x V, key HK x K in the record dtype, both parts "
                      "where it keeps a low part; g HV fp32) and reads the records still in the ring; "
                      "checkpoint -- the verify reads it; fold -- a folding row's commit reads its records "
                      "and its checkpoint and writes the checkpoint (tracked rows' extra folds not counted)")

    @classmethod
    def design_traffic(cls, cfg: Config, accept: np.ndarray) -> dict[str, float]:
        d = design.CommitDesign.of(cfg)
        rec = d.records.record_bytes
        record = rec * (cfg.num_v_heads * cfg.head_v_dim + cfg.num_k_heads * cfg.head_k_dim) + 4 * cfg.num_v_heads
        state = cfg.num_v_heads * cfg.head_v_dim * cfg.head_k_dim * cfg.torch_ssm_dtype.itemsize
        schedule = FoldSchedule(d.fold_rounding(), accept.shape[1])
        pending = folded = folds = 0
        for a in np.asarray(accept, np.int64):
            pending += int(schedule.records.sum())  # what each verify reads back, before this step's
            before = schedule.records + a
            f = schedule.step(a)
            folded += int(before[f].sum())
            folds += int(f.sum())
        steps, layers = max(len(accept), 1), cfg.num_layers
        ring = layers * (cfg.num_requests * cfg.num_draft_tokens * record + pending * record / steps)
        return {"ring": ring, "checkpoint": layers * cfg.num_requests * state,
                "fold": layers * (folded * record + folds * 2 * state) / steps}

    def __init__(self, cfg: Config, device: torch.device):
        super().__init__(cfg, device)
        N, D = cfg.num_rows, cfg.num_draft_tokens
        self._last = torch.full((N,), -1, dtype=torch.int64, device=device)
        # What each commit starts from, the reference of its tracked snapshots (reference.py): the ring's
        # cursors and, where the run tracks, each lane's checkpoint.
        self._wp_before = torch.zeros_like(self.pool.write_pos)
        self._before = (torch.zeros_like(self.pool.states.index_select(1, self.pool.active_slots))
                        if cfg.track_interval > 0 else None)
        # The recurrent op's index arguments, which the ring rule does not read (its rows are the pool's).
        self._indices = (self.pool.state_indices.to(I32), torch.zeros((N, D), dtype=I32, device=device),
                         torch.ones(N, dtype=I32, device=device), torch.full((N,), D, dtype=I32, device=device))

    def make_rule(self) -> RingRule:
        return RingRule(self.pool)

    @classmethod
    def validate(cls, cfg: Config) -> None:
        """The design's rules (:meth:`drift.flows.kernel_commit.design.CommitDesign.of`): its verify
        stores no state, so the store rounding is the fold's -- to nearest, or stochastic declared for
        a bf16 checkpoint -- and a cadence must leave the ring room for the verify's records."""
        design.CommitDesign.of(cfg)

    @classmethod
    def fold_rounding(cls, cfg: Config) -> FoldRounding:
        return design.CommitDesign.of(cfg).fold_rounding()

    def verify_args(self, mix, beta, g, rounding: str, key: int, drafts=None, gate=None) -> kernels.VerifyArgs:
        cfg, pool = self.cfg, self.pool
        B = mix.shape[1]  # the step's rows: every row, or its graph bucket
        self.harness.fold_key = key  # the step's key: a declared stochastic fold store draws its noise from it
        return kernels.VerifyArgs(mix, beta, g, pool.temporal, pool.intermediate_ssm, *(t[:B] for t in self._indices),
                                  cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim ** -0.5, rounding, key,
                                  rule=self.rule, gate_inputs=gate)

    def after_verify(self, last: torch.Tensor) -> None:
        self._last[: last.shape[0]].copy_(last)  # the accepted steps: which tracked rows must equal their checkpoint
        self._last[last.shape[0]:] = -1
        self._wp_before.copy_(self.pool.write_pos)  # the commit's starting point: its snapshots' reference
        if self._before is not None:
            self._before.copy_(self.pool.states.index_select(1, self.pool.active_slots))

    def committed_states(self) -> torch.Tensor:
        """The state each request's next verify starts from: its checkpoint, with any records still in
        its ring folded in (none after a fold-every-commit step), in the state dtype."""
        pool = self.pool
        h = effective_states(pool, pool.lane_ring_rows, pool.active_slots, self.cfg.num_v_heads)
        return h.to(pool.temporal.dtype)

    # ------------------------------------------------------------ a churning lifecycle (docs/semantics.md §12)
    SLOTS = ReplaySlots  # SGLang's bookkeeping, a fresh request row's spec cursors zeroed

    def admit(self, lane: int, request: int, start) -> None:
        super().admit(lane, request, start)
        self.pool.lane_ring_rows[lane] = self.held[lane].row

    def serving_buffers(self) -> dict[str, torch.Tensor]:
        pool = self.pool
        return {**super().serving_buffers(), "lane_ring_rows": pool.lane_ring_rows, "state_indices": pool.state_indices,
                "replay_indices": pool.replay_indices, "op_cache_indices": self._indices[0]}

    def load_serving_state_dict(self, st: dict) -> None:
        super().load_serving_state_dict(st)
        B, h, pool = self.rows, self.harness, self.pool
        h.state_batch_indices, h.req_pool_indices = pool.state_indices[:B], pool.replay_indices[:B]

    def arranged(self, lanes_of_rows: np.ndarray, moved_from: np.ndarray) -> None:
        """The spec verify's and the commit's indices per row (``_replayssm_target_verify``: ``ssm_state_indices
        = cache_indices``, -1 for padded rows; ``replay_indices = req_pool_indices``, row 0 for padded rows),
        handed to the commit for this step's rows."""
        pool, h, B = self.pool, self.harness, len(lanes_of_rows)
        live = torch.from_numpy(np.concatenate([lanes_of_rows >= 0, np.zeros(self.cfg.num_rows - B, bool)]))
        live = live.to(pool.device)
        rows = np.zeros(self.cfg.num_rows, np.int64)
        rows[:B][lanes_of_rows >= 0] = [self.held[int(lane)].row for lane in lanes_of_rows[lanes_of_rows >= 0]]
        pool.state_indices.copy_(torch.where(live, pool.row_slots, torch.full_like(pool.row_slots, NULL_SLOT)))
        pool.replay_indices.copy_(torch.from_numpy(rows))
        self._indices[0].copy_(pool.state_indices.to(I32))
        h.state_batch_indices, h.req_pool_indices = pool.state_indices[:B], pool.replay_indices[:B]

    def tracked_snapshot(self, track: np.ndarray) -> tuple:
        """What the track slots hold. The run held no per-token state to compare bits with; where a
        row was tracked at its last accepted step under fold-every-commit, SGLang's commit folds the
        same records into both slots with the same code, so the track slot must equal the new
        checkpoint bit for bit. Every snapshot, mid-window included, must also agree with its exact
        reference -- the fold, in float64, of the run's own checkpoint and ring records to the tracked
        token, within the rounding the fold may add: the reference's inputs are gathered here
        (:func:`~drift.flows.kernel_commit.reference.snapshot_reference`) and folded where the comparison
        runs (:meth:`reference_mismatches`), unless the verify keeps its records outside drift's ring
        (``RingRule.records_elsewhere``). Both count as bits that differ from what the run held."""
        pool = self.pool
        rows = np.nonzero(track >= 0)[0]  # lanes
        rows_t = torch.from_numpy(rows).to(pool.device)
        tslots, windows = self.track_windows(rows_t)
        got = pool.states.index_select(1, tslots)
        batch_rows = torch.from_numpy(self.lane_rows_host[rows]).to(pool.device)
        last, step = self._last.index_select(0, batch_rows), torch.from_numpy(track[rows]).to(pool.device)
        same_step = (last == step) & torch.tensor(self.harness.fold_every_commit, device=pool.device)
        ckpt = pool.states[:, pool.active_slots[rows_t]]
        bits_bad = ((as_bits(got) != as_bits(ckpt)).sum((0, 2, 3, 4)) * same_step).to(torch.int64)
        reference = None
        if not self.rule.records_elsewhere:  # a verify keeping its own records leaves drift's ring nothing to fold
            ring_rows = pool.lane_ring_rows.index_select(0, rows_t)
            reference = snapshot_reference(pool, ring_rows, self._wp_before.index_select(0, ring_rows), last + 1, step,
                                           self._before.index_select(1, rows_t), self.cfg.num_v_heads)
        return rows, got, windows, bits_bad, reference

    def reference_mismatches(self, states: torch.Tensor, reference: tuple) -> torch.Tensor:
        """Per snapshot, its elements outside its exact reference (:func:`~drift.flows.kernel_commit.reference.
        snapshot_outside`; int64 ``[n]``)."""
        return snapshot_outside(self.pool.design, states, reference)

    def buffers(self) -> list[torch.Tensor]:
        extra = [self._wp_before] + ([self._before] if self._before is not None else [])
        return [self._last, *extra, *self.pool.ring_tensors().values()]

    def state_dict(self) -> dict:
        return {name: t.cpu().clone() for name, t in self.pool.ring_tensors().items()}

    def load_state_dict(self, state: dict) -> None:
        for name, t in self.pool.ring_tensors().items():
            t.copy_(state[name])
