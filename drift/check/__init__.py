"""Comparison of a run with the truth: result type, metrics, golden data, the per-step
comparison observer, the checks, the drift bound, the sequential shadow."""
