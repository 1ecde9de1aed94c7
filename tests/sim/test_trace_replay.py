"""Replaying a captured model's GDN inputs through every check.

``drift capture --model tiny`` records a tiny randomly initialised Qwen3-Next (no download) once
per module; ``drift run --trace`` / ``drift nightly --trace`` / ``pytest --drift-trace`` then run
the same simulator, update and checks on the trace instead of the synthetic stream, with the
trace's golden data beside it. Bad traces and damaged trace golden data exit 2 naming the file
and the field.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from drift.check.golden import load_golden, trace_golden_dir
from drift.cli import main
from drift.config import PREFILL_STAGGER, Config, preset
from drift.errors import EXIT_FAIL, EXIT_PASS, EXIT_USAGE, ConfigError, DataError
from drift.fileio import load_npz, npz_bytes
from drift.sim.stream import InputStream, StreamParams, TrueTokens, load_trace, max_position
from drift.sim.tracefile import read_trace, trace_paths, write_trace
from drift.check.registry import CHECKS

if importlib.util.find_spec("transformers") is None:  # found, not imported: capture imports it when it runs
    pytest.skip("drift capture needs transformers>=5 (drift's capture extra)", allow_module_level=True)

TOKENS, PROMPT, SEQ = 64, 16, 4  # the capture's defaults for prompt and sequences, 64 decoded tokens
T = PROMPT + TOKENS  # tokens per sequence in the trace (prompt included)
D = preset("ci-small").num_draft_tokens
# Without --steps a run covers the whole trace: the longest prompt is PROMPT + 3 (R - 1), and a
# step advances a row by at most D positions, so (T - longest) // D steps never read past the end.
WHOLE = (T - (PROMPT + PREFILL_STAGGER * (SEQ - 1))) // D


def cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def captured(tmp_path_factory) -> tuple[Path, str]:
    """``drift capture --model tiny --tokens 64 --out t.npz`` (bf16, 4 sequences, 16-token prompts)."""
    d = tmp_path_factory.mktemp("capture")
    rc, out, err = cli("capture", "--model", "tiny", "--tokens", TOKENS, "--out", d / "t.npz")
    assert rc == EXIT_PASS, err
    return d / "t.npz", out


def fresh_copy(src: Path, dest_dir: Path, name: str = "t") -> Path:
    """The trace's npz and manifest copied into ``dest_dir`` (no golden data there yet). The
    manifest names its npz, so a copy keeps the stem unless renamed consistently."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    npz, man = trace_paths(src)
    m = json.loads(man.read_text())
    m["file"] = f"{name}.npz"
    shutil.copyfile(npz, dest_dir / f"{name}.npz")
    (dest_dir / f"{name}.json").write_text(json.dumps(m, sort_keys=True))
    return dest_dir / f"{name}.npz"


def rewrite(src: Path, dest_dir: Path, mutate) -> Path:
    """A copy of the trace whose stored arrays ``mutate`` changed, with the manifest's length and
    sha256 updated to match: the damage only the array checks can see."""
    p = fresh_copy(src, dest_dir)
    stored = load_npz(p)
    mutate(stored)
    blob = npz_bytes(stored)
    p.write_bytes(blob)
    man = trace_paths(p)[1]
    m = json.loads(man.read_text())
    m.update(sha256=hashlib.sha256(blob).hexdigest(), bytes=len(blob))
    man.write_text(json.dumps(m, sort_keys=True))
    return p


def trace_config(path: Path, **kw) -> Config:
    return Config.from_trace(load_trace(path), preset("ci-small"), **kw)


# ----------------------------------------------------------------------------- capture
def test_capture_prints_the_file_and_bytes_per_token(captured):
    path, out = captured
    m = json.loads(trace_paths(path)[1].read_text())
    assert f"wrote {path}" in out and f"sha256 {m['sha256'][:16]}" in out
    # (C + 2 HV) * 2 bytes for bf16: C = 2*2*32 + 4*32 = 256 channels, HV = 4 -> 528 B.
    assert "bytes per token per layer: 528" in out and m["bytes_per_token_per_layer"] == 528
    assert (m["sequences"], m["tokens"], m["model"]["prompt_tokens"]) == (SEQ, T, PROMPT)
    assert m["model"]["source"] == "tiny" and m["dtype"] == "bfloat16"


def test_capture_without_transformers_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    rc, out, err = cli("capture", "--model", "tiny", "--out", tmp_path / "t.npz")
    assert rc == EXIT_USAGE and ".[capture]" in err and "capture extra" in err
    assert not (tmp_path / "t.npz").exists()


