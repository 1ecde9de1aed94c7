"""drift's rendering of vLLM 0.33.0's per-step MTP state bookkeeping: the code under test of the
``vllm`` flow (docs/semantics.md §6), the built-in update ``vllm-0.33.0``.

vLLM keeps no commit copy: after the verify, the accept count alone says which block the next
step starts from. Two places compute it, and drift runs them as one update, called after each
verify as every update is (``fn(self, last_correct_step_indices, mamba_track_indices,
mamba_steps_to_track)``, ``self`` a :class:`drift.flows.registry.BlockHarness`):

* ``vllm/v1/worker/gpu_model_runner.py: _update_states_after_model_execute``:
  ``num_accepted_tokens.gpu[:num_reqs] = (output_token_ids != -1).sum(dim=1)`` -- on the device;
  a row's kept tokens are its accepted draft steps plus one (``last + 1``), none for a padded row;
* ``vllm/v1/attention/backends/gdn_attn.py: GDNAttentionMetadataBuilder.build`` (the CUDA-graph
  path): ``num_accepted_tokens[:num_spec_decodes]`` copied into its persistent buffer and
  ``[num_spec_decodes:].fill_(1)``; ``spec_state_indices_tensor[:num_spec_decodes] =
  block_table[:, :num_spec + 1]`` and ``[num_spec_decodes:].fill_(NULL_BLOCK_ID)``;
* with prefix caching (``mamba_cache_mode == "align"``), between the two:
  ``vllm/v1/worker/mamba_utils.py: postprocess_mamba_fused_kernel`` (launched by
  ``postprocess_mamba_align_gpu`` from ``_update_states_after_model_execute``) copies the state after
  a block-boundary token into the block-table column of that boundary and, when that column is
  the running one, resets the row's accept count to 1 (:func:`align_copy`; docs/semantics.md §6).

No host sync: every step is device tensors and host ints the harness fixes.

Under a churning lifecycle (docs/semantics.md §12, "vLLM's serving bookkeeping") the engine's
bookkeeping between steps is code under test too: :class:`ServingParts`, which the update carries as
``update.serving`` -- vLLM 0.33.0's V1 model runner (MRV1) with prefix caching's align mode:
``InputBatch.add_request`` and ``condense`` (the rows and their accept counts), the runner's per-row
accept counts, ``preprocess_mamba``'s migration of the running state, the block-table re-slice and
the GDN builder (the update's ``indices``). They are host bookkeeping in vLLM too (numpy arrays and
Python loops over the batch), run by the flow between steps over drift/flows/in_place/engine.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from .engine import NULL_BLOCK_ID, cdiv, do_mamba_copy_block


def kept_tokens(last_correct_step_indices: torch.Tensor) -> torch.Tensor:
    """``(output_token_ids != -1).sum(1)`` from drift's accepted steps (-1: a padded row keeps none)."""
    return (last_correct_step_indices.to(torch.int64) + 1).clamp(min=0)


def runner_accept_counts(self, last_correct_step_indices) -> None:
    """gpu_model_runner._update_states_after_model_execute, then the builder's copy and padding."""
    R = self.num_spec_decodes
    self.num_accepted_tokens[:R].copy_(kept_tokens(last_correct_step_indices)[:R])
    self.num_accepted_tokens[R:].fill_(1)


def boundary_blocks(self, bias: torch.Tensor) -> torch.Tensor:
    """The block holding the state after the boundary token: spec column ``bias`` of each row
    (``_copy_mamba_state_block``'s temporal copy reads ``block_table[src_col + token_bias]``, src_col
    the running column); int64 ``[R]``."""
    idx = self.spec_state_indices_tensor[: self.num_spec_decodes].to(torch.int64)
    return idx.gather(1, bias[:, None]).squeeze(1)


def align_copy(self, mamba_track_indices, mamba_steps_to_track, source=boundary_blocks) -> None:
    """mamba_utils.postprocess_mamba_fused_kernel (vLLM 0.33.0), for the rows that decode speculatively.

    ``mamba_steps_to_track`` int64 ``[N]``: per row the accept-token bias ``aligned_new_computed -
    num_tokens_running_state`` where the kernel's ``needs_copy`` holds, else -1 (drift's stream
    computes it: the track rule with interval = the mamba block size, docs/semantics.md §6);
    ``mamba_track_indices`` int64 ``[N]``: the row's destination block when the boundary column
    ``aligned // block_size - 1`` is not the running one. The destination is the running block
    ``spec_state_indices_tensor[:, 0]`` when ``bias == num_draft_tokens`` (the boundary is the last
    verified token, ``src_block_idx == dest_block_idx``); there the accept count becomes 1, so the
    next verify reads the copied state at column 0 (``num_accepted_tokens_out``).

    Temporal state: block ``source`` (spec column ``bias``) copied whole to the destination. Conv
    state: the running block's columns ``bias:`` to the destination's ``:W - bias`` (its other
    columns kept). A row that copies nothing copies its running block onto itself with bias 0:
    the same bits, and no mask, so no host sync."""
    R = self.num_spec_decodes
    steps = mamba_steps_to_track[:R].to(torch.int64)
    bias = steps.clamp(min=0)
    run = self.spec_state_indices_tensor[:R, 0].to(torch.int64)
    copies = steps >= 0
    same = copies & (bias == self.num_draft_tokens[:R].to(torch.int64))
    dest = torch.where(copies & ~same, mamba_track_indices[:R].to(torch.int64), run)
    src = torch.where(copies, source(self, bias), run)
    self.ssm_state[:, dest] = self.ssm_state[:, src]
    conv = self.conv_state  # [L, blocks, W, C]
    W = conv.shape[2]
    cols = torch.arange(W, device=bias.device)[None, :] + bias[:, None]  # [R, W]: source column of each
    # Advanced indexing, not gather: gather of bf16 on the CPU rewrites NaN payloads (torch 2.x), and
    # a self-copy must leave every bit as it was.
    shifted = conv[:, run[:, None], cols.clamp(max=W - 1)]  # [L, R, W, C]
    conv[:, dest] = torch.where((cols < W)[None, :, :, None], shifted, conv[:, dest])
    self.num_accepted_tokens[:R].masked_fill_(same, 1)


