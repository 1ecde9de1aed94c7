"""vLLM's Triton GDN recurrent kernel as a drift verify kernel: ``--kernel vllm-triton``.

vLLM 0.33.0 ``vllm/third_party/flash_linear_attention/ops/fused_recurrent.py:
fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale, initial_state, inplace_final_state,
cu_seqlens, ssm_state_indices, num_accepted_tokens, use_qk_l2norm_in_kernel)`` keeps state in
one block buffer ``[blocks, HV, V, K]`` (block 0 is vLLM's ``NULL_BLOCK_ID``: a row whose start
index is <= 0 is skipped, and no state is stored at an index <= 0). In speculative decoding a row
starts from block ``ssm_state_indices[n, num_accepted_tokens[n] - 1]`` and writes its state after
token ``t`` in place to block ``ssm_state_indices[n, t]`` (docs/semantics.md §6).

Under drift's ``vllm`` flow (docs/semantics.md §6) the op gets vLLM's own arguments: the pool is
vLLM's state cache, written in place. Under drift's SGLang flows (sglang, npu-accepted) the adapter runs it per
layer in a block buffer of its own: block 0 the
NULL block, blocks ``1 + b * S + t`` row ``b``'s tokens; each row's start state (the committed
state or the scratch block its accept count names, as drift's flow says:
:meth:`LayerOpAdapter.start_states`) is put in the block the kernel will read first
(``1 + b * S + n_b - 1``), so the kernel's verify rule and drift's agree; afterwards the token
blocks are copied into drift's scratch. q and k are L2-normalised by drift in fp32 (the op's
formula), q times the scale, passed with ``scale=1.0`` and ``use_qk_l2norm_in_kernel=False``;
v, g in fp32; beta = sigmoid(b) in fp32; the fp32 output cast to bf16 (round to nearest).

It needs an installed ``vllm`` whose package imports; on a CPU under ``TRITON_INTERPRET=1``
drift imports it over a ``--no-deps`` install with vLLM's server stubbed and the interpreter's
stores mended to round to nearest (drift/plug/triton_interpreter.py; slow: a few steps).
"""

from __future__ import annotations

import itertools

import torch

from ..errors import UpdateRaised
from ..sim.kernels import SOFTPLUS_THRESHOLD, VerifyArgs
from ..sim.pool import raw_state
from .adapter import FlaKernelAdapter

I32 = torch.int32


class VllmTritonAdapter(FlaKernelAdapter):
    """Calls vLLM's recurrent kernel per layer over a block buffer laid out as above."""

    MODULE = "vllm.third_party.flash_linear_attention.ops.fused_recurrent"
    FUNCTION = "fused_recurrent_gated_delta_rule"
    KERNEL, ENGINE = "vllm-triton", "vllm (0.33.0 was modelled)"

    NATIVE_RULE = "blocks"  # vLLM's own arguments (drift/flows/in_place/rule.py); other rules through the mapping

    def indices(self, args: VerifyArgs, device: torch.device) -> tuple:
        """Block indices ``[B, S]`` (block 0: the NULL block), accept counts ``[B]`` (int32), and the
        block each row's kernel reads first ``[B]`` (int64)."""
        L, B, S, HV, V, K = args.dims
        if args.rule.name == self.NATIVE_RULE:
            return None  # the vllm flow hands the op vLLM's own arguments
        idx = (1 + torch.arange(B * S, dtype=I32, device=device)).view(B, S)
        n = args.num_accepted_tokens.to(torch.int64)
        first = 1 + torch.arange(B, device=device, dtype=torch.int64) * S + (n - 1).clamp(min=0)
        return idx, args.num_accepted_tokens.to(I32), first

    def call_op(self, args: VerifyArgs, layer: int, qkvgb: tuple, indices: tuple) -> torch.Tensor:
        if indices is None:  # the vllm flow: the cache itself is the op's state, written in place
            return self.run(args, layer, qkvgb, raw_state(args.recurrent_state)[layer], args.ssm_state_indices,
                            args.num_accepted_tokens)
        idx, n, first = indices
        L, B, S, HV, V, K = args.dims
        blocks = torch.zeros(1 + B * S, HV, V, K, dtype=args.intermediate_state.dtype, device=qkvgb[0].device)
        blocks.index_copy_(0, first, self.start_states(args, layer).to(blocks.dtype))
        o = self.run(args, layer, qkvgb, blocks, idx, n)
        self.write_back(args, layer, blocks[1:])
        return o

    def run(self, args: VerifyArgs, layer: int, qkvgb: tuple, state: torch.Tensor, idx: torch.Tensor,
            n: torch.Tensor) -> torch.Tensor:
        """One call of the op on block buffer ``state`` with indices ``idx`` and accept counts ``n``."""
        pack = varlen(args)
        o, _ = self.op(*(pack.tokens(t) for t in qkvgb), scale=1.0, initial_state=state, inplace_final_state=True,
                       cu_seqlens=pack.cu_seqlens, ssm_state_indices=idx, num_accepted_tokens=n,
                       use_qk_l2norm_in_kernel=False)
        return pack.unpack(o)


