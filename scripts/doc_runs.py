"""The runs behind every duration, count and sample output the documentation states.

``python scripts/update_readme.py --measure [NAME ...]`` runs the commands below (all, or the
named ones) on this machine, quiet and -- where a row says so -- again while two busy processes
hold both cores (the shared CI runner an engine's CI has), and records each one's wall time, exit
code, load average, date and the output lines a document quotes in ``docs/measured.json``. Then
(and on every plain ``update_readme.py``) the ``<!-- drift:durations -->`` blocks of README.md and
docs/reference.md and the README's sample outputs are rendered from that record.
tests/test_docs.py fails when a block differs from the record's rendering, when a sample output
is no longer what the code prints, when a duration is stated outside a generated block, and when
the recorded test count is not the suite's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "docs" / "measured.json"
PY = sys.executable


@dataclass(frozen=True)
class DocRun:
    """One documented command. ``argv`` runs from a scratch directory outside the checkout (as a
    user's CI does) unless ``in_checkout``; ``loaded``: measured under load too; ``sample``: a
    regex whose matching output lines the README quotes (host syncs and verdict lines)."""

    name: str
    shown: str  # the command as the documents show it
    what: str
    argv: tuple[str, ...]
    loaded: bool = False
    in_checkout: bool = False
    sample: str = ""
    readme: bool = False  # a row of the README's table (every run is a row of docs/reference.md's)
    env: dict = field(default_factory=dict)


DRIFT = (PY, "-m", "drift")
GATE = (PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "drift")
RUNS: tuple[DocRun, ...] = (
    DocRun("help", "drift --help", "the help, without importing torch", (*DRIFT, "--help")),
    DocRun("run", "drift run --report drift-report", "4,096 MTP steps of `ci-small` through SGLang 0.5.23's "
           "update under the serving lifecycle, every check; exit 0", (*DRIFT, "run", "--quiet", "--report", "drift-report"),
           loaded=True, readme=True),
    DocRun("run-sync", "drift run --update sglang-32130", "the sglang #32130 version: the host-sync scan runs "
           "first and fails it, naming the line; exit 1", (*DRIFT, "run", "--quiet", "--update", "sglang-32130"),
           loaded=True, readme=True, sample=r"^(host syncs|precision checks|FAIL|PASS)"),
    DocRun("gate", "pytest --pyargs drift", "the same gate as pytest tests (what an engine's CI runs), on "
           "`ci-small` and `ci-heads`", GATE,
           loaded=True, readme=True),
    DocRun("gate-sync-x", "pytest --pyargs drift -x --drift-update sglang-32130", "the gate stops at the "
           "host-sync test", (*GATE, "-x", "--drift-update", "sglang-32130"), readme=True,
           sample=r"^(FAILED|sglang-32130: )"),  # the failure section prints drift's message alone
    DocRun("gate-off-by-one-x", "pytest --pyargs drift -x --drift-update mutant:step_plus1", "an off-by-one: "
           "the precision test stops at its first failing chunk", (*GATE, "-x", "--drift-update",
                                                                   "mutant:step_plus1"), readme=True),
    DocRun("run-512", "drift run --steps 512", "512 steps, every check", (*DRIFT, "run", "--quiet", "--steps",
                                                                        "512"), loaded=True),
    DocRun("gate-512", "pytest --pyargs drift --drift-steps 512", "the gate over 512 steps",
           (*GATE, "--drift-steps", "512"), loaded=True),
    DocRun("mutants", "drift mutants", "the mutation table", (*DRIFT, "mutants", "--quiet")),
    DocRun("tradeoff", "drift tradeoff", "the trade-off table", (*DRIFT, "tradeoff", "--quiet")),
    DocRun("nightly-1000", "drift nightly --steps 1000 --variant rne", "the nightly's `rne` entry "
           "(qwen3.5-397b-tp16 cut to 4 layers) over 1,000 steps",
           (*DRIFT, "nightly", "--quiet", "--steps", "1000", "--variant", "rne", "--report", "nightly-report")),
    DocRun("nightly-1000-variants", "drift nightly --steps 1000 (its four store variants)", "the nightly's four "
           "store variants (rne, stochastic, fp32, sequential) of qwen3.5-397b-tp16 cut to 4 layers, 1,000 steps each",
           (*DRIFT, "nightly", "--quiet", "--steps", "1000", "--variant", "rne", "--variant", "stochastic",
            "--variant", "fp32", "--variant", "sequential", "--report", "nightly-report")),
    DocRun("collect", "python -m pytest --collect-only -q", "from a checkout: the tests the suite collects",
           (PY, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"), in_checkout=True,
           readme=True, sample=r"^\d+(/\d+)? tests? collected"),
    DocRun("suite", "python -m pytest -n auto", "from a checkout: drift's own suite",
           (PY, "-m", "pytest", "-n", "auto", "-q", "-p", "no:cacheprovider"), in_checkout=True, readme=True,
           sample=r"^(=*\s*\d+ (passed|failed)|FAILED )"),
)
BY_NAME = {r.name: r for r in RUNS}
SAMPLED_IN_README = ("run-sync", "gate-sync-x")  # runs whose output lines the README quotes
LOAD_PROCS = 2  # busy processes for "loaded": one per core of the 2-core CI runner


OPTIONAL = ("transformers", "triton", "sglang", "vllm")  # what changes which tests collect and run


def installed_extras() -> list[str]:
    import importlib.util

    return [m for m in OPTIONAL if importlib.util.find_spec(m) is not None]


def _load() -> float:
    return round(os.getloadavg()[0], 1)


def _busy() -> list[subprocess.Popen]:
    spin = "while True: pass"
    return [subprocess.Popen([PY, "-c", spin]) for _ in range(LOAD_PROCS)]


def _once(run: DocRun, loaded: bool) -> dict:
    busy = _busy() if loaded else []
    try:
        with tempfile.TemporaryDirectory(prefix="drift-docs-") as tmp:
            env = run_env() | run.env
            load0, t0 = _load(), time.perf_counter()
            res = subprocess.run(run.argv, cwd=ROOT if run.in_checkout else tmp, env=env, capture_output=True,
                                 text=True, timeout=3600)
            wall = time.perf_counter() - t0
    finally:
        for p in busy:
            p.kill()
            p.wait()
    return {"wall_s": round(wall, 1), "rc": res.returncode, "load": [load0, _load()],
            "sample": sampled(run, res.stdout + res.stderr)}


def run_env() -> dict:
    """The environment of a documented run: the user's, without the repository's pytest options,
    at a fixed terminal width (pytest's summary lines are cut to it) and outside CI (pytest prints
    those lines whole where CI or BUILD_NUMBER is set: _pytest/compat.py running_on_ci)."""
    dropped = ("PYTEST_ADDOPTS", "CI", "BUILD_NUMBER")
    return {k: v for k, v in os.environ.items() if k not in dropped} | {"COLUMNS": "100"}


def sampled(run: DocRun, output: str) -> list[str]:
    """The lines of ``output`` the documents quote, with machine-specific parts taken out: the
    directory drift is installed in (``/x/site-packages/drift/a.py`` reads ``drift/a.py``), the
    column padding that depends on it, and pytest's timing."""
    lines = [ln.rstrip() for ln in output.splitlines() if run.sample and re.search(run.sample, ln)]
    lines = [re.sub(r"\s+in\s+[\d.]+s\b.*$", "", re.sub(r"(?<![\w.])/\S*?/(drift/)", r"\1", ln)) for ln in lines]
    # A table's padding follows its widest cell, a path as long as the checkout's: two spaces apart.
    return [re.sub(r" {3,}", "  ", ln) for ln in lines]


def measure(names=None) -> dict:
    """Run ``names`` (default all) and merge them into the record (atomic write); returns it."""
    sys.path.insert(0, str(ROOT))
    from drift.fileio import atomic_write_text

    record = json.loads(RECORD.read_text()) if RECORD.exists() else {"runs": {}}
    for run in [BY_NAME[n] for n in names] if names else RUNS:
        print(f"measuring {run.name}: {run.shown}", flush=True)
        entry = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cores": os.cpu_count(),
                 "extras": installed_extras(), "quiet": _once(run, loaded=False)}
        if run.loaded:
            entry["loaded"] = _once(run, loaded=True)
        record["runs"][run.name] = entry
        print(f"  {duration(entry['quiet']['wall_s'])}" + (f", loaded {duration(entry['loaded']['wall_s'])}"
                                                          if run.loaded else ""), flush=True)
    atomic_write_text(RECORD, json.dumps(record, indent=1, sort_keys=True) + "\n")
    return record


