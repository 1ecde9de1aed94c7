"""Cost model of the update under test (``drift bench-update``): per implementation and batch
size, what one decode step's update costs.

The trade-off the sglang #32130 review names: a guarded copy costs a host sync, an
unconditional copy costs bytes. Measured per step, averaged over the first ``steps``
decode steps of the preset's stream (its mix of tracking and non-tracking steps, with its
padded rows), by a :class:`~drift.syncs.detector.SyncDetector` on the virtual device:

- ``ops_per_step``: aten ops dispatched by the update (views included; ``view_ops_per_step``
  counts the views alone, which move no data);
- ``bytes_per_step``: :data:`BYTES_MODEL` -- from shapes, not a measurement of traffic;
- ``syncs_per_step``: host-device syncs (:mod:`drift.syncs.detector`);
- ``latency_us``: on CUDA or NPU only (``device`` set in the config), the median device time
  of one update call between two timing events on the current stream; ``None`` on the CPU.

The state tensors are shape-only by default (``shape_only=True``): the counts depend on
shapes and on the index tensors, which stay real, so 256-row batches cost no compute here.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Sequence

import torch

from ..config import Config
from ..devices import resolve_device
from ..flows.registry import state_flow
from ..plug.loader import Update
from ..openmp import run_threads
from ..runspec import Resolved
from .detector import SyncDetector, to_virtual
from .scan import step_indices, update_calls, virtual_harness

BATCH_SIZES: tuple[int, ...] = tuple(2 ** i for i in range(9))  # 1 .. 256 active requests
DEFAULT_STEPS = 16
BYTES_MODEL = ("from shapes, per non-view dispatched op: an indexed read (index, index_select, gather) "
               "moves 2 x the bytes it gathers plus its indices; an indexed write (index_put, index_copy, "
               "scatter) 2 x the bytes of its values plus its indices; any other op its input bytes plus "
               "its new output bytes (numel x element size)")
LATENCY_WARMUP = 2  # untimed calls before timing on a device (first-call allocation and launch setup)


@dataclass
class CostRow:
    """One (implementation, batch size) measurement; ``rows`` = requests + padded rows."""

    update: str
    requests: int
    rows: int
    steps: int
    tracking_steps: int
    ops_per_step: float
    view_ops_per_step: float
    bytes_per_step: float
    syncs_per_step: float
    latency_us: Optional[float]
    latency_device: Optional[str]

    def to_dict(self) -> dict:
        return {**asdict(self), "bytes_model": BYTES_MODEL}


def _latency_us(cfg: Config, upd: Update, last: torch.Tensor, trk: torch.Tensor) -> tuple[float, str]:
    """Median device time (µs) of one update call on ``cfg.device`` (cuda or npu), timed with
    device events; inputs are moved to the device before timing starts."""
    device = resolve_device(cfg.device)
    backend = getattr(torch, device.type)
    calls = list(update_calls(cfg, state_flow(cfg, device).harness, last, trk, lambda t: t.to(device)))
    for call in calls[:LATENCY_WARMUP]:
        upd(*call)
    times = []
    for call in calls:
        start, end = backend.Event(enable_timing=True), backend.Event(enable_timing=True)
        start.record()
        upd(*call)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)  # elapsed_time is in ms
    return statistics.median(times), str(device)


def measure(runs: Sequence[Resolved], batch_sizes: Sequence[int] = BATCH_SIZES,
            steps: int = DEFAULT_STEPS, shape_only: bool = True,
            progress: Optional[Callable[..., None]] = None) -> list[CostRow]:
    """One :class:`CostRow` per (resolved run, batch size): its config with ``num_requests`` = batch
    size (its padded rows kept), the first ``steps`` decode steps of its stream, its update;
    ``progress(done, total, what)`` after each row."""
    if steps < 1:
        raise ValueError(f"steps={steps} is invalid; allowed: an integer >= 1")
    if not batch_sizes or any(int(b) < 1 for b in batch_sizes):
        raise ValueError(f"batch sizes {list(batch_sizes)} are invalid; allowed: integers >= 1")
    out = []
    for batch in batch_sizes:
        for run in runs:
            upd = run.update
            c = run.cfg.replace(num_requests=int(batch))
            last, trk = step_indices(c, steps)
            n_track = int((trk >= 0).any(1).sum()) if c.track_interval > 0 else 0
            det = SyncDetector(device_debug=False)
            # one intra-op thread for a small run, as run_checked's: on two, the first op starts OpenMP's pool,
            # whose thread then keeps every later run of this process from forking (drift tradeoff's)
            with run_threads(c):
                for call in update_calls(c, virtual_harness(c, shape_only), last, trk, to_virtual):
                    det.run(upd, *call)
            rep = det.report
            latency, where = _latency_us(c, upd, last, trk) if c.device != "cpu" else (None, None)
            out.append(CostRow(upd.name, c.num_requests, c.num_rows, steps, n_track, rep.ops / steps,
                               rep.view_ops / steps, rep.bytes / steps, len(rep.events) / steps,
                               latency, where))
            if progress is not None:
                progress(len(out), len(batch_sizes) * len(runs), f"{upd.name}, batch {c.num_requests}")
    return out


def to_json(rows: Sequence[CostRow]) -> str:
    """The rows as a JSON list of objects (each with ``bytes_model``)."""
    return json.dumps([r.to_dict() for r in rows], indent=2)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_table(rows: Sequence[CostRow]) -> str:
    """A Markdown table of the rows, followed by the bytes model."""
    head = ("| update | requests | rows | steps (tracking) | ops/step | views/step | bytes/step | "
            "syncs/step | latency |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lat = f"{r.latency_us:.1f} µs ({r.latency_device})" if r.latency_us is not None else "n/a (cpu)"
        lines.append(f"| {r.update} | {r.requests} | {r.rows} | {r.steps} ({r.tracking_steps}) | "
                     f"{r.ops_per_step:.2f} | {r.view_ops_per_step:.2f} | {_bytes(r.bytes_per_step)} | "
                     f"{r.syncs_per_step:.2f} | {lat} |")
    lines += ["", f"bytes/step: {BYTES_MODEL}."]
    return "\n".join(lines)
