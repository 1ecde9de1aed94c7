"""Every known regression is caught, correct implementations raise no alarm, and the
mutation score and trade-off table of docs/teeth.md are what the code measures."""

from __future__ import annotations

from pathlib import Path

import pytest

from drift.config import preset

from drift.flows.registry import FLOWS
from drift.plug.mutants import MUTANTS
from drift.runner import run_checked
from drift.jobs.teeth import (TEETH_STEPS, catalogue, mutant_steps, mutants_markdown, tradeoff,
                              tradeoff_markdown)
from drift.runspec import resolve

TEETH_DOC = Path(__file__).resolve().parents[2] / "docs" / "teeth.md"  # the tables, from scripts/update_readme.py
# The tests of the catalogue and the trade-off share one worker under pytest-xdist (--dist
# loadgroup, pyproject.toml): those module fixtures are computed once, not once per worker.
SHARED_RUNS = pytest.mark.xdist_group("teeth")
CFG = preset("ci-small", steps=TEETH_STEPS)
# Which checks must catch each direction: syncs by the detector, semantic slips by the
# semantic checks (state, windows, snapshots, slots), precision losses by the bound.
EXPECTED = {"sync": {"host_syncs"},
            "semantics": {"committed_state", "conv_windows", "tracked_snapshots", "untouched_slots",
                          "finite_states", "outputs"},
            "precision": {"drift_bound"}}


@pytest.fixture(scope="module")
def results():
    return {r["mutant"]: r for r in catalogue(CFG)}


def test_catalogue_covers_both_directions_and_the_semantics():
    directions = [m.direction for m in MUTANTS.values()]
    assert len(MUTANTS) >= 12
    assert directions.count("sync") >= 5 and directions.count("precision") >= 3
    assert directions.count("semantics") >= 5
    assert all(m.description and m.target in ("update", "kernel") for m in MUTANTS.values())


def test_precision_mutants_run_the_whole_horizon_and_the_others_a_quarter():
    assert mutant_steps("precision", 512) == 512 and mutant_steps("precision", 40) == 40
    assert mutant_steps("sync", 512) == mutant_steps("semantics", 512) == 128
    assert mutant_steps("semantics", 100) == 64 and mutant_steps("sync", 40) == 40  # at least 64, at most all


@SHARED_RUNS
@pytest.mark.parametrize("name", list(MUTANTS))
def test_mutant_is_caught_by_its_direction(results, name):
    r = results[name]
    assert r["steps"] == (TEETH_STEPS if r["direction"] == "precision" else mutant_steps("sync", TEETH_STEPS))
    assert r["caught"], f"{name} was not caught by any PR-gating check"
    assert EXPECTED[r["direction"]] & set(r["caught_by"]), (name, r["caught_by"])


@SHARED_RUNS
def test_skipping_step0_is_caught_by_the_state_check_and_the_bound(results):
    """The PR twin of tests/check/test_precision.py's nightly test_skipping_step0_commits_fails: the lost
    update of a step-0 row is an order-one state error and past the bound."""
    assert {"committed_state", "drift_bound"} <= set(results["skip_step0"]["caught_by"]), results["skip_step0"]


def _replay_run(overrides: dict, update=None):
    """A checked run of the sglang-replayssm flow on the catalogue's config under a mutant's overrides."""
    overrides = dict(overrides)
    profile = overrides.pop("profile", None)
    cfg = CFG.replace(flow=next(f for f in FLOWS if FLOWS[f].kind == "kernel-commit"), **overrides)
    return run_checked(resolve(cfg.with_profile(profile) if profile else cfg, update), diagnose=False)


def test_the_fold_mutants_fail_where_the_design_they_break_passes():
    """Each fold mutant's negative control (docs/teeth.md): under the mutant's own configuration the
    released commit passes -- the declared fp32 fold, SGLang's bf16-split ring at the same tiny writes
    (fp32's range), the fold store as declared -- so what the catalogue catches is the mutant's part."""
    from drift.flows.kernel_commit.design import RING_RECORDS_OPTION
    from drift.plug.mutants import FP16_RING_TINY_WRITES, FP32_FOLD

    assert _replay_run(FP32_FOLD).passed
    default_ring = {**FP16_RING_TINY_WRITES, "flow_options": tuple(
        (n, v) for n, v in FP16_RING_TINY_WRITES["flow_options"] if n != RING_RECORDS_OPTION)}
    assert _replay_run(default_ring).passed


