"""State flows: how an engine keeps MTP state from one verify step to the next (docs/semantics.md §6).

Each entry of :data:`drift.config.FLOWS` names its ``kind``; :data:`FLOW_KINDS` maps it to one
class (the copy-commit base in :mod:`drift.flows.copy_commit.flow`, the in-place kind here, the
kernel-commit kind in :mod:`drift.flows.kernel_commit.flow`), which owns everything the kind decides: the state pool, the object the update under test gets as
``self`` (the harness), the verify op's arguments, the conv step, which state is "committed" (the
state the next step reads) and which slots the update may write.

* ``copy-commit`` (SGLang 0.5.23; the ``sglang`` and ``npu-accepted`` flows): the verify writes
  every token's state into a scratch buffer and ``update_mamba_state_after_mtp_verify`` copies
  the accepted one into the committed pool and rolls the conv window back
  (:class:`~drift.flows.copy_commit.flow.CopyCommitFlow`).
* ``in-place`` (vLLM 0.33.0; the ``vllm`` flow): one state cache of blocks, each request owning
  D of them; the verify writes token t's state in place into block ``idx[b, t]`` and the next step
  starts from ``idx[b, n - 1]``, n the previous step's accept count; there is no commit copy, and
  the conv window is read at offset ``n - 1`` (a lazy rollback). The code under test is the
  per-step bookkeeping that sets ``num_accepted_tokens`` and the state indices, and prefix
  caching's align copy of the state after a block-boundary token into a destination block
  (:class:`BlockPool`, :class:`BlockHarness`).
* ``kernel-commit`` (SGLang 0.5.23's ReplaySSM spec verify; the ``sglang-replayssm`` flow): the
  verify writes per-token records to a ring and the update folds the accepted ones into the
  checkpoint (:mod:`drift.flows.kernel_commit.flow`).
"""

from __future__ import annotations

import numpy as np
import torch

from ...config import FLOWS, Config
from ...dtypes import as_bits
from ...fileio import check_memory
from ...layouts import LAYOUTS
from ...sim import kernels
from ...sim.pool import STALE, StatePool
from ..copy_commit.flow import CopyCommitFlow, lacks

I32 = torch.int32
NULL_BLOCK_ID = 0  # vllm/v1/core/kv_cache_utils.py (0.33.0): block 0 is never allocated; kernels skip it


class BlockPool(StatePool):
    """vLLM's state cache (docs/semantics.md §6, vLLM 0.33.0): ``temporal`` is the cache of blocks
    ``[L, blocks, HV, V, K]`` and ``conv`` its conv cache ``[L, blocks, W, C]`` (indexed by a request's
    first block); block 0 is the NULL block (NaN: a read of it shows). Each request owns D blocks, a
    seeded permutation of the rest (``block_table [N, D]``; padded rows all NULL); spare blocks hold
    a fixed finite pattern. ``intermediate_ssm`` is the same cache as ``[L, blocks, 1, HV, V, K]``:
    the verify op's scratch is the cache itself.

    Prefix caching's align copy (docs/semantics.md §6): each request also owns one align block
    (``track_slots [R]``; ``row_track_slots [N]`` int64, padded rows NULL), numbered after all the
    others so that the request and spare blocks are those of a pool without them. It stands for
    the block-table column ``aligned // block_size - 1`` that an align copy writes when that column
    is not the running one (vLLM writes a fresh column per boundary; drift compares only the
    latest snapshot, so one block per request holds it). It starts NaN: a read before any copy shows."""

    def __init__(self, cfg: Config, device: torch.device):
        self.cfg, self.device = cfg, device
        L, R, N, D = cfg.num_layers, cfg.num_requests, cfg.num_rows, cfg.num_draft_tokens
        HV, K, V = cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim
        base = 1 + R * D + max(1, cfg.spare_slots)  # the NULL, request and spare blocks
        nblocks = base + R  # and one align block per request
        item = torch.empty(0, dtype=cfg.torch_ssm_dtype).element_size()
        check_memory(L * nblocks * (HV * V * K * item + cfg.conv_window * cfg.conv_channels * 4)
                     + L * R * HV * V * K * 8, f"the state cache of {cfg.name} ({L} layers, {nblocks} blocks)")
        layout = LAYOUTS[cfg.layout]
        self.temporal = layout.state((L, nblocks, HV), V, K, cfg.torch_ssm_dtype, device)
        self.intermediate_ssm = self.temporal.unsqueeze(2)
        self.conv = layout.conv((L, nblocks), cfg.conv_window, cfg.conv_channels, cfg.torch_conv_dtype, device)
        rng = np.random.default_rng([cfg.seed, 0x5107])
        perm = 1 + rng.permutation(base - 1)
        table = np.zeros((N, D), np.int64)
        table[:R] = perm[:R * D].reshape(R, D)
        self.block_table_host = table
        self.block_table = torch.from_numpy(table).to(device)
        self.request_slots = table[:R].reshape(-1)  # every block a request owns
        self.track_slots = np.arange(base, nblocks, dtype=np.int64)  # the align blocks
        self.spare_slots = perm[R * D:].astype(np.int64)
        self.row_slots = self.block_table[:, 0].clone()  # conv_state_indices: the first block
        trk = np.concatenate([self.track_slots, np.full(N - R, NULL_BLOCK_ID, np.int64)])
        self.row_track_slots = torch.from_numpy(trk).to(device)  # mamba_track_indices [N]
        self.active_slots = self.row_slots[:R]
        self.num_blocks = nblocks
        self._fill_sentinels()

    def _fill_sentinels(self) -> None:
        """NULL block 0 and the align blocks hold NaN; spare blocks a fixed finite pattern."""
        for b in (NULL_BLOCK_ID, *self.track_slots.tolist()):
            self.temporal[:, b] = STALE
            self.conv[:, b] = STALE
        for s in self.spare_slots.tolist():
            self.temporal[:, s] = 3.0 + s
            self.conv[:, s] = -3.0 - s

    def slot_role(self, slot: int) -> str:
        if slot == NULL_BLOCK_ID:
            return "NULL block 0"
        hit = np.argwhere(self.block_table_host == slot)
        if len(hit):
            return f"block {int(hit[0][1])} of row {int(hit[0][0])}"
        if slot in self.track_slots:
            return f"align block of row {int(np.argwhere(self.track_slots == slot)[0][0])}"
        return "spare block"


