"""Reports: the summary table printed by ``drift run`` and the files under ``--report DIR``."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Callable, Optional, TextIO

from ..check.registry import find_result, result_key
from ..check.result import CheckResult
from ..fileio import atomic_write_json, atomic_write_text, staged
from .plots import NIGHTLY_PLOTS, RUN_PLOT, planned_plots, run_plot

REPORT_FILES = ("report.json", "report.md", RUN_PLOT)  # what drift run --report DIR receives, one unit
NIGHTLY_FILES = ("report.json", "report.md") + NIGHTLY_PLOTS  # a nightly's (or a merge's) report


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


def _graph_text(run: dict) -> str:
    """How the decode steps ran: captured in a device graph, or eagerly (and why)."""
    state = run.get("graph")
    if state == "captured":
        return "captured in a device graph and replayed"
    if state == "failed":
        return "eager after a failed capture (see the graph capture check)"
    return "eager" if state else "not recorded"


def _pace_text(pace: Optional[dict]) -> str:
    """report.md's words for ``run.pace`` (:meth:`drift.check.compare.Comparison.pace`)."""
    if not pace:
        return ""
    where = {"process": "in a process of its own", "worker": "on a worker thread"}.get(pace["thread"])
    if where is None:
        return "; the comparison ran on the simulation's thread"
    return f"; the comparison ran {where}, and the simulation waited {pace['simulation_waited_s']:.1f} s for it"


def lifecycle_text(run: dict, cfg: dict) -> str:
    """Which lifecycle ran and, under churn, which events it ran (drift/lifecycles.py)."""
    ev = run.get("events")
    if not ev:
        return f"{cfg.get('lifecycle', 'fixed')}: one request per lane, fixed rows and slots"
    starts = ", ".join(f"{n} {k}" for k, n in ev["starts"].items())
    ends = ", ".join(f"{n} {k}" for k, n in ev["ends"].items())
    return (f"{cfg['lifecycle']}: {ev['requests']} requests ({starts}; {ends}), graph buckets "
            f"{', '.join(map(str, ev['buckets']))} with {'/'.join(map(str, ev['padded_rows']))} padded rows, "
            f"{ev['row_moves']} row moves")
def _options_text(cfg: dict) -> str:
    """The flow options a run set (``--ring-records fp16`` ...), or nothing: the kind's defaults."""
    opts = cfg.get("flow_options") or []
    return (", flow options " + " ".join(f"--{n} {v}" for n, v in opts)) if opts else ""


def mkl_warning(versions: dict) -> str:
    """A line when the run's MKL took another path than the one drift pins (drift/mkl.py), else ''."""
    mode = versions.get("mkl")
    if mode in (None, "none", "COMPATIBLE"):
        return ""
    return (f"MKL: {mode}, not COMPATIBLE (MKL_CBWR set otherwise, MKL ran before drift's pin, or a program "
            "calling drift's API without it): figures may differ from another CPU's and from drift's records "
            "(docs/reliability.md)")


def summary_text(rep) -> str:
    d = rep.to_dict()
    run, cfg = d["run"], d["config"]
    head = (f"drift run: preset {cfg['name']}, update {run['update']}, {run['steps']} steps "
            f"({run['mode']}), device {run['device']}, {cfg['ssm_dtype']} state, "
            f"{cfg['store_rounding']} store{_options_text(cfg)}, kernels: {run['kernels']}, "
            f"GDN verify: {run.get('verify_kernel', 'not recorded')}, "
            f"steps: {_graph_text(run)}\n"
            f"lifecycle {lifecycle_text(run, cfg)}\n"
            f"reference: {d['reference']}; {run['wall_s']:.1f} s "
            f"({run['steps_per_s']} steps/s)")
    mkl = mkl_warning(d["versions"])
    if mkl:
        head += "\n" + mkl
    body = table(CHECK_HEADER, check_rows(rep.checks))
    verdict = "PASS: every check passed" if rep.passed else "FAIL: " + ", ".join(
        c.name for c in rep.checks if c.failed)
    diagnosis = rep.extra.get("diagnosis")
    if diagnosis:  # above the verdict, which stays the last line
        verdict = f"diagnosis ({diagnosis.get('check', 'state')}): {diagnosis['text']}\n{verdict}"
    return f"{head}\n\n{body}\n\n{verdict}"


