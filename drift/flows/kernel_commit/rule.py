"""The kernel-commit kind's verify rule: SGLang 0.5.23's ReplaySSM spec verify
(``gdn_replayssm_spec_circular_kernel``, ``launch_mode="verify"``, in
``sglang/kernels/ops/attention/linear/gdn_replayssm_spec_decode.py``; docs/semantics.md §6)."""

from __future__ import annotations

import torch

from ...sim.kernels import Plan, VerifyArgs, VerifyRule, l2norm
from ...sim.pool import STALE
from .pool import ReplayPool, effective_states, put_records

F32 = torch.float32


def key_heads(args: VerifyArgs) -> torch.Tensor:
    """The normalised key of each key head, fp32 ``[L, B, S, H, K]``: what :func:`drift.sim.kernels.op_inputs`
    computes for k before repeating it over the value heads (the same operations, so the same
    bits), without the op's other inputs."""
    H, K = args.nk, args.dims[5]
    x = args.mix_qkv.to(F32)
    return l2norm(x[..., H * K: 2 * H * K].reshape(*x.shape[:-1], H, K))


class RingRule(VerifyRule):
    """Over the run's :class:`~drift.flows.kernel_commit.pool.ReplayPool` (checkpoint slot
    ``state_indices[b]``, ring slot ``replay_indices[b]``): a padded row (slot -1) computes nothing
    and its outputs are zeros; a row whose ``is_flush`` is set is left to the flush launch, which
    SGLang's spec path never runs (outputs uninitialised: NaN here, and no records). Every other row
    starts from its checkpoint with the ring's ``write_pos`` records folded in and runs its S
    tokens; no state is stored, and token t's record -- its delta ``d`` and normalised key ``k`` as the
    design stores them (SGLang's: each a bf16 high plus a bf16 low part; ``pool.design.split_records``),
    and its fp32 log-decay ``g`` -- goes to ring position
    ``(cache_base + write_pos + t) & (RL - 1)`` when ``write_pos + t < RL``. drift's rendering of the
    kernel's maths is the recurrent op's (the kernel's chunked UT form is the same in exact
    arithmetic; docs/semantics.md §10)."""

    name = "ring"
    per_token_states = False
    native = False  # its start states are a fold, and it keeps each token's delta

    def __init__(self, pool: ReplayPool):
        self.pool = pool
        # Set by a verify that keeps its records in windows of its own (FlashInfer's raw-input replay,
        # drift/plug/flashinfer_replayssm.py) rather than in this ring: the ring then holds nothing a
        # tracked snapshot's exact reference could fold (drift/flows/kernel_commit/reference.py).
        self.records_elsewhere = False

    def _rows(self, args: VerifyArgs):
        pool, dev, B = self.pool, args.mix_qkv.device, args.mix_qkv.shape[1]  # the step's rows
        slots, replay = pool.state_indices[:B].to(dev), pool.replay_indices[:B].to(dev)
        live = slots >= 0
        flush = pool.is_flush.index_select(0, replay) != 0
        return slots, replay, live, flush

    def plan(self, args: VerifyArgs) -> Plan:
        slots, replay, live, flush = self._rows(args)
        states = effective_states(self.pool, replay, slots.clamp(min=0), args.nv)
        return Plan(states=states, run=live & ~flush, deltas=True)

    def finish(self, args: VerifyArgs, plan: Plan, out: torch.Tensor, deltas) -> torch.Tensor:
        """The records of the rows that ran, where the ring has room; NaN outputs for flush rows."""
        L, B, S, HV, V, K = args.dims
        slots, replay, live, flush = self._rows(args)
        pool, dev, RL = self.pool, out.device, self.pool.ring_len
        wp = pool.write_pos.index_select(0, replay).to(torch.int64)
        pos = wp[:, None] + torch.arange(S, device=dev)
        store = plan.run[:, None] & (pos < RL)  # [B, S]
        phys = (pool.cache_base.index_select(0, replay).to(torch.int64)[:, None] + pos) & (RL - 1)
        rr = replay[:, None].expand(B, S)
        d_hi, d_lo = pool.design.split_records(deltas.to(F32))  # [L, B, S, HV, V]
        k_hi, k_lo = pool.design.split_records(key_heads(args))  # [L, B, S, H, K]
        for ring, val in ((pool.ring_d, d_hi), (pool.ring_d_lo, d_lo), (pool.ring_k, k_hi), (pool.ring_k_lo, k_lo),
                          (pool.ring_g, args.g.to(F32))):
            if ring is not None:
                put_records(ring, rr, phys, store, val)
        return torch.where(flush[None, :, None, None, None], torch.full_like(out, STALE), out)
