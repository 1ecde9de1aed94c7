"""Reports: the summary table printed by ``drift run`` and the files under ``--report DIR``."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Callable, Optional, TextIO

from .checks import CheckResult
from .fileio import atomic_write_json, atomic_write_text


def _fmt(v: Optional[float]) -> str:
    if v is None or (isinstance(v, float) and math.isinf(v) and v < 0):
        return "-"
    if isinstance(v, float) and (v == 0 or 1e-3 <= abs(v) < 1e4):
        return f"{v:.4g}"
    return f"{v:.3e}" if isinstance(v, float) else str(v)


def check_rows(checks: list[CheckResult]) -> list[list[str]]:
    return [[c.name, c.verdict, _fmt(c.worst), _fmt(c.limit),
             c.where, c.detail] for c in checks]


def table(header: list[str], rows: list[list[str]]) -> str:
    """A plain fixed-width table."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)] if rows else [len(h) for h in header]
    line = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    esc = lambda x: str(x).replace("|", "\\|")
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(esc(x) for x in r) + " |" for r in rows]
    return "\n".join(out)


CHECK_HEADER = ["check", "verdict", "worst", "limit", "where", "detail"]


def summary_text(rep) -> str:
    d = rep.to_dict()
    run, cfg = d["run"], d["config"]
    head = (f"drift run: preset {cfg['name']}, update {run['update']}, {run['steps']} steps "
            f"({run['mode']}), device {run['device']}, {cfg['ssm_dtype']} state, "
            f"{cfg['store_rounding']} store, kernels: {run['kernels']}\n"
            f"reference: {d['reference']}; {run['wall_s']:.1f} s "
            f"({run['steps_per_s']} steps/s)")
    body = table(CHECK_HEADER, check_rows(rep.checks))
    verdict = "PASS: every check passed" if rep.passed else "FAIL: " + ", ".join(
        c.name for c in rep.checks if not c.passed)
    return f"{head}\n\n{body}\n\n{verdict}"


def summary_markdown(rep) -> str:
    d = rep.to_dict()
    run, cfg = d["run"], d["config"]
    lines = [
        f"# drift run: {'PASS' if rep.passed else 'FAIL'}",
        "",
        f"- preset `{cfg['name']}`, seed {cfg['seed']}, {run['steps']} decode steps ({run['mode']})",
        f"- update under test: `{run['update']}`" + (f" ({run.get('update_source')})" if run.get("update_source") else ""),
        f"- state: {cfg['ssm_dtype']} ({cfg['layout']} layout), store rounding {cfg['store_rounding']}; "
        f"kernels: {run['kernels']}; device {run['device']}",
        f"- reference: {d['reference']}",
        f"- wall time {run['wall_s']:.1f} s ({run['steps_per_s']} steps/s)",
        "",
        "## Checks",
        "",
        markdown_table(CHECK_HEADER, check_rows(rep.checks)),
        "",
    ]
    return "\n".join(lines)


def write_report(rep, directory: str | Path) -> list[Path]:
    """Write report.json and report.md under ``directory`` (atomically); returns the paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "report.json", out / "report.md"]
    atomic_write_json(paths[0], rep.to_dict())
    atomic_write_text(paths[1], summary_markdown(rep))
    return paths


def progress_printer(label: str, stream: TextIO = sys.stderr) -> Callable[[int, int], None]:
    """A progress callback: a tqdm bar on a terminal, plain periodic lines otherwise (CI logs)."""
    if stream.isatty():
        from tqdm import tqdm

        bar = tqdm(total=None, desc=label, unit="step", file=stream, dynamic_ncols=True)

        def update(done: int, total: int) -> None:
            if bar.total != total:
                bar.total = total
            bar.update(done - bar.n)
            if done >= total:
                bar.close()
        return update

    t0 = time.perf_counter()
    state = {"next": 0.0}

    def plain(done: int, total: int) -> None:
        now = time.perf_counter() - t0
        if done < total and now < state["next"]:
            return
        state["next"] = now + 10.0  # a line every 10 s at most
        rate = done / now if now > 0 else 0.0
        eta = (total - done) / rate if rate > 0 else float("nan")
        print(f"{label}: step {done}/{total} ({100 * done / total:.0f}%), {rate:.1f} steps/s, "
              f"ETA {eta:.0f} s", file=stream, flush=True)
    return plain
