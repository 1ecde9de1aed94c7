"""The check of a churning lifecycle's events (drift/lifecycles.py, docs/semantics.md §12): every request
that starts -- a prefill, a prefix-cache hit, a resume -- finds exactly its start where its first verify
reads it. The simulation compares, between steps, what the flow's slots hold for the lane with the start
a correct engine stores (``drift.simulate.Simulation._check_starts``); this check reports the first
mismatch with the step, the slot and both of the slot's holders (a finished request's state leaking into
the next owner, a restore from the wrong snapshot, an index that points elsewhere)."""

from __future__ import annotations

from .registry import CHECKS, CheckSpec, RunContext
from .result import CheckResult


def starts_result(ctx: RunContext) -> CheckResult:
    sim = ctx.sim
    name = CHECKS.title("request_starts")
    found, checked = sim.start_findings, sim.starts_checked
    if not checked:
        return CheckResult(name, False, None, 0.0, "", "no request started (a check that saw nothing cannot pass)")
    if not found:
        return CheckResult(name, True, 0.0, 0.0, "",
                           f"{checked} request starts: each first verify read its exact start "
                           f"({', '.join(f'{n} {k}' for k, n in sim.events.starts.items() if n)})")
    f = next((x for x in found if x["previous"]), found[0])  # a leak names both holders where it can
    src = f" from request {f['source']}'s snapshot" if f["source"] >= 0 else ""
    if f.get("restore_bits"):
        src += f", whose restore differs from the snapshot the cache keeps in {f['restore_bits']} bits"
    prev = f"; the slot's previous holder: {f['previous']}" if f["previous"] else ""
    return CheckResult(
        name, False, float(f["state_bits"] + f["window_values"] + f.get("restore_bits", 0)), 0.0,
        f"step {f['step']}, lane {f['lane']}, request {f['request']}, slot {f['slot']}",
        f"{len(found)}{'+' if len(found) == 20 else ''} of {checked} request starts read another start (the first at "
        f"step {found[0]['step']}); request "
        f"{f['request']} ({f['start']}{src}) found {f['state_bits']} state elements and {f['window_values']} conv "
        f"inputs other than its start in slot {f['slot']} ({f['holder']}){prev}. A new request must not inherit "
        "what the slot held (the engine clears it before the prefill, or restores the snapshot it matched).",
        extra={"findings": found})


CHECKS.add(CheckSpec(
    "request_starts", "request starts", 105, "a request that starts (prefill, prefix hit, resume) finds something "
    "else than its start where its first verify reads it: the step, the slot and both of its holders "
    "(`--lifecycle serving` only)", "run", applies=lambda ctx: ctx.cfg.serving.churn and ctx.mode == "mtp",
    result=starts_result))
