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

import numpy as np
import torch

from . import kernels
from ..config import Config
from .stream import StreamParams, TrueTokens

F64 = torch.float64
PREFILL_CHUNK = 8  # prompt tokens per prefill recurrence call


def _inputs(cfg: Config, params: StreamParams, window: torch.Tensor, x: torch.Tensor,
            a: torch.Tensor, b: torch.Tensor):
    """q, k, v, decay, beta in float64 from the op's quantised inputs of true tokens x, a, b."""
    mix = kernels.conv_mix(window, x, params.conv_weight)
    g = kernels.gdn_gating(a, params.A_log, params.dt_bias)
    return kernels.op_inputs(mix, b.to(torch.bfloat16), g, cfg.num_k_heads, cfg.head_k_dim, cfg.num_v_heads,
                             cfg.head_v_dim, cfg.head_k_dim ** -0.5, F64)


def prefill(cfg: Config, tokens: TrueTokens, params: StreamParams, lengths: list[int],
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact state and conv window of every request after its prompt (float64).

    Returns states ``[L, R, HV, V, K]`` and windows ``[L, R, Kc-1, C]`` (the last Kc-1 inputs).
    """
    L, R, Kc = cfg.num_layers, cfg.num_requests, cfg.conv_kernel
    state = torch.zeros(L, R, cfg.num_v_heads, cfg.head_v_dim, cfg.head_k_dim, dtype=F64, device=device)
    window = torch.zeros(L, R, Kc - 1, cfg.conv_channels, dtype=F64, device=device)
    rows = torch.arange(R, device=device)
    prm = params.to(device)
    longest = max(lengths)
    for p0 in range(0, longest, PREFILL_CHUNK):
        n = min(PREFILL_CHUNK, longest - p0)
        xs, as_, bs = [], [], []
        for r in range(R):
            x, a, b = tokens.get(r, p0, p0 + n)
            xs.append(x), as_.append(a), bs.append(b)
        x = torch.from_numpy(np.stack(xs, 1)).to(device=device, dtype=F64).permute(2, 1, 0, 3)  # [L,R,n,C]
        a = torch.from_numpy(np.stack(as_, 1)).to(device=device, dtype=F64).permute(2, 1, 0, 3)
        b = torch.from_numpy(np.stack(bs, 1)).to(device=device, dtype=F64).permute(2, 1, 0, 3)
        take = torch.tensor([max(0, min(n, ln - p0)) for ln in lengths], device=device)
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
                      track: np.ndarray, marks: list, on_step) -> None:
        """``n`` decode steps at once: the same trajectory as ``n`` calls of :meth:`advance`, bit for
        bit, with the input stages (conv, gating, L2 norm: elementwise or per-row work) computed for
        all steps in one pass and only the recurrence stepped. x ``[n, L, R, D, C]``, a, b ``[n, L, R,
        D, HV]``; accept, track host ``[n, R]``; marks: n entries (None or a mark array). After
        each step the attributes are those :meth:`advance` leaves and ``on_step(j)`` is called.

        The window before step j is the last Kc-1 true tokens of the row: its window before the
        batch followed by the accepted tokens of steps 0 .. j-1, gathered by host-built indices."""
        dev, cfg = self.device, self.cfg
        n, L, R, D, C = x.shape
        Km1 = self.window.shape[2]
        x, a, b = (t.to(device=dev, dtype=F64) for t in (x, a, b))
        accept = np.asarray(accept, np.int64)
        # Token j * D + t of a row sits after the Km1 window tokens: index Km1 + j * D + t.
        seq_pos = np.zeros((n + 1, R, Km1), np.int64)
        for r in range(R):
            pos = list(range(Km1)) + [Km1 + j * D + t for j in range(n) for t in range(int(accept[j, r]))]
            start = np.concatenate([[0], np.cumsum(accept[:, r])])
            for j in range(n + 1):
                seq_pos[j, r] = pos[start[j]:start[j] + Km1]
        tokens = torch.cat([self.window, x.permute(1, 2, 0, 3, 4).reshape(L, R, n * D, C)], dim=2)
        rows = torch.arange(R, device=dev)[None, :, None]
        windows = tokens[:, rows, torch.from_numpy(seq_pos).to(dev)]  # [L, n + 1, R, Km1, C]
        fold = lambda t: t.transpose(0, 1).reshape(L, n * R, *t.shape[3:])  # [n, L, R, ..] -> [L, n R, ..]
        q, k, v, decay, beta = _inputs(cfg, self.params, windows[:, :n].reshape(L, n * R, Km1, C), fold(x),
                                       fold(a), fold(b))
        unfold = lambda t: t.view(L, n, R, *t.shape[2:]).transpose(0, 1).contiguous()  # -> [n, L, R, ..]
        q, k, v, decay, beta = (unfold(t) for t in (q, k, v, decay, beta))
        for j in range(n):
            self.decay, self.beta = decay[j], beta[j]
            self.q_sq = q[j].square()
            take = torch.from_numpy(accept[j]).to(dev)
            mark = marks[j]
            captures = [(track[j], self.track_state)] + ([(mark, self.mark_state)] if mark is not None else [])
            self.out = kernels.gdn_decode(self.state, self._rows, q[j], k[j], v[j], decay[j], beta[j], take,
                                          compute_dtype=F64, captures=captures, norms_out=self.norm2)
            for steps, attr in ((track[j], "track_window"), (mark, "mark_window")):
                if steps is not None and (np.asarray(steps) >= 0).any():
                    tw = _advance_window(windows[:, j], x[j], torch.from_numpy(np.maximum(steps, 0) + 1).to(dev))
                    sel = torch.from_numpy(np.asarray(steps) >= 0).to(dev)[None, :, None, None]
                    setattr(self, attr, torch.where(sel, tw, getattr(self, attr)))
            self.window = windows[:, j + 1]
            on_step(j)
        self.window = windows[:, n].clone()
