"""Teeth: the mutation score of the PR-gating checks and the both-directions trade-off table.

``drift mutants`` runs every regression of :mod:`drift.plug.mutants` through the PR-gating checks
and records which checks caught it; ``drift tradeoff`` runs every built-in and reports, per
implementation, syncs and bytes per step, the worst drift-to-bound ratio and a verdict in
each direction (the seesaw of the sglang #32130 review). Both report what they measure.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from ..check.registry import CHECKS, find_result
from ..config import Config, find_profile, flow_options
from ..flows.registry import FLOW_KINDS, FLOWS, UPDATES, default_update, flows_of
from ..plug.loader import load_update, mutant_config
from ..plug.mutants import MUTANTS
from ..runner import run_checked
from ..runspec import resolve
from ..syncs.costmodel import measure
from ..syncs.scan import step_indices

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


def _verdict(ok: bool, failed: Sequence[str], besides: str) -> str:
    """PASS, or FAIL naming the failed checks (their titles) other than ``besides``, as ``--json`` has them."""
    return "PASS" if ok else "FAIL: " + ", ".join(CHECKS.title(k) for k in failed if k != besides)


def tradeoff_markdown(rows: Sequence[dict], cfg: Config) -> str:
    lines = [f"Trade-off on {cfg.name} ({cfg.steps} steps), in each state flow (" + "; ".join(
        f"`{f}`: {FLOWS[f].engine}" for f in dict.fromkeys(r["flow"] for r in rows)) + "):", "",
             "| implementation | flow | syncs/step | bytes/step | worst state error | worst drift/bound | precision "
             "| sync free |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['impl']}` | {r['flow']} | {_num(r['syncs_per_step'])} | "
                     f"{r['bytes_per_step'] / 2**20:.3g} MiB | {_num(r['worst_state_error'])} | "
                     f"{_num(r['worst_bound_ratio'])} | {_verdict(r['precision_ok'], r['failed_checks'], SYNC_CHECK)} | "
                     f"{'PASS' if r['no_syncs'] else 'FAIL'} |")
    return "\n".join(lines)


# ------------------------------------------------------------- design trade-off
# The design table (docs/teeth.md, README.md): each flow kind's TRADEOFF_DESIGNS on ci-small at the
# PR gate's horizon (4,096 steps, measured into DESIGN_RECORD) and at the nightly's (from a merged
# `drift nightly --design-table` report, summarised into DESIGN_NIGHTLY).
DESIGN_STEPS = 4096
DESIGN_RECORD = "docs/design_tradeoff.json"
DESIGN_NIGHTLY = "docs/design_nightly.json"


def design_config(cfg: Config, flow: str, design) -> Config:
    """``cfg`` in ``flow`` with a design configuration (``FlowKind.TRADEOFF_DESIGNS``): its options,
    its checkpoint dtype (the dense profile of that state dtype) and its fold store rounding."""
    profile = find_profile(f"{design.ssm_dtype} states in dense tensors",
                           lambda p, lay: p.ssm_dtype == design.ssm_dtype and lay.dense)
    return cfg.replace(flow=flow, flow_options=flow_options(dict(design.options)),
                       store_rounding=design.store_rounding).with_profile(profile)


def design_entry_key(cfg: Config, flow: str, design) -> str:
    """The key of a design configuration's entry in a ``drift nightly --design-table`` report of
    ``cfg``'s preset and seed (drift/jobs/nightly.py: design_matrix)."""
    from .nightly import Entry, design_variant

    return Entry(cfg.name, cfg.seed, default_update(FLOWS[flow].kind), design_variant(design), None, flow=flow,
                 flow_options=flow_options(dict(design.options))).key


def design_tradeoff(cfg: Config, progress: Optional[Callable[..., None]] = None) -> list[dict]:
    """One row per design configuration of each flow kind that has them, in the kind's first flow, on
    ``cfg`` (its steps: the PR gate's horizon): the bytes per step its kernels move by part
    (``FlowKind.design_traffic`` over the stream's accept lengths), its worst committed-state error
    and drift/bound ratio, and whether every PR-gating check passed."""
    plan = [(kind, flows_of(name)[0], d) for name, kind in FLOW_KINDS.items() if kind.TRADEOFF_DESIGNS and flows_of(name)
            for d in kind.TRADEOFF_DESIGNS]
    rows = []
    for kind, flow, d in plan:
        c = design_config(cfg, flow, d)
        last, _ = step_indices(c, c.steps)
        traffic = kind.design_traffic(c, (last[:, :c.num_requests] + 1).clamp(min=0).numpy())
        rep = run_checked(resolve(c), diagnose=False)
        failed, ratio, _ = _verdicts(rep)
        rows.append({"label": d.label, "note": d.note, "flow": flow, "options": dict(d.options),
                     "checkpoint": d.ssm_dtype, "store_rounding": d.store_rounding, "steps": c.steps,
                     "traffic": {k: round(v, 1) for k, v in traffic.items()}, "worst_bound_ratio": ratio,
                     "worst_state_error": find_result(rep.checks, "committed_state").worst,
                     "passed": not failed, "failed_checks": failed,
                     "nightly_key": design_entry_key(cfg, flow, d)})
        if progress is not None:
            progress(len(rows), len(plan), d.label)
    return rows


def machine_text() -> str:
    """Where a measurement ran: the CPU (architecture and cores) and torch's version."""
    import os
    import platform

    import torch

    return f"{platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__.split('+')[0]}"


def design_record(rows: Sequence[dict], cfg: Config, when: str) -> dict:
    """The committed record of a design trade-off measurement (:data:`DESIGN_RECORD`)."""
    return {"preset": cfg.name, "seed": cfg.seed, "steps": cfg.steps, "machine": machine_text(), "date": when,
            "traffic_model": {r["flow"]: FLOW_KINDS[FLOWS[r["flow"]].kind].DESIGN_TRAFFIC for r in rows},
            "rows": list(rows)}


