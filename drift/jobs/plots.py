"""PNG plots of nightly reports (matplotlib, Agg backend): drawn from report.json alone, so
merged shard reports plot the same way. Output is deterministic for the same report."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from ..check.registry import result_key
from ..fileio import save_figure

METADATA = {"Software": None}  # no version stamp: identical reports give identical files


def new_figure(**kwargs):
    """A matplotlib ``Figure(**kwargs)`` that pyplot never sees: drift does not import pyplot (its
    import, backend and figure manager are the larger part of a small plot's cost; a bare figure
    renders with Agg when saved as PNG and is freed with its last reference, no ``close``)."""
    from matplotlib.figure import Figure

    return Figure(**kwargs)


def _curves(entry: dict, name: str, stat: str = "mean") -> Optional[tuple[np.ndarray, np.ndarray]]:
    for c in entry["checks"]:
        if result_key(c) == "drift_bound" and c.get("bound"):
            cur = c["bound"]["curves"].get(name)
            if cur and cur["step"]:
                return np.asarray(cur["step"]), np.asarray(cur[stat])  # [B], [B, L, H]
    return None


def _worst_ratio(entry: dict) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """What the drift-bound check gates: per step bin and value head, the largest error / bound
    over layers, rows and the bin's steps (``[B]``, ``[B, H]``); None without curves."""
    c = _curves(entry, "bound_ratio", "max")
    return None if c is None else (c[0], c[1].max(axis=1))


def _decays(entry: dict) -> list[float]:
    for c in entry["checks"]:
        if result_key(c) == "drift_bound" and c.get("bound"):
            return list(np.mean(np.asarray(c["bound"]["step_decay"]), axis=0))
    return []


def _pick(entries: dict, mode: str) -> list[tuple[str, dict]]:
    """Entries of a store mode, one per (preset, seed) (implementations agree on precision)."""
    seen, out = set(), []
    for k, e in entries.items():
        en = e["entry"]
        if en["variant"] == mode and (en["preset"], en["seed"]) not in seen:
            seen.add((en["preset"], en["seed"]))
            out.append((k, e))
    return out


def what_ran(update: str, kernel: str, flow: str) -> str:
    """The line every title carries: the update, the verify kernel and the flow under test."""
    return f"update {update}, kernel {kernel}, flow {flow}"


def _entry_what(entries: list[dict]) -> str:
    """:func:`what_ran` of nightly entries (distinct values joined where they differ)."""
    def values(get):
        return " / ".join(dict.fromkeys(str(get(e)) for e in entries)) or "-"
    return what_ran(values(lambda e: e["entry"]["update"] if e["entry"]["variant"] != "sequential" else "(sequential)"),
                    values(lambda e: e.get("verify_kernel", "?")), values(lambda e: e.get("config", {}).get("flow", "?")))


