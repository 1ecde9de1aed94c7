"""Drift metrics: relative and ULP errors, log-binned drift curves, growth exponents.

All host-side numpy on :class:`~drift.check.compare.MetricsChunk` arrays ``[S, L, R, HV]``.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ..checkpoint import Stateful

# Relative errors divide by max(||ref||_F, NORM_FLOOR_PER_SQRT_V * sqrt(V)): the norm of a
# rank-one update with a unit key and values of RMS 0.01, far below any real state
# (ci-small's smallest twin state norm is 0.75 with floor 0.08), so a state decaying
# toward zero cannot inflate the ratio.
NORM_FLOOR_PER_SQRT_V = 0.01
BINS_PER_OCTAVE = 4


def norm_floor(head_v_dim: int) -> float:
    return NORM_FLOOR_PER_SQRT_V * math.sqrt(head_v_dim)


def rel_err(err2: np.ndarray, ref2: np.ndarray, floor: float) -> np.ndarray:
    """Relative Frobenius error ``sqrt(err2) / max(sqrt(ref2), floor)``."""
    return np.sqrt(err2) / np.maximum(np.sqrt(ref2), floor)


def ulp_err(err2: np.ndarray, ulp2: np.ndarray) -> np.ndarray:
    """Error in units of the bf16 ULP of the reference: ``||e||_F / ||ulp_bf16(ref)||_F``."""
    return np.sqrt(err2) / np.maximum(np.sqrt(ulp2), 1e-300)


def step_bin(steps: np.ndarray) -> np.ndarray:
    """Log-spaced bin of each step (BINS_PER_OCTAVE bins per doubling of the step count)."""
    return np.floor(np.log2(steps + 1.0) * BINS_PER_OCTAVE).astype(np.int64)


def bin_center(b: np.ndarray) -> np.ndarray:
    """Geometric centre (in steps) of log bins ``b``."""
    return 2.0 ** ((b + 0.5) / BINS_PER_OCTAVE) - 1.0


class DriftCurves(Stateful):
    """Downsampled drift curves per (layer, head): for each log bin of steps, the mean and the
    max over steps and rows of a set of named per-step series. Memory O(bins), not O(steps)."""

    _state = ("series", "nbins")

    def __init__(self, shape: tuple[int, int]):
        self.shape = shape  # (L, HV)
        self.series: dict[str, dict[str, np.ndarray]] = {}
        self.nbins = 0

    def _grow(self, nbins: int) -> None:
        if nbins <= self.nbins:
            return
        for s in self.series.values():
            for k in ("sum", "max", "count"):
                old = s[k]
                new = np.zeros((nbins,) + old.shape[1:], old.dtype)
                if k == "max":
                    new[:] = -np.inf
                new[: old.shape[0]] = old
                s[k] = new
        self.nbins = nbins

    def add(self, name: str, steps: np.ndarray, values: np.ndarray) -> None:
        """values ``[S, L, R, HV]`` (NaN entries ignored): folded into bins of ``steps``."""
        b = step_bin(steps)
        self._grow(int(b.max()) + 1)
        if name not in self.series:
            L, H = self.shape
            self.series[name] = {"sum": np.zeros((self.nbins, L, H)), "count": np.zeros((self.nbins, L, H)),
                                 "max": np.full((self.nbins, L, H), -np.inf)}
        s = self.series[name]
        ok = np.isfinite(values)
        v = np.where(ok, values, 0.0)
        np.add.at(s["sum"], b, v.sum(2))
        np.add.at(s["count"], b, ok.sum(2))
        np.maximum.at(s["max"], b, np.where(ok, values, -np.inf).max(2))

    def curve(self, name: str, stat: str = "mean") -> tuple[np.ndarray, np.ndarray]:
        """(bin centres in steps ``[B]``, values ``[B, L, HV]``) for bins that saw data."""
        s = self.series[name]
        seen = s["count"].sum((1, 2)) > 0
        vals = s["sum"] / np.maximum(s["count"], 1) if stat == "mean" else s["max"]
        return bin_center(np.arange(self.nbins))[seen], vals[seen]

    def to_dict(self) -> dict:
        out = {}
        for name in self.series:
            x, mean = self.curve(name, "mean")
            _, mx = self.curve(name, "max")
            out[name] = {"step": [round(float(v), 2) for v in x],
                         "mean": np.round(mean, 9).tolist(), "max": np.round(np.where(np.isfinite(mx), mx, 0), 9).tolist()}
        return out


def growth_exponent(steps: np.ndarray, values: np.ndarray, start: float) -> Optional[float]:
    """Robust log-log slope (Theil-Sen, scipy) of ``values`` against ``steps`` for steps >= start.

    ~0 for a bounded error, 0.5 for a random walk, 1 for linear growth. None with fewer
    than 3 usable points. The definition; the checks use :func:`growth_exponents`.
    """
    from scipy.stats import theilslopes

    ok = (steps >= start) & np.isfinite(values) & (values > 0)
    if ok.sum() < 3:
        return None
    slope = theilslopes(np.log(values[ok]), np.log(steps[ok]))[0]
    return float(slope)


def growth_exponents(steps: np.ndarray, values: np.ndarray, start: float) -> np.ndarray:
    """:func:`growth_exponent` of every series at once, without scipy: ``steps`` ``[B]`` (distinct),
    ``values`` ``[B, ...]`` float64 -> ``[...]`` float64, NaN where fewer than 3 points are usable.

    The same numbers, bit for bit: the same pairwise slopes ``(log y_i - log y_j) / (log x_i - log
    x_j)`` over the pairs with ``x_i > x_j`` that scipy's ``theilslopes`` forms, and their median
    as ``np.median`` takes it (the middle one, or the mean of the middle two).
    """
    B, shape = len(steps), values.shape[1:]
    y = values.reshape(B, -1)  # [B, N]
    ok = (steps >= start)[:, None] & np.isfinite(y) & (y > 0)
    lx = np.log(np.where(steps > 0, steps, 1.0))
    ly = np.log(np.where(ok, y, 1.0))
    dx = lx[:, None] - lx[None, :]  # [B, B]
    pair = dx > 0
    use = pair[:, :, None] & ok[:, None, :] & ok[None, :, :]  # [B, B, N]
    slopes = np.where(use, (ly[:, None, :] - ly[None, :, :]) / np.where(pair, dx, 1.0)[:, :, None], np.nan)
    slopes = np.sort(slopes.reshape(B * B, -1), axis=0)  # NaN (pairs not used) sort last
    m = use.sum((0, 1))  # [N] slopes per series
    cols = np.arange(slopes.shape[1])
    hi, lo = slopes[m // 2, cols], slopes[np.maximum(m - 1, 0) // 2, cols]
    med = np.where(m % 2 == 1, hi, (lo + hi) / 2.0)
    return np.where(ok.sum(0) >= 3, med, np.nan).reshape(shape)
