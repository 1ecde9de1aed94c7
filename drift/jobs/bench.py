"""``drift bench``: simulated MTP decode steps per second and effective bandwidth.

Two implementations of the same decode step are timed on one config, in its flow:

* **vectorised**: :class:`drift.simulate.Simulation` as ``drift run`` drives it, minus the
  checks (no observers, ``check_untouched=False``): input stream -> conv verify ->
  split/gating -> GDN verify of all layers -> the flow kind's default update (e.g.
  ``sglang-0.5.23``) through drift's portable kernels.
* **naive**: the same step as host loops (:func:`naive_step`): the flow kind's conv, verify rule
  and default update in loops (``drift/flows/<kind>/naive.py``), in the simulator's dtypes.

Effective bandwidth is the minimal number of bytes a step must move
(:func:`min_bytes_per_step`, the kind's state traffic plus the inputs and outputs) times steps per
second, divided by the bandwidth of a large tensor copy measured in the same run (bytes read +
bytes written per second).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Callable, Optional

import torch

from ..config import Config
from ..errors import ConfigError
from ..flows.registry import FLOW_KINDS, FLOWS
from ..runspec import resolve
from ..sim import kernels, naive, native
from ..sim.stream import StepChunk
from ..simulate import Simulation, StageClock


def _kind(flow: str):
    return FLOW_KINDS[FLOWS[flow].kind]


def benchmarked_flows() -> tuple[str, ...]:
    """The flows drift bench times: those whose kind has a naive step (``naive_update``) to time against."""
    return tuple(f for f in FLOWS if _kind(f).naive_update is not None)


COPY_BYTES = 256 << 20  # copy-bandwidth buffer: 8x the 32 MiB L3 of the reference machine
COPY_REPEATS = 5
WARMUP_STEPS = 2
PROBE_STEPS = 3  # single steps timed per candidate thread count, to pick the count
STAGE_STEPS = 4  # steps per stage profile (the eager step, and drift run's checked step)
# The simulator's speed targets on the 2-core CPU CI box (docs/speed.md): the verdict compares
# the medians over the repeats with them.
TARGETS = {"bandwidth_ratio": 0.15, "speedup": 10.0}

VECTORISED = ("drift.simulate.Simulation, no observers, check_untouched=False, the flow kind's default update "
              "through drift's portable kernels (on the CPU: GDN verify by drift.sim.native's C kernel where "
              "the kind's rule fits it, row copies with host-read indices in the update kernels); "
              "one timed block = Simulation.run(steps), input-stream generation included")
NAIVE = ("drift.jobs.bench.naive_step: the flow kind's conv in loops (per layer, row, token and tap, "
         "float64 as the simulator's conv), the gating per element (Python floats), the kind's verify "
         "rule in loops (drift/flows/<kind>/naive.py: per layer, batch row, value head and token, "
         "float32, states stored as the kind stores them), then the kind's default update as "
         "per-request loops (its naive.update); one timed block = stream chunk of 1 step + naive_step")
COMMON_BYTES = ("read the D input tokens and the Kc-1 committed conv rows and write Kc-1 new ones in the "
                "conv dtype; read gating inputs a, b (float32) and write the D outputs (float32); plus per "
                "layer the conv weights, A_log and dt_bias (float32) once; padded rows and the rare "
                "tracking copies not counted")


def bytes_model(cfg: Config) -> str:
    """What :func:`min_bytes_per_step` counts for ``cfg``'s flow: its kind's state traffic, then the rest."""
    return f"{_kind(cfg.flow).STATE_BYTES}; {COMMON_BYTES}"


def min_bytes_per_step(cfg: Config) -> dict[str, int]:
    """The minimal bytes one decode step moves (:func:`bytes_model`), by part, plus ``total``."""
    R, L, D = cfg.num_requests, cfg.num_layers, cfg.num_draft_tokens
    HV, V, C, Kc = cfg.num_v_heads, cfg.head_v_dim, cfg.conv_channels, cfg.conv_kernel
    conv_b = cfg.torch_conv_dtype.itemsize
    f32 = 4
    parts = dict(_kind(cfg.flow).bench_state_bytes(cfg))
    parts.update({
        # The stream hands x over in bfloat16 (drift.sim.stream.StepChunk).
        "conv_inputs": R * L * (D * C * torch.bfloat16.itemsize + 2 * (Kc - 1) * C * conv_b),
        "gating_inputs": R * L * 2 * D * HV * f32,
        "outputs": R * L * D * HV * V * f32,
        "params": L * (C * Kc + 2 * HV) * f32,
    })
    parts["total"] = sum(parts.values())
    return parts


def _sync(device: torch.device) -> None:
    """Wait for queued device work (a no-op on CPU) so wall-clock times are complete."""
    if device.type != "cpu":
        getattr(torch, device.type).synchronize()


def copy_bandwidths(device: torch.device, nbytes: int = COPY_BYTES, repeats: int = COPY_REPEATS) -> list[float]:
    """Bandwidth of each of ``repeats`` ``dst.copy_(src)`` on uint8 ``[nbytes]`` tensors, in bytes/s,
    counting ``2 * nbytes`` (read + write) per copy. Both buffers are written first, so no
    timed copy pays for first-touch page faults."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    return [2 * nbytes / _timed(device, lambda: dst.copy_(src)) for _ in range(repeats)]


