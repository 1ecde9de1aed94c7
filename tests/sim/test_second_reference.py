"""A second, independent reference for the GDN recurrence: transformers' own torch code.

``torch_recurrent_gated_delta_rule`` (transformers/models/qwen3_next/modeling_qwen3_next.py,
the reference path Qwen3-Next and Qwen3.5 fall back to without flash-linear-attention) and
drift's float64 definitions (drift/sim/naive.py: ``head_inputs`` then ``gdn_token`` per head and
token) must agree on the same q, k, v, g, beta and initial state to float64 rounding.

transformers' function casts its inputs to float32 (``.to(torch.float32)``) before the loop. To
compare in float64 the test runs the function's own code object with the name ``torch`` bound
to a proxy whose ``float32`` is ``torch.float64`` (every other attribute is torch's): the same
statements, promoted. States: drift's are ``[V, K]`` (docs/semantics.md §5), transformers'
``[K, V]``; q is L2-normalised then scaled by ``K^-1/2`` on both sides
(``use_qk_l2norm_in_kernel=True``: drift's op_inputs normalises as the op does, eps 1e-6).
"""

from __future__ import annotations

import importlib.util
import math
import types

import pytest
import torch

from helpers import U64, gdn_state_bound
from drift.sim import naive

MODELING = "transformers.models.qwen3_next.modeling_qwen3_next"
if importlib.util.find_spec("transformers") is None:  # the heavy modeling module loads on first use
    pytest.skip("needs transformers>=5 (drift's capture extra)", allow_module_level=True)

F64 = torch.float64
B, S, HK, HV, K, V = 2, 12, 2, 4, 16, 8  # K != V so a [K, V] / [V, K] mix-up cannot pass


class _Torch64:
    """``torch`` with ``float32`` meaning float64 (for the promoted transformers function)."""

    float32 = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


def _names(code: types.CodeType) -> set[str]:
    """Global and attribute names a code object uses, its nested comprehensions' included."""
    out = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out |= _names(c)
    return out


def _defined_in(obj, filename: str):
    """The function ``filename`` defines, found behind transformers' hub-kernel dispatch: a
    ``functools.wraps`` wrapper (``__wrapped__``) and, since transformers 5.25 with the ``kernels``
    package installed, an ``nn.Module`` whose ``forward`` holds the wrapper in its closure. Fails,
    naming what it found, when no such function is reachable."""
    todo, seen = [obj], set()
    while todo:
        f = todo.pop(0)
        if id(f) in seen:
            continue
        seen.add(id(f))
        code = getattr(f, "__code__", None)
        if code is not None and code.co_filename.endswith(filename):
            return f
        todo += [getattr(f, "__wrapped__", None), getattr(getattr(f, "forward", None), "__func__", None)]
        for cell in getattr(f, "__closure__", None) or ():
            try:
                todo.append(cell.cell_contents if callable(cell.cell_contents) else None)
            except ValueError:  # an empty cell
                pass
        todo = [t for t in todo if t is not None]
    raise AssertionError(f"no function of {filename} behind {obj!r}: transformers changed its dispatch")


def transformers_recurrence(promote: bool = True):
    modeling = pytest.importorskip(MODELING, reason="needs transformers>=5 (drift's capture extra)")
    fn = _defined_in(modeling.torch_recurrent_gated_delta_rule, "modeling_qwen3_next.py")
    assert fn.__module__ == modeling.__name__ and fn.__code__.co_filename.endswith("modeling_qwen3_next.py")
    if not promote:
        return fn
    assert "float32" in _names(fn.__code__), "the function no longer casts to float32: drop the promotion"
    g = dict(fn.__globals__)
    g["torch"] = _Torch64()
    out = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


def inputs(seed: int = 0, V: int = V) -> dict:
    """Raw (un-normalised) q, k [B, S, HK, K], v [B, S, HV, V], g, beta [B, S, HV] and an initial
    state [B, HV, V, K] (drift's layout), float64. Decays exp(g) in (0.37, 1), beta in (0, 1): the
    state keeps a memory of many tokens, so a wrong token anywhere shows at the end."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen, dtype=F64)  # noqa: E731
    return {"q": r(B, S, HK, K), "k": r(B, S, HK, K), "v": r(B, S, HV, V),
            "g": -torch.rand(B, S, HV, generator=gen, dtype=F64), "beta": torch.rand(B, S, HV, generator=gen, dtype=F64),
            "h0": 0.3 * r(B, HV, V, K)}


def drift_recurrence(x: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """drift.sim.naive, float64: per row, token and value head. Returns outputs [B, S, HV, V],
    final states [B, HV, V, K] and the state norms after each token [B, S, HV]."""
    V = x["v"].shape[-1]
    out = torch.zeros(B, S, HV, V, dtype=F64)
    norms = torch.zeros(B, S, HV, dtype=F64)
    final = torch.zeros(B, HV, V, K, dtype=F64)
    for b in range(B):
        h = [x["h0"][b, hd].clone() for hd in range(HV)]
        for t in range(S):
            mix = torch.cat([x["q"][b, t].reshape(-1), x["k"][b, t].reshape(-1), x["v"][b, t].reshape(-1)])
            q, k, v = naive.head_inputs(mix, HK, K, HV, V, K ** -0.5)
            for hd in range(HV):
                h[hd], out[b, t, hd] = naive.gdn_token(h[hd], q[hd], k[hd], v[hd], math.exp(float(x["g"][b, t, hd])),
                                                       float(x["beta"][b, t, hd]))
                norms[b, t, hd] = h[hd].norm()
        for hd in range(HV):
            final[b, hd] = h[hd]
    return out, final, norms


def hf_recurrence(x: dict, fn) -> tuple[torch.Tensor, torch.Tensor]:
    out, state = fn(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=x["h0"].transpose(-1, -2),
                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out, state.transpose(-1, -2)  # [B, HV, K, V] -> drift's [B, HV, V, K]


def bounds(x: dict, norms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How far the two float64 computations may be apart, per row and head.

    Each computes the state after t tokens with error at most gdn_state_bound(t, K, ||h||, ||v||,
    U64) = t (K + 6) u64 (||h|| + ||v||) from the exact result (tests/sim/test_kernels.py derives it:
    per token the decay, the K-term reduction S k, the update and the outer product each round,
    and the normalised k, q carry a few ulps), with ||h||, ||v|| the largest over the tokens; the
    two may differ by twice that. The normalisations differ in form (x / sqrt(.) * s vs
    x * rsqrt(.) / sqrt(K)), which the + 6 covers. An output o = S q with ||q|| <= K^-1/2 differs
    by K^-1/2 (state difference + K u64 ||h||) (its own K-term reduction), twice for two sides.
    """
    t = torch.arange(1, S + 1, dtype=F64)[None, :, None]
    h_norm = torch.maximum(norms.amax(1, keepdim=True), x["h0"].norm(dim=(-1, -2))[:, None])
    v_norm = x["v"].norm(dim=-1).amax(1, keepdim=True)
    state = 2 * gdn_state_bound(t, K, h_norm, v_norm, U64)  # [B, S, HV]
    out = 2 * K ** -0.5 * (state / 2 + K * U64 * h_norm)
    return state[:, -1], out


