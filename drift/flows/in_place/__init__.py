"""The in-place flow kind: vLLM 0.33.0's state cache of blocks, written in place by the verify, the
accept count picking the next start block (docs/semantics.md §6). Its flow and built-in update
are registered here."""

from ..registry import FLOW_KINDS, FLOWS, UPDATES, BuiltinUpdate, Flow
from .flow import InPlaceBlockFlow
from .updates import vllm_0330

FLOW_KINDS.register(InPlaceBlockFlow.name, InPlaceBlockFlow)

FLOWS.register("vllm", Flow(
    "vllm", "vLLM's in-place block flow: each request owns D blocks of one state cache; token t's state is "
    "written in place to block idx[b, t], the next step starts from idx[b, n - 1] (n the accept count), "
    "with no commit copy; the conv cache is read at offset n - 1; padded rows carry NULL block 0",
    "vLLM 0.33.0 (CUDA; vllm-ascend follows its flow)",
    ("vllm/v1/attention/backends/gdn_attn.py: GDNAttentionMetadataBuilder.build",
     "vllm/v1/worker/gpu_model_runner.py: _update_states_after_model_execute",
     "vllm/third_party/flash_linear_attention/ops/fused_recurrent.py",
     "vllm/model_executor/layers/mamba/ops/causal_conv1d.py: causal_conv1d_update",
     "vllm/v1/worker/mamba_utils.py: postprocess_mamba_fused_kernel (prefix caching, align mode)",
     "vllm/v1/worker/mamba_utils.py: preprocess_mamba (serving lifecycle: the running state's migration)",
     "vllm/v1/worker/gpu_input_batch.py: InputBatch.add_request, condense (serving lifecycle)",
     "vllm/v1/attention/backends/utils.py: mamba_get_block_table_tensor (serving lifecycle)",
     "vllm/v1/core/single_type_kv_cache_manager.py: MambaManager, align mode (serving lifecycle)",
     "vllm/v1/core/block_pool.py: BlockPool (serving lifecycle)"),
    kind=InPlaceBlockFlow.name, ragged=True))

UPDATES.register("vllm-0.33.0", BuiltinUpdate(
    "vllm-0.33.0", "vLLM 0.33.0's per-step bookkeeping: the accept count, the state indices the next verify "
    "reads, prefix caching's align copy (drift/flows/in_place/updates.py)", vllm_0330, (InPlaceBlockFlow.name,),
    default=True))
