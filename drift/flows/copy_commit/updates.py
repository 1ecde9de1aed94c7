"""Named parts of ``update_mamba_state_after_mtp_verify``, and the recipe that assembles them.

SGLang's Ascend method (``AscendHybridLinearAttnBackend.update_mamba_state_after_mtp_verify``,
``sglang/srt/hardware_backend/npu/attention/ascend_hybrid_linear_attn_backend.py``, 0.5.23) does
four things in order, and every version drift models differs from another in one of them:

1. **read the backend** (:func:`read_backend`): the slot of each batch row, the pool tensors,
   the source rows ``arange(N)``, the steps as int64;
2. **commit** the state after the last accepted draft step into each row's slot
   (``move_intermediate_cache``);
3. **track** prefix-cache snapshots: the state at the track boundary into the track slot, and
   the verify-time conv window with it;
4. **roll back** the conv windows of the working and the track slots (``conv_state_rollback``).

Each part is a function of one :class:`Batch`; :class:`Recipe` names the parts and builds a
function with the method's signature. Kernels come from
``sgl_kernel_npu.mamba.mamba_state_update_triton`` (:mod:`drift.sim.shim`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from ...sim.shim import sgl_kernels


@dataclass
class Batch:
    """What the parts read, as the SGLang method derives it from its arguments and ``self``.

    dst int64 ``[N]`` the slot of each row (``mamba_cache_indices[:N]``); src int64 ``[N]`` =
    ``arange(N)``, the scratch row of each batch row; last int64 ``[N]`` accepted draft step
    (-1: padded row); conv ``[L, slots, W, C]``, ssm ``[L, slots, HV, V, K]``, inter
    ``[L, rows + 1, D, HV, V, K]``; track / steps int64 ``[N]`` or None (tracking off).
    """

    k: object  # the kernel module
    dst: torch.Tensor
    src: torch.Tensor
    last: torch.Tensor
    conv: torch.Tensor
    ssm: torch.Tensor
    inter: torch.Tensor
    track: Optional[torch.Tensor]
    steps: Optional[torch.Tensor]

    @property
    def D(self) -> int:
        return self.inter.shape[2]


def read_backend(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track) -> Batch:
    """Part 1: what the method reads from ``self`` and its arguments."""
    N = last_correct_step_indices.shape[0]
    dst = self.linear_attn_backend.forward_metadata.mamba_cache_indices[:N].to(torch.int64)
    caches = self.linear_attn_backend.req_to_token_pool.get_speculative_mamba2_params_all_layers()
    src = torch.arange(N, device=dst.device, dtype=torch.int64)
    track = steps = None
    if mamba_track_indices is not None:
        track, steps = mamba_track_indices.to(torch.int64), mamba_steps_to_track.to(torch.int64)
    return Batch(sgl_kernels(), dst, src, last_correct_step_indices.to(torch.int64), caches.conv[0],
                 caches.temporal, caches.intermediate_ssm, track, steps)


# ------------------------------------------------------------------ commit
def commit_all(b: Batch) -> None:
    """Commit every row; the kernel skips rows whose step is < 0 on the device (no sync)."""
    b.k.move_intermediate_cache(b.ssm, b.inter, b.dst, b.src, b.last)


def commit_unless_all_step0(b: Batch) -> None:
    """sglang #31659's precision guard: skip the commit when every row accepted only its root."""
    all_step0 = (b.last == 0).all().item()  # .item(): a host-device sync on every decode step
    if not all_step0:
        commit_all(b)


# ------------------------------------------------------------------- track
def track_device_select(b: Batch) -> None:
    """SGLang 0.5.23: snapshot every row's track step (rows with step -1 are skipped by the
    kernel) and copy the verify-time conv window into the track slot, selecting the source
    with ``torch.where`` (an untracked row copies its track slot onto itself): no sync."""
    b.k.move_intermediate_cache(b.ssm, b.inter, b.track, b.src, b.steps)
    conv_src = torch.where(b.steps >= 0, b.dst, b.track)
    b.conv[:, b.track] = b.conv[:, conv_src]


def track_boolean_mask(b: Batch) -> None:
    """sglang #31659 / #32130: the tracked rows selected with a boolean mask."""
    b.k.move_intermediate_cache(b.ssm, b.inter, b.track, b.src, b.steps)
    mask = b.steps >= 0
    track_sel = b.track[mask]  # boolean-mask indexing: a nonzero, a host-device sync
    if track_sel.numel() > 0:
        b.conv[:, track_sel] = b.conv[:, b.dst[mask]]


# ---------------------------------------------------------------- rollback
def rollback_rows(b: Batch) -> None:
    """Roll the working slots back to their accepted token, then the track slots to theirs."""
    if b.dst.numel() > 0:
        b.k.conv_state_rollback(b.conv, b.dst, b.last, b.D)
    if b.track is not None and b.track.numel() > 0:
        b.k.conv_state_rollback(b.conv, b.track, b.steps, b.D)


# ------------------------------------------------------------------ recipe
Part = Callable[[Batch], None]


@dataclass(frozen=True)
class Recipe:
    """An update as its three varying parts (reading the backend is the same in all)."""

    commit: Part = commit_all
    track: Part = track_device_select
    rollback: Part = rollback_rows

    def but(self, **parts: Part) -> "Recipe":
        """This recipe with some parts replaced (a mutant differs from its base in one)."""
        return replace(self, **parts)

    def build(self, name: str, doc: str) -> Callable:
        """A function with the SGLang method's signature, ``self`` being the backend."""
        recipe = self

        def update(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track,
                   model=None, req_pool_indices=None):
            b = read_backend(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track)
            recipe.commit(b)
            if b.track is not None:
                recipe.track(b)
            recipe.rollback(b)

        update.__name__ = update.__qualname__ = name
        update.__doc__ = doc
        update.recipe = recipe  # type: ignore[attr-defined]
        return update


# The versions drift models, each the released method with the part that differs (docs/semantics.md §2).
SGLANG_0523 = Recipe()
SGLANG_32130 = SGLANG_0523.but(track=track_boolean_mask)
SGLANG_31659 = SGLANG_32130.but(commit=commit_unless_all_step0)