def summary_markdown(rep) -> str:
    d = rep.to_dict()
    run, cfg = d["run"], d["config"]
    mkl = mkl_warning(d["versions"])
    lines = [
        f"# drift run: {'PASS' if rep.passed else 'FAIL'}",
        "",
        f"- preset `{cfg['name']}`, seed {cfg['seed']}, {run['steps']} decode steps ({run['mode']})",
        f"- update under test: `{run['update']}`" + (f" ({run.get('update_source')})" if run.get("update_source") else ""),
        f"- profile `{cfg.get('profile', 'custom')}`: {cfg['ssm_dtype']} state ({cfg['layout']} layout), store "
        f"rounding {cfg['store_rounding']}; verify flow {cfg.get('flow', 'sglang')}{_options_text(cfg)}"
        f"{' (graph-mode arguments)' if cfg.get('graph_mode', True) else ' (eager arguments)'}; "
        f"kernels: {run['kernels']}; GDN verify: {run.get('verify_kernel', 'not recorded')}; device {run['device']}; "
        f"steps {_graph_text(run)}",
        f"- lifecycle {lifecycle_text(run, cfg)}",
        f"- reference: {d['reference']}",
        f"- wall time {run['wall_s']:.1f} s ({run['steps_per_s']} steps/s){_pace_text(run.get('pace'))}",
        *([f"- {mkl}"] if mkl else []),
        "",
        "## Checks",
        "",
        markdown_table(CHECK_HEADER, check_rows(rep.checks)),
        "",
    ]
    return "\n".join(lines)


def write_report(rep, directory: str | Path) -> list[Path]:
    """Write :data:`REPORT_FILES` under ``directory``, replacing the old ones as one unit
    (drift/fileio.py: staged; a run without drift curves writes no plot and removes an old one)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    data = rep.to_dict()
    with staged(out, REPORT_FILES) as stage:
        atomic_write_json(stage / "report.json", data)
        plot = run_plot(data, stage)
        md = summary_markdown(rep) + (f"\n![drift vs step]({RUN_PLOT})\n" if plot else "")
        atomic_write_text(stage / "report.md", md)
    return [out / "report.json", out / "report.md"] + ([out / RUN_PLOT] if plot else [])


def write_failure_report(message: str, run, directory: str | Path) -> list[Path]:
    """The report of a run the code under test ended (UpdateRaised, exit 1) before any check could report:
    report.json (``verdict`` fail, ``error`` the one line ``drift run`` prints, no checks) and report.md, as
    one unit (an old plot removed), so a CI job's artifacts say what failed."""
    from ..runner import versions

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    cfg = run.cfg
    data = {"schema": 1, "verdict": "fail", "config": {**cfg.to_dict(), "profile": cfg.profile},
            "run": {"update": run.update.spec if run.update is not None else "(sequential decode)",
                    "verify_kernel": run.kernel.description if run.kernel is not None else ""},
            "error": message, "reference": None, "checks": [], "versions": versions()}
    with staged(out, REPORT_FILES) as stage:
        atomic_write_json(stage / "report.json", data)
        atomic_write_text(stage / "report.md", f"# drift run {cfg.name}: FAIL\n\n{message}\n\nNo check reported: "
                                               "the code under test ended the run first.\n")
    return [out / "report.json", out / "report.md"]