class BlockHarness:
    """What vLLM 0.33.0's per-step bookkeeping works on, for the update under test as ``self``:

    * ``num_accepted_tokens`` int32 ``[N]``: ``gpu_model_runner.num_accepted_tokens.gpu`` (what
      ``_update_states_after_model_execute`` sets from the sampled tokens) as the builder passes it
      on (``GDNAttentionMetadataBuilder.build``: padded rows 1);
    * ``spec_state_indices_tensor`` int32 ``[N, D]``: the builder's persistent buffer
      (``block_table[:, :num_spec + 1]``, padded rows ``NULL_BLOCK_ID``);
    * ``block_table`` int32 ``[N, D]``: each row's blocks (padded rows NULL);
    * ``num_spec_decodes``: the rows that decode speculatively (host int; padded rows follow them);
    * ``num_draft_tokens`` int32 ``[N]``: the drafts each row verifies besides its root token
      (``mamba_utils.stage_postprocess_inputs_to_gpu``'s ``num_draft_tokens_buf``), staged by the
      flow before each verify;
    * ``ssm_state`` ``[L, blocks, HV, V, K]`` and ``conv_state`` ``[L, blocks, W, C]``: the caches the
      align copy moves blocks of (each GDN layer's ``kv_cache``, ``mamba_utils``'s state base
      addresses), in the pool's dtypes and layout.
    """

    ATTRIBUTES = ("num_accepted_tokens", "spec_state_indices_tensor", "block_table", "num_spec_decodes",
                  "num_draft_tokens", "ssm_state", "conv_state")
    PROVIDED = (", ".join(f"self.{a}" for a in ATTRIBUTES) + " (vLLM's bookkeeping of the in-place flows, "
                "docs/semantics.md §6; an SGLang update runs under --flow "
                + " or ".join(f for f in FLOWS if FLOWS[f].kind == "copy-commit") + ")")
    HOW_TO_PROVIDE = "extend drift.flows.registry.BlockHarness"

    def __init__(self, pool: BlockPool):
        self._drift_pool = pool
        cfg = pool.cfg
        self.block_table = pool.block_table.to(I32)
        self.num_spec_decodes = cfg.num_requests
        # gpu_model_runner: num_accepted_tokens.np.fill(1) before the first decode; the prefill state
        # sits in each request's first block (non_spec_state_indices = block_table[:, 0]).
        self.num_accepted_tokens = torch.ones(cfg.num_rows, dtype=I32, device=pool.device)
        self.spec_state_indices_tensor = self.block_table.clone()
        self.num_draft_tokens = torch.full((cfg.num_rows,), cfg.num_draft_tokens - 1, dtype=I32, device=pool.device)
        self.ssm_state, self.conv_state = pool.temporal, pool.conv

    def __getattr__(self, name: str):
        return lacks(self, name, "vLLM")

    def objects(self) -> tuple:
        return (self,)


