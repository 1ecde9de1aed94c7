"""Teacher-forced input stream: the true tokens, the acceptance schedule, the verify windows.

Everything here is generated on the CPU from the config's seed (numpy PCG64,
counter-based: a block of positions or steps is a pure function of
``(seed, row, block)``), then moved to the device, so every device sees the same
inputs and any position can be produced without replaying the ones before it.

Invariant: the true trajectory of a request depends only on its true tokens,
never on the acceptance pattern. Accepted drafts *are* the true next tokens; a
rejected draft is a perturbed token whose state is computed and thrown away.
One golden trajectory therefore serves every acceptance pattern.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..config import Config

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
    positions ``p0 .. p1-1``; all values lie on the bfloat16 grid.
    """

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self._cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

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
        if len(self._cache) > 4 * max(1, cfg.num_requests):
            self._cache.pop(next(iter(self._cache)))  # oldest first: positions only grow
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


def accept_lengths(cfg: Config, step0: int, count: int) -> np.ndarray:
    """``accept_len`` (1..D) for steps ``step0 .. step0+count-1`` and every active row: int64 ``[count, R]``."""
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


# --------------------------------------------------------------------------- steps
def prefill_lengths(cfg: Config) -> list[int]:
    """Prompt length of each request: staggered by 3 so rows cross track boundaries apart."""
    return [cfg.prefill_len + 3 * r for r in range(cfg.num_requests)]


def max_position(cfg: Config, steps: int | None = None) -> int:
    """The furthest position any request can reach in ``steps`` decode steps (all accept D)."""
    return max(prefill_lengths(cfg)) + (cfg.steps if steps is None else steps) * cfg.num_draft_tokens


@dataclass
class StepChunk:
    """Inputs of ``count`` consecutive decode steps starting at ``step0``.

    Device tensors (all rows = active + padded, ``N``):
      x ``[S, L, N, D, C]`` bfloat16 (the verify windows), a, b ``[S, L, N, D, HV]`` float32,
      last_steps ``[S, N]`` int64 (accept_len - 1; -1 for padded rows),
      track_steps ``[S, N]`` int64 (-1 when not tracked).
    Host arrays (active rows ``R``): pre ``[S, R]`` seq_len before each step, accept ``[S, R]``.
    """

    step0: int
    count: int
    x: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    last_steps: torch.Tensor
    track_steps: torch.Tensor
    pre: np.ndarray
    accept: np.ndarray
    track_host: np.ndarray


class InputStream:
    """Iterates decode steps in device-resident chunks (one host-to-device copy per chunk)."""

    def __init__(self, cfg: Config, device: torch.device, chunk_bytes: int = 16 << 20):
        self.cfg = cfg
        self.device = device
        self.tokens = TrueTokens(cfg)
        self.params = StreamParams.generate(cfg)
        per_step = cfg.num_layers * cfg.num_rows * cfg.num_draft_tokens * (cfg.conv_channels * 2 + 8 * cfg.num_v_heads)
        self.chunk_steps = int(max(1, min(256, chunk_bytes // max(per_step, 1))))
        self.pos = np.array(prefill_lengths(cfg), dtype=np.int64)
        self.step = 0

    def prefill_len(self, row: int) -> int:
        return prefill_lengths(self.cfg)[row]

    def chunk(self, count: int) -> StepChunk:
        """The next ``count`` steps (advances the stream)."""
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
        dev = self.device
        out = StepChunk(
            step0=self.step, count=count,
            x=torch.from_numpy(x).view(torch.bfloat16).to(dev),
            a=torch.from_numpy(a).to(dev), b=torch.from_numpy(b).to(dev),
            last_steps=torch.from_numpy(last).to(dev), track_steps=torch.from_numpy(trk).to(dev),
            pre=pre, accept=acc, track_host=trk[:, :R],
        )
        self.pos = pre[-1] + acc[-1]
        self.step += count
        return out
