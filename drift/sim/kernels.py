"""Portable reference kernels (torch only), vectorised over layers, rows and heads.

Each has a float64 naive counterpart in :mod:`drift.naive` that tests compare it to.

Conventions (one tensor-parallel rank):
  L layers, S pool slots, N batch rows, D verify tokens, HK / HV key / value heads,
  K / V head dims, C = 2*HK*K + HV*V conv channels, Kc conv kernel,
  W = (Kc-1) + (D-1) conv window rows (the NPU extended window).
States are handled in ``[.., K, V]`` orientation (``h`` in docs/semantics.md §5);
the pool hands out ``[K, V]`` views whatever its storage layout.

The update kernels ``move_intermediate_cache`` and ``conv_state_rollback`` have
exactly the signatures and semantics of ``sgl_kernel_npu.mamba.mamba_state_update_triton``
and are what the sgl_kernel_npu shim serves when that package is absent.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from . import native

STATE_CHUNK_BYTES = 4 << 20  # fp32 working set per kernel chunk (fits L2/L3 with room)
# On plain CPU tensors an index tensor already lives in host memory: reading it is no
# device sync, so the kernels copy whole rows with host-known indices (each byte moved
# once) instead of the device path's gather/scatter. Everywhere else (an accelerator, or
# drift's virtual sync-detection device) the device path runs. Tests switch this off to
# check the device path on the CPU too.
HOST_INDEX_PATHS = True
# gdn_verify on the CPU runs drift.native's C kernel when it can be built (same arithmetic,
# two passes over each state per token instead of five tensor ops). Tests switch it off to
# compare it with the torch-op path.
USE_NATIVE = True
# The verify-kernel plug point: a callable with the signature of :func:`gdn_verify`
# (``kernel(state_kv, slots, q, k, v, g, beta, inter_kv, rounding="rne", key=0) -> out``).
VerifyKernel = Callable[..., torch.Tensor]
_MASK_HI16 = -65536  # int32 0xFFFF0000: keeps sign, exponent and the 7 bf16 mantissa bits


def _host_indexed(*tensors: torch.Tensor) -> bool:
    """Whether the host-index row paths apply: every tensor a plain CPU tensor."""
    return HOST_INDEX_PATHS and all(type(t) is torch.Tensor and t.device.type == "cpu" for t in tensors)


# ------------------------------------------------------------------ gating, norms
def gdn_gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
               dtype: torch.dtype = torch.float32):
    """``g = -exp(A_log) * softplus(a + dt_bias)`` (threshold 20) and ``beta = sigmoid(b)``.

    a, b: ``[L, N, D, HV]``; A_log, dt_bias: ``[L, HV]``. Returns (g, beta) of a's shape in dtype.
    """
    sp = F.softplus(a.to(dtype) + dt_bias.to(dtype)[:, None, None, :], beta=1.0, threshold=20.0)
    g = -torch.exp(A_log.to(dtype))[:, None, None, :] * sp
    return g, torch.sigmoid(b.to(dtype))


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim, in x's dtype."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def split_qkv(qkv: torch.Tensor, num_k_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int):
    """Split conv output ``[L, N, D, C]`` into q, k ``[L, N, D, HV, K]`` (l2-normalised,
    q scaled by ``K**-0.5``, key heads repeated over their value-head group) and
    v ``[L, N, D, HV, V]``."""
    L, N, D, _ = qkv.shape
    HK, K, HV, V = num_k_heads, head_k_dim, num_v_heads, head_v_dim
    q = qkv[..., : HK * K].reshape(L, N, D, HK, K)
    k = qkv[..., HK * K: 2 * HK * K].reshape(L, N, D, HK, K)
    v = qkv[..., 2 * HK * K:].reshape(L, N, D, HV, V)
    q = l2norm(q) * (K ** -0.5)
    k = l2norm(k)
    if HV != HK:
        group = HV // HK
        q = q.unsqueeze(4).expand(L, N, D, HK, group, K).reshape(L, N, D, HV, K)
        k = k.unsqueeze(4).expand(L, N, D, HK, group, K).reshape(L, N, D, HV, K)
    return q, k, v


# ----------------------------------------------------------------------- conv
def conv_verify(conv_states: torch.Tensor, slots: torch.Tensor, x: torch.Tensor,
                weight: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv1d + SiLU over the verify window, NPU extended-window layout.

    conv_states ``[L, S, W, C]`` (any dtype): the last ``Kc-1`` rows of a slot are the
    committed window. x ``[L, N, D, C]``: the D verify tokens. weight ``[L, C, Kc]``.
    Returns float32 ``[L, N, D, C]``. Leaves each slot's buffer rolled:
    ``[old[D:], x_0 .. x_{D-1}]`` (what conv_state_rollback later undoes).
    """
    L, S, W, C = conv_states.shape
    N, D, Kc = x.shape[1], x.shape[2], weight.shape[-1]
    slots = slots.to(torch.int64)
    # Whole-slot row copies when each slot's window is one dense block ([W, C] or, for the
    # channel-major NPU layout, [C, W] storage): rows [L * S, W * C] in storage order.
    rows, cw = _slot_rows(conv_states)
    flat = _flat_rows(slots, L, S).reshape(-1)
    if rows is None:
        buf = conv_states.index_select(1, slots)  # [L, N, W, C]
    elif cw:
        buf = rows.index_select(0, flat).view(L, N, C, W).transpose(-1, -2)
    else:
        buf = rows.index_select(0, flat).view(L, N, W, C)
    out = conv_silu(buf[:, :, W - (Kc - 1):], x, weight, torch.float32)
    xs = x.to(conv_states.dtype)
    if cw:  # the rolled windows built in storage order [L, N, C, W]
        rolled = torch.cat([buf.transpose(-1, -2)[..., D:], xs.transpose(-1, -2)], dim=-1)
    else:
        rolled = torch.cat([buf[:, :, D:], xs], dim=2)
    if rows is None:
        conv_states.index_copy_(1, slots, rolled)
    else:
        dst, src = _wide_rows(rows, rolled.view(L * N, W * C))
        dst.index_copy_(0, flat, src)
    return out