def test_a_declared_stochastic_fold_store_passes():
    """--rounding stochastic under the kernel-commit flow is the declared stochastic fold store (its
    bound counts 1/6 ulp^2 a store): the released commit passes, and so does the
    replay_stochastic_fold mutant's code once the run declares what it does."""
    assert _replay_run({"store_rounding": "stochastic"}).passed
    assert _replay_run({"store_rounding": "stochastic"}, "mutant:replay_stochastic_fold").passed


# The PR suite runs the catalogue's horizon; the nightly twins run the same assertions twice
# (the catalogue) and eight times (the correct updates) as long: a slow precision loss and a false
# alarm both grow with the horizon.


@pytest.mark.nightly
@pytest.mark.parametrize("name", list(MUTANTS))
def test_mutant_is_caught_over_a_longer_horizon(name):
    [r] = catalogue(CFG.replace(steps=2 * TEETH_STEPS), names=[name])
    assert r["caught"] and EXPECTED[r["direction"]] & set(r["caught_by"]), (name, r["caught_by"])


# Five seeds per implementation under the nightly marker; in the PR suite one each, not seed 0:
# the trade-off runs both implementations on seed 0 over the same horizon, and
# test_tradeoff_reports_the_seesaw asserts sglang-0.5.23 passes every check there and
# sglang-32130 every check but the host sync of its tracking path (off here).
# The kernel-commit flow's released commit (SGLang's ReplaySSM) joins them under its own flow, seed 3.
SEEDS = range(5)
PR_SEEDS = {"sglang-0.5.23": (1,), "sglang-32130": (2,), "sglang-0.5.23-replayssm": (3,)}
RELEASED = (("sglang-0.5.23", True, "sglang"), ("sglang-32130", False, "sglang"),
            ("sglang-0.5.23-replayssm", True, next(f for f in FLOWS if FLOWS[f].kind == "kernel-commit")))
NO_ALARM = [pytest.param(impl, tracking, flow, seed, steps, id=f"{impl}-{tracking}-{seed}-{label}",
                         marks=marks)
            for steps, label, marks in ((TEETH_STEPS, f"pr{TEETH_STEPS}", ()),
                                        (8 * TEETH_STEPS, f"long{8 * TEETH_STEPS}", pytest.mark.nightly))
            for impl, tracking, flow in RELEASED
            for seed in SEEDS if marks or seed in PR_SEEDS[impl]]


@pytest.mark.parametrize("impl,tracking,flow,seed,steps", NO_ALARM)
def test_correct_implementations_raise_no_alarm(impl, tracking, flow, seed, steps):
    cfg = CFG.replace(seed=seed, steps=steps, flow=flow)
    cfg = cfg if tracking else cfg.replace(track_interval=0)
    rep = run_checked(resolve(cfg, impl))
    assert rep.passed, [c.to_dict() for c in rep.checks if c.failed]


@pytest.fixture(scope="module")
def trade():
    return tradeoff(CFG)


@SHARED_RUNS
def test_tradeoff_reports_the_seesaw(trade):
    rows = {r["impl"]: r for r in trade}
    for r in trade:
        assert set(r) >= {"impl", "syncs_per_step", "bytes_per_step", "worst_bound_ratio", "precision_ok", "no_syncs"}
    assert rows["sglang-31659"]["syncs_per_step"] >= 1 and not rows["sglang-31659"]["no_syncs"]
    assert not rows["sglang-32130"]["no_syncs"] and rows["sglang-32130"]["precision_ok"]
    assert rows["sglang-0.5.23"]["no_syncs"] and rows["sglang-0.5.23"]["precision_ok"]
    assert rows["sglang-0.5.23"]["syncs_per_step"] == 0
    # #31659's guard skips the commit when every row accepted one token, losing that update (a
    # semantic error and past the bound) in both flows; with a padded row (step -1) in the batch
    # it never fires.
    for r in trade:
        if r["impl"] == "sglang-31659 (no padded rows)":
            assert {"committed_state", "drift_bound"} <= set(r["failed_checks"]), r
            assert not r["precision_ok"]
        elif r["impl"] == "sglang-31659":
            assert r["precision_ok"] and r["failed_checks"] == ["host_syncs"], r
    assert {r["flow"] for r in trade} == set(FLOWS.names())


