"""Helpers the test modules import (``from helpers import ...``): one verify-case factory and one
conformance assertion for every kernel test."""

from __future__ import annotations

from dataclasses import replace

import torch

from drift.plug.loader import Conformance
from drift.sim.kernels import VerifyArgs

BF16 = torch.bfloat16


def verify_case(seed: int = 3, L: int = 2, slots: int = 7, B: int = 3, S: int = 4, HK: int = 1, HV: int = 2,
                K: int = 16, V: int = 16, accepted=(1, 1, 1)) -> VerifyArgs:
    """VerifyArgs over a small random pool, as SGLang's Ascend backend builds them: bf16 mix_qkv
    ``[L, B, S, C]`` and beta logit ``[L, B, S, HV]``, fp32 g, bf16 committed states ``[L, slots, HV,
    V, K]`` and scratch ``[L, B + 1, S, HV, V, K]``, int32 cache indices (row 2 on the dummy slot 0),
    ``ssm_state_indices = arange(B * S)``; ``accepted``: num_accepted_tokens per row (all 1: SGLang's
    flow; other counts: the accepted-count flow)."""
    g = torch.Generator().manual_seed(seed)
    C = 2 * HK * K + HV * V
    return VerifyArgs(torch.randn(L, B, S, C, generator=g).to(BF16), torch.randn(L, B, S, HV, generator=g).to(BF16),
                      -torch.rand(L, B, S, HV, generator=g), torch.randn(L, slots, HV, V, K, generator=g).to(BF16),
                      torch.randn(L, B + 1, S, HV, V, K, generator=g).to(BF16),
                      torch.tensor([4, 1, 0][:B], dtype=torch.int32),
                      torch.arange(B * S, dtype=torch.int32).view(B, S), torch.tensor(accepted, dtype=torch.int32),
                      torch.full((B,), S, dtype=torch.int32), HK, HV, K ** -0.5)


def clone_case(args: VerifyArgs) -> VerifyArgs:
    """The same case with its own copies of the state tensors the kernel writes."""
    return replace(args, recurrent_state=args.recurrent_state.clone(), intermediate_state=args.intermediate_state.clone())


def assert_conforms(kernel, reference, args: VerifyArgs, conformance: Conformance) -> None:
    """``kernel`` and ``reference`` on copies of ``args``: stored scratch states and outputs within
    ``conformance``; the committed states never written (the op writes only the scratch)."""
    got, ref = clone_case(args), clone_case(args)
    out, ref_out = kernel(got), reference(ref)
    B = args.cache_indices.shape[0]
    c = conformance
    torch.testing.assert_close(got.intermediate_state[:, :B].float(), ref.intermediate_state[:, :B].float(),
                               rtol=c.state_rtol, atol=c.state_atol, msg=lambda m: f"scratch states ({c.why}): {m}")
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=c.output_rtol, atol=c.output_atol,
                               msg=lambda m: f"outputs ({c.why}): {m}")
    assert torch.equal(got.recurrent_state.view(torch.int16), args.recurrent_state.view(torch.int16)), \
        "the kernel wrote the committed states"
