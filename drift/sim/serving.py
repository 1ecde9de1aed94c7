"""The serving schedule: which request each lane runs at each decode step, how it started, how it
ended, the batch's row order and its graph bucket (drift/lifecycles.py, docs/semantics.md §12).

Everything a request does is drawn from ``(seed, request id)`` (numpy PCG64, counter-based, as the
stream's tokens and acceptance are): its length, the idle steps before it arrives, whether it starts
from a prefix-cache hit (and the draw that picks the snapshot), whether and when it is preempted.
What depends on the run so far -- which snapshots the prefix cache holds, where a request's position
stands, which row the batch gives it -- follows by replaying those draws in step order, on the host,
from the stream's accept lengths; the schedule of steps ``0 .. n`` is therefore the same in every run
of a config, whatever its horizon, and any step can be reproduced. No device data is read.

Lane ``r`` runs requests ``r, r + R, r + 2R, ...``; lane 0's first request runs the whole horizon.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from ..config import PREFILL_STAGGER, Config
from ..lifecycles import Lifecycle

# What a lane's request does at a step (``ScheduleChunk.start`` / ``end``).
START_NONE, START_PREFILL, START_PREFIX, START_RESUME = 0, 1, 2, 3
END_NONE, END_FINISH, END_PREEMPT = 0, 1, 2
START_NAMES = {START_PREFILL: "prefill", START_PREFIX: "prefix hit", START_RESUME: "resume"}
END_NAMES = {END_FINISH: "finish", END_PREEMPT: "preemption"}
FOREVER = np.iinfo(np.int64).max // 4  # the length of lane 0's first request


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([int(k) & 0xFFFFFFFF for k in key])


def prompt_length(cfg: Config, request: int) -> int:
    """The prompt of a request that starts from prefill: the preset's, staggered by 3 per request id
    (as :func:`drift.sim.stream.prefill_lengths` staggers the fixed batch's rows)."""
    return cfg.prefill_len + PREFILL_STAGGER * request


@dataclass(frozen=True)
class Start:
    """How request ``request`` starts in ``lane`` (START_*): the engine's extend stores its state after its
    tokens ``p0 .. p1 - 1`` from what its slot holds -- a prefill from the prompt's start (``p0 = 0``), a
    resume from the start of everything it holds, a prefix hit from the ``p0`` positions it shares with
    request ``source``, whose snapshot the prefix cache restores (-1: none)."""

    lane: int
    request: int
    code: int
    p0: int
    p1: int
    source: int = -1


@dataclass(frozen=True)
class RequestDraws:
    """What request ``request`` (lane ``request % R``) does, drawn from ``(seed, request)`` alone:
    ``steps`` decode steps in all; ``idle`` steps its lane waits before it arrives; ``hit`` whether it
    asks for a prefix-cache hit and ``pick`` (uniform in [0, 1)) which cached snapshot it takes;
    ``preempt_after`` the steps after which it is preempted (0: never); ``extra`` the prompt tokens a
    prefix hit adds to the shared prefix (1 .. the track interval: the engine computes at least one)."""

    request: int
    steps: int
    idle: int
    hit: bool
    pick: float
    preempt_after: int
    extra: int


def request_draws(cfg: Config, life: Lifecycle, request: int) -> RequestDraws:
    R = cfg.num_requests
    rng = _rng(cfg.seed, 0x5E4E, request)
    u = rng.random(4)
    extra = max(1, life.mean_steps - life.min_steps)
    steps = FOREVER if request == 0 else life.min_steps + int(rng.geometric(1.0 / extra)) - 1
    idle = 0 if request < R else int(rng.integers(0, life.idle_max + 1))
    hit = request >= R and u[0] < life.prefix_hit_rate
    preempt = 0
    if request != 0 and steps >= 4 and u[2] < life.preempt_rate:
        preempt = 1 + int(u[3] * (steps - 2))  # after 1 .. steps - 2 of its steps: some done, some left
    extra = 1 + int(rng.integers(0, max(1, cfg.track_interval)))
    return RequestDraws(request, steps, idle, bool(hit), float(u[1]), preempt, extra)


@dataclass
class _Lane:
    request: int = -1  # running (or preempted, waiting to resume) request; -1 between requests
    draws: Optional[RequestDraws] = None
    idle_left: int = 0  # steps before the next request (or the resume) starts
    pending: int = START_NONE  # how the request starts when idle_left reaches 0
    source: int = -1  # its prefix-hit source
    pos: int = 0  # seq_len of the running request
    done: int = 0  # its decode steps so far
    preempted: bool = False
    last_snapshot: int = -1  # position of its last prefix-cache snapshot (-1: none yet)


@dataclass
class ScheduleChunk:
    """The schedule of ``count`` steps from ``step0`` (host int64 arrays, per lane ``[S, R]`` unless
    noted). ``request``: the request each lane runs (-1 idle); ``start``: how it started at this step
    (START_*; its first decode step after an arrival or a resume); ``source``: the prefix-hit source
    request (-1); ``prefix``: the positions the hit shares with it (its prompt is those and ``extra``
    tokens of its own, ``pre`` at its first step); ``end``: END_* after
    this step; ``pre``, ``accept``, ``track``: seq_len before the step, tokens accepted, the draft step
    whose state is tracked (-1 none; 0 accepted for an idle lane); ``row``: the lane's batch row (-1
    idle); ``lanes [S, N]``: the lane in each batch row (-1 padded); ``bucket [S]``: the rows passed."""

    step0: int
    count: int
    request: np.ndarray
    start: np.ndarray
    source: np.ndarray
    prefix: np.ndarray
    end: np.ndarray
    pre: np.ndarray
    accept: np.ndarray
    track: np.ndarray
    row: np.ndarray
    lanes: np.ndarray
    bucket: np.ndarray
    kept: np.ndarray  # [S, R] bool: a finished request's last snapshot entered the prefix cache

    @property
    def live(self) -> np.ndarray:
        """``[S, R]`` bool: the lane runs a request at the step."""
        return self.request >= 0

    def starts(self, s: int) -> list[Start]:
        """The requests that start at step ``s``, lane by lane."""
        out = []
        for lane in np.nonzero(self.start[s])[0].tolist():
            code, q, pre = int(self.start[s, lane]), int(self.request[s, lane]), int(self.pre[s, lane])
            p0 = int(self.prefix[s, lane]) if code == START_PREFIX else 0
            out.append(Start(lane, q, code, p0, pre, int(self.source[s, lane])))
        return out


def track_steps(pre: np.ndarray, accept: np.ndarray, interval: int) -> np.ndarray:
    """SGLang's tracking index math: the draft step whose state lands on a multiple of
    ``interval``, or -1. ``pre`` = seq_len before verify, ``post = pre + accept``;
    track when ``pre // I != post // I``; step = ``post // I * I - pre - 1`` clamped to
    ``[0, accept - 1]``."""
    if interval <= 0:
        return np.full_like(pre, -1)
    post = pre + accept
    crossing = (pre // interval) != (post // interval)
    step = np.clip((post // interval) * interval - pre - 1, 0, accept - 1)
    return np.where(crossing, step, -1)


# ------------------------------------------------------------------------------ batch order
def order_append(order: list[int], ended: list[int], started: list[int]) -> list[int]:
    """SGLang 0.5.23's running batch: finished requests leave and the rest keep their order
    (``ScheduleBatch.filter_batch``); new ones join at the end (``merge_batch``)."""
    return [lane for lane in order if lane not in ended] + started


def order_condense(order: list[int], ended: list[int], started: list[int]) -> list[int]:
    """vLLM 0.33.0's persistent batch: a new request takes the lowest row a finished one left
    (``InputBatch.add_request``), then ``condense`` moves the last rows into the holes still left
    (lowest hole first), so rows keep no order."""
    rows: list[int] = [(-1 if lane in ended else lane) for lane in order]
    for lane in started:
        holes = [i for i, v in enumerate(rows) if v < 0]
        if holes:
            rows[holes[0]] = lane
        else:
            rows.append(lane)
    while -1 in rows:
        hole = rows.index(-1)
        last = len(rows) - 1
        while last > hole and rows[last] < 0:
            last -= 1
        if last <= hole:
            del rows[hole:]
            break
        rows[hole], rows[last] = rows[last], -1
        while rows and rows[-1] < 0:
            rows.pop()
    return rows


BATCH_ORDERS: dict[str, Callable[[list[int], list[int], list[int]], list[int]]] = {
    "append": order_append, "condense": order_condense}


# ------------------------------------------------------------------------------ the schedule
class ServingSchedule:
    """The lifecycle of ``cfg`` (churn on), replayed in step order on the host: :meth:`advance` takes
    the accept lengths the stream drew for the next steps (``[count, R]``, every lane) and the draft
    counts, and returns their :class:`ScheduleChunk`. ``batch_order`` is the engine's (:data:`BATCH_ORDERS`).
    A finished request's last tracked snapshot (its longest prefix on the track grid) enters the prefix
    cache in every flow: the requests, their prompts and their truths do not depend on the engine."""

    def __init__(self, cfg: Config, batch_order: str = "append"):
        self.cfg, self.life = cfg, cfg.serving
        self.order_fn = BATCH_ORDERS[batch_order]
        R = cfg.num_requests
        self.lanes = [_Lane() for _ in range(R)]
        for r, lane in enumerate(self.lanes):
            self._arrive(lane, r, first=True)
        self.order: list[int] = []
        self._ended: list[int] = []  # lanes whose request ended after the last step (their rows leave now)
        self.cache: list[tuple[int, int]] = []  # (request, snapshot position) the prefix cache holds, oldest first
        self.step = 0
        self.prefixes: dict[int, tuple[int, int]] = {}  # request -> (source request, shared positions)
        self.spans: dict[int, list[int]] = {}  # request -> [first position, last position reached]

    LANE_FIELDS = ("request", "idle_left", "pending", "source", "pos", "done", "preempted", "last_snapshot")

    def state_dict(self) -> dict:
        """Where the schedule stands (between chunks), as ints and lists (drift.checkpoint)."""
        return {"lanes": [[int(getattr(lane, f)) for f in self.LANE_FIELDS] for lane in self.lanes],
                "order": list(self.order), "ended": list(self._ended), "step": self.step,
                "cache": [list(c) for c in self.cache],
                "prefixes": [[q, src, P] for q, (src, P) in self.prefixes.items()],
                "spans": [[q, a, b] for q, (a, b) in self.spans.items()]}

    def load_state_dict(self, state: dict) -> None:
        for lane, values in zip(self.lanes, state["lanes"]):
            for f, v in zip(self.LANE_FIELDS, values):
                setattr(lane, f, bool(v) if f == "preempted" else int(v))
            lane.draws = request_draws(self.cfg, self.life, lane.request) if lane.request >= 0 else None
        self.order, self._ended, self.step = list(state["order"]), list(state["ended"]), int(state["step"])
        self.cache = [tuple(c) for c in state["cache"]]
        self.prefixes.clear()  # the same dict the stream's tokens read
        self.prefixes.update({int(q): (int(src), int(P)) for q, src, P in state["prefixes"]})
        self.spans = {int(q): [int(a), int(b)] for q, a, b in state["spans"]}

    def _arrive(self, lane: _Lane, request: int, first: bool = False) -> None:
        d = request_draws(self.cfg, self.life, request)
        lane.request, lane.draws = request, d
        lane.idle_left = 0 if first else d.idle
        lane.pending, lane.done, lane.preempted, lane.last_snapshot, lane.source = START_PREFILL, 0, False, -1, -1

    def _start(self, lane: _Lane) -> tuple[int, int, int]:
        """The lane's request starts now: (start code, source, shared positions)."""
        if lane.pending == START_RESUME:
            return START_RESUME, -1, 0
        q, d = lane.request, lane.draws
        cached = [c for c in self.cache if c[0] != q]
        if d.hit and cached:
            src, P = cached[min(len(cached) - 1, int(d.pick * len(cached)))]
            lane.pos, lane.source = P + d.extra, src
            self.prefixes[q] = (src, P)
            self.spans[q] = [0, lane.pos]
            return START_PREFIX, src, P
        lane.pos = prompt_length(self.cfg, q)
        self.spans[q] = [0, lane.pos]
        return START_PREFILL, -1, 0

    def advance(self, accept: np.ndarray, drafts: np.ndarray) -> ScheduleChunk:
        cfg, R = self.cfg, self.cfg.num_requests
        S = accept.shape[0]
        N = cfg.num_rows
        out = {k: np.full((S, R), -1, np.int64) for k in ("request", "source", "row", "track")}
        out.update({k: np.zeros((S, R), np.int64) for k in ("start", "end", "pre", "accept", "prefix")})
        kept = np.zeros((S, R), bool)
        lanes_of_rows = np.full((S, N), -1, np.int64)
        bucket = np.zeros(S, np.int64)
        for j in range(S):
            started: list[int] = []
            for r, lane in enumerate(self.lanes):
                if lane.pending != START_NONE:
                    if lane.idle_left > 0:
                        lane.idle_left -= 1
                        continue
                    code, src, P = self._start(lane)
                    lane.pending = START_NONE
                    out["start"][j, r], out["source"][j, r], out["prefix"][j, r] = code, src, P
                    started.append(r)
                q = lane.request
                out["request"][j, r] = q
                pre, acc = lane.pos, int(accept[j, r])
                trk = int(track_steps(np.array([pre]), np.array([acc]), cfg.track_interval)[0])
                out["pre"][j, r], out["accept"][j, r], out["track"][j, r] = pre, acc, trk
                if trk >= 0:
                    lane.last_snapshot = pre + trk + 1
                lane.pos = pre + acc
                self.spans[q][1] = lane.pos
                lane.done += 1
            live = [r for r in range(R) if out["request"][j, r] >= 0]
            # The engine's scheduler between the steps: the requests that ended leave the batch, the
            # ones that start join it.
            self.order = self.order_fn(self.order, self._ended, started)
            assert sorted(self.order) == live, (self.order, live)
            for i, r in enumerate(self.order):
                out["row"][j, r] = i
                lanes_of_rows[j, i] = r
            bucket[j] = self.life.graph_bucket(len(self.order))
            ended = []
            for r, lane in enumerate(self.lanes):  # after the step: who finishes or is preempted
                if out["request"][j, r] < 0:
                    continue
                d = lane.draws
                if d.preempt_after and not lane.preempted and lane.done == d.preempt_after:
                    out["end"][j, r] = END_PREEMPT
                    lane.preempted, lane.pending, lane.idle_left = True, START_RESUME, self.life.preempt_idle
                    ended.append(r)
                elif lane.done >= d.steps:
                    out["end"][j, r] = END_FINISH
                    if lane.last_snapshot >= 0:
                        self.cache = (self.cache + [(lane.request, lane.last_snapshot)])[-self.life.prefix_cache:]
                        kept[j, r] = True
                    self._arrive(lane, lane.request + R)
                    ended.append(r)
            self._ended = ended
            self.step += 1
        return ScheduleChunk(self.step - S, S, out["request"], out["start"], out["source"], out["prefix"],
                             out["end"], out["pre"], out["accept"], out["track"], out["row"], lanes_of_rows, bucket, kept)