def _section(name: str) -> str:
    text = TEETH_DOC.read_text()
    start, end = f"<!-- drift:{name} -->", f"<!-- /drift:{name} -->"
    assert start in text and end in text, f"docs/teeth.md lacks the {name} markers"
    return text.split(start, 1)[1].split(end, 1)[0].strip()


@SHARED_RUNS
def test_readme_shows_the_measured_mutation_score(results):
    assert _section("mutants") == mutants_markdown(list(results.values()), CFG).strip(), \
        "docs/teeth.md mutation score is stale: run python scripts/update_readme.py"


@SHARED_RUNS
def test_readme_shows_the_measured_tradeoff(trade):
    assert _section("tradeoff") == tradeoff_markdown(trade, CFG).strip(), \
        "docs/teeth.md trade-off table is stale: run python scripts/update_readme.py"


# The plug-in row of `drift tradeoff --update`: a run of 64 steps on one flow is enough to tell a
# correct implementation (PASS, no syncs) from an off-by-one (precision FAIL from step 0).
ENGINE_METHOD = (f"{Path(__file__).resolve().parents[1] / 'fixtures' / 'ascend_backend.py'}:"
                 "AscendHybridLinearAttnBackend.update_mamba_state_after_mtp_verify")


def test_tradeoff_adds_the_users_implementation_as_a_row(capsys):
    import json

    from drift.cli import main

    assert main(["tradeoff", "--flow", "sglang", "--steps", "64", "--json", "--quiet",
                 "--update", ENGINE_METHOD, "--update", "mutant:step_plus1"]) == 0
    rows = {r["impl"]: r for r in json.loads(capsys.readouterr().out)}
    assert {r["flow"] for r in rows.values()} == {"sglang"}  # --flow: that flow only
    assert rows[ENGINE_METHOD]["precision_ok"] and rows[ENGINE_METHOD]["no_syncs"]
    assert not rows["mutant:step_plus1"]["precision_ok"]  # the control: a wrong row says so
    assert "sglang-0.5.23" in rows  # the built-ins stay beside it


def test_tradeoff_refuses_an_update_that_does_not_load(tmp_path, capsys):
    from drift.cli import main

    assert main(["tradeoff", "--steps", "64", "--quiet", "--update", f"{tmp_path / 'nosuch.py'}:f"]) == 2
    err = capsys.readouterr().err
    assert "not found" in err and "Traceback" not in err


# ------------------------------------------------------------- the design trade-off
ROOT = Path(__file__).resolve().parents[2]


def _design_records():
    from drift.fileio import read_json
    from drift.jobs.teeth import DESIGN_NIGHTLY, DESIGN_RECORD

    record = read_json(ROOT / DESIGN_RECORD, "design record", "run python scripts/update_readme.py --designs-only")
    nightly = read_json(ROOT / DESIGN_NIGHTLY, "design nightly", "-") if (ROOT / DESIGN_NIGHTLY).exists() else None
    return record, nightly


def test_the_design_table_is_rendered_from_its_records():
    """docs/teeth.md's and README.md's design blocks are what the records render to; negative control:
    a record with one figure changed renders another table."""
    import copy

    from drift.jobs.teeth import design_markdown, design_summary

    record, nightly = _design_records()
    assert _section("designs") == design_markdown(record, nightly).strip(), \
        "docs/teeth.md design trade-off is stale: run python scripts/update_readme.py --help-only"
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- drift:designs -->", 1)[1].split("<!-- /drift:designs -->", 1)[0].strip()
    assert block == design_summary(record, nightly).strip()
    changed = copy.deepcopy(record)
    changed["rows"][0]["worst_bound_ratio"] *= 1.5
    assert design_markdown(changed, nightly) != design_markdown(record, nightly)