@pytest.mark.parametrize("args, words", [
    (["--tokens", "0"], "--tokens"),
    (["--out", "/proc/drift-no/t.npz"], "cannot write there"),
    (["--model", "/nonexistent-model-dir"], "no config.json"),
])
def test_capture_rejects_bad_input_before_work(tmp_path, args, words):
    argv = ["capture", "--out", tmp_path / "t.npz"] + args
    with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            rc = main([str(a) for a in argv])
        except SystemExit as exc:  # argparse usage errors
            rc = exc.code
    assert rc == EXIT_USAGE and words in err.getvalue()
    assert not (tmp_path / "t.npz").exists()


# ------------------------------------------------------------------------ capture -> run
def test_run_on_the_trace_passes_with_its_golden_beside_it(captured, tmp_path):
    path = fresh_copy(captured[0], tmp_path)
    gdir = trace_golden_dir(path)
    assert gdir == tmp_path / "t.golden" and not gdir.exists()
    rc, out, err = cli("run", "--trace", path, "--quiet")
    assert rc == EXIT_PASS, out + err
    assert "PASS: every check passed" in out and f"{WHOLE} steps (mtp)" in out
    golden_row = next(line for line in out.splitlines() if line.startswith("golden "))
    assert golden_row.split()[1] == "PASS", golden_row  # validated against, not "n/a"
    assert "generating it now" in err and (gdir / "manifest.json").is_file()
    files = list(gdir.glob("*.npz"))
    assert len(files) == 1
    stamp = files[0].stat().st_mtime_ns
    # A second run reuses it: nothing generated, the file untouched, validated again.
    rc, out, err = cli("run", "--trace", path, "--quiet")
    assert rc == EXIT_PASS and "generating" not in err
    assert files[0].stat().st_mtime_ns == stamp and list(gdir.glob("*.npz")) == files
    assert next(line for line in out.splitlines() if line.startswith("golden ")).split()[1] == "PASS"
    # regen-golden --trace finds it unchanged (generation is byte-for-byte reproducible).
    rc, out, _ = cli("regen-golden", "--trace", path)
    assert rc == EXIT_PASS and "unchanged" in out


def test_golden_beside_the_trace_is_what_the_run_is_checked_against(captured, tmp_path):
    """Negative control: golden data with a wrong trajectory, consistently hashed, fails the
    golden check -- the run really compares with the file beside the trace."""
    path = fresh_copy(captured[0], tmp_path)
    assert cli("run", "--trace", path, "--quiet")[0] == EXIT_PASS
    gdir = trace_golden_dir(path)
    (gfile,) = gdir.glob("*.npz")
    arrays = load_npz(gfile)
    arrays["proj_state"] = arrays["proj_state"] * np.float32(1.01)  # 1% off: far above the 1e-6 limit
    blob = npz_bytes(arrays)
    gfile.write_bytes(blob)
    man = json.loads((gdir / "manifest.json").read_text())
    (entry,) = man["entries"].values()
    entry["files"][gfile.name] = {"sha256": hashlib.sha256(blob).hexdigest(), "size": len(blob)}
    (gdir / "manifest.json").write_text(json.dumps(man))
    rc, out, _ = cli("run", "--trace", path, "--quiet")
    assert rc == EXIT_FAIL and out.rstrip().endswith("FAIL: golden")


def test_golden_of_one_trace_never_serves_another(captured, tmp_path):
    """The config hash covers the trace's sha256, not its path: a copy elsewhere shares it, a
    trace with other content does not."""
    a = trace_config(captured[0])
    b = trace_config(fresh_copy(captured[0], tmp_path / "elsewhere"))
    assert a.trace != b.trace and a.stream_hash() == b.stream_hash()

    def nudge(stored):
        stored["b"] = stored["b"].copy()
        stored["b"][0, 0, 0, 0] ^= 1  # one bf16 ulp of one beta logit
    c = trace_config(rewrite(captured[0], tmp_path / "other", nudge))
    assert c.trace_sha256 != a.trace_sha256 and c.stream_hash() != a.stream_hash()
    # A synthetic config with the trace's shapes does not hash like the trace either.
    synthetic = a.replace(trace="", trace_sha256="", trace_tokens=0, trace_loop=False)
    assert synthetic.stream_hash() != a.stream_hash()


