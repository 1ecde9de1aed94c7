"""The float64 twin: the true trajectory of the stream, advanced alongside a run.

It shares no state-handling code with the run under test: it keeps each request's
state and conv window (the last Kc-1 true inputs) itself and advances each request by
exactly its accepted tokens. Drafts after a rejection are never seen: its trajectory
depends on the true tokens alone. Its inputs are the op's quantised inputs computed from
the true window (the same input stages as the run: bf16 ``mix_qkv``, fp32 ``g``, the bf16
beta logit; docs/semantics.md §10); everything after them (L2 norm, sigmoid, exp, the
recurrence) is float64. States are ``[.., V, K]`` like the op's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from . import kernels
from ..config import Config
from .stream import StreamParams, TrueTokens

F64 = torch.float64
# Prompt tokens per prefill recurrence call. Each call's setup (conv, gating, op inputs: about 20 small
# tensor ops) is paid per chunk: 64 tokens a call take a 194-token ci-small prompt in 4 calls, not 25
# (6-11 ms against 16-20 ms a prefill, 2026-12-07); the states and windows are bit-identical to 8's
# (every token's conv, gating and normalisation is elementwise or per token; the recurrence runs token
# by token either way; report.json of every flow unchanged, docs/speed.md).
PREFILL_CHUNK = 64
CAPTURE_BYTES = 64 << 20  # capture buffers of one batch's recurrence in one call (beyond: step by step)


def _inputs(cfg: Config, params: StreamParams, window: torch.Tensor, x: torch.Tensor,
            a: torch.Tensor, b: torch.Tensor):
    """q, k, v, decay, beta in float64 from the op's quantised inputs of true tokens x, a, b."""
    mix = kernels.conv_mix(window, x, params.conv_weight)
    g = kernels.gdn_gating(a, params.A_log, params.dt_bias)
    return kernels.op_inputs(mix, b.to(torch.bfloat16), g, cfg.num_k_heads, cfg.head_k_dim, cfg.num_v_heads,
                             cfg.head_v_dim, cfg.head_k_dim ** -0.5, F64)


