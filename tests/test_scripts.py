"""scripts/speed_ratios.py, issue 29's ratios side by side: the commands it would run (``--dry-run``: each
pair alternated within every round, the base commit's run on its own tree, every flow against sglang), a
bad ``--only`` refused, and the verdict taken on the median of the rounds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from drift.flows.registry import FLOWS

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "speed_ratios.py"


def _script():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import speed_ratios
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return speed_ratios


def test_the_dry_run_alternates_each_pair_in_every_round():
    out = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--rounds", "2"], capture_output=True,
                         text=True, timeout=120, check=True).stdout.splitlines()
    others = [f for f in FLOWS if f != "sglang"]
    assert len(out) == 2 * 2 * (2 + len(others))  # rounds x (denominator, numerator) x pairs
    first = out[: len(out) // 2]
    assert [ln.split(": ", 1)[0] for ln in first[::2]] == [
        "round 1 gate / run@512", "round 1 run / base run", *(f"round 1 {f} / sglang" for f in others)]
    gate_den, gate_num, base, now = (ln.split(": ", 1)[1] for ln in first[:4])
    assert "drift run --steps 512" in gate_den and "pytest" in gate_num and "--drift-steps 512" in gate_num
    assert base.startswith("PYTHONPATH=") and "PYTHONPATH" not in now and "drift run --quiet" in now
    assert out[len(out) // 2:] == [ln.replace("round 1", "round 2", 1) for ln in first]


def test_an_unknown_ratio_is_refused_naming_the_choices():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--only", "gate,speed", "--dry-run"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "--only takes gate, run, flows (got speed)" in proc.stderr


@pytest.mark.parametrize("ratios, target, verdict", [
    ([1.2, 1.6, 1.25], 1.3, "median 1.250 (rounds 1.200-1.600, n=3); target <= 1.3: met"),
    ([1.2, 1.6, 1.35], 1.3, "median 1.350 (rounds 1.200-1.600, n=3); target <= 1.3: not met"),  # one round met is not enough
    ([0.48, 0.72, 0.55, 0.53], 0.5, "median 0.540 (rounds 0.480-0.720, n=4); target <= 0.5: not met"),
])
def test_the_verdict_is_the_medians(ratios, target, verdict):
    assert _script().summary("x", ratios, target) == f"x: {verdict}"