# --------------------------------------------------------------------- the stream is the trace
def test_replayed_tokens_and_constants_are_the_trace(captured):
    path = captured[0]
    tr = read_trace(path)
    cfg = trace_config(path)
    tok = TrueTokens(cfg)
    for row in range(SEQ):
        x, a, b = tok.get(row, 5, 40)
        # A bf16 capture is already on the bf16 grid: replayed exactly.
        assert np.array_equal(x, tr.x[row, 5:40]) and np.array_equal(a, tr.a[row, 5:40])
        assert np.array_equal(b, tr.b[row, 5:40])
    # Negative control: rows are distinct sequences, not one sequence repeated.
    assert not np.array_equal(tok.get(1, 5, 40)[0], tr.x[0, 5:40])
    prm = StreamParams.generate(cfg)
    assert torch.equal(prm.A_log, torch.tensor(tr.A_log))
    assert torch.equal(prm.dt_bias, torch.tensor(tr.dt_bias))
    assert torch.equal(prm.conv_weight, torch.tensor(tr.conv_weight))
    # The synthetic stream of the same shapes is something else entirely.
    synthetic = cfg.replace(trace="", trace_sha256="", trace_tokens=0, trace_loop=False)
    assert not np.array_equal(TrueTokens(synthetic).get(0, 5, 40)[0], tr.x[0, 5:40])
    assert not torch.equal(StreamParams.generate(synthetic).A_log, prm.A_log)


def test_verify_windows_hold_the_trace_tokens(captured):
    """What the simulator feeds the verify: accepted window positions are the trace's tokens."""
    tr = read_trace(captured[0])
    cfg = trace_config(captured[0])
    chunk = InputStream(cfg, torch.device("cpu")).chunk(cfg.steps)
    x = chunk.x.to(torch.float32).numpy()  # [S, L, N, D, C]
    for s in range(chunk.count):
        for r in range(SEQ):
            for j in range(int(chunk.accept[s, r])):  # accepted draft j is position pre + j
                p = int(chunk.pre[s, r]) + j
                assert np.array_equal(x[s, :, r, j], tr.x[r, p]), (s, r, j)
    assert max_position(cfg) <= T


def test_a_float32_capture_is_replayed_rounded_to_bf16(captured, tmp_path):
    tr = read_trace(captured[0])
    rng = np.random.default_rng(0)
    noisy = {k: (getattr(tr, k) + rng.standard_normal(getattr(tr, k).shape).astype(np.float32) * 1e-3)
             .astype(np.float32) for k in ("x", "a", "b")}
    m = tr.manifest
    p = write_trace(tmp_path / "f32.npz", **noisy, A_log=tr.A_log, dt_bias=tr.dt_bias, conv_weight=tr.conv_weight,
                    conv_bias=tr.conv_bias, dtype="float32", model=m["model"], layers=m["layers"])
    cfg = trace_config(p)
    x, a, b = TrueTokens(cfg).get(2, 0, T)
    for got, raw in ((x, noisy["x"][2]), (a, noisy["a"][2]), (b, noisy["b"][2])):
        want = torch.from_numpy(raw).to(torch.bfloat16).to(torch.float32).numpy()
        assert np.array_equal(got, want)  # round to nearest even onto the bf16 grid
        assert not np.array_equal(got, raw)  # the float32 values themselves are not replayed


def test_conv_bias_is_refused_by_replay_and_read_by_trace_stats(captured, tmp_path):
    def bias(stored):
        stored["conv_bias"] = stored["conv_bias"].copy()
        stored["conv_bias"][1, 7] = 0.25
    p = rewrite(captured[0], tmp_path, bias)
    rc, _, err = cli("run", "--trace", p, "--quiet")
    assert rc == EXIT_USAGE and str(p) in err and "'conv_bias'" in err and "[1, 7]" in err
    assert cli("trace-stats", p, "--preset-tokens", "64")[0] == EXIT_PASS  # statistics apply the bias


# ------------------------------------------------------------------------------ teeth
def test_a_mutant_update_fails_on_the_trace(captured, tmp_path):
    path = fresh_copy(captured[0], tmp_path)
    rc, out, _ = cli("run", "--trace", path, "--quiet", "--update", "mutant:step_plus1")
    assert rc == EXIT_FAIL
    failed = out.rstrip().splitlines()[-1]
    assert failed.startswith("FAIL:") and CHECKS.title("committed_state") in failed and CHECKS.title("golden") not in failed


def test_a_precision_mutant_kernel_fails_the_bound_on_the_trace(captured, tmp_path):
    """The verify kernel storing states by truncation: caught by the drift bound on real inputs."""
    path = fresh_copy(captured[0], tmp_path)
    rc, out, _ = cli("run", "--trace", path, "--quiet", "--kernel", "mutant:truncate_store")
    assert rc == EXIT_FAIL and CHECKS.title("drift_bound") in out.rstrip().splitlines()[-1]


