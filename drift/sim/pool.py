"""The state pool: committed states, verify scratch and conv windows of one rank, with slot bookkeeping.

Pool layout follows SGLang 0.5.23's MambaPool (docs/semantics.md §4):
  temporal          ``[L, slots, HV, V, K]`` committed SSM states
  intermediate_ssm  ``[L, rows + 1, D, HV, V, K]`` verify scratch (row ``rows`` is spare)
  conv[0]           ``[L, slots, W, C]`` conv windows, NPU extended window
The layout (``Config.layout``) is an entry of :data:`drift.layouts.LAYOUTS`, which allocates the
three tensors (dense, or transposed views that lose the writes of code working on a copy).

A state's meaning is its raw memory in ``[HV, V, K]`` order, the verify op's ABI
(docs/semantics.md §4-§5): :func:`raw_state` reinterprets a slot's block that way whatever the
view's strides, and every kernel, check and report of drift reads states through it.
Slot 0 is the dummy that padded rows point at; request and track slots are a
seeded permutation of the rest, with spare slots nobody owns.
"""

from __future__ import annotations

import numpy as np
import torch

from ..config import Config
from ..dtypes import as_bits
from ..fileio import check_memory
from ..layouts import LAYOUTS

STALE = float("nan")  # fills the dummy slot and never-valid rows: any read of them shows


def planned_bytes(cfg: Config, scratch: bool = True) -> int:
    """A lower bound on what one checked run of ``cfg`` allocates: the pool's committed states,
    verify scratch (when kept) and conv windows, plus the float64 truth's state of every request
    (the twin, the golden generator)."""
    L, S, N, D = cfg.num_layers, cfg.num_slots, cfg.num_rows, cfg.num_draft_tokens * scratch
    state = cfg.num_v_heads * cfg.head_v_dim * cfg.head_k_dim
    item = torch.empty(0, dtype=cfg.torch_ssm_dtype).element_size()
    return L * (state * ((S + (N + 1) * D) * item + cfg.num_requests * 8) + S * cfg.conv_window * cfg.conv_channels * 4)


def check_fits(cfg: Config, scratch: bool = True) -> None:
    """Refuse (DataError, exit 2), before any allocation, a config whose states exceed the memory limit."""
    check_memory(planned_bytes(cfg, scratch), f"the states of {cfg.name} ({cfg.num_layers} layers, {cfg.num_slots} slots, "
                 f"{cfg.num_v_heads} heads of {cfg.head_v_dim} x {cfg.head_k_dim})")