def nightly_summary(report: dict, machine: str, when: str) -> dict:
    """A merged ``drift nightly --design-table`` report cut to what the design table shows
    (:data:`DESIGN_NIGHTLY`): per entry its steps, worst drift/bound ratio and committed-state error,
    verdict and failed checks, with the machine it ran on (``machine``: the nightly's report records
    only its device) and the run's date."""
    entries = {}
    for key, e in sorted(report["entries"].items()):
        checks = {c.get("key"): c for c in e["checks"]}
        entries[key] = {"steps": e["steps"], "verdict": e["verdict"],
                        "worst_bound_ratio": checks.get("drift_bound", {}).get("worst"),
                        "worst_state_error": checks.get("committed_state", {}).get("worst"),
                        "failed_checks": [k for k, c in checks.items() if c.get("failed")],
                        "cut": e.get("cut", "")}
    return {"machine": machine, "device": report.get("device"), "date": when, "versions": report.get("versions"),
            "shards": report.get("shard"), "seconds": report.get("timings", {}), "entries": entries}


def _mib(n: float) -> str:
    return f"{n / 2 ** 10:.0f} KiB" if n < 2 ** 20 else f"{n / 2 ** 20:.3g} MiB"


def _options_text(r: dict) -> str:
    opts = ", ".join(f"{k} {v}" for k, v in sorted(r["options"].items())) or "the defaults"
    store = "" if r["store_rounding"] == "rne" else f", {r['store_rounding']} fold store"
    return f"{opts}; {r['checkpoint']} checkpoint{store}"


def _long(nightly: Optional[dict], r: dict) -> Optional[dict]:
    return (nightly or {}).get("entries", {}).get(r["nightly_key"])


def design_markdown(record: dict, nightly: Optional[dict]) -> str:
    """The design trade-off table of :data:`DESIGN_RECORD` with the nightly's column (None: not run)."""
    rows = record["rows"]
    horizon = "not run yet"
    if nightly:
        steps = sorted({e["steps"] for e in nightly["entries"].values()})
        horizon = (f"{', '.join(f'{s:,}' for s in steps)} steps, `drift nightly --design-table` on {nightly['machine']} "
                   f"({nightly['date']}, shards {nightly['shards']})")
    flows = ", ".join(f"`{f}`" for f in dict.fromkeys(r["flow"] for r in rows))
    lines = [f"Designs of the {flows} flow's commit on {record['preset']} (seed {record['seed']}), each judged by its "
             "own bound: the "
             f"worst drift/bound at {record['steps']:,} steps measured on {record['machine']} ({record['date']}); at "
             f"the nightly's horizon: {horizon}.", "",
             f"| configuration | design | shipped by | ring | checkpoint | fold | total / step | worst state error, "
             f"{record['steps']:,} | drift/bound, {record['steps']:,} | drift/bound, nightly | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t, long = r["traffic"], _long(nightly, r)
        late = "not run" if long is None else f"{_num(long['worst_bound_ratio'])} ({long['steps']:,} steps)"
        verdict = "PASS" if r["passed"] and (long is None or long["verdict"] == "pass") else "FAIL"
        failed = [(record["steps"], r["failed_checks"])] if not r["passed"] else []
        if long is not None and long["verdict"] != "pass":
            failed.append((long["steps"], long["failed_checks"]))
        where = ("; ".join(f"{n:,} steps: {', '.join(CHECKS.title(k) for k in keys)}" for n, keys in failed)
                 if failed else "" if long is not None else f"{record['steps']:,} steps")
        where = f" ({where})" if where else ""
        lines.append(f"| {r['label']} | {_options_text(r)} | {r['note']} | {_mib(t['ring'])} | {_mib(t['checkpoint'])} | "
                     f"{_mib(t['fold'])} | {_mib(sum(t.values()))} | {_num(r['worst_state_error'])} | "
                     f"{_num(r['worst_bound_ratio'])} | {late} | {verdict}{where} |")
    lines += ["", "Bytes per decode step, modelled from the kernels' own storage (not drift's torch temporaries): "
              + "; ".join(record["traffic_model"].values()) + ".", "", design_summary(record, nightly)]
    return "\n".join(lines)


def design_summary(record: dict, nightly: Optional[dict]) -> str:
    """The table's conclusions: the cheapest configuration within its own bound at every horizon
    measured, and whether a TF32 fold holds at the nightly's horizon."""
    rows = record["rows"]
    ok = [r for r in rows if r["passed"] and (_long(nightly, r) is None or _long(nightly, r)["verdict"] == "pass")]
    text = "No configuration stays within its bound." if not ok else ""
    if ok:
        best = min(ok, key=lambda r: sum(r["traffic"].values()))
        measured = "the PR gate's and the nightly's horizons" if _long(nightly, best) else f"{record['steps']:,} steps"
        text = (f"The cheapest configuration within its own bound ({measured}): **{best['label']}** "
                f"({_options_text(best)}), {_mib(sum(best['traffic'].values()))} per step.")
    tf32 = [r for r in rows if r["options"].get("fold-contraction") == "tf32"]
    for r in tf32:
        long = _long(nightly, r)
        if long is None:
            text += f" A TF32 fold ({r['label']}): not yet run at the nightly's horizon (it holds at {record['steps']:,} steps: " \
                    f"{'yes' if r['passed'] else 'no'})."
        else:
            text += (f" A TF32 fold ({r['label']}) {'holds' if long['verdict'] == 'pass' else 'does not hold'} at "
                     f"{long['steps']:,} steps (worst drift/bound {_num(long['worst_bound_ratio'])}).")
    return text
