"""Request lifecycles: what happens to the batch between decode steps (``--lifecycle``).

* ``fixed``: one request per lane for the whole run, always in the same batch row, slot and blocks,
  plus ``num_padded`` padded rows: the batch drift ran before lifecycles existed, reproduced bit for
  bit (every earlier figure stays checkable).
* ``serving``: a serving engine's life (docs/semantics.md §12). Requests finish after a drawn number
  of decode steps and new ones take their lane; a new request starts from its prefill state or, at a
  stated rate, from a prefix-cache hit that restores the tracked snapshot of an earlier request
  sharing its prefix; a request is preempted and resumes at a stated rate; the batch is ordered as
  the engine orders it and padded to the engine's graph bucket, so its size and its padded rows
  change step by step.

A *lane* is drift's own index of a running request (the float64 twin, the measures and the checks
are per lane): lane ``r`` runs requests ``r, r + R, r + 2R, ...`` one after another (R =
``num_requests``, the most requests running at once). Lane 0's first request runs the whole horizon,
so every run keeps one request as long as the run (the long-horizon drift the gate is for). The
engine never sees lanes: it sees batch rows, slots and blocks, which its own bookkeeping assigns.
Each lifecycle is one registry entry.
"""

from __future__ import annotations

from dataclasses import dataclass

from .registry import Registry


@dataclass(frozen=True)
class Lifecycle:
    """How requests come and go (module docstring). ``churn`` False is the fixed batch; the rest is
    read only when it is True.

    * request length: ``min_steps`` plus a geometric number of decode steps with mean
      ``mean_steps - min_steps`` (lane 0's first request: the whole horizon);
    * a lane stays idle ``0 .. idle_max`` steps (uniform) before its next request arrives;
    * ``prefix_hit_rate``: the share of new requests whose prompt is the prefix an earlier, finished
      request tracked last (its last prefix-cache snapshot), restored from the cache instead of
      prefilled; the cache keeps the snapshots of the last ``prefix_cache`` finished requests;
    * ``preempt_rate``: the share of requests preempted once, after a uniformly drawn share of their
      steps, resuming ``preempt_idle`` steps later from a fresh prefill of everything they hold;
    * ``buckets``: the graph batch sizes the batch is padded up to (the smallest one that holds the
      running requests).
    """

    name: str
    description: str
    churn: bool
    mean_steps: int = 0
    min_steps: int = 0
    idle_max: int = 0
    prefix_hit_rate: float = 0.0
    prefix_cache: int = 0
    preempt_rate: float = 0.0
    preempt_idle: int = 0
    buckets: tuple[int, ...] = ()

    def graph_bucket(self, live: int) -> int:
        """The graph batch size a batch of ``live`` running requests is padded to."""
        for b in self.buckets:
            if b >= live:
                return b
        raise ValueError(f"no graph bucket holds {live} requests (buckets {list(self.buckets)})")


LIFECYCLES: Registry[Lifecycle] = Registry("lifecycle")
LIFECYCLES.register("fixed", Lifecycle(
    "fixed", "one request per lane for the whole run, in fixed rows, slots and blocks, plus the preset's padded "
    "rows (the batch of drift before lifecycles)", churn=False))
# Graph batch sizes: the small end both engines capture by default -- SGLang 0.5.23
# srt/model_executor/cuda_graph_runner.py: get_batch_sizes_to_capture ([1, 2, 4, 8, 12, 16, ...]; the NPU
# graph runner subclasses it) and vLLM 0.33.0 vllm/config/compilation.py (cudagraph_capture_sizes
# [1, 2, 4] + range(8, ..., 8)): both hold 1, 2, 4, 8 (docs/semantics.md §12).
LIFECYCLES.register("serving", Lifecycle(
    "serving", "requests finish and arrive (lane 0's first request runs the whole horizon), new ones start "
    "from prefill or a prefix-cache hit, some are preempted and resume, the batch is ordered as the engine "
    "orders it and padded to its graph bucket", churn=True, mean_steps=128, min_steps=16, idle_max=32,
    prefix_hit_rate=0.5, prefix_cache=4, preempt_rate=0.15, preempt_idle=3, buckets=(1, 2, 4, 8, 12, 16, 24, 32)))

DEFAULT_LIFECYCLE = "serving"  # what drift run, the gate and the nightly run unless told otherwise
