"""The NPU verify op as SGLang calls it, and any stand-in with its signature.

SGLang 0.5.23's Ascend backend (``srt/hardware_backend/npu/attention/ascend_gdn_backend.py``,
``fused_recurrent_gated_delta_rule_update``) calls, per GDN layer::

    torch.ops.npu.recurrent_gated_delta_rule(
        mix_qkv,                      # bf16 [B, S, C], the conv output
        recurrent_state,              # the layer's temporal [slots, HV, V, K]
        beta=beta,                    # bf16 [B, S, HV], the pre-sigmoid logit b
        scale=head_k_dim ** -0.5,
        actual_seq_lengths=...,       # int32 [B]
        ssm_state_indices=....view(B, S),  # int32
        nk=num_k_heads, nv=num_v_heads,
        intermediate_state=intermediate.view(-1, HV, K, V),  # the scratch, reinterpreted
        cache_indices=...,            # int32 [B], slot of each row
        num_accepted_tokens=...,      # int32 [B]
        g=g)                          # fp32 [B, S, HV], the log-decay
    -> bf16 [B, S, HV, V]

:func:`npu_op_adapter` turns any callable with that signature into a drift verify kernel
(:data:`drift.sim.kernels.VerifyKernel`) that makes exactly those calls, layer by layer, with
the dtypes and int32 index tensors SGLang passes (docs/semantics.md §5-§6). ``--kernel npu``
adapts the op sgl-kernel-npu registers (``import sgl_kernel_npu``);
``--kernel npu-op:<module|file.py>:<qualname>`` adapts a stand-in or a new build of it.

``--kernel npu-legacy`` adapts the older public op ``torch_npu.npu_recurrent_gated_delta_rule``
(separate q/k/v, post-sigmoid beta in bf16), kept reachable for comparison; SGLang does not
call it.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Callable

import torch

from ..devices import npu_available
from ..errors import LoadError
from ..sim.kernels import VerifyArgs, VerifyKernel
from ..sim.pool import raw_state
from .adapter import LayerOpAdapter
from .specs import callable_name

BF16, F32, I32 = torch.bfloat16, torch.float32, torch.int32


class NpuOpAdapter(LayerOpAdapter):
    """Calls ``op`` (the signature above) once per layer exactly as SGLang does: the layer's
    committed states and scratch passed whole (the op gathers its start states itself)."""

    def prepare(self, args: VerifyArgs):
        L, B, S, HV, V, K = args.dims
        return (raw_state(args.recurrent_state), raw_state(args.intermediate_state),
                args.ssm_state_indices.to(I32).view(B, S))

    def call_layer(self, args: VerifyArgs, layer: int, ctx) -> torch.Tensor:
        rec, inter, idx = ctx
        L, B, S, HV, V, K = args.dims
        return self.op(args.mix_qkv[layer].to(BF16).contiguous(), rec[layer],
                       beta=args.beta[layer].to(BF16).contiguous(), scale=args.scale,
                       actual_seq_lengths=args.actual_seq_lengths.to(I32), ssm_state_indices=idx,
                       nk=args.nk, nv=args.nv, intermediate_state=inter[layer].view(-1, HV, K, V),
                       cache_indices=args.cache_indices.to(I32), num_accepted_tokens=args.num_accepted_tokens.to(I32),
                       g=args.g[layer].to(F32).contiguous())


OP_KEYWORDS = ("beta", "scale", "actual_seq_lengths", "ssm_state_indices", "nk", "nv", "intermediate_state",
               "cache_indices", "num_accepted_tokens", "g")


def check_op_signature(op: Callable, spec: str, positional: int = 2, keywords: tuple[str, ...] = OP_KEYWORDS,
                       caller: str = "SGLang's call") -> None:
    """LoadError (at load, exit 2) when ``op`` cannot take the call its engine makes: ``positional``
    arguments then ``keywords`` (default SGLang's, above); an op whose signature cannot be read (a
    torch op, a builtin) is taken on trust."""
    try:
        sig = inspect.signature(op)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*[None] * positional, **{k: None for k in keywords})
    except TypeError as exc:
        first = "mix_qkv, recurrent_state, *, " if positional else "*, "
        raise LoadError(f"kernel spec {spec!r} has signature {callable_name(op)}{sig}, which cannot take "
                        f"{caller} ({exc}); expected op({first}{', '.join(keywords)})") from None


def npu_op_adapter(op: Callable) -> VerifyKernel:
    """A verify kernel calling ``op`` (the signature above) once per layer as SGLang does."""
    return NpuOpAdapter(op, f"npu_op_adapter({getattr(op, '__qualname__', op)!s})")


def sgl_kernel_npu_op() -> Callable:
    """``torch.ops.npu.recurrent_gated_delta_rule``, registered by importing sgl_kernel_npu."""
    if not npu_available():
        raise LoadError("--kernel npu needs torch_npu with an NPU present; on other machines pass "
                        "npu-op:<module|file.py>:<qualname> with a stand-in of the op")
    try:
        importlib.import_module("sgl_kernel_npu")
    except Exception as exc:
        raise LoadError(f"--kernel npu needs sgl_kernel_npu (it registers torch.ops.npu.recurrent_gated_delta_rule); "
                        f"importing it raised {exc!r}") from exc
    try:
        return torch.ops.npu.recurrent_gated_delta_rule
    except (AttributeError, RuntimeError) as exc:
        raise LoadError("this sgl_kernel_npu registers no torch.ops.npu.recurrent_gated_delta_rule; upgrade it") from exc


class LegacyAdapter(LayerOpAdapter):
    """``torch_npu.npu_recurrent_gated_delta_rule(query, key, value, state, *, beta, scale,
    actual_seq_lengths, ssm_state_indices, num_accepted_tokens, g, gk)``: q/k normalised by the
    caller, beta post-sigmoid in bf16 (the rounding vLLM #53877 describes), one state block per
    token with the start state in each row's first block, written back into drift's scratch."""

    def prepare(self, args: VerifyArgs):
        L, B, S, HV, V, K = args.dims
        q, k, v, _, beta = args.inputs(F32)  # q normalised and scaled; beta = sigmoid(b)
        T = B * S
        lengths = torch.full((B,), S, dtype=I32, device=q.device)
        indices = torch.arange(T, dtype=I32, device=q.device)
        return q, k, v, beta, lengths, indices

    def call_layer(self, args: VerifyArgs, layer: int, ctx) -> torch.Tensor:
        q, k, v, beta, lengths, indices = ctx
        L, B, S, HV, V, K = args.dims
        T = B * S
        blocks = torch.empty(B, S, HV, V, K, dtype=BF16, device=q.device)
        blocks[:, 0] = self.start_states(args, layer).to(BF16)
        o = self.op(q[layer].reshape(T, HV, K).to(BF16), k[layer].reshape(T, HV, K).to(BF16),
                    v[layer].reshape(T, HV, V).to(BF16), blocks.view(T, HV, V, K),
                    beta=beta[layer].reshape(T, HV).to(BF16), scale=1.0, actual_seq_lengths=lengths,
                    ssm_state_indices=indices, num_accepted_tokens=None, g=args.g[layer].reshape(T, HV).to(F32),
                    gk=None)
        self.write_back(args, layer, blocks.view(T, HV, V, K))
        return o  # judged as the op returned it (bf16 [T, HV, V]), never cast


def legacy_adapter(op: Callable) -> VerifyKernel:
    """The older public op through :class:`LegacyAdapter`. Only the SGLang flow's semantics are
    the op's own (every row from its committed state)."""
    return LegacyAdapter(op, f"legacy_adapter({getattr(op, '__qualname__', op)!s})")


def torch_npu_legacy_op() -> Callable:
    if not npu_available():
        raise LoadError("--kernel npu-legacy needs torch_npu with an NPU present")
    import torch_npu

    op = getattr(torch_npu, "npu_recurrent_gated_delta_rule", None)
    if op is None:
        raise LoadError("this torch_npu has no npu_recurrent_gated_delta_rule")
    return op
