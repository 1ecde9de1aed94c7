"""The kernel-commit flow kind: SGLang 0.5.23's ReplaySSM spec verify, a ring of per-token records that
the commit folds into the checkpoint (docs/semantics.md §6). Its flow and built-in update are
registered here."""

from ..registry import FLOW_KINDS, FLOWS, UPDATES, BuiltinUpdate, Flow
from .flow import KernelCommitFlow
from .updates import sglang_0523_replayssm

FLOW_KINDS.register(KernelCommitFlow.name, KernelCommitFlow)

FLOWS.register("sglang-replayssm", Flow(
    "sglang-replayssm", "SGLang's ReplaySSM kernel-side commit (--enable-linear-replayssm-spec): the verify "
    "writes each draft token's compact record (delta, key, log-decay) into a per-request ring and keeps no "
    "per-token state; the commit advances the ring's cursors by the accept length and folds the accepted "
    "records into the checkpoint (every step for a 16-bit checkpoint, when the ring fills for fp32)",
    "SGLang 0.5.23 (CUDA Triton; NPU and CPU fall back to the recurrent verify)",
    ("sglang/kernels/ops/attention/linear/gdn_replayssm_spec_decode.py: gdn_replayssm_spec_circular_kernel, "
     "commit_gdn_replayssm_spec, commit_gdn_replayssm_circular",
     "sglang/srt/speculative/spec_utils.py: commit_mamba_states_after_verify",
     "sglang/srt/layers/attention/linear/gdn_backend.py: _replayssm_target_verify",
     "sglang/srt/mem_cache/memory_pool.py: MambaPool (the ring buffers and cursors)"), kind=KernelCommitFlow.name))

UPDATES.register("sglang-0.5.23-replayssm", BuiltinUpdate(
    "sglang-0.5.23-replayssm", "SGLang 0.5.23's ReplaySSM commit: advance the ring cursors by the accept length, "
    "fold the accepted records into the checkpoint, restart the ring, roll the conv window back "
    "(drift/flows/kernel_commit/updates.py)", sglang_0523_replayssm, (KernelCommitFlow.name,), default=True))
