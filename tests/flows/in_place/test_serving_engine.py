"""drift.flows.in_place.engine and the serving parts of drift.flows.in_place.updates: vLLM 0.33.0's
engine state (MRV1, prefix caching's align mode) and the bookkeeping under test that runs on it,
each held to vLLM's own formulas (docs/semantics.md §12, "vLLM's serving bookkeeping"):

* the block-table re-slice: ``start = max((seq_len - 1) // block_size, 0)`` (``mamba_get_block_table_tensor``),
  which is ``preprocess_mamba``'s running column ``cdiv(seq_len, block_size) - 1`` for every seq_len >= 1;
* ``preprocess_mamba``'s migration: temporal from column ``prev + n - 1``, conv from column ``prev`` at
  offset ``n - 1`` (the copy specs), the accept count reset to 1; a new request's column
  ``(num_computed - 1) // block_size`` (a prefix hit's cached column, or -1: nothing to copy);
* the block pool's order (uncached frees reused most recent first, cached ones last, oldest first) and
  MambaManager's columns (null below the running one, freed once passed; a bounded number held);
* InputBatch: a new request in the lowest hole with accept count 1, condense moving the last rows
  (and their accept counts) into the holes, as the schedule's batch order has it.

Each positive test stands beside a negative control (the known-bad variant it must tell apart).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import same_bits
from drift.flows.in_place.engine import (NULL_BLOCK_ID, BlockAllocator, InputBatch, MambaBlocks, RequestState,
                                         Runner, cdiv)
from drift.flows.in_place.updates import ServingParts, mamba_block_table
from drift.sim.serving import order_condense

BS, NS = 16, 3  # block size (ci-small's track interval) and num_speculative_blocks (D = 4)


# ------------------------------------------------------------------------------ the re-slice
def test_the_reslice_starts_at_the_running_column_of_each_rows_seq_len():
    g = np.random.default_rng(3)
    table = torch.from_numpy(g.integers(1, 1000, size=(6, 40)))
    seq_lens = torch.tensor([0, 1, 16, 17, 33, 500], dtype=torch.int64)  # a padded row (0), boundaries and past
    got = mamba_block_table(table, seq_lens, BS, 1 + NS)
    for r, n in enumerate(seq_lens.tolist()):
        start = max((n - 1) // BS, 0)  # vLLM's CPU path and Triton kernel
        assert got[r].tolist() == table[r, start:start + 1 + NS].tolist()
        if n >= 1:  # the builder's start is preprocess_mamba's running column
            assert start == cdiv(n, BS) - 1


def test_a_reslice_from_seq_len_over_block_size_is_one_column_late_at_each_boundary():
    """Negative control: ``seq_len // block_size`` (no -1) disagrees exactly where seq_len ends a block."""
    table = torch.arange(40, dtype=torch.int64).repeat(2, 1)
    seq_lens = torch.tensor([32, 33], dtype=torch.int64)
    right = mamba_block_table(table, seq_lens, BS, 1 + NS)[:, 0].tolist()
    late = (seq_lens // BS).tolist()
    assert right == [1, 2] and late == [2, 2]  # at 32 tokens the state lives in column 1, not 2


# ------------------------------------------------------------------------------ preprocess_mamba
def _runner(blocks_per_req: int = 8, L: int = 2, W: int = 6, C: int = 3, HV: int = 2, V: int = 2, K: int = 2):
    """Two requests (lanes 0 and 1) in rows 0 and 1 with blocks 1..8 and 9..16, every block's state and
    conv columns distinct (bf16 values that tell blocks and columns apart)."""
    nblocks = 1 + 2 * blocks_per_req
    ssm = (torch.arange(L * nblocks * HV * V * K, dtype=torch.float32).view(L, nblocks, HV, V, K) / 7).to(torch.bfloat16)
    conv = (torch.arange(L * nblocks * W * C, dtype=torch.float32).view(L, nblocks, W, C) / 5).to(torch.bfloat16)
    batch = InputBatch(4)
    runner = Runner(batch, BS, NS, torch.ones(4, dtype=torch.int32), ssm, conv)
    parts = ServingParts()
    for lane in (0, 1):
        ids = list(range(1 + lane * blocks_per_req, 1 + (lane + 1) * blocks_per_req))
        runner.requests[lane] = RequestState(lane, 0, ids)
        parts.add_request(batch, lane, ids)
    return runner, parts


def test_preprocess_mamba_migrates_the_running_state_when_its_column_advances_and_resets_the_count():
    runner, parts = _runner()
    ssm0, conv0 = runner.ssm_state.clone(), runner.conv_state.clone()
    W = conv0.shape[2]
    # lane 0: its state in column 1 (prev), 3 tokens accepted, the step's tokens end in column 2: it moves;
    # lane 1: its state in column 1, the step stays in column 1: nothing moves, its count kept.
    runner.mamba_state_idx.update({0: 1, 1: 1})
    runner.requests[0].num_computed_tokens, runner.num_scheduled_tokens[0] = 30, 4  # seq_len 34: column 2
    runner.requests[1].num_computed_tokens, runner.num_scheduled_tokens[1] = 20, 4  # seq_len 24: column 1
    runner.input_batch.num_accepted_tokens_cpu[:2] = [3, 2]
    parts.preprocess_mamba(runner, [0, 1])
    ids, n = runner.requests[0].block_ids, 3
    assert runner.mamba_state_idx == {0: 2, 1: 1}
    assert same_bits(runner.ssm_state[:, ids[2]], ssm0[:, ids[1 + n - 1]])  # temporal: column prev + n - 1
    assert same_bits(runner.conv_state[:, ids[2], :W - (n - 1)], conv0[:, ids[1], n - 1:])  # conv: column prev at n - 1
    assert same_bits(runner.conv_state[:, ids[2], W - (n - 1):], conv0[:, ids[2], W - (n - 1):])  # the rest kept
    assert runner.input_batch.num_accepted_tokens_cpu[:2].tolist() == [1, 2]
    others = [b for b in range(ssm0.shape[1]) if b != ids[2]]
    assert same_bits(runner.ssm_state[:, others], ssm0[:, others]) and same_bits(runner.conv_state[:, others],
                                                                                 conv0[:, others])


def test_a_migration_that_keeps_the_count_leaves_the_next_verify_on_a_stale_block():
    """Negative control: without the reset (the vllm_migrate_keeps_accept part) the count stays 3, so the
    next verify would start from column 2 of the new window, not from the migrated state in column 0."""
    runner, _ = _runner()
    parts = ServingParts(reset_after_copy=lambda batch, row: None)
    runner.mamba_state_idx[0] = 1
    runner.requests[0].num_computed_tokens, runner.num_scheduled_tokens[0] = 30, 4
    runner.input_batch.num_accepted_tokens_cpu[0] = 3
    parts.preprocess_mamba(runner, [0])
    assert runner.input_batch.num_accepted_tokens_cpu[0] == 3


def test_a_new_request_copies_its_prefix_hits_cached_column_and_a_fresh_one_copies_nothing():
    runner, parts = _runner()
    ssm0 = runner.ssm_state.clone()
    ids = runner.requests[0].block_ids
    # lane 0: a prefix hit of 32 tokens (cached column 1), 5 prompt tokens of its own: running column 2;
    # lane 1: a fresh request of 21 tokens: nothing computed, nothing to copy.
    runner.requests[0].num_computed_tokens, runner.num_scheduled_tokens[0] = 32, 5
    runner.requests[1].num_computed_tokens, runner.num_scheduled_tokens[1] = 0, 21
    parts.preprocess_mamba(runner, [0, 1])
    assert runner.mamba_state_idx == {0: 2, 1: 1}
    assert same_bits(runner.ssm_state[:, ids[2]], ssm0[:, ids[1]])  # bias 0: add_request set the count to 1
    unchanged = [b for b in range(ssm0.shape[1]) if b != ids[2]]
    assert same_bits(runner.ssm_state[:, unchanged], ssm0[:, unchanged])


def test_a_prefix_hit_read_one_column_early_restores_another_snapshot():
    """Negative control: the vllm_hit_wrong_column part takes column 0 for a 32-token hit."""
    from drift.plug.mutants import hit_one_column_early

    runner, parts = _runner()
    runner.requests[0].num_computed_tokens = 32
    assert parts.prev_state_idx(runner, 0) == 1 and hit_one_column_early(runner, 0) == 0


# ------------------------------------------------------------------------------ the block pool
def _freed_order(pool: BlockAllocator) -> list[int]:
    """The free queue after a request held blocks 1-4 (2 and 3 cached) and freed them, tail first."""
    a = pool.get_new_blocks(4)
    pool.cached[[2, 3]] = True
    pool.free_blocks(list(reversed(a)))
    return list(pool.free)


def test_the_free_queue_reuses_uncached_blocks_most_recent_first_and_evicts_cached_ones_oldest_first():
    pool = BlockAllocator(9)
    # uncached 4 and 1 to the front (4 first: freed first), cached 3 and 2 to the end (3 first)
    assert _freed_order(pool) == [4, 1, 5, 6, 7, 8, 3, 2]
    got = pool.get_new_blocks(8)
    assert got == [4, 1, 5, 6, 7, 8, 3, 2] and not pool.cached[[2, 3]].any()  # popped cached blocks are evicted
    with pytest.raises(RuntimeError, match="too small"):
        pool.get_new_blocks(1)


class _FifoAllocator(BlockAllocator):
    """A pool that appends every freed block (no LIFO reuse of uncached blocks)."""

    def free_blocks(self, ordered):
        for b in ordered:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free.append(b)


def test_a_fifo_free_queue_is_told_apart():
    """Negative control: the order test above fails for a pool that appends every freed block."""
    assert _freed_order(_FifoAllocator(9)) != [4, 1, 5, 6, 7, 8, 3, 2]


def test_a_touched_cached_block_leaves_the_free_queue_until_its_last_reference_goes():
    pool = BlockAllocator(4)
    b = pool.get_new_blocks(1)[0]
    pool.cached[b] = True
    pool.free_blocks([b])
    assert list(pool.free)[-1] == b
    pool.touch([b])
    assert b not in pool.free and pool.ref[b] == 1
    pool.free_blocks([b])
    assert list(pool.free)[-1] == b


def test_a_requests_columns_follow_its_running_column_and_stay_bounded():
    """A request decoding 4 tokens a step: its running column is the re-slice's start, the columns below
    the previous running one are freed and nulled, and it never holds more than D + 1 blocks."""
    pool = BlockAllocator(64)
    mb = MambaBlocks(pool, BS, NS)
    mb.new_request(0)
    mb.allocate_new_blocks(0, 24)  # the prefill step: columns 0 (null), 1 (running), 2..4 (speculative)
    assert mb.req_to_blocks[0][0] == NULL_BLOCK_ID and len(mb.req_to_blocks[0]) == 2 + NS
    computed = 24
    for _ in range(40):
        mb.remove_skipped_blocks(0, computed)
        mb.allocate_new_blocks(0, computed + 1 + NS)
        seq_len = computed + 1 + NS
        curr = cdiv(seq_len, BS) - 1
        cols = mb.req_to_blocks[0]
        assert len(cols) == curr + 1 + NS
        assert all(b != NULL_BLOCK_ID for b in cols[curr:])  # the running and speculative blocks
        assert all(b == NULL_BLOCK_ID for b in cols[:max(curr - 1, 0)])  # below the previous running one: freed
        assert sum(b != NULL_BLOCK_ID for b in cols) <= NS + 2
        assert mb.block_ids[0][curr:curr + 1 + NS] == cols[curr:curr + 1 + NS]  # the worker's view agrees
        computed += 3
    held = sum(b != NULL_BLOCK_ID for b in mb.req_to_blocks[0])
    assert len(pool.free) == 63 - held  # every freed block is back in the pool
    mb.free(0)
    assert len(pool.free) == 63


def test_a_prefix_hit_shares_the_cached_block_at_its_column():
    pool = BlockAllocator(16)
    cached = pool.get_new_blocks(1)[0]
    pool.cached[cached] = True
    mb = MambaBlocks(pool, BS, NS)
    mb.new_request(0, 1, cached)  # a hit of 32 tokens
    mb.allocate_new_blocks(0, 37)
    assert mb.req_to_blocks[0][:2] == [NULL_BLOCK_ID, cached] and pool.ref[cached] == 2
    assert mb.last_state_block_idx[0] == 1  # "the last block saves the hit state"
    mb.remove_skipped_blocks(0, 37)  # moving past it frees the request's reference only
    assert mb.req_to_blocks[0][1] == NULL_BLOCK_ID and pool.ref[cached] == 1 and cached not in pool.free


# ------------------------------------------------------------------------------ InputBatch
def test_add_request_takes_the_lowest_hole_and_condense_moves_the_last_rows_with_their_counts():
    batch, parts = InputBatch(8), ServingParts()
    for lane in range(5):
        parts.add_request(batch, lane, [lane + 1])
    batch.num_accepted_tokens_cpu[:5] = [2, 3, 4, 1, 4]
    for lane in (1, 3):
        batch.remove_request(lane)
    assert parts.add_request(batch, 9, [20]) == 1 and batch.num_accepted_tokens_cpu[1] == 1
    parts.condense(batch)
    assert batch.req_ids == [0, 9, 2, 4]  # lane 4 (row 4) moved into the hole at row 3
    assert batch.num_accepted_tokens_cpu[:4].tolist() == [2, 1, 4, 4]
    assert batch.block_table[3, 0] == 5


def test_a_condense_that_leaves_the_count_behind_gives_the_moved_row_the_holes_count():
    """Negative control: the vllm_condense_accept part."""
    batch, parts = InputBatch(4), ServingParts(move_accept=lambda batch, src, dst: None)
    for lane in range(3):
        ServingParts().add_request(batch, lane, [lane + 1])
    batch.num_accepted_tokens_cpu[:3] = [2, 3, 4]
    batch.remove_request(1)
    parts.condense(batch)
    assert batch.req_ids == [0, 2] and batch.num_accepted_tokens_cpu[1] == 3  # lane 2 runs with lane 1's count


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_persistent_batch_orders_rows_as_the_schedules_condense_order(seed):
    g = np.random.default_rng(seed)
    batch, parts = InputBatch(16), ServingParts()
    order: list[int] = []
    running, idle = [], list(range(12))
    for _ in range(50):
        ended = [lane for lane in running if g.random() < 0.3]
        started = [lane for lane in idle if g.random() < 0.3][: 12 - len(running) + len(ended)]
        for lane in ended:
            batch.remove_request(lane)
        for lane in started:
            parts.add_request(batch, lane, [1])
        parts.condense(batch)
        batch.removed.clear()
        order = order_condense(order, ended, started)
        running = [lane for lane in running if lane not in ended] + started
        idle = [lane for lane in idle if lane not in started] + ended
        assert batch.req_ids == order