def copy_bandwidth(device: torch.device, nbytes: int = COPY_BYTES, repeats: int = COPY_REPEATS) -> float:
    """The best of :func:`copy_bandwidths`."""
    return max(copy_bandwidths(device, nbytes, repeats))


def naive_step(sim: Simulation, chunk: StepChunk, s: int) -> torch.Tensor:
    """Step ``s`` of ``chunk`` on ``sim``'s pool as naive loops (:data:`NAIVE`), in ``sim``'s flow.

    Leaves the pool as the vectorised step would (committed, tracked and conv states, within
    float32 rounding of the verify arithmetic) but does not advance ``sim.step``. Returns
    float32 outputs ``[L, N, D, HV, V]``.
    """
    cfg, flow, prm = sim.cfg, sim.flow, sim.params
    L, N, D, HV = cfg.num_layers, cfg.num_rows, cfg.num_draft_tokens, cfg.num_v_heads
    f32 = torch.float32
    x, a_t, b_t, drafts = chunk.x[s], chunk.a[s], chunk.b[s], chunk.drafts[s]
    mix = flow.naive_conv(x, prm.conv_weight, drafts)  # float64 holding bf16 values [L, N, D, C]
    a, A_log, dt_bias = a_t.tolist(), prm.A_log.tolist(), prm.dt_bias.tolist()
    g = torch.tensor([[[[naive.gating(a[l][n][t][hd], A_log[l][hd], dt_bias[l][hd]) for hd in range(HV)]
                        for t in range(D)] for n in range(N)] for l in range(L)], dtype=f32, device=mix.device)
    args = flow.verify_args(mix.to(torch.bfloat16), b_t.to(torch.bfloat16), g, cfg.store_rounding, sim.step,
                            drafts, (a_t, prm.A_log, prm.dt_bias))

    def store(h: torch.Tensor) -> torch.Tensor:  # as the kind's scratch holds a state
        out = torch.empty(h.shape, dtype=sim.pool.intermediate_ssm.dtype, device=h.device)
        kernels.store_state(out, h, cfg.store_rounding, sim.step)
        return out

    out = flow.naive(args, f32, store)
    last = chunk.last_steps[s]
    flow.after_verify(last)
    tracking = cfg.track_interval > 0
    flow.naive_update(flow, last, sim.pool.row_track_slots if tracking else None,
                      chunk.track_steps[s] if tracking else None)
    return out


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"bench {name}={value!r} is invalid; allowed: an integer >= 1")


