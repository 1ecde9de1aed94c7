"""SGLang 0.5.23's request and mamba slot bookkeeping: the code under test of a churning lifecycle
in the kinds that keep SGLang's MambaPool slots (copy-commit, kernel-commit; docs/semantics.md §12).

Read from the wheel (paths relative to ``sglang/``):

* ``srt/mem_cache/allocator/mamba.py: MambaSlotAllocator``: the free mamba slots, ``arange(1, size +
  1)`` at ``clear`` (slot 0 is "a dummy write target for padded tokens"); ``alloc(n)`` takes the first n
  (``free_slots[:need_size]``), ``free`` appends at the end (``torch.cat``): first in, first out.
* ``srt/mem_cache/memory_pool.py: ReqToTokenPool``: the request-pool rows, ``list(range(1, size + 1))``
  (row 0 is the padding row); ``alloc_rows`` pops the tail, ``free_rows`` appends: last in, first out.
* ``HybridReqToTokenPool.alloc``: a request without a slot gets one (``mamba_allocator.alloc(1)``) with
  ``mamba_needs_clear = True`` -- the slot is zeroed later, by ``MambaPool.clear_slots`` on the forward
  stream before the extend (``ModelRunner._maybe_execute_deferred_mamba_cow_and_clear``) -- and its
  tracking slots (``_alloc_ping_pong_buffer``, from the same allocator, not cleared); a fresh request
  row's ReplaySSM spec cursors are zeroed (``index_fill_(0, fresh_rows, 0)``, the kernel-commit kind's
  :meth:`MambaSlots.fresh_row`).
* ``MambaPool.copy_from(src, dst)``: a prefix-cache hit's restore, the conv window and the state of the
  tree's slot into the new working slot (``MambaComponent.finalize_match_result_in_cache``, then the
  deferred copy before the extend); no ring, no spec cursor.
* ``HybridReqToTokenPool.free_mamba_cache`` / ``ReqToTokenPool.free``: a finished request frees its
  working slot and its tracking slots but the one it donated to the tree; a retracted one frees all.

drift keeps one tracking slot per request (SGLang's default ``extra_buffer`` strategy keeps two
ping-pong slots and donates the one holding the latest snapshot at each track point; drift donates
its latest snapshot when the request finishes: the snapshot the tree keeps for the longest prefix).
:class:`MambaSlots` renders these as SGLang ships them over drift's pool; a serving mutant replaces a
method (drift/plug/mutants.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sim.pool import StatePool


@dataclass
class Held:
    """What a running request holds: its request-pool ``row``, its working slot ``work`` (the state its
    verify reads) and its tracking slot ``track``; ``needs_clear``: its working slot is zeroed before the
    extend (a request that does not restore a prefix)."""

    row: int
    work: int
    track: int
    needs_clear: bool


class MambaSlots:
    """HybridReqToTokenPool's rows and MambaSlotAllocator's slots over ``pool`` (module docstring);
    ``rows``: the request-pool rows (the most requests running at once)."""

    def __init__(self, pool: StatePool, rows: int):
        self.pool = pool
        self.free_list = torch.arange(1, pool.temporal.shape[1], dtype=torch.int64)  # MambaSlotAllocator.clear
        self.free_rows = list(range(1, rows + 1))  # ReqToTokenPool: row 0 pads

    # ------------------------------------------------------------------ MambaSlotAllocator
    def alloc_slots(self, need: int) -> list[int]:
        """``MambaSlotAllocator.alloc``: the first ``need`` free slots."""
        if need > len(self.free_list):
            raise RuntimeError(f"the mamba pool has {len(self.free_list)} free slots, {need} asked: drift sized it "
                               "too small for this lifecycle")
        picked, self.free_list = self.free_list[:need], self.free_list[need:]
        return [int(s) for s in picked]

    def free_slots(self, slots: list[int]) -> None:
        """``MambaSlotAllocator.free``: the slots go to the end of the free list."""
        self.free_list = torch.cat([self.free_list, torch.tensor(slots, dtype=torch.int64)])

    # ------------------------------------------------------------------ HybridReqToTokenPool
    def alloc(self, prefix_hit: bool) -> Held:
        """``HybridReqToTokenPool.alloc`` for a new request: a request row (LIFO), a working slot (a prefix
        hit's comes from ``finalize_match_result_in_cache`` first, the same allocator) and a tracking slot."""
        row = self.free_rows.pop()
        work = self.alloc_slots(1)[0]
        track = self.alloc_slots(1)[0]
        self.fresh_row(row)
        return Held(row, work, track, needs_clear=not prefix_hit)

    def match(self, cache: dict, source: int) -> int:
        """``MambaComponent.finalize_match_result_in_cache`` (``srt/mem_cache/unified_cache/components/mamba.py``):
        the slot of the tree node the prefix matched, here the one holding ``source``'s snapshot (``cache``:
        request -> slot, the snapshots the tree keeps)."""
        return cache[source]

    def fresh_row(self, row: int) -> None:
        """What ``alloc`` resets for a freshly handed-out request row (nothing for a copy-commit pool)."""

    def free(self, held: Held, keep_track: bool) -> None:
        """``free_mamba_cache`` and ``ReqToTokenPool.free``: the working slot and (unless donated to the
        tree) the tracking slot go back to the allocator, the row to the request pool."""
        self.free_slots([held.work] + ([] if keep_track else [held.track]))
        self.free_rows.append(held.row)

    # ------------------------------------------------------------------ the step's batch
    def replay_metadata(self, indices: torch.Tensor, slots: list[int], padded: int) -> None:
        """``_replay_metadata`` (``srt/hardware_backend/npu/attention/ascend_hybrid_linear_attn_backend.py``;
        eager: ``MambaAttnBackendBase._forward_metadata``): the step's mamba indices, each row's slot looked up
        from its request row (``get_mamba_indices``), the whole ``[:bs]`` buffer rewritten every step, the
        ``padded`` rows at its end on slot 0 (NPU's padding slot; ``req_pool_indices`` 0). ``indices``: the
        persistent int64 buffer; ``slots [bs]``: each row's slot, padded rows' any."""
        bs = len(slots)
        values = torch.tensor(slots, dtype=torch.int64)
        values[bs - padded:] = 0
        indices[:bs].copy_(values)
        indices[bs:] = 0

    # ------------------------------------------------------------------ MambaPool
    def clear_slots(self, slots: list[int]) -> None:
        """``MambaPool.clear_slots``: the slots' conv windows and states zeroed (the deferred clear)."""
        pool = self.pool
        idx = torch.tensor(slots, dtype=torch.int64, device=pool.device)
        pool.conv.index_fill_(1, idx, 0)
        pool.temporal.index_fill_(1, idx, 0)

    def copy_from(self, src: int, dst: int) -> None:
        """``MambaPool.copy_from``: slot ``dst`` gets slot ``src``'s conv window and state, every layer."""
        pool = self.pool
        pool.conv[:, dst] = pool.conv[:, src]
        pool.temporal[:, dst] = pool.temporal[:, src]
