"""Store dtypes: every fact drift uses about a state's storage dtype, in one table.

An entry gives the torch dtype, its mantissa bits ``p`` (precision, the implicit bit included:
bf16 8, fp16 11, fp32 24 -- IEEE 754 / the bfloat16 format), the unit roundoff ``u = 2^-p``
(the largest relative error of one round-to-nearest store, docs/bounds.md §2), the stagnation
margin (a head whose per-token decay ``a`` has ``1 - a`` below it can have ``fl(a x) == x`` for
elements near a power of two: half an ulp relative, ``2^-p``, docs/bounds.md §5), the
same-width integer view used for NaN-safe bit comparisons, and whether drift's native CPU
kernels handle it (drift/sim/_native/gdn_verify.c: fp32 compute, bf16 or fp32 stores).

Adding a dtype (fp16 or fp8 states, say) is one :func:`register` line here plus calibration data
for the bound (docs/extending.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .registry import Registry


@dataclass(frozen=True)
class StoreDtype:
    """One storage dtype of the committed state, the scratch or the conv window."""

    name: str
    torch_dtype: torch.dtype
    mantissa_bits: int  # p, implicit bit included
    native: bool  # drift's native CPU kernels store into it

    @property
    def int_view(self) -> torch.dtype:
        """The same-width integer dtype: bit-exact, NaN-safe comparisons (:func:`as_bits`)."""
        return INT_OF_WIDTH[self.torch_dtype.itemsize]

    @property
    def unit_roundoff(self) -> float:
        """u = 2^-p: the largest relative error of one round-to-nearest store."""
        return 2.0 ** -self.mantissa_bits

    @property
    def stagnation_margin(self) -> float:
        """``1 - a`` below this makes a decay by ``a`` a no-op on some stored elements: 2^-p."""
        return 2.0 ** -self.mantissa_bits


INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # bytes -> integer dtype


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """Same-width integer view of a float tensor (any strides, any width): bit-exact, NaN-safe compares."""
    return t.view(INT_OF_WIDTH[t.element_size()])


STORE_DTYPES: Registry[StoreDtype] = Registry("store dtype")
for _entry in (StoreDtype("bfloat16", torch.bfloat16, 8, True),
               StoreDtype("float16", torch.float16, 11, False),
               StoreDtype("float32", torch.float32, 24, True)):
    STORE_DTYPES.register(_entry.name, _entry)


def store_dtype(dtype: "str | torch.dtype") -> StoreDtype:
    """The entry of a dtype given by name or as a torch dtype (ConfigError listing the known ones)."""
    if isinstance(dtype, torch.dtype):
        for entry in STORE_DTYPES.values():
            if entry.torch_dtype == dtype:
                return entry
        dtype = str(dtype).replace("torch.", "")
    return STORE_DTYPES[dtype]


FP32_MANTISSA_BITS = 24  # IEEE 754 binary32, the implicit bit included


def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """float32 ``x`` rounded to nearest (ties to even) to ``bits`` mantissa bits (the implicit bit
    included), kept in float32 with fp32's exponent range: the operand rounding of a reduced-precision
    dot product. ``bits`` 11 is TF32 (a 10-bit stored mantissa, NVIDIA's tensor-core format), 8 the
    bfloat16 grid (equal to ``x.to(torch.bfloat16)``, subnormals included), 24 returns ``x``. Adding
    half the dropped unit (plus the kept last bit, for ties to even) to the magnitude bits and
    clearing the dropped ones rounds either sign; a carry into the exponent is the correct
    round-up. Infinities and NaN are not expected (the fold's operands are finite)."""
    if x.dtype != torch.float32:
        raise ValueError(f"round_mantissa rounds float32, not {x.dtype}")
    if not 1 <= bits <= FP32_MANTISSA_BITS:
        raise ValueError(f"bits={bits} is invalid; allowed: 1 .. {FP32_MANTISSA_BITS}")
    drop = FP32_MANTISSA_BITS - bits
    if drop == 0:
        return x
    i = x.contiguous().view(torch.int32)
    lsb = (i >> drop) & 1
    rounded = (i + ((1 << (drop - 1)) - 1) + lsb) & ~((1 << drop) - 1)
    return rounded.view(torch.float32).view(x.shape)