def _slot_rows(conv_states: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
    """``conv_states [L, S, W, C]`` as rows ``[L * S, W * C]`` holding each slot's window in
    storage order, and whether that order is channel-major (``[C, W]``, a transposed view);
    ``(None, False)`` when a window is not one dense block."""
    rows = _as_rows(conv_states, 2)
    if rows is not None:
        return rows, False
    rows = _as_rows(conv_states.transpose(-1, -2), 2)
    return rows, rows is not None


def conv_silu(window: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """SiLU(causal depthwise conv) of the D tokens ``x [L, N, D, C]`` given the ``Kc-1`` tokens
    before them, ``window [L, N, Kc-1, C]``; weight ``[L, C, Kc]``. Returns ``[L, N, D, C]`` in dtype,
    stored in memory order ``[L, C, N, D]`` (see the end)."""
    D, Kc = x.shape[2], weight.shape[-1]
    # .contiguous() first: casting a strided bf16 view (a window of channel-major conv storage)
    # is ~7x slower than copying it dense and casting that; the values are the same.
    seq = torch.cat([window.contiguous().to(dtype), x.contiguous().to(dtype)], dim=2)  # [L, N, Kc-1+D, C]
    taps = weight.to(dtype).permute(2, 0, 1).contiguous()[:, :, None, None, :]  # [Kc, L, 1, 1, C]
    # Taps summed in order m = 0 .. Kc-1, each product rounded then added (no FMA).
    acc = seq[:, :, 0:D] * taps[0]
    tmp = torch.empty_like(acc)
    for m in range(1, Kc):
        acc.add_(torch.mul(seq[:, :, m:m + D], taps[m], out=tmp))
    F.silu(acc, inplace=True)
    # Returned in memory order [L, C, N, D] (the layout an einsum over the unfolded window
    # produced): reductions over C downstream (split_qkv's l2norm) sum in memory order, so
    # this keeps their rounding, and every value after them, bit-identical to that version.
    L, N, _, C = acc.shape
    out = torch.empty(L, C, N, D, dtype=dtype, device=acc.device).permute(0, 2, 3, 1)
    return out.copy_(acc)


def conv_state_rollback(conv_states: torch.Tensor, state_indices: torch.Tensor,
                        step_indices: torch.Tensor, draft_token_num: int) -> torch.Tensor:
    """Roll each accepted request's conv window back to its last accepted token, in place.

    For every i with ``0 <= step_indices[i] < draft_token_num``: ``shift = (D-1) - step``;
    if shift > 0, ``buf[:, shift:] = buf[:, :W-shift]`` for slot ``state_indices[i]`` in
    every layer (the first ``shift`` rows keep stale values). Rows with step < 0 are left
    untouched. Works through any strides of ``conv_states`` ``[L, S, W, C]``; no host sync
    (on plain CPU tensors the indices are read on the host, which is no sync there:
    :data:`HOST_INDEX_PATHS`).
    """
    if conv_states.ndim != 4:
        raise ValueError(f"conv_states must be [L, slots, W, C], got shape {tuple(conv_states.shape)}")
    if state_indices.shape != step_indices.shape or state_indices.ndim != 1:
        raise ValueError("state_indices and step_indices must be 1-D of equal length, got "
                         f"{tuple(state_indices.shape)} and {tuple(step_indices.shape)}")
    W = conv_states.shape[2]
    if _host_indexed(conv_states, state_indices, step_indices):
        S = conv_states.shape[1]
        for slot, st in zip(state_indices.tolist(), step_indices.tolist()):
            shift = (draft_token_num - 1) - st
            if 0 <= st < draft_token_num and shift > 0:
                if not 0 <= slot < S:  # Python indexing would wrap a negative one
                    raise IndexError(f"conv_state_rollback: slot {slot} out of range (of {S})")
                win = conv_states[:, slot]
                win[:, shift:] = win[:, :W - shift].clone()  # the ranges overlap
        return conv_states
    dev = conv_states.device
    step = step_indices.to(device=dev, dtype=torch.int64)
    ok = (step >= 0) & (step < draft_token_num)
    shift = torch.where(ok, (draft_token_num - 1) - step, torch.zeros_like(step))  # [N]
    w = torch.arange(W, device=dev, dtype=torch.int64)
    src = torch.where(w[None, :] >= shift[:, None], w[None, :] - shift[:, None], w[None, :])  # [N, W]
    slot = state_indices.to(device=dev, dtype=torch.int64)
    # Gather then scatter; rows with shift 0 write back their own bits.
    L, S, _, C = conv_states.shape
    rows = _as_rows(conv_states, 3)  # [L * S * W, C]: one row per window position
    if rows is not None:
        base = _flat_rows(slot * W, L, S * W)[:, :, None]  # [L, N, 1]
        (rows,) = _wide_rows(rows)
        moved = rows.index_select(0, (base + src[None]).reshape(-1))
        rows.index_copy_(0, (base + w[None, None, :]).reshape(-1), moved)
        return conv_states
    rows, cw = _slot_rows(conv_states)
    if cw:  # channel-major windows: gather whole slots, shift along W inside them, scatter
        flat = _flat_rows(slot, L, S).reshape(-1)
        blocks = rows.index_select(0, flat).view(L, -1, C, W)
        # Gather on the bits: torch.gather on bf16 rewrites NaN payloads, an int view keeps them.
        blocks = blocks.view(_SAME_WIDTH_INT[blocks.element_size()])
        moved = torch.gather(blocks, 3, src[None, :, None, :].expand(blocks.shape))
        dst, moved = _wide_rows(rows, moved.view(rows.dtype).view(-1, C * W))
        dst.index_copy_(0, flat, moved)
        return conv_states
    conv_states[:, slot] = conv_states[:, slot[:, None], src]  # strides that do not flatten
    return conv_states


# ---------------------------------------------------------------- state stores
def _hash32(idx: torch.Tensor, key: int) -> torch.Tensor:
    """Counter-based 32-bit hash (int64 arithmetic, no overflow): same bits on every device."""
    x = (idx + ((key & 0xFFFFFFFF) * 0x632BE5AB)) & 0xFFFFFFFF
    x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    return (x >> 16) ^ x


def store_state(dst: torch.Tensor, h: torch.Tensor, rounding: str = "rne", key: int = 0,
                offset: int = 0) -> None:
    """Store float32 ``h`` into ``dst`` (its dtype, any strides) with the given rounding.

    ``rne``: round to nearest even (a plain cast). ``truncate``: toward zero (bf16 only).
    ``stochastic``: up with probability equal to the dropped fraction (bf16 only), the
    random bits a hash of (element index + ``offset``, key): device independent, and
    independent of how a caller chunks a larger tensor when it passes each chunk's offset.
    """
    if rounding == "rne" or dst.dtype == torch.float32 and h.dtype == torch.float32:
        dst.copy_(h)
        return
    if dst.dtype != torch.bfloat16:
        raise ValueError(f"store rounding {rounding!r} is defined for bfloat16 states, not {dst.dtype}")
    bits = h.to(torch.float32).contiguous().view(torch.int32)
    if rounding == "truncate":
        dst.copy_(bits.bitwise_and(_MASK_HI16).view(torch.float32))
    elif rounding == "stochastic":
        idx = torch.arange(offset, offset + bits.numel(), device=bits.device, dtype=torch.int64).view(bits.shape)
        noise = (_hash32(idx, key) & 0xFFFF).to(torch.int32)
        # Adding to the magnitude bits then truncating rounds |h| up with probability
        # (dropped bits) / 2^16, for either sign (sign-magnitude encoding).
        dst.copy_((bits + noise).bitwise_and(_MASK_HI16).view(torch.float32))
    else:
        raise ValueError(f"store rounding {rounding!r} is not known; allowed: rne, stochastic, truncate")


def round_to(h: torch.Tensor, dtype: torch.dtype, rounding: str = "rne", key: int = 0,
             offset: int = 0) -> torch.Tensor:
    """``h`` rounded to ``dtype`` and back to h's dtype (a store followed by a reload)."""
    if dtype == h.dtype:
        return h
    tmp = torch.empty(h.shape, dtype=dtype, device=h.device)
    store_state(tmp, h, rounding, key, offset)
    return tmp.to(h.dtype)


# ------------------------------------------------------------------------ GDN
def _layer_chunk(shape_per_layer: tuple[int, ...], itemsize: int = 4) -> int:
    n = itemsize
    for s in shape_per_layer:
        n *= s
    return max(1, STATE_CHUNK_BYTES // max(n, 1))


def _gdn_token(h: torch.Tensor, q, k, v, decay, beta, o_out) -> None:
    """One gated delta-rule token on flattened heads, in place.

    h ``[B, K, V]`` (float32 or float64); q, k ``[B, K]``; v ``[B, V]``; decay, beta ``[B]``.
    ``h <- h*decay; v' = (v - k^T h)*beta; h <- h + k v'^T; o = q^T h`` (o written to o_out ``[B, V]``).
    """
    h.mul_(decay[:, None, None])
    kh = torch.bmm(k.unsqueeze(1), h)  # [B, 1, V]
    u = (v.unsqueeze(1) - kh).mul_(beta[:, None, None])
    h.addcmul_(k.unsqueeze(2), u)  # rank-1 update (elementwise: faster than a k=1 baddbmm)
    torch.bmm(q.unsqueeze(1), h, out=o_out.unsqueeze(1))


def gdn_verify(state_kv: torch.Tensor, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, inter_kv: torch.Tensor,
               rounding: str = "rne", key: int = 0, compute_dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """GDN verify with NPU semantics: every intermediate state stored, committed state untouched.

    state_kv ``[L, S, HV, K, V]`` (any dtype/strides): committed states, read at ``slots [N]``.
    q, k ``[L, N, D, HV, K]``; v ``[L, N, D, HV, V]``; g, beta ``[L, N, D, HV]`` float32.
    inter_kv ``[L, N, D, HV, K, V]`` (any dtype/strides): receives the state after each
    token, stored with ``rounding`` (``key`` seeds stochastic rounding).
    The state is loaded into ``compute_dtype`` and kept there across the D tokens.
    Returns outputs ``[L, N, D, HV, V]`` in compute_dtype.
    On plain CPU tensors the C kernel of :mod:`drift.native` runs when it applies
    (:func:`drift.native.supports`): the same float32 arithmetic in another summation order.
    """
    L, N, D, HV, K = q.shape
    V = v.shape[-1]
    cd = compute_dtype
    if uses_native(state_kv, slots, inter_kv, rounding, cd):
        out = torch.empty(L, N, D, HV, V, dtype=cd)
        f32 = (t.to(cd).contiguous() for t in (q, k, v, torch.exp(g.to(cd)), beta))
        native.gdn_verify(state_kv, slots.tolist(), *f32, inter_kv, out)
        return out
    slots = slots.to(torch.int64)
    # Token-major copies ([D, L, N, HV, ...]) so every per-token slice below is a plain view.
    qt, kt, vt, dect, bt = (_token_major(t, cd) for t in (q, k, v, torch.exp(g.to(cd)), beta))
    out = torch.empty(D, L, N, HV, V, dtype=cd, device=q.device)
    step = _layer_chunk((N, HV, K, V), torch.finfo(cd).bits // 8)
    h_buf = torch.empty(min(step, L) * N * HV, K, V, dtype=cd, device=q.device)
    host_slots = slots.tolist() if _host_indexed(state_kv, slots) else None
    for l0 in range(0, L, step):
        l1 = min(L, l0 + step)
        B = (l1 - l0) * N * HV
        h = h_buf[:B]
        if host_slots is not None:  # one converting copy per row (index_select + cast is two passes)
            hv = h.view(l1 - l0, N, HV, K, V)
            for n, slot in enumerate(host_slots):
                hv[:, n].copy_(state_kv[l0:l1, slot])
        else:
            h.copy_(state_kv[l0:l1].index_select(1, slots).view(B, K, V))
        for t in range(D):
            _gdn_token(h, qt[t, l0:l1].view(B, K), kt[t, l0:l1].view(B, K), vt[t, l0:l1].view(B, V),
                       dect[t, l0:l1].view(B), bt[t, l0:l1].view(B), out[t, l0:l1].view(B, V))
            store_state(inter_kv[l0:l1, :, t], h.view(l1 - l0, N, HV, K, V), rounding,
                        key * 1_000_003 + t * 4099, offset=l0 * N * HV * K * V)
    return out.permute(1, 2, 0, 3, 4).contiguous()


def uses_native(state_kv: torch.Tensor, slots: torch.Tensor, inter_kv: torch.Tensor, rounding: str = "rne",
                compute_dtype: torch.dtype = torch.float32) -> bool:
    """Whether :func:`gdn_verify` with these arguments runs :mod:`drift.native`'s C kernel."""
    return USE_NATIVE and _host_indexed(slots) and native.supports(state_kv, inter_kv, rounding, compute_dtype)


def _token_major(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[L, N, D, ...]`` -> contiguous ``[D, L, N, ...]`` in dtype (values unchanged)."""
    return t.to(dtype).movedim(2, 0).contiguous()


def gdn_decode(state_kv: torch.Tensor, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, num_tokens: torch.Tensor,
               rounding: str = "rne", key: int = 0, compute_dtype: torch.dtype = torch.float32,
               captures=(), norms_out: torch.Tensor | None = None) -> torch.Tensor:
    """Sequential (non-MTP) decode: one token at a time, the state stored after every token.

    Same shapes as :func:`gdn_verify`; row n processes its first ``num_tokens[n]`` tokens
    (a token beyond that gets decay 1 and beta 0, an exact identity). The state is
    rounded to ``state_kv``'s dtype after each token (nothing to round when that is the
    compute dtype) and written back to ``slots``. Each ``(steps, out)`` in ``captures``
    (steps a host int array ``[N]``, -1 = none; out ``[L, N, HV, K, V]``) receives the state
    of row n after token ``steps[n]``; ``norms_out [L, N, D, HV]`` receives ``||h||_F^2`` after
    every token. Returns outputs ``[L, N, D, HV, V]`` in compute_dtype
    (entries past num_tokens are meaningless).
    """
    L, N, D, HV, K = q.shape
    V = v.shape[-1]
    cd = compute_dtype
    slots = slots.to(torch.int64)
    sdt = state_kv.dtype
    active = torch.arange(D, device=q.device)[None, :] < num_tokens.to(q.device)[:, None]  # [N, D]
    act = active[None, :, :, None]
    decay = torch.where(act, torch.exp(g.to(cd)), torch.ones((), dtype=cd, device=q.device))
    bt = torch.where(act, beta.to(cd), torch.zeros((), dtype=cd, device=q.device))
    qc, kc, vc = q.to(cd), k.to(cd), v.to(cd)
    out = torch.empty(L, N, D, HV, V, dtype=cd, device=q.device)
    step = _layer_chunk((N, HV, K, V), torch.finfo(cd).bits // 8)
    cap_masks: dict[int, list] = {}
    for cap_steps, cap_out in captures:
        for t in range(D):
            hit = [n for n in range(N) if int(cap_steps[n]) == t]
            if hit:
                m = torch.zeros(N, dtype=torch.bool)
                m[hit] = True
                cap_masks.setdefault(t, []).append((m.to(q.device)[:, None, None, None], cap_out))
    for l0 in range(0, L, step):
        l1 = min(L, l0 + step)
        B = (l1 - l0) * N * HV
        h = state_kv[l0:l1].index_select(1, slots).to(cd).reshape(B, K, V)
        for t in range(D):
            o_t = torch.empty(B, V, dtype=cd, device=q.device)
            _gdn_token(h, qc[l0:l1, :, t].reshape(B, K), kc[l0:l1, :, t].reshape(B, K),
                       vc[l0:l1, :, t].reshape(B, V), decay[l0:l1, :, t].reshape(B),
                       bt[l0:l1, :, t].reshape(B), o_t)
            out[l0:l1, :, t] = o_t.view(l1 - l0, N, HV, V)
            if sdt != cd:
                h.copy_(round_to(h, sdt, rounding, key * 1_000_003 + t * 4099, offset=l0 * N * HV * K * V))
            if norms_out is not None:
                norms_out[l0:l1, :, t] = h.square().sum((-1, -2)).view(l1 - l0, N, HV).to(norms_out.dtype)
            for mask, cap_out in cap_masks.get(t, ()):
                hv = h.view(l1 - l0, N, HV, K, V)
                cap_out[l0:l1] = torch.where(mask, hv.to(cap_out.dtype), cap_out[l0:l1])
        state_kv[l0:l1].index_copy_(1, slots, h.view(l1 - l0, N, HV, K, V).to(sdt))
    return out


# -------------------------------------------------------------- update kernels
def move_intermediate_cache(ssm_states: torch.Tensor, intermediate_state_cache: torch.Tensor,
                            dst_indices: torch.Tensor, src_indices: torch.Tensor,
                            last_steps: torch.Tensor) -> torch.Tensor:
    """``ssm[l, dst[i]] = inter[l, src[i], last_steps[i]]`` for every layer and every i with
    ``0 <= last_steps[i] < D``; other rows untouched. In place; honours the strides of
    both views (a transposed ``[HV, V, K]`` view copies logically); no host sync (on plain
    CPU tensors: one row copy per committed row, indices read on the host, :data:`HOST_INDEX_PATHS`).

    ssm_states ``[L, S, HV, ., .]``; intermediate_state_cache ``[L, rows, D, HV, ., .]``.
    To stay sync free, skipped rows still write: each layer's first skipped destination
    gets its own current bits back, so a skipped row must not share its destination with
    a committed one (padded rows use the dummy slot 0, which no request owns).
    """
    if ssm_states.ndim != 5 or intermediate_state_cache.ndim != 6:
        raise ValueError("move_intermediate_cache expects ssm_states [L, S, HV, ., .] and "
                         "intermediate_state_cache [L, rows, D, HV, ., .]; got shapes "
                         f"{tuple(ssm_states.shape)} and {tuple(intermediate_state_cache.shape)}")
    if ssm_states.dtype != intermediate_state_cache.dtype:
        raise ValueError("move_intermediate_cache copies raw values and does not cast: dtypes "
                         f"{ssm_states.dtype} and {intermediate_state_cache.dtype} differ")
    if ssm_states.shape[2:] != intermediate_state_cache.shape[3:]:
        raise ValueError(f"state shapes differ: {tuple(ssm_states.shape[2:])} vs "
                         f"{tuple(intermediate_state_cache.shape[3:])}")
    dev = ssm_states.device
    D = intermediate_state_cache.shape[2]
    if _host_indexed(ssm_states, intermediate_state_cache, dst_indices, src_indices, last_steps):
        S, rows = ssm_states.shape[1], intermediate_state_cache.shape[1]
        for d, r, st in zip(dst_indices.tolist(), src_indices.tolist(), last_steps.tolist()):
            if 0 <= st < D:
                if not (0 <= d < S and 0 <= r < rows):  # Python indexing would wrap a negative one
                    raise IndexError(f"move_intermediate_cache: destination slot {d} (of {S}) or "
                                     f"source row {r} (of {rows}) out of range")
                ssm_states[:, d].copy_(intermediate_state_cache[:, r, st])
        return ssm_states
    step = last_steps.to(device=dev, dtype=torch.int64)
    ok = (step >= 0) & (step < D)
    dst = dst_indices.to(device=dev, dtype=torch.int64)
    src = src_indices.to(device=dev, dtype=torch.int64)
    step0 = torch.where(ok, step, torch.zeros_like(step))
    ssm, inter = _dense_last(ssm_states, intermediate_state_cache)
    ssm2, inter2 = _as_rows(ssm, 2), _as_rows(inter, 3)
    if ssm2 is None or inter2 is None:  # strides that do not flatten: generic gather/select/scatter
        vals = inter[:, src, step0]
        keep = ssm[:, dst]
        ssm[:, dst] = torch.where(ok[None, :, None, None, None], vals, keep)
        return ssm_states
    _select_rows(ssm2, _flat_rows(dst, ssm.shape[0], ssm.shape[1]),
                 inter2, _flat_rows(src * D + step0, inter.shape[0], inter.shape[1] * D), ok)
    return ssm_states


def _dense_last(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, b)``, or both transposed in their last two dims when that makes the last dim the
    densest in both (an elementwise copy between them means the same either way)."""
    if a.stride(-1) > a.stride(-2) and b.stride(-1) > b.stride(-2):
        return a.transpose(-1, -2), b.transpose(-1, -2)
    return a, b


def _as_rows(t: torch.Tensor, lead: int) -> torch.Tensor | None:
    """``t`` viewed (never copied) as ``[prod(shape[:lead]), prod(shape[lead:])]``, or None when
    its strides do not allow that."""
    inner = 1
    for s in t.shape[lead:]:
        inner *= s
    if t.numel() == 0:
        return None
    try:
        return t.view(-1, inner)
    except RuntimeError:
        return None


_WIDE = (torch.complex128, torch.int64, torch.int32, torch.int16)
_SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _wide_rows(*rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``[R, E]`` CPU row views of one dtype reinterpreted as the widest element that fits (bits
    unchanged): CPU index kernels copy element by element, so 16-byte elements move bf16
    rows about 6x faster. Returned unchanged when no wider view exists or not on the CPU."""
    if rows[0].device.type != "cpu":  # accelerator index kernels need no help (nor complex128)
        return rows
    for wide in _WIDE:
        if wide.itemsize <= rows[0].element_size():
            break
        try:
            return tuple(r.view(wide) for r in rows)
        except RuntimeError:
            continue
    return rows


def _flat_rows(idx: torch.Tensor, L: int, per_layer: int) -> torch.Tensor:
    """Row numbers ``l * per_layer + idx[i]`` of a ``[L * per_layer, E]`` view: int64 ``[L, len(idx)]``."""
    return torch.arange(L, device=idx.device, dtype=torch.int64)[:, None] * per_layer + idx[None, :]


def _select_rows(dst2: torch.Tensor, dst_rows: torch.Tensor, src2: torch.Tensor,
                 src_rows: torch.Tensor, ok: torch.Tensor) -> None:
    """``dst2[dst_rows[l, i]] = src2[src_rows[l, i]]`` for every layer l and every i with ``ok[i]``;
    when the call returns, no other row of dst2 has changed.

    dst2 / src2: ``[rows, E]`` views of one dtype; dst_rows / src_rows int64 ``[L, N]``; ok bool
    ``[N]``. Sync free, so skipped rows still copy, but only within one row per layer: they
    all write the first committed row's candidate into the first skipped row's destination
    ``T`` (by the caller's contract no committed row writes there), and ``T`` then gets its
    own bits back, so skipped rows cost no memory traffic of their own. Per chunk of layers:
    gather the candidates and the ``T`` rows, scatter the candidates, restore the ``T`` rows.
    """
    dst2, src2 = _wide_rows(dst2, src2)
    L, N = dst_rows.shape
    # First committed / first skipped row as 1-element index tensors (indexing with a 0-dim
    # tensor would read it on the host); 0 when there is none.
    first_ok = torch.argmax(ok.to(torch.int32), dim=0, keepdim=True)
    first_skip = torch.argmax((~ok).to(torch.int32), dim=0, keepdim=True)
    any_skip = (~ok).any()
    src_rows = torch.where(ok[None, :], src_rows, src_rows.index_select(1, first_ok))
    keep_rows = dst_rows.index_select(1, first_skip).view(L)  # T of each layer
    dst_rows = torch.where(ok[None, :], dst_rows, keep_rows[:, None])
    lc = _layer_chunk((N + 1, dst2.shape[1]), dst2.element_size())
    for l0 in range(0, L, lc):
        l1 = min(L, l0 + lc)
        before = dst2.index_select(0, keep_rows[l0:l1])
        cand = src2.index_select(0, src_rows[l0:l1].reshape(-1))
        dst2.index_copy_(0, dst_rows[l0:l1].reshape(-1), cand)
        # T's final bits: its own when a row was skipped; else T is row 0's destination.
        row0 = cand.view(l1 - l0, N, -1)[:, 0]
        dst2.index_copy_(0, keep_rows[l0:l1], torch.where(any_skip, before, row0))
