"""Teacher-forced input stream: the true tokens, the acceptance schedule, the verify windows.

Everything here is generated on the CPU from the config's seed (numpy PCG64,
counter-based: a block of positions or steps is a pure function of
``(seed, row, block)``), then moved to the device, so every device sees the same
inputs and any position can be produced without replaying the ones before it.

Invariant: the true trajectory of a request depends only on its true tokens,
never on the acceptance pattern. Accepted drafts *are* the true next tokens; a
rejected draft is a perturbed token whose state is computed and thrown away.
One golden trajectory therefore serves every acceptance pattern.

Replay: with ``cfg.trace`` set (a config from :meth:`drift.config.Config.from_trace`) the true
tokens and the layer constants are a captured model's instead (:func:`load_trace`):
:class:`StreamParams` returns the trace's ``A_log``, ``dt_bias`` and conv weights, and
:class:`TrueTokens` request ``r``'s tokens are sequence ``r`` of the trace, ``x``, ``a``, ``b``
rounded to the bf16 grid (the deployment feeds the GDN layer bf16; a float32 capture is
rounded here, a bf16 one is already exact). Everything downstream -- the verify windows, the
float64 twin, the golden generator, the simulation -- reads tokens and constants only through
these two, so it runs unchanged on a trace. With ``cfg.trace_loop`` position ``p`` reads token
``p mod tokens``: past the end the sequence starts over, and so does the conv window, which
then holds the trace's last tokens before its first (a seam real decoding never has).
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..config import PREFILL_STAGGER, Config
from ..errors import ConfigError, DataError
from .tracefile import Trace, read_trace, trace_paths
from .serving import ScheduleChunk, track_steps

TOKEN_BLOCK = 64  # positions generated per (row, block) draw
SCHEDULE_BLOCK = 1024  # steps generated per acceptance draw
A_JITTER = 0.5  # std of the gating input `a` around 0 (decay varies per token)
SQRT3 = math.sqrt(3.0)  # uniform on [-sqrt3, sqrt3] has unit variance

# The "mixed" acceptance pattern cycles through these phases (name, steps).
MIXED_PHASES: tuple[tuple[str, int], ...] = (
    ("model", 256), ("all-1", 128), ("model", 256), ("all-D", 128), ("split", 128),
)
MIXED_CYCLE = sum(n for _, n in MIXED_PHASES)


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([int(k) & 0xFFFFFFFF for k in key])


def _to_bf16_grid(x: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest bfloat16 (the inputs a bf16 model sees)."""
    return torch.from_numpy(x).to(torch.bfloat16).to(torch.float32).numpy()


# --------------------------------------------------------------------------- traces
@dataclass(frozen=True, eq=False)
class ReplayTrace:
    """A validated trace as the stream replays it: x, a, b float32 on the bf16 grid
    ``[R, T, L, C]`` / ``[R, T, L, HV]`` (the trace's own arrays when it was captured in bf16)."""

    trace: Trace
    x: np.ndarray
    a: np.ndarray
    b: np.ndarray


_TRACE_CACHE: "OrderedDict[tuple, ReplayTrace]" = OrderedDict()
_TRACE_CACHE_SIZE = 2  # traces held in memory (a run reads one)