class StatePool:
    """Committed states, conv windows and verify scratch of one rank, with slot bookkeeping."""

    def __init__(self, cfg: Config, device: torch.device, scratch: bool = True):
        check_fits(cfg, scratch)
        self.cfg = cfg
        self.device = device
        L, S, N, D = cfg.num_layers, cfg.num_slots, cfg.num_rows, cfg.num_draft_tokens
        HV, K, V = cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim
        sdt, cdt = cfg.torch_ssm_dtype, cfg.torch_conv_dtype
        W, C = cfg.conv_window, cfg.conv_channels
        layout = LAYOUTS[cfg.layout]
        self.temporal = layout.state((L, S, HV), V, K, sdt, device)
        # scratch=False: a flow whose verify keeps no per-token states (an empty scratch, D = 0)
        self.intermediate_ssm = (layout.scratch((L, N + 1, D, HV), V, K, sdt, device) if scratch
                                 else torch.empty((L, N + 1, 0, HV, V, K), dtype=sdt, device=device))
        self.conv = layout.conv((L, S), W, C, cdt, device)
        R = cfg.num_requests
        # Who holds each slot, for messages (slot -> what it is); under churn the flow's bookkeeping keeps it
        # (:meth:`own`, :meth:`disown`), and ``previous`` who held it before (a leak names both).
        self.owners: dict[int, str] = {}
        self.previous: dict[int, str] = {}
        if cfg.serving.churn:
            # Every slot but the dummy starts free; the engine's allocator hands them out as requests arrive
            # (the flow's serving bookkeeping, drift/flows/slots.py). Rows, lanes and their slots are
            # persistent buffers the flow rewrites before each step.
            self.request_slots = self.track_slots = np.zeros(0, np.int64)
            self.spare_slots = np.arange(1, S, dtype=np.int64)
            N = cfg.num_rows
            self.row_slots = torch.zeros(N, dtype=torch.int64, device=device)
            self.row_track_slots = torch.zeros(N, dtype=torch.int64, device=device)
            self.active_slots = torch.zeros(R, dtype=torch.int64, device=device)
            self.lane_track_slots = torch.zeros(R, dtype=torch.int64, device=device)
        else:
            rng = np.random.default_rng([cfg.seed, 0x5107])
            perm = 1 + rng.permutation(S - 1)
            self.request_slots = perm[:R].astype(np.int64)
            self.track_slots = perm[R:2 * R].astype(np.int64)
            self.spare_slots = perm[2 * R:].astype(np.int64)
            # Batch rows: active requests, then padded rows on the dummy slot 0.
            rows = np.concatenate([self.request_slots, np.zeros(cfg.num_padded, np.int64)])
            trk = np.concatenate([self.track_slots, np.zeros(cfg.num_padded, np.int64)])
            self.row_slots = torch.from_numpy(rows).to(device)  # [N] int64
            self.row_track_slots = torch.from_numpy(trk).to(device)  # [N] int64
            self.active_slots = torch.from_numpy(self.request_slots).to(device)  # [R]: each lane's slot
            self.lane_track_slots = torch.from_numpy(self.track_slots).to(device)  # [R]: each lane's track slot
            for r, (req, trk_slot) in enumerate(zip(self.request_slots, self.track_slots)):
                self.owners[int(req)] = f"request slot of row {r}"
                self.owners[int(trk_slot)] = f"track slot of row {r}"
        self._fill_sentinels()

    def _fill_sentinels(self) -> None:
        """Dummy slot and spare scratch row hold NaN; spare slots hold a fixed finite pattern."""
        self.temporal[:, 0] = STALE
        self.conv[:, 0] = STALE
        self.intermediate_ssm[:, -1] = STALE
        for s in self.spare_slots.tolist():
            self.temporal[:, s] = 3.0 + s
            self.conv[:, s] = -3.0 - s

    # -------------------------------------------------------------- raw views
    @property
    def states(self) -> torch.Tensor:
        """Committed states by their meaning: ``[L, S, HV, V, K]`` raw blocks (docs/semantics.md §4)."""
        return raw_state(self.temporal)

    @property
    def scratch(self) -> torch.Tensor:
        """Verify scratch by its meaning: ``[L, rows + 1, D, HV, V, K]`` raw blocks."""
        return raw_state(self.intermediate_ssm)

    def own(self, slot: int, holder: str) -> None:
        """``slot`` now holds ``holder`` (a request's slot, its track slot, a cached snapshot)."""
        self.disown(slot)
        self.owners[int(slot)] = holder

    def disown(self, slot: int) -> None:
        """``slot`` is free again; what held it is kept as its previous holder."""
        if int(slot) in self.owners:
            self.previous[int(slot)] = self.owners.pop(int(slot))

    def slot_role(self, slot: int) -> str:
        """'dummy slot 0', 'request slot of row r', 'track slot of row r', what the serving bookkeeping
        says holds it, or 'spare slot' / 'free slot' (for messages)."""
        if slot == 0:
            return "dummy slot 0"
        return self.owners.get(int(slot), "free slot" if self.cfg.serving.churn else "spare slot")

    @property
    def unowned_slots(self) -> np.ndarray:
        """int64 ``[U]``: the slots no row owns (slot 0, the dummy or NULL block, and the spare slots;
        under churn every slot no request and no cached snapshot holds), which neither the verify
        kernel nor the update may write."""
        if self.cfg.serving.churn:
            free = [s for s in range(1, self.temporal.shape[1]) if s not in self.owners]
            return np.asarray([0, *free], np.int64)
        return np.concatenate([[0], self.spare_slots]).astype(np.int64)

    def bits(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Integer views of (temporal, conv) for bit-exact comparisons (NaN-safe)."""
        return as_bits(self.states), as_bits(self.conv)


def raw_state(t: torch.Tensor) -> torch.Tensor:
    """``t [..., V, K]`` read as its memory holds it: each trailing ``[V, K]`` block reinterpreted
    as dense row-major ``[V, K]``, outer strides kept (a view, never a copy).

    The verify op and sgl-kernel-npu's raw copy see a state this way (docs/semantics.md §3-§4).
    For a dense block this is ``t`` itself; for a transposed view of ``[K, V]`` storage it is
    that storage read as ``[V, K]``. Raises ValueError when a block is not dense in either order.
    """
    V, K = t.shape[-2:]
    sv, sk = t.stride()[-2:]
    if (sv, sk) == (K, 1) or t.numel() == 0:
        return t
    if (sv, sk) != (1, V):
        raise ValueError(f"a state block of shape [{V}, {K}] with strides ({sv}, {sk}) is not dense; "
                         "drift's pool layouts keep every [V, K] block dense")
    return torch.as_strided(t, t.shape, (*t.stride()[:-2], K, 1), t.storage_offset())