def bench(cfg: Config, layers: Optional[int] = None, steps: int = 20, naive_steps: int = 3,
          repeats: int = 5, copy_bytes: int = COPY_BYTES, threads: Optional[int] = None,
          stage_steps: int = STAGE_STEPS, progress: Optional[Callable[..., None]] = None) -> dict:
    """Time the vectorised and the naive step on ``cfg`` (first ``layers`` GDN layers).

    After a warm-up, per candidate CPU thread count (``threads``, or both 1 and torch's
    current count: on a shared machine intra-op threads can stall each other by whole
    scheduler slices): the copy bandwidth and a short probe of single steps. With the
    faster count: ``repeats`` blocks of ``steps`` vectorised steps, then ``naive_steps``
    naive blocks of one step each, the copies again, and (``stage_steps`` > 0) the stage
    profiles (:func:`stage_profile`). Every rate is the median over its blocks (one disturbed
    block does not move it), reported with its range; the copy bandwidth is the median of the
    copies with the same thread count (the same CPU resources), before and after the steps.
    Returns a JSON-ready dict with ``bandwidth_ratio = steps_per_s * min_bytes_per_step /
    (copy_bandwidth_GBps * 1e9)`` and the ``verdict`` on :data:`TARGETS`.
    ``progress(done, total, what)`` after each timed part (probe, block, naive step, profile).
    """
    if cfg.flow not in benchmarked_flows():
        raise ConfigError(f"drift bench times the flows whose kind has a naive step to time against; --flow "
                          f"{cfg.flow} has none yet: pass --flow {' or '.join(benchmarked_flows())}")
    for name, value in (("steps", steps), ("naive_steps", naive_steps), ("repeats", repeats),
                        ("copy_bytes", copy_bytes)):
        _positive(name, value)
    if threads is not None:
        _positive("threads", threads)
    if not isinstance(stage_steps, int) or isinstance(stage_steps, bool) or stage_steps < 0:
        raise ConfigError(f"bench stage_steps={stage_steps!r} is invalid; allowed: an integer >= 0 (0: no profile)")
    preset_layers = cfg.num_layers
    if layers is not None:
        _positive("layers", layers)
        cfg = cfg.replace(num_layers=layers)
    sim = Simulation(resolve(cfg), observers=(), check_untouched=False, graph=False)
    dev = sim.device
    # The captured step where the device has graphs (drift.sim.graph), timed in the same run.
    captured = Simulation(resolve(cfg), observers=(), check_untouched=False, graph=True)
    if captured._graph.api is None:
        captured = None
    start_threads = torch.get_num_threads()
    candidates = [threads] if threads is not None else sorted({1, start_threads})
    copies, probes = {}, {}
    profiles = {}
    parts = [0, 1 + len(candidates) + repeats * (2 if captured is not None else 1) + naive_steps
             + (1 if stage_steps else 0)]

    def tick(what: str, value):
        parts[0] += 1
        if progress is not None:
            progress(parts[0], parts[1], what)
        return value
    try:
        tick("warm-up", sim.run(steps=WARMUP_STEPS))
        for c in candidates:
            torch.set_num_threads(c)
            copies[c] = copy_bandwidths(dev, copy_bytes)
            # A stalling thread count is given up once it has taken a few times the best probe.
            budget = 3 * PROBE_STEPS * min(probes.values()) if probes else math.inf
            probes[c] = tick(f"probe, {c} thread(s)", _probe(sim, budget))
        chosen = min(candidates, key=lambda c: probes[c])
        torch.set_num_threads(chosen)
        blocks = [tick(f"block {i + 1}/{repeats}", _timed(dev, lambda: sim.run(steps=steps)) / steps)
                  for i in range(repeats)]
        graph_blocks = []
        if captured is not None:
            captured.run(steps=WARMUP_STEPS)  # warm-up, capture
            graph_blocks = [tick(f"captured block {i + 1}/{repeats}",
                                 _timed(dev, lambda: captured.run(steps=steps)) / steps) for i in range(repeats)]
        naive_blocks = [tick(f"naive step {i + 1}/{naive_steps}",
                             _timed(dev, lambda: naive_step(sim, sim.stream.chunk(1), 0)))
                        for i in range(naive_steps)]
        copy_all = copies[chosen] + copy_bandwidths(dev, copy_bytes)
        if stage_steps:
            profiles = tick("stage profile", stage_profile(cfg, stage_steps))
    finally:
        torch.set_num_threads(start_threads)
    nbytes = min_bytes_per_step(cfg)
    copy_bps = statistics.median(copy_all)
    eager = _rates(blocks)
    naive_r = _rates(naive_blocks)
    graph_r = _rates(graph_blocks) if graph_blocks else None
    best = graph_r if graph_r is not None and graph_r["median"] > eager["median"] else eager
    sps, naive_sps = best["median"], naive_r["median"]
    ratio_range = [r * nbytes["total"] / copy_bps for r in best["range"]]
    verdict = {
        "bandwidth_ratio": _target(sps * nbytes["total"] / copy_bps, ratio_range, TARGETS["bandwidth_ratio"]),
        "speedup": _target(sps / naive_sps, [best["range"][0] / naive_r["range"][1], best["range"][1] / naive_r["range"][0]],
                           TARGETS["speedup"]),
    }
    verdict["met"] = all(v["met"] for v in verdict.values())
    graph_note = captured.graph_status.note if captured is not None else sim.graph_status.note.replace(
        "eager: graph mode off (--no-graph)", f"{dev.type} has no device graph")
    return {
        "preset": cfg.name,
        "flow": cfg.flow,
        "update": sim.update.name,
        "layers": cfg.num_layers,
        "preset_layers": preset_layers,
        "device": str(dev),
        "verify_kernel": sim.verify_description(),
        "native_kernel": native.status() if dev.type == "cpu" else "not used off the CPU",
        "torch_threads": chosen,
        "probe_steps_per_s_by_threads": {str(c): 1.0 / t for c, t in probes.items()},
        "copy_bandwidth_GBps_by_threads": {str(c): statistics.median(b) / 1e9 for c, b in copies.items()},
        "load_avg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "ssm_dtype": cfg.ssm_dtype,
        "steps": steps,
        "repeats": repeats,
        "naive_steps": naive_steps,
        "statistic": "median over the repeats (range: slowest and fastest)",
        "steps_per_s": sps,
        "steps_per_s_range": best["range"],
        "eager_steps_per_s": eager["median"],
        "captured_steps_per_s": graph_r["median"] if graph_r else None,
        "graph": captured.graph_status.state if captured is not None else "unavailable",
        "graph_note": graph_note,
        "eager_bandwidth_ratio": eager["median"] * nbytes["total"] / copy_bps,
        "captured_bandwidth_ratio": graph_r["median"] * nbytes["total"] / copy_bps if graph_r else None,
        "steps_per_s_blocks": [1.0 / b for b in blocks],
        "captured_steps_per_s_blocks": [1.0 / b for b in graph_blocks],
        "naive_steps_per_s": naive_sps,
        "naive_steps_per_s_range": naive_r["range"],
        "speedup": sps / naive_sps,
        "min_bytes_per_step": nbytes["total"],
        "min_bytes_breakdown": {k: v for k, v in nbytes.items() if k != "total"},
        "copy_bandwidth_GBps": copy_bps / 1e9,
        "copy_bandwidth_GBps_range": [min(copy_all) / 1e9, max(copy_all) / 1e9],
        "copy_bytes": copy_bytes,
        "effective_bandwidth_GBps": sps * nbytes["total"] / 1e9,
        "bandwidth_ratio": sps * nbytes["total"] / copy_bps,
        "bandwidth_ratio_range": ratio_range,
        "naive_bandwidth_ratio": naive_sps * nbytes["total"] / copy_bps,
        "targets": dict(TARGETS),
        "verdict": verdict,
        "stage_profile": profiles,
        "vectorised": VECTORISED,
        "naive": NAIVE,
        "bytes_model": bytes_model(cfg),
    }


