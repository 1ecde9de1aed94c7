"""Nightly machinery on short runs: report files, resume after a kill, baseline
trend, shards and merge. The long-horizon matrix itself is tests/jobs/test_nightly_long.py."""

from __future__ import annotations

import copy
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from drift.cli import main
from drift.jobs import nightly
from drift.sim import native
from drift.check.registry import CHECKS
from drift.flows.registry import FLOWS

PNG = b"\x89PNG\r\n\x1a\n"
# One worker runs this module under pytest-xdist (--dist loadgroup, pyproject.toml): its module
# fixtures (a short nightly report, an uninterrupted resumable run) are computed once.
pytestmark = pytest.mark.xdist_group("nightly")
ARGS = ["--preset", "ci-small", "--update", "sglang-0.5.23", "--quiet"]


def run_nightly(out: Path, *extra: str) -> int:
    return main(["nightly", *ARGS, "--report", str(out), *extra])


TIMINGS_BLOCK = re.compile(r'^  "timings": \{\n(?:    .*\n)*  \},?\n', re.M)  # the one block that may differ


def deterministic(report_dir: Path) -> dict:
    """Every byte of a report's files except report.json's ``timings`` block (wall-clock seconds)."""
    text = (report_dir / "report.json").read_text()
    kept = TIMINGS_BLOCK.sub("", text, count=1)
    rep = json.loads(text)
    assert rep.pop("timings") and json.loads(kept) == rep  # the block and nothing else was cut
    files = {p.name: p.read_bytes() for p in report_dir.iterdir() if p.suffix in (".md", ".png")}
    return {"json": kept, "files": files}


@pytest.fixture(scope="module")
def short_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("nightly")
    assert run_nightly(out, "--steps", "160") == 0
    return out


def test_short_run_writes_every_report_file(short_report):
    rep = json.loads((short_report / "report.json").read_text())
    assert rep["verdict"] == "pass" and rep["kind"] == "drift-nightly"
    assert set(e["entry"]["variant"] for e in rep["entries"].values()) == set(nightly.VARIANTS)
    for key, e in rep["entries"].items():
        bound = next(c for c in e["checks"] if c["key"] == "drift_bound")
        curves = bound["bound"]["curves"]["rel_err"]
        assert len(curves["step"]) > 5 and np.array(curves["mean"]).shape[1:] == (2, 4)
        assert bound["bound"]["growth_exponent"] and "first_fail" not in bound
        assert e["steps"] == 160 and key in rep["timings"]
    md = (short_report / "report.md").read_text()
    for section in ("Verdict per update and variant", "Worst heads", "Growth exponents", "Trade-off"):
        assert section in md
    # Which GDN verify each entry ran: the native kernel takes the bf16 RNE deployment store
    # (when it builds); stochastic stores need the torch-op path; sequential decode has none.
    verify = {e["entry"]["variant"]: e["verify_kernel"] for e in rep["entries"].values()}
    native_or_not = "portable, native C kernel (CPU)" if native.available() else "portable, torch ops"
    assert verify["rne"] == native_or_not and verify["stochastic"] == "portable, torch ops"
    assert verify["sequential"] == "none (sequential decode)"
    assert "- GDN verify: " + "; ".join(sorted(set(verify.values()))) in md
    import matplotlib.image as mpimg

    for name in ("drift_vs_step.png", "mtp_vs_sequential.png", "rounding_modes.png"):
        data = (short_report / name).read_bytes()
        assert data[:8] == PNG
        img = mpimg.imread(short_report / name)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 300
        assert img.std() > 0.01  # not a blank canvas


def test_failing_entry_gives_nonzero_exit(tmp_path):
    code = main(["nightly", "--preset", "ci-small", "--update", "sglang-32130", "--variant", "rne", "--steps", "40",
                 "--report", str(tmp_path), "--quiet"])
    assert code == 1  # sglang-32130 syncs on its tracking path
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["verdict"] == "fail"
    assert CHECKS.title("host_syncs") in (tmp_path / "report.md").read_text()


