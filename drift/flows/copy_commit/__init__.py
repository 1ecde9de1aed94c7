"""The copy-commit flow kind: SGLang 0.5.23's scratch per verify and commit copy (docs/semantics.md §6).

The verify writes every token's state into a scratch buffer (:mod:`.rule`); the update under test,
``update_mamba_state_after_mtp_verify`` (:mod:`.updates`), copies the accepted one into the committed
pool, tracks prefix-cache snapshots and rolls the conv window back (:mod:`.flow`, :mod:`.harness`,
:mod:`.backend`). Its flows and built-in updates are registered here.
"""

from ..registry import FLOW_KINDS, FLOWS, UPDATES, BuiltinUpdate, Flow
from .flow import CopyCommitFlow
from .updates import SGLANG_0523, SGLANG_31659, SGLANG_32130

FLOW_KINDS.register(CopyCommitFlow.name, CopyCommitFlow)

FLOWS.register("sglang", Flow(
    "sglang", "SGLang's copy-commit: num_accepted_tokens = ones and ssm_state_indices = arange, so every "
    "row starts from its committed state; update_mamba_state_after_mtp_verify copies the accepted "
    "scratch state into it", "SGLang 0.5.23 (Ascend NPU)",
    ("srt/hardware_backend/npu/attention/ascend_gdn_backend.py: prepare_gdn_inputs",
     "srt/hardware_backend/npu/attention/ascend_hybrid_linear_attn_backend.py: _replay_metadata, "
     "update_mamba_state_after_mtp_verify"), kind=CopyCommitFlow.name))
FLOWS.register("npu-accepted", Flow(
    "npu-accepted", "the NPU op's accepted-count argument form (a row continues from the previous step's "
    "scratch block; one that accepted one token from its committed state) under SGLang's commit copy: "
    "a hybrid no engine drift has read runs", "none: SGLang 0.5.23 passes ones; vLLM 0.33.0 has no commit copy",
    ("sgl-kernel-npu: the op's num_accepted_tokens / ssm_state_indices arguments (docs/semantics.md §5-§6)",),
    kind=CopyCommitFlow.name, settings={"accept_counts": True}))

for _name, _recipe, _doc, _default in (
    ("sglang-31659", SGLANG_31659, "sglang #31659: precision guard with .item(); boolean-mask tracking.", False),
    ("sglang-32130", SGLANG_32130, "sglang #32130: guard removed; tracking still selects rows with a boolean mask.",
     False),
    ("sglang-0.5.23", SGLANG_0523, "SGLang 0.5.23: device-side tracking by torch.where; no sync.", True),
):
    UPDATES.register(_name, BuiltinUpdate(_name, _doc, _recipe.build(_name, _doc), (CopyCommitFlow.name,), _default))
