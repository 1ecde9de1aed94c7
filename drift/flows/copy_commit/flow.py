"""SGLang's copy-commit state flow (the ``sglang`` and ``npu-accepted`` entries of
:data:`drift.config.FLOWS`; docs/semantics.md §6): the base every flow kind builds on.

The verify writes every token's state into a scratch buffer and ``update_mamba_state_after_mtp_verify``
copies the accepted one into the committed pool and rolls the conv window back
(:class:`~drift.sim.pool.StatePool`, :class:`~drift.sim.pool.Harness`,
:class:`~drift.flows.copy_commit.backend.VerifyArgsBuilder`). The other kinds (:mod:`drift.flows.registry`,
:mod:`drift.flows.kernel_commit.flow`) subclass :class:`CopyCommitFlow`.
"""

from __future__ import annotations

import numpy as np
import torch

from ...config import Config
from ...dtypes import as_bits
from ...sim import kernels
from ...sim.pool import STALE, Harness, StatePool
from .backend import VerifyArgsBuilder


class CopyCommitFlow:
    """SGLang's copy-commit flow (the ``sglang`` and ``npu-accepted`` entries)."""

    kind = "copy-commit"
    start_rule = "npu"  # how the verify op reads its arguments (drift.sim.kernels.START_RULES)
    tracks = True  # prefix-cache tracking copies (docs/semantics.md §7)
    default_update = "sglang-0.5.23"
    POOL, HARNESS = StatePool, Harness  # what a subclass keeping this flow's verify arguments swaps

    def __init__(self, cfg: Config, device: torch.device):
        self.cfg = cfg
        self.pool = self.POOL(cfg, device)
        self.harness = self.HARNESS(self.pool)
        self.args = VerifyArgsBuilder(cfg, self.pool)

    def verify_args(self, mix, beta, g, rounding: str, key: int, drafts=None, gate=None) -> kernels.VerifyArgs:
        """The verify op's arguments (drafts: every row verifies D tokens in these flows; gate: the raw
        gate inputs, :class:`~drift.sim.kernels.VerifyArgs`)."""
        return self.args.build(mix, beta, g, rounding, key, gate)

    def after_verify(self, last: torch.Tensor) -> None:
        self.args.accepted(last)

    def conv_verify(self, x: torch.Tensor, weight: torch.Tensor, drafts=None) -> torch.Tensor:
        return kernels.conv_verify(self.pool.conv, self.pool.row_slots, x, weight)

    def load_start(self, stored: torch.Tensor, window: torch.Tensor) -> None:
        """The starting state as prefill leaves it: stored once in the state dtype, the conv
        window at the end of the buffer, the first D-1 rows stale (NaN: a read of them shows)."""
        cfg, pool = self.cfg, self.pool
        slots = pool.active_slots
        pool.states[:, slots] = stored
        W, Km1 = cfg.conv_window, cfg.conv_kernel - 1
        buf = torch.full((cfg.num_layers, cfg.num_requests, W, cfg.conv_channels), STALE,
                         dtype=pool.conv.dtype, device=pool.device)
        buf[:, :, W - Km1:] = window.to(pool.device, pool.conv.dtype)
        pool.conv[:, slots] = buf
        pool.temporal[:, pool.row_track_slots[: cfg.num_requests]] = STALE
        pool.conv[:, pool.row_track_slots[: cfg.num_requests]] = STALE

    def touched(self, track_host: np.ndarray, drafts_host: np.ndarray | None = None) -> np.ndarray:
        """``[count, S]`` bool: the slots the update may write at each step (the request slots,
        and the track slot of a row tracked that step); ``track_host`` ``[count, R]`` host int
        (-1 = not tracked); ``drafts_host`` (the tokens each row verifies) is not needed here."""
        pool = self.pool
        t = np.zeros((track_host.shape[0], self.pool.temporal.shape[1]), dtype=bool)
        t[:, pool.request_slots] = True
        rows, idx = np.nonzero(track_host >= 0)
        t[rows, pool.track_slots[idx]] = True
        return t

    def committed_states(self) -> torch.Tensor:
        """``[L, R, HV, V, K]``: the state each request's next verify starts from (a view or a gather)."""
        return self.pool.states[:, self.pool.active_slots]

    def committed_windows(self) -> torch.Tensor:
        """``[L, R, Kc-1, C]``: the conv inputs each request's next verify reads."""
        cfg, pool = self.cfg, self.pool
        return pool.conv[:, pool.active_slots, cfg.conv_window - (cfg.conv_kernel - 1):]

    def tracked_snapshot(self, track: np.ndarray) -> tuple:
        """What the rows tracked this step (``track [R]`` host int, -1 = none) hold in their track
        slots now: ``(rows [n], states [L, n, HV, V, K], windows [L, n, Kc-1, C], bit mismatches [n]
        of each tracked state against the scratch block it was copied from)``."""
        cfg, pool = self.cfg, self.pool
        rows = np.nonzero(track >= 0)[0]
        rows_t = torch.from_numpy(rows).to(pool.device)
        tslots = pool.row_track_slots[rows_t]
        got = pool.states[:, tslots]  # [L, n, HV, V, K] in the state dtype
        held = pool.scratch[:, rows_t, torch.from_numpy(track[rows]).to(pool.device)]
        bits_bad = (as_bits(got) != as_bits(held)).sum((0, 2, 3, 4))
        Km1 = cfg.conv_kernel - 1
        return rows, got.clone(), pool.conv[:, tslots, cfg.conv_window - Km1:].clone(), bits_bad

    def buffers(self) -> list[torch.Tensor]:
        """The persistent tensors a decode step writes besides the pool's (a captured step replays them)."""
        return [self.args.prev_accept]

    def state_dict(self) -> dict:
        return {"verify_args": self.args.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.args.load_state_dict(state.get("verify_args"))


def lacks(harness, name: str, what: str):
    """The AttributeError of a flow's harness for an attribute it lacks: names the attribute, what the
    harness provides (``harness.PROVIDED``) and how to provide more (``harness.HOW_TO_PROVIDE``);
    its ``obj`` is the harness, so a caller can tell "drift lacks it" from a bug of the update."""
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(f"the update under test read self.{name}, which drift's {what} harness does not provide; "
                         f"it provides {harness.PROVIDED}. To provide it: {harness.HOW_TO_PROVIDE}.",
                         name=name, obj=harness)
