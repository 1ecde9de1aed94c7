"""The host-sync scan of an update under test: drift's pool on the virtual device (and on the
accelerator when there is one), a few representative decode steps, and the ``host syncs`` check.

The detector itself (:mod:`drift.syncs.detector`) needs nothing but torch; this module builds
the pool, the harness and the step indices the update is called with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from ..check.registry import CHECKS
from ..check.result import CheckResult
from ..config import Config
from ..devices import resolve_device
from ..errors import ENDS_PROCESS, DriftError, UpdateRaised, ended_by_code, what_raised
from ..flows.base import Harness
from ..flows.registry import state_flow
from ..openmp import run_threads
from ..runspec import Resolved
from ..sim.pool import StatePool
from ..sim.stream import InputStream
from .detector import VIRTUAL_DEVICE, SyncDetector, SyncEvent, SyncReport, VirtualTensor, npu_present, to_virtual

_HOST = torch.device("cpu")


def virtual_pool(cfg: Config, shape_only: bool = False) -> StatePool:
    """drift's :class:`StatePool` for ``cfg`` with every tensor on the virtual device
    (built on the CPU, then wrapped; views keep sharing storage). ``shape_only``: the
    floating-point states (temporal, intermediate_ssm, conv) hold no data, the integer slot
    tables stay real -- enough for an update whose control flow reads only indices."""
    return _virtual_flow(cfg, shape_only).pool


def _virtualise(obj, shape_only: bool) -> None:
    for name, value in list(vars(obj).items()):
        if isinstance(value, torch.Tensor):
            if shape_only and value.is_floating_point():
                value = value.to(VIRTUAL_DEVICE)  # keeps the strides of a transposed view
            setattr(obj, name, VirtualTensor(value))


def _virtual_flow(cfg: Config, shape_only: bool):
    flow = state_flow(cfg.replace(device="cpu"), _HOST)
    _virtualise(flow.pool, shape_only)
    flow.pool.device = VIRTUAL_DEVICE
    if getattr(type(flow.harness), "BUILT_FROM_POOL", False):  # only the pool's tensors: rebuilt over the virtual pool
        flow.harness = type(flow.harness)(flow.pool)
    else:  # a harness holding tensors of its own (the vllm flow's bookkeeping buffers)
        _virtualise(flow.harness, False)
    return flow


def virtual_harness(cfg: Config, shape_only: bool = False):
    """The ``self`` the update receives in ``cfg``'s state flow, over a :func:`virtual_pool`."""
    return _virtual_flow(cfg, shape_only).harness


