"""drift.sim.stream: determinism and random access of the teacher-forced stream, the acceptance
schedule, SGLang's track index math, and the verify windows built from them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers import small_cfg
from drift.sim.stream import (MIXED_CYCLE, MIXED_PHASES, SCHEDULE_BLOCK, TOKEN_BLOCK, InputStream,
                          StreamParams, TrueTokens, accept_lengths, perturb, track_steps)

CPU = torch.device("cpu")


def _eq(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b))


# ------------------------------------------------------------------ true tokens
def test_true_tokens_are_a_pure_function_of_seed_row_and_position():
    cfg = small_cfg()
    t1, t2 = TrueTokens(cfg), TrueTokens(cfg)
    whole = t1.get(1, 0, 3 * TOKEN_BLOCK + 5)
    # Any chunking of the positions gives the same values (block boundaries included).
    cuts = [0, 1, TOKEN_BLOCK - 1, TOKEN_BLOCK + 7, 2 * TOKEN_BLOCK, 3 * TOKEN_BLOCK + 5]
    parts = [t2.get(1, a, b) for a, b in zip(cuts, cuts[1:])]
    assert _eq(whole, [np.concatenate(p) for p in zip(*parts)])
    # Random access: a late block without the ones before it.
    assert _eq(TrueTokens(cfg).get(1, 2 * TOKEN_BLOCK + 3, 2 * TOKEN_BLOCK + 9),
               [a[2 * TOKEN_BLOCK + 3: 2 * TOKEN_BLOCK + 9] for a in whole])


def test_distinct_seeds_give_distinct_streams():
    """No two allowed seeds share a stream (seeds are 32-bit; 2^32 is refused by the config)."""
    seeds = (0, 1, 2**31, 2**32 - 1)
    firsts = [TrueTokens(small_cfg(seed=s)).get(0, 0, 4)[0] for s in seeds]
    scheds = [accept_lengths(small_cfg(seed=s, pattern="model"), 0, 64) for s in seeds]
    for i in range(len(seeds)):
        for j in range(i):
            assert not np.array_equal(firsts[i], firsts[j]) and not np.array_equal(scheds[i], scheds[j])


def test_a_block_regenerated_after_eviction_is_identical():
    cfg = small_cfg()
    tok = TrueTokens(cfg)
    first = [a.copy() for a in tok.get(0, 0, TOKEN_BLOCK)]
    for blk in range(1, 8 * cfg.num_requests):  # more blocks than the cache keeps
        tok.get(0, blk * TOKEN_BLOCK, blk * TOKEN_BLOCK + 1)
    assert (0, 0) not in tok._cache  # really evicted, so the next get regenerates it
    assert _eq(tok.get(0, 0, TOKEN_BLOCK), first)


def test_true_tokens_shapes_grid_and_independence():
    cfg = small_cfg()
    x, a, b = TrueTokens(cfg).get(2, 5, 15)
    assert x.shape == (10, cfg.num_layers, cfg.conv_channels) and x.dtype == np.float32
    assert a.shape == b.shape == (10, cfg.num_layers, cfg.num_v_heads)
    for arr in (x, a, b):  # the inputs a bf16 model sees
        assert np.array_equal(torch.from_numpy(arr).to(torch.bfloat16).float().numpy(), arr)
    assert not np.array_equal(x, TrueTokens(cfg).get(3, 5, 15)[0])  # rows differ
    assert not np.array_equal(x, TrueTokens(cfg.replace(seed=1)).get(2, 5, 15)[0])  # seeds differ
    assert TrueTokens(cfg).get(0, 4, 4)[0].shape == (0, cfg.num_layers, cfg.conv_channels)
    with pytest.raises(ValueError):
        TrueTokens(cfg).get(0, 5, 4)


def test_key_rank_confines_keys_to_leading_coordinates():
    cfg = small_cfg(key_rank=3)
    x = TrueTokens(cfg).get(0, 0, 50)[0]
    K = cfg.head_k_dim
    keys = x[:, :, K: 2 * K]  # num_k_heads = 1
    assert (keys[..., 3:] == 0).all() and (keys[..., :3] != 0).any()


def test_stream_params_hit_the_configured_median_decays():
    cfg = small_cfg()
    p = StreamParams.generate(cfg)
    assert torch.equal(p.A_log, StreamParams.generate(cfg).A_log)  # deterministic
    # Median decay (a = 0, dt_bias = 0): exp(-exp(A_log) ln 2); A_log has a 0.05 per-layer
    # spread, so the log-decay is within exp(+-5 * 0.05) of the target (5 sigma).
    med = torch.exp(-torch.exp(p.A_log.double()) * math.log(2.0))
    ratio = torch.log(med) / torch.log(torch.tensor(cfg.decays, dtype=torch.float64))
    assert ((ratio > math.exp(-0.25)) & (ratio < math.exp(0.25))).all()


# ------------------------------------------------------------ acceptance schedule
def test_accept_lengths_random_access_across_schedule_blocks():
    cfg = small_cfg(pattern="model")
    whole = accept_lengths(cfg, 0, SCHEDULE_BLOCK + 300)
    assert np.array_equal(accept_lengths(cfg, SCHEDULE_BLOCK - 100, 250), whole[SCHEDULE_BLOCK - 100:SCHEDULE_BLOCK + 150])
    assert np.array_equal(accept_lengths(cfg, 0, SCHEDULE_BLOCK + 300), whole)
    assert whole.dtype == np.int64 and whole.shape == (SCHEDULE_BLOCK + 300, cfg.num_requests)
    assert whole.min() == 1 and whole.max() == cfg.num_draft_tokens


def test_acceptance_model_matches_the_configured_rates():
    cfg = small_cfg(pattern="model")
    acc = accept_lengths(cfg, 0, 4 * SCHEDULE_BLOCK)
    n = acc.size
    for j, p in enumerate(cfg.acceptance, start=1):
        # P(draft j accepted) = P(accept_len >= j + 1); binomial, 5 sigma.
        rate = (acc >= j + 1).mean()
        assert abs(rate - p) <= 5 * math.sqrt(p * (1 - p) / n), (j, rate, p)


def test_scripted_patterns():
    D = 4
    assert (accept_lengths(small_cfg(pattern="all-1"), 0, 50) == 1).all()
    assert (accept_lengths(small_cfg(pattern="all-D"), 0, 50) == D).all()
    mixed = accept_lengths(small_cfg(pattern="mixed"), 0, 2 * MIXED_CYCLE)
    model = accept_lengths(small_cfg(pattern="model"), 0, 2 * MIXED_CYCLE)
    start = 0
    for name, length in MIXED_PHASES:
        for cyc in (0, MIXED_CYCLE):
            seg = slice(cyc + start, cyc + start + length)
            if name == "model":
                assert np.array_equal(mixed[seg], model[seg])
            elif name == "all-1":
                assert (mixed[seg] == 1).all()  # the case the #31659 guard fires on
            elif name == "all-D":
                assert (mixed[seg] == D).all()
            else:  # split: even rows accept 1, odd rows accept D
                assert (mixed[seg][:, 0::2] == 1).all() and (mixed[seg][:, 1::2] == D).all()
        start += length


# --------------------------------------------------------------- track index math
def test_track_steps_hand_worked():
    """SGLang: post = pre + accept; tracked when pre // I != post // I; step =
    post // I * I - pre - 1 clamped to [0, accept - 1]. With I = 16:"""
    pre = np.array([14, 15, 16, 12, 31, 0, 10])
    acc = np.array([4, 1, 4, 4, 1, 4, 3])
    # 14+4=18 crosses 16: state after position 15 = draft step 16-14-1 = 1
    # 15+1=16 crosses 16: step 0 (the root itself lands on the boundary)
    # 16+4=20 stays inside [16, 32): not tracked (16 was tracked the step before)
    # 12+4=16 crosses: step 3, the last accepted token
    # 31+1=32 crosses 32: step 0
    # 0+4=4 no boundary; 10+3=13 no boundary
    assert track_steps(pre, acc, 16).tolist() == [1, 0, -1, 3, 0, -1, -1]
    # Interval smaller than the window: the last boundary crossed wins (6, not 4).
    assert track_steps(np.array([3]), np.array([4]), 2).tolist() == [2]
    assert (track_steps(pre, acc, 0) == -1).all()  # tracking off