# ---------------------------------------------------------------------- steps vs the trace
def test_steps_cover_the_whole_trace_and_no_more(captured):
    cfg = trace_config(captured[0])
    assert cfg.steps == WHOLE and cfg.max_position <= T
    assert (cfg.num_requests, cfg.num_layers, cfg.prefill_len) == (SEQ, 2, PROMPT)
    with pytest.raises(ConfigError, match="at most"):
        cfg.replace(steps=WHOLE + 1)  # one more step could read past the end
    assert cfg.replace(steps=WHOLE + 1, trace_loop=True).steps == WHOLE + 1


def test_explicit_steps_past_the_trace_exit_2_naming_it(captured, tmp_path):
    path = fresh_copy(captured[0], tmp_path)
    rc, out, err = cli("run", "--trace", path, "--steps", 100, "--quiet")
    assert rc == EXIT_USAGE and str(path) in err and f"{T} tokens" in err and "steps=100" in err
    assert "drift run: preset" not in out  # rejected before any work
    rc, out, err = cli("run", "--trace", path, "--steps", 100, "--loop", "--quiet")
    assert rc == EXIT_PASS, out + err
    assert "100 steps (mtp)" in out


def test_loop_wraps_positions_and_needs_a_trace(captured):
    cfg = trace_config(captured[0], steps=100, loop=True)
    tr = read_trace(captured[0])
    x, _, _ = TrueTokens(cfg).get(1, T - 2, T + 3)
    assert np.array_equal(x, tr.x[1, [T - 2, T - 1, 0, 1, 2]])
    with pytest.raises(ConfigError, match="past the end"):
        TrueTokens(trace_config(captured[0])).get(1, T - 2, T + 3)
    assert cli("run", "--loop", "--quiet")[0] == EXIT_USAGE


def test_a_layer_cut_replays_the_first_layers_and_other_shapes_drop_the_trace(captured):
    tr = read_trace(captured[0])
    cfg = trace_config(captured[0])
    one = cfg.replace(num_layers=1)
    assert one.trace == cfg.trace and one.stream_hash() != cfg.stream_hash()
    assert np.array_equal(TrueTokens(one).get(0, 0, 10)[0], tr.x[0, :10, :1])
    # Other head shapes are another model: the copy is synthetic (what the sync scan's
    # schedule-only copy relies on), and the same schedule fields are kept.
    other = cfg.replace(num_k_heads=1, num_v_heads=1, head_k_dim=1, head_v_dim=1, decays=(0.5,))
    assert other.trace == "" and other.seed == cfg.seed and other.prefill_len == cfg.prefill_len
    with pytest.raises(ConfigError, match="does not fit"):
        TrueTokens(cfg.replace(num_requests=SEQ + 1, steps=1))


# ------------------------------------------------------------------------- bad traces
def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


def _wrong_shape(stored) -> None:
    stored["a"] = np.ascontiguousarray(stored["a"][..., :3])


def _nan(stored) -> None:
    stored["x"] = stored["x"].copy()
    stored["x"][2, 5, 1, 7] = 0x7FC0  # bf16 NaN bits


@pytest.mark.parametrize("command", ["run", "trace-stats"])
@pytest.mark.parametrize("damage, field", [(_truncate, "field 'bytes'"), (_flip, "field 'sha256'"),
                                           (_wrong_shape, "array 'a'"), (_nan, "array 'x'")],
                         ids=["truncated", "flipped-byte", "wrong-shape", "nan"])
def test_bad_traces_exit_2_naming_file_and_field(captured, tmp_path, command, damage, field):
    if damage in (_truncate, _flip):
        p = fresh_copy(captured[0], tmp_path)
        damage(p)
    else:
        p = rewrite(captured[0], tmp_path, damage)
    argv = ["run", "--trace", p, "--quiet"] if command == "run" else ["trace-stats", p]
    rc, out, err = cli(*argv)
    assert rc == EXIT_USAGE, out + err
    assert str(p) in err and field in err, err
    if damage is _nan:
        assert "NaN" in err and "[2, 5, 1, 7]" in err
    assert not trace_golden_dir(p).exists()  # nothing ran, nothing written


def test_a_missing_trace_exits_2(tmp_path):
    rc, _, err = cli("run", "--trace", tmp_path / "absent.npz", "--quiet")
    assert rc == EXIT_USAGE and "absent.json" in err and "not found" in err