def _ratio_figure(groups: list[tuple[str, dict, dict]], title: str):
    """One panel per value head: each group's worst error / bound (over layers and rows) vs step,
    log-log, with the bound at 1 (a check fails above it)."""
    curves = [(label, _worst_ratio(e), style) for label, e, style in groups]
    nheads = max((c[1].shape[1] for _, c, _ in curves if c is not None), default=1)
    values = np.concatenate([c[1].ravel() for _, c, _ in curves if c is not None] or [np.ones(1)])
    values = values[np.isfinite(values) & (values > 0)]
    # At least two decades below the line and one above, so "how far from failing" reads at a glance.
    low = min(1e-2, float(values.min()) / 2) if values.size else 1e-2
    high = max(10.0, float(values.max()) * 2) if values.size else 10.0
    fig = new_figure(figsize=(3.2 * nheads, 3.2))
    axes = fig.subplots(1, nheads, squeeze=False, sharey=True)
    for h in range(nheads):
        ax = axes[0, h]
        for label, c, style in curves:
            if c is None or h >= c[1].shape[1]:
                continue
            ax.loglog(c[0], np.maximum(c[1][:, h], low), label=label, **style)
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1.0, label="bound (fail above)")
        ax.set_ylim(low, high)
        d = _decays(groups[0][1]) if groups else []
        ax.set_title(f"head {h}" + (f" (decay {d[h]:.4f}/step)" if h < len(d) else ""), fontsize=8)
        ax.set_xlabel("decode step", fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.tick_params(which="both", labelsize=7)
    axes[0, 0].set_ylabel("worst error / bound\n(max over layers and rows)", fontsize=8)
    handles, labels = axes[0, -1].get_legend_handles_labels()
    if handles:
        axes[0, -1].legend(handles, labels, fontsize=6, loc="best")
    fig.suptitle(title, fontsize=9)
    # Fixed margins in inches (y label and ticks left, x label below, panel and figure titles
    # above) instead of tight_layout, which draws every figure once more to measure it.
    w, h = fig.get_size_inches()
    fig.subplots_adjust(left=0.95 / w, right=1 - 0.12 / w, bottom=0.45 / h, top=1 - 0.75 / h, wspace=0.08)
    return fig


RUN_PLOT, SEQUENTIAL_PLOT, ROUNDING_PLOT = "drift_vs_step.png", "mtp_vs_sequential.png", "rounding_modes.png"
NIGHTLY_PLOTS = (RUN_PLOT, SEQUENTIAL_PLOT, ROUNDING_PLOT)
COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
ROUNDING_MODES = (("rne", "round to nearest, bf16", "tab:blue"), ("stochastic", "stochastic rounding, bf16", "tab:green"),
                  ("fp32", "fp32 state", "tab:red"))


def planned_plots(entries: dict) -> list[str]:
    """The nightly plots a report's entries allow: a comparison only when both sides ran."""
    variants = {e["entry"]["variant"] for e in entries.values()}
    names = [RUN_PLOT] if entries else []
    if {"rne", "sequential"} <= variants:
        names.append(SEQUENTIAL_PLOT)
    if len(variants & {m for m, _, _ in ROUNDING_MODES}) >= 2:
        names.append(ROUNDING_PLOT)
    return names


def _with_baseline(groups: list, report: dict, baseline: Optional[dict]) -> list:
    """``groups`` with, after each, its entry's baseline entry (``report["trend_pairs"]``) dashed."""
    if baseline is None:
        return groups
    out = []
    for label, e, style in groups:
        out.append((label, e, style))
        old = baseline["entries"].get((report.get("trend_pairs") or {}).get(e.get("key")))
        if old is not None:
            out.append((f"{label}, baseline", old, {**style, "linestyle": "--", "alpha": 0.8}))
    return out


def nightly_figures(report: dict, baseline: Optional[dict] = None) -> dict:
    """The :func:`planned_plots` of a nightly report as matplotlib figures (name -> figure), each
    the gated quantity per head with the bound line and what ran in its title; with the
    ``baseline`` report, each entry's baseline curve beside it (dashed, labelled)."""
    entries = report["entries"]
    planned = planned_plots(entries)
    figs = {}

    def figure(name: str, groups: list, title: str) -> None:
        figs[name] = _ratio_figure(_with_baseline(groups, report, baseline),
                                   f"{title}\n{_entry_what([g[1] for g in groups])}")

    if RUN_PLOT in planned:
        rne = _pick(entries, "rne")
        groups = [(f"{e['entry']['preset']} seed {e['entry']['seed']}", e, {"color": COLORS[i % len(COLORS)]})
                  for i, (_, e) in enumerate(rne)] or \
                 [(k, e, {"color": COLORS[i % len(COLORS)]}) for i, (k, e) in enumerate(list(entries.items())[:3])]
        what = "bf16 round to nearest" if rne else "the first entries"
        figure(RUN_PLOT, groups, f"Drift vs step, {what}: worst error / bound")
    if SEQUENTIAL_PLOT in planned:
        pairs = [("MTP" if mode == "rne" else "sequential", e, {"color": color})
                 for mode, color in (("rne", "tab:blue"), ("sequential", "tab:orange")) for _, e in _pick(entries, mode)[:1]]
        figure(SEQUENTIAL_PLOT, pairs, "MTP (one rounding per step) vs sequential decode (one per token): "
                                        "worst error / bound")
    if ROUNDING_PLOT in planned:
        modes = [(text, e, {"color": color}) for mode, text, color in ROUNDING_MODES for _, e in _pick(entries, mode)[:1]]
        figure(ROUNDING_PLOT, modes, f"Store rounding: {' vs '.join(m[0] for m in modes)}: worst error / its bound")
    return figs


def _save(fig, path: Path) -> Path:
    save_figure(fig, path, dpi=110, metadata=METADATA)
    return path


def nightly_plots(report: dict, out: Path, baseline: Optional[dict] = None) -> list[Path]:
    """Write :func:`nightly_figures` under ``out``; returns their paths."""
    return [_save(fig, out / name) for name, fig in nightly_figures(report, baseline).items()]


def run_figure(report: dict):
    """drift_vs_step for one ``drift run`` report (None when it has no drift curves)."""
    if _worst_ratio(report) is None:
        return None
    cfg, run = report["config"], report["run"]
    return _ratio_figure([(f"{cfg['name']} seed {cfg['seed']}", report, {"color": COLORS[0]})],
                         f"Drift vs step: worst error / bound ({cfg['ssm_dtype']} state, {cfg['store_rounding']} "
                         f"store)\n{what_ran(run['update'], run.get('verify_kernel', '?'), cfg.get('flow', '?'))}")


def run_plot(report: dict, out: Path) -> Optional[Path]:
    """drift_vs_step.png for one ``drift run`` report (None when it has no drift curves)."""
    fig = run_figure(report)
    return None if fig is None else _save(fig, out / RUN_PLOT)
