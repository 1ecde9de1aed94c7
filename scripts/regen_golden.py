"""Regenerate golden trajectories deliberately (the same as ``drift regen-golden``).

    python scripts/regen_golden.py                      # all PR-gating presets
    python scripts/regen_golden.py --preset ci-small --force

Refuses to overwrite changed data without --force; writes the new file under a
content-addressed name, swaps the manifest atomically, prints a diff summary to review.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from drift.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["regen-golden", *sys.argv[1:]]))