def test_transformers_recurrence_agrees_with_drift_naive_to_float64_rounding():
    x = inputs()
    o_d, h_d, norms = drift_recurrence(x)
    o_t, h_t = hf_recurrence(x, transformers_recurrence())
    assert o_t.dtype == F64 and h_t.dtype == F64  # the promotion took: no float32 anywhere
    state_bound, out_bound = bounds(x, norms)
    state_diff = (h_t - h_d).norm(dim=(-1, -2))  # [B, HV]
    out_diff = (o_t - o_d).norm(dim=-1)  # [B, S, HV]
    assert (state_diff <= state_bound).all(), (state_diff / state_bound).max()
    assert (out_diff <= out_bound).all(), (out_diff / out_bound).max()
    # The bound is tight enough to mean something: far below the states' own size.
    assert (state_bound < 1e-11 * h_d.norm(dim=(-1, -2))).all()


def test_one_perturbed_beta_disagrees():
    """Negative control: beta of one token of one head off by one part in a million -> the
    final state and the outputs from that token on disagree far beyond the bound."""
    x = inputs()
    o_d, h_d, norms = drift_recurrence(x)
    y = {k: v.clone() for k, v in x.items()}
    y["beta"][1, S - 3, 2] *= 1 + 1e-6
    o_t, h_t = hf_recurrence(y, transformers_recurrence())
    state_bound, out_bound = bounds(x, norms)
    state_ratio = (h_t - h_d).norm(dim=(-1, -2)) / state_bound
    out_ratio = (o_t - o_d).norm(dim=-1) / out_bound
    assert state_ratio[1, 2] > 100 and out_ratio[1, S - 3, 2] > 100
    # ... and only there: every other head, and that head before the token, still agree.
    mask = torch.ones(B, HV, dtype=torch.bool)
    mask[1, 2] = False
    assert (state_ratio[mask] <= 1).all()
    assert (out_ratio[1, : S - 3, 2] <= 1).all()


def test_swapped_state_layout_disagrees():
    """Negative control: drift's [V, K] initial state handed to transformers untransposed. With
    V = K the shapes line up either way, so only the values can tell -- and they do."""
    x = inputs(1, V=K)
    _, h_d, norms = drift_recurrence(x)
    fn = transformers_recurrence()
    _, wrong = fn(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=x["h0"],
                  output_final_state=True, use_qk_l2norm_in_kernel=True)
    _, right = hf_recurrence(x, fn)
    state_bound, _ = bounds(x, norms)
    assert ((right - h_d).norm(dim=(-1, -2)) <= state_bound).all()
    assert ((wrong.transpose(-1, -2) - h_d).norm(dim=(-1, -2)) > 100 * state_bound).any()


def test_the_float32_original_agrees_only_to_float32():
    """transformers as shipped (float32 inside) is close to the float64 truth at float32's scale
    but not at float64's: the promotion above is what makes the float64 comparison meaningful."""
    x = inputs()
    _, h_d, norms = drift_recurrence(x)
    _, h_32 = hf_recurrence(x, transformers_recurrence(promote=False))
    assert h_32.dtype == torch.float32
    diff = (h_32.to(F64) - h_d).norm(dim=(-1, -2))
    state_bound, _ = bounds(x, norms)
    assert (diff > 100 * state_bound).any()  # float32 rounding, ~2^29 times u64
    # within the float32 version of the same bound (inputs rounded to float32 once: + 1 token's worth)
    t = torch.tensor(S + 1, dtype=F64)
    h_norm = torch.maximum(norms.amax(1), x["h0"].norm(dim=(-1, -2)))
    v_norm = x["v"].norm(dim=-1).amax(1)
    assert (diff <= gdn_state_bound(t, K, h_norm, v_norm, 2.0 ** -24)).all()