def test_bad_arguments_exit_2(tmp_path, cpu_only, capsys):
    assert main(["nightly", "--shard", "3/2", "--report", str(tmp_path)]) == 2
    assert main(["nightly", "--device", "npu", "--report", str(tmp_path)]) == 2
    assert main(["nightly", "--update", "sglang-0.5.2", "--report", str(tmp_path)]) == 2
    assert main(["nightly", "--baseline", str(tmp_path / "none.json"), "--report", str(tmp_path)]) == 2
    assert "none.json not found" in capsys.readouterr().err
    # an update written for another kind of state flow: refused before the first entry runs
    other = next(f for f in FLOWS if FLOWS[f].kind != "copy-commit")
    assert main(["nightly", "--flow", other, "--update", "sglang-0.5.23", "--report", str(tmp_path)]) == 2
    assert "is written for the copy-commit flow kind" in capsys.readouterr().err
    for argv in (["--variant", "bogus"], ["--steps", "0"], ["--seed", "-1"], ["--checkpoint-every", "0"]):
        with pytest.raises(SystemExit) as exc:
            main(["nightly", *argv, "--report", str(tmp_path)])
        assert exc.value.code == 2, argv
    assert not (tmp_path / "report.json").exists()  # rejected before any work


# ci-small steps come in chunks of 256: a 600-step entry writes checkpoints at 256 and 512.
RESUMABLE = [*ARGS, "--variant", "rne", "--steps", "600", "--checkpoint-every", "200"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, dict]:
    """An uninterrupted RESUMABLE run: its report directory (both checkpoints kept, as an unfinished
    entry has them; copy it before changing it) and the deterministic part of its report, which
    every resumed run must reproduce."""
    whole = tmp_path_factory.mktemp("whole")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(nightly, "drop_checkpoints", lambda *args: None)
        assert main(["nightly", *RESUMABLE, "--report", str(whole)]) == 0
    return whole, deterministic(whole)


def test_resume_after_kill_reproduces_the_uninterrupted_report(tmp_path, uninterrupted):
    common = RESUMABLE
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "drift", "nightly", *common, "--report", str(killed)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt = killed / "checkpoints" / "ci-small.seed0.sglang-0.5.23.rne.pt"
    deadline = time.time() + 600
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert ckpt.exists() and proc.poll() is None, "the run ended before its first checkpoint"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "report.json").exists()
    assert main(["nightly", *common, "--report", str(killed), "--resume"]) == 0
    assert deterministic(killed) == uninterrupted[1]
    timings = json.loads((killed / "report.json").read_text())["timings"]
    assert timings != json.loads((uninterrupted[0] / "report.json").read_text())["timings"]  # wall clock: differs
    assert not (killed / ".lock").exists()  # the one the killed run left holds no lock and is gone


def test_baseline_flags_an_injected_regression(short_report, tmp_path):
    rep = json.loads((short_report / "report.json").read_text())
    same = nightly.assemble(rep["entries"], {}, {}, baseline=rep)
    assert same["trend"] == [] and same["verdict"] == "pass"
    better = copy.deepcopy(rep)  # a baseline whose errors were half of today's
    key = next(k for k, e in better["entries"].items() if e["entry"]["variant"] == "rne")
    bound = next(c for c in better["entries"][key]["checks"] if c["key"] == "drift_bound")
    mean = np.array(bound["bound"]["curves"]["rel_err"]["mean"])
    mean[..., 3] *= 0.5  # head 3 only
    bound["bound"]["curves"]["rel_err"]["mean"] = mean.tolist()
    flagged = nightly.assemble(rep["entries"], {}, {}, baseline=better)
    assert flagged["verdict"] == "fail"
    assert {(t["key"], t["head"]) for t in flagged["trend"]} == {(key, 3)}
    assert all(t["ratio"] == pytest.approx(2.0) for t in flagged["trend"])
    nightly.write(flagged, tmp_path)
    assert "Trend against the baseline" in (tmp_path / "report.md").read_text()