# ------------------------------------------------------------------------ rendering
def duration(s: float) -> str:
    return f"{s:.1f} s" if s < 10 else f"{s:.0f} s" if s < 60 else f"{int(s // 60)} min {int(s % 60)} s"


def _cell(entry: dict, how: str) -> str:
    m = entry.get(how)
    if m is None:
        return ""
    load = "-".join(f"{x:g}" for x in m["load"])
    return f"{duration(m['wall_s'])} (exit {m['rc']}; load {load})"


def _counts(entry: dict) -> str:
    """'1003 passed, 17 skipped, 1 xfailed' from the suite's summary line."""
    line = (entry["quiet"]["sample"] or ["?"])[-1]
    return re.sub(r"\s+in\s+[\d.]+s.*$", "", line.strip("= "))


def table(names, record: dict) -> str:
    runs = record["runs"]
    missing = [n for n in names if n not in runs]
    if missing:
        raise SystemExit(f"{RECORD} has no measurement of {', '.join(missing)}: "
                         f"run python scripts/update_readme.py --measure {' '.join(missing)}")
    lines = ["| command | what it does | quiet | two busy processes holding both cores | measured |",
             "|---|---|---|---|---|"]
    for n in names:
        run, e = BY_NAME[n], runs[n]
        what = run.what + (f" ({_counts(e)})" if n in ("suite", "collect") else "")
        lines.append(f"| `{run.shown}` | {what} | {_cell(e, 'quiet')} | {_cell(e, 'loaded') or '-'} | "
                     f"{e['date']}, {e['cores']} cores |")
    return "\n".join(lines)


