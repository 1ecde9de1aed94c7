"""Teeth: the mutation score of the PR-gating checks and the both-directions trade-off table.

``drift mutants`` runs every regression of :mod:`drift.plug.mutants` through the PR-gating checks
and records which checks caught it; ``drift tradeoff`` runs every built-in and reports, per
implementation, syncs and bytes per step, the worst drift-to-bound ratio and a verdict in
each direction (the seesaw of the sglang #32130 review). Both report what they measure.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from ..check.registry import CHECKS, find_result
from ..config import Config
from ..flows.registry import FLOWS, UPDATES
from ..plug.loader import load_update, mutant_config
from ..plug.mutants import MUTANTS
from ..runner import run_checked
from ..runspec import resolve
from ..syncs.costmodel import measure

# Decode steps per run: every mutant is caught well within it (measured 16/16 at 512 steps; the
# test suite's nightly twin runs the catalogue at 1,024, docs/bounds.md).
TEETH_STEPS = 512
# A precision loss needs the horizon to pile up; a host sync is found by the scan of the update
# (no horizon at all) and a semantic slip within the first track intervals (measured at 256
# steps: every semantic mutant over 500x its bound). Those run a quarter of the horizon, at least
# 64 steps (four track intervals of ci-small at the least acceptance).
SHORT_HORIZON_SHARE, SHORT_HORIZON_MIN = 4, 64


def mutant_steps(direction: str, steps: int) -> int:
    """The decode steps a mutant of ``direction`` runs in a catalogue of ``steps``."""
    return steps if direction == "precision" else min(steps, max(SHORT_HORIZON_MIN, steps // SHORT_HORIZON_SHARE))


SYNC_CHECK = "host_syncs"
GUARDED = "sglang-31659"  # the built-in with the .item() precision guard


def _verdicts(rep) -> tuple[list[str], Optional[float], Optional[float]]:
    """(keys of failed gated checks, worst bound ratio, syncs per step)."""
    failed = [c.key for c in rep.checks if c.failed]
    ratio = getattr(find_result(rep.checks, "drift_bound"), "worst", None)
    syncs = getattr(find_result(rep.checks, SYNC_CHECK), "worst", None)
    return failed, ratio, syncs


def run_spec(cfg: Config, update: Optional[str] = None, kernel: Optional[str] = None):
    """A checked run of ``update`` (None: the flow's default) with ``kernel``, under the config a
    mutant spec asks for, in the update's own flow where it is written for another kind."""
    overrides = {**mutant_config(update), **mutant_config(kernel)}
    profile = overrides.pop("profile", None)
    if profile:
        cfg = cfg.with_profile(profile)
    return run_checked(resolve(cfg.replace(**overrides) if overrides else cfg, update, kernel, choose_flow=True),
                       diagnose=False)  # the catalogue counts verdicts: no diagnosis replay


def evaluate_mutant(name: str, cfg: Config) -> dict:
    """Run one mutant through every PR-gating check; which checks caught it."""
    m = MUTANTS[name]
    cfg = cfg.replace(steps=mutant_steps(m.direction, cfg.steps))
    rep = run_spec(cfg, f"mutant:{name}") if m.target == "update" else run_spec(cfg, kernel=f"mutant:{name}")
    failed, ratio, syncs = _verdicts(rep)
    return {"mutant": name, "flow": rep.config.flow, "direction": m.direction, "target": m.target,
            "description": m.description,
            "thread": m.thread, "steps": cfg.steps, "caught": bool(failed), "caught_by": failed,
            "worst_bound_ratio": ratio, "syncs_per_step": syncs}


def catalogue(cfg: Config, names: Optional[Sequence[str]] = None,
              progress: Optional[Callable[..., None]] = None) -> list[dict]:
    """:func:`evaluate_mutant` of each of ``names`` (default: the whole catalogue);
    ``progress(done, total, name)`` after each."""
    names = list(names or MUTANTS)
    rows = []
    for name in names:
        rows.append(evaluate_mutant(name, cfg))
        if progress is not None:
            progress(len(rows), len(names), name)
    return rows


def tradeoff(cfg: Config, impls: Optional[Sequence[str]] = None, unpadded_guard: bool = True,
             flows: Optional[Sequence[str]] = None, progress: Optional[Callable[..., None]] = None) -> list[dict]:
    """One row per state flow (docs/semantics.md §6; default all) and each of ``impls`` (default every
    built-in) written for its kind (the update's entry says which; a plug-in runs in ``cfg``'s flow)
    on ``cfg``; with ``unpadded_guard`` also ``sglang-31659`` on the same batch without padded rows
    (its guard never fires while a padded row carries step -1). Syncs and bytes are the update's
    own; precision is the flow's. ``progress(done, total, what)`` after each checked run."""
    impls = tuple(UPDATES) if impls is None else tuple(impls)
    kinds = {i: load_update(i).kinds for i in impls}
    plan = []
    for flow in (FLOWS.names() if flows is None else flows):
        mine = [i for i in impls if FLOWS[flow].kind in kinds[i] or (not kinds[i] and flow == cfg.flow)]
        c0 = cfg.replace(flow=flow)
        plan += [(flow, impl, c0, impl) for impl in mine]
        if unpadded_guard and GUARDED in mine and cfg.num_padded > 0:
            plan.append((flow, GUARDED, c0.replace(num_padded=0), f"{GUARDED} (no padded rows)"))
    rows, costs = [], {}
    for flow, impl, c, label in plan:
        key = (label, FLOWS[flow].kind)
        if key not in costs:  # the same in every flow of one kind
            costs[key] = measure([resolve(c, impl)], [c.num_requests])[0]
        rep = run_checked(resolve(c, impl), diagnose=False)
        if progress is not None:
            progress(len(rows) + 1, len(plan), f"{label}, {flow} flow")
        failed, ratio, syncs = _verdicts(rep)
        state = find_result(rep.checks, "committed_state")
        rows.append({"impl": label, "flow": flow, "syncs_per_step": syncs, "bytes_per_step": costs[key].bytes_per_step,
                     "worst_bound_ratio": ratio, "worst_state_error": state.worst,
                     "precision_ok": not [f for f in failed if f != SYNC_CHECK],
                     "no_syncs": SYNC_CHECK not in failed, "failed_checks": failed,
                     "batch": f"{c.num_requests} requests + {c.num_padded} padded"})
    return rows


# --------------------------------------------------------------------- render
def _num(v: Optional[float], digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}g}"


