"""The bad-input battery: hostile and damaged inputs, failing outputs, misbehaving code under test
and interrupts, each handled by drift's contract -- exit 2 for input rejected before any work (one
line naming the cause and a fix that works), 1 for code under test that fails, 130/143 for SIGINT /
SIGTERM, no traceback, nothing outside a golden directory touched, nothing half-written left.

Runs ``drift.cli.main`` in-process with tiny shapes and a few steps; subprocesses only for signals.
"""

from __future__ import annotations

import errno
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch

from drift import checkpoint, fileio
from drift.check import golden
from drift.check.registry import title
from drift.cli import main
from drift.errors import EXIT_FAIL, EXIT_PASS, EXIT_USAGE, DataError
from drift.jobs import nightly
from drift.sim.tracefile import write_trace

RUN = ["run", "--preset", "ci-small", "--steps", "8", "--quiet"]
DEEP = "[" * 100_000 + "]" * 100_000  # nested past what Python's JSON parser follows (RecursionError)


def err_of(capsys) -> str:
    """stderr of the last command, checked to be one line without a traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


# ------------------------------------------------------------------- golden store
def _golden_copy(tmp_path: Path) -> Path:
    """A copy of the golden manifest drift ships, with one small data file (8 steps of ci-small, its
    fixed entry)."""
    d = tmp_path / "golden"
    assert golden.regenerate(["ci-small"], directory=d, steps=8, out=io.StringIO(), lifecycles=("fixed",)) == 0
    return d


def test_a_manifest_name_outside_its_directory_is_refused_and_nothing_is_deleted(tmp_path, capsys, monkeypatch):
    d = _golden_copy(tmp_path)
    victim = tmp_path / "victim.npz"
    victim.write_bytes(b"precious")
    m = json.loads((d / "manifest.json").read_text())
    (entry,) = m["entries"].values()
    (meta,) = entry["files"].values()
    entry["files"] = {"../victim.npz": {**meta, "sha256": "0" * 64}}  # out of date: regen would replace it
    (d / "manifest.json").write_text(json.dumps(m))
    monkeypatch.setenv("DRIFT_GOLDEN_DIR", str(d))
    assert main(["regen-golden", "--force", "--golden-dir", str(d), "--preset", "ci-small"]) == EXIT_USAGE
    err = err_of(capsys)
    assert "'../victim.npz'" in err and "not a plain file name" in err and "move it aside" in err
    assert victim.read_bytes() == b"precious"
    for bad in ("/etc/passwd", "sub/x.npz", "..", "", "a\\b.npz"):
        assert not golden.plain_name(bad), bad
    assert golden.plain_name("ci-small-seed0-0123456789ab.npz")


def test_regeneration_repairs_a_file_damaged_on_disk(tmp_path):
    d = _golden_copy(tmp_path)
    (f,) = d.glob("*.npz")
    whole = f.read_bytes()
    f.write_bytes(whole[:1000])  # truncated: the manifest's sha256 still names the true data
    out = io.StringIO()
    fixed = ("fixed",)
    assert golden.regenerate(["ci-small"], directory=d, steps=8, out=out, lifecycles=fixed) == 0  # no --force needed
    assert "repaired" in out.getvalue() and f.read_bytes() == whole
    out = io.StringIO()
    assert golden.regenerate(["ci-small"], directory=d, steps=8, out=out, lifecycles=fixed) == 0
    assert "unchanged" in out.getvalue()  # negative control: an intact file is left alone


@pytest.mark.parametrize("make, words", [
    (lambda d: d.write_text("a file"), "is a file, not a directory"),
    (lambda d: (d.mkdir(), (d / "manifest.json").symlink_to("manifest.json")), "Too many levels of symbolic links"),
    (lambda d: (d / "manifest.json").mkdir(parents=True), "manifest.json is a directory"),
    (lambda d: (d.mkdir(), (d / "manifest.json").write_text(DEEP)), "nested deeper"),
])
def test_a_broken_golden_directory_is_named_as_such(tmp_path, capsys, monkeypatch, make, words):
    d = tmp_path / "g"
    make(d)
    monkeypatch.setenv("DRIFT_GOLDEN_DIR", str(d))
    assert main(RUN) == EXIT_USAGE
    err = err_of(capsys)
    assert words in err and "no golden data" not in err


# ------------------------------------------------------------------ bounded reads
def _npz_with_header(tmp_path: Path, header: bytes) -> Path:
    """An .npz whose one member is an .npy with this header dict (v1.0) and 16 bytes of data."""
    pad = 64 - (10 + len(header) + 1) % 64
    body = header + b" " * pad + b"\n"
    npy = b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body + bytes(16)
    path = tmp_path / "h.npz"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("x.npy", npy)
    return path


def test_npz_headers_are_checked_before_anything_is_allocated(tmp_path, monkeypatch):
    huge = _npz_with_header(tmp_path, b"{'descr': '<f4', 'fortran_order': False, 'shape': (549755813888,), }")
    with pytest.raises(DataError, match=r"declares shape \(549755813888,\).*2.0 TiB.*holds \d+ B") as ei:
        fileio.load_npz(huge)  # a 2 TiB array in a 144-byte member: damaged, not "needs pickle"
    assert "pickle" not in str(ei.value)
    long = _npz_with_header(tmp_path, b"{'descr': '<f4', 'fortran_order': False, 'shape': (4,), " + b" " * 20_000 + b"}")
    with pytest.raises(DataError, match="oversized .npy header"):
        fileio.load_npz(long)
    fine = _npz_with_header(tmp_path, b"{'descr': '<f4', 'fortran_order': False, 'shape': (4,), }")
    assert fileio.load_npz(fine)["x"].shape == (4,)  # positive control: the same file, sane
    monkeypatch.setenv("DRIFT_MAX_BYTES", "8")
    with pytest.raises(DataError, match="memory limit of 8 B.*DRIFT_MAX_BYTES"):
        fileio.load_npz(fine)
    with pytest.raises(DataError, match="is a directory"):
        fileio.load_npz(tmp_path)


def test_a_run_too_large_for_the_memory_limit_is_refused_before_allocating(capsys, monkeypatch):
    monkeypatch.setenv("DRIFT_MAX_BYTES", "1M")  # ci-small's states need a few MiB
    assert main(RUN) == EXIT_USAGE
    err = err_of(capsys)
    assert "memory limit of 1.0 MiB" in err and "DRIFT_MAX_BYTES" in err


# Trace shapes: 4 sequences, 20 tokens, 1 layer, HK=1, HV=2, K=V=8 (C = 32), conv kernel 4.
R, T, HV, K, KC = 4, 20, 2, 8, 4
C = 2 * K + HV * K


def _trace(tmp_path: Path, name: str = "t") -> Path:
    g = torch.Generator().manual_seed(0)
    return write_trace(tmp_path / name, x=(0.5 * torch.randn(R, T, 1, C, generator=g)).bfloat16(),
                       a=torch.randn(R, T, 1, HV, generator=g).bfloat16(), b=torch.randn(R, T, 1, HV, generator=g).bfloat16(),
                       A_log=torch.zeros(1, HV), dt_bias=torch.zeros(1, HV), conv_weight=0.3 * torch.randn(1, C, KC, generator=g),
                       conv_bias=torch.zeros(1, C), dtype="bfloat16", layers=[0],
                       model={"name": "unit", "source": "tiny", "config": {"num_k_heads": 1, "head_k_dim": K, "head_v_dim": K}})


def test_a_trace_too_large_for_the_memory_limit_leaves_no_golden_directory(tmp_path, capsys, monkeypatch):
    npz = _trace(tmp_path)
    monkeypatch.setenv("DRIFT_MAX_BYTES", "16K")  # the trace's arrays fit (5 KiB of x); its run's states do not
    assert main(["run", "--trace", str(npz), "--quiet"]) == EXIT_USAGE
    assert "the states of ci-small+trace:t" in err_of(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json", "t.npz"]  # no empty t.golden/


def test_damaged_json_and_non_files_exit_2(tmp_path, capsys):
    npz = _trace(tmp_path)
    npz.with_suffix(".json").write_text(DEEP)
    assert main(["trace-stats", str(npz)]) == EXIT_USAGE
    assert "nested deeper" in err_of(capsys)
    npz.with_suffix(".json").unlink()
    npz.with_suffix(".json").mkdir()
    assert main(["trace-stats", str(npz)]) == EXIT_USAGE
    assert "is a directory" in err_of(capsys)
    with pytest.raises(DataError, match="is a directory"):
        checkpoint.load(tmp_path)


def test_a_checkpoint_with_code_in_it_never_advises_unpickling(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"x": io.StringIO()}, path)  # any object beyond tensors and numbers
    with pytest.raises(DataError, match="drift never unpickles code") as ei:
        checkpoint.load(path)
    assert "weights_only=False" not in str(ei.value)


# ------------------------------------------------------------- a short trace
def test_a_trace_shorter_than_the_track_interval_is_not_a_false_fail(tmp_path, capsys):
    npz = _trace(tmp_path)
    # qwen3.5-397b-tp16 tracks every 256 tokens; the trace has 20: tracking cannot be exercised.
    assert main(["run", "--trace", str(npz), "--preset", "qwen3.5-397b-tp16", "--quiet"]) == EXIT_PASS
    out = capsys.readouterr().out
    row = next(ln for ln in out.splitlines() if ln.startswith(title("tracked_snapshots")))
    assert "n/a" in row and "not exercised" in row and "--loop" in row
    # negative control: with a track interval the trace reaches, the check is exercised and gates.
    assert main(["run", "--trace", str(npz), "--preset", "ci-small", "--quiet"]) == EXIT_PASS
    row = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(title("tracked_snapshots")))
    assert "PASS" in row and "snapshots compared" in row


# ----------------------------------------------------------------------- outputs
def test_outputs_of_the_wrong_kind_are_refused_before_work(tmp_path, capsys):
    (tmp_path / "rep" / "report.json").mkdir(parents=True)
    assert main(RUN + ["--report", str(tmp_path / "rep")]) == EXIT_USAGE
    assert "report.json: is a directory" in err_of(capsys)
    npz = _trace(tmp_path)
    (tmp_path / "plot.png").mkdir()
    assert main(["trace-stats", str(npz), "--plot", str(tmp_path / "plot.png")]) == EXIT_USAGE
    assert "plot.png: is a directory" in err_of(capsys)
    (tmp_path / "cap.npz").mkdir()
    assert main(["capture", "--out", str(tmp_path / "cap")]) == EXIT_USAGE
    assert "cap.npz: is a directory" in err_of(capsys)


def _same_as(kind: str, target: Path, tmp_path: Path) -> str:
    """An output path that names ``target``: as given, relative with ./, a symlink or a hard link."""
    if kind == "same":
        return str(target)
    if kind == "dot":
        return f"./{target.relative_to(tmp_path)}"
    link = tmp_path / f"{kind}.png"
    (link.symlink_to if kind == "symlink" else link.hardlink_to)(target)
    return str(link)


@pytest.mark.parametrize("kind", ["same", "dot", "symlink", "hardlink"])
@pytest.mark.parametrize("member", ["npz", "json"])
def test_trace_stats_never_writes_its_plot_over_the_trace(tmp_path, capsys, monkeypatch, kind, member):
    npz = _trace(tmp_path)
    target = npz.with_suffix(f".{member}")
    before = target.read_bytes()
    monkeypatch.chdir(tmp_path)
    assert main(["trace-stats", str(npz), "--plot", _same_as(kind, target, tmp_path)]) == EXIT_USAGE
    assert "is the same file as the trace" in err_of(capsys) and target.read_bytes() == before
    assert main(["trace-stats", str(npz), "--plot", str(tmp_path / "fine.png")]) == EXIT_PASS  # control
    assert (tmp_path / "fine.png").read_bytes()[:4] == b"\x89PNG" and target.read_bytes() == before


def test_a_run_never_writes_its_report_over_its_trace(tmp_path, capsys):
    npz = _trace(tmp_path, "report")  # its manifest is report.json: --report beside it would overwrite it
    before = npz.with_suffix(".json").read_bytes()
    assert main(["run", "--trace", str(npz), "--quiet", "--report", str(tmp_path)]) == EXIT_USAGE
    assert "is the same file as the trace's manifest" in err_of(capsys)
    assert npz.with_suffix(".json").read_bytes() == before
    assert main(["run", "--trace", str(npz), "--quiet", "--report", str(tmp_path / "out")]) == EXIT_PASS  # control


def test_a_capture_never_writes_over_the_model_it_reads(tmp_path, capsys, monkeypatch):
    from drift import cli
    from drift.errors import ConfigError

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert main(["capture", "--model", str(model), "--out", str(model / "config")]) == EXIT_USAGE
    assert "--out" in (err := err_of(capsys)) and "is the same file as a file of --model" in err
    assert (model / "config.json").read_text() == "{}"

    def reached():
        raise ConfigError("past the output checks")

    monkeypatch.setattr(cli, "_need_transformers", reached)  # control: another --out gets past them
    assert main(["capture", "--model", str(model), "--out", str(tmp_path / "trace")]) == EXIT_USAGE
    assert "past the output checks" in err_of(capsys)


def test_two_runs_never_share_a_report_directory(tmp_path, capsys):
    out = tmp_path / "rep"
    assert main(RUN + ["--report", str(out)]) == EXIT_PASS
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with fileio.locked(out, "drift run"):  # another drift run writing there
        assert main(RUN + ["--update", "sglang-32130", "--report", str(out)]) == EXIT_USAGE
        assert f"is in use by another drift run (pid {os.getpid()})" in err_of(capsys)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_run_replaces_its_report_files_as_one_unit(tmp_path, capsys, monkeypatch):
    """A write that fails halfway (here the plot, after report.json was staged) leaves the old
    report whole; a run that makes no plot removes the old one with the rest (all new or all old)."""
    from drift.jobs import report

    out = tmp_path / "rep"
    assert main(RUN + ["--report", str(out)]) == EXIT_PASS
    old = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(old) == {"report.json", "report.md", "drift_vs_step.png"}

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(report, "run_plot", full)
    assert main(RUN + ["--steps", "16", "--report", str(out)]) == EXIT_USAGE
    assert "No space left on device" in err_of(capsys)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == old  # all old, no staging left
    monkeypatch.undo()
    assert main(RUN + ["--update", "sglang-32130", "--report", str(out)]) == EXIT_FAIL  # no drift curves: no plot
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md"]
    assert json.loads((out / "report.json").read_text())["run"]["update"] == "sglang-32130"


def test_a_lock_or_unit_that_cannot_be_made_is_one_clear_error(tmp_path):
    from drift.errors import ConfigError, WriteError

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(ConfigError, match="cannot create its lock file"):
        with fileio.locked(not_a_dir, "drift run"):
            pass
    with pytest.raises(WriteError, match=f"cannot write {not_a_dir}"):
        with fileio.staged(not_a_dir, ["report.json"]):
            pass
    with fileio.locked(tmp_path, "drift run"), fileio.staged(tmp_path, ["x"]) as stage:  # control: a directory
        (stage / "x").write_text("x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "x"]


def test_a_unit_a_killed_process_committed_is_completed_by_the_next(tmp_path, monkeypatch):
    d = tmp_path
    for name in "abc":
        (d / name).write_text(f"old {name}")
    real, moves = os.replace, []

    def killed_after_one(src, dst):
        if Path(src).parent.name == fileio.UNIT_DIR:  # a move of the committed unit into place
            if moves:
                raise SystemExit("killed")  # as SIGKILL would: between two renames of the unit
            moves.append(dst)
        real(src, dst)

    monkeypatch.setattr(fileio.os, "replace", killed_after_one)
    with pytest.raises(SystemExit):
        with fileio.staged(d, "abc") as stage:
            (stage / "a").write_text("new a")
            (stage / "b").write_text("new b")  # c: not written, so removed with the unit
    assert [(d / n).read_text() for n in "abc"] == ["new a", "old b", "old c"]  # a mix, committed
    monkeypatch.undo()
    with fileio.staged(d, "abc") as stage:
        assert (d / "b").read_text() == "new b" and not (d / "c").exists()  # completed before anything else
        (stage / "c").write_text("newer c")
    assert sorted(p.name for p in d.iterdir()) == ["c"] and (d / "c").read_text() == "newer c"


def test_a_full_disk_exits_2_naming_the_path_and_leaves_no_partial_file(tmp_path, capsys, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fileio.os, "fsync", full)
    out = tmp_path / "rep"
    assert main(RUN + ["--report", str(out)]) == EXIT_USAGE
    err = err_of(capsys)
    assert f"cannot write {out / 'report.json'} (No space left on device)" in err
    assert list(out.iterdir()) == []  # no report, no temporary file


# ----------------------------------------------------------- code under test
KERNELS = '''
from drift.sim import kernels

def raises(args):
    raise RuntimeError("kernel bug")

def returns_none(args):
    return None

def short(args):
    return kernels.recurrent_gated_delta_rule(args)[:, :1]

def fp32(args):
    return kernels.recurrent_gated_delta_rule(args).float()

def two_args(args, other):
    return None

def op_raises(mix_qkv, recurrent_state, *, beta, scale, actual_seq_lengths, ssm_state_indices, nk, nv,
              intermediate_state=None, cache_indices=None, num_accepted_tokens=None, g=None):
    raise ValueError("op bug")

def op_positional(mix_qkv, recurrent_state, beta):
    return None

class Takes:
    def __call__(self, args, other):
        return None

an_object = Takes()
'''


@pytest.mark.parametrize("kernel, code, words", [
    ("raises", EXIT_FAIL, "kern.py:raises) raised RuntimeError('kernel bug') (raised at "),
    ("returns_none", EXIT_FAIL, "returned NoneType, not a bfloat16 tensor"),
    # the default (serving) run's first step: 4 running requests fill its graph bucket, no padded row
    ("short", EXIT_FAIL, "returned shape (2, 1, 4, 4, 64), expected (2, 4, 4, 4, 64) at decode step 0"),
    ("fp32", EXIT_FAIL, "returned a torch.float32 tensor, expected bfloat16"),
    ("two_args", EXIT_USAGE, "cannot take one VerifyArgs"),
    ("npu-op:op_raises", EXIT_FAIL, "failed at decode step 0, layer 0: the op raised ValueError('op bug')"),
    ("npu-op:op_positional", EXIT_USAGE, "cannot take SGLang's call"),
    ("an_object", EXIT_USAGE, "has signature Takes.__call__(args, other), which cannot take one VerifyArgs"),
    ("npu-op:no_such_op", EXIT_USAGE, "kernel spec 'npu-op:"),  # the spec as given, prefix and all
])
def test_a_misbehaving_verify_kernel_fails_as_code_under_test(tmp_path, capsys, kernel, code, words):
    f = tmp_path / "kern.py"
    f.write_text(KERNELS)
    prefix, _, name = kernel.rpartition(":")
    spec = f"{prefix + ':' if prefix else ''}{f}:{name}"
    assert main(RUN + ["--kernel", spec]) == code
    err = err_of(capsys)
    assert words in err, err
    assert err.startswith("drift run: FAIL: the verify kernel under test" if code == EXIT_FAIL else "drift run: error:")


VLLM_ASCEND = f"{Path(__file__).resolve().parent / 'fixtures' / 'fake_vllm_ascend_op.py'}"
STAND_INS = f'''
import importlib.util
spec = importlib.util.spec_from_file_location("fake_op", {VLLM_ASCEND!r})
fake = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fake)

def none(**kw):
    return None

def short(**kw):
    return fake.npu_recurrent_gated_delta_rule(**kw)[:1]

def fp32(**kw):
    return fake.npu_recurrent_gated_delta_rule(**kw).float()
'''


@pytest.mark.parametrize("op, words", [
    ("none", "layer 0: the op returned NoneType, not a bfloat16 tensor"),
    ("short", "layer 0: the op returned shape (1, 4, 64), expected (16, 4, 64)"),  # T = 4 rows x 4 tokens (serving)
    ("fp32", "layer 0: the op returned a torch.float32 tensor, expected bfloat16"),  # never cast
])
def test_a_stand_in_op_is_judged_by_what_it_returned(tmp_path, capsys, op, words):
    f = tmp_path / "ops.py"
    f.write_text(STAND_INS)
    assert main(RUN + ["--flow", "vllm", "--kernel", f"vllm-ascend-op:{f}:{op}"]) == EXIT_FAIL
    err = err_of(capsys)
    assert words in err and "raised" not in err, err


def test_a_raised_keyboard_interrupt_is_code_a_signal_is_not():
    from drift.errors import ended_by_code

    def raises():
        raise KeyboardInterrupt

    def signalled():  # the default handler raises it where the loop happens to be
        # to this thread (os.kill may hand it to a torch worker thread that a loaded box leaves
        # descheduled past a fixed-length loop), and wait for it rather than for a loop count
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pass

    caught = []
    for fn in (raises, signalled):
        try:
            fn()
        except KeyboardInterrupt as exc:
            caught.append(ended_by_code(exc))
    assert caught == [True, False]
    assert ended_by_code(SystemExit(0)) and not ended_by_code(ValueError())


def test_an_engine_commit_under_another_flow_names_the_harness_not_a_kernel(capsys):
    assert main(RUN + ["--flow", "sglang", "--update", "drift.plug.replayssm_engine:sglang_commit"]) == EXIT_USAGE
    err = err_of(capsys)
    assert "read self.spec_state" in err and "pass --flow sglang-replayssm" in err and "--kernel" not in err, err


# ----------------------------------------------------------------------- nightly
NIGHTLY = ["nightly", "--preset", "ci-small", "--variant", "rne", "--layers", "1", "--quiet"]


@pytest.fixture(scope="module")
def nightly_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("nightly")
    assert main(NIGHTLY + ["--steps", "16", "--report", str(out)]) == EXIT_PASS
    return out


@pytest.mark.parametrize("extra", [["--variant", "sequential"], ["--flow", "sglang"]])
def test_every_nightly_update_is_loaded_before_any_entry_runs(tmp_path, capsys, extra):
    """Sequential decode runs no update, yet a bad one is refused (it was silently ignored); an update
    (a mutant) of another flow is refused before the first entry, not after it."""
    update = "nosuch.py:f" if "sequential" in extra else "mutant:vllm_start_plus1"
    argv = [a for a in NIGHTLY if a not in ("--variant", "rne")] + ["--steps", "16", "--update", update]
    out = tmp_path / "n"
    assert main(argv + extra + ["--report", str(out)]) == EXIT_USAGE
    err = err_of(capsys)
    assert ("not found" if "sequential" in extra else "pass --flow vllm") in err, err
    assert not out.exists()


def test_resume_reuses_only_results_of_the_same_configuration(nightly_dir, tmp_path, capsys):
    import shutil

    d = tmp_path / "n"
    shutil.copytree(nightly_dir, d)
    capsys.readouterr()
    assert main(NIGHTLY + ["--steps", "8", "--report", str(d), "--resume"]) == EXIT_PASS
    err = capsys.readouterr().err
    assert "redoing ci-small.seed0.sglang-0.5.23.rne" in err and "config.steps 16 -> 8" in err
    (entry,) = json.loads((d / "report.json").read_text())["entries"].values()
    assert entry["steps"] == 8  # not the 16-step result
    assert main(NIGHTLY + ["--steps", "8", "--report", str(d), "--resume"]) == EXIT_PASS
    assert "redoing" not in capsys.readouterr().err  # the same configuration is reused


def test_a_checkpoint_of_another_configuration_is_set_aside(tmp_path):
    entry = nightly.Entry("ci-small", 0, "sglang-0.5.23", "rne", 8, 1)
    want = nightly.identity(entry, "cpu")
    other = nightly.identity(nightly.Entry("ci-small", 0, "sglang-0.5.23", "rne", 8, 2), "cpu")
    newest, _ = nightly.checkpoint_paths(tmp_path, entry)
    checkpoint.save(newest, {"entry": entry.key, "identity": other})
    log = io.StringIO()
    assert nightly.load_resume_state(tmp_path, entry, log, want) is None
    assert "config.num_layers 2 -> 1" in log.getvalue() and (tmp_path / (newest.name + ".stale")).exists()
    checkpoint.save(newest, {"entry": entry.key, "identity": want})  # positive control: the same one resumes
    assert nightly.load_resume_state(tmp_path, entry, io.StringIO(), want)["identity"] == want


def test_an_interrupted_nightlys_checkpoints_are_never_thrown_away_unasked(tmp_path, capsys):
    """A killed nightly leaves checkpoints and no report.json; running again without --resume deleted them
    and started over, saying nothing (a user trial). Refused now (exit 2) naming --resume and --force;
    the files are untouched."""
    ckpt = tmp_path / "out" / "checkpoints"
    ckpt.mkdir(parents=True)
    (ckpt / "entry.ckpt").write_bytes(b"a killed run's state")
    assert main(NIGHTLY + ["--steps", "8", "--report", str(tmp_path / "out")]) == EXIT_USAGE
    err = err_of(capsys)
    assert "checkpoints of a run that did not finish" in err and "--resume" in err and "--force" in err, err
    assert (ckpt / "entry.ckpt").read_bytes() == b"a killed run's state"


def test_a_report_directory_is_never_silently_overwritten_or_shared(nightly_dir, capsys):
    before = (nightly_dir / "report.json").read_bytes()
    assert main(NIGHTLY + ["--steps", "8", "--report", str(nightly_dir)]) == EXIT_USAGE
    assert "already holds a report" in err_of(capsys)
    with fileio.locked(nightly_dir, "drift nightly"):  # another nightly writing there
        assert main(NIGHTLY + ["--steps", "8", "--report", str(nightly_dir), "--resume"]) == EXIT_USAGE
        assert f"in use by another drift nightly (pid {os.getpid()})" in err_of(capsys)
    assert (nightly_dir / "report.json").read_bytes() == before
    assert not (nightly_dir / ".lock").exists()  # released and removed


def _of_seed(entry: dict, seed: int) -> dict:
    """A copy of a report entry that says it ran with another seed (another configuration)."""
    entry = json.loads(json.dumps(entry))
    entry["identity"]["entry"]["seed"] = entry["identity"]["config"]["seed"] = seed
    return entry


def test_a_bad_baseline_is_refused_before_the_nightly_runs(nightly_dir, tmp_path, capsys):
    rep = json.loads((nightly_dir / "report.json").read_text())
    cases = {"list": ({**rep, "entries": list(rep["entries"].values())}, "'entries' is a list"),
             "deep": (None, "nested deeper"),
             "none": ({**rep, "entries": {"other.seed0.x.rne": _of_seed(next(iter(rep["entries"].values())), 7)}},
                      "matches no entry of this run")}
    for name, (obj, words) in cases.items():
        base = tmp_path / f"{name}.json"
        base.write_text(DEEP if obj is None else json.dumps(obj))
        out = tmp_path / f"out-{name}"
        assert main(NIGHTLY + ["--steps", "8", "--report", str(out), "--baseline", str(base)]) == EXIT_USAGE, name
        err = err_of(capsys)
        assert words in err, err
        assert not (out / "report.json").exists()
    shard = tmp_path / "shard"
    shard.mkdir()
    (shard / "report.json").write_text(json.dumps(cases["list"][0]))
    assert main(["report", "merge", str(shard), "-o", str(tmp_path / "merged")]) == EXIT_USAGE
    assert "'entries' is a list" in err_of(capsys)


def test_a_nightly_never_writes_over_its_baseline(nightly_dir, capsys):
    base = nightly_dir / "report.json"
    before = base.read_bytes()
    assert main(NIGHTLY + ["--steps", "16", "--report", str(nightly_dir), "--force", "--baseline", str(base)]) == EXIT_USAGE
    assert "is the same file as the baseline" in err_of(capsys) and base.read_bytes() == before


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, Path]:
    """Shards 1/2 and 2/2 of a two-variant matrix at 16 steps, and shard 2/2 of it at 8 steps."""
    root = tmp_path_factory.mktemp("shards")
    out = {}
    for name, shard, steps in (("one", "1/2", "16"), ("two", "2/2", "16"), ("two_short", "2/2", "8")):
        out[name] = root / name
        assert main(NIGHTLY + ["--variant", "fp32", "--steps", steps, "--shard", shard, "--report", str(out[name])]) == 0
    return out


def _edited(src: Path, dst: Path, edit) -> Path:
    rep = json.loads((src / "report.json").read_text())
    edit(rep)
    dst.mkdir()
    (dst / "report.json").write_text(json.dumps(rep))
    return dst


def _ident(rep: dict) -> dict:
    return next(iter(rep["entries"].values()))["identity"]


@pytest.mark.parametrize("case, words", [
    ("steps", "in its matrix (matrix.0.steps 16 -> 8"),
    ("alone", "shard 2/2 is missing"),
    ("twice", "shard 1/2 is given 2 times"),
    ("duplicate", "is in 2 shards"),
    ("code", "the code of update sglang-0.5.23 differs"),
    ("arch", "what computes the figures differs"),
    ("no identity", "records no identity"),
])
def test_merge_refuses_reports_that_do_not_belong_together(shards, tmp_path, capsys, case, words):
    one, two = shards["one"], shards["two"]
    key_one = next(iter(json.loads((one / "report.json").read_text())["entries"]))
    dirs = {"steps": lambda: [one, shards["two_short"]], "alone": lambda: [one], "twice": lambda: [one, one, two],
            "duplicate": lambda: [one, _edited(two, tmp_path / "dup", lambda r: r["entries"].update(
                {key_one: json.loads((one / "report.json").read_text())["entries"][key_one]}))],
            "code": lambda: [one, _edited(two, tmp_path / "code", lambda r: _ident(r)["update"]["modules"].update(
                {"drift.flows.copy_commit.updates": "0" * 16}))],
            "arch": lambda: [one, _edited(two, tmp_path / "arch", lambda r: _ident(r)["numerics"].update(
                {"machine": "aarch64" if _ident(r)["numerics"]["machine"] != "aarch64" else "x86_64"}))],
            "no identity": lambda: [one, _edited(two, tmp_path / "old", lambda r: next(iter(
                r["entries"].values())).pop("identity"))]}[case]()
    out = tmp_path / "merged"
    assert main(["report", "merge", *map(str, dirs), "-o", str(out)]) == EXIT_USAGE
    assert words in err_of(capsys) and not (out / "report.json").exists()
    assert main(["report", "merge", str(one), str(two), "-o", str(out)]) == EXIT_PASS  # control: the two shards
    assert json.loads((out / "report.json").read_text())["shard"] == "merged 1/2, 2/2"


def test_merge_never_overwrites_a_shard_or_a_report_without_force(shards, tmp_path, capsys):
    one, two = shards["one"], shards["two"]
    before = (one / "report.json").read_bytes()
    for out in (one, Path(f"{one}/../{one.name}")):
        assert main(["report", "merge", str(one), str(two), "-o", str(out)]) == EXIT_USAGE
        assert "is the same file as a file of shard" in err_of(capsys)
    assert (one / "report.json").read_bytes() == before
    out = tmp_path / "merged"
    assert main(["report", "merge", str(one), str(two), "-o", str(out)]) == EXIT_PASS
    assert main(["report", "merge", str(one), str(two), "-o", str(out)]) == EXIT_USAGE
    err = err_of(capsys)
    assert "already holds a report" in err and "pass --force" in err
    assert main(["report", "merge", str(one), str(two), "-o", str(out), "--force"]) == EXIT_PASS


# ------------------------------------------------------------------- interrupts
def _as_launched_by_a_ci_runner():
    # SIGINT as a terminal delivers it, even where the test runner's worker ignores it; SIGTERM
    # blocked, as a CI runner's inherited signal mask had it (the SIGTERM case then exited 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupt_exits_with_one_line_and_leaves_nothing_half_written(tmp_path, sig, code):
    gdir = tmp_path / "g"
    proc = subprocess.Popen([sys.executable, "-m", "drift", "regen-golden", "--golden-dir", str(gdir),
                             "--preset", "stagnation"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_as_launched_by_a_ci_runner)
    assert "generating" in proc.stdout.readline()  # it is working now
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, f"stdout: {out!r}\nstderr: {err!r}"
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and "interrupted" in err
    assert not list(gdir.glob("*.tmp")) and not (gdir / "manifest.json").exists()


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupt_whose_exception_a_callback_swallowed_still_ends_the_command(tmp_path, monkeypatch, capsys,
                                                                                  sig, code):
    """Python runs a signal handler between any two bytecodes, also inside a weakref callback whose
    exception is only reported ("Exception ignored in"): a SIGTERM landing in importlib's module-lock
    callback let a regen-golden finish with exit 0 under load. drift remembers the interrupt and ends
    the command at the next chunk or write, writing nothing more."""
    from drift import errors

    real = golden.generate

    def swallowed_then_work(*args, **kwargs):
        try:
            errors.interrupt(sig)  # what the handler does, in a context that swallows what it raises
        except BaseException:
            pass
        return real(*args, **kwargs)

    monkeypatch.setattr(golden, "generate", swallowed_then_work)
    gdir = tmp_path / "g"
    assert main(["regen-golden", "--golden-dir", str(gdir), "--preset", "stagnation"]) == code
    err = capsys.readouterr().err
    assert "interrupted" in err and len(err.strip().splitlines()) == 1
    assert not list(gdir.glob("*.npz")) and not (gdir / "manifest.json").exists()
    errors.raise_if_interrupted()  # handled: nothing pending stays behind in this process
    # Negative control: without an interrupt the same command writes the golden data.
    monkeypatch.setattr(golden, "generate", real)
    assert main(["regen-golden", "--golden-dir", str(gdir), "--preset", "stagnation"]) == 0
    assert (gdir / "manifest.json").exists()


BASE_EXCEPTIONS = '''
class Odd(BaseException):
    pass

def raises_odd(self, last, track, steps):
    raise Odd("not an Exception")

def raises_generator_exit(self, last, track, steps):
    raise GeneratorExit()

def kernel_raises_odd(args):
    raise Odd("from the kernel")
'''


@pytest.mark.parametrize("option, name, line", [("--update", "raises_odd", 6), ("--update", "raises_generator_exit", 9),
                                                ("--kernel", "kernel_raises_odd", 12)])
def test_any_base_exception_code_raises_fails_the_run_naming_its_line(tmp_path, capsys, option, name, line):
    """Beside sys.exit and a raised KeyboardInterrupt (the battery in tests/test_front_ends.py): a
    BaseException that is not an Exception, of the code's own or GeneratorExit, would end the
    process as well; it fails the run (exit 1) at its line, never a traceback."""
    from drift.cli import main

    path = tmp_path / "base_exceptions.py"
    path.write_text(BASE_EXCEPTIONS)
    rc = main(["run", "--steps", "4", "--quiet", option, f"{path}:{name}"])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert f"{path}:{line}" in err and "which would end the process" in err and "Traceback" not in err, err


def test_os_exit_raises_only_while_drift_runs_code(tmp_path):
    """``os._exit`` ends the interpreter at once with the code's status -- an update calling
    ``os._exit(0)`` made ``drift run`` exit 0 with no output, a pass. While drift runs code it raises
    ProcessExit at the caller's line instead (drift/errors.py: no_process_exit; the battery in
    tests/test_front_ends.py runs it through both front ends); outside it, and in a forked child
    (multiprocessing's fork start method ends children that way), it ends the process as before."""
    code = ("import os\nfrom drift.errors import ProcessExit, no_process_exit, raised_at\n"
            "with no_process_exit():\n"
            "    try:\n"
            "        os._exit(3)\n"
            "    except ProcessExit as exc:\n"
            "        print('caught', repr(exc), raised_at(exc), flush=True)\n"
            "    pid = os.fork()\n"
            "    if pid == 0:\n"
            "        try:\n"
            "            os._exit(7)\n"
            "        finally:\n"
            "            __import__('drift.errors').errors._REAL_EXIT(9)\n"
            "    print('child', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)\n"
            "os._exit(5)\n"
            "print('not reached')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    # the guard's os._exit(3) raised at its line; the child exited 7 itself; after the guard, 5 ends it
    assert res.stdout.splitlines() == ["caught os._exit(3) <string>:5", "child 7"], res.stdout + res.stderr
    assert res.returncode == 5, res.stderr


CHECKS_WITHOUT_A_VERDICT = '''
from drift.check.checks import Check
from drift.check.registry import CHECKS, CheckSpec
import os

class Says(Check):
    key = "says"
    measures = ("state",)

    def consume(self, chunk):
        pass

    def result(self):
        return {"str": "fine", "none": None}[os.environ["SAYS"]]

which = os.environ["SAYS"]
if which in ("str", "none"):
    CHECKS.add(CheckSpec("says", "says", 74, "a toy", "consumer", build=lambda ctx: Says(0.1)))
elif which == "build-none":
    CHECKS.add(CheckSpec("says", "says", 74, "a toy", "consumer", build=lambda ctx: None))
else:  # a run-level check may have nothing to report (None), not something else
    CHECKS.add(CheckSpec("says", "says", 74, "a toy", "run",
                         result=lambda ctx: {"run-int": 42, "run-none": None}[which]))
'''


@pytest.fixture
def says(tmp_path, monkeypatch):
    from drift.check.registry import CHECKS
    from helpers import loaded_for_one_test

    path = tmp_path / "says.py"
    path.write_text(CHECKS_WITHOUT_A_VERDICT)
    yield from loaded_for_one_test(monkeypatch, path, (CHECKS,))


@pytest.mark.parametrize("which, words", [("str", "its result returned str, not a drift.check.result.CheckResult"),
                                          ("none", "its result returned NoneType, not a"),
                                          ("run-int", "its result returned int, not a"),
                                          ("build-none", "its build returned NoneType, which has no consume() or "
                                                         "result()")])
def test_an_extension_check_that_gives_no_verdict_is_refused(monkeypatch, capsys, says, which, words):
    """A check whose build or result gives no verdict is drift unable to run it (exit 2 naming it): it
    crashed the report with a traceback, or a consumer's None dropped its row from a PASS."""
    monkeypatch.setenv("SAYS", which)  # read as main() imports the extension
    assert main(RUN) == EXIT_USAGE
    err = err_of(capsys)
    assert "check 'says' of the extension" in err and words in err, err


def test_a_run_check_with_nothing_to_report_passes(monkeypatch, capsys, says):
    """The control: a run-level check's None is 'nothing to report', as drift's own checks' is."""
    monkeypatch.setenv("SAYS", "run-none")
    assert main(RUN) == EXIT_PASS, capsys.readouterr().err


def test_a_nightly_refuses_an_extension_check_that_cannot_be_built(tmp_path, monkeypatch, capsys, says):
    """The nightly builds every check for a result's identity before the first entry: an extension's
    build that raises or builds nothing is exit 2 there too (it was a traceback)."""
    monkeypatch.setenv("SAYS", "build-none")
    assert main(NIGHTLY + ["--steps", "16", "--report", str(tmp_path / "n")]) == EXIT_USAGE
    assert "its build returned NoneType" in err_of(capsys)
    assert not (tmp_path / "n" / "report.json").exists()


def test_a_run_too_short_to_cross_a_tracking_boundary_is_a_usage_error_in_both_front_ends(capsys, tmp_path):
    """Whether a boundary falls within the run is the stream's schedule alone (tracking every 16 positions,
    ci-small's prefill 24: one step of at most 4 tokens crosses none), never the code under test: exit 2
    (pytest: 4) naming --steps and --track-interval, no longer a FAILED tracked-snapshot check (exit 1; a
    user trial), and refused in the preflight, before any test ran (under pytest it was found at the end of
    the precision run, after the sync tests, as ``! _pytest.outcomes.Exit``; a re-trial). A run long
    enough (the control) passes."""
    assert main(["run", "--steps", "1", "--lifecycle", "fixed", "--quiet"]) == EXIT_USAGE
    err = err_of(capsys)
    assert "no tracking boundary fell within the 1 steps run" in err and "--track-interval 0" in err, err
    assert main(["run", "--steps", "1", "--lifecycle", "fixed", "--track-interval", "0", "--quiet"]) == EXIT_PASS
    gate = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "drift",
                           "--drift-preset", "ci-small", "--drift-steps", "1", "--drift-lifecycle", "fixed"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    out = gate.stdout + gate.stderr
    assert gate.returncode == 4 and "no tracking boundary fell within" in out and "Traceback" not in out, out[-2000:]
    assert "no tests ran" in out and "_pytest.outcomes.Exit" not in out, out[-2000:]  # the preflight's refusal