def _rates(seconds_per_step: list[float]) -> dict:
    """Steps/s of timed blocks: the median and the range [slowest, fastest]."""
    rates = [1.0 / s for s in seconds_per_step]
    return {"median": statistics.median(rates), "range": [min(rates), max(rates)]}


def _target(median: float, spread: list[float], target: float) -> dict:
    return {"median": median, "range": spread, "target": target, "met": median >= target}


def stage_profile(cfg: Config, steps: int = STAGE_STEPS) -> dict:
    """Where a decode step's wall time goes, on ``cfg`` with the current thread count: per stage,
    milliseconds per step and the share of the step (:class:`drift.simulate.StageClock`), for

    * ``eager_step``: the step :func:`bench` times (no observers, no slot guard);
    * ``checked_step``: the step ``drift run`` pays (:class:`drift.runner.CheckedRun`: slot guard,
      the float64 twin, the state metrics and the checks), with ``observers`` split into the
      twin's recurrence (``float64 twin``) and the rest (``metrics and checks``), all on this thread
      (a run overlaps them with the next steps on a worker where it can: drift.check.pipeline).

    Each after a warm-up step (a checked run: the twin's prefill and the golden load happen
    before the profile). Where the checked step is captured in a device graph it is not split."""
    from ..runner import CheckedRun  # the checked step's assembly (drift run's)

    out = {}
    sim = Simulation(resolve(cfg), observers=(), check_untouched=False, graph=False)
    sim.run(steps=1)
    out["eager_step"] = _clocked(sim, steps, None)
    checked = CheckedRun(resolve(cfg))
    checked.comparison.pipelined = False  # the stages split in one thread (a worker's would overlap the step's)
    if checked.sim.graph_status.state != "eager":  # a replayed graph is one unit: nothing to split
        out["checked_step"] = {"note": f"not split: {checked.sim.graph_status.note}"}
        return out
    checked.run(1)
    out["checked_step"] = _clocked(checked.sim, steps, checked.comparison)
    return out


