"""The NPU verify op adapter: drift's verify-kernel arguments laid out as the Ascend op takes them.

A verify kernel has the signature of :func:`drift.sim.kernels.gdn_verify` (:data:`VerifyKernel`).
:func:`npu_op_adapter` wraps a callable with the Ascend op's signature into one.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..devices import npu_available
from ..errors import LoadError
from ..sim.kernels import VerifyKernel

BF16 = torch.bfloat16


def npu_op_adapter(op: Callable) -> VerifyKernel:
    """Map drift's verify-kernel arguments onto the layout of the Ascend op
    ``npu_recurrent_gated_delta_rule(query, key, value, state, *, beta, scale,
    actual_seq_lengths, ssm_state_indices, num_accepted_tokens, g, gk)``.

    Per layer: T = N * D tokens; query/key ``[T, HV, K]`` (key heads already repeated, so
    N_k = N_v), value ``[T, HV, V]``, beta ``[T, HV]`` and the state blocks in bf16 (the op's
    only dtype), g ``[T, HV]`` float32; state ``[T, HV, V, K]`` (the op's [BlockNum, N_v, D_v,
    D_k]) with token t's block = ``t``; the committed state of row n is placed in the block
    of its first token, which the op reads when ``num_accepted_tokens`` is None, and every
    block holds the state after its token when the op returns. ``scale`` is 1 (q arrives
    scaled). The op rounds to bf16 itself: ``rounding`` is not used.
    """

    def verify(state_kv, slots, q, k, v, g, beta, inter_kv, rounding="rne", key=0, **_):
        L, N, D, HV, K = q.shape
        V = v.shape[-1]
        T = N * D
        dev = q.device
        out = torch.empty(L, N, D, HV, V, dtype=torch.float32, device=dev)
        lengths = torch.full((N,), D, dtype=torch.int32, device=dev)
        indices = torch.arange(T, dtype=torch.int32, device=dev)
        slots64 = slots.to(torch.int64)
        for l in range(L):
            blocks = torch.empty(N, D, HV, V, K, dtype=BF16, device=dev)
            blocks[:, 0] = state_kv[l].index_select(0, slots64).transpose(-1, -2).to(BF16)
            o = op(q[l].reshape(T, HV, K).to(BF16), k[l].reshape(T, HV, K).to(BF16),
                   v[l].reshape(T, HV, V).to(BF16), blocks.view(T, HV, V, K),
                   beta=beta[l].reshape(T, HV).to(BF16), scale=1.0, actual_seq_lengths=lengths,
                   ssm_state_indices=indices, num_accepted_tokens=None,
                   g=g[l].reshape(T, HV).to(torch.float32), gk=None)
            inter_kv[l, :N] = blocks.transpose(-1, -2).to(inter_kv.dtype)
            out[l] = o.reshape(N, D, HV, V).to(torch.float32)
        return out

    verify.__name__ = f"npu_op_adapter({getattr(op, '__name__', op)!s})"
    return verify


def torch_npu_op() -> Callable:
    if not npu_available():
        raise LoadError("--drift-kernel npu needs torch_npu with an NPU present; on other machines use "
                        "npu-op:<spec> with a CPU stand-in of the op")
    import torch_npu  # noqa: F401

    op = getattr(torch_npu, "npu_recurrent_gated_delta_rule", None)
    if op is None:
        raise LoadError("this torch_npu has no npu_recurrent_gated_delta_rule; upgrade torch_npu")
    return op
