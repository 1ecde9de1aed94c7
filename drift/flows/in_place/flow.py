"""vLLM 0.33.0's in-place block flow (the ``vllm`` flow; docs/semantics.md §6).

One state cache of blocks, each request owning D of them (:class:`~drift.flows.in_place.pool.BlockPool`);
the verify writes token t's state in place into block ``idx[b, t]`` and the next step starts from
``idx[b, n - 1]``, n the previous step's accept count (:class:`~drift.flows.in_place.rule.BlockRule`);
there is no commit copy, and the conv window is read at offset ``n - 1`` (a lazy rollback). The
code under test is the per-step bookkeeping that sets ``num_accepted_tokens`` and the state
indices, and prefix caching's align copy of the state after a block-boundary token into a
destination block (:class:`~drift.flows.in_place.pool.BlockHarness`, drift/flows/in_place/updates.py).

Under a churning lifecycle (docs/semantics.md §12, "vLLM's serving bookkeeping") the flow runs vLLM's
engine between steps (drift/flows/in_place/engine.py: the block pool, each request's columns, the
persistent batch) with the serving parts under test (``updates.ServingParts``): a request's blocks are
columns of its block table, re-sliced at its running column every step, and its running state migrates
when that column advances; padded rows of a graph bucket get the NULL block.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from ...config import Config
from ...dtypes import as_bits
from ...errors import ConfigError, LoadError, UpdateRaised, what_raised
from ...sim import kernels
from ...sim.pool import STALE
from ..base import FlowKind
from . import naive
from .engine import BlockAllocator, InputBatch, MambaBlocks, RequestState, Runner
from .pool import I32, NULL_BLOCK_ID, BlockHarness, BlockPool
from .rule import BlockRule
from .updates import ServingParts


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
        N, D, R = cfg.num_rows, cfg.num_draft_tokens, cfg.num_requests
        self.actual_seq_lengths = torch.full((N,), D, dtype=I32, device=device)
        self.scale = cfg.head_k_dim ** -0.5
        valid = np.nonzero(self.pool.block_table_host[:, 0] != NULL_BLOCK_ID)[0]
        self._valid_rows = torch.from_numpy(valid).to(device)  # fixed by the pool: no device read
        # The drafts each row verified at the last verify, the flow's own copy of what it stages into
        # the harness (tracked_snapshot decides the align destination from it, not from the harness).
        self._num_draft = torch.full((N,), D - 1, dtype=I32, device=device)
        # Each lane's batch row on the device (the fixed batch: lane r is row r; under churn arrange sets it).
        self._lane_rows = torch.arange(R, dtype=torch.int64, device=device)

    @classmethod
    def validate(cls, cfg: Config) -> None:
        """Under a churning lifecycle the flow runs vLLM's align mode with ``mamba_block_size`` = the track
        interval, which must hold a step's tokens (one block boundary per step at the most)."""
        if cfg.serving.churn and 0 < cfg.track_interval < cfg.num_draft_tokens:
            raise ConfigError(f"track_interval={cfg.track_interval} under lifecycle={cfg.lifecycle!r} and flow={cfg.flow!r}: "
                              "the serving lifecycle runs vLLM's prefix caching (align mode) with mamba_block_size = "
                              f"the track interval, which must hold one step's tokens; allowed: track_interval >= "
                              f"num_draft_tokens ({cfg.num_draft_tokens}) (or 0: no prefix caching), or lifecycle='fixed'")

    def verify_args(self, mix, beta, g, rounding: str, key: int, drafts=None, gate=None) -> kernels.VerifyArgs:
        """vLLM's call (model_executor/layers/mamba/gdn: fused_recurrent_gated_delta_rule with
        initial_state = the cache, inplace_final_state=True, ssm_state_indices, num_accepted_tokens;
        each row's token count from cu_seqlens, here ``drafts [B]``), for the step's ``B`` rows. Stages
        each row's draft count (``drafts - 1``) into ``harness.num_draft_tokens``, as the runner stages the
        align copy's inputs before the forward (``mamba_utils.stage_postprocess_inputs_to_gpu``, 0.33.0)."""
        cfg, pool, h = self.cfg, self.pool, self.harness
        B = mix.shape[1]
        lengths = self.actual_seq_lengths[:B] if drafts is None else drafts.to(I32)
        self._num_draft[:B].copy_(lengths - 1)
        h.num_draft_tokens[:B].copy_(self._num_draft[:B])
        return kernels.VerifyArgs(mix, beta, g, pool.temporal, pool.intermediate_ssm, pool.row_slots[:B].to(I32),
                                  h.spec_state_indices_tensor[:B], h.num_accepted_tokens[:B], lengths,
                                  cfg.num_k_heads, cfg.num_v_heads, self.scale, rounding, key, rule=self.rule,
                                  gate_inputs=gate)

    def after_verify(self, last: torch.Tensor) -> None:
        """The accept count is the update's business. Under churn the scheduler reads the step's sampled
        tokens on the host (``Scheduler.update_from_output``: each request's computed tokens advance by the
        tokens it accepted), as drift's serving bookkeeping does at the next step's events."""
        if self.cfg.serving.churn:
            self._accepted = last.cpu().numpy().astype(np.int64) + 1

    def kernel_slots(self) -> np.ndarray:
        """The verify writes each token's state in place into the rows' own blocks (``block_table``):
        every block a request owns, and no other (not the NULL, spare or align blocks). Under a churning
        lifecycle: the blocks of this step's spec columns (the re-sliced block table of the batch's rows)."""
        if self.cfg.serving.churn:
            blocks = np.unique(self.pool.block_table_host[: self.rows])
            return blocks[blocks != NULL_BLOCK_ID].astype(np.int64)
        return np.asarray(self.pool.request_slots, np.int64)

    def conv_verify(self, x: torch.Tensor, weight: torch.Tensor, drafts=None) -> torch.Tensor:
        """vLLM's causal_conv1d_update with num_accepted_tokens (docs/semantics.md §6): read at offset
        ``n - 1`` of the conv cache of each row's first block; rows on the NULL block are skipped;
        a row verifying fewer than D tokens (``drafts``) writes that many. Under churn which rows are
        on the NULL block is read from the builder's indices on the device (``live``)."""
        h, B = self.harness, x.shape[1]
        slots = h.spec_state_indices_tensor[:B, 0].to(torch.int64)
        offset = (h.num_accepted_tokens[:B].to(torch.int64) - 1).clamp(min=0)
        if self.cfg.serving.churn:
            return kernels.conv_verify_at(self.pool.conv, slots, offset, x, weight, self._all_rows[:B], drafts,
                                          live=slots > NULL_BLOCK_ID)
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
        destination of a lane tracked that step (:meth:`align_destinations`, at the lane's batch row);
        every other block must stay as the verify left it. ``track_host``, ``drafts_host`` ``[count, R]``
        host int per lane (the step to track or -1; the tokens each lane verifies, all D when None)."""
        t = np.zeros((track_host.shape[0], self.pool.num_blocks), dtype=bool)
        if drafts_host is None:
            drafts_host = np.full(track_host.shape, self.cfg.num_draft_tokens, np.int64)
        steps, lanes = np.nonzero(track_host >= 0)
        dest = self.align_destinations(self.lane_rows_host[lanes], track_host[steps, lanes],
                                       drafts_host[steps, lanes] - 1)
        t[steps, dest] = True
        return t

    def align_destinations(self, rows: np.ndarray, steps, num_draft):
        """The block an align copy writes for each of the batch ``rows`` [n] tracked at draft ``steps`` [n]
        (the accept-token bias) with ``num_draft`` [n] drafts (host arrays, or device tensors): the
        running block ``block_table[r, 0]`` when the boundary is the row's last verified token
        (vLLM's ``src_block_idx == dest_block_idx``: ``aligned == num_computed + num_scheduled``),
        else the row's align block (``row_track_slots``). Host in, host out; device in, device out (no sync)."""
        pool = self.pool
        if isinstance(steps, torch.Tensor):
            r = torch.from_numpy(np.asarray(rows, np.int64)).to(pool.device)
            return torch.where(steps == num_draft, pool.block_table[r, 0], pool.row_track_slots[r])
        return np.where(steps == num_draft, pool.block_table_host[rows, 0], pool.row_track_host[rows])

    def tracked_snapshot(self, track: np.ndarray) -> tuple:
        """What the align copy left for the lanes tracked this step (``track [R]`` host int, -1 =
        none): ``(lanes [n], states [L, n, HV, V, K], windows [L, n, Kc-1, C], bit mismatches [n] of
        each state against block ``block_table[r, step]`` (r the lane's batch row), where the verify
        stored the state after the boundary token)``; the window is the first Kc-1 columns of the
        destination's conv cache."""
        cfg, pool = self.cfg, self.pool
        lanes = np.nonzero(track >= 0)[0]
        rows = self.lane_rows_host[lanes]
        rows_t = torch.from_numpy(rows).to(pool.device)
        steps = torch.from_numpy(track[lanes]).to(pool.device)
        dest = self.align_destinations(rows, steps, self._num_draft[rows_t].to(torch.int64))
        got = pool.states.index_select(1, dest)  # [L, n, HV, V, K] in the state dtype
        held = pool.states[:, pool.block_table[rows_t, steps]]
        bits_bad = (as_bits(got) != as_bits(held)).sum((0, 2, 3, 4))
        return lanes, got, pool.conv[:, dest, :cfg.conv_kernel - 1], bits_bad, None

    def unreadable_update(self) -> str:
        """An accept count past the row's D state indices (``n > D``) or negative, in a lane's row: vLLM's
        fused_recurrent reads ``ssm_state_indices[b, n - 1]`` (ops/fused_recurrent.py, 0.33.0), outside the
        row's D blocks (another row's index, or none). One host read of the ``[R]`` counts per step."""
        D = self.cfg.num_draft_tokens
        if self.pool.device.type == "meta":  # a run on the virtual device (no values to read)
            return ""
        n = self.harness.num_accepted_tokens.index_select(0, self._lane_rows).to(torch.int64).cpu()
        bad = ((n < 0) | (n > D)).nonzero().flatten().tolist()
        if not bad:
            return ""
        return (f"left num_accepted_tokens = {int(n[bad[0]])} in row {int(self._lane_rows[bad[0]])}, outside 0..D = "
                f"{D}: the next verify would read ssm_state_indices[row, n - 1] past the row's {D} blocks (an "
                "accept count off by one?)")

    def _next_start(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each lane's blocks ``[R, D]`` and the column its next verify starts from (``n - 1``), at its row."""
        h, rows = self.harness, self._lane_rows
        n = h.num_accepted_tokens.index_select(0, rows).to(torch.int64)
        idx = h.spec_state_indices_tensor.index_select(0, rows).to(torch.int64)
        return idx, (n - 1).clamp(min=0)

    def committed_states(self) -> torch.Tensor:
        """The block each lane's next verify starts from: ``idx[r, n_r - 1]`` as the update left them."""
        idx, j = self._next_start()
        return self.pool.states.index_select(1, idx.gather(1, j[:, None]).squeeze(1))

    def committed_windows(self) -> torch.Tensor:
        """The Kc-1 conv inputs the next verify reads: columns ``n - 1 .. n + Kc - 3`` of the conv cache
        of each lane's first block."""
        cfg = self.cfg
        idx, j = self._next_start()
        Km1 = cfg.conv_kernel - 1
        cols = j[:, None] + torch.arange(Km1, device=j.device)  # [R, Kc-1]
        win = self.pool.conv.index_select(1, idx[:, 0])  # [L, R, W, C]
        return win.gather(2, cols[None, :, :, None].expand(win.shape[0], -1, -1, win.shape[3]))

    # ------------------------------------------------------------ a churning lifecycle (docs/semantics.md §12)
    SERVES = True
    BATCH_ORDER = "condense"  # vLLM's persistent batch (MRV1 InputBatch: add_request, condense)

    def start_serving(self, bookkeeping: Optional[ServingParts] = None, extend=None) -> None:
        """vLLM 0.33.0's engine state (drift/flows/in_place/engine.py) around the serving bookkeeping
        under test (``bookkeeping``: a :class:`~drift.flows.in_place.updates.ServingParts`, the update's
        ``serving``; None: the built-in's): every block free, no request running. ``extend(start, state0,
        window0) -> (state, window)``: drift's prefill model, which the simulation supplies."""
        cfg, pool, h = self.cfg, self.pool, self.harness
        R, N, D = cfg.num_requests, cfg.num_rows, cfg.num_draft_tokens
        self.parts = bookkeeping if bookkeeping is not None else ServingParts()
        self.extend = extend
        self.block_size = cfg.track_interval if cfg.track_interval > 0 else NO_ALIGN
        self.allocator = BlockAllocator(pool.num_blocks)
        self.blocks = MambaBlocks(self.allocator, self.block_size, D - 1)
        self.batch = InputBatch(N)
        self.runner = Runner(self.batch, self.block_size, D - 1, h.num_accepted_tokens, pool.temporal, pool.conv)
        self.lane_request = np.full(R, -1, np.int64)
        self.running: list[int] = []  # lanes in the scheduler's running order (arrival order)
        # The prefix cache's blocks: each lane's latest tracked snapshot (request, position, block), and the
        # snapshots of finished requests it keeps (request -> (position, block), oldest first).
        self.latest: dict[int, tuple[int, int, int]] = {}
        self.cache: dict[int, tuple[int, int]] = {}
        self._step_lanes: list[int] = []  # the lane in each live row of the last step
        self._accepted: Optional[np.ndarray] = None  # tokens each row accepted at the last step (after_verify)
        self._all_rows = torch.arange(N, dtype=torch.int64, device=pool.device)
        self.restored: dict[int, int] = {}  # lane -> bits of a prefix hit's restore that differ from the snapshot
        h.num_spec_decodes = 0
        h.num_accepted_tokens.fill_(1)
        h.spec_state_indices_tensor.fill_(NULL_BLOCK_ID)
        h.block_table.fill_(NULL_BLOCK_ID)

    def _call(self, what: str, fn: Callable, *args):
        """A part of the serving bookkeeping under test: one that raises fails the run (UpdateRaised)."""
        try:
            return fn(*args)
        except LoadError:  # a part that cannot run here (refused, exit 2), not a regression of it
            raise
        except Exception as exc:
            raise UpdateRaised(f"the serving bookkeeping under test ({what}: "
                               f"{getattr(fn, '__qualname__', fn)}) raised {what_raised(exc)}") from exc

    def _settle(self) -> None:
        """What follows the last step, once, before any event of the next: the align kernel's accept counts
        reach the CPU array in the last step's row order (``postprocess_mamba_align_gpu``: the D2H of
        ``num_accepted_tokens_out``), and the scheduler advances each request by the tokens it accepted
        (``update_from_output``), caches the columns it completed, and the prefix cache takes the block of
        a boundary it crossed (its latest tracked snapshot; the previous one released)."""
        if self._accepted is None:
            return
        accepted, self._accepted = self._accepted, None
        n, bs = len(self._step_lanes), self.block_size
        self.batch.num_accepted_tokens_cpu[:n] = self.harness.num_accepted_tokens[:n].cpu().numpy()
        for row, lane in enumerate(self._step_lanes):
            req = self.runner.requests[lane]
            pre, post = req.num_computed_tokens, req.num_computed_tokens + int(accepted[row])
            req.num_computed_tokens = post
            self.blocks.cache_blocks(lane, post)
            if self.cfg.track_interval > 0 and pre // bs != post // bs:
                column = post // bs - 1
                block = self.blocks.req_to_blocks[lane][column]
                assert block != NULL_BLOCK_ID, (lane, column)
                self.allocator.touch([block])
                old = self.latest.get(lane)
                if old is not None:
                    self.allocator.free_blocks([old[2]])
                self.latest[lane] = (req.request, (column + 1) * bs, block)

    def release(self, lane: int, request: int, finished: bool, keep_snapshot: bool) -> None:
        """The request leaves: the worker's ``InputBatch.remove_request`` (a hole; ``cleanup_mamba_state_idx``),
        the scheduler's ``free`` of its blocks (the cached ones to the end of the free queue); finished, its
        latest snapshot stays in the prefix cache with ``keep_snapshot`` (the ``prefix_cache`` newest kept,
        the oldest released), else is released; preempted, the cache keeps it for the resume."""
        self._settle()
        self.batch.remove_request(lane)
        self.runner.requests.pop(lane)
        self.runner.mamba_state_idx.pop(lane, None)
        self.runner.num_scheduled_tokens.pop(lane, None)
        self.blocks.free(lane)
        self.running.remove(lane)
        self.lane_request[lane] = -1
        if finished:
            latest = self.latest.pop(lane, None)
            if keep_snapshot:
                assert latest is not None and latest[0] == request, (lane, request, latest)
                self.cache[request] = latest[1:]
            elif latest is not None:
                self.allocator.free_blocks([latest[2]])
            while len(self.cache) > self.cfg.serving.prefix_cache:
                self.allocator.free_blocks([self.cache.pop(next(iter(self.cache)))[1]])
        self._own()

    def admit(self, lane: int, request: int, start) -> None:
        """The request's prefill step (drift runs it between decode steps): the scheduler's blocks (a prefix
        hit shares the cached block of its source's last snapshot at its column), the worker's
        ``add_request``, ``preprocess_mamba`` for its row (a hit's state copied into its running column),
        then the extend of its tokens into the running block -- from what the block holds only after a
        prefix (``has_initial_state = context_lens > 0``, gdn_attn.py), else from zeros -- and the prefill's
        sampled count (one token) as its accept count."""
        self._settle()
        cfg, pool, parts, bs = self.cfg, self.pool, self.parts, self.block_size
        hit = start.source >= 0
        if hit:
            position, block = self.cache[start.source]
            assert position == start.p0 and position % bs == 0, (position, start)
            self.blocks.new_request(lane, position // bs - 1, block)
        else:
            self.blocks.new_request(lane)
        computed = start.p0  # (allocate_slots' remove_skipped_blocks runs before the hit's blocks join: a no-op)
        self.blocks.allocate_new_blocks(lane, start.p1)
        req = self.runner.requests[lane] = RequestState(request, computed, self.blocks.block_ids[lane])
        self.runner.num_scheduled_tokens[lane] = start.p1 - computed
        self.runner.mamba_state_idx.pop(lane, None)  # cleanup_mamba_state_idx: a resumed request's entry
        row = self._call("add_request", parts.add_request, self.batch, lane, req.block_ids)
        self._call("preprocess_mamba", parts.preprocess_mamba, self.runner, [row])
        run = req.block_ids[self.runner.mamba_state_idx[lane]]
        if hit:
            # The restore, bit for bit, against the block the prefix cache keeps for the source (untouched
            # since: the slot guard holds it); preprocess_mamba copied it whole (bias 0).
            self.restored[lane] = int((as_bits(pool.states[:, run]) != as_bits(pool.states[:, block])).sum()
                                      + (as_bits(pool.conv[:, run]) != as_bits(pool.conv[:, block])).sum())
            state0 = pool.states[:, run].to(torch.float64).cpu()
            window0 = pool.conv[:, run, :cfg.conv_kernel - 1].to(torch.float64).cpu()
        else:
            shape = (cfg.num_layers, cfg.num_v_heads, cfg.head_v_dim, cfg.head_k_dim)
            state0, window0 = torch.zeros(shape, dtype=torch.float64), None
        state, window = self.extend(start, state0, window0)
        self.store_start(run, state, window)
        req.num_computed_tokens = start.p1
        self.blocks.cache_blocks(lane, start.p1)
        self.batch.num_accepted_tokens_cpu[row] = 1  # _update_states_after_model_execute: the prefill sampled one token
        self.running.append(lane)
        self.lane_request[lane] = request
        self._own()

    def store_start(self, block: int, state: torch.Tensor, window: torch.Tensor) -> None:
        """The extend's store into ``block``: the state in the state dtype (round to nearest), the last Kc-1
        inputs in the first Kc-1 columns of its conv cache, the other columns NaN (a read shows), as
        :meth:`load_start` does."""
        cfg, pool = self.cfg, self.pool
        pool.states[:, block] = state.to(pool.device).to(pool.temporal.dtype)
        buf = torch.full((cfg.num_layers, cfg.conv_window, cfg.conv_channels), STALE, dtype=pool.conv.dtype,
                         device=pool.device)
        buf[:, :cfg.conv_kernel - 1] = window.to(pool.device, pool.conv.dtype)
        pool.conv[:, block] = buf

    def arrange(self, lanes_of_rows: np.ndarray, scheduled: Optional[np.ndarray] = None) -> None:
        """The step's batch, as vLLM's worker forms it: ``condense`` (its rows must be the schedule's
        ``lanes_of_rows``); the scheduler's ``remove_skipped_blocks`` and ``allocate_new_blocks`` for each
        running request (``scheduled [R]``: the tokens each lane's request runs, the root and its drafts),
        the new block ids appended to its row; the runner's per-row accept counts from the CPU array;
        ``preprocess_mamba`` (the running state migrates where its column advanced) and the re-sync of the
        counts; the block-table re-slice at ``seq_len = computed + scheduled`` (padded rows NULL, seq_len
        0); the GDN builder's indices; and each row's align destination (column ``start - 1``)."""
        self._settle()
        cfg, pool, h, parts, batch = self.cfg, self.pool, self.harness, self.parts, self.batch
        R, N, D, B = cfg.num_requests, cfg.num_rows, cfg.num_draft_tokens, len(lanes_of_rows)
        if scheduled is None:
            scheduled = np.full(R, D, np.int64)
        self._call("condense", parts.condense, batch)
        batch.removed.clear()  # refresh_metadata: batch_update_builder.reset()
        live = [int(lane) for lane in lanes_of_rows if lane >= 0]
        if batch.req_ids != live:
            raise RuntimeError(f"vLLM's persistent batch holds lanes {batch.req_ids}, the schedule's batch order "
                               f"{live}: drift's schedule and engine disagree")
        num_reqs = len(live)
        rows = batch.row_of()
        for lane in self.running:  # the scheduler: the running requests, in arrival order
            req = self.runner.requests[lane]
            self.blocks.remove_skipped_blocks(lane, req.num_computed_tokens)
            new = self.blocks.allocate_new_blocks(lane, req.num_computed_tokens + int(scheduled[lane]))
            if new:
                batch.append_row(new, rows[lane])  # _update_states: block_table.append_row(new_block_ids, req_index)
            self.runner.num_scheduled_tokens[lane] = int(scheduled[lane])
        self._call("the runner's accept counts", parts.runner_accepts, self.runner, num_reqs, True)
        self._call("preprocess_mamba", parts.preprocess_mamba, self.runner, range(num_reqs))
        self._call("the runner's accept counts", parts.runner_accepts, self.runner, num_reqs, False)
        seq_lens = np.zeros(N, np.int64)
        for row, lane in enumerate(live):
            seq_lens[row] = self.runner.requests[lane].num_computed_tokens + int(scheduled[lane])
        table = torch.from_numpy(batch.block_table[:N].copy())
        table[num_reqs:] = NULL_BLOCK_ID  # _get_block_table: blk_table_tensor[num_reqs:num_reqs_padded].fill_(NULL_BLOCK_ID)
        window = self._call("the block-table re-slice", parts.reslice, table, torch.from_numpy(seq_lens),
                            self.block_size, D).to(torch.int64)
        running_column = np.maximum((seq_lens - 1) // self.block_size, 0)  # the re-slice's start
        cols = np.minimum(np.maximum(running_column - 1, 0), batch.block_table.shape[1] - 1)
        track = np.where((running_column >= 1) & (np.arange(N) < num_reqs), batch.block_table[np.arange(N), cols],
                         NULL_BLOCK_ID)
        pool.block_table_host = window.numpy().copy()
        pool.block_table.copy_(window)
        pool.row_track_host = track
        pool.row_track_slots.copy_(torch.from_numpy(track))
        pool.row_slots.copy_(window[:, 0])
        h.block_table.copy_(window.to(I32))
        h.num_spec_decodes = num_reqs
        self._call("the GDN builder", parts.builder, h)
        self.lane_rows_host = np.zeros(R, np.int64)
        self.lane_rows_host[live] = np.arange(num_reqs)
        self._lane_rows.copy_(torch.from_numpy(self.lane_rows_host))
        self.rows = B
        self._step_lanes = live
        self._own()

    def _own(self) -> None:
        """Who holds each block, for the slot guard's unowned set and its messages (``pool.owners``; a block
        whose holder changed keeps the last one in ``pool.previous``, so a leak names both)."""
        pool, owners, held = self.pool, {}, set()
        for lane in self.running:
            q = self.runner.requests[lane].request
            for j, b in enumerate(self.blocks.req_to_blocks[lane]):
                if b != NULL_BLOCK_ID:
                    held.add(b)
                    owners[b] = f"column {j} of request {q} (lane {lane})"
        for q, position, b in self.latest.values():
            owners.setdefault(b, f"the prefix cache's snapshot of request {q} (position {position})")
        for q, (position, b) in self.cache.items():
            owners.setdefault(b, f"the prefix cache's snapshot of request {q} (position {position})")
        for b, who in pool.owners.items():
            if owners.get(b) != who:
                pool.previous[b] = who
        pool.owners, pool.held = owners, held

    def cached_snapshot(self, request: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block the prefix cache keeps for finished request ``request``: its state ``[L, HV, V, K]``
        (state dtype) and the first Kc-1 columns of its conv cache ``[L, Kc-1, C]`` (the align copy's)."""
        block = self.cache[request][1]
        return self.pool.states[:, block], self.pool.conv[:, block, :self.cfg.conv_kernel - 1]

    def start_slot(self, lane: int) -> int:
        """The block ``lane``'s request's next verify starts from, ``spec_state_indices[row, n - 1]`` (for
        messages: a device read)."""
        h, row = self.harness, int(self.lane_rows_host[lane])
        n = max(int(h.num_accepted_tokens[row]), 1)
        return int(h.spec_state_indices_tensor[row, n - 1])

    # ------------------------------------------------------------ checkpoints of a churning lifecycle
    def _serving_buffers(self) -> dict[str, torch.Tensor]:
        pool, h = self.pool, self.harness
        return {"block_table": pool.block_table, "row_slots": pool.row_slots, "row_track_slots": pool.row_track_slots,
                "accept": h.num_accepted_tokens, "spec": h.spec_state_indices_tensor, "window": h.block_table,
                "num_draft": h.num_draft_tokens, "own_num_draft": self._num_draft, "lane_rows": self._lane_rows}

    def serving_state_dict(self) -> dict:
        """The engine state between chunks (drift.checkpoint): the block pool, each request's columns and
        block ids, the persistent batch, the runner's state, the prefix cache's blocks, the index buffers."""
        pool, mb, batch, runner = self.pool, self.blocks, self.batch, self.runner

        def pairs(d: dict) -> list:
            return [[int(k), v] for k, v in d.items()]

        return {
            "free": np.asarray(self.allocator.free, np.int64), "ref": self.allocator.ref, "cached": self.allocator.cached,
            "req_to_blocks": pairs(mb.req_to_blocks), "block_ids": pairs(mb.block_ids), "allocated": sorted(mb.allocated),
            "last_state": pairs(mb.last_state_block_idx), "retired": pairs(mb.retired), "num_cached": pairs(mb.num_cached),
            "req_ids": [-1 if lane is None else lane for lane in batch.req_ids], "removed": list(batch.removed),
            "accept_cpu": batch.num_accepted_tokens_cpu, "batch_table": batch.block_table, "num_blocks": batch.num_blocks,
            "requests": [[lane, r.request, r.num_computed_tokens] for lane, r in runner.requests.items()],
            "mamba_state_idx": pairs(runner.mamba_state_idx), "scheduled": pairs(runner.num_scheduled_tokens),
            "accept_np": runner.accept_np, "running": list(self.running),
            "latest": [[lane, *v] for lane, v in self.latest.items()], "cache": [[q, *v] for q, v in self.cache.items()],
            "step_lanes": list(self._step_lanes), "accepted": self._accepted, "lane_request": self.lane_request,
            "lane_rows": self.lane_rows_host, "rows": self.rows, "num_spec_decodes": self.harness.num_spec_decodes,
            "owners": pairs(pool.owners), "previous": pairs(pool.previous), "held": sorted(pool.held),
            "table_host": pool.block_table_host, "track_host": pool.row_track_host,
            "buffers": self._serving_buffers()}

    def load_serving_state_dict(self, st: dict) -> None:
        from collections import deque

        pool, mb, batch, runner = self.pool, self.blocks, self.batch, self.runner

        def unpair(rows: list) -> dict:
            return {int(k): v for k, v in rows}

        self.allocator.free = deque(int(b) for b in st["free"])
        self.allocator.ref, self.allocator.cached = st["ref"], st["cached"]
        mb.req_to_blocks = {k: [int(b) for b in v] for k, v in unpair(st["req_to_blocks"]).items()}
        mb.block_ids = {k: [int(b) for b in v] for k, v in unpair(st["block_ids"]).items()}
        mb.allocated = set(int(x) for x in st["allocated"])
        mb.last_state_block_idx, mb.retired, mb.num_cached = (
            {k: int(v) for k, v in unpair(st[name]).items()} for name in ("last_state", "retired", "num_cached"))
        batch.req_ids = [None if lane < 0 else int(lane) for lane in st["req_ids"]]
        batch.removed = [int(x) for x in st["removed"]]
        batch.num_accepted_tokens_cpu, batch.block_table, batch.num_blocks = st["accept_cpu"], st["batch_table"], st["num_blocks"]
        runner.requests = {int(lane): RequestState(int(q), int(c), mb.block_ids[int(lane)]) for lane, q, c in st["requests"]}
        runner.mamba_state_idx = {k: int(v) for k, v in unpair(st["mamba_state_idx"]).items()}
        runner.num_scheduled_tokens = {k: int(v) for k, v in unpair(st["scheduled"]).items()}
        runner.accept_np = st["accept_np"]
        self.running = [int(x) for x in st["running"]]
        self.latest = {int(lane): (int(q), int(p), int(b)) for lane, q, p, b in st["latest"]}
        self.cache = {int(q): (int(p), int(b)) for q, p, b in st["cache"]}
        self._step_lanes = [int(x) for x in st["step_lanes"]]
        self._accepted = st["accepted"]
        self.lane_request, self.lane_rows_host, self.rows = st["lane_request"], st["lane_rows"], int(st["rows"])
        self.harness.num_spec_decodes = int(st["num_spec_decodes"])
        pool.owners, pool.previous = unpair(st["owners"]), unpair(st["previous"])
        pool.held = set(int(b) for b in st["held"])
        pool.block_table_host, pool.row_track_host = st["table_host"], st["track_host"]
        for name, t in self._serving_buffers().items():
            t.copy_(st["buffers"][name])

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


# Mode "none" (no prefix caching: track_interval 0): mamba_block_size = max_model_len
# (MambaModelConfig.verify_and_update_config), so every request keeps its 1 + num_spec blocks from its
# first column: a block size no position reaches.
NO_ALIGN = 1 << 62
