"""State flows: how an engine keeps MTP state from one verify step to the next (docs/semantics.md §6).

One package per flow kind, each owning its pool, harness, verify rule, built-in updates, naive
reference and validation (:class:`drift.flows.base.FlowKind` says what a kind provides), and
registering its kind, its flows and its updates (:mod:`drift.flows.registry`):

* ``copy_commit``: SGLang 0.5.23 -- a scratch per verify and a commit copy (``sglang``, ``npu-accepted``);
* ``in_place``: vLLM 0.33.0 -- blocks written in place, the accept count picks the next start (``vllm``);
* ``kernel_commit``: SGLang 0.5.23's ReplaySSM -- a ring of per-token records the commit folds
  (``sglang-replayssm``).
"""

from . import copy_commit, in_place, kernel_commit  # noqa: F401  (each registers its kind, flows and updates)