def mutants_markdown(rows: Sequence[dict], cfg: Config) -> str:
    caught = sum(r["caught"] for r in rows)
    lines = [f"**Mutation score: {caught}/{len(rows)} caught** ({cfg.name}, every PR-gating check; precision "
             f"mutants over {mutant_steps('precision', cfg.steps)} steps, sync and semantic ones over "
             f"{mutant_steps('sync', cfg.steps)})", "",
             "| mutant | flow | direction | what it does | modelled on | caught by |", "|---|---|---|---|---|---|"]
    for r in rows:
        by = ", ".join(CHECKS.title(k) for k in r["caught_by"]) if r["caught"] else "**NOT CAUGHT**"
        lines.append(f"| `{r['mutant']}` | {r.get('flow', '-')} | {r['direction']} | {r['description']} | "
                     f"{r['thread'] or '-'} | {by} |")
    return "\n".join(lines)


def tradeoff_markdown(rows: Sequence[dict], cfg: Config) -> str:
    lines = [f"Trade-off on {cfg.name} ({cfg.steps} steps), in each state flow (" + "; ".join(
        f"`{f}`: {FLOWS[f].engine}" for f in dict.fromkeys(r["flow"] for r in rows)) + "):", "",
             "| implementation | flow | syncs/step | bytes/step | worst state error | worst drift/bound | precision "
             "| sync free |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['impl']}` | {r['flow']} | {_num(r['syncs_per_step'])} | "
                     f"{r['bytes_per_step'] / 2**20:.3g} MiB | {_num(r['worst_state_error'])} | "
                     f"{_num(r['worst_bound_ratio'])} | {'PASS' if r['precision_ok'] else 'FAIL'} | "
                     f"{'PASS' if r['no_syncs'] else 'FAIL'} |")
    return "\n".join(lines)
