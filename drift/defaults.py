"""Names and defaults the command line shows, in a leaf module that imports nothing heavy, so
``drift --help`` and ``drift --version`` answer without importing torch.

Each is defined here once and re-exported by the module that uses it (tests/test_cli.py checks
the name lists against the catalogues they name).
"""

from __future__ import annotations

# drift.plug.updates.BUILTINS, in that order; the default update under test.
BUILTIN_UPDATES = ("sglang-31659", "sglang-32130", "sglang-0.5.23")
DEFAULT_UPDATE = "sglang-0.5.23"
# Built-in verify kernel specs -> what they load (drift.plug.loader.load_kernel).
KERNELS = {
    "portable": "drift's own op (drift.sim.kernels.recurrent_gated_delta_rule)",
    "npu": "torch.ops.npu.recurrent_gated_delta_rule from sgl_kernel_npu, called as SGLang 0.5.23 calls it",
    "npu-legacy": "torch_npu.npu_recurrent_gated_delta_rule (the older public op)",
    "sglang-triton": "SGLang 0.5.23's Triton fused_recurrent_gated_delta_rule_update (CUDA)",
}
# drift.plug.mutants.MUTANTS, in catalogue order.
MUTANT_NAMES = ("item_guard", "any_branch", "mask_slots", "tolist_steps", "nonzero_rows", "step_plus1",
                "step_minus1", "skip_step0", "rollback_shift", "rollback_contiguous", "reshape_commit",
                "logical_commit", "truncate_store", "beta_bf16", "round_every_token", "padded_alias_row0")
# Decode steps of drift tradeoff / drift mutants: every mutant is caught well within it (measured
# 16/16 at 512 steps; the test suite's nightly twin runs the catalogue at 1,024, docs/bounds.md).
TEETH_STEPS = 512
GOLDEN_PRESETS = ("ci-small", "stagnation")  # the PR-gating presets
# drift bench-update: active-request counts (1 .. 256) and decode steps averaged.
BATCH_SIZES: tuple[int, ...] = tuple(2 ** i for i in range(9))
COSTMODEL_STEPS = 16
TINY_ARCHS = ("qwen3_next", "qwen3_5")  # drift capture --model tiny