def prefill(cfg: Config, tokens: TrueTokens, params: StreamParams, lengths: list[int],
            device: torch.device, requests: Optional[list[int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact state and conv window of each request after its first ``lengths[i]`` tokens (float64):
    the fixed batch's requests ``0 .. R-1``, or the request ids ``requests``.

    Returns states ``[L, n, HV, V, K]`` and windows ``[L, n, Kc-1, C]`` (the last Kc-1 inputs).
    """
    requests = list(range(cfg.num_requests)) if requests is None else list(requests)
    return extend(cfg, tokens, params, requests, [0] * len(requests), lengths, device)


def extend(cfg: Config, tokens: TrueTokens, params: StreamParams, requests: list[int], starts: list[int],
           ends: list[int], device: torch.device, state: Optional[torch.Tensor] = None,
           window: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The state and conv window of each request ``requests[i]`` after its tokens ``starts[i] ..
    ends[i] - 1``, in float64, from ``state [L, n, HV, V, K]`` and ``window [L, n, Kc-1, C]`` (the state
    and the last Kc-1 inputs before ``starts[i]``; zeros when None: a prompt from its start). An
    engine's extend (prefill) from what a slot holds, computed exactly (drift's model of the prefill
    kernel: exact, then stored once in the state dtype; docs/semantics.md §12)."""
    L, R, Kc = cfg.num_layers, len(requests), cfg.conv_kernel
    shape = (L, R, cfg.num_v_heads, cfg.head_v_dim, cfg.head_k_dim)
    state = torch.zeros(shape, dtype=F64, device=device) if state is None else state.to(device, F64).clone()
    window = (torch.zeros(L, R, Kc - 1, cfg.conv_channels, dtype=F64, device=device) if window is None
              else window.to(device, F64).clone())
    rows = torch.arange(R, device=device)
    prm = params.to(device)
    longest = max(e - s for s, e in zip(starts, ends)) if R else 0
    for off in range(0, longest, PREFILL_CHUNK):
        n = min(PREFILL_CHUNK, longest - off)
        xs, as_, bs = [], [], []
        for q, s0 in zip(requests, starts):
            x, a, b = tokens.get(q, s0 + off, s0 + off + n)
            xs.append(x), as_.append(a), bs.append(b)
        x = torch.from_numpy(np.stack(xs, 1)).to(device=device, dtype=F64).permute(2, 1, 0, 3)  # [L,R,n,C]
        a = torch.from_numpy(np.stack(as_, 1)).to(device=device, dtype=F64).permute(2, 1, 0, 3)
        b = torch.from_numpy(np.stack(bs, 1)).to(device=device, dtype=F64).permute(2, 1, 0, 3)
        take = torch.tensor([max(0, min(n, e - s - off)) for s, e in zip(starts, ends)], device=device)
        q, k, v, decay, beta = _inputs(cfg, prm, window, x, a, b)
        kernels.gdn_decode(state, rows, q, k, v, decay, beta, take, compute_dtype=F64)
        window = _advance_window(window, x, take)
    return state, window


def _advance_window(window: torch.Tensor, x: torch.Tensor, take: torch.Tensor) -> torch.Tensor:
    """The last Kc-1 inputs after appending the first ``take[r]`` tokens of ``x`` to row r."""
    Km1 = window.shape[2]
    seq = torch.cat([window, x.to(window.dtype)], dim=2)  # [L, R, Kc-1+n, C]
    idx = take.to(torch.int64)[:, None] + torch.arange(Km1, device=window.device)[None, :]  # [R, Kc-1]
    return seq[:, torch.arange(seq.shape[1], device=window.device)[:, None], idx]


def window_positions(accept: np.ndarray, track: np.ndarray, D: int, Km1: int) -> tuple[np.ndarray, np.ndarray]:
    """Where each row's conv windows of a batch of ``n`` steps sit in its token sequence (its window
    before the batch, positions 0 .. Km1-1, then token t of step j at Km1 + j D + t): ``seq_pos [n + 1,
    R, Km1]``, the window before each step and after the last (the last Km1 accepted tokens), and
    ``track_pos [n, R, Km1]``, the window after token ``track[j, r]`` of step j (-1: the window before
    the step). accept, track: host int64 ``[n, R]``."""
    n, R = accept.shape
    seq_pos = np.empty((n + 1, R, Km1), np.int64)
    offsets = np.arange(Km1)
    for r in range(R):
        taken = np.arange(D)[None, :] < accept[:, r, None]  # [n, D]: the accepted tokens, in order
        pos = np.concatenate([offsets, Km1 + np.flatnonzero(taken)])
        start = np.concatenate([[0], np.cumsum(accept[:, r])])
        seq_pos[:, r] = pos[start[:, None] + offsets]
    # The window after token t of step j: the last Km1 of its window before the step and the step's
    # tokens 0 .. t, i.e. entries t + 1 .. t + Km1 of that window followed by all D of them.
    ahead = Km1 + np.arange(n)[:, None, None] * D + np.arange(D)[None, None, :]  # [n, 1, D]
    ext = np.concatenate([seq_pos[:n], np.broadcast_to(ahead, (n, R, D))], axis=2)  # [n, R, Km1 + D]
    track_pos = np.take_along_axis(ext, track[:, :, None] + 1 + offsets, axis=2)
    return seq_pos, track_pos


class Float64Twin:
    """Exact committed states, tracked states, conv windows and outputs of the active rows.

    After :meth:`advance`: ``state [L, R, HV, V, K]`` and ``window [L, R, Kc-1, C]`` at each
    row's new position; ``track_state`` / ``track_window`` at its track boundary (rows
    tracked this step); ``out [L, R, D, HV, V]`` (first accept_len tokens meaningful);
    ``decay``, ``beta`` ``[L, R, D, HV]`` and ``q_sq`` (``q^2``, ``[L, R, D, HV, K]``) of the step's tokens.
    """

    def __init__(self, cfg: Config, params: StreamParams, device: torch.device,
                 state: torch.Tensor, window: torch.Tensor):
        self.cfg = cfg
        self.device = device
        self.params = params.to(device)
        self.state = state.to(device=device, dtype=F64).clone()
        self.window = window.to(device=device, dtype=F64).clone()
        self.track_state = torch.zeros_like(self.state)
        self.track_window = torch.zeros_like(self.window)
        self.mark_state = torch.zeros_like(self.state)  # state at a marked position (golden checkpoints)
        self.mark_window = torch.zeros_like(self.window)
        self.out = self.decay = self.beta = self.q_sq = None
        self.norm2 = torch.zeros(cfg.num_layers, cfg.num_requests, cfg.num_draft_tokens, cfg.num_v_heads,
                                 dtype=F64, device=device)  # ||h||^2 after each token of the step
        self._rows = torch.arange(cfg.num_requests, device=device)

    def reset_lanes(self, lanes: np.ndarray, state: torch.Tensor, window: torch.Tensor) -> None:
        """Lanes ``lanes [n]`` start a new request (or resume one) here: its true state ``[L, n, HV, V,
        K]`` and its last Kc-1 true inputs ``[L, n, Kc-1, C]`` (any float dtype; held in float64)."""
        idx = torch.from_numpy(np.asarray(lanes, np.int64)).to(self.device)
        self.state.index_copy_(1, idx, state.to(self.device, F64))
        self.window = self.window.index_copy(1, idx, window.to(self.device, F64))

    def advance(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accept: np.ndarray,
                track: np.ndarray, mark: np.ndarray | None = None) -> None:
        """One decode step. x ``[L, R, D, C]``, a, b ``[L, R, D, HV]`` (active rows); accept,
        track host int arrays ``[R]`` (track = -1 when the row is not tracked); ``mark``
        (optional, same form) selects a second draft step to capture into mark_state/window."""
        dev = self.device
        x, a, b = (t.to(device=dev, dtype=F64) for t in (x, a, b))
        q, k, v, self.decay, self.beta = _inputs(self.cfg, self.params, self.window, x, a, b)
        self.q_sq = q.square()  # [L, R, D, HV, K]
        take = torch.from_numpy(np.asarray(accept, np.int64)).to(dev)
        captures = [(track, self.track_state)] + ([(mark, self.mark_state)] if mark is not None else [])
        self.out = kernels.gdn_decode(self.state, self._rows, q, k, v, self.decay, self.beta, take,
                                      compute_dtype=F64, captures=captures, norms_out=self.norm2)
        for steps, attr in ((track, "track_window"), (mark, "mark_window")):
            if steps is not None and (np.asarray(steps) >= 0).any():
                tw = _advance_window(self.window, x, torch.from_numpy(np.maximum(steps, 0) + 1).to(dev))
                sel = torch.from_numpy(np.asarray(steps) >= 0).to(dev)[None, :, None, None]
                setattr(self, attr, torch.where(sel, tw, getattr(self, attr)))
        self.window = _advance_window(self.window, x, take)

    def advance_batch(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accept: np.ndarray,
                      track: np.ndarray, marks: list, on_step=None, keep_states: bool = False,
                      keep_deltas: bool = False) -> "TwinSteps":
        """``n`` decode steps at once: the same trajectory as ``n`` calls of :meth:`advance`, bit for
        bit, with the input stages (conv, gating, L2 norm: elementwise or per-row work) computed for
        all steps in one pass and only the recurrence stepped. x ``[n, L, R, D, C]``, a, b ``[n, L, R,
        D, HV]``; accept, track host ``[n, R]``; marks: n entries (None or a mark array). After
        each step the attributes are those :meth:`advance` leaves (``track_state`` /
        ``track_window`` valid for the rows tracked that step) and ``on_step(j)``, if given, is
        called. Returns every step's values stacked (:class:`TwinSteps`; committed states only
        with ``keep_states``, each token's delta and key only with ``keep_deltas``: then the
        recurrence runs on torch's path, which computes the deltas), in buffers the next call reuses.

        The window before step j is the last Kc-1 true tokens of the row: its window before the
        batch followed by the accepted tokens of steps 0 .. j-1, gathered by host-built indices;
        the window at a track boundary (after token t of step j) likewise."""
        dev, cfg = self.device, self.cfg
        n, L, R, D, C = x.shape
        Km1 = self.window.shape[2]
        x, a, b = (t.to(device=dev, dtype=F64) for t in (x, a, b))
        accept = np.asarray(accept, np.int64)
        # Token j * D + t of a row sits after the Km1 window tokens: index Km1 + j * D + t.
        seq_pos, track_pos = window_positions(accept, np.asarray(track, np.int64), D, Km1)
        tokens = torch.cat([self.window, x.permute(1, 2, 0, 3, 4).reshape(L, R, n * D, C)], dim=2)
        rows = torch.arange(R, device=dev)[None, :, None]
        windows = tokens[:, rows, torch.from_numpy(seq_pos).to(dev)]  # [L, n + 1, R, Km1, C]
        track_windows = tokens[:, rows, torch.from_numpy(track_pos).to(dev)].transpose(0, 1)  # [n, L, R, Km1, C]
        fold = lambda t: t.transpose(0, 1).reshape(L, n * R, *t.shape[3:])  # [n, L, R, ..] -> [L, n R, ..]
        q, k, v, decay, beta = _inputs(cfg, self.params, windows[:, :n].reshape(L, n * R, Km1, C), fold(x),
                                       fold(a), fold(b))
        unfold = lambda t: t.view(L, n, R, *t.shape[2:]).transpose(0, 1).contiguous()  # -> [n, L, R, ..]
        q, k, v, decay, beta = (unfold(t) for t in (q, k, v, decay, beta))
        buf = self._buffers(n, keep_states, keep_deltas)
        steps = TwinSteps(state=buf["state"][:n] if keep_states else None, window=windows[:, 1:].transpose(0, 1),
                          track_window=track_windows, decay=decay, beta=beta, q_sq=q.square(),
                          norm2=buf["norm2"][:n], out=buf["out"][:n],
                          delta=buf["delta"][:n] if keep_deltas else None, key=k if keep_deltas else None)
        tracked = (np.asarray(track) >= 0).any(1)
        one_call = on_step is None and not keep_deltas and self._steps_native(
            steps, q, k, v, decay, beta, accept, track, marks, windows, x, keep_states)
        if one_call:  # the attributes the loop's last step leaves
            last = n - 1
            self.decay, self.beta, self.q_sq, self.norm2 = decay[last], beta[last], steps.q_sq[last], steps.norm2[last]
            self.out, self.track_window = steps.out[last], track_windows[last]
        for j in range(0 if one_call else n):  # step by step where the one call did not run
            self.decay, self.beta, self.q_sq, self.norm2 = decay[j], beta[j], steps.q_sq[j], steps.norm2[j]
            take = torch.from_numpy(accept[j]).to(dev)
            mark = marks[j]
            captures = ([(track[j], self.track_state)] if tracked[j] else []) + (
                [(mark, self.mark_state)] if mark is not None else [])
            out = kernels.gdn_decode(self.state, self._rows, q[j], k[j], v[j], decay[j], beta[j], take,
                                     compute_dtype=F64, captures=captures, norms_out=self.norm2,
                                     deltas_out=steps.delta[j] if keep_deltas else None)
            self.out = steps.out[j]
            self.out.copy_(out)
            if keep_states:
                steps.state[j].copy_(self.state)
            if tracked[j]:
                rows_j = torch.from_numpy(np.nonzero(np.asarray(track[j]) >= 0)[0]).to(dev)
                steps.tracked[j] = (rows_j, self.track_state.index_select(1, rows_j))
            self.track_window = track_windows[j]
            if mark is not None and (np.asarray(mark) >= 0).any():
                self._keep_mark(steps, j, np.asarray(mark), windows, x)
            self.window = windows[:, j + 1]
            if on_step is not None:
                on_step(j)
        self.window = windows[:, n].clone()
        self.track_window = self.track_window.clone()
        return steps

    def _steps_native(self, steps: "TwinSteps", q, k, v, decay, beta, accept: np.ndarray, track: np.ndarray,
                      marks: list, windows: torch.Tensor, x: torch.Tensor, keep_states: bool) -> bool:
        """The batch's recurrence in one C call (:func:`kernels.gdn_decode_steps`: each state block runs
        all ``n`` steps while in cache), then each step's track captures and marks as the step-by-step
        loop of :meth:`advance_batch` leaves them, the same bits; False, nothing done, where the C kernel
        does not take it or its captures would exceed :data:`CAPTURE_BYTES`. Each capture lands in a buffer of
        its own, kept between batches."""
        n, track = q.shape[0], np.asarray(track)
        mark_rows = {j: np.asarray(m) for j, m in enumerate(marks) if m is not None and (np.asarray(m) >= 0).any()}
        wanted = [(j, track[j], "track") for j in range(n) if (track[j] >= 0).any()]
        wanted += [(j, m, "mark") for j, m in mark_rows.items()]
        if len(wanted) * self.state.numel() * self.state.element_size() > CAPTURE_BYTES:
            return False  # a large model's batch: step by step, the captures in the twin's own buffers
        caps = self._capture_buffers(len(wanted))
        captures = [(j, tok, caps[i]) for i, (j, tok, _) in enumerate(wanted)]
        if not kernels.gdn_decode_steps(self.state, q, k, v, decay, beta, torch.from_numpy(accept), steps.out,
                                        steps.norm2, steps.state if keep_states else None, captures):
            return False
        # Track and mark captures are independent; each kind is written back in step order, as the loop does.
        for (j, tok, kind), cap in zip(wanted, caps):
            rows = torch.from_numpy(np.nonzero(tok >= 0)[0]).to(self.device)
            picked = cap.index_select(1, rows)
            if kind == "track":
                self.track_state.index_copy_(1, rows, picked)
                steps.tracked[j] = (rows, picked)
            else:
                self.mark_state.index_copy_(1, rows, picked)
                self._keep_mark(steps, j, tok, windows, x)
        return True

    def _keep_mark(self, steps: "TwinSteps", j: int, mark: np.ndarray, windows: torch.Tensor,
                   x: torch.Tensor) -> None:
        """After step j's mark capture: each marked row's window at its mark (after token ``mark[r]``), and
        the step's ``(mark_state, mark_window)`` kept in ``steps.marks``."""
        dev = self.device
        tw = _advance_window(windows[:, j], x[j], torch.from_numpy(np.maximum(mark, 0) + 1).to(dev))
        sel = torch.from_numpy(mark >= 0).to(dev)[None, :, None, None]
        self.mark_window = torch.where(sel, tw, self.mark_window)
        steps.marks[j] = (self.mark_state.clone(), self.mark_window.clone())

    def _capture_buffers(self, count: int) -> torch.Tensor:
        """``[count, L, R, HV, V, K]`` float64 capture targets, kept between batches (grown as needed)."""
        have = getattr(self, "_caps", None)
        if have is None or have.shape[0] < count:
            have = self._caps = torch.empty(max(count, 1), *self.state.shape, dtype=F64, device=self.device)
        return have[:count]

    def _buffers(self, n: int, keep_states: bool, keep_deltas: bool = False) -> dict:
        """Per-step output buffers for ``n`` steps, kept between batches (fresh ones every batch
        cost page faults on every first write); what a batch returns is a view of them."""
        cfg, have = self.cfg, getattr(self, "_buf", {})
        if have.get("n", 0) < n or ("state" in have) < keep_states or ("delta" in have) < keep_deltas:
            L, R, D, HV = cfg.num_layers, cfg.num_requests, cfg.num_draft_tokens, cfg.num_v_heads
            have = {"n": n, "norm2": torch.empty(n, L, R, D, HV, dtype=F64, device=self.device),
                    "out": torch.empty(n, L, R, D, HV, cfg.head_v_dim, dtype=F64, device=self.device)}
            if keep_states:
                have["state"] = torch.empty(n, *self.state.shape, dtype=F64, device=self.device)
            if keep_deltas:
                have["delta"] = torch.empty(n, L, R, D, HV, cfg.head_v_dim, dtype=F64, device=self.device)
            self._buf = have
        return have


@dataclass
class TwinSteps:
    """The twin's values at each of the ``n`` steps of one :meth:`Float64Twin.advance_batch`, float64
    on its device: ``state`` (committed, ``[n, L, R, HV, V, K]``, or None), ``out [n, L, R, D, HV, V]``,
    ``window`` and ``track_window`` ``[n, L, R, Kc-1, C]`` (after the step; at each row's track
    boundary, meaningful where the row was tracked), ``decay``, ``beta``, ``norm2`` ``[n, L, R, D,
    HV]``, ``q_sq [n, L, R, D, HV, K]``; with ``keep_deltas``, each token's delta ``delta [n, L, R, D,
    HV, V]`` (``S <- a S + delta k^T``; zero past the accepted tokens) and normalised key ``key [n, L, R,
    D, HV, K]`` (a key head's repeated over its value heads), else None; ``tracked``: step -> (rows ``[m]``, their ``track_state``
    ``[L, m, HV, V, K]``) at the steps that tracked a row; ``marks``: step -> (``mark_state``,
    ``mark_window``) at the steps that had a mark."""

    state: Optional[torch.Tensor]
    window: torch.Tensor
    track_window: torch.Tensor
    decay: torch.Tensor
    beta: torch.Tensor
    q_sq: torch.Tensor
    norm2: torch.Tensor
    out: torch.Tensor
    delta: Optional[torch.Tensor] = None
    key: Optional[torch.Tensor] = None
    tracked: dict = field(default_factory=dict)
    marks: dict = field(default_factory=dict)
