"""pytest plugin for drift (registered through the ``pytest11`` entry point).

Options:
  --drift-force-regen   regenerate golden data a test asks for, then fail that test so
                        the change is reviewed (as pytest-regressions' --force-regen).
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("drift", "drift precision-drift suite")
    group.addoption("--drift-force-regen", action="store_true", default=False,
                    help="regenerate golden trajectories used by the tests (then fail them for review)")


@pytest.fixture
def drift_golden(request: pytest.FixtureRequest):
    """``drift_golden(cfg)`` -> the loaded :class:`drift.golden.Golden` for ``cfg``.

    Fails (never skips) when the golden is missing or broken. With --drift-force-regen it
    regenerates it first and fails the test, naming what changed.
    """
    from drift.golden import GOLDEN_PRESETS, load_golden, regenerate

    def get(cfg):
        if request.config.getoption("--drift-force-regen"):
            import io

            out = io.StringIO()
            regenerate([cfg.name], seed=cfg.seed, force=True, out=out)
            pytest.fail(f"--drift-force-regen: golden for {cfg.name} seed {cfg.seed} regenerated:\n"
                        f"{out.getvalue()}review the diff and re-run without --drift-force-regen")
        golden, note = load_golden(cfg)
        if golden is None:
            pytest.fail(f"no golden data for {cfg.name} seed {cfg.seed} ({note}); PR-gating presets "
                        f"{GOLDEN_PRESETS} must have it: python scripts/regen_golden.py --preset {cfg.name}")
        return golden

    return get
