"""Portable kernels of the simulated deployment (torch only), vectorised over layers, rows and heads.

Each has a float64 loop definition that tests compare it to: the arithmetic in
:mod:`drift.sim.naive`, and each flow kind's read/write rule in ``drift/flows/<kind>/naive.py``.
The stages, in the order a decode step runs them (docs/semantics.md):

* input stages (§10): :func:`conv_verify` -- the conv + SiLU of each row's verify window, in
  float64, rounded once to the op's input ``mix_qkv`` (bf16) -- and :func:`gdn_gating` -- the
  log-decay ``g`` in float64 rounded once to fp32; the beta logit ``b`` goes to the op as is;
* the verify op (§5-§6): :func:`recurrent_gated_delta_rule` on :class:`VerifyArgs`, rule-free: the
  flow kind's :class:`VerifyRule` (``args.rule``, drift/flows) says where each row starts and where
  each token's state goes; sequential (non-MTP) decode: :func:`gdn_decode`;
* the update kernels (§3): :func:`move_intermediate_cache` (a raw block copy, as
  sgl-kernel-npu's Triton kernel) and :func:`conv_state_rollback` (in place), the exact
  signatures of ``sgl_kernel_npu.mamba.mamba_state_update_triton``: the shim serves them when
  that package is absent.

Conventions (one tensor-parallel rank): L layers, S pool slots, N batch rows, D verify tokens,
HK / HV key / value heads, K / V head dims, C = 2*HK*K + HV*V conv channels, Kc conv kernel,
W = (Kc-1) + (D-1) conv window rows. States are ``[.., V, K]`` blocks, the op's order, read by
their raw meaning (:func:`drift.sim.pool.raw_state`): ``S <- a S; delta = (v - S k) beta;
S <- S + delta k^T; o = S q``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..devices import on_host
from ..dtypes import as_bits
from . import native
from .pool import raw_state

STATE_CHUNK_BYTES = 4 << 20  # fp32 working set per kernel chunk (fits L2/L3 with room)
# On plain CPU tensors an index tensor already lives in host memory: reading it is no
# device sync, so the kernels copy whole rows with host-known indices (each byte moved
# once) instead of the device path's gather/scatter. Everywhere else (an accelerator, or
# drift's virtual sync-detection device) the device path runs. Tests switch this off to
# check the device path on the CPU too.
HOST_INDEX_PATHS = True
# The verify op on the CPU runs drift.sim.native's C kernel when it can be built (same arithmetic,
# one pass over each state row per token instead of five tensor ops). Tests switch it off to
# compare it with the torch-op path.
USE_NATIVE = True
L2NORM_EPS = 1e-6  # the op's EPSILON_FOR_STABILITY (docs/semantics.md §5)
SOFTPLUS_THRESHOLD = 20.0  # fused_gdn_gating's threshold (docs/semantics.md §5)
F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
_NARROW = (torch.float32, torch.bfloat16, torch.float16)  # at most 24 significant bits
_MASK_HI16 = -65536  # int32 0xFFFF0000: keeps sign, exponent and the 7 bf16 mantissa bits


def _host_indexed(*tensors: torch.Tensor) -> bool:
    """Whether the host-index row paths apply: every tensor a plain CPU tensor."""
    return HOST_INDEX_PATHS and on_host(*tensors)


def native_takes(*tensors: torch.Tensor) -> bool:
    """Whether drift's C kernels (:mod:`drift.sim.native`) can work on ``tensors`` directly: they are on,
    built, and every tensor is a plain dense CPU tensor (its raw memory is what they read and write)."""
    return (USE_NATIVE and _host_indexed(*tensors) and all(t.is_contiguous() for t in tensors)
            and native.available())


# -------------------------------------------------------------- input stages
def quantize_mix(x: torch.Tensor) -> torch.Tensor:
    """float64 conv output -> the op's ``mix_qkv``: rounded to fp32 (the conv op's accumulator),
    then to bf16 (its output dtype), each round to nearest even."""
    return x.to(F32).to(BF16)


def conv_mix(window: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``mix_qkv`` bf16 ``[L, N, D, C]`` of the D tokens ``x [L, N, D, C]`` given the ``Kc-1`` tokens
    before them, ``window [L, N, Kc-1, C]``; weight ``[L, C, Kc]`` (tap m multiplies token
    ``t - (Kc-1) + m``). SiLU(depthwise causal conv) in float64, taps summed in order m = 0 .. Kc-1,
    SiLU as ``z / (1 + exp(-z))``, then :func:`quantize_mix`."""
    if USE_NATIVE and native.conv_takes(window, x, weight):  # the taps and the rounding in C, the same bits
        acc, neg = native.conv_taps(window, x, weight)
        exp_neg = neg.exp_()
        out = native.conv_silu_bf16(acc, exp_neg)
        if out is not None:
            return out
        return quantize_mix(acc.div_(exp_neg.add_(1.0)))  # a NaN: torch rounds it
    D, Kc = x.shape[2], weight.shape[-1]
    seq = torch.empty((*x.shape[:2], Kc - 1 + D, x.shape[3]), dtype=F64, device=x.device)  # [L, N, Kc-1+D, C]
    seq[:, :, :Kc - 1] = window
    seq[:, :, Kc - 1:] = x
    taps = weight.to(F64).permute(2, 0, 1).contiguous()[:, :, None, None, :]  # [Kc, L, 1, 1, C]
    # A product of two values of at most 24 significant bits is exact in float64, so the fused
    # acc + s * w rounds once, as acc + (s * w) does: the same bits, in place.
    exact = all(t.dtype in _NARROW for t in (window, x, weight))
    acc = seq[:, :, 0:D] * taps[0]
    for m in range(1, Kc):
        if exact:
            acc.addcmul_(seq[:, :, m:m + D], taps[m])
        else:
            acc.add_(seq[:, :, m:m + D] * taps[m])
    return quantize_mix(acc.div_(torch.neg(acc).exp_().add_(1.0)))  # SiLU: acc / (1 + exp(-acc))


