"""drift.sim.twin: the float64 twin is the true trajectory of the stream.

Checked against an independent per-token float64 loop built from drift.sim.naive (the conv
stage and gating quantised as the op receives them, then the gated delta rule in float64),
and shown to depend on positions only: advanced under any acceptance pattern, it lands on
the state the loop reaches at the same position.

Tolerance (float64, u64 = 2^-53): the per-token bound of test_kernels.py,
(K + 6) u64 (||h|| + ||v||) per token with a non-expansive map, over at most ~150 tokens
from position 0 here (prompt ~25 + 30 steps of up to D = 4), with ||v|| / ||h|| <= ~3
(unit-variance inputs, K = V = 16; the states have norm >= 0.9), gives
150 * 22 * 1.1e-16 * 4 ~ 1.5e-12 relative. 1e-11 leaves a 7x margin over that worst
case (observed: ~1e-15) and is 10^9 below a one-token difference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import rel_fro, small_cfg
from drift.sim import naive
from drift.sim.twin import Float64Twin, prefill
from drift.sim.stream import InputStream, StreamParams, TrueTokens

F64 = torch.float64
TOL = 1e-11
CPU = torch.device("cpu")


class NaiveTrajectory:
    """Per-request float64 loop over the true tokens from position 0 (zero initial conv window)."""

    def __init__(self, cfg, params: StreamParams):
        self.cfg, self.p = cfg, params
        self.tok = TrueTokens(cfg)

    def states(self, row: int, upto: int):
        """After each of the first ``upto`` tokens: ([L, HV, V, K] state, [L, Kc-1, C] window,
        [L, HV, V] output of that token)."""
        cfg, p = self.cfg, self.p
        L, HV, K, V, Kc = cfg.num_layers, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim, cfg.conv_kernel
        h = torch.zeros(L, HV, V, K, dtype=F64)
        win = torch.zeros(L, Kc - 1, cfg.conv_channels, dtype=F64)
        x, a, b = (torch.from_numpy(t).to(F64) for t in self.tok.get(row, 0, upto))
        out = []
        for t in range(upto):
            h, o = h.clone(), torch.empty(L, HV, V, dtype=F64)
            mix = naive.conv_mix(win[:, None], x[t][:, None, None], p.conv_weight)  # [L, 1, 1, C]
            for l in range(L):
                q, k, v = naive.head_inputs(mix[l, 0, 0], cfg.num_k_heads, K, HV, V, K ** -0.5)
                for hd in range(HV):
                    g = float(np.float32(naive.gating(float(a[t, l, hd]), float(p.A_log[l, hd]), float(p.dt_bias[l, hd]))))
                    h[l, hd], o[l, hd] = naive.gdn_token(h[l, hd], q[hd], k[hd], v[hd], float(np.exp(g)),
                                                         naive.sigmoid(float(b[t, l, hd])))
            win = torch.cat([win[:, 1:], x[t][:, None]], 1)
            out.append((h.clone(), win.clone(), o))
        return out


@pytest.fixture(scope="module")
def setup():
    cfg = small_cfg(30, num_requests=2, num_padded=0, track_interval=8, pattern="model")
    params = StreamParams.generate(cfg)
    loop = NaiveTrajectory(cfg, params)
    truth = {r: loop.states(r, 160) for r in range(cfg.num_requests)}
    return cfg, params, truth


def _close(state, ref):
    return rel_fro(state, ref).max().item() <= TOL


def test_prefill_is_the_true_state_after_the_prompt(setup):
    cfg, params, truth = setup
    lengths = [cfg.prefill_len, cfg.prefill_len + 13]  # not a multiple of the prefill chunk
    state, window = prefill(cfg, TrueTokens(cfg), params, lengths, CPU)
    for r, n in enumerate(lengths):
        h, w, _ = truth[r][n - 1]
        assert _close(state[:, r], h)
        assert torch.equal(window[:, r], w)  # data movement of bf16-grid inputs: exact


@pytest.mark.parametrize("pattern", ["model", "all-D", "all-1"])
def test_twin_lands_on_the_true_state_whatever_the_acceptance(setup, pattern):
    cfg, params, truth = setup
    cfg = cfg.replace(pattern=pattern)
    stream = InputStream(cfg, CPU)
    lengths = [stream.prefill_len(r) for r in range(cfg.num_requests)]
    twin = Float64Twin(cfg, params, CPU, *prefill(cfg, stream.tokens, params, lengths, CPU))
    ch = stream.chunk(cfg.steps)
    R = cfg.num_requests
    tracked = 0
    for s in range(ch.count):
        twin.advance(ch.x[s][:, :R], ch.a[s][:, :R], ch.b[s][:, :R], ch.accept[s], ch.track_host[s])
        for r in range(R):
            pos = int(ch.pre[s, r] + ch.accept[s, r])
            h, w, _ = truth[r][pos - 1]
            assert _close(twin.state[:, r], h), (s, r)
            assert torch.equal(twin.window[:, r], w)
            t = int(ch.track_host[s, r])
            if t >= 0:  # the snapshot at the track boundary: position pre + t + 1
                tracked += 1
                bpos = int(ch.pre[s, r]) + t + 1
                assert bpos % cfg.track_interval == 0
                hb, wb, _ = truth[r][bpos - 1]
                assert _close(twin.track_state[:, r], hb), (s, r)
                assert torch.equal(twin.track_window[:, r], wb)
    assert tracked >= 5  # the snapshot path ran


def test_twin_outputs_are_those_of_the_true_tokens(setup):
    """The outputs of the accepted tokens are q_t^T h_t of the true trajectory (rejected
    drafts never reach the twin)."""
    cfg, params, truth = setup
    stream = InputStream(cfg, CPU)
    lengths = [stream.prefill_len(r) for r in range(cfg.num_requests)]
    twin = Float64Twin(cfg, params, CPU, *prefill(cfg, stream.tokens, params, lengths, CPU))
    R = cfg.num_requests
    ch = stream.chunk(10)
    for s in range(ch.count):
        twin.advance(ch.x[s][:, :R], ch.a[s][:, :R], ch.b[s][:, :R], ch.accept[s], ch.track_host[s])
        for r in range(R):
            for j in range(int(ch.accept[s, r])):
                ref = truth[r][int(ch.pre[s, r]) + j][2]
                assert (rel_fro(twin.out[:, r, j], ref, dims=-1) <= TOL).all(), (s, r, j)
