"""Comparison of a run against its float64 twin (validated against golden data), step by step.

:class:`Comparison` is the observer: it advances the twin with each step's true inputs,
validates the twin against the golden trajectory where one exists, and reduces the
differences on the device into per-step arrays that it hands, one chunk of steps at a
time, as a :class:`MetricsChunk` to its consumers (checks, bound model, curves).
"""

from __future__ import annotations

import math
from typing import Optional, Protocol, Sequence

import numpy as np
import torch

from ..checkpoint import saveable
from ..devices import supports_float64
from ..dtypes import store_dtype
from ..sim import native
from ..dtypes import as_bits
from ..sim.twin import F64, Float64Twin
from ..simulate import StopRun
from .golden import Golden, load_golden

# Per (layer, row, head), float64, every step:
PER_HEAD = (
    "err2",      # ||run - twin||_F^2 of the committed state
    "ref2",      # ||twin||_F^2
    "run2",      # ||run||_F^2
    "ulp2_run",  # ||ulp(run)||_F^2 in the state dtype: the size of one store rounding
    "ulp4_run",  # sum ulp(run)^4: how much one rounding's energy fluctuates
    "ulp2_bf16", # ||ulp_bf16(twin)||_F^2: the unit of the bf16-ULP error metric
    "rho2",      # contraction of the error energy over this step's accepted tokens (bound model)
    "logdecay",  # sum of g over the accepted tokens: log of the pure decay of this step
    "round_w",   # store roundings this step, each weighted by the contraction that follows it
    "tok_w",     # the same for the fp32 compute of every accepted token
    "out_err2", "out_ref2",  # outputs of the accepted tokens (summed over them)
    "out_w",     # sum over accepted tokens of rho2(<= t) sum_k q_tk^2 c_k: how the committed error reaches them
    "out_round2",  # sum over accepted tokens of ||ulp_bf16(o_run)/2||^2: the most the op's bf16 output rounding moves them
    "trk_err2", "trk_ref2",  # tracked state vs twin at the boundary (rows tracked this step)
    "gold_dev",  # |proj(twin) - golden proj| / (|golden proj| + ||h|| / sqrt(K V)); NaN: not covered
    "gold_out_dev",  # the same for the outputs of the accepted tokens (max over them)
)
# Per row, every step:
PER_ROW = ("conv_bad", "trk_bits_bad", "trk_conv_bad", "gold_ckpt_bad", "gold_ckpt_dev")
BATCH_BYTES = 64 << 20  # per-step snapshots held between comparisons (a batch is at most a chunk)


