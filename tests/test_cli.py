"""drift.cli ``drift run``: exit 0 when every check passes, 1 when one fails, 2 on a usage,
config, load or device error; the summary table and the --report files.

Runs the default preset (ci-small, full size) for a few dozen steps: enough to cross
track boundaries (interval 16) so every core check sees data.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import bad_spec
from drift.sim import native
from drift.cli import main
from drift.flows.registry import FLOWS
from drift.errors import EXIT_FAIL, EXIT_PASS, EXIT_USAGE
from drift.check.registry import CHECKS

RUN = ["run", "--steps", "40", "--quiet"]


def test_default_run_passes_and_prints_the_table(capsys):
    """``drift run`` with no update runs the released sglang-0.5.23 and passes every check."""
    assert main(RUN) == EXIT_PASS
    out = capsys.readouterr().out
    assert "update sglang-0.5.23, 40 steps (mtp)" in out and "PASS: every check passed" in out
    for spec in CHECKS.values():  # every check that applies to a CPU MTP run prints its row
        if spec.key not in ("mtp_vs_sequential", "run_completed"):
            assert f"\n{spec.title} " in out, spec.title


def test_sglang_32130_fails_only_on_its_tracking_sync(capsys):
    """sglang #32130 is precise but syncs on its boolean-mask tracking path: the README's second
    run exits 1 naming that line, every other check passing."""
    assert main(RUN + ["--update", "sglang-32130"]) == EXIT_FAIL
    out = capsys.readouterr().out
    assert out.rstrip().endswith("FAIL: " + CHECKS.title("host_syncs"))
    assert "drift/flows/copy_commit/updates.py:" in out and "Tensor.__getitem__" in out and "track_boolean_mask" in out


@pytest.mark.parametrize("args", [["--mode", "sequential"],
                                  ["--update", "sglang-0.5.23", "--profile", "fp32", "--pattern", "all-D"],
                                  ["--update", "sglang-0.5.23", "--rounding", "stochastic", "--seed", "3"]])
def test_other_correct_configurations_exit_0(args):
    assert main(RUN + args) == EXIT_PASS


def test_flow_option_reaches_the_config_and_the_report(tmp_path):
    """--flow accepted: the verify op continues from the previous step's scratch (the named
    variant of docs/semantics.md §6); the released update passes there too."""
    assert main(RUN + ["--flow", "npu-accepted", "--report", str(tmp_path)]) == EXIT_PASS
    assert json.loads((tmp_path / "report.json").read_text())["config"]["flow"] == "npu-accepted"


def test_failing_check_exits_1(capsys):
    """A file-spec update that commits draft step last + 1."""
    assert main(RUN + ["--update", bad_spec("commit_next_step")]) == EXIT_FAIL
    out = capsys.readouterr().out
    assert "FAIL: " in out and CHECKS.title("committed_state") in out.split("FAIL: ")[-1]


def test_report_files_even_for_a_nan_run(tmp_path, capsys):
    """--report writes JSON a strict parser reads (NaN worst values become null). --all-checks: its
    scalar-tensor index is also a host sync, which alone would stop the run before the simulation."""
    assert main(RUN + ["--update", bad_spec("commit_nan"), "--report", str(tmp_path), "--all-checks"]) == EXIT_FAIL
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["verdict"] == "fail" and rep["run"]["stopped_early"]
    assert rep["config"]["name"] == "ci-small" and rep["run"]["update"] == "commit_nan"
    assert {c["key"] for c in rep["checks"]} >= {"finite_states", "run_completed"}
    assert (tmp_path / "report.md").read_text().startswith("# drift run: FAIL")
    assert "wrote" in capsys.readouterr().out


def test_report_of_a_passing_run(tmp_path):
    assert main(RUN + ["--update", "sglang-0.5.23", "--report", str(tmp_path)]) == EXIT_PASS
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["verdict"] == "pass" and all(c["passed"] for c in rep["checks"])
    # ci-small's npu-layout bf16 states with RNE stores are what the native kernel takes.
    want = "portable, native C kernel (CPU)" if native.available() else "portable, torch ops"
    assert rep["run"]["verify_kernel"] == want and f"GDN verify: {want}" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "drift_vs_step.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "drift_vs_step.png" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("args, words", [
    (["--update", "/nonexistent/upd.py:fn"], "not found"),
    (["--update", "sync_fre"], "not a built-in"),
    (["--update", f"{bad_spec('nope')}"], "has no attribute 'nope'"),
    (["--device", "cuda"], "device='cuda' requested"),
    (["--device", "npu"], "device='npu' requested"),
])
def test_usage_config_load_and_device_errors_exit_2(cpu_only, capsys, args, words):
    assert main(RUN + args) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("drift run: error: ") and words in err


@pytest.mark.parametrize("args, words", [
    (["run", "--steps", "many"], "'many' is not an integer >= 1"),
    (["run", "--steps", "0"], "'0' is not an integer >= 1"),
    (["run", "--seed", "-1"], "seed '-1' is invalid"),
    (["run", "--preset", "nope"], "preset 'nope' is not known; allowed: ci-small"),
    (["run", "--profile", "tpu"], "profile 'tpu' is not known"),
    (["run", "--device", "tpu"], "device 'tpu' is not known"),
    (["run", "--flow", "ragged"], "flow 'ragged' is not known; allowed: " + ", ".join(FLOWS)),
    (["fly"], "invalid choice: 'fly'"),
    (["tradeoff", "--steps", "0"], "'0' is not an integer >= 1"),  # it used to run 1,024 steps silently
    (["mutants", "--steps", "-3"], "'-3' is not an integer >= 1"),
    (["bench", "--layers", "0"], "'0' is not an integer >= 1"),
    (["bench-update", "--batches", "0,2"], "is not a comma-separated list of batch sizes >= 1"),
])
def test_bad_arguments_exit_2(capsys, args, words):
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == EXIT_USAGE and words in capsys.readouterr().err


def test_unwritable_report_dir_is_rejected_before_the_run(capsys):
    """--report /proc/x used to run the whole simulation, then die with a traceback (exit 1)."""
    assert main(RUN + ["--report", "/proc/drift-report"]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert "drift run: error: --report /proc/drift-report: cannot write there" in captured.err
    assert "drift run: preset" not in captured.out  # no simulation ran


@pytest.mark.parametrize("command", ["run", "nightly", "tradeoff", "mutants", "regen-golden", "bench",
                                     "bench-update", "report"])
def test_every_command_calls_itself_by_its_name(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert capsys.readouterr().out.startswith(f"usage: drift {command} ")


def test_an_update_that_raises_fails_the_run_with_its_message(tmp_path, capsys):
    plugin = tmp_path / "raises.py"
    plugin.write_text("def update(self, last, track, steps):\n    raise ValueError('boom')\n")
    assert main(RUN + ["--update", f"{plugin}:update"]) == EXIT_FAIL
    err = capsys.readouterr().err
    assert f"raised ValueError('boom') (raised at {plugin}:2) at decode step 0" in err  # its line named
    # with --report the CI's artifacts say what failed (they were an empty directory)
    assert main(RUN + ["--update", f"{plugin}:update", "--report", str(tmp_path / "r")]) == EXIT_FAIL
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["verdict"] == "fail" and "raised ValueError('boom')" in report["error"] and report["checks"] == []
    assert "raised ValueError('boom')" in (tmp_path / "r" / "report.md").read_text()


# ------------------------------------------------------------- help, version
def _all_actions():
    import argparse

    from drift.cli import build_parser

    for name, p in next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices.items():
        for action in p._actions:
            yield name, action
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sp in action.choices.items():
                    yield from ((f"{name} {sub_name}", a) for a in sp._actions)


def test_every_help_entry_says_something():
    empty = [(name, a.option_strings or a.dest) for name, a in _all_actions() if not (a.help or "").strip()]
    assert empty == []


def test_version(capsys):
    from drift.version import __version__

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"drift {__version__}"


def test_stored_help_texts_are_the_parsers():
    """drift/_help.py (what --help prints without importing torch) is the parser's own help."""
    from drift._help import HELP
    from drift.cli import help_texts

    assert HELP == help_texts(), "drift/_help.py is stale: run python scripts/update_readme.py --help-only"


