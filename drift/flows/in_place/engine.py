"""vLLM 0.33.0's engine state under a churning lifecycle, as the vllm flow's serving bookkeeping
(drift/flows/in_place/updates.py) works on it: docs/semantics.md §12, "vLLM's serving bookkeeping".

drift models vLLM's V1 model runner (MRV1, ``VLLM_USE_V2_MODEL_RUNNER=0``) with prefix caching on
(``mamba_cache_mode == "align"``, ``mamba_block_size`` = the config's ``track_interval``). Read from the
wheel (paths relative to ``vllm/``):

* :class:`BlockAllocator` -- ``v1/core/block_pool.py: BlockPool``: the free queue holds every block but
  the null block 0 in id order; ``get_new_blocks`` pops the head (a cached block popped is evicted:
  ``_maybe_evict_cached_block``); ``free_blocks`` prepends the blocks that carry no hash ("LIFO reuse of
  non-cached blocks") and appends the cached ones ("FIFO reuse of cached blocks for LRU eviction
  behavior"); ``touch`` takes a cached block a prefix hit shares out of the queue. Blocks are never
  zeroed (``_record_new_block_ids`` zeroes attention blocks only: a MambaSpec is no AttentionSpec).
* :class:`MambaBlocks` -- ``v1/core/single_type_kv_cache_manager.py: MambaManager`` in align mode: a
  request's columns (``req_to_blocks``; column j holds the state after ``(j + 1) * block_size`` tokens),
  ``allocate_new_blocks`` (``cdiv(num_tokens, block_size) + num_speculative_blocks`` columns, the skipped
  ones null, the speculative blocks a column advance leaves behind relocated to the end,
  ``last_state_block_idx``), ``remove_skipped_blocks`` (every column below ``(computed - 1) //
  block_size`` freed and nulled), ``find_longest_cache_hit`` (a hit at column i: ``[null] * i +
  [cached]``), ``free`` (the blocks in reverse order); and the worker's copy of the request's block ids
  (``CachedRequestState.block_ids``), which only grows (``append_row``: "The worker block table of a
  running request is append-only").
* :class:`InputBatch` -- ``v1/worker/gpu_input_batch.py: InputBatch``: the persistent batch's rows
  (``_req_ids``, holes left by ``remove_request`` in ``batch_update_builder._removed``, the lowest
  popped first), ``num_accepted_tokens_cpu`` (ones at init) and the per-row block table
  (``block_table``: ``add_row`` / ``append_row`` / ``move_row`` / ``clear_row``).
* :class:`Runner` -- ``v1/worker/gpu_model_runner.py: GPUModelRunner``'s state the bookkeeping reads:
  ``requests``, ``mamba_state_idx`` (keyed by request, so reorder-safe), the scheduler output's
  ``num_scheduled_tokens`` and the ``num_accepted_tokens`` buffer (host ``.np`` and device ``.gpu``,
  the harness's).

drift's simplifications, stated: a column's block is cached once the request's computed tokens reach
the column's end (vLLM hashes it at the scheduling step whose tokens reach it); no chunked prefill,
prefill checkpoints, partial-block hits or P/D; and the prefix cache (drift's, which the schedule's
hits are drawn from: drift/sim/serving.py) holds a reference to each block it may still be asked for,
so that vLLM's eviction never removes a snapshot the schedule restores (vLLM would then miss; the
schedule's requests do not depend on the engine).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

NULL_BLOCK_ID = 0  # vllm/v1/core/kv_cache_utils.py (0.33.0): block 0 is never allocated; kernels skip it


def cdiv(a: int, b: int) -> int:
    """vllm/utils: ``-(a // -b)``."""
    return -(a // -b)


# ------------------------------------------------------------------------------ the block pool
class BlockAllocator:
    """``BlockPool``'s free queue and reference counts over blocks ``1 .. num_blocks - 1`` (module
    docstring); ``cached[b]``: block b carries a prefix-cache hash."""

    def __init__(self, num_blocks: int):
        self.free: deque[int] = deque(range(1, num_blocks))
        self.ref = np.zeros(num_blocks, np.int64)
        self.cached = np.zeros(num_blocks, bool)

    def get_new_blocks(self, n: int) -> list[int]:
        """``get_new_blocks``: the first ``n`` of the free queue, a cached one evicted."""
        if n > len(self.free):
            raise RuntimeError(f"vLLM's block pool has {len(self.free)} free blocks, {n} asked: drift sized the "
                               "state cache too small for this lifecycle")
        out = [self.free.popleft() for _ in range(n)]
        for b in out:
            self.cached[b] = False  # _maybe_evict_cached_block
            self.ref[b] = 1
        return out

    def free_blocks(self, ordered: list[int]) -> None:
        """``free_blocks(ordered_blocks)``: a block whose count drops to 0 goes to the front of the queue
        (no hash; the first of ``ordered`` first) or to its end (cached)."""
        first, last = [], []
        for b in ordered:
            if b == NULL_BLOCK_ID:  # "never pooled; its ref_cnt is not maintained"
                continue
            self.ref[b] -= 1
            if self.ref[b] == 0:
                (last if self.cached[b] else first).append(b)
        self.free.extendleft(reversed(first))  # prepend_n
        self.free.extend(last)  # append_n

    def touch(self, blocks: list[int]) -> None:
        """``touch``: one more reference; a block in the free queue leaves it."""
        for b in blocks:
            if b == NULL_BLOCK_ID:
                continue
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1


# ------------------------------------------------------------------------------ a request's blocks
class MambaBlocks:
    """``MambaManager`` (align mode) for the running requests, keyed by drift's lane: the scheduler's
    columns ``req_to_blocks`` and the worker's append-only ``block_ids`` (module docstring)."""

    def __init__(self, allocator: BlockAllocator, block_size: int, num_speculative_blocks: int):
        self.allocator, self.block_size, self.num_spec = allocator, block_size, num_speculative_blocks
        self.req_to_blocks: dict[int, list[int]] = {}
        self.block_ids: dict[int, list[int]] = {}  # the worker's CachedRequestState.block_ids
        self.allocated: set[int] = set()  # _allocated_block_reqs
        self.last_state_block_idx: dict[int, int] = {}
        self.retired: dict[int, int] = {}  # _num_retired_blocks
        self.num_cached: dict[int, int] = {}  # num_cached_block

    def new_request(self, lane: int, hit_column: int = -1, hit_block: int = NULL_BLOCK_ID) -> None:
        """A request with no blocks, or with a prefix hit at ``hit_column``: ``find_longest_cache_hit``'s
        ``[null] * i + [cached]``, the cached block shared (``touch``) as ``allocate_new_computed_blocks``
        does."""
        blocks = [NULL_BLOCK_ID] * hit_column + [hit_block] if hit_column >= 0 else []
        if hit_column >= 0:
            self.allocator.touch([hit_block])
        self.req_to_blocks[lane] = blocks
        self.block_ids[lane] = list(blocks)
        self.num_cached[lane] = len(blocks)

    def allocate_new_blocks(self, lane: int, num_tokens: int) -> list[int]:
        """``allocate_new_blocks`` (align; no checkpoint, no partial hit): the worker gets the new
        entries appended (``returned_blocks``: null padding, relocated and new blocks)."""
        bs, ns = self.block_size, self.num_spec
        req = self.req_to_blocks[lane]
        num_required = cdiv(num_tokens, bs) + ns
        if num_required <= len(req):
            self.allocated.add(lane)
            return []
        prev_len = len(req)
        if lane in self.allocated:  # "We always save the running state at the last (1 + num_speculative_blocks) block"
            self.last_state_block_idx[lane] = prev_len - 1 - ns
        elif prev_len > 0:  # "When a new request hits the prefix cache, the last block saves the hit state."
            self.last_state_block_idx[lane] = prev_len - 1
        num_skipped = num_required - ns - 1
        if prev_len < num_skipped:
            req.extend([NULL_BLOCK_ID] * (num_skipped - prev_len))
        if lane in self.allocated:
            for idx in range(prev_len - ns, prev_len):  # _relocate_speculative_block
                if idx < num_skipped:
                    req.append(req[idx])
                    req[idx] = NULL_BLOCK_ID
                else:
                    break
        new = self.allocator.get_new_blocks(max(num_required - len(req), 0))
        returned = req[prev_len:] + new
        req.extend(new)
        self.allocated.add(lane)
        self.block_ids[lane].extend(returned)
        return returned

    def remove_skipped_blocks(self, lane: int, computed: int) -> None:
        """``remove_skipped_blocks``: the base class frees the columns below ``(computed - 1) // block_size``
        (``get_num_skipped_tokens = computed - 1``; ``_remove_blocks_in_range``, highest first), then
        MambaManager frees ``last_state_block_idx`` once it lies below ``cdiv(computed, block_size) - 1``."""
        req, bs = self.req_to_blocks[lane], self.block_size
        if computed - 1 > 0:
            last = min((computed - 1) // bs, len(req))
            first = self.retired.get(lane, 0)
            if first < last:
                freed = []
                for i in range(last - 1, first - 1, -1):
                    if req[i] != NULL_BLOCK_ID:
                        freed.append(req[i])
                        req[i] = NULL_BLOCK_ID
                self.allocator.free_blocks(freed)
                self.retired[lane] = last
        idx = self.last_state_block_idx.get(lane)
        if idx is not None and idx < cdiv(computed, bs) - 1 and req[idx] != NULL_BLOCK_ID:
            self.allocator.free_blocks([req[idx]])
            req[idx] = NULL_BLOCK_ID

    def cache_blocks(self, lane: int, computed: int) -> None:
        """Every column whose end the request's computed tokens reached gets its block cached (module
        docstring: drift's timing of ``cache_full_blocks``; null columns skipped)."""
        req = self.req_to_blocks[lane]
        full = min(computed // self.block_size, len(req))
        for j in range(self.num_cached[lane], full):
            if req[j] != NULL_BLOCK_ID:
                self.allocator.cached[req[j]] = True
        self.num_cached[lane] = max(self.num_cached[lane], full)

    def free(self, lane: int) -> None:
        """``free``: the request's blocks, in reverse order ("so that the tail blocks are evicted first");
        ``pop_blocks_for_free`` drops its align bookkeeping."""
        self.allocator.free_blocks(list(reversed(self.req_to_blocks.pop(lane))))
        self.block_ids.pop(lane)
        for book in (self.last_state_block_idx, self.retired, self.num_cached):
            book.pop(lane, None)
        self.allocated.discard(lane)


# ------------------------------------------------------------------------------ the persistent batch
class InputBatch:
    """``InputBatch``'s rows (module docstring): ``req_ids[row]`` the lane of its request (None: a hole),
    ``removed`` the holes (``batch_update_builder._removed``), ``num_accepted_tokens_cpu`` int32
    ``[max_num_reqs]`` and ``block_table`` int64 ``[max_num_reqs, columns]`` (grown as requests grow)."""

    def __init__(self, max_num_reqs: int):
        self.max_num_reqs = max_num_reqs
        self.req_ids: list[Optional[int]] = []
        self.removed: list[int] = []
        self.num_accepted_tokens_cpu = np.ones(max_num_reqs, np.int32)  # torch.ones(...).numpy()
        self.block_table = np.zeros((max_num_reqs, 1), np.int64)
        self.num_blocks = np.zeros(max_num_reqs, np.int64)

    @property
    def num_reqs(self) -> int:
        return sum(lane is not None for lane in self.req_ids)

    def pop_removed(self) -> Optional[int]:
        """The lowest hole (``BatchUpdateBuilder.pop_removed``)."""
        if not self.removed:
            return None
        self.removed.sort(reverse=True)
        return self.removed.pop()

    def peek_removed(self) -> Optional[int]:
        if not self.removed:
            return None
        self.removed.sort(reverse=True)
        return self.removed[-1]

    def remove_request(self, lane: int) -> int:
        """``remove_request``: the row becomes a hole and its block table row is cleared."""
        row = self.req_ids.index(lane)
        self.removed.append(row)
        self.req_ids[row] = None
        self.clear_row(row)
        return row

    def row_of(self) -> dict[int, int]:
        return {lane: row for row, lane in enumerate(self.req_ids) if lane is not None}

    # ``MultiGroupBlockTable`` (v1/worker/block_table.py), one group
    def _fit(self, columns: int) -> None:
        if columns > self.block_table.shape[1]:
            grown = np.zeros((self.max_num_reqs, max(columns, 2 * self.block_table.shape[1])), np.int64)
            grown[:, :self.block_table.shape[1]] = self.block_table
            self.block_table = grown

    def add_row(self, block_ids: list[int], row: int) -> None:
        self.num_blocks[row] = 0
        self.append_row(block_ids, row)

    def append_row(self, block_ids: list[int], row: int) -> None:
        n, k = int(self.num_blocks[row]), len(block_ids)
        self._fit(n + k)
        self.block_table[row, n:n + k] = block_ids
        self.num_blocks[row] = n + k

    def move_row(self, src: int, tgt: int) -> None:
        self.block_table[tgt] = self.block_table[src]
        self.num_blocks[tgt] = self.num_blocks[src]

    def clear_row(self, row: int) -> None:
        self.num_blocks[row] = 0
        self.block_table[row] = NULL_BLOCK_ID


@dataclass
class RequestState:
    """``CachedRequestState``: the request's id, its computed tokens and the worker's block ids."""

    request: int
    num_computed_tokens: int
    block_ids: list[int]


@dataclass
class Runner:
    """What ``GPUModelRunner`` holds that the serving bookkeeping reads and writes (module docstring):
    ``accept_np`` int32 ``[N]`` is ``num_accepted_tokens.np`` and ``accept_gpu`` (the harness's
    ``num_accepted_tokens``) its device side; ``ssm_state`` / ``conv_state`` the caches; ``block_size``
    the mamba block size; ``num_speculative_blocks`` = D - 1."""

    input_batch: InputBatch
    block_size: int
    num_speculative_blocks: int
    accept_gpu: torch.Tensor
    ssm_state: torch.Tensor
    conv_state: torch.Tensor
    requests: dict[int, RequestState] = field(default_factory=dict)
    mamba_state_idx: dict[int, int] = field(default_factory=dict)
    num_scheduled_tokens: dict[int, int] = field(default_factory=dict)
    accept_np: np.ndarray = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.accept_np is None:
            self.accept_np = np.ones(self.accept_gpu.shape[0], np.int32)

    def copy_accepts_to_gpu(self, n: Optional[int] = None) -> None:
        """``CpuGpuBuffer.copy_to_gpu(n)``: the first ``n`` host entries (all: None) to the device."""
        n = self.accept_gpu.shape[0] if n is None else n
        self.accept_gpu[:n].copy_(torch.from_numpy(self.accept_np[:n].copy()))


def do_mamba_copy_block(runner: Runner, copies: list[tuple[int, int, int, int]]) -> None:
    """``do_mamba_copy_block`` (v1/worker/mamba_utils.py): the batched copies ``collect_mamba_copy_meta``
    collected, each ``(conv source, offset, temporal source, destination)`` block: the temporal state
    whole (``get_temporal_copy_spec``), the conv state's columns ``offset:`` into the destination's first
    ``W - offset`` columns, its other columns kept (``get_conv_copy_spec``: ``state[src, offset:]``)."""
    if not copies:
        return
    ssm, conv = runner.ssm_state, runner.conv_state
    dev = ssm.device
    conv_src, offset, temporal_src, dst = (torch.tensor(c, dtype=torch.int64, device=dev) for c in zip(*copies))
    ssm[:, dst] = ssm[:, temporal_src]
    W = conv.shape[2]
    cols = torch.arange(W, device=dev)[None, :] + offset[:, None]  # [n, W]: the source column of each
    # Advanced indexing, not gather: gather of bf16 on the CPU rewrites NaN payloads (torch 2.x).
    shifted = conv[:, conv_src[:, None], cols.clamp(max=W - 1)]  # [L, n, W, C]
    conv[:, dst] = torch.where((cols < W)[None, :, :, None], shifted, conv[:, dst])
