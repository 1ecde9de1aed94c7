"""The nightly long-horizon matrix: ``pytest -m nightly -n auto``.

Excluded from the default PR run (pyproject addopts). Each entry runs the default nightly
horizon (100,000 decode steps of qwen3.5-397b-tp16; on a CPU cut to a few layers, as the
report states) through every check of ``drift run``.
"""

from __future__ import annotations

import pytest

from drift.jobs import nightly

pytestmark = pytest.mark.nightly

ENTRIES = nightly.build_matrix(nightly.DEFAULT_PRESETS, [0], nightly.DEFAULT_UPDATES, nightly.VARIANTS,
                               nightly.DEFAULT_STEPS, nightly.layers_for("cpu", "auto"))


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.key)
def test_long_horizon_entry(entry, tmp_path):
    result, _ = nightly.run_entry(entry, "cpu", tmp_path, nightly.DEFAULT_CHECKPOINT_EVERY)
    failed = [c for c in result["checks"] if c["failed"]]
    assert result["verdict"] == "pass", failed