def test_shards_cover_the_matrix_and_merge(tmp_path):
    dirs = []
    for k in (1, 2):
        d = tmp_path / f"shard{k}"
        assert run_nightly(d, "--steps", "24", "--variant", "rne", "--variant", "stochastic", "--variant", "fp32",
                           "--shard", f"{k}/2") == 0
        dirs.append(d)
    keys = [set(json.loads((d / "report.json").read_text())["entries"]) for d in dirs]
    assert keys[0] and keys[1] and not keys[0] & keys[1]
    out = tmp_path / "merged"
    assert main(["report", "merge", *map(str, dirs), "-o", str(out)]) == 0
    merged = json.loads((out / "report.json").read_text())
    assert set(merged["entries"]) == keys[0] | keys[1]
    assert (out / "drift_vs_step.png").read_bytes()[:8] == PNG


def test_resume_over_a_damaged_checkpoint_falls_back_and_says_so(tmp_path, capsys, uninterrupted):
    """A damaged newest checkpoint is set aside (kept as *.damaged) and the entry resumes from
    the one before it; with none left it starts over. Either way the report is the one an
    uninterrupted run writes."""
    common = RESUMABLE
    ran = tmp_path / "ran"
    shutil.copytree(uninterrupted[0], ran)
    ckpts = ran / "checkpoints"
    newest, previous = (ckpts / "ci-small.seed0.sglang-0.5.23.rne.pt", ckpts / "ci-small.seed0.sglang-0.5.23.rne.prev.pt")
    assert newest.exists() and previous.exists()  # written at 256 and 512 steps
    (ran / "entries" / "ci-small.seed0.sglang-0.5.23.rne.json").unlink()  # the entry is unfinished again
    newest.write_bytes(newest.read_bytes()[:100])  # torn
    capsys.readouterr()
    assert main(["nightly", *common, "--report", str(ran), "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"checkpoint {newest} cannot be read" in err and "set it aside" in err
    assert (ckpts / (newest.name + ".damaged")).exists()
    assert deterministic(ran) == uninterrupted[1]


def test_a_flow_of_its_own_runs_its_engines_update_and_names_the_flow_in_its_key(tmp_path):
    other = [f for f in FLOWS if FLOWS[f].kind != "copy-commit"][0]
    out = tmp_path / "flow"
    assert main(["nightly", "--preset", "ci-small", "--flow", other, "--steps", "64", "--variant", "rne",
                 "--quiet", "--report", str(out)]) == 0
    entries = json.loads((out / "report.json").read_text())["entries"]
    assert list(entries) == [f"ci-small.seed0.{other}.vllm-0.33.0.rne"]
    assert entries[f"ci-small.seed0.{other}.vllm-0.33.0.rne"]["config"]["flow"] == other
    # Negative control: without --flow the key keeps the form earlier reports have (no flow in it).
    assert nightly.Entry("ci-small", 0, "sglang-0.5.23", "rne", 64).key == "ci-small.seed0.sglang-0.5.23.rne"


def test_the_kernel_commit_flow_runs_every_variant_and_its_design_options(tmp_path, capsys):
    """Its verify stores no state and its fold stores the checkpoint, so the stochastic variant is the
    declared stochastic fold store: every variant runs. A design option (--ring-records) reaches
    every MTP entry and its key, not the sequential one (no MTP state). A design whose bound is not
    derived is refused (exit 2) before any work."""
    flow = next(f for f in FLOWS if FLOWS[f].kind == "kernel-commit")
    out = tmp_path / "ring"
    assert main(["nightly", "--preset", "ci-small", "--flow", flow, "--steps", "16", "--quiet",
                 "--ring-records", "fp32", "--report", str(out)]) == 0
    entries = json.loads((out / "report.json").read_text())["entries"]
    variants = {key.rsplit(".", 1)[1] for key in entries}
    assert variants == set(nightly.VARIANTS)
    for key, e in entries.items():
        mtp = not key.endswith(".sequential")
        assert (["ring-records", "fp32"] in e["config"].get("flow_options", [])) == mtp, key
        assert ("ring-records-fp32" in key) == mtp
    # Negative control: a cadence that would overflow the ring, an error before any work.
    assert main(["nightly", "--preset", "ci-small", "--flow", flow, "--fold-cadence", "every:8", "--steps", "16",
                 "--report", str(tmp_path / "asked")]) == 2
    assert not (tmp_path / "asked" / "report.json").exists()


def test_trend_rows_name_an_integer_step_of_the_run(short_report):
    """The trend compares log bins of steps; a row names the bin's last step both runs reached, an
    integer (4adf604 wrote the bin's centre, 'step 1578.22' for a 1,500-step run)."""
    rep = json.loads((short_report / "report.json").read_text())
    better = copy.deepcopy(rep)
    for e in better["entries"].values():
        bound = next(c for c in e["checks"] if c["key"] == "drift_bound")
        bound["bound"]["curves"]["rel_err"]["mean"] = (np.array(bound["bound"]["curves"]["rel_err"]["mean"]) * 0.5).tolist()
    flagged = nightly.assemble(rep["entries"], {}, {}, baseline=better)["trend"]
    assert flagged and {type(t["step"]) for t in flagged} == {int} and {t["step"] for t in flagged} == {160}
    centre = next(c for c in rep["entries"][flagged[0]["key"]]["checks"] if c["key"] == "drift_bound")
    assert centre["bound"]["curves"]["rel_err"]["step"][-1] > 160  # negative control: the centre is past the run
    from drift.check.metrics import step_bin

    for b in range(8, 80):  # uncapped: the last step of each bin (from 8 on no bin is empty)
        last = nightly._last_step(float(np.round(2.0 ** ((b + 0.5) / 4) - 1.0, 2)))
        assert step_bin(np.array([last, last + 1])).tolist() == [b, b + 1]


def test_the_plots_overlay_the_baseline_dashed_and_labelled(short_report):
    from drift.jobs.plots import nightly_figures

    rep = json.loads((short_report / "report.json").read_text())
    with_base = nightly.assemble(rep["entries"], {}, {}, baseline=rep)

    def dashed(figs) -> set[str]:
        return {line.get_label() for f in figs.values() for ax in f.axes for line in ax.lines
                if line.get_linestyle() == "--" and "baseline" in line.get_label()}

    assert dashed(nightly_figures(with_base, rep)) == {"ci-small seed 0, baseline", "MTP, baseline",
                                                        "sequential, baseline", "round to nearest, bf16, baseline",
                                                        "stochastic rounding, bf16, baseline", "fp32 state, baseline"}
    assert dashed(nightly_figures(with_base)) == set()  # negative control: no baseline, no overlay


CHECKPOINTED = [*ARGS, "--variant", "rne", "--layers", "1", "--steps", "300", "--checkpoint-every", "100"]


def test_a_finished_entry_keeps_no_checkpoint_and_no_lock_is_left(tmp_path):
    out = tmp_path / "plain"
    assert main(["nightly", *CHECKPOINTED, "--report", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["drift_vs_step.png", "entries", "report.json", "report.md"]
    kept = tmp_path / "kept"  # the control: this run did write a checkpoint (at step 256), and keeps it
    assert main(["nightly", *CHECKPOINTED, "--report", str(kept), "--keep-checkpoint"]) == 0
    assert sorted(p.name for p in (kept / "checkpoints").iterdir()) == ["ci-small.seed0.sglang-0.5.23.rne.pt"]
    assert not (kept / ".lock").exists()


def test_no_lock_is_left_after_a_failure_or_an_interrupt(tmp_path, monkeypatch):
    from drift.errors import Terminated

    assert main(["nightly", "--preset", "ci-small", "--update", "sglang-32130", "--variant", "rne", "--steps", "16",
                 "--layers", "1", "--report", str(tmp_path / "fail"), "--quiet"]) == 1
    assert not (tmp_path / "fail" / ".lock").exists()

    def interrupted(*args, **kwargs):
        assert (tmp_path / "int" / ".lock").exists()  # held while it runs
        raise Terminated()

    monkeypatch.setattr(nightly, "run_entry", interrupted)
    assert run_nightly(tmp_path / "int", "--variant", "rne", "--steps", "16") == 143
    assert not (tmp_path / "int" / ".lock").exists()


def test_the_default_matrix_runs_each_kinds_nightly_designs(tmp_path):
    """Without --preset, --flow, --update, --variant or a flow option the matrix holds the released
    update's variants and each flow kind's NIGHTLY_DESIGNS (SGLang's ReplaySSM default, the TF32
    fold, the fp16 ring), in their kind's flow with their options in the key; an empty shard lists them
    without running any. Negative control: a --preset narrows the matrix to the released update's."""
    from drift.flows.registry import FLOW_KINDS

    designs = [d for k in FLOW_KINDS.values() for d in k.NIGHTLY_DESIGNS]
    out = tmp_path / "default"
    n = len(nightly.VARIANTS) + len(designs)
    assert main(["nightly", "--steps", "8", "--shard", f"{n + 1}/{n + 1}", "--quiet", "--report", str(out)]) == 0
    matrix = [nightly.Entry(**m) for m in json.loads((out / "report.json").read_text())["matrix"]]
    assert len(matrix) == n
    kinds = [e for e in matrix if e.flow]
    assert len(kinds) == len(designs) and {e.variant for e in kinds} <= {"rne", "fp32"}
    assert any(dict(e.flow_options).get("fold-contraction") == "tf32" for e in kinds)
    assert any(dict(e.flow_options).get("ring-records") == "fp16" for e in kinds)
    narrowed = tmp_path / "narrowed"
    assert main(["nightly", "--preset", "ci-small", "--steps", "8", "--shard", f"{n + 1}/{n + 1}", "--quiet",
                 "--report", str(narrowed)]) == 0
    assert all(not m.get("flow") for m in json.loads((narrowed / "report.json").read_text())["matrix"])


def test_the_design_table_shards_merge_into_the_tables_nightly_column(tmp_path):
    """`drift nightly --design-table`, sharded and merged, gives one entry per design configuration
    under the keys the design table reads, summarised into its nightly column; --design-table refuses
    an --update (each design runs its kind's released update)."""
    from drift.flows.registry import FLOW_KINDS
    from drift.jobs.teeth import DESIGN_STEPS, design_markdown, nightly_summary

    count = sum(len(k.TRADEOFF_DESIGNS) for k in FLOW_KINDS.values())
    shards = 2
    dirs = []
    for k in range(1, shards + 1):
        d = tmp_path / f"shard{k}"
        assert main(["nightly", "--design-table", "--preset", "ci-small", "--steps", "8", "--layers", "1",
                     "--shard", f"{k}/{shards}", "--quiet", "--report", str(d)]) == 0
        dirs.append(str(d))
    merged = tmp_path / "merged"
    assert main(["report", "merge", *dirs, "-o", str(merged)]) == 0
    report = json.loads((merged / "report.json").read_text())
    assert len(report["entries"]) == count
    summary = nightly_summary(report, "this test's machine", "2026-01-01")
    rows = [{"label": key, "note": "", "flow": "", "options": {}, "checkpoint": "x", "store_rounding": "rne",
             "traffic": {"ring": 1.0, "checkpoint": 1.0, "fold": 1.0}, "worst_bound_ratio": 0.5,
             "worst_state_error": 0.1, "passed": True, "nightly_key": key} for key in report["entries"]]
    text = design_markdown({"preset": "ci-small", "seed": 0, "steps": DESIGN_STEPS, "machine": "m", "date": "d",
                            "traffic_model": {"f": "model"}, "rows": rows}, summary)
    assert "not run |" not in text and "8 steps" in text and "this test's machine" in text
    assert main(["nightly", "--design-table", "--update", "sglang-0.5.23", "--preset", "ci-small", "--steps", "8",
                 "--report", str(tmp_path / "refused")]) == 2


def test_a_small_entry_runs_on_one_intra_op_thread_as_drift_run_does(monkeypatch):
    """run_entry takes run_checked's thread rule (drift/openmp.py: run_threads): a small entry on one torch
    thread, so its comparison may run in a process of its own (on two threads a 4,096-step ci-small nightly
    took 128 s, 22 s of it system time, against 85 s; every report file equal). The count as it was
    afterwards. Fails where the entry runs on torch's count."""
    from drift.runner import CheckedRun
    from helpers import threads_inside

    seen, after, (result, _) = threads_inside(
        monkeypatch, CheckedRun, "run",
        lambda: nightly.run_entry(nightly.Entry("ci-small", 0, "sglang-0.5.23", "rne", 64), "cpu"))
    assert seen == [1] and after == 2
    assert result["verdict"] == "pass" and result["steps"] == 64
