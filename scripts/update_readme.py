#!/usr/bin/env python3
"""Regenerate the README's generated sections: the checks table (from drift's check registry), the
mutation score and the trade-off (from measurements).

    python scripts/update_readme.py

Runs ``drift mutants`` and ``drift tradeoff`` (ci-small, drift.jobs.teeth.TEETH_STEPS steps) and
replaces the text between ``<!-- drift:checks -->`` / ``<!-- drift:mutants -->`` /
``<!-- drift:tradeoff -->`` and their closing markers. tests/test_teeth.py fails when the README and the measurements disagree.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import drift.check  # noqa: E402,F401  (registers the checks)
from drift.check.registry import checks_markdown  # noqa: E402
from drift.config import preset  # noqa: E402
from drift.fileio import atomic_write_text  # noqa: E402
from drift.jobs.teeth import TEETH_STEPS, catalogue, mutants_markdown, tradeoff, tradeoff_markdown  # noqa: E402


def replace_section(text: str, name: str, body: str) -> str:
    start, end = f"<!-- drift:{name} -->", f"<!-- /drift:{name} -->"
    if start not in text or end not in text:
        raise SystemExit(f"README.md lacks the markers {start} ... {end}")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}\n{end}{tail}"


def main() -> int:
    import torch

    torch.set_num_threads(1)
    cfg = preset("ci-small", steps=TEETH_STEPS)
    readme = ROOT / "README.md"
    text = readme.read_text()
    text = replace_section(text, "checks", checks_markdown())
    text = replace_section(text, "mutants", mutants_markdown(catalogue(cfg), cfg))
    text = replace_section(text, "tradeoff", tradeoff_markdown(tradeoff(cfg), cfg))
    atomic_write_text(readme, text)
    print(f"updated {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