def test_track_steps_invariants_by_brute_force():
    rng = np.random.default_rng(0)
    for interval in (1, 2, 3, 5, 16):
        pre = rng.integers(0, 200, 2000)
        acc = rng.integers(1, 5, 2000)
        got = track_steps(pre, acc, interval)
        for p, a, s in zip(pre, acc, got):
            # The boundaries crossed: sequence lengths p+1 .. p+a that are multiples of I.
            hits = [n for n in range(p + 1, p + a + 1) if n % interval == 0]
            if not hits:
                assert s == -1
            else:
                assert 0 <= s <= a - 1 and (p + s + 1) % interval == 0
                assert p + s + 1 == hits[-1]  # the last boundary inside the window


# ------------------------------------------------------------------ verify windows
def _collect(stream: InputStream, sizes):
    chunks = [stream.chunk(n) for n in sizes]
    cat = lambda f: torch.cat([getattr(c, f) for c in chunks]) if f in ("x", "a", "b", "last_steps", "track_steps") \
        else np.concatenate([getattr(c, f) for c in chunks])
    return {f: cat(f) for f in ("x", "a", "b", "last_steps", "track_steps", "pre", "accept", "track_host")}


def test_input_stream_is_independent_of_chunking():
    cfg = small_cfg()
    a = _collect(InputStream(cfg, CPU), [100])
    b = _collect(InputStream(cfg, CPU), [1, 7, 33, 59])
    for f in a:
        assert (torch.equal(a[f], b[f]) if isinstance(a[f], torch.Tensor) else np.array_equal(a[f], b[f])), f