def ulp_sq(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``ulp(x)^2`` elementwise: ulp = spacing of ``dtype``'s grid at each element of float64
    ``x`` (``2^(e - p)`` with ``x = m 2^e``, ``m`` in [0.5, 1), p mantissa bits), 0 where x is 0."""
    _, e = torch.frexp(x)
    sq = torch.exp2((e - store_dtype(dtype).mantissa_bits).to(x.dtype) * 2.0)
    return torch.where(x == 0, torch.zeros_like(x), sq)


def ulp2_sum(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``sum(ulp(x)^2)`` over the last two dims (float64, x's shape minus two dims)."""
    return ulp_sq(x, dtype).sum((-1, -2))


class MetricsChunk:
    """Per-step reductions for ``count`` steps from ``step0`` (host numpy arrays).

    Per-head arrays (names in ``PER_HEAD``) are ``[S, L, R, HV]`` float64; ``finite`` is
    ``[S, L, R, HV]`` bool; per-row arrays (``PER_ROW``) are ``[S, R]``; ``pre``, ``accept``,
    ``track`` ``[S, R]`` int are the host schedule (track = -1 when not tracked).
    """

    def __init__(self, step0: int, count: int, arrays: dict[str, np.ndarray]):
        self.step0, self.count, self.arrays = step0, count, arrays

    def __getattr__(self, name: str) -> np.ndarray:
        try:
            return self.__dict__["arrays"][name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def steps(self) -> np.ndarray:
        return self.step0 + np.arange(self.count)


class Consumer(Protocol):
    def start(self, comparison: "Comparison") -> None: ...
    def consume(self, chunk: MetricsChunk) -> None: ...
    def finish(self) -> None: ...


class Comparison:
    """Observer comparing committed states, tracked snapshots, conv windows and outputs of the
    active rows with a :class:`~drift.sim.twin.Float64Twin` at every step.

    golden: a :class:`~drift.check.golden.Golden`, ``None`` to look one up for the config, or
    ``False`` for none. The twin runs on the run's device, or on the CPU when that device
    lacks float64 (NPU).
    """

    def __init__(self, consumers: Sequence[Consumer] = (), golden: Golden | None | bool = None):
        self.consumers = list(consumers)
        self._golden_arg = golden
        self.golden: Optional[Golden] = None
        self.golden_note = ""
        self.sim = None
        # Called as listener(step, twin) once the twin has advanced through decode step ``step`` (the
        # twin runs per batch, after the steps: an observer that needs the truth at a step asks here).
        self.twin_listeners = []

    # -------------------------------------------------------------- lifecycle
    def on_start(self, sim) -> None:
        self.sim = sim
        cfg = sim.cfg
        if self._golden_arg is None:
            self.golden, self.golden_note = load_golden(cfg)
        elif self._golden_arg is False:
            self.golden, self.golden_note = None, "golden not requested"
        else:
            self.golden, self.golden_note = self._golden_arg, self._golden_arg.describe()
        dev = sim.device if supports_float64(sim.device) else torch.device("cpu")
        self.ref_device = dev
        self.twin = Float64Twin(cfg, sim.stream.params, dev, sim.prefill_state, sim.prefill_window)
        S, L, R, HV = sim.stream.chunk_steps, cfg.num_layers, cfg.num_requests, cfg.num_v_heads
        self._buf = {k: torch.zeros(S, L, R, HV, dtype=F64, device=dev) for k in PER_HEAD}
        self._buf["finite"] = torch.ones(S, L, R, HV, dtype=torch.bool, device=dev)
        self._buf.update({k: torch.zeros(S, R, dtype=F64, device=dev) for k in PER_ROW})
        self._host: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []
        self._snap = None  # per-step snapshots of the current batch (allocated at the first step)
        self._pending = []
        self.r_eff = cfg.key_rank or cfg.head_k_dim
        self.golden_positions = 0  # committed positions validated against golden
        self.golden_checkpoints = 0
        self.golden_limit = None
        self.beyond_golden_steps = 0
        if self.golden is not None:
            ga = self.golden.arrays
            self._g = {k: torch.from_numpy(ga[k]).to(dev, F64) for k in
                       ("proj_state", "state_norm", "proj_out", "proj_u", "proj_w", "proj_wo")}
            self._ckpt = {int(p): i for i, p in enumerate(ga["ckpt_pos"])}
            self.golden_limit = self.golden.max_position
        # One rounding of the prefill state on load: the bound model's starting point.
        pool = sim.pool
        run0 = pool.states[:, pool.active_slots].to(dev, F64)
        u2 = ulp_sq(run0, pool.temporal.dtype)
        self.ulp2_initial = u2.sum((-1, -2)).cpu().numpy()
        self.ulp4_initial = u2.square().sum((-1, -2)).cpu().numpy()
        self._col_frac = self._columns(u2)
        self._native_metrics = (dev.type == "cpu" and native.available()
                                and store_dtype(pool.temporal.dtype).native)
        for c in self.consumers:
            c.start(self)

    # ------------------------------------------------------------------- step
    def _marks(self, pre: np.ndarray, accept: np.ndarray) -> Optional[np.ndarray]:
        """Draft step at which each row passes a golden checkpoint position this step (-1: none)."""
        if self.golden is None:
            return None
        mark = np.full(len(pre), -1, np.int64)
        for r, (p0, acc) in enumerate(zip(pre, accept)):
            for c in range(int(p0) + 1, int(p0 + acc) + 1):
                if c in self._ckpt:
                    mark[r] = c - int(p0) - 1
        return mark if (mark >= 0).any() else None

    def _views(self, view) -> dict[str, torch.Tensor]:
        """What a step leaves to compare, as views of the run (its device, its dtypes): committed
        states, outputs and conv windows of the active rows, and the step's true inputs."""
        cfg, pool, R = self.sim.cfg, self.sim.pool, self.sim.cfg.num_requests
        Km1 = cfg.conv_kernel - 1
        return {"run": pool.states[:, pool.active_slots], "out": view.out[:, :R],
                "win": pool.conv[:, pool.active_slots, cfg.conv_window - Km1:],
                "x": view.x[:, :R], "a": view.a[:, :R], "b": view.b[:, :R]}

    def on_step(self, view) -> None:
        """Snapshot the step (a few device copies); the comparison itself runs once per batch of
        up to ``batch`` steps (:data:`BATCH_BYTES` of snapshots, at most a chunk)."""
        views = self._views(view)
        if self._snap is None:
            per_step = sum(t.numel() * t.element_size() for t in views.values())
            self.batch = int(max(1, min(self.sim.stream.chunk_steps, BATCH_BYTES // max(per_step, 1))))
            self._snap = {k: torch.empty((self.batch, *t.shape), dtype=t.dtype, device=t.device)
                          for k, t in views.items()}
        j = len(self._pending)
        for k, t in views.items():
            self._snap[k][j].copy_(t)
        tracked = self._tracked_snapshot(view) if self.sim.mode == "mtp" and (view.track >= 0).any() else None
        self._host.append((view.step, view.pre.copy(), view.accept.copy(), view.track.copy()))
        self._pending.append((view.index, view.pre.copy(), view.accept.copy(), view.track.copy(), tracked,
                              view.step))
        if len(self._pending) == self.batch:
            self._process()

    def _tracked_snapshot(self, view) -> tuple:
        """What the tracking rows hold now: (rows, tracked states, their windows, bit mismatches of
        each tracked slot against the scratch block it was copied from [n])."""
        sim, cfg, pool = self.sim, self.sim.cfg, self.sim.pool
        rows = np.nonzero(view.track >= 0)[0]
        rows_t = torch.from_numpy(rows).to(sim.device)
        tslots = pool.row_track_slots[rows_t]
        got = pool.states[:, tslots]  # [L, n, HV, V, K] in the state dtype
        held = pool.scratch[:, rows_t, torch.from_numpy(view.track[rows]).to(sim.device)]
        bits_bad = (as_bits(got) != as_bits(held)).sum((0, 2, 3, 4))
        Km1 = cfg.conv_kernel - 1
        return rows, got.clone(), pool.conv[:, tslots, cfg.conv_window - Km1:].clone(), bits_bad

    def _process(self) -> None:
        """Advance the twin through the buffered steps and compare: the recurrence and the state
        comparison step by step (the native C kernels on a CPU), everything else batched."""
        n = len(self._pending)
        if n == 0:
            return
        cfg, twin, buf, dev = self.sim.cfg, self.twin, self._buf, self.ref_device
        R, D = cfg.num_requests, cfg.num_draft_tokens
        snap = {k: v[:n].to(dev) for k, v in self._snap.items()}
        idx = [p[0] for p in self._pending]
        accept = np.stack([p[2] for p in self._pending])
        L, HV, V = cfg.num_layers, cfg.num_v_heads, cfg.head_v_dim
        tw_out = torch.empty(n, L, R, D, HV, V, dtype=F64, device=dev)
        tw_win = torch.empty(n, *twin.window.shape, dtype=F64, device=dev)
        tw = {k: torch.empty(n, L, R, D, HV, dtype=F64, device=dev) for k in ("decay", "beta", "norm2")}
        tw_qc = torch.empty(n, L, R, D, HV, dtype=F64, device=dev)  # sum_k q_k^2 c_k (bound model)
        p_twin = torch.empty(n, L, R, HV, dtype=F64, device=dev) if self.golden is not None else None
        marks = [self._marks(p[1], p[2]) for p in self._pending]

        def compare(j: int) -> None:  # after the twin's step j
            i, pre, _, _, tracked, step = self._pending[j]
            for listener in self.twin_listeners:
                listener(step, twin)
            col_frac, self._col_frac = self._col_frac, self._state_metrics(snap["run"][j], i)
            tw_out[j] = twin.out
            tw_win[j] = twin.window
            for k in tw:
                tw[k][j] = getattr(twin, k)
            tw_qc[j] = (twin.q_sq * col_frac[:, :, None]).sum(-1)
            if tracked is not None:
                self._tracked(i, tracked)
            if self.golden is not None:
                g = self._g
                p_twin[j] = torch.einsum("lhv,lrhvk,lhk->lrh", g["proj_w"], twin.state, g["proj_u"])
                if marks[j] is not None:
                    self._checkpoint(i, pre, marks[j])

        twin.advance_batch(snap["x"], snap["a"], snap["b"], accept, np.stack([p[3] for p in self._pending]),
                           marks, compare)
        m = torch.arange(D, device=dev)[None, None, :] < torch.from_numpy(accept).to(dev)[:, :, None]  # [n, R, D]
        rows = torch.tensor(idx, dtype=torch.int64, device=dev)
        self._bound_terms(rows, m, tw, tw_qc)
        o_run = snap["out"].to(F64)
        m6 = m[:, None, :, :, None, None]
        buf["out_err2"][rows] = ((o_run - tw_out) * m6).square().sum((3, 5))
        buf["out_ref2"][rows] = (tw_out * m6).square().sum((3, 5))
        # Round to nearest moves a value by at most half an ulp of the result (an ulp of a bf16
        # output bounds the ulp of the fp32 value it was rounded from).
        buf["out_round2"][rows] = (ulp_sq(o_run, torch.bfloat16) * m6).sum((3, 5)) / 4.0
        buf["conv_bad"][rows] = (snap["win"].to(F64) != tw_win).sum((1, 3, 4)).to(F64)
        if self.golden is not None:
            pre = np.stack([p[1] for p in self._pending])
            self._validate(rows, pre, accept, m, p_twin, tw_out)
        self._pending.clear()

    def _state_metrics(self, run: torch.Tensor, i: int) -> torch.Tensor:
        """The per-head state comparisons of step i into the chunk buffers (err2, ref2, run2, ulp2_run,
        ulp4_run, ulp2_bf16, finite); returns the run's key-column shares of its rounding energy. One
        pass of drift.sim.native's C kernel on plain CPU tensors; torch ops elsewhere (same sums)."""
        buf, twin = self._buf, self.twin
        dtype = self.sim.pool.temporal.dtype
        if self._native_metrics and type(run) is torch.Tensor and run.device.type == "cpu":
            m, col = native.state_metrics(run.contiguous(), twin.state, store_dtype(dtype).mantissa_bits)
            for j, name in enumerate(("err2", "ref2", "run2", "ulp2_run", "ulp4_run", "ulp2_bf16")):
                buf[name][i] = m[..., j]
            buf["finite"][i] = m[..., 6] > 0
            return col / col.sum(-1, keepdim=True).clamp(min=1e-300)
        run = run.to(self.ref_device, F64)
        buf["err2"][i] = (run - twin.state).square().sum((-1, -2))
        buf["ref2"][i] = twin.state.square().sum((-1, -2))
        buf["run2"][i] = run.square().sum((-1, -2))
        u2 = ulp_sq(run, dtype)
        buf["ulp2_run"][i] = u2.sum((-1, -2))
        buf["ulp4_run"][i] = u2.square().sum((-1, -2))
        buf["ulp2_bf16"][i] = ulp2_sum(twin.state, torch.bfloat16)
        buf["finite"][i] = torch.isfinite(run).all(-1).all(-1)
        return self._columns(u2)

    @staticmethod
    def _columns(u2: torch.Tensor) -> torch.Tensor:
        """``[L, R, HV, K]``: each key column's share of a store rounding's error energy (ulp^2 summed
        over the state's V rows): how the committed error is spread over the key directions."""
        col = u2.sum(-2)
        return col / col.sum(-1, keepdim=True).clamp(min=1e-300)

    def _bound_terms(self, rows: torch.Tensor, m: torch.Tensor, tw: dict, qc: torch.Tensor) -> None:
        """Contraction of the error energy over each step, and the weight of its roundings.

        Per token the error is multiplied by ``a (I - beta k k^T)``; for an error spread evenly
        over the ``r_eff``-dimensional key span, E||(I - beta k k^T) e||^2 = (1 - (2 beta -
        beta^2) / r_eff) ||e||^2 (docs/bounds.md). A rounding after token j is contracted by
        the tokens after it and scales with the state's size there, ||h_j||^2 / ||h_last||^2
        (the bound multiplies by the ulp^2 of the committed state). MTP stores once, after the
        last accepted token; sequential decode after every token; the fp32 compute rounds
        at every token in both. rows ``[n]``: chunk indices; m ``[n, R, D]`` accepted tokens;
        tw: the twin's decay, beta, norm2 ``[n, L, R, D, HV]``; qc: ``sum_k q_k^2 c_k`` likewise.
        """
        buf = self._buf
        mm = m[:, None, :, :, None]  # [n, 1, R, D, 1]
        decay, beta, norm2 = tw["decay"], tw["beta"], tw["norm2"]
        c = decay.square() * (1.0 - (2.0 * beta - beta.square()) / self.r_eff)  # [n, L, R, D, HV]
        c = torch.where(mm, c, torch.ones_like(c))
        buf["rho2"][rows] = c.prod(3)
        buf["logdecay"][rows] = torch.where(mm, torch.log(decay), torch.zeros_like(decay)).sum(3)
        # The output of token t sees the step's starting error E contracted by tokens 1..t, read by
        # q_t: E||E q||^2 = sum_k q_k^2 E||E[:, k]||^2 = ||E||_F^2 sum_k q_k^2 c_k, c_k the share of
        # the error energy in key column k (that of the last store's rounding; 1/K when even).
        buf["out_w"][rows] = (qc * torch.cumprod(c, 3) * mm).sum(3)
        suffix = torch.flip(torch.cumprod(torch.flip(c, [3]), 3), [3])  # prod_{t >= j}
        after = torch.cat([suffix[..., 1:, :], torch.ones_like(suffix[..., :1, :])], 3)  # prod_{t > j}
        last = (m.sum(2) - 1).clamp(min=0)  # [n, R] index of the last accepted token
        n_last = norm2.gather(3, last[:, None, :, None, None].expand(-1, norm2.shape[1], -1, 1, norm2.shape[4]))
        size = norm2 / n_last.clamp(min=1e-300)
        tok_w = (after * size * mm).sum(3)
        buf["tok_w"][rows] = tok_w
        buf["round_w"][rows] = torch.ones_like(tok_w) if self.sim.mode == "mtp" else tok_w

    def _tracked(self, i: int, tracked: tuple) -> None:
        """Tracked snapshots of step i (taken when it ran) against the twin's track state now."""
        twin, buf, dev = self.twin, self._buf, self.ref_device
        rows, got, win, bits_bad = tracked
        rows_d = torch.from_numpy(rows).to(dev)
        buf["trk_bits_bad"][i].index_copy_(0, rows_d, bits_bad.to(dev, F64))
        got64 = got.to(dev, F64)
        ref = twin.track_state[:, rows_d]
        buf["trk_err2"][i][:, rows_d] = (got64 - ref).square().sum((-1, -2))
        buf["trk_ref2"][i][:, rows_d] = ref.square().sum((-1, -2))
        buf["trk_conv_bad"][i].index_copy_(0, rows_d, (win.to(dev, F64) != twin.track_window[:, rows_d])
                                           .sum((0, 2, 3)).to(F64))

    def _validate(self, rows: torch.Tensor, pre: np.ndarray, accept: np.ndarray, m: torch.Tensor,
                  p_twin: torch.Tensor, tw_out: torch.Tensor) -> None:
        """Twin vs golden for a batch of steps ``[n]``: projections at every committed position and
        accepted output. Positions past the golden horizon are NaN. pre / accept ``[n, R]`` host;
        m ``[n, R, D]``; p_twin ``[n, L, R, HV]``; tw_out ``[n, L, R, D, HV, V]``."""
        cfg, buf, dev, g = self.sim.cfg, self._buf, self.ref_device, self._g
        post = pre + accept
        inside = post <= self.golden_limit  # [n, R]
        self.beyond_golden_steps += int((~inside.all(1)).sum())
        self.golden_positions += int(inside.sum())
        R = cfg.num_requests
        r_idx = torch.arange(R, device=dev)
        pos = torch.from_numpy(np.minimum(post, self.golden_limit)).to(dev)  # [n, R]
        scale_kv = math.sqrt(cfg.head_k_dim * cfg.head_v_dim)
        p_gold = g["proj_state"][pos, :, r_idx[None, :]].permute(0, 2, 1, 3)  # [n, L, R, HV]
        n_gold = g["state_norm"][pos, :, r_idx[None, :]].permute(0, 2, 1, 3)
        dev_s = (p_twin - p_gold).abs() / (p_gold.abs() + n_gold / scale_kv + 1e-300)
        inside_t = torch.from_numpy(inside).to(dev)[:, None, :, None]
        buf["gold_dev"][rows] = torch.where(inside_t, dev_s, torch.full_like(dev_s, math.nan))
        # Outputs of accepted tokens j sit at positions pre + j.
        opos = torch.from_numpy(pre).to(dev)[:, :, None] + torch.arange(cfg.num_draft_tokens, device=dev)  # [n, R, D]
        ok = m & (opos < g["proj_out"].shape[0])
        o_gold = g["proj_out"][opos.clamp(max=g["proj_out"].shape[0] - 1), :, r_idx[None, :, None]]  # [n, R, D, L, HV]
        o_twin = torch.einsum("nlrdhv,lhv->nrdlh", tw_out, g["proj_wo"])
        o_norm = torch.linalg.vector_norm(tw_out, dim=-1).permute(0, 2, 3, 1, 4) / math.sqrt(cfg.head_v_dim)
        o_dev = (o_twin - o_gold).abs() / (o_gold.abs() + o_norm + 1e-300)
        o_dev = torch.where(ok[..., None, None], o_dev, torch.zeros_like(o_dev)).amax(2)  # [n, R, L, HV]
        buf["gold_out_dev"][rows] = torch.where(inside_t, o_dev.permute(0, 2, 1, 3), torch.full_like(dev_s, math.nan))

    def _checkpoint(self, i: int, pre: np.ndarray, mark: np.ndarray) -> None:
        """Full state and conv window of the twin against golden checkpoints passed at step i."""
        ga, buf, dev, twin = self.golden.arrays, self._buf, self.ref_device, self.twin
        for r in np.nonzero(mark >= 0)[0]:
            c = self._ckpt[int(pre[r] + mark[r] + 1)]
            ref = torch.from_numpy(ga["ckpt_state"][c][:, r]).to(dev, F64)
            d = torch.linalg.vector_norm(twin.mark_state[:, r] - ref) / torch.linalg.vector_norm(ref)
            wref = torch.from_numpy(ga["ckpt_window"][c][:, r]).to(dev, F64)
            buf["gold_ckpt_dev"][i, r] = d
            buf["gold_ckpt_bad"][i, r] = (twin.mark_window[:, r] != wref).sum().to(F64)
            self.golden_checkpoints += 1

    # ------------------------------------------------------------------ flush
    def flush(self) -> None:
        self._process()
        if not self._host:
            return
        n = len(self._host)
        arrays = {k: v[:n].cpu().numpy().copy() for k, v in self._buf.items()}
        for k, v in self._buf.items():
            v[:n] = 1 if k == "finite" else 0
        arrays["pre"] = np.stack([h[1] for h in self._host])
        arrays["accept"] = np.stack([h[2] for h in self._host])
        arrays["track"] = np.stack([h[3] for h in self._host])
        chunk = MetricsChunk(self._host[0][0], n, arrays)
        self._host.clear()
        stop = None
        for c in self.consumers:  # every consumer sees the chunk, even after a fatal finding
            try:
                c.consume(chunk)
            except StopRun as why:
                stop = stop or why
        if stop is not None:
            raise stop

    def on_end(self) -> None:
        for c in self.consumers:
            c.finish()

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Counters and the twin's state (taken between chunks, after a flush)."""
        return {"golden_positions": self.golden_positions, "golden_checkpoints": self.golden_checkpoints,
                "beyond_golden_steps": self.beyond_golden_steps,
                "twin_state": saveable(self.twin.state), "twin_window": saveable(self.twin.window),
                "consumers": [c.state_dict() if hasattr(c, "state_dict") else None for c in self.consumers]}

    def load_state_dict(self, state: dict) -> None:
        self.golden_positions = state["golden_positions"]
        self.golden_checkpoints = state["golden_checkpoints"]
        self.beyond_golden_steps = state["beyond_golden_steps"]
        self.twin.state.copy_(state["twin_state"])
        self.twin.window = state["twin_window"].to(self.twin.window.device)
        for c, cs in zip(self.consumers, state["consumers"]):
            if cs is not None:
                c.load_state_dict(cs)

    def reference_description(self) -> str:
        dev = self.ref_device
        if self.golden is None:
            return f"float64 twin computed alongside on {dev} ({self.golden_note}; falling back to the twin)"
        text = (f"{self.golden_note}; float64 twin on {dev} validated against it at "
                f"{self.golden_positions} committed positions and {self.golden_checkpoints} checkpoints")
        if self.beyond_golden_steps:
            text += (f"; {self.beyond_golden_steps} steps reached past golden position {self.golden_limit} "
                     "and were checked against the float64 twin alone")
        return text
