"""pytest plugin for drift (registered through the ``pytest11`` entry point).

An engine's CI runs drift's PR-gating checks against its own code::

    pytest --pyargs drift --drift-device npu \\
        --drift-update sglang.srt.hardware_backend.npu.attention.ascend_hybrid_linear_attn_backend:AscendHybridLinearAttnBackend.update_mamba_state_after_mtp_verify \\
        --drift-kernel npu

Options: every shared run option of ``drift run`` (drift/options.py: ``RUN_OPTIONS``), spelled
``--drift-`` + its name and read into the same :class:`drift.runspec.RunSpec`: ``--drift-preset
--drift-steps --drift-seed --drift-device --drift-profile --drift-rounding --drift-pattern
--drift-drafts --drift-flow --drift-draft-tokens --drift-key-heads --drift-value-heads --drift-update``
(repeatable) ``--drift-update-factory --drift-kernel --drift-mode --drift-trace --drift-loop
--drift-no-graph``; ``pytest --help`` lists them with their defaults. Without ``--drift-preset``
every gate test runs on each of ``GATE_PRESETS`` (drift/config.py: ci-small, and ci-heads with 2 key
heads and D = 2). Also ``--drift-force-regen``: regenerate golden data a test asks for, then fail
that test so the change is reviewed (as pytest-regressions' ``--force-regen``); ``--drift-fail-fast``
(implied by ``-x``): stop a precision run at its first failing chunk. A precision run prints a
progress line per chunk of steps through the terminal reporter (fixtures ``drift_fail_fast``,
``drift_progress``). The precision runs are made ahead, in a process of their own, while the sync tests
run, where the session may fork (drift/gate_ahead.py; fixture ``drift_ahead``; ``-v`` says where).

Markers: ``cuda``, ``npu`` (a test needing that device skips, naming it, when the run did not
ask for the device, and fails when it asked and the device is absent) and ``nightly``.

OpenMP: the ``drift`` command's defaults (drift/openmp.py), applied when pytest imports this
plugin, before the imports below load torch: ``OMP_WAIT_POLICY=PASSIVE`` unless set, inherited by
pytest-xdist's workers (each imports this plugin afresh); where torch was imported before the
plugin, one intra-op thread instead. pytest's header says which.

MKL: in drift's sessions only (``--pyargs drift``, or a ``--drift-*`` run option), its code path pinned to
``MKL_CBWR=COMPATIBLE`` unless set (drift/mkl.py: the same figures on an Intel and an AMD runner), at
configure time, before any test computes; the header says what was done.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
from dataclasses import replace
from typing import Optional

import pytest

from drift.mkl import mkl_defaults
from drift.openmp import blas_defaults, openmp_defaults
from drift.process_end import freeze_for_exit

OPENMP = openmp_defaults()  # first: the imports below load torch and its OpenMP runtime


def drifts_command_line(argv) -> bool:
    """Whether pytest's arguments ask for drift's tests, as :func:`_drifts_session` decides once they are
    parsed (``--pyargs`` and ``drift`` or a module of it, or a ``--drift-*`` option); read before, at import."""
    named = any(a == "drift" or a.startswith(("drift.", "drift::")) for a in argv)
    return ("--pyargs" in argv and named) or any(a.startswith("--drift-") for a in argv)


# Before the imports below load numpy: one OpenBLAS thread leaves the process one thread, so a run may
# fork its comparison (drift/openmp.py: blas_defaults). drift's sessions only: another project's numpy
# keeps its threads.
BLAS = (blas_defaults() if drifts_command_line(sys.argv[1:] + shlex.split(os.environ.get("PYTEST_ADDOPTS", "")))
        else "not drift's session: OpenBLAS left alone")
MKL = "not pinned: not drift's session (pytest --pyargs drift, or a --drift-* option)"  # pytest_configure


def rewrite_only_the_gate() -> bool:
    """pytest rewrites the asserts of every module of a ``pytest11`` plugin's distribution
    (``_pytest/config/__init__.py: _mark_plugins_for_rewrite``), so each of drift's ~120 modules is
    parsed and rewritten on every run that has no rewrite cache -- a fresh CI runner, or
    ``PYTHONDONTWRITEBYTECODE``: about 1.5 s of the gate. Their asserts are not tests; the gate's are
    in :mod:`drift.test_gate`, which pytest still rewrites as a collected test module and which stays
    marked. pytest has no public call to unmark a name: its rewrite hook's ``_must_rewrite`` set is
    narrowed where it exists (pytest 7-9), and nothing changes where it does not. Returns whether it was."""
    import sys

    for hook in sys.meta_path:
        marked = getattr(hook, "_must_rewrite", None)
        if type(hook).__name__ == "AssertionRewritingHook" and isinstance(marked, set) and "drift" in marked:
            marked.discard("drift")
            marked.add("drift.test_gate")
            getattr(hook, "_marked_for_rewrite_cache", {}).clear()
            return True
    return False


REWRITE_NARROWED = rewrite_only_the_gate()  # before the imports below load drift's modules

from drift.check.golden import GOLDEN_PRESETS, load_golden, regenerate, requires_golden, write_trace_golden
from drift.config import DEFAULT_PRESET, GATE_PRESETS
from drift.runspec import RunSpec
from drift.devices import resolve_device
from drift.errors import EXIT_USAGE, DeviceUnavailable, DriftError, no_process_exit
from drift.gate_ahead import RunsAhead, ahead_refusal
from drift.options import DEFAULTS, RUN_OPTIONS, add_options, dest
from drift.plug.loader import ENGINE_UPDATES
from drift.plug.extensions import load_extensions
from drift.runner import preflight
from drift.runspec import Resolved
from drift.sim import native

DEVICE_MARKERS = ("cuda", "npu")
MARKERS = {
    "nightly": "long-horizon drift runs (excluded by default; run with pytest -m nightly -n auto)",
    "cuda": "needs a CUDA device (select with --drift-device cuda)",
    "npu": "needs an Ascend NPU through torch_npu (select with --drift-device npu)",
}
PREFIX = "drift-"


def pytest_addoption(parser: pytest.Parser) -> None:
    try:
        with no_process_exit():  # an extension's os._exit at import is refused, as under drift
            load_extensions()  # $DRIFT_EXTENSIONS, before any option is read (as the drift command)
    except DriftError as exc:
        raise pytest.UsageError(f"drift: error: {exc}") from None
    group = parser.getgroup("drift", "drift precision-drift suite")
    add_options(group.addoption, RUN_OPTIONS, prefix=PREFIX, repeat=("update",), defaults={"preset": None},
                default_text={"preset": f"the gate's shapes, {' and '.join(GATE_PRESETS)}; with --drift-trace, "
                                        f"{DEFAULT_PRESET}'s batch"})
    group.addoption("--drift-force-regen", action="store_true", default=False,
                    help="regenerate golden trajectories used by the tests (then fail them for review)")
    group.addoption("--drift-fail-fast", action="store_true", default=False,
                    help="stop a precision run at the end of the chunk (16 steps, then as many as are done, up "
                         "to 256) in which a check first fails, as drift run --fail-fast (implied by -x / --maxfail 1)")


def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    global MKL
    if _drifts_session(config):  # before any test computes (MKL reads its mode when it first runs)
        MKL = mkl_defaults()
    trace = config.getoption(dest(PREFIX, "trace"), None)
    if trace:  # a bad trace, or one too short for --drift-steps: one usage error now, not one per test
        try:
            spec_from_options(config.getoption).config()
        except DriftError as exc:
            raise pytest.UsageError(f"--drift-trace {trace}: {exc}") from None


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """The last hook of drift's session in a process of its own -- the ``pytest`` command, or an xdist
    worker -- leaves the process's objects out of Python's final collections
    (:func:`drift.process_end.freeze_for_exit`: 0.6 s of every such process). A session run inside
    another program (``pytest.main``, whose arguments are not the process's) is left alone: the
    program goes on, and its cycles must stay collectable."""
    own_process = hasattr(config, "workerinput") or list(config.invocation_params.args) == sys.argv[1:]
    if own_process and _drifts_session(config):
        freeze_for_exit()


# ------------------------------------------------------------------------ exit codes
# drift's exit 2 (the run could not be made: a spec that does not load, an update the harness cannot
# run, an absent device, a bad option) is pytest's usage error (exit 4), raised once, before any test
# runs; only what a test measures fails it (exit 1). README: "Exit codes".
def _preflight(config: pytest.Config, updates) -> None:
    spec = spec_from_options(config.getoption)
    for update in updates:
        try:
            with no_process_exit():
                preflight(replace(spec, update=update).resolve())
        except DriftError as exc:
            raise pytest.UsageError(f"drift: error: {exc}") from None


def _distributed(config: pytest.Config) -> bool:
    """Whether pytest-xdist runs the tests in workers (this process, the controller, collects none)."""
    return config.pluginmanager.hasplugin("xdist") and getattr(config.option, "dist", "no") != "no"


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under pytest-xdist, the controller preflights the runs of drift's own tests (``--pyargs
    drift``, or any --drift-* option given), once, before its workers start; they do not."""
    config = session.config
    if hasattr(config, "workerinput") or not _distributed(config):
        return
    if _drifts_session(config):
        _preflight(config, config.getoption(dest(PREFIX, "update")) or [DEFAULTS["update"]])


def _drifts_session(config: pytest.Config) -> bool:
    """Whether this session runs drift's tests: ``--pyargs drift`` (or a module of it, ``drift.test_gate``),
    or any --drift-* run option given (a plugin loaded into another project's session, which asks for
    neither, changes nothing there)."""
    given = any(config.getoption(dest(PREFIX, name), None) not in (None, False, [], DEFAULTS.get(name))
                for name in RUN_OPTIONS)
    named = any(a == "drift" or a.startswith(("drift.", "drift::")) for a in config.args)
    return given or bool(config.getoption("pyargs", False) and named)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Every run the collected drift tests ask for (one per --drift-update), resolved and
    preflighted (drift.runner.preflight) before the first test: a refusal is a usage error."""
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: its controller did (a usage error here would crash the worker)
    items = [i for i in session.items if "drift_run" in getattr(i, "fixturenames", ())]
    if items:
        _runs_ahead(session, items)  # first: they simulate while this process preflights and scans
        try:
            _preflight(session.config, dict.fromkeys(
                getattr(i, "callspec", None) and i.callspec.params.get("drift_update") for i in items))
        except BaseException:
            _end_runs_ahead(session.config)
            raise


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """What only running finds drift unable to run (an extension's check that raises as it
    consumes, a harness gap the scan's steps did not reach) ends the session as the same usage
    error (exit 4, drift's one line), not as one failed test among others. While a test of drift's
    runs, code that calls ``os._exit`` raises instead (drift.errors.no_process_exit), so it fails
    that test rather than ending pytest with the code's status (0 read as a pass)."""
    guard = no_process_exit() if "drift_run" in getattr(item, "fixturenames", ()) else contextlib.nullcontext()
    try:
        with guard:
            return (yield)
    except DriftError as exc:
        if exc.exit_code != EXIT_USAGE:
            raise
        pytest.exit(f"drift: error: {exc}", returncode=pytest.ExitCode.USAGE_ERROR)


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Which GDN verify the CPU runs (the native C kernel, or why the torch-op path); OpenMP's and OpenBLAS's
    defaults; MKL's code path (drift/mkl.py)."""
    return [f"drift: CPU GDN verify: {native.status()}", f"drift: OpenMP: {OPENMP}", f"drift: OpenBLAS: {BLAS}",
            f"drift: MKL: {MKL}"]


def pytest_runtest_setup(item: pytest.Item) -> None:
    asked = item.config.getoption("--drift-device").split(":")[0]
    for dev in DEVICE_MARKERS:
        if item.get_closest_marker(dev) is None:
            continue
        if asked != dev:
            pytest.skip(f"needs the {dev} device, which this run did not ask for (--drift-device {dev})")
        try:
            resolve_device(item.config.getoption("--drift-device"))
        except DeviceUnavailable as exc:
            pytest.fail(f"--drift-device {dev} was asked for but is absent: {exc}", pytrace=False)


def gate_presets(getoption) -> tuple[str, ...]:
    """The presets the gate runs: --drift-preset, else :data:`drift.config.GATE_PRESETS` (with a trace,
    which fixes the model's heads, the default preset's batch only)."""
    asked = getoption(dest(PREFIX, "preset"), None)
    if asked:
        return (asked,)
    return (DEFAULT_PRESET,) if getoption(dest(PREFIX, "trace"), None) else GATE_PRESETS


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    """The gate's tests one preset (and update) at a time -- its sync tests, then its precision test --
    not every preset's sync tests first: with ``-x`` a regression of the first shape stops the gate
    before the next shape is scanned. Other tests keep their place (a stable sort of the gate's)."""
    gate = [i for i, it in enumerate(items) if getattr(it, "callspec", None) is not None
            and "drift_preset" in it.callspec.params and it.module is not None
            and it.module.__name__ == "drift.test_gate"]
    if len(gate) < 2:
        return

    def key(i: int):
        p = items[i].callspec.params
        return (str(p.get("drift_preset")), str(p.get("drift_update")))

    first_seen = list(dict.fromkeys(key(i) for i in gate))
    moved = [items[i] for i in sorted(gate, key=lambda i: first_seen.index(key(i)))]  # stable within a key
    for slot, item in zip(gate, moved):
        items[slot] = item


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "drift_spec" in metafunc.fixturenames:
        metafunc.parametrize("drift_preset", gate_presets(metafunc.config.getoption))
    if "drift_update" in metafunc.fixturenames:
        specs = metafunc.config.getoption(dest(PREFIX, "update")) or [DEFAULTS["update"]]
        flow = metafunc.config.getoption(dest(PREFIX, "flow"), None)
        metafunc.parametrize("drift_update", specs, ids=[update_id(s, flow) for s in specs])


def update_id(spec, flow) -> str:
    """A test id that names the update: a built-in's (or the flow's default's) name, else the file's or
    module's last name and the qualname (``my_backend.Backend.update``), at most 60 characters."""
    from drift.flows.registry import FLOWS, default_update

    if not spec:  # the flow's own built-in
        return default_update(FLOWS[flow].kind) if flow in FLOWS else "the-flows-update"
    where, colon, qualname = str(spec).rpartition(":")
    if str(spec).startswith("mutant:"):
        return qualname[:60]
    if not colon or not where or spec in ENGINE_UPDATES:
        return str(spec).replace(":", "-")[:60]  # no ':' in an id (pytest's -k reads it)
    stem = where.replace("\\", "/").rsplit("/", 1)[-1].removesuffix(".py").rsplit(".", 1)[-1]
    return f"{stem}.{qualname}"[:60]


def fail_fast(config: pytest.Config) -> bool:
    """Whether a precision run stops at its first failing chunk: ``--drift-fail-fast``, or ``-x`` (pytest
    stops at the first failure anyway, so the steps after it would be paid for nothing)."""
    return bool(config.getoption("--drift-fail-fast") or config.getoption("maxfail") == 1)


@pytest.fixture
def drift_fail_fast(request: pytest.FixtureRequest) -> bool:
    """:func:`fail_fast` of the session."""
    return fail_fast(request.config)


def shows_progress(config: pytest.Config) -> bool:
    """Whether a precision run prints its progress: a terminal (pytest-xdist's workers have none), and not
    ``-qq``."""
    return config.pluginmanager.get_plugin("terminalreporter") is not None and config.getoption("verbose") >= -1


def progress_lines(config: pytest.Config, label: str):
    """``progress(done, total[, elapsed])`` for a simulation: one line per chunk of steps, naming ``label``,
    through pytest's terminal reporter, past the output capture as pytest's live logging writes, so a long
    gate is never silent (shown with ``-q`` too); None where :func:`shows_progress` says none is shown.
    ``elapsed``: the seconds a run made ahead had run (drift/gate_ahead.py)."""
    import contextlib
    import time

    if not shows_progress(config):
        return None
    plugins = config.pluginmanager
    term, capman = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    uncaptured = capman.global_and_fixture_disabled if capman is not None else contextlib.nullcontext
    t0 = time.perf_counter()

    def progress(done: int, total: int, elapsed: Optional[float] = None) -> None:
        el = time.perf_counter() - t0 if elapsed is None else elapsed  # elapsed: a run made ahead's own
        eta = el / done * (total - done) if done else float("nan")
        with uncaptured():
            term.write_line(f"drift: {label}: step {done}/{total} ({done / max(el, 1e-9):.0f} steps/s, "
                            f"{el:.0f} s, ETA {eta:.0f} s)")
    return progress


@pytest.fixture
def drift_progress(request: pytest.FixtureRequest):
    """:func:`progress_lines` of this test."""
    return progress_lines(request.config, request.node.nodeid)


# ------------------------------------------------------------------------ precision runs made ahead
AHEAD = pytest.StashKey[RunsAhead]()
AHEAD_NOTE = pytest.StashKey[str]()  # where the session's precision runs were made, for -v's summary
PRECISION_TEST = "test_update_keeps_precision"


def _runs_ahead(session: pytest.Session, items: list) -> None:
    """The session's precision runs, started in a process of their own (drift/gate_ahead.py) where they
    may be: pytest's own process (not xdist's), no golden regeneration (its test fails before running),
    each run resolvable here (else its test reports why), one thread and the CPU (:func:`ahead_refusal`)."""
    config = session.config
    runs = []
    for item in items:
        if getattr(item, "originalname", None) != PRECISION_TEST or \
                getattr(getattr(item, "module", None), "__name__", None) != "drift.test_gate":
            continue
        params = item.callspec.params
        try:
            run = replace(spec_from_options(config.getoption), preset=params["drift_preset"],
                          update=params["drift_update"]).resolve()
        except DriftError:
            return
        runs.append((item.nodeid, run, {"fail_fast": fail_fast(config)}))
    if not runs:
        return
    refusal = ("pytest-xdist runs the tests" if _distributed(config)
               else "--drift-force-regen" if config.getoption("--drift-force-regen")
               else ahead_refusal([run for _, run, _ in runs]))
    config.stash[AHEAD_NOTE] = f"each made in its test: {refusal}"
    if refusal is not None:
        return
    for stream in (sys.stdout, sys.stderr):  # the child would write what they hold again
        stream.flush()
    try:
        config.stash[AHEAD] = RunsAhead(runs, progress=shows_progress(config))
    except OSError as exc:  # no fork or pipe to be had (EAGAIN, ENOMEM, EMFILE): each test makes its run
        config.stash[AHEAD_NOTE] = f"each made in its test: {exc}"
        return
    config.stash[AHEAD_NOTE] = (f"{len(runs)} made ahead, in a process of their own, while the sync tests ran "
                                "(drift/gate_ahead.py)")


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """With -v: where the precision runs were made."""
    note = config.stash.get(AHEAD_NOTE, None)
    if note is not None and config.getoption("verbose") >= 1:
        terminalreporter.write_line(f"drift: precision runs: {note}")


@pytest.fixture
def drift_ahead(request: pytest.FixtureRequest, drift_progress):
    """``drift_ahead()``: this precision test's outcome where its run was made ahead (drift/gate_ahead.py),
    ``(passed, failures, output)``, waiting for it and printing its progress (:func:`drift_progress`); None where the
    test makes the run itself."""
    ahead = request.config.stash.get(AHEAD, None)
    return lambda: None if ahead is None else ahead.outcome(request.node.nodeid, drift_progress)


def _end_runs_ahead(config: pytest.Config) -> None:
    """Runs made ahead and not read (``-x`` stopped the gate, a usage error, tests not reached): ended."""
    ahead = config.stash.get(AHEAD, None)
    if ahead is not None:
        ahead.close()


def pytest_sessionfinish(session: pytest.Session) -> None:
    _end_runs_ahead(session.config)


@pytest.fixture
def drift_device(request: pytest.FixtureRequest) -> str:
    return request.config.getoption(dest(PREFIX, "device"))


@pytest.fixture
def drift_spec(request: pytest.FixtureRequest, drift_preset: str) -> RunSpec:
    """The run the --drift-* options ask for (drift/runspec.py), the same spec ``drift run`` builds, on
    one of the gate's presets (:func:`gate_presets`, parametrised)."""
    return replace(spec_from_options(request.config.getoption), preset=drift_preset)


def spec_from_options(getoption) -> RunSpec:
    """The RunSpec of a pytest ``getoption(dest, default)``; the updates are parametrised instead
    (``--drift-update`` repeats: one test per update, :func:`pytest_generate_tests`)."""
    return RunSpec.from_options(lambda name: getoption(dest(PREFIX, name), None) if name != "update" else None,
                                prefix=PREFIX)


@pytest.fixture
def drift_run(drift_spec: RunSpec, drift_update) -> Resolved:
    """The run under test, resolved once (drift.runspec.RunSpec.resolve): the preset with every
    --drift-* option applied (with --drift-trace replaying that trace on the preset's batch), this
    test's --drift-update and the --drift-kernel loaded and accepted by the flow's kind. A bad
    combination (refused before the first test already: :func:`pytest_collection_finish`) ends the
    session as that usage error, naming the option (never a traceback)."""
    try:
        return replace(drift_spec, update=drift_update).resolve()
    except DriftError as exc:
        pytest.exit(f"drift: error: {exc}", returncode=pytest.ExitCode.USAGE_ERROR)


@pytest.fixture
def drift_config(drift_run: Resolved):
    """The validated Config of :func:`drift_run`."""
    return drift_run.cfg


@pytest.fixture
def drift_golden(request: pytest.FixtureRequest):
    """``drift_golden(cfg)`` -> the loaded :class:`drift.check.golden.Golden` for ``cfg``, or None where
    the golden cannot apply (``cfg`` leaves its preset's trajectory or requests, e.g. tracking off under
    the serving lifecycle: the run compares with its float64 twin, and its golden row says why, as
    ``drift run``'s).

    Fails (never skips) when the golden a PR-gating preset's own config requires
    (:func:`drift.check.golden.requires_golden`) is missing or broken. With --drift-force-regen it
    regenerates it first and fails the test, naming what changed.
    """
    def get(cfg):
        if request.config.getoption("--drift-force-regen"):
            import io

            out = io.StringIO()
            if cfg.trace:
                write_trace_golden(cfg, force=True, out=out)
            else:
                # a serving run reads the fixed entry (the lanes' first requests) and its own
                regenerate([cfg.name], seed=cfg.seed, force=True, out=out,
                           lifecycles=("fixed", cfg.lifecycle) if cfg.serving.churn else ("fixed",))
            pytest.fail(f"--drift-force-regen: golden for {cfg.name} seed {cfg.seed} regenerated:\n"
                        f"{out.getvalue()}review the diff and re-run without --drift-force-regen")
        golden, note = load_golden(cfg)  # a trace's: generated beside it on first use
        if golden is None and (cfg.trace or requires_golden(cfg)):
            pytest.fail(f"no golden data for {cfg.name} seed {cfg.seed} ({note}); PR-gating presets "
                        f"{GOLDEN_PRESETS} must have it: drift regen-golden --preset {cfg.name}")
        return golden

    return get
