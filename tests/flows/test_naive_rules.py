"""Each flow kind's naive reference (``FlowKind.naive``, the kind's ``naive.py``) against drift's
portable verify op, on the arguments a real run builds: a short eager run of the kind's first flow
is stopped at its fourth verify call, and the op and the naive loops each run on their own copy of
that call's states (the op in fp32, the naive in float64). What the call writes must agree: the
outputs, the stored per-token states (copy-commit scratch, in-place cache blocks) and the ring
records (kernel-commit). A negative control, the op fed the decay of the wrong token, must fail the
same comparison in every kind.

Tolerances (Frobenius, over everything the call wrote; tests/sim/test_kernels.py derives the
per-block terms): the fp32 op's state after t tokens is within ``t (K + 6) u (||h|| + ||v||)`` of
the float64 recurrence (:func:`helpers.gdn_state_bound`) plus ``t (2K + 18) u (||h|| + ||v||)`` for
its fp32 inputs, u = 2^-24; a kernel-commit row's start state is a fold of ``write_pos`` records, the
same recurrence form, so t counts them too. Summed over n blocks the squared bounds add up to at most
n times the largest, hence the factor sqrt(n). Storing into bf16 adds half a bf16 ulp per element,
<= 2^-9 of the value; 2^-8 of the reference's norm covers it with the rounding of the fp32 error on
top. Outputs are the state times q (||q|| = K^-1/2) plus ``(2K + 6) u ||h||``, then cast to bf16.
A ring delta is the state increment ``h_t - e^g h_{t-1}`` over a unit key, so its error is at most
twice the state bound; keys are unit vectors within ``(2K + 18) u`` per key; the log-decays are copies
of ``g`` (exact)."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch

from helpers import gdn_state_bound, small_cfg
from drift.flows.registry import FLOW_KINDS, flows_of
from drift.plug.loader import Kernel
from drift.runspec import resolve
from drift.sim import kernels
from drift.simulate import Simulation

F64, BF16 = torch.float64, torch.bfloat16
U = 2.0 ** -24
CALL = 4  # the verify call captured: late enough that states, cursors and rings have moved
RING = ("ring_d", "ring_d_lo", "ring_k", "ring_k_lo", "ring_g")


def captured_call(kind: str):
    """The ``CALL``-th VerifyArgs of a short eager run of ``kind``'s first flow, with copies of its
    state tensors (and, for a rule that owns a pool, of the pool)."""
    seen = []

    def op(args):
        seen.append(args)
        if len(seen) == CALL:
            raise _Stop
        return kernels.recurrent_gated_delta_rule(args)

    run = resolve(small_cfg(steps=16, flow=flows_of(kind)[0]))
    run = replace(run, kernel=Kernel("capture", op, portable=True))
    with pytest.raises(_Stop):
        Simulation(run, graph=False).run()
    return seen[-1]


class _Stop(Exception):
    pass


def own_copy(args, dtype=None):
    """``args`` on copies of what a verify call writes (in ``dtype`` where given: the naive's
    float64), one copy where the committed states and the scratch are one cache (in-place), and
    the rule with its own pool where it has one."""
    rec = args.recurrent_state.to(dtype or args.recurrent_state.dtype, copy=True)
    if args.intermediate_state.data_ptr() == args.recurrent_state.data_ptr():
        inter = rec.view(args.intermediate_state.shape)
    else:
        inter = args.intermediate_state.to(dtype or args.intermediate_state.dtype, copy=True)
    rule = copy.copy(args.rule)
    if hasattr(rule, "pool"):
        rule.pool = copy.deepcopy(rule.pool)
    return replace(args, recurrent_state=rec, intermediate_state=inter, rule=rule)


def written(before, got, ref):
    """The elements ``got`` or ``ref`` changed from ``before`` (float64), NaN where both are NaN."""
    b, g, r = before.double(), got.double(), ref.double()
    changed = ~((g == b) | (g.isnan() & b.isnan())) | ~((r == b) | (r.isnan() & b.isnan()))
    return g[changed], r[changed]


def norms(args):
    """||h|| (largest committed or scratch block) and ||v|| (largest value vector) of the call."""
    L, B, S, HV, V, K = args.dims
    blocks = [t.double() for t in (args.recurrent_state, args.intermediate_state) if t.numel()]
    h = max(float(b.nan_to_num(0.0).reshape(-1, V, K).norm(dim=(-1, -2)).max()) for b in blocks)
    v = args.mix_qkv[..., 2 * args.nk * K:].double().reshape(-1, V).norm(dim=-1).max()
    return h, float(v)


def compare(args, op=kernels.recurrent_gated_delta_rule):
    """(what differs beyond its bound, as text; empty when all agrees) for ``op`` against the
    kind's naive on copies of ``args``."""
    kind = next(k for k in FLOW_KINDS.values() if isinstance(args.rule, k.RULE))
    mine, ref = own_copy(args), own_copy(args, F64)
    out = op(mine)
    want = kind.naive(ref, F64)
    L, B, S, HV, V, K = args.dims
    h, v = norms(args)
    t = S + (int(args.rule.pool.write_pos.max()) if hasattr(args.rule, "pool") else 0)
    state = gdn_state_bound(t, K, h, v, U) + t * (2 * K + 18) * U * (h + v)
    bad = []

    def check(what, got, exp, per_block, n, stored=BF16):
        """got (float64 values of a ``stored``-dtype tensor) against exp over n blocks."""
        err, size = float((got - exp).nan_to_num(float("inf")).norm()), float(exp.nan_to_num(0.0).norm())
        bound = math.sqrt(max(n, 1)) * per_block + (2.0 ** -8 * (size + per_block) if stored == BF16 else 0.0)
        if not err <= bound:
            bad.append(f"{what}: error {err:.3g} > bound {bound:.3g}")

    ran = ~want.isnan().all(-1).all(-1)  # [L, B, S]: flush rows leave NaN in both
    check("outputs", out.double()[ran], want[ran], K ** -0.5 * (state + (2 * K + 6) * U * h), int(ran.sum()) * HV)
    if args.rule.per_token_states:
        g, r = written(args.intermediate_state, mine.intermediate_state, ref.intermediate_state)
        check("stored states", g, r, state, g.numel() // (V * K), args.intermediate_state.dtype)
    if hasattr(args.rule, "pool"):
        for name in RING:
            g, r = written(getattr(args.rule.pool, name), getattr(mine.rule.pool, name), getattr(ref.rule.pool, name))
            if name == "ring_g":
                if not torch.equal(g, r):
                    bad.append("ring log-decays differ from g")
                continue
        d = [getattr(p.pool, n).double() for p in (mine.rule, ref.rule) for n in ("ring_d", "ring_d_lo")]
        k = [getattr(p.pool, n).double() for p in (mine.rule, ref.rule) for n in ("ring_k", "ring_k_lo")]
        check("ring deltas", d[0] + d[1], d[2] + d[3], 2 * state, L * B * S * HV, F64)  # hi + lo: fp32-exact
        check("ring keys", k[0] + k[1], k[2] + k[3], (2 * K + 18) * U, L * B * S * args.nk, F64)
    return "; ".join(bad)


@pytest.fixture(scope="module", params=list(FLOW_KINDS))
def call(request):
    return captured_call(request.param)


def test_the_op_follows_the_kinds_naive_rule(call):
    assert compare(call) == ""


def test_an_op_that_takes_the_wrong_tokens_decay_fails_the_comparison(call):
    """Negative control: the op fed token t + 1's log-decay at token t (an indexing slip)."""
    def shifted(args):
        return kernels.recurrent_gated_delta_rule(replace(args, g=args.g.roll(-1, dims=2)))

    assert "error" in compare(call, shifted)
