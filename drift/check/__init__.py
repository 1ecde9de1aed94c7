"""Comparison of a run with the truth: result type, metrics, golden data, the per-step
comparison observer, the checks and their registry, the drift bound, the sequential shadow, the
run-level checks. Importing the package registers every built-in check (drift.check.registry)."""

from . import bounds, checks, lifecycle, runlevel, shadow  # noqa: F401  (each registers its checks)