@pytest.mark.parametrize("damage", ["flip", "manifest"])
def test_damaged_trace_golden_exits_2_naming_it(captured, tmp_path, damage):
    path = fresh_copy(captured[0], tmp_path)
    assert cli("run", "--trace", path, "--quiet")[0] == EXIT_PASS
    gdir = trace_golden_dir(path)
    if damage == "flip":
        (target,) = gdir.glob("*.npz")
        _flip(target)
        words = "truncated or corrupted"
    else:
        target = gdir / "manifest.json"
        target.write_text("{ not json")
        words = "not valid JSON"
    rc, out, err = cli("run", "--trace", path, "--quiet")
    assert rc == EXIT_USAGE and str(target) in err and words in err and "regen-golden --trace" in err
    assert "drift run: preset" not in out
    with pytest.raises(Exception, match=words):  # the loader itself, as the plugin and nightly use it
        load_golden(trace_config(path))


# ------------------------------------------------------------------- nightly and plugin
def test_nightly_replays_the_trace(captured, tmp_path):
    path = fresh_copy(captured[0], tmp_path / "tr")
    rep_dir = tmp_path / "rep"
    rc, out, err = cli("nightly", "--trace", path, "--variant", "rne", "--variant", "sequential",
                       "--preset", "ci-small", "--report", rep_dir, "--quiet")
    assert rc == EXIT_PASS, err
    rep = json.loads((rep_dir / "report.json").read_text())
    assert set(rep["entries"]) == {"ci-small.trace-t.seed0.sglang-0.5.23.rne", "ci-small.trace-t.seed0.-.sequential"}
    for e in rep["entries"].values():
        assert e["verdict"] == "pass" and e["steps"] == WHOLE and e["config"]["trace"] == str(path)
        golden = next(c for c in e["checks"] if c["key"] == "golden")
        assert golden["verdict"] == "PASS", golden  # validated against the golden beside the trace
    # Explicit steps past the trace: refused before any entry runs.
    rc, _, err = cli("nightly", "--trace", path, "--steps", 1000, "--variant", "rne", "--report", tmp_path / "r2")
    assert rc == EXIT_USAGE and str(path) in err and not (tmp_path / "r2" / "report.json").exists()


def test_pytest_plugin_replays_the_trace(captured, tmp_path):
    """pytest --pyargs drift --drift-trace: the released update passes the precision gate on the
    trace, the step_plus1 mutant fails it (one run, both parametrised)."""
    path = fresh_copy(captured[0], tmp_path / "tr")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "drift",
                          "--drift-trace", str(path), "--drift-steps", "8", "-k", "precision",
                          "--drift-update", "sglang-0.5.23", "--drift-update", "mutant:step_plus1"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-2000:]
    assert "1 failed, 1 passed" in run.stdout and "step_plus1" in run.stdout
    assert CHECKS.title("committed_state") in run.stdout
    assert (trace_golden_dir(path) / "manifest.json").is_file()


REPO = Path(__file__).resolve().parents[2]


def test_pytest_from_the_checkout_takes_no_repository_defaults_and_refuses_a_short_trace(captured, tmp_path):
    """Run from the checkout (pytest's root directory there), the installed gate replays the whole
    trace: the repository's own --drift-steps default never reaches it. A trace too short for
    --drift-steps is one pytest usage error (exit 4) naming the trace, not a setup traceback."""
    path = fresh_copy(captured[0], tmp_path / "tr")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "--pyargs", "drift",
            "--drift-trace", str(path)]
    run = subprocess.run(base + ["-k", "precision"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
    short = subprocess.run(base + ["--drift-steps", "100000", "--co"], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=600)
    assert short.returncode == 4, short.stdout[-2000:] + short.stderr[-2000:]
    assert f"--drift-trace {path}" in short.stderr and "Traceback" not in short.stderr + short.stdout


def test_data_error_for_a_trace_replaced_after_the_config(captured, tmp_path):
    path = fresh_copy(captured[0], tmp_path)
    cfg = trace_config(path)

    def nudge(stored):
        stored["a"] = stored["a"].copy()
        stored["a"][0, 0, 0, 0] ^= 1
    other = rewrite(path, tmp_path / "other", nudge)
    for name in (other.name, other.with_suffix(".json").name):  # same path, other content
        shutil.copyfile(other.with_name(name), path.with_name(name))
    with pytest.raises(DataError, match="replaced"):
        TrueTokens(cfg)
    assert TrueTokens(trace_config(path)).get(0, 0, 1)[1][0, 0, 0] != read_trace(captured[0]).a[0, 0, 0, 0]
