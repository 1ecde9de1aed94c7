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
from drift.sim import kernels, naive, native
from drift.sim.twin import Float64Twin, prefill, window_positions
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


@pytest.mark.parametrize("path", ["per-step-hook", "one-call"])
def test_the_batched_twin_is_the_stepped_twin_bit_for_bit(setup, path, monkeypatch):
    """advance_batch (what the comparison runs) against advance step by step, from the same start:
    the same bits at every step -- states, outputs, windows, the inputs it keeps, the track boundary
    of every tracked row and a golden-checkpoint mark -- in what it returns, in the attributes it
    leaves at each step (with a per-step hook: the step-by-step loop) and in those it leaves at the
    batch's end. Without a hook the recurrence runs as one C call for the batch (kernels.gdn_decode_steps),
    which must have run: a missing compiler fails here rather than testing the loop twice."""
    cfg, params, _ = setup
    calls = []
    real = kernels.gdn_decode_steps
    monkeypatch.setattr(kernels, "gdn_decode_steps", lambda *a, **k: calls.append(1) or real(*a, **k))
    stream = InputStream(cfg, CPU)
    lengths = [stream.prefill_len(r) for r in range(cfg.num_requests)]
    start = prefill(cfg, stream.tokens, params, lengths, CPU)
    stepped, batched = Float64Twin(cfg, params, CPU, *start), Float64Twin(cfg, params, CPU, *start)
    R, n = cfg.num_requests, 24
    ch = stream.chunk(n)
    marks = [None] * n
    marks[5] = np.array([1, -1]) if ch.accept[5, 0] > 1 else np.array([0, -1])
    names = ("state", "out", "window", "decay", "beta", "q_sq", "norm2")
    want = []
    for s in range(n):
        stepped.advance(ch.x[s][:, :R], ch.a[s][:, :R], ch.b[s][:, :R], ch.accept[s], ch.track_host[s], marks[s])
        want.append({name: getattr(stepped, name).clone() for name in names}
                    | {"track_state": stepped.track_state.clone(), "track_window": stepped.track_window.clone(),
                       "mark_state": stepped.mark_state.clone(), "mark_window": stepped.mark_window.clone()})
    seen = []

    def on_step(j):
        tracked = ch.track_host[j] >= 0
        assert all(torch.equal(getattr(batched, name), want[j][name]) for name in names), j
        for name in ("track_state", "track_window"):  # meaningful on the rows tracked this step
            assert torch.equal(getattr(batched, name)[:, tracked], want[j][name][:, tracked]), (j, name)
        seen.append(j)

    steps = batched.advance_batch(ch.x[:, :, :R], ch.a[:, :, :R], ch.b[:, :, :R], ch.accept, ch.track_host, marks,
                                  on_step if path == "per-step-hook" else None, keep_states=True)
    if path == "per-step-hook":
        assert seen == list(range(n)) and not calls
    else:
        assert calls == [1] and native.available(), native.status()  # the one-call path ran
        for name in names + ("mark_state", "mark_window"):  # what the batch's last step leaves
            assert torch.equal(getattr(batched, name), want[-1][name]), name
        last_tracked = {}  # row -> its last tracked step: the track state it holds at the batch's end
        for j in range(n):
            last_tracked.update({int(r): j for r in np.nonzero(ch.track_host[j] >= 0)[0]})
        for r, j in last_tracked.items():
            assert torch.equal(batched.track_state[:, r], want[j]["track_state"][:, r]), (r, j)
    for j in range(n):
        for name in names:
            assert torch.equal(getattr(steps, name)[j], want[j][name]), (j, name)
        rows = np.nonzero(ch.track_host[j] >= 0)[0]
        assert (j in steps.tracked) == bool(rows.size)
        if rows.size:
            assert steps.tracked[j][0].tolist() == rows.tolist()
            assert torch.equal(steps.tracked[j][1], want[j]["track_state"][:, rows])
            assert torch.equal(steps.track_window[j][:, rows], want[j]["track_window"][:, rows])
    assert len(steps.tracked) >= 3 and list(steps.marks) == [5]  # both capture paths ran
    assert torch.equal(steps.marks[5][0][:, 0], want[5]["mark_state"][:, 0])
    assert torch.equal(steps.marks[5][1][:, 0], want[5]["mark_window"][:, 0])
    assert not torch.equal(steps.state[0], steps.state[1])  # the trajectory moves: equality is not vacuous


def _window_positions_by_lists(accept, track, D, Km1):
    """window_positions' definition, token by token in Python lists (the oracle)."""
    n, R = accept.shape
    seq_pos, track_pos = np.zeros((n + 1, R, Km1), np.int64), np.zeros((n, R, Km1), np.int64)
    for r in range(R):
        pos = list(range(Km1)) + [Km1 + j * D + t for j in range(n) for t in range(int(accept[j, r]))]
        start = np.concatenate([[0], np.cumsum(accept[:, r])])
        for j in range(n + 1):
            seq_pos[j, r] = pos[start[j]:start[j] + Km1]
        for j in range(n):
            track_pos[j, r] = (list(seq_pos[j, r]) + [Km1 + j * D + t for t in range(int(track[j, r]) + 1)])[-Km1:]
    return seq_pos, track_pos


def test_window_positions_are_the_token_lists():
    """The batched twin's window indices (numpy) against the token lists they stand for, over random
    batches: rows that accept no token, untracked rows (-1), D = 1 and windows longer than a step."""
    rng = np.random.default_rng(0)
    for trial in range(200):
        D, Km1, n, R = (int(rng.integers(lo, hi)) for lo, hi in ((1, 6), (1, 5), (1, 30), (1, 6)))
        accept = rng.integers(0 if trial % 3 == 0 else 1, D + 1, (n, R)).astype(np.int64)
        track = np.where(rng.random((n, R)) < 0.5, -1, rng.integers(0, D, (n, R))).astype(np.int64)
        got, want = window_positions(accept, track, D, Km1), _window_positions_by_lists(accept, track, D, Km1)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), (trial, D, Km1, n, R)