def _clocked(sim: Simulation, steps: int, comparison) -> dict:
    """Run ``steps`` more steps of ``sim`` (observers flushed once at the end) under a StageClock."""
    clock = StageClock(sim.device)
    twin_s = [0.0]
    if comparison is not None:
        twin = comparison.twin
        advance = twin.advance_batch

        def timed_advance(*args, **kwargs):
            *head, on_step = args
            inner = [0.0]

            def timed_on_step(j):  # the comparisons after each twin step: metrics, not twin
                t0 = clock._now()
                on_step(j)
                inner[0] += clock._now() - t0

            t0 = clock._now()
            out = advance(*head, timed_on_step if on_step is not None else None, **kwargs)
            twin_s[0] += clock._now() - t0 - inner[0]
            return out

        twin.advance_batch = timed_advance
    sim.clock = clock
    try:
        clock.start()
        done = 0
        while done < steps:
            done += sim.advance(min(steps - done, sim.stream.chunk_steps))
            for obs in sim.observers:
                obs.flush()
            clock.lap("observers: flush")
    finally:
        sim.clock = None
        if comparison is not None:
            del twin.advance_batch  # the class's method again
    secs = dict(clock.seconds)
    if comparison is not None:
        obs = secs.pop("observers: per step", 0.0) + secs.pop("observers: flush", 0.0)
        secs["float64 twin"] = twin_s[0]
        secs["metrics and checks"] = obs - twin_s[0]
    else:  # no observers: what is left is the step's bookkeeping (its view, counters)
        secs["other"] = secs.pop("observers: per step", 0.0) + secs.pop("observers: flush", 0.0)
    total = sum(secs.values())
    return {"steps": steps, "ms_per_step": 1e3 * total / steps,
            "stages": {k: {"ms_per_step": 1e3 * v / steps, "share": v / total if total > 0 else 0.0}
                       for k, v in sorted(secs.items(), key=lambda kv: -kv[1])}}


def _probe(sim: Simulation, budget: float) -> float:
    """Mean seconds of up to :data:`PROBE_STEPS` single steps; stops early once the steps
    together took more than ``budget`` seconds."""
    times = []
    while len(times) < PROBE_STEPS and sum(times) <= budget:
        times.append(_timed(sim.device, lambda: sim.run(steps=1)))
    return sum(times) / len(times)