class _Lines:
    """A file for tqdm in logs: each refresh becomes its own line instead of a carriage return."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").strip()
        if text:
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress_printer(label: str, stream: Optional[TextIO] = None, unit: str = "step",
                     every_s: Optional[float] = None) -> Callable[..., None]:
    """A progress callback ``update(done, total, what="")`` (rate and ETA from tqdm; ``what``
    names the item just finished): a live bar on a terminal, a plain line at most every
    ``every_s`` seconds otherwise (CI logs; default 10 s for steps, every item for coarser units)."""
    stream = stream or sys.stderr
    from tqdm import tqdm

    class Bar(tqdm):
        """tqdm without its monitor thread: a process with a second thread may not fork (drift.check.forked.
        fork_refusal), and a bar over a command's runs (``drift mutants``' 43) kept every run after the first
        from scanning and comparing in processes of their own. The monitor only redraws a bar whose loop
        stalls; ours redraws at each callback."""
        monitor_interval = 0

    tty = stream.isatty()
    every = every_s if every_s is not None else (10.0 if unit == "step" else 0.0)
    bars: list = []

    def update(done: int, total: int, what: str = "") -> None:
        if not bars:
            bars.append(Bar(total=total, desc=label, unit=unit, file=stream if tty else _Lines(stream),
                             dynamic_ncols=tty, ascii=not tty, mininterval=0.1 if tty else every))
        bar = bars[0]
        if what:
            bar.set_postfix_str(what, refresh=False)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()
    return update


# ---------------------------------------------------------------------- nightly
def _check(entry: dict, key: str) -> Optional[dict]:
    return find_result(entry["checks"], key)


def _bound(entry: dict) -> dict:
    c = _check(entry, "drift_bound")
    return (c or {}).get("bound") or {}


def nightly_markdown(rep: dict) -> str:
    """The one-minute summary of a nightly report."""
    entries = rep["entries"]
    lines = [f"# drift nightly: {rep['verdict'].upper()}", ""]
    cuts = sorted({e["cut"] for e in entries.values() if e.get("cut")})
    lines += [f"- {len(entries)} entries; device {rep.get('device', '?')}; shard {rep.get('shard', '1/1')}",
              "- versions: " + ", ".join(f"{k} {v}" for k, v in (rep.get("versions") or {}).items())]
    lines += [f"- cut to fit the night: {c}" for c in cuts]
    verify = sorted({e.get("verify_kernel") or "not recorded" for e in entries.values()})
    lines.append("- GDN verify: " + "; ".join(verify))
    lines += ["", "## Verdict per update and variant", ""]
    rows = []
    for key, e in entries.items():
        en, b = e["entry"], _bound(e)
        state = _check(e, "committed_state") or {}
        worst_ratio = (_check(e, "drift_bound") or {}).get("worst")
        failed = [c["name"] for c in e["checks"] if c["failed"]]
        update = en["update"] + "".join(f" --{n} {v}" for n, v in en.get("flow_options") or [])
        rows.append([en["preset"], str(en["seed"]), update, en["variant"], str(e["steps"]),
                     e["verdict"].upper(), _fmt(worst_ratio), _fmt(state.get("worst")),
                     _fmt(e.get("syncs_per_step")), ", ".join(failed) or "-"])
    lines.append(markdown_table(["preset", "seed", "update", "variant", "steps", "verdict", "worst bound ratio",
                                 "worst rel. error", "syncs/step", "failed checks"], rows))
    heads = []
    for key, e in entries.items():
        b = _bound(e)
        for l, row in enumerate(b.get("worst_ratio_per_head", [])):
            for h, r in enumerate(row):
                g = b["growth_exponent"][l][h]
                heads.append((r, key, l, h, g, b["step_decay"][l][h], b["stagnation_prone"][l][h]))
    heads.sort(key=lambda t: -t[0])
    lines += ["", "## Worst heads (by bound ratio)", ""]
    lines.append(markdown_table(["entry", "layer", "head", "bound ratio", "growth exponent", "decay / step",
                                 "stagnation-prone"],
                                [[k, str(l), str(h), _fmt(r), _fmt(g), f"{d:.5f}", "yes" if s else "no"]
                                 for r, k, l, h, g, d, s in heads[:8]]))
    lines += ["", "## Growth exponents (max over layers, per value head)", ""]
    grow_rows = []
    for key, e in entries.items():
        ge = _bound(e).get("growth_exponent") or []
        if ge:
            per_head = [max((r[h] for r in ge if r[h] is not None), default=None) for h in range(len(ge[0]))]
            grow_rows.append([key] + [_fmt(v) for v in per_head])
    if grow_rows:
        width = max(len(r) for r in grow_rows) - 1
        lines.append(markdown_table(["entry"] + [f"head {h}" for h in range(width)], grow_rows))
    lines += ["", "## Trade-off", ""]
    impls = {}
    for e in entries.values():
        en = e["entry"]
        if en["variant"] == "sequential":
            continue
        t = impls.setdefault(en["update"], {"syncs": 0.0, "ratio": 0.0, "precision": True})
        t["syncs"] = max(t["syncs"], e.get("syncs_per_step") or 0.0)
        t["ratio"] = max(t["ratio"], (_check(e, "drift_bound") or {}).get("worst") or 0.0)
        if en["variant"] == "rne":
            t["precision"] &= not any(c["failed"] for c in e["checks"] if result_key(c) != "host_syncs")
    lines.append(markdown_table(["update", "syncs/step", "worst bound ratio (all variants)", "precision (rne)", "sync free"],
                                [[k, _fmt(v["syncs"]), _fmt(v["ratio"]), "PASS" if v["precision"] else "FAIL",
                                  "PASS" if v["syncs"] == 0 else "FAIL"] for k, v in impls.items()]))
    if rep.get("trend") is not None:
        lines += ["", f"## Trend against the baseline (flag: error grew > {rep['trend_factor']}x at equal horizon)", ""]
        if rep["trend"]:
            lines.append(markdown_table(["entry", "layer", "head", "step", "baseline", "now", "ratio"],
                                        [[t["key"], str(t["layer"]), str(t["head"]), str(int(t["step"])),
                                          _fmt(t["baseline"]), _fmt(t["current"]), _fmt(t["ratio"])]
                                         for t in rep["trend"]]))
        else:
            lines.append("No head regressed.")
        if rep.get("trend_unmatched"):
            lines += ["", "Not compared (the baseline has no entry of their key): "
                      + ", ".join(f"`{k}`" for k in rep["trend_unmatched"])]
    fails = [(k, c) for k, e in entries.items() for c in e["checks"] if c["failed"]]
    if fails:
        lines += ["", "## Failures", ""]
        lines += [f"- `{k}` **{c['name']}**: {c.get('detail') or ''} ({c.get('where') or ''})" for k, c in fails]
    plots = planned_plots(entries)
    if plots:
        lines += ["", "Plots (per value head, the worst error over layers and rows as a ratio to its bound, "
                  "log-log; a check fails above the line at 1" + ("; dashed: the baseline's entry"
                                                                  if rep.get("trend") is not None else "")
                  + "): " + ", ".join(f"`{p}`" for p in plots) + ".", ""]
    else:
        lines.append("")
    return "\n".join(lines)
