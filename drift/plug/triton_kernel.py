"""SGLang's Triton MTP verify kernel (its CUDA path) as a drift verify kernel: ``--kernel sglang-triton``.

SGLang 0.5.23 ``kernels/ops/attention/fla/fused_recurrent.py:
fused_recurrent_gated_delta_rule_update`` (docs/semantics.md §9) takes q, k ``[B, T, HK, K]``,
v ``[B, T, HV, V]``, g and beta ``[B, T, HV]`` (beta post-sigmoid), an initial-state source
``[slots, HV, V, K]`` with per-row indices, and with ``intermediate_states_buffer`` it writes the
state after every token to ``buffer[intermediate_state_indices[b] * cache_steps + t]``
(``[.., HV, V, K]`` blocks, stored with Triton's cast to the buffer's dtype). The adapter calls
it per layer with:

* ``initial_state_source`` = each row's start block gathered into a contiguous ``[B, HV, V, K]``
  tensor (the committed state ``temporal[slot]`` in SGLang's flow, the previous step's scratch
  block in the npu-accepted flow: ``args.plan()``) and
  ``initial_state_indices = arange(B)`` (int32): the same start states as the committed states
  with the slots as indices, read without a host sync so a captured step can replay it;
* ``disable_state_update=True``; ``intermediate_states_buffer`` a contiguous ``[B, D, HV, V, K]``
  buffer, ``intermediate_state_indices = arange(B)``, ``cache_steps = D``; the buffer is copied
  into drift's scratch blocks afterwards, so no write is lost to a layout;
* q and k L2-normalised by drift in fp32 with the op's formula, q times the scale, passed with
  ``scale=1.0`` and ``use_qk_l2norm_in_kernel=False``; v, g in fp32; beta = sigmoid(b) in fp32.

It needs an installed ``sglang`` whose package imports; on a CPU under ``TRITON_INTERPRET=1``
drift imports it over a ``--no-deps`` install with SGLang's server stubbed and the interpreter's
stores mended to round to nearest (drift/plug/triton_interpreter.py; slow: a few steps).
"""

from __future__ import annotations

import torch

from ..sim.kernels import VerifyArgs
from .adapter import FlaKernelAdapter


class TritonAdapter(FlaKernelAdapter):
    """Calls SGLang's Triton kernel per layer (the mapping above)."""

    MODULE = "sglang.kernels.ops.attention.fla.fused_recurrent"
    FUNCTION = "fused_recurrent_gated_delta_rule_update"
    KERNEL, ENGINE = "sglang-triton", "sglang (0.5.23 was modelled)"

    def indices(self, args: VerifyArgs, device: torch.device) -> torch.Tensor:
        return torch.arange(args.dims[1], dtype=torch.int32, device=device)  # start states and buffer rows

    def call_op(self, args: VerifyArgs, layer: int, qkvgb: tuple, rows: torch.Tensor) -> torch.Tensor:
        q, k, v, g, beta = qkvgb
        L, B, S, HV, V, K = args.dims
        buf = torch.empty(B, S, HV, V, K, dtype=args.intermediate_state.dtype, device=q.device)
        o = self.op(q, k, v, g, beta=beta, scale=1.0, initial_state_source=self.start_states(args, layer),
                    initial_state_indices=rows, use_qk_l2norm_in_kernel=False, disable_state_update=True,
                    intermediate_states_buffer=buf, intermediate_state_indices=rows, cache_steps=S)
        self.write_back(args, layer, buf.view(B * S, HV, V, K))
        return o
