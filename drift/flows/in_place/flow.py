"""vLLM 0.33.0's in-place block flow (the ``vllm`` flow; docs/semantics.md §6).

One state cache of blocks, each request owning D of them (:class:`~drift.flows.in_place.pool.BlockPool`);
the verify writes token t's state in place into block ``idx[b, t]`` and the next step starts from
``idx[b, n - 1]``, n the previous step's accept count (:class:`~drift.flows.in_place.rule.BlockRule`);
there is no commit copy, and the conv window is read at offset ``n - 1`` (a lazy rollback). The
code under test is the per-step bookkeeping that sets ``num_accepted_tokens`` and the state
indices, and prefix caching's align copy of the state after a block-boundary token into a
destination block (:class:`~drift.flows.in_place.pool.BlockHarness`, drift/flows/in_place/updates.py).
"""

from __future__ import annotations

import numpy as np
import torch

from ...config import Config
from ...dtypes import as_bits
from ...sim import kernels
from ...sim.pool import STALE
from ..base import FlowKind
from . import naive
from .pool import I32, NULL_BLOCK_ID, BlockHarness, BlockPool
from .rule import BlockRule


class InPlaceBlockFlow(FlowKind):
    """vLLM's in-place block flow (the ``vllm`` flow; module docstring). Tracking is prefix caching's
    align copy (docs/semantics.md §6: "Prefix caching, align mode")."""

    name = "in-place"
    RULE, POOL, HARNESS = BlockRule, BlockPool, BlockHarness
    naive_update = staticmethod(naive.update)
    naive = staticmethod(naive.verify)
    STATE_BYTES = ("per active request and layer: read the start block's state once, write the state after "
                   "each of the D tokens into its block (no commit copy: the accept count names the block), "
                   "in the state dtype")

    @classmethod
    def bench_state_bytes(cls, cfg) -> dict[str, int]:
        state = cfg.num_requests * cfg.num_layers * cfg.num_v_heads * cfg.head_k_dim * cfg.head_v_dim * cfg.torch_ssm_dtype.itemsize
        return {"state_read": state, "blocks_write": cfg.num_draft_tokens * state}

    def naive_conv(self, x: torch.Tensor, weight: torch.Tensor, drafts=None) -> torch.Tensor:
        return naive.conv(self, x, weight, drafts)

    def __init__(self, cfg: Config, device: torch.device):
        super().__init__(cfg, device)
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
                                  cfg.num_k_heads, cfg.num_v_heads, self.scale, rounding, key, rule=self.rule,
                                  gate_inputs=gate)

    def after_verify(self, last: torch.Tensor) -> None:
        pass  # the accept count is the update's business here

    def kernel_slots(self) -> np.ndarray:
        """The verify writes each token's state in place into the rows' own blocks (``block_table``):
        every block a request owns, and no other (not the NULL, spare or align blocks)."""
        return np.asarray(self.pool.request_slots, np.int64)

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
