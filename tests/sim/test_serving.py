"""The serving schedule (drift/sim/serving.py): counter-based, the engines' batch orders, graph buckets,
prefix hits that name a snapshot the cache holds, and the tokens a prefix hit shares with its source."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from drift.config import preset
from drift.lifecycles import LIFECYCLES
from drift.sim.serving import (END_FINISH, END_PREEMPT, START_PREFILL, START_PREFIX, START_RESUME, ServingSchedule,
                               order_append, order_condense, request_draws)
from drift.sim.stream import InputStream, TrueTokens, accept_lengths, draft_counts

CFG = preset("ci-small", lifecycle="serving", steps=1024)


def run_schedule(cfg, order="append", chunks=(256, 256, 256, 256)):
    sch, out, step = ServingSchedule(cfg, order), [], 0
    for n in chunks:
        out.append(sch.advance(accept_lengths(cfg, step, n), draft_counts(cfg, step, n)))
        step += n
    return sch, {k: np.concatenate([getattr(c, k) for c in out]) for k in
                 ("request", "start", "source", "prefix", "end", "pre", "accept", "track", "row", "lanes", "bucket")}


def test_the_schedule_is_the_same_however_it_is_chunked():
    """Counter-based: the steps 0 .. n come out the same in chunks of any size (a run's chunk size depends
    on its config's bytes; a shorter horizon replays the same prefix of events)."""
    _, a = run_schedule(CFG, chunks=(256,) * 4)
    _, b = run_schedule(CFG, chunks=(1, 100, 411, 7, 505))
    for k in a:
        assert np.array_equal(a[k], b[k]), k


def test_another_seed_draws_other_requests():
    """The negative control of the test above: the draws depend on the seed."""
    _, a = run_schedule(CFG)
    _, b = run_schedule(CFG.replace(seed=1))
    assert not np.array_equal(a["request"], b["request"])


def test_every_event_kind_happens_and_lane_0_keeps_its_request():
    _, s = run_schedule(CFG)
    assert (s["request"][:, 0] == 0).all(), "lane 0's first request runs the whole horizon"
    for code in (START_PREFILL, START_PREFIX, START_RESUME):
        assert (s["start"] == code).any(), code
    for code in (END_FINISH, END_PREEMPT):
        assert (s["end"] == code).any(), code
    live = (s["request"] >= 0).sum(1)
    assert len(np.unique(s["bucket"])) > 1 and (s["bucket"] >= live).all()
    assert (s["bucket"] == [LIFECYCLES["serving"].graph_bucket(n) for n in live]).all()


def test_rows_hold_the_live_lanes_and_padded_rows_follow_them():
    _, s = run_schedule(CFG)
    for j in range(len(s["bucket"])):
        live = np.nonzero(s["request"][j] >= 0)[0]
        B = s["bucket"][j]
        lanes = s["lanes"][j, :B]
        assert sorted(lanes[lanes >= 0]) == sorted(live) and (lanes[len(live):] == -1).all()
        assert all(s["row"][j, lane] == i for i, lane in enumerate(lanes[:len(live)]))


def test_a_prefix_hit_restores_a_finished_request_s_last_snapshot_on_the_track_grid():
    sch, s = run_schedule(CFG)
    steps, lanes = np.nonzero(s["start"] == START_PREFIX)
    assert len(steps)
    for j, r in zip(steps, lanes):
        src, P = int(s["source"][j, r]), int(s["prefix"][j, r])
        assert P % CFG.track_interval == 0 and P > 0
        # the source finished before, and its last tracked boundary was P
        ended = np.nonzero((s["request"] == src) & (s["end"] == END_FINISH))
        assert len(ended[0]) and ended[0][0] < j
        tracked = (s["request"] == src) & (s["track"] >= 0)
        last = np.nonzero(tracked)
        t = (last[0][-1], last[1][-1])
        assert s["pre"][t] + s["track"][t] + 1 == P
        assert CFG.track_interval >= s["pre"][j, r] - P >= 1  # its own prompt tokens after the shared prefix


def test_a_prefix_hit_s_tokens_are_its_source_s_up_to_the_prefix_and_its_own_after():
    sch, s = run_schedule(CFG)
    tokens = TrueTokens(CFG, prefixes=sch.prefixes)
    plain = TrueTokens(CFG)
    q, (src, P) = next(iter(sch.prefixes.items()))
    mine, theirs, own = tokens.get(q, 0, P + 4), plain.get(src, 0, P + 4), plain.get(q, 0, P + 4)
    for a, b, c in zip(mine, theirs, own):
        assert np.array_equal(a[:P], b[:P]) and np.array_equal(a[P:], c[P:]) and not np.array_equal(a[P:], b[P:])


def test_batch_orders_are_the_engines():
    # SGLang: filter_batch keeps the order, merge_batch appends
    assert order_append([3, 1, 2, 0], [1], [1]) == [3, 2, 0, 1]
    # vLLM's InputBatch: a new request takes the lowest hole, condense moves the last rows into the others
    assert order_condense([3, 1, 2, 0], [1, 2], [2]) == [3, 2, 0]
    assert order_condense([3, 1, 2, 0], [3], []) == [0, 1, 2]
    assert order_condense([0, 1], [], [3]) == [0, 1, 3]


def test_request_draws_are_a_function_of_seed_and_request_id():
    life = LIFECYCLES["serving"]
    assert request_draws(CFG, life, 7) == request_draws(CFG.replace(steps=5), life, 7)
    assert request_draws(CFG, life, 7) != request_draws(CFG, life, 8)


def test_the_stream_puts_each_lane_s_tokens_in_its_row():
    sch = ServingSchedule(CFG)
    stream = InputStream(CFG, torch.device("cpu"), schedule=sch)
    chunk = stream.chunk(64)
    plan = chunk.schedule
    tokens = TrueTokens(CFG, prefixes=sch.prefixes)
    for j in (0, 17, 63):
        for r in np.nonzero(plan.request[j] >= 0)[0]:
            row, q, pre, acc = plan.row[j, r], plan.request[j, r], plan.pre[j, r], plan.accept[j, r]
            x, _, _ = tokens.get(int(q), int(pre), int(pre + acc))
            got = chunk.x[j, :, row, :acc].float().permute(1, 0, 2).numpy()
            assert np.array_equal(got, x), (j, r)
        B = plan.bucket[j]
        assert (chunk.last_steps[j, (plan.lanes[j, :B] < 0).nonzero()[0]] == -1).all()


@pytest.mark.parametrize("name", ["fixed"])
def test_a_fixed_lifecycle_makes_no_schedule(name):
    cfg = preset("ci-small", lifecycle=name)
    assert not cfg.serving.churn and cfg.num_rows == cfg.num_requests + cfg.num_padded