def gdn_gating(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """The op's ``g`` fp32 ``[L, N, D, HV]``: ``-exp(A_log) * softplus(a + dt_bias)`` (threshold 20)
    in float64, rounded once to fp32. a ``[L, N, D, HV]``; A_log, dt_bias ``[L, HV]``."""
    bias, neg_rate = _gating_params(A_log, dt_bias)
    z = a.to(F64) + bias
    sp = torch.where(z > SOFTPLUS_THRESHOLD, z, torch.log1p(torch.exp(torch.clamp(z, max=SOFTPLUS_THRESHOLD))))
    return (neg_rate * sp).to(F32)


_GATING: dict = {}  # (id, version, device) of A_log and dt_bias -> (them, what _gating_params made of them)


def _gating_params(A_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dt_bias`` and ``-exp(A_log)`` in float64, ``[L, 1, 1, HV]``: computed once per pair of parameter
    tensors (the stream's constants; a change made in place bumps a version and recomputes them), not at
    every call (four tensor ops a step). The same values gdn_gating computed inline."""
    key = (id(A_log), A_log._version, id(dt_bias), dt_bias._version, A_log.device)
    hit = _GATING.get(key)
    if hit is None or hit[0] is not A_log or hit[1] is not dt_bias:
        if len(_GATING) > 8:
            _GATING.clear()
        hit = (A_log, dt_bias, dt_bias.to(F64)[:, None, None, :], -torch.exp(A_log.to(F64))[:, None, None, :])
        _GATING[key] = hit
    return hit[2], hit[3]


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim, in x's dtype (the op's kL2Norm / qL2Norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def op_inputs(mix: torch.Tensor, beta_logit: torch.Tensor, g: torch.Tensor, num_k_heads: int,
              head_k_dim: int, num_v_heads: int, head_v_dim: int, scale: float,
              dtype: torch.dtype = F32):
    """What the op derives from its inputs, in ``dtype`` (fp32 in the op, float64 for the truth).

    mix ``[..., C]``, beta_logit / g ``[..., HV]``. Returns q, k ``[..., HV, K]`` (L2-normalised,
    q times ``scale`` after it, key heads repeated over their value-head group), v ``[..., HV, V]``,
    decay = ``exp(g)`` and beta = ``sigmoid(b)`` ``[..., HV]``.
    """
    HK, K, HV, V = num_k_heads, head_k_dim, num_v_heads, head_v_dim
    lead = mix.shape[:-1]
    x = mix.to(dtype)
    q = l2norm(x[..., : HK * K].reshape(*lead, HK, K)) * scale
    k = l2norm(x[..., HK * K: 2 * HK * K].reshape(*lead, HK, K))
    v = x[..., 2 * HK * K:].reshape(*lead, HV, V)
    if HV != HK:
        group = HV // HK
        q = q.unsqueeze(-2).expand(*lead, HK, group, K).reshape(*lead, HV, K)
        k = k.unsqueeze(-2).expand(*lead, HK, group, K).reshape(*lead, HV, K)
    return q, k, v, torch.exp(g.to(dtype)), torch.sigmoid(beta_logit.to(dtype))


# ----------------------------------------------------------------------- conv
def conv_verify(conv_states: torch.Tensor, slots: torch.Tensor, x: torch.Tensor,
                weight: torch.Tensor) -> torch.Tensor:
    """The verify conv, NPU extended-window layout: ``mix_qkv`` bf16 ``[L, N, D, C]``
    (:func:`conv_mix`) of each row's window ``x [L, N, D, C]``, given the last ``Kc-1`` rows of its
    slot's buffer in ``conv_states [L, S, W, C]`` (any dtype and strides); weight ``[L, C, Kc]``.
    Leaves each slot's buffer rolled: ``[old[D:], x_0 .. x_{D-1}]`` (what conv_state_rollback
    later undoes; docs/semantics.md §3)."""
    L, S, W, C = conv_states.shape
    N, D, Kc = x.shape[1], x.shape[2], weight.shape[-1]
    slots = slots.to(torch.int64)
    # Whole-slot row copies when each slot's window is one dense block ([W, C] or, for the
    # channel-major layout, [C, W] storage): rows [L * S, W * C] in storage order.
    rows, cw = _slot_rows(conv_states)
    flat = _flat_rows(slots, L, S).reshape(-1)
    if rows is None:
        buf = conv_states.index_select(1, slots)  # [L, N, W, C]
    elif cw:
        buf = rows.index_select(0, flat).view(L, N, C, W).transpose(-1, -2)
    else:
        buf = rows.index_select(0, flat).view(L, N, W, C)
    out = conv_mix(buf[:, :, W - (Kc - 1):], x, weight)
    xs = x.to(conv_states.dtype)
    if cw:  # the rolled windows built in storage order [L, N, C, W]
        rolled = torch.cat([buf.transpose(-1, -2)[..., D:], xs.transpose(-1, -2)], dim=-1)
    else:
        rolled = torch.cat([buf[:, :, D:], xs], dim=2)
    if rows is None:
        conv_states.index_copy_(1, slots, rolled)
    else:
        dst, src = _wide_rows(rows, rolled.reshape(L * N, W * C))
        dst.index_copy_(0, flat, src)
    return out


def conv_verify_at(conv_states: torch.Tensor, slots: torch.Tensor, offset: torch.Tensor, x: torch.Tensor,
                   weight: torch.Tensor, rows: torch.Tensor, lengths: Optional[torch.Tensor] = None,
                   live: Optional[torch.Tensor] = None) -> torch.Tensor:
    """vLLM 0.33.0's speculative conv update (``causal_conv1d_update`` with ``num_accepted_tokens``,
    model_executor/layers/mamba/ops/causal_conv1d.py), for the batch rows ``rows`` (the others,
    on the NULL block, are skipped: their output is zero). Row b reads the ``Kc-1`` inputs at
    ``offset[b] = n - 1`` of its slot's buffer ``conv_states [L, S, W, C]`` (``W = Kc-1 + D-1``, the
    cache's state_len), returns ``mix_qkv`` bf16 ``[L, N, D, C]`` (:func:`conv_mix`) and leaves the
    buffer ``[old[offset + 1 : offset + Kc-1], x_0 .. x_{D-1}]``: the next step reads at its own
    accept count (a lazy rollback: nothing is rolled back after the step). slots / offset int64
    ``[N]``; rows int64 ``[n]``, fixed by the pool (no device read). lengths ``[N]``: tokens each row
    verifies (varlen: the kernel's state_len shrinks by ``D - length``, so only the first
    ``Kc-2 + length`` columns are written); None: all D. live bool ``[N]`` (a device mask; None: every
    row of ``rows``): a row not live is skipped on the device (its slot neither read into the output nor
    written), for rows whose NULL block only the device knows."""
    L, S, W, C = conv_states.shape
    N, D, Kc = x.shape[1], x.shape[2], weight.shape[-1]
    slot = slots.index_select(0, rows)
    off = offset.index_select(0, rows)
    buf = conv_states.index_select(1, slot)  # [L, n, W, C]
    cols = off[:, None] + torch.arange(W, device=off.device)  # [n, W]; past W: never kept below
    src = cols.clamp(max=W - 1)[None, :, :, None].expand(L, -1, -1, C)
    shifted = buf.gather(2, src)  # [L, n, W, C]: column j holds old[off + j]
    out = torch.zeros(L, N, D, C, dtype=BF16, device=x.device)
    mix = conv_mix(shifted[:, :, :Kc - 1], x.index_select(1, rows), weight)
    if live is not None:
        on = live.index_select(0, rows)[None, :, None, None]
        mix = torch.where(on, mix, torch.zeros_like(mix))
    out.index_copy_(1, rows, mix)
    kept = shifted[:, :, 1:Kc - 1]  # old[off + 1 .. off + Kc - 2]
    new = torch.cat([kept, x.index_select(1, rows).to(conv_states.dtype)], dim=2)
    if lengths is not None:  # columns past Kc-2 + length keep what they held
        written = torch.arange(W, device=off.device)[None, :] < (Kc - 2) + lengths.index_select(0, rows).to(torch.int64)[:, None]
        new = torch.where(written[None, :, :, None], new, buf)
    if live is not None:  # a skipped row writes back what its slot held
        new = torch.where(on, new, buf)
    conv_states.index_copy_(1, slot, new)
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
        blocks = as_bits(blocks)
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
        if native_takes(bits):  # the hash and the rounding in C, the same bits; the cast torch's
            dst.copy_(native.stochastic_bf16_bits(bits, key, offset).view(torch.float32))
            return
        idx = torch.arange(offset, offset + bits.numel(), device=bits.device, dtype=torch.int64).view(bits.shape)
        noise = (_hash32(idx, key) & 0xFFFF).to(torch.int32)
        # Adding to the magnitude bits then truncating rounds |h| up with probability
        # (dropped bits) / 2^16, for either sign (sign-magnitude encoding).
        dst.copy_((bits + noise).bitwise_and(_MASK_HI16).view(torch.float32))
    else:
        raise ValueError(f"store rounding {rounding!r} is not known; allowed: rne, stochastic, truncate")


_KEY_STRIDE, _TOKEN_STRIDE = 1_000_003, 4099  # store_key's mix of a call's key and a token's step


def store_key(key: int, t: int) -> int:
    """The hash key of the state stored after token ``t`` of a call keyed ``key`` (the verify op's
    ``args.key``, gdn_decode's ``key``); :func:`_hash32` reads it mod 2^32."""
    return key * _KEY_STRIDE + t * _TOKEN_STRIDE


def token_key(key: int, t: int) -> int:
    """The key of a one-token call whose store hashes as token ``t`` of a call keyed ``key`` does:
    ``store_key(token_key(key, t), 0) == store_key(key, t)`` mod 2^32 (the stride is odd, so it
    has an inverse mod 2^32)."""
    return store_key(key, t) * pow(_KEY_STRIDE, -1, 1 << 32) % (1 << 32)


def round_to(h: torch.Tensor, dtype: torch.dtype, rounding: str = "rne", key: int = 0,
             offset: int = 0) -> torch.Tensor:
    """``h`` rounded to ``dtype`` and back to h's dtype (a store followed by a reload)."""
    if dtype == h.dtype:
        return h
    tmp = torch.empty(h.shape, dtype=dtype, device=h.device)
    store_state(tmp, h, rounding, key, offset)
    return tmp.to(h.dtype)


def _layer_chunk(shape_per_layer: tuple[int, ...], itemsize: int = 4) -> int:
    n = itemsize
    for s in shape_per_layer:
        n *= s
    return max(1, STATE_CHUNK_BYTES // max(n, 1))


# ------------------------------------------------------------------------ GDN
@dataclass
class Plan:
    """Where each row of one verify call starts and where the state after each token goes: a flow
    kind's :class:`VerifyRule` applied to the call's arguments. Tensors on the indices' device.

    * ``start`` int64 ``[B]``, ``from_committed`` bool ``[B]``: row b starts from slot ``start[b]``
      of ``recurrent_state`` where ``from_committed[b]``, else from flat scratch block ``start[b]``
      (:func:`scratch_blocks`);
    * ``states`` fp32 ``[L, B, HV, V, K]``: the start states themselves, when the rule computes them
      (then ``start`` is unused);
    * ``run`` bool ``[B]``: the rows computed; a row not run reads and stores nothing and its
      outputs are zero, as are a row's outputs past its ``actual_seq_lengths``. None: every row;
    * ``dest`` int64 ``[B, S]``: the flat scratch block that receives the state after token t;
      None: the verify stores no state;
    * ``stores`` bool ``[B, S]``: which tokens of ``dest`` are stored (a token not stored leaves its
      block as it was). None: all of them;
    * ``deltas``: the rule wants each token's delta ``(v - S k) beta`` (:meth:`VerifyRule.finish`).
    """

    start: Optional[torch.Tensor] = None
    from_committed: Optional[torch.Tensor] = None
    states: Optional[torch.Tensor] = None
    run: Optional[torch.Tensor] = None
    dest: Optional[torch.Tensor] = None
    stores: Optional[torch.Tensor] = None
    deltas: bool = False


class VerifyRule(abc.ABC):
    """A flow kind's read/write rule for the verify op (docs/semantics.md §6): where each row of a
    call starts and which states it stores. The kernels here (the portable op, its C kernel) and
    the engine adapters (drift/plug) implement the arithmetic; the rule, which the flow kind
    (drift/flows) hands them in ``VerifyArgs.rule``, says where it reads and writes. A kernel
    names the rules it implements by :attr:`name` (its entry's ``rules``)."""

    name: str = ""
    ragged: bool = False  # rows may run 1..S tokens (actual_seq_lengths); otherwise every row runs S
    per_token_states: bool = True  # the verify stores the state after each token (into the scratch)
    native: bool = True  # its plans fit the C kernel (a start slot or block per row, -1 for a store not made)

    @abc.abstractmethod
    def plan(self, args: "VerifyArgs") -> Plan:
        """This call's :class:`Plan`, read from ``args`` without a host sync."""

    def finish(self, args: "VerifyArgs", plan: Plan, out: torch.Tensor,
               deltas: Optional[torch.Tensor]) -> torch.Tensor:
        """After the arithmetic: what the rule writes besides states (``deltas`` fp32 ``[L, B, S, HV,
        V]`` when the plan asked for them); returns the call's bf16 outputs ``[L, B, S, HV, V]``."""
        return out


@dataclass
class VerifyArgs:
    """The verify op's arguments for every layer at once: what SGLang's Ascend backend passes
    ``torch.ops.npu.recurrent_gated_delta_rule`` per layer (docs/semantics.md §5-§6).

    mix_qkv bf16 ``[L, B, S, C]``; beta bf16 ``[L, B, S, HV]`` (pre-sigmoid logits); g fp32
    ``[L, B, S, HV]``; recurrent_state ``[L, slots, HV, V, K]`` (the pool's ``temporal``);
    intermediate_state ``[L, rows + 1, D, HV, V, K]`` (the pool's ``intermediate_ssm``, whose
    blocks the op addresses by flat index ``row * D + step``; S = D); cache_indices int32 ``[B]``;
    ssm_state_indices int32 ``[B, S]``; num_accepted_tokens int32 ``[B]``; actual_seq_lengths
    int32 ``[B]``; nk / nv key / value heads; scale (``K ** -0.5``). rounding / key: how states are
    stored -- the op's own is ``"rne"``; ``stochastic`` and ``truncate`` are drift's variants.
    rule: the flow kind's :class:`VerifyRule` (where rows start, what is stored). gate_inputs: the
    raw inputs g was computed from (:func:`gdn_gating`: a fp32 ``[L, B, S, HV]``, A_log and dt_bias
    ``[L, HV]``), which every flow passes, for a kernel that computes the gating itself.
    """

    mix_qkv: torch.Tensor
    beta: torch.Tensor
    g: torch.Tensor
    recurrent_state: torch.Tensor
    intermediate_state: torch.Tensor
    cache_indices: torch.Tensor
    ssm_state_indices: torch.Tensor
    num_accepted_tokens: torch.Tensor
    actual_seq_lengths: torch.Tensor
    nk: int
    nv: int
    scale: float
    rounding: str = "rne"
    key: int = 0
    rule: Optional[VerifyRule] = None
    gate_inputs: Optional[tuple] = None

    @property
    def dims(self) -> tuple[int, int, int, int, int, int]:
        """(L, B, S, HV, V, K)."""
        L, B, S, _ = self.mix_qkv.shape
        V, K = self.recurrent_state.shape[-2:]
        return L, B, S, self.nv, V, K

    def inputs(self, dtype: torch.dtype = F32):
        """q, k, v, decay, beta as the op derives them (:func:`op_inputs`), in ``dtype``."""
        L, B, S, HV, V, K = self.dims
        return op_inputs(self.mix_qkv, self.beta, self.g, self.nk, K, HV, V, self.scale, dtype)

    def accepted_index(self) -> torch.Tensor:
        """``ssm_state_indices[b, num_accepted_tokens[b] - 1]`` int64 ``[B]`` (a count of 0 reads column
        0): the index the accept count names, where the rules of drift's flows start a row."""
        idx = self.ssm_state_indices.to(torch.int64)
        n = self.num_accepted_tokens.to(torch.int64)
        return idx.gather(1, (n - 1).clamp(min=0)[:, None]).squeeze(1)

    def plan(self) -> Plan:
        """The rule's :class:`Plan` for this call (ValueError when no rule was given)."""
        if self.rule is None:
            raise ValueError("VerifyArgs.rule is None: the flow kind's verify rule says where each row starts and "
                             "what is stored (drift.flows: its flow's verify_args passes it)")
        return self.rule.plan(self)


# The verify-kernel plug point: ``kernel(args: VerifyArgs) -> bf16 [L, B, S, HV, V]``, reading and
# writing states where ``args.rule`` says (``args.plan()``).
VerifyKernel = Callable[[VerifyArgs], torch.Tensor]


def scratch_blocks(intermediate: torch.Tensor) -> torch.Tensor:
    """``intermediate [L, rows + 1, D, HV, V, K]`` as the op addresses it: ``[L, (rows + 1) * D,
    HV, V, K]`` raw blocks by flat index ``row * D + step`` (a view)."""
    raw = raw_state(intermediate)
    L, R, D = raw.shape[:3]
    if D == 0:  # a flow whose verify keeps no per-token states: no blocks
        return raw.new_empty((L, 0, *raw.shape[3:]))
    if raw.stride(1) != D * raw.stride(2):
        raise ValueError("the scratch's rows and draft steps are not one flat run of blocks; the verify op "
                         f"addresses them by flat index (strides {raw.stride()})")
    return torch.as_strided(raw, (L, R * D, *raw.shape[3:]), (raw.stride(0), raw.stride(2), *raw.stride()[3:]),
                            raw.storage_offset())


def _gdn_token(h: torch.Tensor, q, k, v, decay, beta, o_out, u_out=None) -> None:
    """One gated delta-rule token on flattened heads, in place, ``[V, K]`` orientation.

    h ``[B, V, K]`` (float32 or float64); q, k ``[B, K]``; v ``[B, V]``; decay, beta ``[B]``.
    ``h <- h*decay; u = (v - h k)*beta; h <- h + u k^T; o = h q`` (o written to o_out ``[B, V]``,
    the delta u to u_out ``[B, V]`` when given).
    """
    h.mul_(decay[:, None, None])
    hk = torch.bmm(h, k.unsqueeze(2))  # [B, V, 1]
    u = (v.unsqueeze(2) - hk).mul_(beta[:, None, None])
    h.addcmul_(u, k.unsqueeze(1))  # rank-1 update (elementwise: faster than a k=1 baddbmm)
    torch.bmm(h, q.unsqueeze(2), out=o_out.unsqueeze(2))
    if u_out is not None:
        u_out.copy_(u.squeeze(2))


def _layer_major(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[L, B, S, ...]`` -> contiguous ``[S, L, B, ...]`` in dtype (values unchanged)."""
    return t.to(dtype).movedim(2, 0).contiguous()


def recurrent_gated_delta_rule(args: VerifyArgs, compute_dtype: torch.dtype = F32) -> torch.Tensor:
    """The verify op (docs/semantics.md §5-§6) for every layer at once, rule-free: each row starts
    where the flow kind's rule says (``args.plan()``), runs its tokens in ``compute_dtype`` (the op:
    fp32) and stores the state after token t where the plan says (``args.rounding``); the
    committed states are never written. Returns the outputs ``o = S q`` (of the unrounded running
    state) as bf16 ``[L, B, S, HV, V]``, after the rule's :meth:`VerifyRule.finish`. On plain CPU
    tensors the C kernel of :mod:`drift.sim.native` runs when the plan fits it (:func:`uses_native`);
    everywhere else :func:`recurrent_gated_delta_rule_torch`."""
    plan = args.plan()
    if not (plan.states is None and not plan.deltas and _plain(args) and uses_native(args, compute_dtype)):
        return _torch_verify(args, plan, compute_dtype)
    L, B, S, HV, V, K = args.dims
    q, k, v, decay, beta = args.inputs(compute_dtype)
    check_lengths(args)
    start, from_rec = plan.start.tolist(), plan.from_committed.tolist()
    run = [True] * B if plan.run is None else plan.run.tolist()
    rows = [b for b in range(B) if run[b]]
    lengths = args.actual_seq_lengths.tolist()
    dest = plan.dest.tolist() if plan.dest is not None else [[-1] * S for _ in range(B)]
    if plan.stores is not None:
        stores = plan.stores.tolist()
        dest = [[i if keep else -1 for i, keep in zip(d, s)] for d, s in zip(dest, stores)]
    src = [slot if f else i for slot, f, i in zip(args.cache_indices.tolist(), from_rec, start)]
    out = torch.zeros(L, B, S, HV, V, dtype=compute_dtype)
    rec, blocks = raw_state(args.recurrent_state), scratch_blocks(args.intermediate_state)
    if len(rows) == B:
        native.recurrent_gated_delta_rule(rec, blocks, src, from_rec, dest, *(t.contiguous() for t in (q, k, v, decay, beta)),
                                          out)
    elif rows:
        sel = torch.tensor(rows, dtype=torch.int64)
        part = torch.empty(L, len(rows), S, HV, V, dtype=compute_dtype)
        native.recurrent_gated_delta_rule(rec, blocks, [src[b] for b in rows], [from_rec[b] for b in rows],
                                          [dest[b] for b in rows],
                                          *(t.index_select(1, sel).contiguous() for t in (q, k, v, decay, beta)), part)
        out.index_copy_(1, sel, part)
    if plan.run is not None and any(n < S for n in lengths):  # a short row's extra tokens: zero
        ran = (torch.arange(S)[None, :] < torch.tensor(lengths)[:, None])[None, :, :, None, None]
        out = torch.where(ran, out, torch.zeros_like(out))
    return args.rule.finish(args, plan, out.to(BF16), None)


def _plain(args: VerifyArgs) -> bool:
    """Whether every tensor the verify op indexes by is a plain CPU tensor (:func:`_host_indexed`)."""
    return _host_indexed(raw_state(args.recurrent_state), scratch_blocks(args.intermediate_state), args.cache_indices,
                         args.ssm_state_indices, args.num_accepted_tokens, args.actual_seq_lengths)


def check_lengths(args: VerifyArgs) -> None:
    """ValueError unless every row runs all S tokens, or 1..S tokens where the rule is ragged (vLLM's
    varlen verify), when ``args`` are plain CPU tensors; elsewhere reading the lengths would be a
    host sync, and nothing is checked."""
    if not _plain(args):
        return
    S = args.mix_qkv.shape[2]
    ragged = bool(getattr(args.rule, "ragged", False))
    host_len = args.actual_seq_lengths.to(torch.int64).tolist()
    if not all(0 < n <= S for n in host_len) or (not ragged and any(n != S for n in host_len)):
        raise ValueError(f"actual_seq_lengths {host_len}: drift's verify runs every row's S = {S} tokens"
                         + (f" (1..S by the {args.rule.name} rule)" if ragged else ""))


def recurrent_gated_delta_rule_torch(args: VerifyArgs, compute_dtype: torch.dtype = F32) -> torch.Tensor:
    """:func:`recurrent_gated_delta_rule` in torch ops, whatever the device: the same semantics as
    the C kernel, which agrees with it to float32 rounding, not bit for bit (:mod:`drift.sim.native`).
    The state after each token is stored (rounded to the scratch dtype) while the running state
    stays in ``compute_dtype``."""
    return _torch_verify(args, args.plan(), compute_dtype)


def _torch_verify(args: VerifyArgs, plan: Plan, compute_dtype: torch.dtype) -> torch.Tensor:
    L, B, S, HV, V, K = args.dims
    cd = compute_dtype
    q, k, v, decay, beta = args.inputs(cd)
    rec = raw_state(args.recurrent_state)
    inter = scratch_blocks(args.intermediate_state)
    sdt = inter.dtype
    plain = _plain(args)
    check_lengths(args)
    qt, kt, vt, dect, bt = (_layer_major(t, cd) for t in (q, k, v, decay, beta))
    out = torch.empty(S, L, B, HV, V, dtype=cd, device=q.device)
    deltas = torch.empty(S, L, B, HV, V, dtype=cd, device=q.device) if plan.deltas else None
    step = _layer_chunk((B, HV, V, K), torch.finfo(cd).bits // 8)
    h_buf = torch.empty(min(step, L) * B * HV, V, K, dtype=cd, device=q.device)
    dest = plan.dest.to(device=inter.device) if plan.dest is not None else None
    run = plan.run
    host = None
    if plain:  # host lists: one converting copy per row, one store per stored token
        host = (None if plan.states is not None else (plan.start.tolist(), plan.from_committed.tolist(),
                                                      args.cache_indices.tolist()),
                None if run is None else run.tolist(), None if dest is None else dest.tolist(),
                None if plan.stores is None else plan.stores.tolist())
    given = plan.states
    if given is not None and run is not None and host is None:  # on the host: a row not run is zeroed in h
        given = torch.where(run.to(given.device)[None, :, None, None, None], given, torch.zeros_like(given))
    if not plain and given is None:
        slots = args.cache_indices.to(device=rec.device, dtype=torch.int64)
        start_d, from_d = plan.start.to(rec.device), plan.from_committed.to(rec.device)
        live = None if run is None else run.to(rec.device)[None, :, None, None, None]
    stores = None if plan.stores is None else plan.stores.to(inter.device)
    for l0 in range(0, L, step):
        l1 = min(L, l0 + step)
        nb = (l1 - l0) * B * HV
        h = h_buf[:nb]
        hv = h.view(l1 - l0, B, HV, V, K)
        if given is not None:
            hv.copy_(given[l0:l1])
            for b in () if host is None or host[1] is None else range(B):
                if not host[1][b]:  # the where above, made on the chunk: a row not run starts from +0.0
                    hv[:, b].zero_()
        elif host is not None:
            (starts, fr, slot_list), runs = host[0], host[1]
            for b in range(B):
                if runs is not None and not runs[b]:
                    hv[:, b].zero_()
                else:
                    hv[:, b].copy_(rec[l0:l1, slot_list[b]] if fr[b] else inter[l0:l1, starts[b]])
        else:
            cand_rec = rec[l0:l1].index_select(1, slots)
            cand_int = inter[l0:l1].index_select(1, start_d)
            hv.copy_(torch.where(from_d[None, :, None, None, None], cand_rec, cand_int))
            if live is not None:
                hv.copy_(torch.where(live, hv, torch.zeros_like(hv)))
        for t in range(S):
            _gdn_token(h, qt[t, l0:l1].view(nb, K), kt[t, l0:l1].view(nb, K), vt[t, l0:l1].view(nb, V),
                       dect[t, l0:l1].view(nb), bt[t, l0:l1].view(nb), out[t, l0:l1].view(nb, V),
                       None if deltas is None else deltas[t, l0:l1].view(nb, V))
            if dest is None:
                continue
            stored = torch.empty(l1 - l0, B, HV, V, K, dtype=sdt, device=h.device)
            store_state(stored, hv, args.rounding, store_key(args.key, t), offset=l0 * B * HV * V * K)
            if host is not None:
                for b in range(B):
                    if host[3] is None or host[3][b][t]:
                        inter[l0:l1, host[2][b][t]].copy_(stored[:, b])
            else:
                if stores is not None:  # a token not stored writes back what its block holds
                    keep = stores[:, t][None, :, None, None, None]
                    stored = torch.where(keep, stored, inter[l0:l1].index_select(1, dest[:, t]))
                inter[l0:l1].index_copy_(1, dest[:, t], stored)
    if run is not None:  # a row not run computes nothing, a short row its own tokens: the rest stays zero
        ran = (torch.arange(S, device=out.device)[:, None] < args.actual_seq_lengths.to(out.device)[None, :]) \
            & run.to(out.device)[None, :]  # [S, B]
        out = torch.where(ran[:, None, :, None, None], out, torch.zeros_like(out))
    res = out.permute(1, 2, 0, 3, 4).to(BF16)
    return args.rule.finish(args, plan, res, None if deltas is None else deltas.permute(1, 2, 0, 3, 4))


def uses_native(args: VerifyArgs, compute_dtype: torch.dtype = F32) -> bool:
    """Whether :func:`recurrent_gated_delta_rule` with these arguments runs the C kernel (the rule's
    plans fit it, plain CPU tensors, dense blocks, a store the C kernel makes)."""
    if not USE_NATIVE or compute_dtype != F32 or not getattr(args.rule, "native", False):
        return False
    rec, inter = raw_state(args.recurrent_state), args.intermediate_state
    if not (_host_indexed(rec, inter, args.cache_indices, args.ssm_state_indices) and rec.is_contiguous()):
        return False
    try:
        blocks = scratch_blocks(inter)
    except ValueError:
        return False
    return blocks.is_contiguous() and native.supports(rec, blocks, args.rounding)


def gdn_decode(state: torch.Tensor, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor, num_tokens: torch.Tensor,
               rounding: str = "rne", key: int = 0, compute_dtype: torch.dtype = F32,
               captures=(), norms_out: torch.Tensor | None = None,
               deltas_out: torch.Tensor | None = None) -> torch.Tensor:
    """Sequential (non-MTP) decode: one token at a time, the state stored after every token.

    state ``[L, S, HV, V, K]`` (any dtype; a raw view of the pool, or the truth's own float64
    states) is read at ``slots [N]``; q, k ``[L, N, D, HV, K]``, v ``[L, N, D, HV, V]``, decay and
    beta ``[L, N, D, HV]`` as :func:`op_inputs` derives them. Row n processes its first
    ``num_tokens[n]`` tokens (a token beyond gets decay 1 and beta 0, an exact identity); the
    state is rounded to ``state``'s dtype after each token (nothing to round when that is the
    compute dtype) and written back to ``slots``. Each ``(steps, out)`` in ``captures`` (steps a
    host int array ``[N]``, -1 = none; out ``[L, N, HV, V, K]``) receives the state of row n after
    token ``steps[n]``; ``norms_out [L, N, D, HV]`` receives ``||S||_F^2`` after every token, and
    ``deltas_out [L, N, D, HV, V]`` each token's delta ``u = beta (v - a S k)`` (``S <- a S + u k^T``;
    zero past num_tokens; the torch path computes it, the C kernel does not).
    Returns outputs ``[L, N, D, HV, V]`` in compute_dtype (entries past num_tokens are meaningless).
    """
    L, N, D, HV, K = q.shape
    V = v.shape[-1]
    cd = compute_dtype
    if deltas_out is None and _native_decode(state, slots, cd, norms_out, captures):
        return _decode_f64_native(state, q, k, v, decay, beta, num_tokens, captures, norms_out)
    slots = slots.to(torch.int64)
    sdt = state.dtype
    active = torch.arange(D, device=q.device)[None, :] < num_tokens.to(q.device)[:, None]  # [N, D]
    act = active[None, :, :, None]
    dec = torch.where(act, decay.to(cd), torch.ones((), dtype=cd, device=q.device))
    bt = torch.where(act, beta.to(cd), torch.zeros((), dtype=cd, device=q.device))
    qc, kc, vc = q.to(cd), k.to(cd), v.to(cd)
    out = torch.empty(L, N, D, HV, V, dtype=cd, device=q.device)
    step = _layer_chunk((N, HV, V, K), torch.finfo(cd).bits // 8)
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
        nb = (l1 - l0) * N * HV
        h = state[l0:l1].index_select(1, slots).to(cd).reshape(nb, V, K)
        for t in range(D):
            o_t = torch.empty(nb, V, dtype=cd, device=q.device)
            u_t = None if deltas_out is None else torch.empty(nb, V, dtype=cd, device=q.device)
            _gdn_token(h, qc[l0:l1, :, t].reshape(nb, K), kc[l0:l1, :, t].reshape(nb, K),
                       vc[l0:l1, :, t].reshape(nb, V), dec[l0:l1, :, t].reshape(nb),
                       bt[l0:l1, :, t].reshape(nb), o_t, u_t)
            if u_t is not None:
                deltas_out[l0:l1, :, t] = u_t.view(l1 - l0, N, HV, V).to(deltas_out.dtype)
            out[l0:l1, :, t] = o_t.view(l1 - l0, N, HV, V)
            if sdt != cd:
                h.copy_(round_to(h, sdt, rounding, store_key(key, t), offset=l0 * N * HV * V * K))
            if norms_out is not None:
                norms_out[l0:l1, :, t] = h.square().sum((-1, -2)).view(l1 - l0, N, HV).to(norms_out.dtype)
            for mask, cap_out in cap_masks.get(t, ()):
                hvw = h.view(l1 - l0, N, HV, V, K)
                cap_out[l0:l1] = torch.where(mask, hvw.to(cap_out.dtype), cap_out[l0:l1])
        state[l0:l1].index_copy_(1, slots, h.view(l1 - l0, N, HV, V, K).to(sdt))
    return out


def _native_decode(state: torch.Tensor, slots: torch.Tensor, compute_dtype, norms_out, captures) -> bool:
    """Whether :func:`gdn_decode` runs :func:`drift.sim.native.decode_f64`: the float64 truth's own
    dense states, every row its own slot, on plain CPU tensors, when the C kernel builds."""
    if not (USE_NATIVE and compute_dtype == F64 and state.dtype == F64 and _host_indexed(state, slots)
            and state.is_contiguous() and native.available()):
        return False
    if slots.shape[0] != state.shape[1] or slots.tolist() != list(range(state.shape[1])):
        return False
    if norms_out is not None and not (type(norms_out) is torch.Tensor and norms_out.dtype == F64
                                      and norms_out.is_contiguous()):
        return False
    return all(type(c) is torch.Tensor and c.dtype == F64 and c.is_contiguous() for _, c in captures)


def _decode_f64_native(state, q, k, v, decay, beta, num_tokens, captures, norms_out) -> torch.Tensor:
    L, N, D, HV, K = q.shape
    out = torch.empty(L, N, D, HV, v.shape[-1], dtype=F64)
    norms = norms_out if norms_out is not None else torch.empty(L, N, D, HV, dtype=F64)
    dense = (t.to(F64).contiguous() for t in (q, k, v, decay, beta))
    native.decode_f64(state, [int(n) for n in num_tokens.tolist()], *dense, out, norms,
                      [([int(x) for x in steps], cap) for steps, cap in captures])
    return out


def gdn_decode_steps(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                     beta: torch.Tensor, num_tokens: torch.Tensor, out: torch.Tensor, norms: torch.Tensor,
                     states_out: torch.Tensor | None = None, captures=()) -> bool:
    """``n`` steps of :func:`gdn_decode` of the float64 truth (its own dense states, every row its own
    slot) in one C call (:func:`drift.sim.native.decode_f64_steps`), the same bits as ``n`` calls:
    q, k ``[n, L, R, D, HV, K]``, v ``[n, L, R, D, HV, V]``, decay, beta ``[n, L, R, D, HV]`` (float64),
    num_tokens int64 CPU ``[n, R]``; out ``[n, L, R, D, HV, V]`` and norms ``[n, L, R, D, HV]`` receive each
    step's outputs and ``||S||_F^2``, states_out (``[n, L, R, HV, V, K]``, or None) its state; captures:
    (step j, host token indices ``[R]``, out ``[L, R, HV, V, K]``). Returns False, having done nothing,
    where the C kernel does not take the call (then step :func:`gdn_decode`)."""
    buffers = [state, q, k, v, decay, beta, out, norms] + ([states_out] if states_out is not None else [])
    if not (native_takes(*buffers, *(c for _, _, c in captures)) and all(t.dtype == F64 for t in buffers)):
        return False
    native.decode_f64_steps(state, num_tokens.to(torch.int64).contiguous(), q, k, v, decay,
                            beta, out, norms, states_out,
                            [(j, [int(x) for x in steps], cap) for j, steps, cap in captures])
    return True


# -------------------------------------------------------------- update kernels
def move_intermediate_cache(ssm_states: torch.Tensor, intermediate_state_cache: torch.Tensor,
                            dst_indices: torch.Tensor, src_indices: torch.Tensor,
                            last_steps: torch.Tensor) -> torch.Tensor:
    """For every layer and every i with ``last_steps[i] >= 0``: the block
    ``intermediate_state_cache[l, src[i], last_steps[i]]`` copied into ``ssm_states[l, dst[i]]`` as
    raw memory in flat order, whatever the views' inner strides (docs/semantics.md §3: the
    sgl-kernel-npu Triton kernel; on blocks of one layout the logical copy, on a transposed
    destination not). In place; no host sync (on plain CPU tensors: one block copy per committed
    row, indices read on the host, :data:`HOST_INDEX_PATHS`).

    ssm_states ``[L, S, HV, V, K]``; intermediate_state_cache ``[L, rows, D, HV, V, K]``; the block
    read is the flat one ``src[i] * D + last_steps[i]`` (the kernel checks no upper bound; drift
    raises IndexError past the buffer). To stay sync free, skipped rows still write: each layer's
    first skipped destination gets its own current bits back, so a skipped row must not share its
    destination with a committed one (padded rows use the dummy slot 0, which no request owns).
    """
    if ssm_states.ndim != 5 or intermediate_state_cache.ndim != 6:
        raise ValueError("move_intermediate_cache expects ssm_states [L, S, HV, V, K] and "
                         "intermediate_state_cache [L, rows, D, HV, V, K]; got shapes "
                         f"{tuple(ssm_states.shape)} and {tuple(intermediate_state_cache.shape)}")
    if ssm_states.dtype != intermediate_state_cache.dtype:
        raise ValueError("move_intermediate_cache copies raw values and does not cast: dtypes "
                         f"{ssm_states.dtype} and {intermediate_state_cache.dtype} differ")
    if ssm_states.shape[2:] != intermediate_state_cache.shape[3:]:
        raise ValueError(f"state shapes differ: {tuple(ssm_states.shape[2:])} vs "
                         f"{tuple(intermediate_state_cache.shape[3:])}")
    L, S = ssm_states.shape[:2]
    R, D = intermediate_state_cache.shape[1:3]
    ssm3 = _blocks(raw_state(ssm_states))  # [L, S, E]: each slot's raw block, any layer / slot strides
    inter3 = _blocks(scratch_blocks(intermediate_state_cache))  # [L, R * D, E]
    if _host_indexed(ssm_states, intermediate_state_cache, dst_indices, src_indices, last_steps):
        for d, r, st in zip(dst_indices.tolist(), src_indices.tolist(), last_steps.tolist()):
            if st >= 0:
                flat = r * D + st
                if not (0 <= d < S and 0 <= flat < R * D):  # Python indexing would wrap a negative one
                    raise IndexError(f"move_intermediate_cache: destination slot {d} (of {S}) or source "
                                     f"block {r} * {D} + {st} (of {R * D}) out of range")
                ssm3[:, d].copy_(inter3[:, flat])
        return ssm_states
    dev = ssm_states.device
    step = last_steps.to(device=dev, dtype=torch.int64)
    ok = step >= 0
    dst = dst_indices.to(device=dev, dtype=torch.int64)
    src = src_indices.to(device=dev, dtype=torch.int64) * D + step
    try:
        _select_blocks(ssm3, dst, inter3, src, ok)
    except (RuntimeError, IndexError) as exc:
        if "out of" not in str(exc):
            raise
        raise IndexError(f"move_intermediate_cache: a destination slot (of {S}) or source block (of {R * D}) "
                         f"is out of range ({exc})") from exc
    return ssm_states


def _blocks(raw: torch.Tensor) -> torch.Tensor:
    """``raw [L, n, HV, V, K]`` (dense ``[HV, V, K]`` blocks, any outer strides) as ``[L, n, E]``."""
    L, n = raw.shape[:2]
    E = raw[0, 0].numel() if raw.numel() else 0
    inner = raw.stride()[2:]
    if tuple(inner) != tuple(torch.empty(raw.shape[2:], device="meta").stride()):
        raise ValueError(f"a state block of strides {inner} is not dense")
    return torch.as_strided(raw, (L, n, E), (raw.stride(0), raw.stride(1), 1), raw.storage_offset())


def _select_blocks(dst3: torch.Tensor, dst: torch.Tensor, src3: torch.Tensor, src: torch.Tensor,
                   ok: torch.Tensor) -> None:
    """``dst3[l, dst[i]] = src3[l, src[i]]`` for every layer l and every i with ``ok[i]``; when the
    call returns, no other block of dst3 has changed, and a skipped row's indices are never used
    (the real kernel returns before it reads them).

    dst3 / src3: ``[L, n, E]`` block views of one dtype; dst / src int64 ``[N]``; ok bool ``[N]``.
    Sync free, so skipped rows still copy: they copy the first committed row's block onto that
    row's destination ``T`` (the value it gets anyway), and when no row commits ``T`` gets its own
    bits back. Per chunk of layers: gather the candidates and ``T``, scatter, set ``T``.
    """
    N = dst.shape[0]
    # The first committed row as a 1-element index tensor (a 0-dim index would be read on the host).
    first = torch.argmax(ok.to(torch.int32), dim=0, keepdim=True)
    any_ok = ok.any()
    src = torch.where(ok, src, src.index_select(0, first).clamp(0, src3.shape[1] - 1))
    dst = torch.where(ok, dst, dst.index_select(0, first).clamp(0, dst3.shape[1] - 1))
    target = dst.index_select(0, first)  # T
    L = dst3.shape[0]
    lc = _layer_chunk((N + 1, dst3.shape[2]), dst3.element_size())
    for l0 in range(0, L, lc):
        l1 = min(L, l0 + lc)
        d3, s3 = _wide_rows(dst3[l0:l1], src3[l0:l1])
        before = d3.index_select(1, target)
        cand = s3.index_select(1, src)
        d3.index_copy_(1, dst, cand)
        d3.index_copy_(1, target, torch.where(any_ok, cand.index_select(1, first), before))


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
