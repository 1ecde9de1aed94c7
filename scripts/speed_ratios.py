#!/usr/bin/env python3
"""Issue 29's speed ratios, measured side by side: each pair alternated round by round, medians kept.

    python scripts/speed_ratios.py                      # every ratio, 3 rounds, quiet
    python scripts/speed_ratios.py --load               # two busy processes hold both cores meanwhile
    python scripts/speed_ratios.py --only gate --rounds 5
    python scripts/speed_ratios.py --base 4adf604       # the default run against that commit's
    python scripts/speed_ratios.py --dry-run            # the commands, in the order they would run

* ``gate``: ``pytest -q --pyargs drift --drift-steps 512`` against ``drift run --steps 512`` (target <= 1.3);
* ``run``: a default ``drift run`` against the ``--base`` commit's (``git archive`` into a scratch folder,
  run with ``PYTHONPATH`` there; target <= 0.5);
* ``flows``: ``drift run --flow F --steps 512`` for every flow against ``--flow sglang`` (target <= 1.5).

Each command runs from a scratch folder outside the checkout, with this interpreter and its installed
drift (the ``drift`` of this checkout where it is installed editable), and is timed from its start to its
end (``time.perf_counter`` around ``subprocess.run``). A box whose speed drifts within minutes moves both
sides of a round alike; the spread of the rounds is printed beside each median.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"gate": 1.3, "run": 0.5, "flows": 1.5}
BASE = "4adf604"  # issue 29's "today" (the default run's 0.5x is against it)
PY = sys.executable


def flows() -> list[str]:
    sys.path.insert(0, str(ROOT))
    from drift.flows.registry import FLOWS

    return list(FLOWS)


def pairs(which: list[str], scratch: Path, base_tree: Path) -> list[tuple[str, list[str], dict, list[str], dict]]:
    """(label, numerator argv, its extra environment, denominator argv, its environment) per ratio."""
    drift = [PY, "-m", "drift"]
    out = []
    if "gate" in which:
        out.append(("gate / run@512", [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "drift",
                                       "--drift-steps", "512"], {},
                    [*drift, "run", "--steps", "512", "--quiet", "--report", str(scratch / "r512")], {}))
    if "run" in which:
        out.append(("run / base run", [*drift, "run", "--quiet", "--report", str(scratch / "now")], {},
                    [*drift, "run", "--quiet", "--report", str(scratch / "base")], {"PYTHONPATH": str(base_tree)}))
    if "flows" in which:
        sglang = [*drift, "run", "--flow", "sglang", "--steps", "512", "--quiet", "--report", str(scratch / "f_sglang")]
        for f in flows():
            if f != "sglang":
                out.append((f"{f} / sglang", [*drift, "run", "--flow", f, "--steps", "512", "--quiet", "--report",
                                              str(scratch / f"f_{f}")], {}, sglang, {}))
    return out


def summary(label: str, ratios: list[float], target: float) -> str:
    """One line: the median of ``ratios``, their spread, and whether the median meets ``target``."""
    med = statistics.median(ratios)
    return (f"{label}: median {med:.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f}, n={len(ratios)}); "
            f"target <= {target}: {'met' if med <= target else 'not met'}")


def timed(argv: list[str], env: dict, cwd: Path) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"speed_ratios: {' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return wall


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds per ratio (default 3)")
    p.add_argument("--only", default="gate,run,flows", help="comma-separated: gate, run, flows (default all)")
    p.add_argument("--base", default=BASE, help=f"the commit the default run is compared with (default {BASE})")
    p.add_argument("--load", action="store_true", help="two busy processes hold both cores while measuring")
    p.add_argument("--dry-run", action="store_true", help="print the commands in order; run nothing")
    args = p.parse_args(argv)
    which = [w.strip() for w in args.only.split(",") if w.strip()]
    unknown = sorted(set(which) - set(TARGETS))
    if unknown or args.rounds < 1:
        p.error(f"--only takes {', '.join(TARGETS)} (got {', '.join(unknown)})" if unknown else "--rounds must be >= 1")
    with tempfile.TemporaryDirectory(prefix="drift-speed-") as tmp:
        scratch, base_tree = Path(tmp), Path(tmp) / "base"
        todo = pairs(which, scratch, base_tree)
        if args.dry_run:
            for r in range(args.rounds):
                for label, num, num_env, den, den_env in todo:
                    for argv_, env in ((den, den_env), (num, num_env)):
                        print(f"round {r + 1} {label}: " + " ".join([*(f"{k}={v}" for k, v in env.items()), *argv_]))
            return 0
        if "run" in which:
            base_tree.mkdir()
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.base], capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", str(base_tree)], input=archive.stdout, check=True)
        busy = [subprocess.Popen([PY, "-c", "while True: pass"]) for _ in range(2)] if args.load else []
        try:
            ratios: dict[str, list[float]] = {label: [] for label, *_ in todo}
            for r in range(args.rounds):
                for label, num, num_env, den, den_env in todo:
                    d = timed(den, den_env, scratch)
                    n = timed(num, num_env, scratch)
                    ratios[label].append(n / d)
                    print(f"round {r + 1} {label}: {n:.2f} / {d:.2f} s = {n / d:.3f}", flush=True)
        finally:
            for b in busy:
                b.kill()
                b.wait()
        for label, *_ in todo:
            kind = "gate" if label.startswith("gate") else "run" if label.startswith("run") else "flows"
            print(summary(label, ratios[label], TARGETS[kind]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
