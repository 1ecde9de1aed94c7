#!/usr/bin/env python3
"""Regenerate golden trajectories (deliberately; review the printed diff before committing).

    python scripts/regen_golden.py                      # all PR-gating presets
    python scripts/regen_golden.py --preset ci-small --force

Same as ``drift regen-golden``. Refuses to overwrite changed data without --force; writes
atomically; unchanged data leaves every file untouched.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drift.golden import regen_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(regen_main())