def _file_key(path: Path) -> tuple:
    st = os.stat(path)
    return (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _replay_trace(path: str | os.PathLike) -> ReplayTrace:
    """:func:`drift.sim.tracefile.read_trace` (sha256 checked, every field validated) once per
    file version -- cached by path, inode, size, mtime and ctime of the npz and its manifest -- plus what
    replay needs beyond a valid trace: no conv bias."""
    npz, man = trace_paths(path)
    try:
        key = _file_key(npz) + _file_key(man)
    except OSError:
        key = None  # missing: read_trace names the file and the fix
    hit = _TRACE_CACHE.get(key) if key is not None else None
    if hit is not None:
        _TRACE_CACHE.move_to_end(key)
        return hit
    tr = read_trace(path)
    if np.any(tr.conv_bias != 0):
        idx = [int(i) for i in np.argwhere(tr.conv_bias != 0)[0]]
        raise DataError(f"trace {tr.path}: array 'conv_bias': holds {tr.conv_bias[tuple(idx)]} at index {idx}; "
                        "drift's conv stage has no bias (Qwen3-Next / Qwen3.5 GDN convs have none), so this trace "
                        "cannot be replayed: capture a model without a conv bias (drift trace-stats reads it)")
    if tr.dtype == "bfloat16":
        x, a, b = tr.x, tr.a, tr.b
    else:
        x, a, b = (_to_bf16_grid(np.array(v, dtype=np.float32)) for v in (tr.x, tr.a, tr.b))  # writable copies
        for v in (x, a, b):
            v.setflags(write=False)
    rt = ReplayTrace(tr, x, a, b)
    if key is not None:
        _TRACE_CACHE[key] = rt
        while len(_TRACE_CACHE) > _TRACE_CACHE_SIZE:
            _TRACE_CACHE.popitem(last=False)
    return rt


def load_trace(path: str | os.PathLike) -> Trace:
    """The trace at ``path`` validated for replay (cached): DataError naming the file and the
    field when it is damaged, or when it has a conv bias drift's conv stage cannot apply."""
    return _replay_trace(path).trace


def _trace_for(cfg: Config) -> ReplayTrace:
    """The trace ``cfg`` replays, checked against the config made from it."""
    rt = _replay_trace(cfg.trace)
    tr, m = rt.trace, rt.trace.manifest
    if m["sha256"] != cfg.trace_sha256:
        raise DataError(f"trace {tr.path}: field 'sha256': the file is now {m['sha256'][:16]}..., the config was "
                        f"made from {cfg.trace_sha256[:16]}...: the trace was replaced; build the config again "
                        "(Config.from_trace) from the trace you mean")
    bad = [f"{f}={getattr(cfg, f)} (trace: {m[f]})" for f in ("num_k_heads", "num_v_heads", "head_k_dim",
                                                               "head_v_dim", "conv_kernel") if getattr(cfg, f) != m[f]]
    if cfg.num_layers > m["num_layers"]:
        bad.append(f"num_layers={cfg.num_layers} (trace: {m['num_layers']}; fewer replay its first layers)")
    if cfg.num_requests > m["sequences"]:
        bad.append(f"num_requests={cfg.num_requests} (trace: {m['sequences']} sequences, one per request)")
    if cfg.trace_tokens != m["tokens"]:
        bad.append(f"trace_tokens={cfg.trace_tokens} (trace: {m['tokens']})")
    if bad:
        raise ConfigError(f"config {cfg.name} does not fit trace {tr.path}: {'; '.join(bad)}; build it with "
                          "Config.from_trace")
    return rt


# --------------------------------------------------------------------------- params
@dataclass(frozen=True)
class StreamParams:
    """Per-layer constants of the simulated model (float32, CPU).

    ``A_log`` and ``dt_bias`` are ``[L, HV]``; ``conv_weight`` is ``[L, C, Kc]``.
    """

    A_log: torch.Tensor
    dt_bias: torch.Tensor
    conv_weight: torch.Tensor

    @staticmethod
    def generate(cfg: Config) -> "StreamParams":
        if cfg.trace:  # the captured model's own constants, first num_layers layers
            tr = _trace_for(cfg).trace
            L = cfg.num_layers
            return StreamParams(*(torch.from_numpy(np.array(arr[:L], dtype=np.float32))
                                  for arr in (tr.A_log, tr.dt_bias, tr.conv_weight)))
        rng = _rng(cfg.seed, 0x5EED)
        L, HV, C, Kc = cfg.num_layers, cfg.num_v_heads, cfg.conv_channels, cfg.conv_kernel
        # decay = exp(-exp(A_log) * softplus(a + dt_bias)); with a = 0 and dt_bias = 0
        # softplus = ln 2, so A_log = ln(-ln(decay) / ln 2) hits the target median decay.
        target = np.array([math.log(-math.log(d) / math.log(2.0)) for d in cfg.decays])
        a_log = target[None, :] + 0.05 * rng.standard_normal((L, HV))  # small per-layer spread
        # Depthwise conv weights with unit output variance for unit-variance inputs.
        w = (rng.random((L, C, Kc), dtype=np.float32) * 2 - 1) * SQRT3 / math.sqrt(Kc)
        return StreamParams(
            A_log=torch.tensor(a_log, dtype=torch.float32),
            dt_bias=torch.zeros(L, HV, dtype=torch.float32),
            conv_weight=torch.from_numpy(_to_bf16_grid(w.astype(np.float32))),
        )

    def to(self, device: torch.device) -> "StreamParams":
        return StreamParams(*(t.to(device) for t in (self.A_log, self.dt_bias, self.conv_weight)))


# --------------------------------------------------------------------------- tokens
class TrueTokens:
    """The ground-truth token inputs of every request, by position.

    ``get(row, p0, p1)`` returns float32 arrays ``x [n, L, C]`` (pre-conv mixed
    q/k/v channels), ``a [n, L, HV]`` and ``b [n, L, HV]`` (gating inputs) for
    positions ``p0 .. p1-1``; all values lie on the bfloat16 grid. ``row`` is the request id (the
    fixed batch's request r is row r): a request's tokens are a function of (seed, request id) alone,
    except the prompt a prefix-cache hit shares with an earlier request (``prefixes``).
    """

    def __init__(self, cfg: Config, prefixes: Optional[dict] = None):
        self.cfg = cfg
        self._cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._trace = _trace_for(cfg) if cfg.trace else None
        # request -> (source request, shared positions): a prefix-cache hit's prompt is its source's
        # first positions (drift.sim.serving fills this as requests start; the fixed batch has none).
        self.prefixes: dict[int, tuple[int, int]] = {} if prefixes is None else prefixes

    def _from_trace(self, row: int, p0: int, p1: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        cfg, rt = self.cfg, self._trace
        T, L = rt.x.shape[1], cfg.num_layers
        if not 0 <= row < cfg.num_requests:
            raise ValueError(f"row {row} is invalid; allowed: 0 .. {cfg.num_requests - 1}")
        if p1 > T and not cfg.trace_loop:
            raise ConfigError(f"positions [{p0}, {p1}) of request {row} run past the end of trace {rt.trace.path} "
                              f"({T} tokens per sequence); replay fewer steps, or wrap around (--loop)")
        idx = slice(p0, p1) if p1 <= T else np.arange(p0, p1) % T
        # Fresh writable copies, as the synthetic path returns (callers wrap them with torch.from_numpy).
        return tuple(np.array(arr[row, idx, :L], dtype=np.float32) for arr in (rt.x, rt.a, rt.b))  # type: ignore[return-value]

    def _block(self, row: int, block: int):
        key = (row, block)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        cfg = self.cfg
        L, C, HV = cfg.num_layers, cfg.conv_channels, cfg.num_v_heads
        rng = _rng(cfg.seed, 0x70CE, row, block)
        # In-place float32 arithmetic: the same operations as (u * 2 - 1) * SQRT3, no temporaries.
        x = rng.random((TOKEN_BLOCK, L, C), dtype=np.float32)
        x *= 2
        x -= 1
        x *= SQRT3
        if cfg.key_rank:
            # Keys confined to the first `key_rank` coordinates of every key head:
            # zero channels stay zero through the conv and SiLU(0) = 0.
            k0 = cfg.num_k_heads * cfg.head_k_dim
            xk = x[:, :, k0:2 * k0].reshape(TOKEN_BLOCK, L, cfg.num_k_heads, cfg.head_k_dim)
            xk[..., cfg.key_rank:] = 0.0
        a = (rng.random((TOKEN_BLOCK, L, HV), dtype=np.float32) * 2 - 1) * (SQRT3 * A_JITTER)
        b = (rng.random((TOKEN_BLOCK, L, HV), dtype=np.float32) * 2 - 1) * SQRT3 + np.float32(cfg.beta_bias)
        out = (_to_bf16_grid(x), _to_bf16_grid(a), _to_bf16_grid(b))
        if len(self._cache) > 4 * max(1, cfg.num_requests):  # oldest first: positions only grow
            for oldest in list(self._cache)[:1]:  # one read: the comparison's worker thread draws tokens too
                self._cache.pop(oldest, None)
        self._cache[key] = out
        return out

    def get(self, row: int, p0: int, p1: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if p0 < 0 or p1 < p0:
            raise ValueError(f"positions [{p0}, {p1}) are invalid")
        if p1 == p0:
            cfg = self.cfg
            return (np.zeros((0, cfg.num_layers, cfg.conv_channels), np.float32),
                    np.zeros((0, cfg.num_layers, cfg.num_v_heads), np.float32),
                    np.zeros((0, cfg.num_layers, cfg.num_v_heads), np.float32))
        if self._trace is not None:
            return self._from_trace(row, p0, p1)
        shared = self.prefixes.get(row)
        if shared is not None and p0 < shared[1]:  # the prompt a prefix hit shares with its source
            src, P = shared
            head = self.get(src, p0, min(p1, P))
            if p1 <= P:
                return head
            tail = self.get(row, P, p1)
            return tuple(np.concatenate(pair, axis=0) for pair in zip(head, tail))  # type: ignore[return-value]
        parts = []
        for blk in range(p0 // TOKEN_BLOCK, (p1 - 1) // TOKEN_BLOCK + 1):
            lo, hi = max(p0, blk * TOKEN_BLOCK) - blk * TOKEN_BLOCK, min(p1, (blk + 1) * TOKEN_BLOCK) - blk * TOKEN_BLOCK
            parts.append(tuple(arr[lo:hi] for arr in self._block(row, blk)))
        return tuple(np.concatenate(p, axis=0) for p in zip(*parts))  # type: ignore[return-value]


def perturb(x: np.ndarray, a: np.ndarray, b: np.ndarray):
    """A rejected draft: the true token with its channels reversed and gates negated.

    Deterministic and cheap; far from the true token, so a commit of a rejected
    position shows as an order-one state error.
    """
    return x[..., ::-1].copy(), -a, -b


# ------------------------------------------------------------------------ schedule
def _phase(step: int) -> str:
    r = step % MIXED_CYCLE
    for name, n in MIXED_PHASES:
        if r < n:
            return name
        r -= n
    raise AssertionError("unreachable")


def draft_counts(cfg: Config, step0: int, count: int) -> np.ndarray:
    """Tokens each active row verifies at steps ``step0 .. step0+count-1``: int64 ``[count, R]``; all D
    unless ``cfg.drafts`` is "ragged", then a seeded count uniform in 1..D per row and step (the
    root token and up to D-1 drafts, as vLLM's varlen verify takes them)."""
    D, R = cfg.num_draft_tokens, cfg.num_requests
    if cfg.drafts != "ragged":
        return np.full((count, R), D, np.int64)
    out = np.empty((count, R), dtype=np.int64)
    for blk in range(step0 // SCHEDULE_BLOCK, (step0 + count - 1) // SCHEDULE_BLOCK + 1):
        d = _rng(cfg.seed, 0xD4AF, blk).integers(1, D + 1, size=(SCHEDULE_BLOCK, R))
        lo, hi = max(step0, blk * SCHEDULE_BLOCK), min(step0 + count, (blk + 1) * SCHEDULE_BLOCK)
        out[lo - step0:hi - step0] = d[lo - blk * SCHEDULE_BLOCK:hi - blk * SCHEDULE_BLOCK]
    return out


def accept_lengths(cfg: Config, step0: int, count: int) -> np.ndarray:
    """``accept_len`` (1..D) for steps ``step0 .. step0+count-1`` and every active row: int64 ``[count, R]``;
    at most the row's :func:`draft_counts` (a draft that was not verified cannot be accepted)."""
    acc = _accept_lengths(cfg, step0, count)
    return acc if cfg.drafts != "ragged" else np.minimum(acc, draft_counts(cfg, step0, count))


def _accept_lengths(cfg: Config, step0: int, count: int) -> np.ndarray:
    D, R = cfg.num_draft_tokens, cfg.num_requests
    out = np.empty((count, R), dtype=np.int64)
    # Conditional probability that draft j is accepted given j-1 was.
    marg = np.array((1.0,) + tuple(cfg.acceptance))
    cond = np.divide(marg[1:], marg[:-1], out=np.zeros(D - 1), where=marg[:-1] > 0)
    for blk in range(step0 // SCHEDULE_BLOCK, (step0 + count - 1) // SCHEDULE_BLOCK + 1):
        rng = _rng(cfg.seed, 0xACCE, blk)
        u = rng.random((SCHEDULE_BLOCK, R, max(D - 1, 1)))
        ok = np.cumprod(u[..., : D - 1] < cond, axis=-1) if D > 1 else np.zeros((SCHEDULE_BLOCK, R, 0))
        model = 1 + ok.sum(axis=-1).astype(np.int64)
        lo, hi = max(step0, blk * SCHEDULE_BLOCK), min(step0 + count, (blk + 1) * SCHEDULE_BLOCK)
        for s in range(lo, hi):
            kind = cfg.pattern if cfg.pattern != "mixed" else _phase(s)
            if kind == "model":
                out[s - step0] = model[s - blk * SCHEDULE_BLOCK]
            elif kind == "all-1":
                out[s - step0] = 1
            elif kind == "all-D":
                out[s - step0] = D
            else:  # split: even rows accept 1, odd rows accept D
                out[s - step0] = np.where(np.arange(R) % 2 == 0, 1, D)
    return out


# --------------------------------------------------------------------------- steps
def prefill_lengths(cfg: Config) -> list[int]:
    """Prompt length of each request: staggered by 3 (PREFILL_STAGGER) so rows cross track
    boundaries apart. With a trace, request r's prompt is the trace's prompt plus 3r of its
    decoded tokens."""
    return [cfg.prefill_len + PREFILL_STAGGER * r for r in range(cfg.num_requests)]


def max_position(cfg: Config, steps: int | None = None) -> int:
    """The furthest position any request can reach in ``steps`` decode steps (all accept D);
    :attr:`Config.max_position` for ``cfg.steps``."""
    return max(prefill_lengths(cfg)) + (cfg.steps if steps is None else steps) * cfg.num_draft_tokens


@dataclass
class StepChunk:
    """Inputs of ``count`` consecutive decode steps starting at ``step0``.

    Device tensors (all rows = active + padded, ``N``):
      x ``[S, L, N, D, C]`` bfloat16 (the verify windows), a, b ``[S, L, N, D, HV]`` float32,
      last_steps ``[S, N]`` int64 (accept_len - 1; -1 for padded rows),
      track_steps ``[S, N]`` int64 (-1 when not tracked),
      drafts ``[S, N]`` int32 (tokens each row verifies: D, or 1..D with ragged drafts; D for padded rows).
    Host arrays (active rows ``R``): pre ``[S, R]`` seq_len before each step, accept ``[S, R]``,
    track_host ``[S, R]``, drafts_host ``[S, R]`` (int64).
    """

    step0: int
    count: int
    x: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    last_steps: torch.Tensor
    track_steps: torch.Tensor
    drafts: torch.Tensor
    pre: np.ndarray
    accept: np.ndarray
    track_host: np.ndarray
    drafts_host: np.ndarray
    schedule: Optional[ScheduleChunk] = None  # the serving schedule of these steps (None: the fixed batch)

    def rows(self, s: int) -> int:
        """The batch rows passed at step ``s`` of the chunk: its graph bucket (every row when fixed)."""
        return self.last_steps.shape[1] if self.schedule is None else int(self.schedule.bucket[s])


class InputStream:
    """Iterates decode steps in device-resident chunks (one host-to-device copy per chunk).

    ``schedule``: the serving schedule (drift.sim.serving.ServingSchedule) of a config whose lifecycle
    churns; its requests' tokens (and their shared prefixes) fill the lanes' rows step by step."""

    def __init__(self, cfg: Config, device: torch.device, chunk_bytes: int = 16 << 20, schedule=None):
        self.cfg = cfg
        self.device = device
        self.schedule = schedule
        self.tokens = TrueTokens(cfg, prefixes=schedule.prefixes if schedule is not None else None)
        self.params = StreamParams.generate(cfg)
        per_step = cfg.num_layers * cfg.num_rows * cfg.num_draft_tokens * (cfg.conv_channels * 2 + 8 * cfg.num_v_heads)
        self.chunk_steps = int(max(1, min(256, chunk_bytes // max(per_step, 1))))
        self.pos = np.array(prefill_lengths(cfg), dtype=np.int64)
        self.step = 0

    def prefill_len(self, row: int) -> int:
        return prefill_lengths(self.cfg)[row]

    def chunk(self, count: int) -> StepChunk:
        """The next ``count`` steps (advances the stream)."""
        if self.schedule is not None:
            return self._serving_chunk(count)
        cfg = self.cfg
        L, N, R, D, C, HV = (cfg.num_layers, cfg.num_rows, cfg.num_requests, cfg.num_draft_tokens,
                             cfg.conv_channels, cfg.num_v_heads)
        acc = accept_lengths(cfg, self.step, count)
        pre = self.pos[None, :] + np.concatenate([np.zeros((1, R), np.int64), np.cumsum(acc, 0)[:-1]], 0)
        # x is assembled as bfloat16 bit patterns (int16; 0 is +0.0 for padded rows): the tokens
        # lie on the bf16 grid, so this is exact, and a perturbation only reverses channels.
        x = np.zeros((count, L, N, D, C), np.int16)
        a = np.zeros((count, L, N, D, HV), np.float32)
        b = np.zeros((count, L, N, D, HV), np.float32)
        for r in range(R):
            p0, p1 = int(pre[0, r]), int(pre[-1, r]) + D
            tx, ta, tb = self.tokens.get(r, p0, p1)
            tx = torch.from_numpy(tx).to(torch.bfloat16).view(torch.int16).numpy()
            idx = (pre[:, r, None] - p0) + np.arange(D)[None, :]  # [count, D]
            wx, wa, wb = tx[idx], ta[idx], tb[idx]  # [count, D, L, ...]
            rejected = np.arange(D)[None, :] >= acc[:, r, None]  # drafts after the first rejection
            if rejected.any():
                px, pa, pb = perturb(wx[rejected], wa[rejected], wb[rejected])
                wx[rejected], wa[rejected], wb[rejected] = px, pa, pb
            x[:, :, r] = wx.transpose(0, 2, 1, 3)
            a[:, :, r] = wa.transpose(0, 2, 1, 3)
            b[:, :, r] = wb.transpose(0, 2, 1, 3)
        last = np.full((count, N), -1, np.int64)
        last[:, :R] = acc - 1
        trk = np.full((count, N), -1, np.int64)
        trk[:, :R] = track_steps(pre, acc, cfg.track_interval)
        drafts_host = draft_counts(cfg, self.step, count)
        drafts = np.full((count, N), D, np.int32)
        drafts[:, :R] = drafts_host
        out = self._chunk(count, x, a, b, last, trk, drafts, pre=pre, accept=acc, track_host=trk[:, :R],
                          drafts_host=drafts_host)
        self.pos = pre[-1] + acc[-1]
        self.step += count
        return out

    def _chunk(self, count: int, x, a, b, last, trk, drafts, **host) -> StepChunk:
        """A :class:`StepChunk` of the next ``count`` steps from its host arrays: x (bf16 bits as
        int16), a, b, last, trk, drafts moved to the device; ``host`` its host fields as given."""
        dev = self.device
        return StepChunk(step0=self.step, count=count, x=torch.from_numpy(x).view(torch.bfloat16).to(dev),
                         a=torch.from_numpy(a).to(dev), b=torch.from_numpy(b).to(dev),
                         last_steps=torch.from_numpy(last).to(dev), track_steps=torch.from_numpy(trk).to(dev),
                         drafts=torch.from_numpy(drafts).to(dev), **host)

    def _serving_chunk(self, count: int) -> StepChunk:
        """The next ``count`` steps of a churning lifecycle: the schedule says which request each lane
        runs and where it stands; each lane's windows go to the batch row the schedule gives it (padded
        rows: zeros, step -1)."""
        cfg, sch = self.cfg, self.schedule
        L, N, R, D, C, HV = (cfg.num_layers, cfg.num_rows, cfg.num_requests, cfg.num_draft_tokens,
                             cfg.conv_channels, cfg.num_v_heads)
        drafts_lane = draft_counts(cfg, self.step, count)
        plan = sch.advance(accept_lengths(cfg, self.step, count), drafts_lane)
        acc, pre, rows = plan.accept, plan.pre, plan.row
        x = np.zeros((count, L, N, D, C), np.int16)
        a = np.zeros((count, L, N, D, HV), np.float32)
        b = np.zeros((count, L, N, D, HV), np.float32)
        last = np.full((count, N), -1, np.int64)
        trk = np.full((count, N), -1, np.int64)
        drafts = np.full((count, N), D, np.int32)
        for r in range(R):
            steps = np.nonzero(plan.request[:, r] >= 0)[0]
            if not len(steps):
                continue
            # contiguous runs of one request in this lane (a lane changes request at a start)
            cut = np.nonzero((np.diff(steps) != 1) | (np.diff(plan.request[steps, r]) != 0))[0] + 1
            for seg in np.split(steps, cut):
                q = int(plan.request[seg[0], r])
                p0, p1 = int(pre[seg[0], r]), int(pre[seg[-1], r]) + D
                tx, ta, tb = self.tokens.get(q, p0, p1)
                tx = torch.from_numpy(tx).to(torch.bfloat16).view(torch.int16).numpy()
                idx = (pre[seg, r, None] - p0) + np.arange(D)[None, :]  # [n, D]
                wx, wa, wb = tx[idx], ta[idx], tb[idx]  # [n, D, L, ...]
                rejected = np.arange(D)[None, :] >= acc[seg, r, None]
                if rejected.any():
                    px, pa, pb = perturb(wx[rejected], wa[rejected], wb[rejected])
                    wx[rejected], wa[rejected], wb[rejected] = px, pa, pb
                rw = rows[seg, r]
                x[seg, :, rw] = wx.transpose(0, 2, 1, 3)
                a[seg, :, rw] = wa.transpose(0, 2, 1, 3)
                b[seg, :, rw] = wb.transpose(0, 2, 1, 3)
                last[seg, rw] = acc[seg, r] - 1
                trk[seg, rw] = plan.track[seg, r]
                drafts[seg, rw] = drafts_lane[seg, r]
        live = plan.request >= 0
        out = self._chunk(count, x, a, b, last, trk, drafts, pre=np.where(live, pre, 0),
                          accept=np.where(live, acc, 0), track_host=np.where(live, plan.track, -1),
                          drafts_host=np.where(live, drafts_lane, D), schedule=plan)
        self.pos = np.where(live[-1], pre[-1] + acc[-1], 0)
        self.step += count
        return out
