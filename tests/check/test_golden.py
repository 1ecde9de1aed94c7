"""Golden data: content, loading errors, fallback, regeneration (refusal, atomicity, determinism)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from drift.check import golden as gmod
from drift.config import preset
from drift.check.golden import (GOLDEN_PRESETS, GoldenError, golden_dir, golden_lifecycles, load_golden,
                                regenerate, serving_coverage, serving_schedule, _golden_step)
from drift.check.checks import GOLDEN_TOL
from drift.check.compare import Comparison
from drift.fileio import load_npz
from drift.runner import run_checked
from drift.sim.serving import START_PREFILL, START_PREFIX, START_RESUME
from drift.sim.stream import StreamParams, TrueTokens
from drift.runspec import resolve

REPO = Path(__file__).resolve().parents[2]
TINY_STEPS = 40  # a golden horizon of 40 decode steps: ~200 positions, generated in a second


def test_every_pr_gating_preset_has_golden_within_budget():
    manifest = json.loads((golden_dir() / "manifest.json").read_text())
    assert manifest["schema"] == gmod.SCHEMA and manifest["generator_version"] == gmod.GENERATOR_VERSION
    assert golden_lifecycles() == ("fixed", "serving")
    for name in GOLDEN_PRESETS:
        for lifecycle in golden_lifecycles():
            cfg = preset(name).replace(lifecycle=lifecycle)
            entry = manifest["entries"][f"{name}/seed{cfg.seed}" + ("" if lifecycle == "fixed" else f"/{lifecycle}")]
            for key in ("preset", "seed", "config_hash", "generator_version", "torch", "numpy", "created", "files"):
                assert key in entry, key
            assert entry["config_hash"] == cfg.stream_hash()
            g, note = load_golden(cfg)
            assert g is not None and g.serving == cfg.serving.churn, note
            # Enough positions for the preset's horizon under any acceptance pattern (all accept D).
            assert g.max_position >= cfg.prefill_len + 3 * (cfg.num_requests - 1) + cfg.steps * cfg.num_draft_tokens
    total = sum(p.stat().st_size for p in golden_dir().iterdir())
    assert total <= 16 * 2**20, f"golden/ is {total / 2**20:.1f} MiB; the budget is 16 MiB"


@pytest.mark.parametrize("name", GOLDEN_PRESETS)
def test_serving_golden_covers_every_request_the_gate_runs(name):
    """Every request the PR gate's serving run has over the preset's horizon is in the golden data: its
    start as scheduled, a lane's first request at every position (the fixed entry), each later request
    at every committed position and its start; full checkpoints at starts of every kind the horizon has
    after step 0 (prefill, prefix hit, resume)."""
    cfg = preset(name).replace(lifecycle="serving")
    g, note = load_golden(cfg)
    assert g is not None and g.serving and g.steps == cfg.steps, note
    assert serving_coverage(g, cfg) == []
    sched = serving_schedule(cfg)
    later = sched["sched_step"] > 0
    ck = g.arrays["start_ckpt"]
    assert set(g.arrays["sched_code"][ck].tolist()) == set(sched["sched_code"][later].tolist()) == {1, 2, 3}
    # Negative control: past the horizon the data was made for, the later requests' positions are gaps.
    gaps = serving_coverage(g, cfg, steps=cfg.steps + 64)
    assert len(gaps) == 1 and "have no key" in gaps[0], gaps


def test_golden_generator_matches_a_scalar_transcription():
    """The vectorised golden step against naive per-head scalar math for a few tokens: the op's
    inputs quantised as the deployment feeds them (bf16 mix_qkv, fp32 g), then float64."""
    from drift.sim import naive

    cfg = preset("ci-small", num_layers=1, head_k_dim=8, head_v_dim=8, num_requests=1)
    prm_t = StreamParams.generate(cfg)
    prm = {k: getattr(prm_t, k).to(torch.float64) for k in ("A_log", "dt_bias", "conv_weight")}
    x, a, b = (torch.from_numpy(t).to(torch.float64) for t in TrueTokens(cfg).get(0, 0, 6))
    L, R, HV, K, V, C = 1, 1, cfg.num_v_heads, 8, 8, cfg.conv_channels
    h = torch.zeros(L, R, HV, V, K, dtype=torch.float64)
    win = torch.zeros(L, R, cfg.conv_kernel - 1, C, dtype=torch.float64)
    h_ref = torch.zeros(HV, V, K, dtype=torch.float64)
    hist = torch.zeros(cfg.conv_kernel - 1, C, dtype=torch.float64)
    for t in range(6):
        h, win, o = _golden_step(cfg, prm, h, win, x[t][:, None], a[t][:, None], b[t][:, None])
        mix = naive.conv_mix(hist[None, None], x[t, 0][None, None, None], prm_t.conv_weight)[0, 0, 0]
        q, k, v = naive.head_inputs(mix, cfg.num_k_heads, K, HV, V, K ** -0.5)
        for hd in range(HV):
            gg = float(np.float32(naive.gating(float(a[t, 0, hd]), float(prm["A_log"][0, hd]), 0.0)))
            h_ref[hd], _ = naive.gdn_token(h_ref[hd], q[hd], k[hd], v[hd], np.exp(gg), naive.sigmoid(float(b[t, 0, hd])))
        hist = torch.cat([hist, x[t, 0][None]], 0)[1:]
    # Two float64 transcriptions of the same math: agreement to ~1e-15 relative; 1e-12 is ample.
    torch.testing.assert_close(h[0, 0], h_ref, rtol=1e-12, atol=1e-14)
    # Negative control: without the quantisation of the op's inputs the truth is another one,
    # ~2^-9 relative away (bf16 rounding of mix_qkv), far above the tolerance.
    assert not torch.allclose(h[0, 0], _unquantised(cfg, prm, x, a, b), rtol=1e-6, atol=0)


def _unquantised(cfg, prm, x, a, b):
    from drift.sim import naive

    K = V = 8
    HV = cfg.num_v_heads
    h = torch.zeros(HV, V, K, dtype=torch.float64)
    hist = torch.zeros(cfg.conv_kernel - 1, cfg.conv_channels, dtype=torch.float64)
    for t in range(6):
        seq = torch.cat([hist, x[t, 0][None]], 0)
        z = sum(prm["conv_weight"][0, :, m] * seq[m] for m in range(cfg.conv_kernel))
        q, k, v = naive.head_inputs(z / (1 + torch.exp(-z)), cfg.num_k_heads, K, HV, V, K ** -0.5)
        for hd in range(HV):
            gg = naive.gating(float(a[t, 0, hd]), float(prm["A_log"][0, hd]), 0.0)
            h[hd], _ = naive.gdn_token(h[hd], q[hd], k[hd], v[hd], np.exp(gg), naive.sigmoid(float(b[t, 0, hd])))
        hist = seq[1:]
    return h


@pytest.fixture
def tiny_golden(tmp_path, monkeypatch):
    """A golden directory for ci-small over TINY_STEPS, pointed to by DRIFT_GOLDEN_DIR."""
    d = tmp_path / "golden"
    assert regenerate(["ci-small"], directory=d, steps=TINY_STEPS, out=io.StringIO()) == 0
    monkeypatch.setenv("DRIFT_GOLDEN_DIR", str(d))
    return d


def _npz(d: Path, serving: bool = False) -> Path:
    """The fixed entry's file in ``d`` (the serving entry's with ``serving``)."""
    (p,) = [p for p in d.glob("*.npz") if ("-serving-" in p.name) == serving]
    return p


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "schema", "hash", "serving-flip", "serving-hash"])
def test_broken_golden_fails_naming_file_and_fix(tiny_golden, damage):
    serving = damage.startswith("serving-")
    damage = damage.removeprefix("serving-")
    npz, manifest = _npz(tiny_golden, serving), tiny_golden / "manifest.json"
    if damage == "truncate":
        npz.write_bytes(npz.read_bytes()[:-100])
    elif damage == "flip":
        data = bytearray(npz.read_bytes())
        data[len(data) // 2] ^= 0x01
        npz.write_bytes(bytes(data))
    elif damage == "delete":
        npz.unlink()
    else:
        m = json.loads(manifest.read_text())
        if damage == "schema":
            m["schema"] = 99
        else:
            m["entries"]["ci-small/seed0" + ("/serving" if serving else "")]["config_hash"] = "0" * 16
        manifest.write_text(json.dumps(m))
    cfg = preset("ci-small", steps=5, lifecycle="serving" if serving else "fixed")
    with pytest.raises(GoldenError) as err:
        load_golden(cfg)
    msg = str(err.value)
    assert "regen" in msg and ("manifest.json" in msg or npz.name in msg or "preset" in msg)
    # The run fails too; it never quietly falls back.
    with pytest.raises(GoldenError):
        run_checked(resolve(cfg, "sglang-0.5.23"), steps=5, sync_scan=False)


def test_no_golden_falls_back_to_twin_and_says_so(tiny_golden):
    cfg = preset("ci-small", seed=5)  # no entry for seed 5
    g, note = load_golden(cfg)
    assert g is None and "seed 5" in note
    rep = run_checked(resolve(cfg, "sglang-0.5.23"), steps=20, sync_scan=False)
    assert "falling back to the twin" in rep.reference
    golden_row = next(c for c in rep.checks if c.key == "golden")
    assert golden_row.verdict == "n/a" and "no golden" in golden_row.detail


def test_a_pr_gating_preset_without_golden_is_an_error(tmp_path, monkeypatch, capsys):
    """ci-small at its own seed gates PRs: without its golden data drift run stops with exit 2,
    naming the manifest it read and the command that makes the data -- never a quiet n/a. Its serving
    run (drift run's default) needs the serving entry too: without it, the same error, naming it."""
    from drift.cli import main

    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("DRIFT_GOLDEN_DIR", str(empty))
    assert main(["run", "--steps", "4", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"{empty / 'manifest.json'} has no golden data for the PR-gating preset ci-small seed 0" in err
    assert f"drift regen-golden --preset ci-small --golden-dir {empty}" in err
    # Control: another seed is not what gates; it falls back to the twin and says so.
    assert main(["run", "--steps", "4", "--quiet", "--seed", "5"]) == 0
    # The fixed entry alone: the fixed batch runs against it, the serving run stops naming its entry.
    fixed_only = tmp_path / "fixed-only"
    assert regenerate(["ci-small"], directory=fixed_only, steps=4, out=io.StringIO(), lifecycles=("fixed",)) == 0
    monkeypatch.setenv("DRIFT_GOLDEN_DIR", str(fixed_only))
    assert main(["run", "--steps", "4", "--quiet", "--lifecycle", "serving"]) == 2
    err = capsys.readouterr().err
    assert f"{fixed_only / 'manifest.json'} has no golden data for the PR-gating preset ci-small seed 0 " \
           "(lifecycle serving)" in err, err
    assert main(["run", "--steps", "4", "--quiet", "--lifecycle", "fixed"]) == 0


def test_regeneration_into_a_fresh_directory_is_reviewed_against_the_shipped_data(tmp_path, monkeypatch):
    """From an install, `drift regen-golden --golden-dir DIR` writes DIR's own manifest and data
    and prints the diff against what drift ships. (The generator is replaced by the shipped arrays
    for the "identical" case: regenerating 16,000 positions is the nightly's business.)"""
    fixed, serving = (_stored_arrays(golden_dir(), key) for key in ("stagnation/seed0", "stagnation/seed0/serving"))
    monkeypatch.setattr(gmod, "generate", lambda cfg, steps=None: dict(fixed))
    monkeypatch.setattr(gmod, "serving_entry", lambda cfg, steps=None: dict(serving))
    out = io.StringIO()
    d = tmp_path / "mine"
    assert regenerate(["stagnation"], directory=d, out=out) == 0
    for key in ("stagnation/seed0", "stagnation/seed0/serving"):
        assert f"{key}: identical to the golden data drift ships" in out.getvalue(), out.getvalue()
    for lifecycle in golden_lifecycles():
        g, _ = load_golden(preset("stagnation", lifecycle=lifecycle), d)
        assert g is not None and g.path.parent == d
    monkeypatch.undo()
    # A shorter horizon differs from the shipped data: the diff is printed.
    out = io.StringIO()
    assert regenerate(["stagnation"], directory=tmp_path / "short", steps=64, out=out) == 0
    assert "differs from the golden data drift ships" in out.getvalue() and "proj_state: shape" in out.getvalue()
    assert "stagnation/seed0/serving: differs" in out.getvalue() and "key_proj_state: shape" in out.getvalue()


def _stored_arrays(d: Path, key: str) -> dict:
    """The arrays of manifest entry ``key`` in golden directory ``d``."""
    (name,) = json.loads((d / "manifest.json").read_text())["entries"][key]["files"]
    return load_npz(d / name)


def test_run_past_the_golden_horizon_says_so(tiny_golden):
    cfg = preset("ci-small", pattern="all-D")
    rep = run_checked(resolve(cfg, "sglang-0.5.23"), steps=TINY_STEPS + 20, sync_scan=False)
    golden_row = next(c for c in rep.checks if c.key == "golden")
    assert golden_row.passed and golden_row.verdict == "PASS"
    assert "past golden position" in rep.reference and "twin alone" in rep.reference


def test_a_stale_golden_is_caught_by_the_run(tiny_golden, monkeypatch):
    """The twin is validated against golden: a changed stream (other conv weights) fails 'golden'."""
    orig = StreamParams.generate

    def shifted(cfg):
        p = orig(cfg)
        return StreamParams(p.A_log + 0.01, p.dt_bias, p.conv_weight)  # a 1% change of every decay

    monkeypatch.setattr(StreamParams, "generate", staticmethod(shifted))
    rep = run_checked(resolve(preset("ci-small"), "sglang-0.5.23"), steps=20, sync_scan=False)
    golden_row = next(c for c in rep.checks if c.key == "golden")
    assert not golden_row.passed and "drift regen-golden --preset ci-small --force" in golden_row.detail


def test_regeneration_refuses_without_force_and_is_reproducible(tmp_path):
    d = tmp_path / "g"
    out = io.StringIO()
    assert regenerate(["ci-small"], directory=d, steps=TINY_STEPS, out=out) == 0
    first = {p.name: p.read_bytes() for p in d.iterdir()}
    # Same inputs: byte-identical data, nothing rewritten (the manifest keeps its creation time).
    assert regenerate(["ci-small"], directory=d, steps=TINY_STEPS, out=out) == 0
    assert {p.name: p.read_bytes() for p in d.iterdir()} == first
    # A second directory regenerated from scratch holds the same bytes.
    d2 = tmp_path / "g2"
    regenerate(["ci-small"], directory=d2, steps=TINY_STEPS, out=io.StringIO())
    assert _npz(d2).read_bytes() == _npz(d).read_bytes()
    assert _npz(d2, serving=True).read_bytes() == _npz(d, serving=True).read_bytes()
    # Changed data (a longer horizon) is refused without --force, with a diff summary.
    out = io.StringIO()
    assert regenerate(["ci-small"], directory=d, steps=TINY_STEPS + 5, out=out) == 1
    assert "refusing to overwrite" in out.getvalue() and "proj_state: shape" in out.getvalue()
    assert {p.name: p.read_bytes() for p in d.iterdir()} == first
    assert regenerate(["ci-small"], directory=d, steps=TINY_STEPS + 5, force=True, out=out) == 0
    old_npz = next(v for k, v in first.items() if k.endswith(".npz") and "-serving-" not in k)
    assert _npz(d).read_bytes() != old_npz
    assert len(list(d.glob("*.npz"))) == 2  # one per entry: the old files were removed after the manifest swap


def test_interrupted_regeneration_leaves_old_golden_intact(tmp_path, monkeypatch):
    d = tmp_path / "g"
    regenerate(["ci-small"], directory=d, steps=TINY_STEPS, out=io.StringIO())
    before = {p.name: p.read_bytes() for p in d.iterdir()}

    def killed(*a, **k):
        raise KeyboardInterrupt("killed between the data file and the manifest")

    monkeypatch.setattr(gmod, "atomic_write_json", killed)
    with pytest.raises(KeyboardInterrupt):
        regenerate(["ci-small"], directory=d, steps=TINY_STEPS + 5, force=True, out=io.StringIO())
    monkeypatch.undo()
    # The old manifest still names the old file, which is untouched and loads.
    assert (d / "manifest.json").read_bytes() == before["manifest.json"]
    monkeypatch.setenv("DRIFT_GOLDEN_DIR", str(d))
    g, _ = load_golden(preset("ci-small"))
    assert g is not None and g.path.read_bytes() == before[g.path.name]


def test_pytest_force_regen_option_regenerates_and_fails(tmp_path, monkeypatch):
    d = tmp_path / "g"
    test = tmp_path / "test_uses_golden.py"
    test.write_text("from drift.config import preset\n"
                    "def test_it(drift_golden):\n"
                    "    assert drift_golden(preset('stagnation')).max_position > 0\n")
    env = {**os.environ, "DRIFT_GOLDEN_DIR": str(d)}
    run = lambda *extra: subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                         str(test), *extra], cwd=tmp_path, env=env, capture_output=True, text=True)
    missing = run()
    # never skips: a golden directory without the data is drift run's exit 2, pytest's usage error (exit 4)
    assert missing.returncode == 4 and "drift: error:" in missing.stdout and "DRIFT_GOLDEN_DIR" in missing.stdout
    regen = run("--drift-force-regen")
    assert regen.returncode == 1 and "regenerated" in regen.stdout
    assert len(list(d.glob("stagnation-seed0-*.npz"))) == 1
    monkeypatch.setenv("DRIFT_GOLDEN_DIR", str(d))  # what the next run of that test loads (in-process)
    g, _ = load_golden(preset("stagnation"))
    assert g is not None and g.path.parent == d and g.max_position > 0


# ----------------------------------------------------------------------- serving lifecycle
# ci-small's serving schedule at this seed starts a request of every kind -- a prefill into a lane a
# finished request left, a prefix hit, a resume -- within SERVING_STEPS (the fixture asserts it), so
# a golden of that horizon is made in seconds; seed 0's first resume comes at step 771.
SERVING_SEED, SERVING_STEPS = 26, 64


@pytest.fixture
def serving_golden(tmp_path, monkeypatch):
    """Golden data (fixed and serving entries) for ci-small seed SERVING_SEED over SERVING_STEPS,
    pointed to by DRIFT_GOLDEN_DIR: (the serving config, its schedule)."""
    d = tmp_path / "golden"
    assert regenerate(["ci-small"], seed=SERVING_SEED, directory=d, steps=SERVING_STEPS, out=io.StringIO()) == 0
    monkeypatch.setenv("DRIFT_GOLDEN_DIR", str(d))
    cfg = preset("ci-small", seed=SERVING_SEED, lifecycle="serving")
    sched = serving_schedule(cfg, SERVING_STEPS)
    kinds = set(sched["sched_code"][sched["sched_step"] > 0].tolist())
    assert kinds == {START_PREFILL, START_PREFIX, START_RESUME}, (
        f"seed {SERVING_SEED}'s schedule changed (starts after step 0: {kinds}); pick a seed whose first "
        f"{SERVING_STEPS} steps start a request of every kind")
    return cfg, sched


def _first(sched: dict, code: int) -> tuple[int, int, int]:
    """(step, lane, request) of the first start of kind ``code`` after step 0."""
    i = np.nonzero((sched["sched_code"] == code) & (sched["sched_step"] > 0))[0][0]
    return tuple(int(sched[f"sched_{f}"][i]) for f in ("step", "lane", "request"))


def _golden_row(rep):
    return next(c for c in rep.checks if c.key == "golden")


def test_serving_golden_agrees_with_the_twin_lane_by_lane(serving_golden):
    """Every lane's twin against its request's golden rows, the fresh lane at every start included:
    within GOLDEN_TOL at every committed position and start, every start checkpoint compared."""
    cfg, sched = serving_golden
    rep = run_checked(resolve(cfg, "sglang-0.5.23"), steps=SERVING_STEPS, sync_scan=False)
    row = _golden_row(rep)
    assert row.passed and row.worst < GOLDEN_TOL, (row.worst, row.detail)
    g, _ = load_golden(cfg)
    live = int((sched["request"] >= 0).sum())  # every lane-step compared, and every start's position
    assert row.detail == f"{live + len(sched['sched_step'])} positions, {len(g.arrays['start_ckpt'])} checkpoints"
    assert "past golden" not in rep.reference


@pytest.mark.parametrize("name,steps", [
    ("ci-small", 512), ("ci-heads", 512),
    pytest.param("ci-small", None, marks=pytest.mark.nightly), pytest.param("ci-heads", None, marks=pytest.mark.nightly)])
def test_shipped_serving_golden_agrees_with_the_twin(name, steps):
    """The PR gate's serving runs against the golden data drift ships (the gate's full horizon nightly)."""
    cfg = preset(name, lifecycle="serving")
    rep = run_checked(resolve(cfg, "sglang-0.5.23"), steps=steps, sync_scan=False)
    row = _golden_row(rep)
    assert row.passed and row.worst < GOLDEN_TOL, (row.worst, row.detail)
    assert "past golden" not in rep.reference and "checkpoints" in row.detail


def _perturb_starts(monkeypatch, before=None, after=None):
    """The comparison's lane resets (Comparison._start_lanes) with ``before(comp, starts)`` run ahead of
    them and ``after(comp, starts)`` after them: a twin whose lane reset is wrong."""
    orig = Comparison._start_lanes

    def start_lanes(comp, starts):
        if before is not None:
            before(comp, starts)
        orig(comp, starts)
        if after is not None:
            after(comp, starts)

    monkeypatch.setattr(Comparison, "_start_lanes", start_lanes)


def _fails_at(rep, step: int, lane: int, request: int) -> str:
    row = _golden_row(rep)
    assert not row.passed
    assert f"first over the limit at step {step}, layer " in row.detail, row.detail
    assert f", row {lane}, head " in row.detail and f"(request {request})" in row.detail, row.detail
    return row.detail


def test_a_prefix_hit_restored_from_the_wrong_source_fails_golden(serving_golden, monkeypatch):
    """Negative control: the twin starts a prefix hit from another request's snapshot (as a twin that
    took the wrong source would): golden fails at that start, naming its step, lane and request."""
    cfg, sched = serving_golden

    def wrong_source(comp, starts):
        comp._process()  # the twin through the steps before (which may track the source once more)
        for start, _, _ in starts.values():
            if start.code == START_PREFIX:
                other = next(q for q in reversed(comp._snapshot_truth) if q != start.source)
                comp._snapshot_truth[start.source] = (start.p0, *comp._snapshot_truth[other][1:])

    _perturb_starts(monkeypatch, before=wrong_source)
    rep = run_checked(resolve(cfg, "sglang-0.5.23"), steps=SERVING_STEPS, sync_scan=False, diagnose=False)
    step, lane, request = _first(sched, START_PREFIX)
    detail = _fails_at(rep, step, lane, request)
    assert f"checkpoint state/window differs (step {step}, row {lane} (request {request}))" in detail


def test_a_resume_that_resets_the_lane_fails_golden(serving_golden, monkeypatch):
    """Negative control: the twin restarts a resumed request from an empty state instead of keeping
    its own: golden fails at the resume, naming its step, lane and request."""
    cfg, sched = serving_golden

    def reset_resumes(comp, starts):
        lanes = [lane for lane, (start, _, _) in starts.items() if start.code == START_RESUME]
        if lanes:
            state, window = comp.twin.state[:, lanes], comp.twin.window[:, lanes]
            comp.twin.reset_lanes(np.array(lanes), torch.zeros_like(state), torch.zeros_like(window))

    _perturb_starts(monkeypatch, after=reset_resumes)
    rep = run_checked(resolve(cfg, "sglang-0.5.23"), steps=SERVING_STEPS, sync_scan=False, diagnose=False)
    _fails_at(rep, *_first(sched, START_RESUME))


def test_a_run_whose_requests_differ_from_the_goldens_fails_golden(serving_golden, monkeypatch):
    """Negative control: a run whose schedule is not the one the golden data was made for (every prompt
    one token longer; each request's truth is still its own, so its projections agree) fails golden on
    the schedule, naming the first start."""
    from drift.sim import serving

    cfg, sched = serving_golden
    orig = serving.prompt_length
    monkeypatch.setattr(serving, "prompt_length", lambda c, q: orig(c, q) + 1)
    rep = run_checked(resolve(cfg, "sglang-0.5.23"), steps=SERVING_STEPS, sync_scan=False, diagnose=False)
    row = _golden_row(rep)
    assert not row.passed and ("the run's requests differ from those the golden data was made for (step 0, row 0 "
                               "(request 0))") in row.detail, row.detail


def test_serving_run_past_the_golden_horizon_says_so(serving_golden):
    """Requests past the steps a serving golden was made for are the twin's alone, and the report says
    so (no false alarm: a start or a request after the horizon is not a schedule mismatch)."""
    cfg, _ = serving_golden
    rep = run_checked(resolve(cfg, "sglang-0.5.23"), steps=SERVING_STEPS + 40, sync_scan=False)
    assert _golden_row(rep).verdict == "PASS"
    assert f"past the {SERVING_STEPS} steps the golden data was made for" in rep.reference and "twin alone" in rep.reference


def test_the_gates_golden_is_required_where_it_applies_and_none_where_it_cannot(tmp_path):
    """drift_golden fails (never skips) for a PR-gating preset's own config, and gives None -- the run then
    compares with its float64 twin, as drift run does -- where the config leaves the preset's requests
    (tracking off under the serving lifecycle) or the preset has no golden (a deployment preset). It
    failed those with "no golden data" (exit 1), a setup difference read as a regression."""
    test = tmp_path / "test_uses_golden.py"
    test.write_text("from drift.config import preset\n"
                    "def test_required(drift_golden):\n"
                    "    assert drift_golden(preset('ci-small', lifecycle='serving')) is not None\n"
                    "def test_not_applicable(drift_golden):\n"
                    "    assert drift_golden(preset('ci-small', lifecycle='serving', track_interval=0)) is None\n"
                    "    assert drift_golden(preset('qwen3.5-397b-tp16')) is None\n")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)], cwd=tmp_path,
                         capture_output=True, text=True)
    assert res.returncode == 0 and "2 passed" in res.stdout, res.stdout[-2000:]
