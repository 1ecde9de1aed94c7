"""Verify-kernel plug point: the GDN verify kernel under test.

A verify kernel has the signature of :func:`drift.kernels.gdn_verify`::

    kernel(state_kv, slots, q, k, v, g, beta, inter_kv, rounding="rne", key=0) -> out

state_kv ``[L, S, HV, K, V]`` committed states (read at ``slots [N]``), q/k ``[L, N, D, HV, K]``
(l2-normalised, q scaled by K^-0.5, key heads repeated over value heads), v ``[L, N, D, HV, V]``,
g/beta ``[L, N, D, HV]`` float32; it writes the state after every token into inter_kv
``[L, N, D, HV, K, V]`` and returns outputs ``[L, N, D, HV, V]``.

Specs (``--drift-kernel``):
  ``portable``                  drift's own kernel (the default)
  ``npu``                       torch_npu.npu_recurrent_gated_delta_rule through :func:`npu_op_adapter`
  ``npu-op:<module|file.py>:<qualname>``  any callable with that op's signature, through the adapter
  ``mutant:<name>``             a kernel mutant of drift.mutants
  ``<module|file.py>:<qualname>``          a callable with the signature above
"""

from __future__ import annotations

from typing import Callable

import torch

from . import kernels
from .devices import npu_available
from .loader import LoadError, resolve_spec

VerifyKernel = Callable[..., torch.Tensor]
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


def _torch_npu_op() -> Callable:
    if not npu_available():
        raise LoadError("--drift-kernel npu needs torch_npu with an NPU present; on other machines use "
                        "npu-op:<spec> with a CPU stand-in of the op")
    import torch_npu  # noqa: F401

    op = getattr(torch_npu, "npu_recurrent_gated_delta_rule", None)
    if op is None:
        raise LoadError("this torch_npu has no npu_recurrent_gated_delta_rule; upgrade torch_npu")
    return op


def load_kernel(spec: str | VerifyKernel | None) -> VerifyKernel:
    """A verify kernel from a spec (see the module docstring); LoadError names the spec."""
    if spec is None or spec == "portable":
        return kernels.gdn_verify
    if callable(spec):
        return spec
    if spec == "npu":
        return npu_op_adapter(_torch_npu_op())
    if spec.startswith("npu-op:"):
        return npu_op_adapter(resolve_spec(spec[len("npu-op:"):], "kernel"))
    if spec.startswith("mutant:"):
        from .mutants import MUTANTS

        m = MUTANTS.get(spec.split(":", 1)[1])
        if m is None or m.kind != "kernel":
            known = ", ".join(f"mutant:{n}" for n, x in MUTANTS.items() if x.kind == "kernel")
            raise LoadError(f"kernel spec {spec!r} is not a kernel mutant; known: {known}")
        return m.fn
    fn = resolve_spec(spec, "kernel")
    if not callable(fn):
        raise LoadError(f"kernel spec {spec!r} resolves to a {type(fn).__name__}, not a function")
    return fn