def readme_table(record: dict) -> str:
    return table([r.name for r in RUNS if r.readme], record)


def reference_table(record: dict) -> str:
    return table([r.name for r in RUNS], record)


def sample(name: str, record: dict) -> str:
    """The quoted output lines of run ``name``, as a fenced block."""
    return "```\n" + "\n".join(record["runs"][name]["quiet"]["sample"]) + "\n```"


def load_record() -> dict:
    if not RECORD.exists():
        raise SystemExit(f"{RECORD} is missing: run python scripts/update_readme.py --measure")
    return json.loads(RECORD.read_text())


def nightly_rate(record: dict) -> str:
    """What a nightly entry costs, from the measured ``nightly-1000`` run (setup included, so an
    upper bound on the per-step cost of a long run)."""
    e, a = record["runs"]["nightly-1000"], record["runs"]["nightly-1000-variants"]
    wall, wall_all = e["quiet"]["wall_s"], a["quiet"]["wall_s"]
    rate = 1000 / wall
    hours, hours_all = 100_000 / rate / 3600, wall_all * 100 / 3600
    load = lambda r: "-".join(f"{x:g}" for x in r["quiet"]["load"])  # noqa: E731
    return (f"Measured {e['date']} on {e['cores']} cores (load {load(e)}): 1,000 steps of the `rne` entry in "
            f"{duration(wall)}, at least {rate:.0f} steps/s with its setup, so 100,000 steps take at most about "
            f"{hours:.1f} hours for that entry; the four store variants, 1,000 steps each, took {duration(wall_all)} "
            f"({a['date']}, load {load(a)}: the `stochastic` entry runs the torch-op verify, which the native C kernel "
            f"does not cover, its stores' rounding in C, and costs more than an `rne` entry), so about {hours_all:.0f} hours at 100,000 steps on "
            "one such machine (the kernel-commit design entries of the default matrix cost more: docs/teeth.md); "
            "`--shard K/N` splits them.")
