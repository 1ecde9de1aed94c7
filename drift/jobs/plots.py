"""PNG plots of nightly reports (matplotlib, Agg backend): drawn from report.json alone, so
merged shard reports plot the same way. Output is deterministic for the same report."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from ..check.registry import result_key
from ..fileio import save_figure

METADATA = {"Software": None}  # no version stamp: identical reports give identical files


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _curves(entry: dict, name: str) -> Optional[tuple[np.ndarray, np.ndarray]]:
    for c in entry["checks"]:
        if result_key(c) == "drift_bound" and c.get("bound"):
            cur = c["bound"]["curves"].get(name)
            if cur and cur["step"]:
                return np.asarray(cur["step"]), np.asarray(cur["mean"])  # [B], [B, L, H]
    return None


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


def _heads_figure(plt, groups: list[tuple[str, dict, dict]], title: str, with_bound: bool):
    """One panel per value head: each group's mean relative error (over layers) vs step."""
    nheads = max((_curves(e, "rel_err")[1].shape[2] for _, e, _ in groups if _curves(e, "rel_err")), default=1)
    fig, axes = plt.subplots(1, nheads, figsize=(3.2 * nheads, 3.0), squeeze=False, sharey=True)
    for h in range(nheads):
        ax = axes[0, h]
        for label, e, style in groups:
            c = _curves(e, "rel_err")
            if c is None or h >= c[1].shape[2]:
                continue
            ax.loglog(c[0], c[1][:, :, h].mean(1), label=label, **style)
            if with_bound:
                b = _curves(e, "bound_rel")
                if b is not None:
                    ax.loglog(b[0], b[1][:, :, h].mean(1), linestyle="--", color=style.get("color", "k"),
                              alpha=0.6, label=f"{label} bound")
        d = _decays(groups[0][1]) if groups else []
        ax.set_title(f"head {h}" + (f" (decay {d[h]:.4f}/step)" if h < len(d) else ""), fontsize=8)
        ax.set_xlabel("decode step", fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.tick_params(which="both", labelsize=7)
    axes[0, 0].set_ylabel("relative error (mean over layers)", fontsize=8)
    axes[0, -1].legend(fontsize=6, loc="best")
    fig.suptitle(title, fontsize=9)
    # Fixed margins in inches (y label and ticks left, x label below, panel and figure titles
    # above) instead of tight_layout, which draws every figure once more to measure it.
    w, h = fig.get_size_inches()
    fig.subplots_adjust(left=0.8 / w, right=1 - 0.12 / w, bottom=0.45 / h, top=1 - 0.55 / h, wspace=0.08)
    return fig


COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]


def nightly_plots(report: dict, out: Path) -> list[Path]:
    """drift_vs_step.png, mtp_vs_sequential.png, rounding_modes.png; returns their paths."""
    plt = _plt()
    entries = report["entries"]
    written = []

    def save(fig, name):
        path = out / name
        save_figure(fig, path, dpi=110, metadata=METADATA)
        plt.close(fig)
        written.append(path)

    groups = [(f"{e['entry']['preset']} seed {e['entry']['seed']}", e, {"color": COLORS[i % len(COLORS)]})
              for i, (_, e) in enumerate(_pick(entries, "rne"))] or \
             [(k, e, {"color": COLORS[i % len(COLORS)]}) for i, (k, e) in enumerate(list(entries.items())[:3])]
    save(_heads_figure(plt, groups, "bf16 drift vs step, with the bound envelope (MTP, round to nearest)", True),
         "drift_vs_step.png")
    pairs = []
    for mode, color in (("rne", "tab:blue"), ("sequential", "tab:orange")):
        for k, e in _pick(entries, mode)[:1]:
            pairs.append(("MTP" if mode == "rne" else "sequential", e, {"color": color}))
    save(_heads_figure(plt, pairs, "MTP (one rounding per step) vs sequential decode (one per token)", True),
         "mtp_vs_sequential.png")
    modes = []
    for mode, color in (("rne", "tab:blue"), ("stochastic", "tab:green"), ("fp32", "tab:red")):
        for k, e in _pick(entries, mode)[:1]:
            modes.append((mode, e, {"color": color}))
    save(_heads_figure(plt, modes, "store rounding: round to nearest vs stochastic vs fp32 state", False),
         "rounding_modes.png")
    return written


def run_plot(report: dict, out: Path) -> Optional[Path]:
    """drift_vs_step.png for one ``drift run`` report (None when it has no drift curves)."""
    if _curves(report, "rel_err") is None:
        return None
    plt = _plt()
    cfg = report["config"]
    fig = _heads_figure(plt, [(f"{cfg['name']} seed {cfg['seed']}", report, {"color": COLORS[0]})],
                        f"drift vs step with the bound envelope ({report['run']['update']}, "
                        f"{cfg['ssm_dtype']} state, {cfg['store_rounding']} store)", True)
    path = out / "drift_vs_step.png"
    save_figure(fig, path, dpi=110, metadata=METADATA)
    plt.close(fig)
    return path