def update_calls(cfg: Config, harness: Harness, last: torch.Tensor, trk: torch.Tensor,
                 wrap: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[tuple]:
    """The argument tuples of one update call per step, as the simulation passes them:
    ``(harness, last_steps [N], track_indices [N] | None, track_steps [N] | None)``;
    ``last`` / ``trk`` are int64 ``[steps, N]`` host tensors, ``wrap`` moves one onto the device."""
    track_on = cfg.track_interval > 0
    track_idx = harness._drift_pool.row_track_slots if track_on else None
    for i in range(last.shape[0]):
        yield harness, wrap(last[i]), track_idx, (wrap(trk[i]) if track_on else None)


def step_indices(cfg: Config, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``last_steps`` and ``track_steps`` (int64 CPU ``[count, N]``, -1 = none / padded row)
    of the first ``count`` decode steps of ``cfg``'s stream.

    They depend only on the seed, batch, acceptance and tracking fields, never on the model
    shapes, so the stream runs on a one-channel copy of the config (cheap at any size).
    """
    tiny = cfg.replace(num_layers=1, num_k_heads=1, num_v_heads=1, head_k_dim=1, head_v_dim=1,
                       decays=(0.5,), key_rank=0, device="cpu", trace="", trace_loop=False,
                       trace_sha256="", trace_tokens=0)
    chunk = InputStream(tiny, _HOST).chunk(count)
    return chunk.last_steps, chunk.track_steps


SCAN_STEPS = 1024  # steps searched for tracking and non-tracking ones (a track interval of up to ~1000 tokens)


def representative_steps(cfg: Config, steps: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """``steps`` decode steps alternating non-tracking and tracking ones (all non-tracking when
    tracking is off or no boundary is crossed within :data:`SCAN_STEPS`), with their indices.

    Returns (step numbers, last_steps ``[steps, N]``, track_steps ``[steps, N]``), int64 CPU.
    """
    if steps < 1:
        raise ValueError(f"steps={steps} is invalid; allowed: an integer >= 1")
    last, trk = step_indices(cfg, SCAN_STEPS)
    tracking = (trk >= 0).any(1).tolist()
    pools = ([s for s in range(SCAN_STEPS) if not tracking[s]], [s for s in range(SCAN_STEPS) if tracking[s]])
    chosen: list[int] = []
    for i in range(steps):
        want, other = pools[i % 2], pools[1 - i % 2]
        src = want if want else other
        if not src:
            break
        chosen.append(src.pop(0))
    chosen.sort()
    return chosen, last[chosen], trk[chosen]


# Real steps of the run's horizon that ``drift run`` (and the pytest gate) re-check under the
# detector beyond the representative ones; their cost is measured in the README.
RUN_SAMPLE = 12
SAMPLE_HORIZON = 65536  # sampled steps are drawn from at most this many steps of the run


def sampled_steps(cfg: Config, count: int, exclude: list[int]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """``count`` real decode steps of ``cfg``'s run, evenly spaced over its horizon
    (``cfg.steps``, at most :data:`SAMPLE_HORIZON`), none of ``exclude``: the steps the run will
    decode, with the accept lengths and track steps they will have. Same returns as
    :func:`representative_steps`."""
    horizon = max(1, min(int(cfg.steps), SAMPLE_HORIZON))
    if count < 1:
        return [], torch.zeros((0, cfg.num_rows), dtype=torch.int64), torch.zeros((0, cfg.num_rows), dtype=torch.int64)
    want = sorted({round(i * (horizon - 1) / max(count - 1, 1)) for i in range(count)} - set(exclude))
    last, trk = step_indices(cfg, want[-1] + 1 if want else 1)
    return want, last[want], trk[want]


@dataclass
class UpdateScan:
    """The syncs of an update over a few steps: one report per pass (``virtual``, and the
    config's device when it is an accelerator), events labelled ``step <n>``."""

    update: str
    steps: list[int]
    tracking: list[bool]
    padded_rows: int
    track_on: bool
    passes: dict[str, SyncReport]
    sampled: int = 0  # how many of ``steps`` were sampled over the run's horizon

    @property
    def events(self) -> list[SyncEvent]:
        return [e for rep in self.passes.values() for e in rep.events]

    def per_step(self, pass_name: str = "virtual") -> dict[int, list[SyncEvent]]:
        """Events of each step (every step present, possibly with no events)."""
        labels = self.passes[pass_name].by_label()
        return {s: labels.get(f"step {s}", []) for s in self.steps}


def _device_pass(cfg: Config, device: Optional[str]) -> Optional[str]:
    """The accelerator of the second pass: ``device`` as given ("none": no pass), or with
    "auto" the config's device when it is one, else the first accelerator present."""
    if device != "auto":
        return None if device in (None, "none", "cpu") else device
    if cfg.device != "cpu":
        return cfg.device
    if torch.cuda.is_available():
        return "cuda"
    return "npu" if npu_present() else None


def scan_update(run: Resolved, steps: int = 4, device: Optional[str] = "auto", sample: int = 0) -> UpdateScan:
    """Run the update of ``run`` for :func:`representative_steps` (and ``sample`` more
    :func:`sampled_steps` of the run's horizon) on the virtual device and, when there is an
    accelerator (:func:`_device_pass`), again on it with its sync debug mode armed; padded rows and
    tracking as configured (``track_interval = 0`` passes ``None`` as the simulation does). An update
    declaring ``DEVICE_ONLY`` (it launches an engine's device kernels, or holds an engine's device
    buffers, which take no virtual tensor: drift/plug/flashinfer_replayssm.py, drift/plug/vllm_engine.py)
    runs on the accelerator alone, and without one is not scanned (no pass). On the run's thread count
    (drift.openmp.run_threads): a matmul on more threads starts OpenMP's pool, whose idle threads keep a
    later run in this process from forking its comparison (drift.check.forked.fork_refusal)."""
    with run_threads(run.cfg):
        return _scan_update(run, steps, device, sample)


def _scan_update(run: Resolved, steps: int, device: Optional[str], sample: int) -> UpdateScan:
    cfg, upd = run.cfg, run.update
    chosen, last, trk = representative_steps(cfg, steps)
    more, last2, trk2 = sampled_steps(cfg, sample, chosen)
    if more:
        order = sorted(range(len(chosen) + len(more)), key=lambda i: (chosen + more)[i])
        chosen = [(chosen + more)[i] for i in order]
        last, trk = torch.cat([last, last2])[order], torch.cat([trk, trk2])[order]
    passes: dict[str, SyncReport] = {}
    targets: list[tuple[str, Optional[torch.device]]] = [("virtual", None)]
    accel = _device_pass(cfg, device)
    device_only = getattr(upd.fn, "DEVICE_ONLY", False)  # device kernels or buffers that take no virtual tensor
    if accel is not None:
        targets.append((accel, resolve_device(accel)))
    if device_only:
        targets = targets[1:]  # none without an accelerator: the scan has no pass (sync_check: n/a)
    for name, dev in targets:
        if dev is None:
            harness, wrap = virtual_harness(cfg), to_virtual
            det = SyncDetector(device_debug=False)  # CPU data: the debug modes would see nothing
        else:
            harness, wrap = state_flow(cfg.replace(device=name), dev).harness, (lambda t, d=dev: t.to(d))
            det = SyncDetector(device_debug=True)
        for s, call in zip(chosen, update_calls(cfg, harness, last, trk, wrap)):
            det.label = f"step {s}"
            try:
                det.run(upd, *call)
            except DriftError:  # drift could not run it (HarnessLacks): exit 2
                raise
            except (Exception, *ENDS_PROCESS) as exc:  # the code under test raised: a failed run, as in the simulation
                if not isinstance(exc, Exception) and not ended_by_code(exc):
                    raise  # a signal
                raise UpdateRaised(f"the update under test ({upd.spec}) raised {what_raised(exc)} at decode step "
                                   f"{s} (in the host-sync scan, {name} pass)") from exc
        passes[name] = det.report
    tracking = [bool(x) for x in (trk >= 0).any(1).tolist()]
    return UpdateScan(upd.name, chosen, tracking, cfg.num_padded, cfg.track_interval > 0, passes, len(more))


NOT_SCANNED = ("not scanned: the update {spec} runs an engine's objects on real device buffers (DEVICE_ONLY), "
               "which the virtual device cannot hold, and this machine has no accelerator; run on one "
               "(--device cuda, or --drift-device cuda) to scan it")


def sync_check(run: Resolved, steps: int = 4, device: Optional[str] = "auto", sample: int = 0) -> CheckResult:
    """The "host syncs" check of ``drift run``: passed iff the update of ``run`` causes no host-device
    sync in :func:`scan_update`'s steps (virtual device, plus the accelerator pass when there
    is one): ``steps`` representative ones and ``sample`` real steps spread over the run.
    worst: syncs per step (the worst pass); limit 0; where: the first sync's op and
    ``file:line``; extra: steps checked, syncs per pass, detectors, the first events."""
    cfg = run.cfg
    scan = scan_update(run, steps, device, sample)
    if not scan.passes:  # a DEVICE_ONLY update on a machine without an accelerator: nothing was scanned
        return CheckResult(CHECKS.title("host_syncs"), passed=True, worst=None, limit=0.0, where="",
                           detail=NOT_SCANNED.format(spec=run.update.spec), key="host_syncs",
                           extra={"applicable": False, "syncs": 0, "steps_checked": 0})
    n = len(scan.steps)
    per_step = max((len(r.events) / n for r in scan.passes.values()), default=0.0) if n else math.nan
    detectors = sorted({d for r in scan.passes.values() for d in r.detectors})
    n_track = sum(scan.tracking)
    drawn = (f"; {n - scan.sampled} representative + {scan.sampled} sampled over steps 0-"
             f"{max(1, min(int(cfg.steps), SAMPLE_HORIZON)) - 1}" if scan.sampled else "")
    what = (f"{n} steps ({n_track} tracking, {n - n_track} not{'' if scan.track_on else ', tracking off'}{drawn}; "
            f"{scan.padded_rows} padded row(s); passes: {', '.join(scan.passes)}; detectors: {', '.join(detectors)})")
    events = scan.events
    extra = {"syncs": len(events), "steps_checked": n, "sampled": scan.sampled, "syncs_by_pass": {k: len(r.events) for k, r in scan.passes.items()},
             "steps": scan.steps, "detectors": detectors,
             "events": [e.to_dict() for e in events[:10]]}
    if not events:
        return CheckResult(CHECKS.title("host_syncs"), passed=True, worst=0.0, limit=0.0, where="",
                           detail=f"no host-device sync in {what}", extra=extra, key="host_syncs")
    sites = list(dict.fromkeys(f"{e.op} at {e.where}" for e in events))
    detail = (f"{len(events)} syncs in {what}: " + "; ".join(sites[:4])
              + (f"; {len(sites) - 4} more sites" if len(sites) > 4 else "")
              + ". Keep the hot path device-side (torch.where, fixed-shape ops).")
    return CheckResult(CHECKS.title("host_syncs"), passed=False, worst=per_step, limit=0.0, where=events[0].describe(),
                       detail=detail, extra=extra, key="host_syncs")