def builder_state_indices(self) -> None:
    """GDNAttentionMetadataBuilder.build: the spec state indices from the block table, padded rows NULL."""
    R = self.num_spec_decodes
    self.spec_state_indices_tensor[:R].copy_(self.block_table[:R])
    self.spec_state_indices_tensor[R:].fill_(NULL_BLOCK_ID)


# ------------------------------------------------------------ a churning lifecycle (docs/semantics.md §12)
# vLLM 0.33.0's V1 model runner (MRV1, VLLM_USE_V2_MODEL_RUNNER=0) with prefix caching on (align mode),
# over the engine state of drift/flows/in_place/engine.py. Each line an issue-28 mutant breaks is a part
# of its own (:class:`ServingParts`), so a mutant replaces exactly that part.
def reset_accept_count(batch, row: int) -> None:
    """InputBatch.add_request (v1/worker/gpu_input_batch.py L478-479): "Speculative decoding: by default
    1 token is generated"."""
    batch.num_accepted_tokens_cpu[row] = 1


def move_accept_count(batch, src: int, dst: int) -> None:
    """InputBatch.condense (v1/worker/gpu_input_batch.py L806-808): the moved row's accept count goes with it."""
    batch.num_accepted_tokens_cpu[dst] = batch.num_accepted_tokens_cpu[src]


def runner_accepts_from_batch(runner, num_reqs: int, pad: bool = True) -> None:
    """GPUModelRunner._prepare_inputs (v1/worker/gpu_model_runner.py L2095-2100, non-async): the runner's
    per-row ``num_accepted_tokens`` rebuilt from the (moved) CPU array, rows past ``num_reqs`` 1, then
    copied to the device; ``pad=False``: the re-sync after preprocess_mamba (L4069-4076: rows
    ``[:num_reqs]`` only)."""
    runner.accept_np[:num_reqs] = runner.input_batch.num_accepted_tokens_cpu[:num_reqs]
    if pad:
        runner.accept_np[num_reqs:].fill(1)
        runner.copy_accepts_to_gpu()
    else:
        runner.copy_accepts_to_gpu(num_reqs)


def prev_state_idx(runner, lane: int) -> int:
    """preprocess_mamba (v1/worker/mamba_utils.py L1492-1495): the column the request's state was left
    in -- ``mamba_state_idx`` (keyed by request), or for a new or resumed request the column of its
    computed tokens (a prefix hit's cached column; -1 when nothing is computed)."""
    prev = runner.mamba_state_idx.get(lane)
    if prev is None:  # "New / resumed request; num_computed_tokens == 0 gives -1."
        prev = (runner.requests[lane].num_computed_tokens - 1) // runner.block_size
    return prev


def reset_accept_after_copy(batch, row: int) -> None:
    """preprocess_mamba (v1/worker/mamba_utils.py L1535): after a copy to the new running column the
    state sits at its column 0."""
    batch.num_accepted_tokens_cpu[row] = 1


