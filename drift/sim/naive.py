"""Naive per-layer, per-row, per-head, per-token definitions of :mod:`drift.sim.kernels`.

A direct transcription of docs/semantics.md §3, §5 and §6 in Python loops, float64 by default:
the definition the vectorised kernels are tested against, and the baseline ``drift bench``
compares them with (run there in the simulator's own dtypes). States are ``[V, K]`` blocks.
The verify op's arithmetic is :func:`verify_rows`; where it reads and writes is each flow kind's
rule, defined in loops beside it (``drift/flows/<kind>/naive.py``).
"""

from __future__ import annotations

import math

import torch

from .pool import raw_state

F64 = torch.float64


def gating(a: float, A_log: float, dt_bias: float) -> float:
    """Scalar ``g = -exp(A_log) * softplus(a + dt_bias)`` (threshold 20), float64."""
    z = a + dt_bias
    sp = z if z > 20.0 else math.log1p(math.exp(z))
    return -math.exp(A_log) * sp


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def quantize_mix(x: float) -> float:
    """A float64 conv output rounded as the op receives it: to fp32, then to bf16."""
    return float(torch.tensor(x, dtype=F64).to(torch.float32).to(torch.bfloat16).to(F64))


def conv_mix(window: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Loop version of :func:`drift.sim.kernels.conv_mix` (per layer, row, token and tap; channels
    as vectors): window ``[L, N, Kc-1, C]``, x ``[L, N, D, C]``, weight ``[L, C, Kc]`` -> mix_qkv
    float64 ``[L, N, D, C]`` holding bf16 values."""
    L, N, D, C = x.shape
    Kc = weight.shape[-1]
    out = torch.empty(L, N, D, C, dtype=F64, device=x.device)
    for l in range(L):
        w = weight[l].to(F64)  # [C, Kc]
        for n in range(N):
            seq = torch.cat([window[l, n].to(F64), x[l, n].to(F64)], 0)  # [Kc-1+D, C]
            for t in range(D):
                acc = torch.zeros(C, dtype=F64, device=x.device)
                for m in range(Kc):
                    acc = acc + w[:, m] * seq[t + m]
                out[l, n, t] = (acc / (1.0 + torch.exp(-acc))).to(torch.float32).to(torch.bfloat16).to(F64)
    return out


def conv_verify(conv_states: torch.Tensor, slots: list[int], x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Loop version of :func:`drift.sim.kernels.conv_verify`: mix_qkv (float64 holding bf16 values)
    ``[L, N, D, C]``; rolls ``conv_states [L, S, W, C]`` the same way: ``[old[D:], x_0 .. x_{D-1}]``."""
    L, _, W, C = conv_states.shape
    D, Kc = x.shape[2], weight.shape[-1]
    windows = torch.stack([torch.stack([conv_states[l, s, W - (Kc - 1):] for s in slots]) for l in range(L)])
    out = conv_mix(windows, x, weight)
    for l in range(L):
        for n, s in enumerate(slots):
            conv_states[l, s] = torch.cat([conv_states[l, s, D:], x[l, n].to(conv_states.dtype)], 0)
    return out


def head_inputs(mix_token: torch.Tensor, HK: int, K: int, HV: int, V: int, scale: float, dtype: torch.dtype = F64):
    """One token's mix_qkv ``[C]`` -> per value head q, k ``[HV, K]`` (``x / sqrt(sum x^2 + 1e-6)``,
    q times scale), v ``[HV, V]``, in dtype."""
    x = mix_token.to(dtype)
    q = x[: HK * K].reshape(HK, K)
    k = x[HK * K: 2 * HK * K].reshape(HK, K)
    v = x[2 * HK * K:].reshape(HV, V)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * scale
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    rep = HV // HK
    return q.repeat_interleave(rep, 0, output_size=HV), k.repeat_interleave(rep, 0, output_size=HV), v


def delta(S: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: float, beta: float) -> torch.Tensor:
    """One head's delta for one token, ``u = beta (v - decay S k)`` ``[V]``: what the token writes,
    ``S <- decay S + u k^T`` (the ReplaySSM ring's record ``d``)."""
    return (v - (S * decay) @ k) * beta


def gdn_token(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              decay: float, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One head, one token: ``S <- decay S; S <- S + beta (v - S k) k^T; o = S q``.
    S ``[V, K]``; returns (new S, output ``[V]``)."""
    S = S * decay
    S = S + torch.outer((v - S @ k) * beta, k)
    return S, S @ q


def verify_rows(args, start, dest, dtype: torch.dtype = F64, store=None, run=None, deltas=None) -> torch.Tensor:
    """The verify op's arithmetic in loops (per layer, row, value head, token), rule-free: what a
    flow kind's naive reference (``drift/flows/<kind>/naive.py``) runs after saying where rows start
    and where states go.

    ``args`` a :class:`drift.sim.kernels.VerifyArgs`; ``start(l, b)`` row b's start state ``[HV, V,
    K]`` in layer l; ``dest(l, b, t)`` ``(blocks, i)``, where the state after token t is stored
    (``blocks[i, hd]``), or None (not stored); ``store`` maps a stored state (default: a cast to the
    destination's dtype); ``run(b)`` whether row b runs (default: all; a row not run keeps zero
    outputs); ``deltas``, a ``[L, B, S, HV, V]`` tensor receiving each token's delta ``(v - S k) beta``.
    Row b runs its first ``actual_seq_lengths[b]`` tokens in ``dtype``. Returns outputs ``[L, B, S,
    HV, V]`` in ``dtype`` (zero past a row's length).
    """
    L, B, S, HV, V, K = args.dims
    out = torch.zeros(L, B, S, HV, V, dtype=dtype, device=args.mix_qkv.device)
    for l in range(L):
        for b in range(B):
            if run is not None and not run(b):
                continue
            src = start(l, b)
            for hd in range(HV):
                h = src[hd].to(dtype)
                for t in range(int(args.actual_seq_lengths[b])):
                    q, k, v = head_inputs(args.mix_qkv[l, b, t], args.nk, K, HV, V, args.scale)
                    decay = math.exp(float(args.g[l, b, t, hd]))
                    bt = sigmoid(float(args.beta[l, b, t, hd]))
                    qh, kh, vh = q[hd].to(dtype), k[hd].to(dtype), v[hd].to(dtype)
                    if deltas is not None:
                        deltas[l, b, t, hd] = delta(h, kh, vh, decay, bt)
                    h, o = gdn_token(h, qh, kh, vh, decay, bt)
                    out[l, b, t, hd] = o
                    where = dest(l, b, t)
                    if where is not None:
                        blocks, i = where
                        blocks[i, hd] = h if store is None else store(h)
    return out


def gdn_decode(h0: torch.Tensor, q, k, v, decay, beta, num_tokens: list[int], state_dtype: torch.dtype,
               dtype: torch.dtype = F64):
    """Loop version of :func:`drift.sim.kernels.gdn_decode`: the state rounded to ``state_dtype``
    after each token. h0 ``[L, N, HV, V, K]``; q, k ``[L, N, D, HV, K]``, v ``[L, N, D, HV, V]``,
    decay, beta ``[L, N, D, HV]``. Returns (final states ``[L, N, HV, V, K]``, outputs)."""
    L, N, D, HV, K = q.shape
    V = v.shape[-1]
    final = torch.empty(L, N, HV, V, K, dtype=dtype, device=h0.device)
    out = torch.zeros(L, N, D, HV, V, dtype=dtype, device=h0.device)
    for l in range(L):
        for n in range(N):
            for hd in range(HV):
                h = h0[l, n, hd].to(dtype)
                for t in range(num_tokens[n]):
                    h, o = gdn_token(h, q[l, n, t, hd].to(dtype), k[l, n, t, hd].to(dtype),
                                     v[l, n, t, hd].to(dtype), float(decay[l, n, t, hd]), float(beta[l, n, t, hd]))
                    h = h.to(state_dtype).to(dtype)
                    out[l, n, t, hd] = o
                final[l, n, hd] = h
    return final, out


def move_intermediate_cache(ssm_states, intermediate_state_cache, dst_indices, src_indices, last_steps):
    """The definition (docs/semantics.md §3): for every i with ``last_steps[i] >= 0`` and every layer,
    the raw ``[HV, V, K]`` block at flat scratch index ``src[i] * D + last_steps[i]`` copied into
    slot ``dst[i]``. Both tensors are taken as their raw blocks (:func:`drift.sim.pool.raw_state`)."""
    ssm, inter = raw_state(ssm_states), raw_state(intermediate_state_cache)
    D = inter.shape[2]
    for d, s, st in zip(dst_indices.tolist(), src_indices.tolist(), last_steps.tolist()):
        if st >= 0:
            flat = s * D + st
            for l in range(ssm.shape[0]):
                ssm[l, d] = inter[l, flat // D, flat % D]
    return ssm_states


def conv_state_rollback(conv_states, state_indices, step_indices, draft_token_num):
    """The definition: shift right by ``(D-1) - step``, first ``shift`` rows left stale."""
    W = conv_states.shape[2]
    for s, st in zip(state_indices.tolist(), step_indices.tolist()):
        if not 0 <= st < draft_token_num:
            continue
        shift = draft_token_num - 1 - st
        if shift > 0:
            for l in range(conv_states.shape[0]):
                conv_states[l, s, shift:] = conv_states[l, s, : W - shift].clone()
    return conv_states