class Varlen:
    """vLLM's varlen verify call (``cu_seqlens``): each row's own tokens packed into one sequence
    ``[1, T, ...]`` (``fused_recurrent.py``: "for variable-length inputs, the batch size B is expected
    to be 1"), the outputs put back at ``[B, S, ...]`` with zeros past a row's length. ``sel`` int64
    ``[T]``: the packed tokens' flat ``b * S + t``; None: every row runs S tokens, no packing."""

    def __init__(self, B: int, S: int, sel=None, cu_seqlens=None):
        self.B, self.S, self.sel, self.cu_seqlens = B, S, sel, cu_seqlens

    def tokens(self, t: torch.Tensor) -> torch.Tensor:
        if self.sel is None:
            return t
        return t.reshape(self.B * self.S, *t.shape[2:]).index_select(0, self.sel).unsqueeze(0).contiguous()

    def unpack(self, o: torch.Tensor) -> torch.Tensor:
        if self.sel is None:
            return o
        return self.unflat(o[0])

    def flat(self, t: torch.Tensor) -> torch.Tensor:
        """``t [B, S, ...]`` as the tokens a varlen op reads back to back, ``[T, ...]`` (all B * S of
        them when nothing is packed)."""
        if self.sel is None:
            return t.reshape(self.B * self.S, *t.shape[2:]).contiguous()
        return self.tokens(t)[0]

    def unflat(self, o: torch.Tensor) -> torch.Tensor:
        """A varlen op's per-token ``o [T, ...]`` at ``[B, S, ...]``, zeros past a row's length."""
        if self.sel is None:
            return o.view(self.B, self.S, *o.shape[1:])
        out = torch.zeros(self.B * self.S, *o.shape[1:], dtype=o.dtype, device=o.device)
        out.index_copy_(0, self.sel, o)
        return out.view(self.B, self.S, *o.shape[1:])


def varlen(args: VerifyArgs) -> Varlen:
    """The packing of this call: rows shorter than S under a ragged rule (``--drafts ragged``) run
    only their own tokens, as vLLM's varlen batch does; the lengths are read on the host where they
    live there (plain CPU tensors). On a device they would be a host read the step cannot have
    (a captured step replays fixed shapes): every row then runs S tokens, the extra states going to
    blocks the next step does not read (docs/semantics.md §6)."""
    L, B, S = args.dims[:3]
    lengths = args.actual_seq_lengths
    if not getattr(args.rule, "ragged", False) or lengths.device.type != "cpu":
        return Varlen(B, S)
    lens = lengths.tolist()
    if all(n == S for n in lens):
        return Varlen(B, S)
    sel = torch.tensor([b * S + t for b, n in enumerate(lens) for t in range(n)], dtype=torch.int64)
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=I32)
    return Varlen(B, S, sel.to(args.mix_qkv.device), cu.to(args.mix_qkv.device))


class VllmQwenAdapter(VllmTritonAdapter):
    """The Qwen path's kernel, vLLM 0.33.0 ``fused_sigmoid_gating.py:
    fused_sigmoid_gating_delta_rule_update(A_log, a, b, dt_bias, q, k, v, beta, threshold, scale,
    initial_state, inplace_final_state, cu_seqlens, ssm_state_indices, num_accepted_tokens, ...)``,
    called from ``model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py``: the same recurrence and
    state rules as ``fused_recurrent_gated_delta_rule``, with the gating computed in the kernel in fp32
    (``g = -exp(A_log) * softplus(a + dt_bias)``, softplus threshold 20; ``beta = sigmoid(b)``) from
    the raw inputs drift hands it (``VerifyArgs.gate_inputs``; the b logits as given) instead of
    drift's g (computed in float64 and rounded once to fp32, as SGLang's NPU op takes it)."""

    MODULE = "vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating"
    FUNCTION = "fused_sigmoid_gating_delta_rule_update"
    KERNEL = "vllm-triton-qwen"

    def run(self, args: VerifyArgs, layer: int, qkvgb: tuple, state: torch.Tensor, idx: torch.Tensor,
            n: torch.Tensor) -> torch.Tensor:
        if args.gate_inputs is None:
            raise UpdateRaised("the Qwen-path kernel computes its gating from the raw gate inputs, which these "
                               "verify arguments lack (VerifyArgs.gate_inputs; drift's simulation passes them)")
        pack = varlen(args)
        q, k, v, _, _ = (pack.tokens(t) for t in qkvgb)
        a, A_log, dt_bias = args.gate_inputs
        o, _ = self.op(A_log[layer].float(), pack.tokens(a[layer].float().contiguous()),
                       pack.tokens(args.beta[layer].contiguous()), dt_bias[layer].float(), q, k, v, beta=1.0,
                       threshold=SOFTPLUS_THRESHOLD, scale=1.0, initial_state=state, inplace_final_state=True,
                       cu_seqlens=pack.cu_seqlens, ssm_state_indices=idx, num_accepted_tokens=n,
                       use_qk_l2norm_in_kernel=False)
        return pack.unpack(o)
