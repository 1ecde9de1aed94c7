"""drift.dtypes: round_mantissa, the operand rounding of a reduced-precision dot product (TF32,
bf16), checked against torch's own casts where the formats coincide."""

from __future__ import annotations

import pytest
import torch

from drift.dtypes import round_mantissa


def _values(n: int = 200_000) -> torch.Tensor:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 12)
    return torch.cat([x, torch.tensor([0.0, -0.0, 1e-40, -3e-39, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8])])


def test_eight_bits_is_the_bfloat16_cast_subnormals_and_ties_included():
    x = _values()
    assert torch.equal(round_mantissa(x, 8), x.to(torch.bfloat16).float())


def test_eleven_bits_is_fp16s_mantissa_within_its_range():
    x = _values()
    x = x[(x.abs() >= 2.0 ** -14) & (x.abs() <= 6e4)]  # fp16's normal range: TF32 keeps fp32's exponents
    assert torch.equal(round_mantissa(x, 11), x.half().float())


def test_rounding_is_to_nearest_not_toward_zero():
    """Negative control: truncating the dropped bits (what a cast toward zero gives) is not it."""
    x = _values()
    truncated = (x.view(torch.int32) & ~((1 << 13) - 1)).view(torch.float32)
    assert not torch.equal(round_mantissa(x, 11), truncated)
    err = (round_mantissa(x, 11) - x).abs() / x.abs().clamp(min=1e-30)
    assert err[x.abs() > 1e-37].max() <= 2.0 ** -11  # half an ulp of an 11-bit mantissa at most


def test_twenty_four_bits_returns_the_value_and_other_widths_are_refused():
    x = _values(100)
    assert round_mantissa(x, 24) is x
    with pytest.raises(ValueError):
        round_mantissa(x, 0)
    with pytest.raises(ValueError):
        round_mantissa(x.double(), 11)
