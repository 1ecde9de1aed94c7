"""vllm-ascend's GDN verify op in vLLM's block flow (--flow vllm): ``--kernel vllm-ascend`` (an NPU) and
``--kernel vllm-ascend-op:<module|file.py>:<qualname>`` (any callable with its signature: a
stand-in, or a new build).

vllm-ascend 0.23.0.post1 (``vllm_ascend/ops/gdn.py: _forward_core``, the spec rows) calls its own
AscendC op (``csrc/attention/recurrent_gated_delta_rule``), per GDN layer::

    torch.ops._C_ascend.npu_recurrent_gated_delta_rule(
        query=l2norm_fwd(q),            # [T, H, K], L2-normalised by vLLM's l2norm_fwd, stored in
        key=l2norm_fwd(k),              #   the activation dtype (bf16)
        value=v,                        # [T, HV, V] bf16
        g=g, beta=beta,                 # [T, HV]: g fp32 log-decay; beta = sigmoid(b) stored in b's
                                        #   dtype (bf16: ops/triton/fused_gdn_gating.py, beta_output)
        state=ssm_state,                # the layer's state cache [blocks, HV, V, K], written in place
        scale=K ** -0.5,
        actual_seq_lengths=...,         # int32 [B + 1]: the first token's offset, then each row's
                                        #   token count (ops/gdn_attn_builder.py: _build_actual_seq_lengths);
                                        #   a padded graph row has 0 (and accept count 0)
        ssm_state_indices=spec_state_indices_tensor.flatten(),  # int32 [B * (num_spec + 1)], read
                                        #   by packed token position: seq0 + t
        num_accepted_tokens=...)        # int32 [B]
    -> bf16 [T, HV, V]

Its kernel (``op_kernel/recurrent_gated_delta_rule.h: Process, ProcessHead, Compute``) starts row b
from ``state[ssm_state_indices[seq0 + n - 1]]``, runs its tokens in fp32 (``exp(g)`` decay, the
delta rule, ``q * scale``) and stores the state after token ``t`` at ``ssm_state_indices[seq0 + t]``
(round to nearest): vLLM's block rule (docs/semantics.md §6), without a NULL-block skip.
The adapter makes exactly that call, layer by layer, on drift's ``vllm`` flow (each row's own tokens
packed by its length, as :func:`drift.plug.vllm_kernel.varlen` packs them, and the index table
flattened unpacked, as vllm-ascend passes it: under ``--drafts ragged`` a short row shifts the next
rows' indices, docs/semantics.md §6; a row on vLLM's NULL block, drift's padded row, passed as
vllm-ascend's builder pads one: 0 tokens, accept count 0).
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch

from ..devices import npu_available
from ..errors import LoadError
from ..sim.kernels import VerifyArgs, VerifyKernel
from ..sim.pool import raw_state
from .adapter import LayerOpAdapter
from .vllm_kernel import varlen

BF16, F32, I32 = torch.bfloat16, torch.float32, torch.int32
L2NORM_EPS = 1e-6  # vllm fla/ops/l2norm.py: l2norm_fwd(x, eps=1e-6)


class VllmAscendAdapter(LayerOpAdapter):
    """Calls ``op`` (the signature above) once per layer as vllm-ascend does, over the flow's cache."""

    def __init__(self, op: Callable, name: str, input_dtype: torch.dtype = BF16):
        super().__init__(op, name)
        self.input_dtype = input_dtype  # what vllm-ascend stores q, k and beta in before the call

    def prepare(self, args: VerifyArgs):
        L, B, S, HV, V, K = args.dims
        HK = args.nk
        x = args.mix_qkv.to(F32)
        lead = x.shape[:-1]

        def l2norm(t):  # vllm's l2norm_fwd: x / sqrt(sum(x^2) + eps), stored in the activation dtype
            return (t / torch.sqrt((t * t).sum(-1, keepdim=True) + L2NORM_EPS)).to(self.input_dtype)

        q = l2norm(x[..., : HK * K].reshape(*lead, HK, K))
        k = l2norm(x[..., HK * K: 2 * HK * K].reshape(*lead, HK, K))
        v = args.mix_qkv[..., 2 * HK * K:].reshape(*lead, HV, V)
        beta = torch.sigmoid(args.beta.to(F32)).to(self.input_dtype)  # fused_gdn_gating's beta_output
        pack = varlen(args)  # padded rows come last in drift's batch: their tokens are never reached
        # spec_state_indices_tensor.flatten(): [B * S] as it is, while the kernel reads it by packed token
        # (ssm_state_indices[seq0 + t]): aligned only when every live row runs all S tokens
        idx = args.ssm_state_indices.to(I32).reshape(-1).contiguous()
        live = args.accepted_index() > 0  # not on the NULL block
        zero = torch.zeros(1, dtype=I32, device=live.device)
        lengths = torch.cat([zero, torch.where(live, args.actual_seq_lengths.to(I32), zero)])
        accepted = torch.where(live, args.num_accepted_tokens.to(I32), zero)
        return q, k, v, beta, pack, idx, lengths, accepted

    def call_layer(self, args: VerifyArgs, layer: int, ctx) -> torch.Tensor:
        q, k, v, beta, pack, idx, lengths, accepted = ctx
        L, B, S, HV, V, K = args.dims
        query = pack.flat(q[layer])
        o = self.op(query=query, key=pack.flat(k[layer]), value=pack.flat(v[layer]),
                    state=raw_state(args.recurrent_state)[layer], beta=pack.flat(beta[layer]),
                    scale=K ** -0.5, actual_seq_lengths=lengths, ssm_state_indices=idx, num_accepted_tokens=accepted,
                    g=pack.flat(args.g[layer].to(F32)), gk=None)
        self.check_output(o, (query.shape[0], HV, V), layer, exact=True)  # the op's own bf16 [T, HV, V], before any unpacking
        return pack.unflat(o)


OP_KEYWORDS = ("query", "key", "value", "state", "beta", "scale", "actual_seq_lengths", "ssm_state_indices",
               "num_accepted_tokens", "g", "gk")


def vllm_ascend_adapter(op: Callable, input_dtype: torch.dtype = BF16) -> VerifyKernel:
    """A verify kernel calling ``op`` (the signature above) as vllm-ascend does."""
    return VllmAscendAdapter(op, f"vllm_ascend_adapter({getattr(op, '__qualname__', op)!s})", input_dtype)


def vllm_ascend_op() -> Callable:
    """``torch.ops._C_ascend.npu_recurrent_gated_delta_rule``, registered by vllm-ascend's custom ops."""
    if not npu_available():
        raise LoadError("--kernel vllm-ascend needs torch_npu with an NPU present and vllm_ascend installed; on other "
                        "machines pass vllm-ascend-op:<module|file.py>:<qualname> with a stand-in of the op")
    try:
        importlib.import_module("vllm_ascend.utils").enable_custom_op()
        return torch.ops._C_ascend.npu_recurrent_gated_delta_rule
    except Exception as exc:
        raise LoadError(f"--kernel vllm-ascend needs vllm_ascend's custom ops (torch.ops._C_ascend."
                        f"npu_recurrent_gated_delta_rule); loading them raised {exc!r}") from exc

