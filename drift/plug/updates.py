"""The built-in implementations of ``update_mamba_state_after_mtp_verify``, named after what they model.

Each is a :class:`~drift.flows.copy_commit.updates.Recipe` of named parts, called as SGLang's Ascend backend
calls the method: ``fn(backend, last_correct_step_indices, mamba_track_indices,
mamba_steps_to_track, model=None, req_pool_indices=None)``.

- ``sglang-31659``: sglang #31659 (merged 2026-07-18). A precision guard
  ``(last_steps == 0).all().item()`` skips the commit when every row accepted only its root:
  a host sync on every step, and a lost token update whenever it fires (never while the batch
  carries a padded row, whose step is -1). Tracking selects rows with a boolean mask.
- ``sglang-32130``: sglang #32130 (merged 2026-07-23). The guard removed; the tracking path
  still selects tracked rows with a boolean mask (``t[mask]`` is a nonzero: a sync on every
  step with tracking on).
- ``sglang-0.5.23``: the method as SGLang 0.5.23 ships it: tracking by ``torch.where`` and an
  unconditional copy (a self-copy for untracked rows); no sync anywhere. The copy-commit flows' default.
- ``vllm-0.33.0``: vLLM 0.33.0's per-step bookkeeping of the in-place block flow (``--flow vllm``,
  whose default it is): the accept count and the state indices the next verify reads
  (drift/flows/in_place/updates.py).
- ``sglang-0.5.23-replayssm``: SGLang 0.5.23's ReplaySSM commit (``--flow sglang-replayssm``, whose
  default it is): advance the ring cursors by the accept length, fold the accepted records into
  the checkpoint, restart the ring, roll the conv window back (drift/flows/kernel_commit/updates.py).
"""

from __future__ import annotations

from typing import Callable

from ..config import FLOWS
from ..errors import LoadError

from ..flows.copy_commit.updates import Recipe, commit_unless_all_step0, track_boolean_mask
from ..flows.kernel_commit.updates import sglang_0523_replayssm
from ..flows.in_place.updates import vllm_0330

SGLANG_0523 = Recipe()
SGLANG_32130 = SGLANG_0523.but(track=track_boolean_mask)
SGLANG_31659 = SGLANG_32130.but(commit=commit_unless_all_step0)

BUILTINS: dict[str, Callable] = {
    "sglang-31659": SGLANG_31659.build(
        "sglang-31659", "sglang #31659: precision guard with .item(); boolean-mask tracking."),
    "sglang-32130": SGLANG_32130.build(
        "sglang-32130", "sglang #32130: guard removed; tracking still selects rows with a boolean mask."),
    "sglang-0.5.23": SGLANG_0523.build(
        "sglang-0.5.23", "SGLang 0.5.23: device-side tracking by torch.where; no sync."),
    "vllm-0.33.0": vllm_0330,
    "sglang-0.5.23-replayssm": sglang_0523_replayssm,
}
# The state-flow kind (drift/flows/registry.py) each built-in is written for: the harness it gets as self.
BUILTIN_KINDS: dict[str, str] = {"sglang-31659": "copy-commit", "sglang-32130": "copy-commit",
                                 "sglang-0.5.23": "copy-commit", "vllm-0.33.0": "in-place",
                                 "sglang-0.5.23-replayssm": "kernel-commit"}
DEFAULT_UPDATE = "sglang-0.5.23"


def check_flow(update_name: str, flow: str) -> None:
    """LoadError (exit 2) when built-in ``update_name`` is written for another kind of state flow than
    ``flow``'s: its harness would lack what it reads. Plug-ins are not judged here (the harness
    says what it lacks when they read it)."""
    kind = BUILTIN_KINDS.get(update_name)
    if kind is not None and kind != FLOWS[flow].kind:
        mine = ", ".join(f for f in FLOWS if FLOWS[f].kind == kind)
        raise LoadError(f"update {update_name} is written for the {kind} flows ({mine}), not for --flow {flow} "
                        f"({FLOWS[flow].kind}): pass --flow {mine.split(', ')[0]}, or an update of "
                        f"{flow}'s kind ({', '.join(builtins_of(FLOWS[flow].kind))})")


def builtins_of(kind: str) -> tuple[str, ...]:
    """The built-ins written for state-flow kind ``kind``, in table order."""
    return tuple(n for n in BUILTINS if BUILTIN_KINDS[n] == kind)
# Names earlier drift releases used, for a message that points at the new one.
RENAMED = {"guarded": "sglang-31659", "sync_free": "sglang-32130", "device_select": "sglang-0.5.23"}