def test_verify_windows_are_true_tokens_then_perturbed_drafts():
    cfg = small_cfg()
    s = InputStream(cfg, CPU)
    R, D = cfg.num_requests, cfg.num_draft_tokens
    pos0 = s.pos.copy()
    ch = s.chunk(40)
    tok = TrueTokens(cfg)
    # Positions advance by accept_len; the stream's pos ends where the last step leaves it.
    assert np.array_equal(ch.pre[0], pos0)
    assert np.array_equal(ch.pre[1:], ch.pre[:-1] + ch.accept[:-1])
    assert np.array_equal(s.pos, ch.pre[-1] + ch.accept[-1])
    assert torch.equal(ch.last_steps[:, :R], torch.from_numpy(ch.accept - 1))
    assert (ch.last_steps[:, R:] == -1).all() and (ch.track_steps[:, R:] == -1).all()
    assert np.array_equal(ch.track_host, track_steps(ch.pre, ch.accept, cfg.track_interval))
    assert (ch.x[:, :, R:] == 0).all()  # padded rows carry no tokens
    for step in range(ch.count):
        for r in range(R):
            p, acc = int(ch.pre[step, r]), int(ch.accept[step, r])
            tx, ta, tb = tok.get(r, p, p + D)
            px, pa, pb = perturb(tx, ta, tb)
            for j in range(D):
                ex, ea, eb = (tx[j], ta[j], tb[j]) if j < acc else (px[j], pa[j], pb[j])
                assert torch.equal(ch.x[step, :, r, j].float(), torch.from_numpy(ex))
                assert torch.equal(ch.a[step, :, r, j], torch.from_numpy(ea))
                assert torch.equal(ch.b[step, :, r, j], torch.from_numpy(eb))


def test_rejected_drafts_are_far_from_the_truth():
    x, a, b = TrueTokens(small_cfg()).get(0, 0, 20)
    px, pa, pb = perturb(x, a, b)
    assert np.array_equal(px[..., ::-1], x) and np.array_equal(pa, -a) and np.array_equal(pb, -b)
    assert np.linalg.norm(px - x) > 0.5 * np.linalg.norm(x)


def test_prefill_lengths_are_staggered():
    cfg = small_cfg()
    s = InputStream(cfg, CPU)
    lens = [s.prefill_len(r) for r in range(cfg.num_requests)]
    assert lens[0] == cfg.prefill_len and len(set(lens)) == len(lens)
    assert np.array_equal(s.pos, lens)