def test_readme_synopsis_is_the_parsers():
    from pathlib import Path

    from drift.cli import synopsis_markdown

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start, end = "<!-- drift:synopsis -->", "<!-- /drift:synopsis -->"
    assert start in text and end in text
    assert text.split(start, 1)[1].split(end, 1)[0].strip() == synopsis_markdown().strip(), \
        "the README synopsis is stale: run python scripts/update_readme.py --help-only"


@pytest.mark.parametrize("argv, key", [(["--help"], ""), (["run", "--help"], "run"), (["run", "--steps", "5", "-h"], "run"),
                                       (["report", "merge", "-h"], "report merge"), (["nightly", "-h"], "nightly")])
def test_help_answers_from_the_stored_texts(argv, key):
    from drift.__main__ import quick_answer
    from drift._help import HELP

    assert quick_answer(argv) == HELP[key] and HELP[key].startswith("usage: drift")


def test_other_arguments_go_to_the_parser():
    from drift.__main__ import quick_answer

    # Negative controls: no help flag, or an unknown command (the parser names the error).
    assert quick_answer(["run", "--steps", "5"]) is None and quick_answer(["bogus", "--help"]) is None


def test_help_and_version_import_no_torch():
    """The drift command's --help and --version load neither torch nor drift.cli (seconds to
    import). Negative control: running a command does load torch."""
    code = ("import sys, contextlib, io\nfrom drift.__main__ import main\n"
            "cmds = ['run', 'bench', 'bench-update', 'nightly', 'report', 'tradeoff', 'mutants', 'regen-golden',\n"
            "        'capture', 'trace-stats']\n"
            "for argv in [['--version'], ['--help'], ['report', 'merge', '--help']] + [[c, '--help'] for c in cmds]:\n"
            "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "        assert main(argv) == 0 and out.getvalue().startswith(('usage: drift', 'drift ')), argv\n"
            "    assert 'torch' not in sys.modules and 'drift.cli' not in sys.modules, argv\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    main(['bench-update', '--batches', '1', '--steps', '1', '--update', 'sglang-0.5.23'])\n"
            "print('torch' in sys.modules)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "True"


def test_the_command_lets_idle_openmp_threads_sleep_unless_told_otherwise():
    from drift.__main__ import openmp_defaults

    env = {}
    openmp_defaults(env, modules={})
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    mine = {"OMP_WAIT_POLICY": "ACTIVE"}  # the user's choice stands
    openmp_defaults(mine, modules={})
    assert mine == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_the_command_gives_openblas_one_thread_unless_told_otherwise_or_too_late():
    """One OpenBLAS thread leaves drift's process one thread, so a run may fork its comparison
    (drift/check/forked.py); the user's count stands, and so does the pool of a numpy already loaded."""
    from drift.openmp import blas_defaults

    env = {}
    assert blas_defaults(env, modules={}) == "OPENBLAS_NUM_THREADS=1" and env == {"OPENBLAS_NUM_THREADS": "1"}
    mine = {"OPENBLAS_NUM_THREADS": "4"}
    assert "the user's" in blas_defaults(mine, modules={}) and mine == {"OPENBLAS_NUM_THREADS": "4"}
    late = {}
    assert "numpy was imported before" in blas_defaults(late, modules={"numpy": object()}) and late == {}


def test_openmp_defaults_take_one_thread_where_torch_read_the_environment_already():
    """torch imported before the defaults (the pytest plugin after a conftest or another plugin):
    its runtime spins as it read the environment, so torch gets one thread, unless the user chose
    the policy or the thread count. (The live pytest runs: tests/plug/test_plugin.py.)"""
    from drift.openmp import openmp_defaults

    class FakeTorch:
        def __init__(self):
            self.calls = []

        def set_num_threads(self, n):
            self.calls.append(n)

    cases = [({}, [1]), ({"OMP_NUM_THREADS": "4"}, []), ({"OMP_WAIT_POLICY": "ACTIVE"}, [])]
    for env, calls in cases:
        torch = FakeTorch()
        said = openmp_defaults(env, modules={"torch": torch})
        assert torch.calls == calls, (env, said)
        assert env["OMP_WAIT_POLICY"] in ("PASSIVE", "ACTIVE") and env["OMP_WAIT_POLICY"] in said


def test_an_interrupt_while_starting_exits_130_without_a_traceback(monkeypatch, capsys):
    """Ctrl-C during the seconds drift spends importing torch: one line, exit 130."""
    import sys

    from drift.__main__ import main as entry

    class Interrupted:
        def __getattr__(self, name):
            raise KeyboardInterrupt

    monkeypatch.setitem(sys.modules, "drift.cli", Interrupted())
    assert entry(["run"]) == 130
    assert capsys.readouterr().err == "drift: interrupted (SIGINT) while starting; nothing was written\n"


END = """
import atexit, sys, threading, time
from pathlib import Path
from drift.__main__ import end_process
out = Path(sys.argv[1])
atexit.register(lambda: (out / "exit-handler").write_text("ran"))

class Held:  # freed by Python's teardown, not by end_process's
    def __del__(self):
        (out / "teardown").write_text("ran")

held = Held()
if sys.argv[2] == "thread":  # a thread that is not a daemon: Python's own exit waits for it
    threading.Thread(target=lambda: (time.sleep(0.3), (out / "thread").write_text("done"))).start()
sys.stdout.write("unflushed " * int(sys.argv[3]))
end_process(3)
"""


@pytest.mark.parametrize("thread", ["none", "thread"])
def test_the_command_ends_its_process_with_its_code_after_the_exit_handlers(tmp_path, thread):
    """``drift``'s process ends with the command's code, its exit handlers run and its output flushed,
    and without the module teardown (drift/__main__.py: end_process); a thread that is not a daemon
    is waited for, by Python's own exit."""
    proc = subprocess.run([sys.executable, "-c", END, str(tmp_path), thread, "3"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "unflushed " * 3
    assert (tmp_path / "exit-handler").read_text() == "ran"
    if thread == "thread":
        assert (tmp_path / "thread").read_text() == "done"
        assert (tmp_path / "teardown").exists()  # Python's exit: the teardown ran
    else:
        assert not (tmp_path / "teardown").exists()  # the 0.7 s end_process saves


def test_the_command_ending_on_a_closed_pipe_exits_120_as_python_does(tmp_path):
    """``drift run | head``: the output left to flush at the end (under the pipe buffer: 1,000 bytes) cannot
    be written, and the process ends with 120, Python's code for it."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # the output waits in the buffer
    proc = subprocess.Popen([sys.executable, "-c", END, str(tmp_path), "none", "100"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=env)
    proc.stdout.close()
    assert proc.wait(timeout=60) == 120
    assert (tmp_path / "exit-handler").read_text() == "ran"


def test_the_drift_command_is_the_entry_that_ends_its_process():
    """The installed ``drift`` script and ``python -m drift`` both go through ``entry``."""
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "drift"]
    assert script.value == "drift.__main__:entry"
    proc = subprocess.run([sys.executable, "-m", "drift", "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("drift ")
