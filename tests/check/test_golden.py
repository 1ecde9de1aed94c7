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
from drift.check.golden import (GOLDEN_PRESETS, GoldenError, golden_dir, load_golden, regenerate,
                          _golden_step)
from drift.runner import run_checked
from drift.sim.stream import StreamParams, TrueTokens
from drift.runspec import resolve

REPO = Path(__file__).resolve().parents[2]
TINY_STEPS = 40  # a golden horizon of 40 decode steps: ~200 positions, generated in a second


def test_every_pr_gating_preset_has_golden_within_budget():
    manifest = json.loads((golden_dir() / "manifest.json").read_text())
    assert manifest["schema"] == gmod.SCHEMA and manifest["generator_version"] == gmod.GENERATOR_VERSION
    for name in GOLDEN_PRESETS:
        cfg = preset(name)
        entry = manifest["entries"][f"{name}/seed{cfg.seed}"]
        for key in ("preset", "seed", "config_hash", "generator_version", "torch", "numpy", "created", "files"):
            assert key in entry, key
        assert entry["config_hash"] == cfg.stream_hash()
        g, note = load_golden(cfg)
        assert g is not None, note
        # Enough positions for the preset's horizon under any acceptance pattern (all accept D).
        assert g.max_position >= cfg.prefill_len + 3 * (cfg.num_requests - 1) + cfg.steps * cfg.num_draft_tokens
    total = sum(p.stat().st_size for p in golden_dir().iterdir())
    assert total <= 16 * 2**20, f"golden/ is {total / 2**20:.1f} MiB; the budget is 16 MiB"


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


def _npz(d: Path) -> Path:
    (p,) = d.glob("*.npz")
    return p


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "schema", "hash"])
def test_broken_golden_fails_naming_file_and_fix(tiny_golden, damage):
    npz, manifest = _npz(tiny_golden), tiny_golden / "manifest.json"
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
            m["entries"]["ci-small/seed0"]["config_hash"] = "0" * 16
        manifest.write_text(json.dumps(m))
    cfg = preset("ci-small", steps=5)
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
    naming the manifest it read and the command that makes the data -- never a quiet n/a."""
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


def test_regeneration_into_a_fresh_directory_is_reviewed_against_the_shipped_data(tmp_path, monkeypatch):
    """From an install, `drift regen-golden --golden-dir DIR` writes DIR's own manifest and data
    and prints the diff against what drift ships. (The generator is replaced by the shipped arrays
    for the "identical" case: regenerating 16,000 positions is the nightly's business.)"""
    shipped, _ = load_golden(preset("stagnation"))
    monkeypatch.setattr(gmod, "generate", lambda cfg, steps=None: dict(shipped.arrays))
    out = io.StringIO()
    d = tmp_path / "mine"
    assert regenerate(["stagnation"], directory=d, out=out) == 0
    assert "stagnation/seed0: identical to the golden data drift ships" in out.getvalue(), out.getvalue()
    g, _ = load_golden(preset("stagnation"), d)
    assert g is not None and g.path.parent == d
    monkeypatch.undo()
    # A shorter horizon differs from the shipped data: the diff is printed.
    out = io.StringIO()
    assert regenerate(["stagnation"], directory=tmp_path / "short", steps=64, out=out) == 0
    assert "differs from the golden data drift ships" in out.getvalue() and "proj_state: shape" in out.getvalue()


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
    # Changed data (a longer horizon) is refused without --force, with a diff summary.
    out = io.StringIO()
    assert regenerate(["ci-small"], directory=d, steps=TINY_STEPS + 5, out=out) == 1
    assert "refusing to overwrite" in out.getvalue() and "proj_state: shape" in out.getvalue()
    assert {p.name: p.read_bytes() for p in d.iterdir()} == first
    assert regenerate(["ci-small"], directory=d, steps=TINY_STEPS + 5, force=True, out=out) == 0
    old_npz = next(v for k, v in first.items() if k.endswith(".npz"))
    assert _npz(d).read_bytes() != old_npz
    assert len(list(d.glob("*.npz"))) == 1  # the old file was removed after the manifest swap


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
