"""Naive per-layer, per-request, per-head, per-token counterparts of :mod:`drift.kernels`.

A direct transcription of docs/semantics.md §3 and §5, in float64 by default: the
definition the vectorised kernels are tested against, and the baseline the
benchmark compares them with (run there in the simulator's own dtypes).
"""

from __future__ import annotations

import math

import torch


def gating(a: float, b: float, A_log: float, dt_bias: float) -> tuple[float, float]:
    """Scalar ``g = -exp(A_log) * softplus(a + dt_bias)`` (threshold 20), ``beta = sigmoid(b)``."""
    z = a + dt_bias
    sp = z if z > 20.0 else math.log1p(math.exp(z))
    return -math.exp(A_log) * sp, 1.0 / (1.0 + math.exp(-b))


def conv_verify(conv_states: torch.Tensor, slots: list[int], x: torch.Tensor, weight: torch.Tensor,
                dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Loop version of :func:`drift.kernels.conv_verify`; updates ``conv_states`` the same way."""
    L, _, W, C = conv_states.shape
    N, D = x.shape[1], x.shape[2]
    Kc = weight.shape[-1]
    out = torch.empty(L, N, D, C, dtype=dtype)
    new_bufs = {}
    for l in range(L):
        w = weight[l].to(dtype)  # [C, Kc]
        for n, s in enumerate(slots):
            buf = conv_states[l, s]
            seq = torch.cat([buf[W - (Kc - 1):].to(dtype), x[l, n].to(dtype)], 0)  # [Kc-1+D, C]
            for j in range(D):
                acc = torch.zeros(C, dtype=dtype)
                for m in range(Kc):
                    acc += w[:, m] * seq[j + m]
                out[l, n, j] = acc * torch.sigmoid(acc)
            new_bufs[(l, s)] = torch.cat([buf[D:], x[l, n].to(buf.dtype)], 0)
    for (l, s), nb in new_bufs.items():
        conv_states[l, s] = nb
    return out


def qkv_heads(qkv_token: torch.Tensor, HK: int, K: int, HV: int, V: int):
    """One token's conv output ``[C]`` -> per value head (q ``[HV, K]``, k ``[HV, K]``, v ``[HV, V]``)."""
    q = qkv_token[: HK * K].reshape(HK, K)
    k = qkv_token[HK * K: 2 * HK * K].reshape(HK, K)
    v = qkv_token[2 * HK * K:].reshape(HV, V)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * K ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    rep = HV // HK
    return q.repeat_interleave(rep, 0, output_size=HV), k.repeat_interleave(rep, 0, output_size=HV), v


def gdn_token(h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              decay: float, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One head, one token: returns (new h ``[K, V]``, output ``[V]``)."""
    h = h * decay
    vp = (v - k @ h) * beta
    h = h + torch.outer(k, vp)
    return h, q @ h


def gdn_verify(h0: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, dtype: torch.dtype = torch.float64, store=None):
    """Loop version of :func:`drift.kernels.gdn_verify`.

    h0 ``[L, N, HV, K, V]``; q, k ``[L, N, D, HV, K]``; v ``[L, N, D, HV, V]``; g, beta
    ``[L, N, D, HV]``. Returns (intermediates ``[L, N, D, HV, K, V]``, outputs
    ``[L, N, D, HV, V]``) in ``dtype``; ``store(h)`` maps a kept state to its stored value.
    """
    L, N, D, HV, K = q.shape
    V = v.shape[-1]
    inter = torch.empty(L, N, D, HV, K, V, dtype=dtype)
    out = torch.empty(L, N, D, HV, V, dtype=dtype)
    for l in range(L):
        for n in range(N):
            for hd in range(HV):
                h = h0[l, n, hd].to(dtype)
                for t in range(D):
                    h, o = gdn_token(h, q[l, n, t, hd].to(dtype), k[l, n, t, hd].to(dtype),
                                     v[l, n, t, hd].to(dtype), math.exp(float(g[l, n, t, hd])),
                                     float(beta[l, n, t, hd]))
                    out[l, n, t, hd] = o
                    inter[l, n, t, hd] = h if store is None else store(h)
    return inter, out


def gdn_decode(h0: torch.Tensor, q, k, v, g, beta, num_tokens: list[int], state_dtype: torch.dtype,
               dtype: torch.dtype = torch.float64):
    """Loop version of :func:`drift.kernels.gdn_decode`: the state rounded to ``state_dtype``
    after each token. Returns (final states ``[L, N, HV, K, V]``, outputs)."""
    L, N, D, HV, K = q.shape
    V = v.shape[-1]
    final = torch.empty(L, N, HV, K, V, dtype=dtype)
    out = torch.zeros(L, N, D, HV, V, dtype=dtype)
    for l in range(L):
        for n in range(N):
            for hd in range(HV):
                h = h0[l, n, hd].to(dtype)
                for t in range(num_tokens[n]):
                    h, o = gdn_token(h, q[l, n, t, hd].to(dtype), k[l, n, t, hd].to(dtype),
                                     v[l, n, t, hd].to(dtype), math.exp(float(g[l, n, t, hd])),
                                     float(beta[l, n, t, hd]))
                    h = h.to(state_dtype).to(dtype)
                    out[l, n, t, hd] = o
                final[l, n, hd] = h
    return final, out


def move_intermediate_cache(ssm_states, intermediate_state_cache, dst_indices, src_indices, last_steps):
    """The definition: ``ssm[l, dst[i]] = inter[l, src[i], step[i]]`` for step in [0, D)."""
    D = intermediate_state_cache.shape[2]
    for d, s, st in zip(dst_indices.tolist(), src_indices.tolist(), last_steps.tolist()):
        if 0 <= st < D:
            for l in range(ssm_states.shape[0]):
                ssm_states[l, d] = intermediate_state_cache[l, s, st]
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