def _timed(device: torch.device, fn) -> float:
    """Wall seconds of ``fn()``, device work included."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def format_bench(res: dict) -> str:
    """The :func:`bench` result as a short human-readable report."""
    mib = res["min_bytes_per_step"] / 2**20
    rng = lambda pair, f="{:.2f}": f"{f.format(pair[0])} .. {f.format(pair[1])}"  # noqa: E731
    v = res["verdict"]
    lines = [
        f"drift bench: {res['preset']}, flow {res['flow']} (update {res['update']}), {res['layers']} of "
        f"{res['preset_layers']} GDN layers, "
        f"{res['ssm_dtype']} states, {res['device']}, {res['torch_threads']} threads (probe steps/s "
        f"by threads: {_by_threads(res, 'probe_steps_per_s_by_threads')}), "
        f"load avg {res['load_avg_1min']:.2f}",
        f"  GDN verify: {res['verify_kernel']}; native kernel status: {res['native_kernel']}",
        f"  medians over the repeats, range slowest .. fastest in brackets",
        f"  vectorised  {res['eager_steps_per_s']:9.2f} steps/s   (eager; {res['repeats']} blocks of "
        f"{res['steps']} steps) = {res['eager_bandwidth_ratio']:.3f} of copy bandwidth",
        (f"  captured    {res['captured_steps_per_s']:9.2f} steps/s   (device graph replays; "
         f"{res['captured_steps_per_s'] / res['eager_steps_per_s']:.1f}x eager) = "
         f"{res['captured_bandwidth_ratio']:.3f} of copy bandwidth" if res.get("captured_steps_per_s")
         else f"  captured          n/a   ({res.get('graph_note', 'no device graph')})"),
        f"  naive       {res['naive_steps_per_s']:9.2f} steps/s   ({res['naive_steps']} single steps; "
        f"[{rng(res['naive_steps_per_s_range'])}])",
        f"  speedup     {res['speedup']:9.1f} x [{rng(v['speedup']['range'], '{:.1f}')}] (the faster of eager "
        f"and captured over naive; target {v['speedup']['target']:g})",
        f"  min bytes   {mib:9.1f} MiB/step",
        f"  effective   {res['effective_bandwidth_GBps']:9.2f} GB/s = {res['bandwidth_ratio']:.3f} "
        f"[{rng(res['bandwidth_ratio_range'], '{:.3f}')}] of copy bandwidth {res['copy_bandwidth_GBps']:.1f} GB/s "
        f"[{rng(res['copy_bandwidth_GBps_range'], '{:.1f}')}] (read + write, {res['copy_bytes'] >> 20} MiB tensor "
        f"copy, {res['torch_threads']} threads; by threads: {_by_threads(res, 'copy_bandwidth_GBps_by_threads')} "
        f"GB/s; target {v['bandwidth_ratio']['target']:g})",
        f"  naive       {res['naive_bandwidth_ratio']:.5f} of copy bandwidth",
        f"  verdict     {'targets met' if v['met'] else 'below target: ' + ', '.join(k for k in TARGETS if not v[k]['met'])}"
        " (medians)",
    ]
    for name, prof in res.get("stage_profile", {}).items():
        if "stages" not in prof:
            lines.append(f"  {name}: {prof.get('note', '')}")
            continue
        parts = ", ".join(f"{k} {s['share']:.0%}" for k, s in prof["stages"].items())
        lines.append(f"  {name.replace('_', ' ')} ({prof['ms_per_step']:.1f} ms over {prof['steps']} steps): {parts}")
    lines += [
        "",
        f"vectorised: {res['vectorised']}",
        f"naive: {res['naive']}",
        f"min bytes: {res['bytes_model']}",
    ]
    return "\n".join(lines)


def _by_threads(res: dict, field: str) -> str:
    return ", ".join(f"{c}: {v:.1f}" for c, v in res[field].items())
