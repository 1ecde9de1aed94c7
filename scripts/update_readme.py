#!/usr/bin/env python3
"""Regenerate what the documentation shows from the code and from measurements.

    python scripts/update_readme.py            # everything (the tables take minutes)
    python scripts/update_readme.py --help-only  # help texts, synopsis, checks table, design tables from their records (seconds)
    python scripts/update_readme.py --designs-only  # re-measure the design trade-off's 4,096-step column (minutes)
    python scripts/update_readme.py --design-nightly MERGED/report.json --machine "16-core x86_64, H200 host"
    python scripts/update_readme.py --help      # this text; an unknown option is refused (exit 2)

* drift/_help.py: every ``drift [CMD] --help`` text (drift/__main__.py answers --help from it
  without importing torch), from drift.cli's parser;
* the README's ``<!-- drift:synopsis -->`` block: every command's usage, from the same parser;
* the README's ``<!-- drift:checks -->`` block: the checks table, from drift's check registry;
* docs/teeth.md's ``<!-- drift:mutants -->`` / ``<!-- drift:tradeoff -->`` blocks: ``drift mutants``
  and ``drift tradeoff`` on ci-small at drift.jobs.teeth.TEETH_STEPS steps;
* docs/teeth.md's ``<!-- drift:designs -->`` block and the README's: the kernel-commit design
  trade-off, rendered from its records -- docs/design_tradeoff.json (``drift tradeoff --designs`` at
  4,096 steps, measured here) and docs/design_nightly.json (a merged ``drift nightly --design-table``
  report, summarised by ``--design-nightly MERGED/report.json --machine TEXT``);
* every duration, count and sample output of README.md and docs/reference.md (the
  ``<!-- drift:durations -->``, ``nightly-rate`` and ``sample-*`` blocks), from the record of
  measured runs, docs/measured.json (scripts/doc_runs.py). ``--measure [NAME ...]`` runs them first
  (all, or the named ones: minutes; run it on a machine doing nothing else, it loads the cores itself).

tests/test_cli.py (help, synopsis), tests/check/test_check_registry.py (checks) and tests/jobs/test_teeth.py
(mutation score, trade-off) fail when these are stale.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from drift.mkl import mkl_defaults  # noqa: E402

mkl_defaults()  # the figures it records are MKL's pinned path, as drift's command computes them (drift/mkl.py)

import drift.check  # noqa: E402,F401  (registers the checks)
from drift.check.registry import checks_markdown  # noqa: E402
from drift.cli import help_texts, synopsis_markdown  # noqa: E402
from drift.fileio import atomic_write_text  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
import doc_runs  # noqa: E402

HELP_MODULE = ROOT / "drift" / "_help.py"
README = ROOT / "README.md"
TEETH_DOC = ROOT / "docs" / "teeth.md"  # the mutation score and trade-off tables


def replace_section(text: str, name: str, body: str, where: Path = README) -> str:
    start, end = f"<!-- drift:{name} -->", f"<!-- /drift:{name} -->"
    if start not in text or end not in text:
        raise SystemExit(f"{where} lacks the markers {start} ... {end}")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}\n{end}{tail}"


def help_module() -> str:
    """drift/_help.py's text: the help of every command, keyed as drift.cli.help_texts keys it."""
    body = "".join(f"    {name!r}: {text!r},\n" for name, text in help_texts().items())
    return ('"""Every ``drift [CMD] --help`` text. Generated from drift.cli\'s parser by\n'
            'scripts/update_readme.py (tests/test_cli.py checks it is fresh): do not edit."""\n\n'
            f"HELP = {{\n{body}}}\n")


REFERENCE = ROOT / "docs" / "reference.md"


def measured_sections(readme: str, reference: str) -> tuple[str, str]:
    """README.md's and docs/reference.md's texts with their measured blocks rendered from the record."""
    record = doc_runs.load_record()
    readme = replace_section(readme, "durations", doc_runs.readme_table(record))
    readme = replace_section(readme, "nightly-rate", doc_runs.nightly_rate(record))
    for name in doc_runs.SAMPLED_IN_README:
        readme = replace_section(readme, f"sample-{name}", doc_runs.sample(name, record))
    return readme, replace_section(reference, "durations", doc_runs.reference_table(record), REFERENCE)


