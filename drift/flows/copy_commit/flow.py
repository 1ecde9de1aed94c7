"""SGLang 0.5.23's copy-commit flow (the ``sglang`` and ``npu-accepted`` flows; docs/semantics.md §6).

The verify writes every token's state into a scratch buffer (:class:`~drift.flows.copy_commit.rule.NpuRule`)
and ``update_mamba_state_after_mtp_verify`` copies the accepted one into the committed pool and
rolls the conv window back (:class:`~drift.sim.pool.StatePool`,
:class:`~drift.flows.copy_commit.harness.SGLangHarness`, :class:`~drift.flows.copy_commit.backend.VerifyArgsBuilder`).
"""

from __future__ import annotations

import numpy as np
import torch

from ...dtypes import as_bits
from ...sim import kernels
from ...sim.pool import StatePool
from ..base import MambaPoolFlow
from . import naive
from .backend import VerifyArgsBuilder
from .harness import SGLangHarness
from .rule import NpuRule


class CopyCommitFlow(MambaPoolFlow):
    """A scratch per verify and a commit copy (the ``sglang`` and ``npu-accepted`` flows)."""

    name = "copy-commit"
    RULE, POOL, HARNESS = NpuRule, StatePool, SGLangHarness
    SERVES = True  # requests come and go through SGLang 0.5.23's bookkeeping (drift/flows/slots.py)
    SETTINGS = {"accept_counts": "pass the op the previous step's accept lengths (the npu-accepted flow), not ones"}
    naive_update = staticmethod(naive.update)
    naive = staticmethod(naive.verify)
    STATE_BYTES = ("per active request and layer: read the committed state once, write D intermediate "
                   "states, the commit copy (read 1 + write 1), all in the state dtype")

    @classmethod
    def bench_state_bytes(cls, cfg) -> dict[str, int]:
        state = cfg.num_requests * cfg.num_layers * cfg.num_v_heads * cfg.head_k_dim * cfg.head_v_dim * cfg.torch_ssm_dtype.itemsize
        return {"state_read": state, "intermediates_write": cfg.num_draft_tokens * state, "commit_copy": 2 * state}

    def __init__(self, cfg, device: torch.device):
        super().__init__(cfg, device)
        self.args = VerifyArgsBuilder(cfg, self.pool, self.rule, bool(self.settings.get("accept_counts", False)))

    def verify_args(self, mix, beta, g, rounding: str, key: int, drafts=None, gate=None) -> kernels.VerifyArgs:
        """SGLang's Ascend backend's arguments (every row verifies D tokens in these flows)."""
        return self.args.build(mix, beta, g, rounding, key, gate)

    def after_verify(self, last: torch.Tensor) -> None:
        self.args.accepted(last)

    def arranged(self, lanes_of_rows: np.ndarray, moved_from: np.ndarray) -> None:
        """SGLang rebuilds the step's mamba indices from the batch's request rows every step
        (``MambaAttnBackendBase._forward_metadata``; graph mode: ``_replay_metadata`` rewrites the whole
        ``[:bs]`` buffer, padded rows included): the verify's ``cache_indices`` and the update's
        ``forward_metadata.mamba_cache_indices`` are the rows' slots now. The npu-accepted form's accept
        counts follow their request to its row (1 for a request that starts)."""
        idx = self.pool.row_slots.to(torch.int32)
        self.args.cache_indices.copy_(idx)
        self.harness.linear_attn_backend.forward_metadata.mamba_cache_indices.copy_(idx)
        self.args.follow(moved_from)

    def serving_buffers(self) -> dict[str, torch.Tensor]:
        return {**super().serving_buffers(), "cache_indices": self.args.cache_indices,
                "mamba_cache_indices": self.harness.linear_attn_backend.forward_metadata.mamba_cache_indices}

    def tracked_snapshot(self, track: np.ndarray) -> tuple:
        """The track slots, compared bit for bit with the scratch block each was copied from."""
        pool = self.pool
        rows = np.nonzero(track >= 0)[0]  # lanes
        tslots, windows = self.track_windows(torch.from_numpy(rows).to(pool.device))
        got = pool.states.index_select(1, tslots)  # [L, n, HV, V, K] in the state dtype
        batch_rows = torch.from_numpy(self.lane_rows_host[rows]).to(pool.device)  # the scratch is per batch row
        held = pool.scratch[:, batch_rows, torch.from_numpy(track[rows]).to(pool.device)]
        bits_bad = (as_bits(got) != as_bits(held)).sum((0, 2, 3, 4))
        return rows, got, windows, bits_bad, None

    def buffers(self) -> list[torch.Tensor]:
        return [self.args.prev_accept]

    def state_dict(self) -> dict:
        return {"verify_args": self.args.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.args.load_state_dict(state.get("verify_args"))