def mamba_block_table(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                      n_out: int) -> torch.Tensor:
    """mamba_get_block_table_tensor, align mode (v1/attention/backends/utils.py L1337-1342, its CPU path;
    the Triton kernel computes the same): each row's ``1 + num_speculative_blocks`` columns from
    ``start = max((seq_len - 1) // block_size, 0)``. block_table int64 ``[B, columns]``, seq_lens int64
    ``[B]`` (computed + scheduled tokens; 0 for padded rows); returns int64 ``[B, n_out]``."""
    start = ((seq_lens - 1) // block_size).clamp(min=0)
    offsets = torch.arange(n_out, dtype=torch.int64)
    return torch.gather(block_table, 1, start.unsqueeze(1) + offsets)


@dataclass(frozen=True)
class ServingParts:
    """vLLM 0.33.0's serving bookkeeping of the vllm flow (MRV1, align mode; docs/semantics.md §12): the
    persistent batch's rows and accept counts, the runner's per-row accept counts, ``preprocess_mamba``'s
    migration of the running state, the block-table re-slice and the GDN builder. Each field is one
    replaceable part; :meth:`add_request`, :meth:`condense` and :meth:`preprocess_mamba` render the
    engine's functions around them."""

    reset_accept: Callable = reset_accept_count
    move_accept: Callable = move_accept_count
    runner_accepts: Callable = runner_accepts_from_batch
    prev_state_idx: Callable = prev_state_idx
    reset_after_copy: Callable = reset_accept_after_copy
    reslice: Callable = mamba_block_table
    builder: Callable = builder_state_indices  # GDNAttentionMetadataBuilder.build (the update's ``indices``)

    def add_request(self, batch, lane: int, block_ids: list[int]) -> int:
        """InputBatch.add_request (v1/worker/gpu_input_batch.py L345-494): the lowest hole, else a new
        row at the end; its block table row; its accept count (:attr:`reset_accept`). Returns the row."""
        row = batch.pop_removed()  # _register_add_request: "Fill the next empty index if there is one."
        if row is None:
            row = batch.num_reqs  # "Append to end otherwise."
        if row == len(batch.req_ids):
            batch.req_ids.append(lane)
        else:
            batch.req_ids[row] = lane
        batch.add_row(block_ids, row)  # self.block_table.add_row(request.block_ids, req_index)
        self.reset_accept(batch, row)
        return row

    def condense(self, batch) -> None:
        """InputBatch.condense (v1/worker/gpu_input_batch.py L698-830): the highest live row into the
        lowest hole, repeatedly, each moved row's block table row and accept count (:attr:`move_accept`)
        with it; the trailing holes are trimmed."""
        num_reqs = batch.num_reqs
        empty = batch.removed
        if not empty:
            return
        if num_reqs == 0:
            batch.req_ids.clear()
            return
        last = num_reqs + len(empty) - 1
        while empty:
            while last in empty:  # "Find the largest non-empty index."
                last -= 1
            hole = batch.peek_removed()  # "Find the smallest empty index."
            if hole >= last:
                break
            batch.pop_removed()
            batch.req_ids[hole], batch.req_ids[last] = batch.req_ids[last], None
            batch.move_row(last, hole)  # self.block_table.move_row(last_req_index, empty_index)
            self.move_accept(batch, last, hole)
            last -= 1
        del batch.req_ids[num_reqs:]

    def preprocess_mamba(self, runner, rows) -> None:
        """preprocess_mamba (v1/worker/mamba_utils.py L1446-1549, the scalar path): for each of ``rows``
        the running column ``curr = cdiv(num_computed + num_scheduled, block_size) - 1``; where it
        differs from the column the state was left in (:attr:`prev_state_idx`) the state moves --
        temporal from column ``prev + n - 1``, conv from column ``prev`` at offset ``n - 1``
        (``get_temporal_copy_spec`` / ``get_conv_copy_spec``, model_executor/layers/mamba/mamba_utils.py),
        n the row's accept count -- and the count is reset (:attr:`reset_after_copy`). The copies run as
        one batch (``do_mamba_copy_block``)."""
        batch, bs, ns = runner.input_batch, runner.block_size, runner.num_speculative_blocks
        copies = []
        for i in rows:
            lane = batch.req_ids[i]
            req = runner.requests[lane]
            prev = self.prev_state_idx(runner, lane)
            num_blocks = cdiv(req.num_computed_tokens + runner.num_scheduled_tokens[lane], bs) + ns
            curr = num_blocks - 1 - ns  # "We always save the current running state at the last (1 + num_speculative_blocks) block."
            runner.mamba_state_idx[lane] = curr
            if prev != -1 and prev != curr:
                bias = int(batch.num_accepted_tokens_cpu[i]) - 1  # accept_token_bias
                ids = req.block_ids
                copies.append((ids[prev], bias, ids[prev + bias], ids[curr]))  # conv src, its offset, temporal src, dest
                self.reset_after_copy(batch, i)
        do_mamba_copy_block(runner, copies)


def bookkeeping(accept=runner_accept_counts, indices=builder_state_indices, align=align_copy,
                name: str = "vllm-0.33.0", serving: ServingParts = ServingParts()):
    """The update of the vllm flow from its three parts (a mutant replaces one of them); the align
    copy runs when tracking is on (``mamba_track_indices`` given: prefix caching on). ``serving``: the
    engine's bookkeeping between steps under a churning lifecycle (:class:`ServingParts`, its builder
    the update's ``indices``), carried as ``update.serving``."""
    def update(self, last_correct_step_indices, mamba_track_indices=None, mamba_steps_to_track=None):
        accept(self, last_correct_step_indices)
        if mamba_track_indices is not None:
            align(self, mamba_track_indices, mamba_steps_to_track)
        indices(self)

    update.__name__ = update.__qualname__ = name.replace("-", "_").replace(".", "")
    update.__doc__ = f"{name}: vLLM 0.33.0's per-step bookkeeping (drift/flows/in_place/updates.py)."
    update.serving = replace(serving, builder=indices)
    return update


vllm_0330 = bookkeeping()
