"""The flow kinds: how an engine keeps MTP state from one verify step to the next (docs/semantics.md §6).

Each entry of :data:`drift.config.FLOWS` names its ``kind``; :data:`FLOW_KINDS` maps it to the
class of its package (``drift/flows/<kind>/``).
"""

from __future__ import annotations

import torch

from ..config import FLOWS, Config
from .copy_commit.flow import CopyCommitFlow
from .in_place.flow import InPlaceBlockFlow
from .kernel_commit.flow import KernelCommitFlow

FLOW_KINDS = {"copy-commit": CopyCommitFlow, "in-place": InPlaceBlockFlow, "kernel-commit": KernelCommitFlow}


def state_flow(cfg: Config, device: torch.device, mode: str = "mtp") -> CopyCommitFlow:
    """The state flow ``cfg.flow`` on ``device``: its pool, harness and verify arguments. Sequential
    decode (no drafts) keeps one state per request however the engine keeps MTP state: a plain pool."""
    if mode != "mtp":
        return CopyCommitFlow(cfg, device)
    return FLOW_KINDS[FLOWS[cfg.flow].kind](cfg, device)


def flow_kind(cfg: Config) -> type:
    return FLOW_KINDS[FLOWS[cfg.flow].kind]