def _arg(argv: list[str], name: str) -> str:
    i = argv.index(name)
    if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
        raise SystemExit(f"{name} needs a value")
    return argv[i + 1]


def render_designs() -> None:
    """docs/teeth.md's and the README's design blocks from the committed records."""
    from drift.fileio import read_json
    from drift.jobs.teeth import DESIGN_NIGHTLY, DESIGN_RECORD, design_markdown, design_summary

    record = read_json(ROOT / DESIGN_RECORD, "design trade-off record", "run python scripts/update_readme.py --designs-only")
    nightly = read_json(ROOT / DESIGN_NIGHTLY, "design nightly summary", "restore it") if (ROOT / DESIGN_NIGHTLY).exists() \
        else None
    atomic_write_text(TEETH_DOC, replace_section(TEETH_DOC.read_text(), "designs", design_markdown(record, nightly),
                                                 TEETH_DOC))
    atomic_write_text(README, replace_section(README.read_text(), "designs", design_summary(record, nightly)))
    print(f"updated the design trade-off in {TEETH_DOC} and {README}")


def measure_designs() -> None:
    import datetime

    import torch

    from drift.config import preset
    from drift.fileio import atomic_write_json
    from drift.jobs.teeth import DESIGN_RECORD, DESIGN_STEPS, design_record, design_tradeoff

    torch.set_num_threads(1)
    cfg = preset("ci-small", steps=DESIGN_STEPS)
    atomic_write_json(ROOT / DESIGN_RECORD, design_record(design_tradeoff(cfg), cfg, datetime.date.today().isoformat()))


OPTIONS = ("--design-nightly", "--machine", "--date", "--designs-only", "--measure", "--help-only")


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:  # this docstring, never a run (the default run measures for minutes)
        print(__doc__)
        return 0
    unknown = [a for a in argv if a.startswith("-") and a not in OPTIONS]
    if unknown:
        print(f"update_readme.py: unknown option {unknown[0]}; the options are {', '.join(OPTIONS)} "
              "(--help says what each does)", file=sys.stderr)
        return 2
    if "--design-nightly" in argv:  # a merged nightly report of the design table, summarised and rendered
        import datetime

        from drift.fileio import atomic_write_json
        from drift.jobs.nightly import read_report
        from drift.jobs.teeth import DESIGN_NIGHTLY, nightly_summary

        report = read_report(Path(_arg(argv, "--design-nightly")))
        machine = _arg(argv, "--machine") if "--machine" in argv else "an unrecorded machine"
        when = _arg(argv, "--date") if "--date" in argv else datetime.date.today().isoformat()
        atomic_write_json(ROOT / DESIGN_NIGHTLY, nightly_summary(report, machine, when))
        render_designs()
        return 0
    if "--designs-only" in argv:
        measure_designs()
        render_designs()
        return 0
    if "--measure" in argv:
        names = [a for a in argv[argv.index("--measure") + 1:] if not a.startswith("--")]
        doc_runs.measure(names or None)
    atomic_write_text(HELP_MODULE, help_module())
    text = replace_section(README.read_text(), "synopsis", synopsis_markdown())
    text, reference = measured_sections(replace_section(text, "checks", checks_markdown()), REFERENCE.read_text())
    atomic_write_text(README, text)
    atomic_write_text(REFERENCE, reference)
    print(f"updated {HELP_MODULE}, the synopsis, the checks table and the measured blocks in {README}, "
          f"the durations in {REFERENCE}")
    if (ROOT / "docs" / "design_tradeoff.json").exists():
        render_designs()
    if "--help-only" in argv or "--measure" in argv:
        return 0
    import torch

    from drift.config import preset
    from drift.jobs.teeth import TEETH_STEPS, catalogue, mutants_markdown, tradeoff, tradeoff_markdown

    torch.set_num_threads(1)
    cfg = preset("ci-small", steps=TEETH_STEPS)
    text = TEETH_DOC.read_text()
    text = replace_section(text, "mutants", mutants_markdown(catalogue(cfg), cfg), TEETH_DOC)
    text = replace_section(text, "tradeoff", tradeoff_markdown(tradeoff(cfg), cfg), TEETH_DOC)
    atomic_write_text(TEETH_DOC, text)
    print(f"updated {TEETH_DOC}")
    measure_designs()
    render_designs()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
