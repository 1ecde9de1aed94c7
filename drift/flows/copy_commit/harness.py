"""What SGLang 0.5.23's update reads, for the update under test as ``self`` (docs/semantics.md §2):
``AscendHybridLinearAttnBackend``'s ``linear_attn_backend`` with its forward metadata and
``req_to_token_pool.get_speculative_mamba2_params_all_layers()``
(``srt/hardware_backend/npu/attention/ascend_hybrid_linear_attn_backend.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...sim.pool import StatePool
from ..base import Harness


@dataclass
class SpeculativeParams:
    """What ``req_to_token_pool.get_speculative_mamba2_params_all_layers()`` returns."""

    conv: list
    temporal: torch.Tensor
    intermediate_ssm: torch.Tensor
    intermediate_conv_window: list = field(default_factory=list)  # CUDA only; empty here


class _ForwardMetadata:
    __slots__ = ("mamba_cache_indices",)

    def __init__(self, mamba_cache_indices: torch.Tensor):
        self.mamba_cache_indices = mamba_cache_indices


class _ReqToTokenPool:
    __slots__ = ("_pool",)

    def __init__(self, pool: StatePool):
        self._pool = pool

    def get_speculative_mamba2_params_all_layers(self) -> SpeculativeParams:
        p = self._pool
        return SpeculativeParams(conv=[p.conv], temporal=p.temporal, intermediate_ssm=p.intermediate_ssm)


class _LinearAttnBackend:
    """The linear-attention backend the update reads (no ``__slots__``: an ``--update-factory`` may set
    what else the engine's update reads of it)."""

    # What HybridLinearAttnBackend.__init__ reads of its linear backend (sglang 0.5.23,
    # srt/layers/attention/hybrid_linear_attn_backend.py: __init__), at SGLang's own defaults
    # (base_attn_backend.py: AttentionBackend.needs_cpu_seq_lens = True; hybrid_linear_attn_backend.py:
    # MambaAttnBackendBase.supports_prefill_graph_extend -> False), so an engine's subclass is built
    # through its own constructor (README: The class built as the engine builds it).
    needs_cpu_seq_lens = True

    def __init__(self, forward_metadata: _ForwardMetadata, req_to_token_pool: _ReqToTokenPool):
        self.forward_metadata = forward_metadata
        self.req_to_token_pool = req_to_token_pool

    def supports_prefill_graph_extend(self) -> bool:
        return False


class SGLangHarness(Harness):
    """Stands in for ``AscendHybridLinearAttnBackend``: exactly what the SGLang method reads.

    ``self.linear_attn_backend.forward_metadata.mamba_cache_indices``: int32 ``[N]`` slot of
    each batch row; ``self.linear_attn_backend.req_to_token_pool
    .get_speculative_mamba2_params_all_layers()``: ``.conv`` (list), ``.temporal``,
    ``.intermediate_ssm``.
    """

    ATTRIBUTES = ("linear_attn_backend",)
    PROVIDED = ("self.linear_attn_backend.forward_metadata.mamba_cache_indices and "
                "self.linear_attn_backend.req_to_token_pool.get_speculative_mamba2_params_all_layers() "
                "(docs/semantics.md §2)")
    HOW_TO_PROVIDE = ("build your backend with --update-factory FILE.py:make (pytest: --drift-update-factory), "
                      "where make(harness) sets it as "
                      "the engine does, on your object or on harness.linear_attn_backend (README: The class built "
                      "as the engine builds it), or give the attribute a class-level default in your backend class")

    def __init__(self, pool: StatePool):
        self._drift_pool = pool
        self.linear_attn_backend = _LinearAttnBackend(
            _ForwardMetadata(pool.row_slots.to(torch.int32)), _ReqToTokenPool(pool))

    def objects(self) -> tuple:
        be = self.linear_attn_backend
        return (self, be, be.forward_metadata, be.req_to_token_pool)