def test_the_design_records_hold_the_kinds_configurations_and_their_modelled_bytes():
    """One row per FlowKind.TRADEOFF_DESIGNS entry, in order, at least six, with the bytes the traffic
    model gives for the stream's accept lengths (recomputed here); the nightly column's keys are those
    `drift nightly --design-table` writes."""
    from drift.flows.registry import FLOW_KINDS
    from drift.jobs.nightly import design_matrix
    from drift.jobs.teeth import DESIGN_STEPS, design_config
    from drift.syncs.scan import step_indices

    record, nightly = _design_records()
    designs = [(k, d) for k in FLOW_KINDS.values() for d in k.TRADEOFF_DESIGNS]
    assert len(designs) >= 6 and [r["label"] for r in record["rows"]] == [d.label for _, d in designs]
    assert record["steps"] == DESIGN_STEPS and record["preset"] == CFG.name
    cfg = CFG.replace(steps=DESIGN_STEPS)
    for r, (kind, d) in zip(record["rows"], designs):
        c = design_config(cfg, r["flow"], d)
        last, _ = step_indices(c, c.steps)
        traffic = kind.design_traffic(c, (last[:, :c.num_requests] + 1).clamp(min=0).numpy())
        assert r["traffic"] == {k: round(v, 1) for k, v in traffic.items()}, r["label"]
    keys = {e.key for e in design_matrix("table", [CFG.name], [0], None, None)}
    assert {r["nightly_key"] for r in record["rows"]} == keys
    if nightly is not None:
        assert set(nightly["entries"]) <= keys


DESIGN_ROWS = [pytest.param(0, id="design-0")] + [pytest.param(i, id=f"design-{i}", marks=pytest.mark.nightly)
                                                   for i in range(1, 8)]


@pytest.mark.parametrize("index", DESIGN_ROWS)
def test_the_recorded_design_column_is_what_the_code_measures(index):
    """Row ``index`` of the record re-measured at its 4,096 steps: the same verdict and, to the three
    significant digits the table shows, the same worst drift/bound and state error (SGLang's row in
    the PR suite; every row under the nightly marker)."""
    from drift.flows.registry import FLOW_KINDS
    from drift.jobs.teeth import DESIGN_STEPS, design_config

    record, _ = _design_records()
    r = record["rows"][index]
    design = [d for k in FLOW_KINDS.values() for d in k.TRADEOFF_DESIGNS][index]
    rep = run_checked(resolve(design_config(CFG.replace(steps=DESIGN_STEPS), r["flow"], design)), diagnose=False)
    bound = next(c for c in rep.checks if c.key == "drift_bound")
    state = next(c for c in rep.checks if c.key == "committed_state")
    assert rep.passed == r["passed"]
    assert f"{bound.worst:.3g}" == f"{r['worst_bound_ratio']:.3g}" and f"{state.worst:.3g}" == f"{r['worst_state_error']:.3g}"


def test_the_tradeoff_tables_precision_fail_names_its_checks():
    """The Markdown table said FAIL where --json names the failed checks (a user trial); now it names them
    too, the host-sync check aside (its own column). The control: a passing row says PASS alone."""
    row = {"impl": "x", "flow": "sglang", "syncs_per_step": 1.0, "bytes_per_step": 2 ** 20, "worst_state_error": 3.9,
           "worst_bound_ratio": 1e3, "no_syncs": False, "batch": "4 requests + 1 padded"}
    failed = dict(row, precision_ok=False, failed_checks=["committed_state", "host_syncs", "drift_bound"])
    passed = dict(row, precision_ok=True, failed_checks=["host_syncs"])
    lines = tradeoff_markdown([failed, passed], CFG).splitlines()[-2:]
    assert "| FAIL: committed state, drift bound | FAIL |" in lines[0], lines[0]
    assert "| PASS | FAIL |" in lines[1], lines[1]
