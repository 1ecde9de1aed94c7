"""vLLM 0.33.0's state cache and what its per-step bookkeeping works on (docs/semantics.md §6):
:class:`BlockPool` (the cache of blocks, each request owning D of them, and its align blocks) and
:class:`BlockHarness` (the builder's and the runner's buffers, the update's ``self``)."""

from __future__ import annotations

import numpy as np
import torch

from ...config import Config
from ...fileio import check_memory
from ...layouts import LAYOUTS
from ...sim.pool import STALE, StatePool
from ..base import Harness
from .engine import NULL_BLOCK_ID

I32 = torch.int32


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
    latest snapshot, so one block per request holds it). It starts NaN: a read before any copy shows.

    Under a churning lifecycle (docs/semantics.md §12) the cache has :func:`serving_blocks` blocks, all
    free at the start (a fixed finite pattern: vLLM never zeroes a block), handed out by vLLM's block pool
    (drift/flows/in_place/engine.py); before each step the flow writes each row's re-sliced columns into
    ``block_table`` / ``block_table_host`` (padded rows NULL), its running block into ``row_slots`` and its
    align destination -- the column before the running one -- into ``row_track_slots`` /
    ``row_track_host``; ``held`` are the blocks running requests hold and ``owners`` names every block."""

    def __init__(self, cfg: Config, device: torch.device):
        self.cfg, self.device = cfg, device
        L, R, N, D = cfg.num_layers, cfg.num_requests, cfg.num_rows, cfg.num_draft_tokens
        HV, K, V = cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim
        if cfg.serving.churn:
            nblocks = serving_blocks(cfg)
        else:
            base = 1 + R * D + max(1, cfg.spare_slots)  # the NULL, request and spare blocks
            nblocks = base + R  # and one align block per request
        item = torch.empty(0, dtype=cfg.torch_ssm_dtype).element_size()
        check_memory(L * nblocks * (HV * V * K * item + cfg.conv_window * cfg.conv_channels * 4)
                     + L * R * HV * V * K * 8, f"the state cache of {cfg.name} ({L} layers, {nblocks} blocks)")
        layout = LAYOUTS[cfg.layout]
        self.temporal = layout.state((L, nblocks, HV), V, K, cfg.torch_ssm_dtype, device)
        self.intermediate_ssm = self.temporal.unsqueeze(2)
        self.conv = layout.conv((L, nblocks), cfg.conv_window, cfg.conv_channels, cfg.torch_conv_dtype, device)
        self.num_blocks = nblocks
        self.owners: dict[int, str] = {}  # under churn: who holds each block, for messages (the flow keeps it)
        self.previous: dict[int, str] = {}  # and who held it before (a leak names both)
        if cfg.serving.churn:
            # Every block but the NULL one starts free, holding a fixed finite pattern (vLLM never zeroes a
            # mamba block); the serving bookkeeping hands them out (drift/flows/in_place/engine.py) and
            # rewrites the rows' tables before each step.
            table = np.zeros((N, D), np.int64)
            self.request_slots = self.track_slots = np.zeros(0, np.int64)
            self.spare_slots = np.arange(1, nblocks, dtype=np.int64)
            self.row_track_host = np.zeros(N, np.int64)
            self.held: set[int] = set()  # the blocks running requests hold (the flow keeps it)
        else:
            rng = np.random.default_rng([cfg.seed, 0x5107])
            perm = 1 + rng.permutation(base - 1)
            table = np.zeros((N, D), np.int64)
            table[:R] = perm[:R * D].reshape(R, D)
            self.request_slots = table[:R].reshape(-1)  # every block a request owns
            self.track_slots = np.arange(base, nblocks, dtype=np.int64)  # the align blocks
            self.spare_slots = perm[R * D:].astype(np.int64)
            self.row_track_host = np.concatenate([self.track_slots, np.full(N - R, NULL_BLOCK_ID, np.int64)])
        self.block_table_host = table
        self.block_table = torch.from_numpy(table).to(device)
        self.row_slots = self.block_table[:, 0].clone()  # conv_state_indices: the first block
        self.row_track_slots = torch.from_numpy(self.row_track_host).to(device)  # mamba_track_indices [N]
        self.active_slots = self.row_slots[:R]
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
        if self.cfg.serving.churn:
            return self.owners.get(int(slot), "free block")
        hit = np.argwhere(self.block_table_host == slot)
        if len(hit):
            return f"block {int(hit[0][1])} of row {int(hit[0][0])}"
        if slot in self.track_slots:
            return f"align block of row {int(np.argwhere(self.track_slots == slot)[0][0])}"
        return "spare block"

    @property
    def unowned_slots(self) -> np.ndarray:
        """int64 ``[U]``: the blocks neither the verify kernel nor the update may write: the NULL block and
        the spare blocks; under churn every block no running request holds -- the free ones and those the
        prefix cache keeps (a cached snapshot is only read)."""
        if self.cfg.serving.churn:
            return np.asarray([NULL_BLOCK_ID, *(b for b in range(1, self.num_blocks) if b not in self.held)], np.int64)
        return np.concatenate([[NULL_BLOCK_ID], self.spare_slots]).astype(np.int64)


def serving_blocks(cfg: Config) -> int:
    """The blocks of the state cache under a churning lifecycle: the NULL block; per running request at
    most D + 1 (its running block, its D - 1 speculative ones and the previous running block, which
    ``remove_skipped_blocks`` frees once the request moves past it) and the block of its latest tracked
    snapshot, which the prefix cache holds; the ``prefix_cache`` snapshots of finished requests; and the
    spare blocks (at least one): ``1 + R (D + 2) + prefix_cache + spare``."""
    return (1 + cfg.num_requests * (cfg.num_draft_tokens + 2) + cfg.serving.prefix_cache
            + max(1, cfg.spare_slots))


class BlockHarness(Harness):
    """What vLLM 0.33.0's per-step bookkeeping works on, for the update under test as ``self``:

    * ``num_accepted_tokens`` int32 ``[N]``: ``gpu_model_runner.num_accepted_tokens.gpu`` (what
      ``_update_states_after_model_execute`` sets from the sampled tokens) as the builder passes it
      on (``GDNAttentionMetadataBuilder.build``: padded rows 1);
    * ``spec_state_indices_tensor`` int32 ``[N, D]``: the builder's persistent buffer
      (``block_table[:, :num_spec + 1]``, padded rows ``NULL_BLOCK_ID``);
    * ``block_table`` int32 ``[N, D]``: each row's blocks (padded rows NULL); under a churning lifecycle the
      columns ``mamba_get_block_table_tensor`` re-slices from the row's block table at its running column;
    * ``num_spec_decodes``: the rows that decode speculatively (host int; padded rows follow them; under
      a churning lifecycle the step's running requests);
    * ``num_draft_tokens`` int32 ``[N]``: the drafts each row verifies besides its root token
      (``mamba_utils.stage_postprocess_inputs_to_gpu``'s ``num_draft_tokens_buf``), staged by the
      flow before each verify;
    * ``ssm_state`` ``[L, blocks, HV, V, K]`` and ``conv_state`` ``[L, blocks, W, C]``: the caches the
      align copy moves blocks of (each GDN layer's ``kv_cache``, ``mamba_utils``'s state base
      addresses), in the pool's dtypes and layout.
    """

    ATTRIBUTES = ("num_accepted_tokens", "spec_state_indices_tensor", "block_table", "num_spec_decodes",
                  "num_draft_tokens", "ssm_state", "conv_state")
    PROVIDED = (", ".join(f"self.{a}" for a in ATTRIBUTES) + " (vLLM's bookkeeping of the in-place block flow, "
                "docs/semantics.md §6)")
    HOW_TO_PROVIDE = "extend drift.flows.in_place.pool.BlockHarness"
    BUILT_FROM_POOL = False  # it holds the builder's buffers of its own

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