class InPlaceBlockFlow(CopyCommitFlow):
    """vLLM's in-place block flow (the ``vllm`` entry; module docstring)."""

    kind = "in-place"
    start_rule = "blocks"
    tracks = True  # prefix caching's align copy (docs/semantics.md §6: "Prefix caching, align mode")
    default_update = "vllm-0.33.0"

    def __init__(self, cfg: Config, device: torch.device):
        self.cfg = cfg
        self.pool = BlockPool(cfg, device)
        self.harness = BlockHarness(self.pool)
        N, D = cfg.num_rows, cfg.num_draft_tokens
        self.actual_seq_lengths = torch.full((N,), D, dtype=I32, device=device)
        self.scale = cfg.head_k_dim ** -0.5
        valid = np.nonzero(self.pool.block_table_host[:, 0] != NULL_BLOCK_ID)[0]
        self._valid_rows = torch.from_numpy(valid).to(device)  # fixed by the pool: no device read
        # The drafts each row verified at the last verify, the flow's own copy of what it stages into
        # the harness (tracked_snapshot decides the align destination from it, not from the harness).
        self._num_draft = torch.full((N,), D - 1, dtype=I32, device=device)

    def verify_args(self, mix, beta, g, rounding: str, key: int, drafts=None, gate=None) -> kernels.VerifyArgs:
        """vLLM's call (model_executor/layers/mamba/gdn: fused_recurrent_gated_delta_rule with
        initial_state = the cache, inplace_final_state=True, ssm_state_indices, num_accepted_tokens;
        each row's token count from cu_seqlens, here ``drafts [N]``). Stages each row's draft count
        (``drafts - 1``) into ``harness.num_draft_tokens``, as the runner stages the align copy's
        inputs before the forward (``mamba_utils.stage_postprocess_inputs_to_gpu``, 0.33.0)."""
        cfg, pool, h = self.cfg, self.pool, self.harness
        lengths = self.actual_seq_lengths if drafts is None else drafts.to(I32)
        self._num_draft.copy_(lengths - 1)
        h.num_draft_tokens.copy_(self._num_draft)
        return kernels.VerifyArgs(mix, beta, g, pool.temporal, pool.intermediate_ssm, pool.row_slots.to(I32),
                                  h.spec_state_indices_tensor, h.num_accepted_tokens, lengths,
                                  cfg.num_k_heads, cfg.num_v_heads, self.scale, rounding, key, start_rule="blocks",
                                  gate_inputs=gate)

    def after_verify(self, last: torch.Tensor) -> None:
        pass  # the accept count is the update's business here

    def conv_verify(self, x: torch.Tensor, weight: torch.Tensor, drafts=None) -> torch.Tensor:
        """vLLM's causal_conv1d_update with num_accepted_tokens (docs/semantics.md §6): read at offset
        ``n - 1`` of the conv cache of each row's first block; rows on the NULL block are skipped;
        a row verifying fewer than D tokens (``drafts``) writes that many."""
        h = self.harness
        slots = h.spec_state_indices_tensor[:, 0].to(torch.int64)
        offset = (h.num_accepted_tokens.to(torch.int64) - 1).clamp(min=0)
        return kernels.conv_verify_at(self.pool.conv, slots, offset, x, weight, self._valid_rows, drafts)

    def load_start(self, stored: torch.Tensor, window: torch.Tensor) -> None:
        """Prefill leaves the state in each request's first block (non_spec_state_indices =
        block_table[:, 0]) and the last Kc-1 inputs in the first Kc-1 columns of its conv cache
        (causal_conv1d_fn's state_len = width - 1); the other columns stay NaN (a read shows)."""
        cfg, pool = self.cfg, self.pool
        first = pool.block_table[: cfg.num_requests, 0]
        pool.states[:, first] = stored
        Km1 = cfg.conv_kernel - 1
        buf = torch.full((cfg.num_layers, cfg.num_requests, cfg.conv_window, cfg.conv_channels), STALE,
                         dtype=pool.conv.dtype, device=pool.device)
        buf[:, :, :Km1] = window.to(pool.device, pool.conv.dtype)
        pool.conv[:, first] = buf

    def touched(self, track_host: np.ndarray, drafts_host: np.ndarray | None = None) -> np.ndarray:
        """``[count, blocks]`` bool: the blocks the update may write at each step: only the align
        destination of a row tracked that step (:meth:`align_destinations`); every other block must
        stay as the verify left it. ``track_host``, ``drafts_host`` ``[count, R]`` host int (the
        step to track or -1; the tokens each row verifies, all D when None)."""
        t = np.zeros((track_host.shape[0], self.pool.num_blocks), dtype=bool)
        if drafts_host is None:
            drafts_host = np.full(track_host.shape, self.cfg.num_draft_tokens, np.int64)
        steps, rows = np.nonzero(track_host >= 0)
        dest = self.align_destinations(rows, track_host[steps, rows], drafts_host[steps, rows] - 1)
        t[steps, dest] = True
        return t

    def align_destinations(self, rows: np.ndarray, steps, num_draft):
        """The block an align copy writes for each of ``rows`` [n] tracked at draft ``steps`` [n]
        (the accept-token bias) with ``num_draft`` [n] drafts (host arrays, or device tensors): the
        running block ``block_table[r, 0]`` when the boundary is the row's last verified token
        (vLLM's ``src_block_idx == dest_block_idx``: ``aligned == num_computed + num_scheduled``),
        else the row's align block. Host in, host out; device in, device out (no sync)."""
        pool = self.pool
        if isinstance(steps, torch.Tensor):
            r = torch.from_numpy(np.asarray(rows, np.int64)).to(pool.device)
            return torch.where(steps == num_draft, pool.block_table[r, 0], pool.row_track_slots[r])
        return np.where(steps == num_draft, pool.block_table_host[rows, 0], pool.track_slots[rows])

    def tracked_snapshot(self, track: np.ndarray) -> tuple:
        """What the align copy left for the rows tracked this step (``track [R]`` host int, -1 =
        none): ``(rows [n], states [L, n, HV, V, K], windows [L, n, Kc-1, C], bit mismatches [n] of
        each state against block ``block_table[r, step]``, where the verify stored the state after
        the boundary token)``; the window is the first Kc-1 columns of the destination's conv cache."""
        cfg, pool = self.cfg, self.pool
        rows = np.nonzero(track >= 0)[0]
        rows_t = torch.from_numpy(rows).to(pool.device)
        steps = torch.from_numpy(track[rows]).to(pool.device)
        dest = self.align_destinations(rows, steps, self._num_draft[rows_t].to(torch.int64))
        got = pool.states[:, dest]  # [L, n, HV, V, K] in the state dtype
        held = pool.states[:, pool.block_table[rows_t, steps]]
        bits_bad = (as_bits(got) != as_bits(held)).sum((0, 2, 3, 4))
        return rows, got.clone(), pool.conv[:, dest, :cfg.conv_kernel - 1].clone(), bits_bad

    def _next_start(self) -> tuple[torch.Tensor, torch.Tensor]:
        R, h = self.cfg.num_requests, self.harness
        n = h.num_accepted_tokens[:R].to(torch.int64)
        idx = h.spec_state_indices_tensor[:R].to(torch.int64)
        return idx, (n - 1).clamp(min=0)

    def committed_states(self) -> torch.Tensor:
        """The block each request's next verify starts from: ``idx[r, n_r - 1]`` as the update left them."""
        idx, j = self._next_start()
        return self.pool.states[:, idx.gather(1, j[:, None]).squeeze(1)]

    def committed_windows(self) -> torch.Tensor:
        """The Kc-1 conv inputs the next verify reads: columns ``n - 1 .. n + Kc - 3`` of the conv cache
        of each request's first block."""
        cfg = self.cfg
        idx, j = self._next_start()
        Km1 = cfg.conv_kernel - 1
        cols = j[:, None] + torch.arange(Km1, device=j.device)  # [R, Kc-1]
        win = self.pool.conv[:, idx[:, 0]]  # [L, R, W, C]
        return win.gather(2, cols[None, :, :, None].expand(win.shape[0], -1, -1, win.shape[3]))

    def buffers(self) -> list[torch.Tensor]:
        h = self.harness
        return [h.num_accepted_tokens, h.spec_state_indices_tensor, h.num_draft_tokens, self._num_draft]

    def state_dict(self) -> dict:
        h = self.harness
        return {"num_accepted_tokens": h.num_accepted_tokens.cpu().clone(),
                "spec_state_indices": h.spec_state_indices_tensor.cpu().clone()}

    def load_state_dict(self, state: dict) -> None:
        self.harness.num_accepted_tokens.copy_(state["num_accepted_tokens"])
        self.harness.spec_state_indices_tensor.copy_(state["spec_state_indices"])
