"""Fail fast: the host-sync scan runs first and a sync fails ``drift run`` at once (unless
--all-checks); --fail-fast ends a precision run at the chunk where a check first fails; the scan
re-checks real steps sampled over the run's horizon and says how many it checked."""

from __future__ import annotations

import inspect
import re

from drift.check.registry import title
from drift.cli import main
from drift.config import preset
from drift.errors import EXIT_FAIL, EXIT_PASS
from drift.flows.copy_commit import updates as parts
from drift.syncs.scan import RUN_SAMPLE, sync_check
from drift.runspec import resolve
from drift.runner import TIMINGS, run_checked
from drift.simulate import FIRST_CHUNK, Simulation


def _rows(out: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in re.finditer(r"^(\w[\w ]*?)\s{2,}(PASS|FAIL|n/a|info)\b", out, re.M)}


def test_a_sync_fails_the_run_before_the_simulation(capsys):
    rc = main(["run", "--update", "sglang-32130", "--steps", "512", "--quiet"])
    out = capsys.readouterr().out
    rows = _rows(out)
    assert rc == EXIT_FAIL and rows == {title("host_syncs"): "FAIL", "precision checks": "n/a"}, out
    line = next(i for i, t in enumerate(inspect.getsource(parts).splitlines(), 1) if "[mask]" in t)
    assert "0 steps" in out and f"copy_commit/updates.py:{line}" in out  # no step simulated; the row names the line


def test_all_checks_runs_the_full_table_despite_a_sync(capsys):
    rc = main(["run", "--update", "sglang-32130", "--steps", "8", "--quiet", "--all-checks"])
    rows = _rows(capsys.readouterr().out)
    assert rc == EXIT_FAIL and rows[title("host_syncs")] == "FAIL" and rows[title("committed_state")] == "PASS"
    assert "precision checks" not in rows


def test_fail_fast_stops_at_the_first_failing_chunk(capsys):
    rc = main(["run", "--update", "mutant:step_minus1", "--steps", "2048", "--quiet", "--fail-fast"])
    out = capsys.readouterr().out
    steps = int(re.search(r"update mutant:step_minus1, (\d+) steps", out).group(1))
    # Committing one step back is order-one wrong from the first step: the run ends after its first
    # chunk, a fail-fast run's FIRST_CHUNK steps (not the stream's 256), not at 2048.
    assert rc == EXIT_FAIL and 0 < steps <= FIRST_CHUNK, out
    assert _rows(out)[title("run_completed")] == "FAIL" and "stopped early: fail-fast:" in out  # the stop names why, as under pytest -x


def test_a_fail_fast_run_ramps_its_chunks_up_to_the_streams():
    sim = Simulation(resolve(preset("ci-small", steps=4096)))
    assert [sim.chunk_size(d) for d in (0, 16, 32, 64, 128, 256, 512, 4000)] == [sim.stream.chunk_steps] * 8
    sim.ramp = True
    done, sizes = 0, []
    while done < 1024:
        sizes.append(sim.chunk_size(done))
        done += sizes[-1]
    assert sim.stream.chunk_steps == 256 and sizes == [16, 16, 32, 64, 128, 256, 256, 256], sizes


def _figures(rep) -> dict:
    d = rep.to_dict()
    d["run"] = {k: v for k, v in d["run"].items() if k not in TIMINGS}
    return d


def test_the_ramp_moves_where_checks_run_not_what_they_find():
    """A passing run's report is the same, field for field but its timing, with fail-fast's short
    first chunks as with the stream's (the measures and checks do not depend on chunk boundaries),
    in the fixed batch and under serving; the stepped control: a run stopped early differs."""
    for lifecycle in ("fixed", "serving"):
        run = resolve(preset("ci-small", steps=300, lifecycle=lifecycle))
        plain, ramped = (run_checked(run, sync_scan=False, fail_fast=ff) for ff in (False, True))
        assert plain.passed and ramped.passed and ramped.info.steps == 300
        assert plain.info.meta["lifecycle"] == lifecycle and (lifecycle == "fixed" or plain.info.meta["events"]["ends"])
        assert _figures(ramped) == _figures(plain), lifecycle
    short = run_checked(run, steps=296, sync_scan=False)
    assert _figures(short) != _figures(plain)  # the comparison sees a difference where there is one


def test_fail_fast_leaves_a_passing_run_whole(capsys):
    # Negative control: nothing fails, so every asked step runs.
    assert main(["run", "--steps", "24", "--quiet", "--fail-fast"]) == EXIT_PASS
    assert ", 24 steps" in capsys.readouterr().out


def test_the_scan_rechecks_real_steps_sampled_over_the_horizon():
    cfg = preset("ci-small", steps=4096)
    plain = sync_check(resolve(cfg), device="none")
    res = sync_check(resolve(cfg), device="none", sample=RUN_SAMPLE)
    assert plain.extra["steps_checked"] == 4 and plain.extra["sampled"] == 0
    assert res.passed and res.extra["sampled"] >= RUN_SAMPLE - 1  # step 0 may coincide with a probe step
    assert res.extra["steps_checked"] == 4 + res.extra["sampled"]
    assert max(res.extra["steps"]) == 4095 and "sampled over steps 0-4095" in res.detail
    bad = sync_check(resolve(cfg, "sglang-32130"), device="none", sample=RUN_SAMPLE)
    assert not bad.passed and bad.extra["steps_checked"] == res.extra["steps_checked"]
