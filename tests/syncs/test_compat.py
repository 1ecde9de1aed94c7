"""drift without torch's private symbols (drift/compat.py): hide them, and drift, every test module
and the sync detector still work.

Each scenario runs a fresh interpreter (``sys.executable``) whose prelude hides a set of private
torch symbols *from everything but torch itself* before drift is imported: the modules
``torch.utils._python_dispatch``, ``torch.utils._pytree`` and ``torch._subclasses.fake_tensor``
are replaced (in ``sys.modules`` and on their parent package) by proxies that refuse the hidden
names; ``torch.Tensor._make_wrapper_subclass`` becomes a descriptor that raises
``AttributeError``; ``torch._C._disabled_torch_function_impl`` is removed and served back by a
module ``__getattr__``. They are hidden from code in drift/ and tests/ (the frame that asks is
checked): that is the code whose imports must be guarded. Everything else -- torch's internals,
and libraries such as transformers, which would break with such a torch on their own account --
still gets the real object. The child then reports, as JSON: whether the hiding bites,
drift.compat's view, which drift and test modules import, and what the sync detector reports
for known bad and clean code. No test here skips.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch

import drift
from drift import compat

TESTS = Path(__file__).resolve().parents[1]  # tests/, above the package folders
DRIFT_ROOT = Path(drift.__file__).resolve().parent.parent  # the child imports this same drift

# Hideable symbols: key -> (dotted name as drift.compat.MISSING_PRIVATE spells it, probe code).
SYMBOLS = {
    "TorchDispatchMode": ("torch.utils._python_dispatch.TorchDispatchMode",
                          "from torch.utils._python_dispatch import TorchDispatchMode"),
    "_make_wrapper_subclass": ("torch.Tensor._make_wrapper_subclass", "torch.Tensor._make_wrapper_subclass"),
    "_disabled_torch_function_impl": ("torch._C._disabled_torch_function_impl",
                                      "torch._C._disabled_torch_function_impl"),
    "tree_flatten": ("torch.utils._pytree.tree_flatten", "from torch.utils._pytree import tree_flatten"),
    "tree_map": ("torch.utils._pytree.tree_map", "from torch.utils._pytree import tree_map"),
    "FakeTensorMode": ("torch._subclasses.fake_tensor.FakeTensorMode",
                       "from torch._subclasses.fake_tensor import FakeTensorMode"),
    "DataDependentOutputException": ("torch._subclasses.fake_tensor.DataDependentOutputException",
                                     "from torch._subclasses.fake_tensor import DataDependentOutputException"),
    "DynamicOutputShapeException": ("torch._subclasses.fake_tensor.DynamicOutputShapeException",
                                    "from torch._subclasses.fake_tensor import DynamicOutputShapeException"),
    "FakeTensorDeviceMismatchError": ("torch._subclasses.fake_tensor.FakeTensorDeviceMismatchError",
                                      "from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError"),
}
_DISPATCH_KEYS = {"TorchDispatchMode", "_make_wrapper_subclass", "_disabled_torch_function_impl"}
SCENARIOS = {
    "none": [],  # the control: the prelude runs, hides nothing
    "wrapper": ["_make_wrapper_subclass"],  # one missing symbol is enough to switch to the fallback
    "all": list(SYMBOLS),
}

# The known bad and clean code the detector must judge (line numbers matter: see BAD_LINE).
SAMPLE = '''\
import torch


def bad(t, m):
    s = t * 2
    return s.sum().item()


def clean(t, m):
    return torch.where(m, t, -t).sum() * 2
'''
BAD_LINE = 6

CHILD = r'''
import importlib, importlib.util, inspect, json, os, sys, traceback, types
from pathlib import Path

HIDE, SYMBOLS, ROOT, TESTS, SAMPLE = json.loads(sys.argv[1])
sys.path.insert(0, ROOT)
import torch

TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
BLIND = (os.path.join(ROOT, "drift") + os.sep, TESTS + os.sep)  # the code the symbols are hidden from


def from_torch(depth):
    """Whether the frame ``depth`` up (past the import machinery) may see the hidden symbols:
    any code but drift's and its tests' (torch's own, numpy's, transformers' ...)."""
    f = sys._getframe(depth + 1)
    while f is not None and f.f_code.co_filename.startswith("<frozen importlib"):
        f = f.f_back
    return f is None or not os.path.abspath(f.f_code.co_filename).startswith(BLIND)


class Proxy(types.ModuleType):
    """A torch module without the hidden names (for callers outside torch)."""

    def __init__(self, real, hidden):
        super().__init__(real.__name__, real.__doc__)
        self.__dict__.update(_real=real, _hidden=set(hidden), __file__=getattr(real, "__file__", None))

    def __getattr__(self, name):
        d = self.__dict__
        if name in d["_hidden"] and not from_torch(1):
            raise AttributeError(f"module {d['_real'].__name__!r} has no attribute {name!r} (hidden by test_compat)")
        return getattr(d["_real"], name)


by_module = {}
for key in HIDE:
    dotted = SYMBOLS[key][0]
    owner, name = dotted.rsplit(".", 1)
    if owner == "torch.Tensor":
        real = getattr(torch.Tensor, name)

        class Hidden:
            def __get__(self, obj, objtype=None, _real=real, _name=name):
                if from_torch(1):
                    return _real
                raise AttributeError(f"type object 'Tensor' has no attribute {_name!r} (hidden by test_compat)")

        setattr(torch.Tensor, name, Hidden())
    elif owner == "torch._C":
        real_c = torch._C.__dict__.pop(name)

        def c_getattr(attr, _name=name, _real=real_c):
            if attr == _name and from_torch(1):
                return _real
            raise AttributeError(f"module 'torch._C' has no attribute {attr!r} (hidden by test_compat)")

        torch._C.__getattr__ = c_getattr
    else:
        by_module.setdefault(owner, []).append(name)
for owner, names in by_module.items():
    real = importlib.import_module(owner)
    proxy = Proxy(real, names)
    sys.modules[owner] = proxy
    parent, leaf = owner.rsplit(".", 1)
    setattr(sys.modules[parent], leaf, proxy)


def probe(code, filename):
    try:
        exec(compile(code, filename, "exec"), {"torch": torch})
        return True
    except (ImportError, AttributeError):
        return False


res = {"torch": torch.__version__}
drift_file = os.path.join(ROOT, "drift", "_probe.py")
res["visible_to_drift"] = {k: probe(v[1], drift_file) for k, v in SYMBOLS.items()}
res["visible_to_tests"] = {k: probe(v[1], os.path.join(TESTS, "_probe.py")) for k, v in SYMBOLS.items()}
res["visible_to_torch"] = {k: probe(v[1], TORCH_DIR + "_probe.py") for k, v in SYMBOLS.items()}


def attempt(fn):
    try:
        fn()
        return "ok"
    except BaseException as exc:  # a test module may skip itself (pytest's Skipped is a BaseException)
        if type(exc).__name__ == "Skipped":
            return "skipped: " + str(exc)
        return "".join(traceback.format_exception_only(type(exc), exc)).strip() + "\n" + traceback.format_exc()[-1500:]


# drift/compat.py imports torch alone: loaded by path, it answers even when the package does not import.
spec = importlib.util.spec_from_file_location("drift_compat_alone", os.path.join(ROOT, "drift", "compat.py"))
compat = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compat)
res["missing"] = list(compat.MISSING_PRIVATE)
res["dispatch_detector"] = compat.DISPATCH_DETECTOR
pkg = Path(ROOT) / "drift"
names = []
for p in sorted(pkg.rglob("*.py")):
    parts = list(p.relative_to(pkg.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    names.append(".".join(parts))


def import_drift(name):
    if name != "drift.__main__":
        importlib.import_module(name)
        return
    # ``python -m drift``: importing it runs the CLI; with --help that ends in SystemExit(0).
    import contextlib, io
    argv, sys.argv = sys.argv, ["drift", "--help"]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            importlib.import_module(name)
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    finally:
        sys.argv = argv


res["drift_modules"] = {n: attempt(lambda n=n: import_drift(n)) for n in names}

sys.path.insert(0, TESTS)


def load(path):
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)


tests = {"conftest": attempt(lambda: load(os.path.join(TESTS, "conftest.py")))}
for p in sorted(Path(TESTS).rglob("test_*.py")):
    tests[p.stem] = attempt(lambda p=p: load(str(p)))
res["test_modules"] = tests

# The detector on known bad and clean code, through its public entry points. Each section's
# failure is reported (res["errors"]), not fatal: the other sections still run.
res["errors"] = {}


def section(name):
    def run(fn):
        try:
            fn()
        except BaseException:
            res["errors"][name] = traceback.format_exc()[-3000:]
        return fn
    return run


def events(rep):
    return [{"file": e.file, "line": e.line, "op": e.op, "api": e.api, "seen_by": list(e.seen_by)} for e in rep.events]


@section("detector")
def _():
    from drift.syncs.detector import DETECTOR_VIRTUAL, detect_syncs

    spec = importlib.util.spec_from_file_location("compat_sample", SAMPLE)
    sample = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sample)
    args = (torch.arange(4, dtype=torch.float32), torch.tensor([True, False, True, False]))
    bad = detect_syncs(sample.bad, *args)
    clean = detect_syncs(sample.clean, *args)
    res["detector"] = DETECTOR_VIRTUAL
    res["bad"] = {"events": events(bad), "detectors": bad.detectors, "ops": bad.ops}
    res["clean"] = {"events": events(clean), "detectors": clean.detectors, "ops": clean.ops}


@section("scan")
def _():
    from drift.config import preset
    from drift.flows.copy_commit import updates as parts
    from drift.runspec import resolve
    from drift.syncs.scan import sync_check

    src, start = inspect.getsourcelines(parts.commit_unless_all_step0)
    res["item_line"] = [start + k for k, line in enumerate(src) if ".item()" in line.split("#")[0]]
    for key, spec_name in (("guarded", "sglang-31659"), ("device_select", "sglang-0.5.23")):
        r = sync_check(resolve(preset("ci-small"), spec_name), 4, device="none")
        res[key] = {"passed": r.passed, "where": r.where, "worst": r.worst, "detectors": r.extra["detectors"]}


@section("controls")
def _():
    """tests/syncs/test_syncs.py's controls, judged by the detector that runs here."""
    if tests.get("test_syncs") != "ok":
        raise RuntimeError("tests/syncs/test_syncs.py did not import")
    ts = sys.modules["test_syncs"]
    controls = {}
    for fn, _, _ in ts.POSITIVE:
        virt, host, rep = ts._run_control(fn)
        controls[fn.__name__] = {"positive": True, "events": events(rep), "line": fn.__code__.co_firstlineno,
                                 "same": fn is ts.c_mask_write or bool(ts._same(virt, host))}
    for fn in ts.NEGATIVE:
        virt, host, rep = ts._run_control(fn)
        controls[fn.__name__] = {"positive": False, "events": events(rep), "line": fn.__code__.co_firstlineno,
                                 "same": bool(ts._same(virt, host)), "ops": rep.ops}
    res["controls"] = controls
    res["test_syncs_file"] = ts.__file__


print("@@RESULT@@" + json.dumps(res))
'''


def _run_child(scenario: str, tmp: Path) -> dict:
    sample = tmp / "compat_sample.py"
    sample.write_text(SAMPLE)
    hide = SCENARIOS[scenario]
    payload = json.dumps([hide, {k: list(v) for k, v in SYMBOLS.items()}, str(DRIFT_ROOT), str(TESTS), str(sample)])
    res = subprocess.run([sys.executable, "-c", CHILD, payload], cwd=tmp, capture_output=True, text=True,
                         timeout=900, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    marker = [ln for ln in res.stdout.splitlines() if ln.startswith("@@RESULT@@")]
    if res.returncode != 0 or not marker:
        return {"child_failed": f"scenario {scenario!r}: the child failed (rc {res.returncode})\n"
                                f"{res.stdout[-3000:]}\n{res.stderr[-6000:]}"}
    return json.loads(marker[-1][len("@@RESULT@@"):])


_CACHE: dict[str, dict] = {}
# One worker runs this module under pytest-xdist (--dist loadgroup, pyproject.toml): each scenario's
# child interpreter then starts once, not once per worker.
pytestmark = pytest.mark.xdist_group("compat")


def _report(scenario: str, tmp_path_factory) -> dict:
    """The child's report for ``scenario``; one child per scenario and test process."""
    if scenario not in _CACHE:
        _CACHE[scenario] = _run_child(scenario, tmp_path_factory.mktemp(f"compat-{scenario}"))
    return _CACHE[scenario]


@pytest.fixture(params=list(SCENARIOS))
def child(request, tmp_path_factory) -> tuple[str, dict]:
    """(scenario, the child's report)."""
    res = _report(request.param, tmp_path_factory)
    assert "child_failed" not in res, res.get("child_failed")
    return request.param, res


def _no_error(res: dict, section: str) -> None:
    assert section not in res["errors"], f"the child's {section!r} section raised:\n{res['errors'][section]}"


def _hidden(scenario: str) -> set[str]:
    return set(SCENARIOS[scenario])


def _native_missing() -> set[str]:
    """Keys of the symbols this torch itself lacks (none hidden)."""
    return {k for k, (dotted, _) in SYMBOLS.items() if dotted in compat.MISSING_PRIVATE}


def test_the_prelude_hides_exactly_its_symbols_from_drift_and_the_tests(child):
    """Control: the hiding bites (a plain ``from ... import`` in a frame located in drift/ or
    tests/ fails) and only for the chosen symbols; torch's own frames still see every one this
    torch has."""
    scenario, res = child
    gone = _hidden(scenario) | _native_missing()
    assert {k for k, seen in res["visible_to_drift"].items() if not seen} == gone, res["visible_to_drift"]
    assert {k for k, seen in res["visible_to_tests"].items() if not seen} == gone, res["visible_to_tests"]
    assert {k for k, seen in res["visible_to_torch"].items() if not seen} == _native_missing(), res["visible_to_torch"]


def test_compat_lists_what_is_missing(child):
    scenario, res = child
    gone = _hidden(scenario) | _native_missing()
    assert set(res["missing"]) == {SYMBOLS[k][0] for k in gone}, res["missing"]
    assert res["dispatch_detector"] is (not gone & _DISPATCH_KEYS)


def test_drift_and_every_submodule_import(child):
    scenario, res = child
    mods = res["drift_modules"]
    expected = {".".join(p.relative_to(DRIFT_ROOT).with_suffix("").parts).removesuffix(".__init__")
                for p in (DRIFT_ROOT / "drift").rglob("*.py")}
    assert set(mods) == expected and {"drift", "drift.compat", "drift.syncs.detector"} <= set(mods)
    failed = {n: out for n, out in mods.items() if out != "ok"}
    assert not failed, f"{scenario}: drift modules that do not import:\n" + "\n".join(
        f"{n}: {o}" for n, o in failed.items())


def test_every_test_module_imports(child, tmp_path_factory):
    """Every tests/**/test_*.py imports (by path, not collected); one that skips itself at import
    (an optional dependency missing) must do so in the control scenario too, for the same reason."""
    scenario, res = child
    mods = res["test_modules"]
    assert set(mods) == {"conftest"} | {p.stem for p in TESTS.rglob("test_*.py")}
    failed = {n: out for n, out in mods.items() if out != "ok" and not out.startswith("skipped: ")}
    assert not failed, f"{scenario}: test modules that do not import:\n" + "\n".join(
        f"{n}: {o}" for n, o in failed.items())
    assert all(mods[n] == "ok" for n in ("conftest", "test_syncs", "test_compat", "test_layout"))
    skipped = {n: out for n, out in mods.items() if out != "ok"}
    for name, why in skipped.items():  # never for want of a private torch symbol
        assert not any(dotted.rsplit(".", 1)[1] in why for dotted, _ in SYMBOLS.values()), (name, why)
    if scenario != "none":
        control = _report("none", tmp_path_factory)
        assert skipped == {n: o for n, o in control["test_modules"].items() if o != "ok"}, skipped


def _expected_detector(scenario: str) -> str:
    from drift.syncs.detector import DETECTOR_DISPATCH
    return DETECTOR_DISPATCH if not (_hidden(scenario) | _native_missing()) & _DISPATCH_KEYS else "function mode"


def test_detector_reports_the_item_sync_and_nothing_in_clean_code(child):
    scenario, res = child
    _no_error(res, "detector")
    name = _expected_detector(scenario)
    assert res["detector"].startswith(name), res["detector"]
    bad = res["bad"]
    assert len(bad["events"]) == 1, bad
    [ev] = bad["events"]
    assert ev["file"].endswith("compat_sample.py") and ev["line"] == BAD_LINE, ev
    assert ev["api"] == "Tensor.item" and ev["seen_by"] == [res["detector"]], ev
    assert bad["detectors"][0] == res["detector"]
    assert res["clean"]["events"] == [] and res["clean"]["ops"] > 0, res["clean"]
    if name == "function mode":  # the report names the fallback and what this torch lacks
        gone = (_hidden(scenario) | _native_missing()) & _DISPATCH_KEYS
        assert all(SYMBOLS[k][0] in res["detector"] for k in gone), res["detector"]


def test_update_scan_fails_the_guarded_update_at_its_item_line(child):
    scenario, res = child
    _no_error(res, "scan")
    [line] = res["item_line"]
    guarded, clean = res["guarded"], res["device_select"]
    assert not guarded["passed"] and f"copy_commit/updates.py:{line} " in guarded["where"], guarded
    assert "commit_unless_all_step0" in guarded["where"] and guarded["worst"] >= 1.0, guarded
    assert clean["passed"] and clean["worst"] == 0.0, clean
    assert guarded["detectors"][0].startswith(_expected_detector(scenario)), guarded["detectors"]


def test_test_syncs_controls_hold_under_the_detector_that_runs(child):
    """tests/syncs/test_syncs.py's positive controls are caught once, at their line, with the same result
    as on the host; its negative controls report nothing -- under the fallback too."""
    scenario, res = child
    _no_error(res, "controls")
    controls = res["controls"]
    assert len(controls) >= 30 and res["test_syncs_file"], sorted(controls)
    wrong = {}
    for name, c in controls.items():
        evs = c["events"]
        if c["positive"]:
            ok = len(evs) == 1 and evs[0]["line"] == c["line"] and evs[0]["file"] == res["test_syncs_file"]
        else:
            ok = evs == []
        if not (ok and c["same"]):
            wrong[name] = c
    assert not wrong, f"{scenario}: " + json.dumps(wrong, indent=1)[:4000]


# ------------------------------------------------------------------ drift.compat's own pytree
Pair = namedtuple("Pair", "a b")


def test_own_pytree_matches_torchs_on_drifts_trees():
    """drift's leaves/map (what the sync detector walks each op's arguments with) agree with
    torch's on the trees drift builds (args/kwargs of calls: tuples, lists, dicts, namedtuples,
    torch.Size, the struct sequences torch's functions return; anything else a leaf). torch's pytree is the
    oracle: this fails where it is absent."""
    assert compat.torch_tree_flatten is not None and compat.torch_tree_map is not None, (
        "this torch lacks torch.utils._pytree.tree_flatten / tree_map, the oracle of drift's own pytree")
    t = torch.arange(3)
    tree = ((t, [1, t, {"b": 2, "a": (t,)}]), {"device": torch.device("cpu"), "size": torch.Size([2, 3]),
                                                "p": Pair(t, None), "s": slice(0, 2), "m": torch.max(t, dim=0)})
    leaves = compat.tree_leaves(tree)
    assert [type(x) for x in leaves] == [torch.Tensor, int, torch.Tensor, int, torch.Tensor, torch.device,
                                         int, int, torch.Tensor, type(None), slice, torch.Tensor, torch.Tensor]
    theirs, _ = compat.torch_tree_flatten(tree)
    assert len(theirs) == len(leaves) and all(x is y for x, y in zip(theirs, leaves))
    same = compat.tree_map(lambda x: x, tree)
    assert same is not tree and same[0] == tree[0] and type(same[1]["p"]) is Pair
    assert type(same[1]["m"]) is type(tree[1]["m"]) and same[1]["m"][0] is tree[1]["m"][0]
    bump = lambda x: x + 1 if isinstance(x, int) else x  # noqa: E731
    mapped = compat.tree_map(bump, tree)
    assert mapped[0][1][0] == 2 and mapped[0][1][2] == {"b": 3, "a": (t,)} and isinstance(mapped[1]["p"], Pair)
    assert mapped[1]["size"] == torch.Size([3, 4]) and type(mapped[1]["size"]) is torch.Size
    assert type(mapped[1]["m"]) is type(tree[1]["m"]) and mapped[1]["m"].indices is tree[1]["m"].indices
    assert mapped is not tree and tree[0][1][0] == 1 and tree[1]["size"] == torch.Size([2, 3])
    theirs = compat.torch_tree_map(bump, tree)
    assert theirs[0] == mapped[0] and type(theirs[1]["m"]) is type(mapped[1]["m"])
    assert all(x is y for x, y in zip(compat.torch_tree_flatten(theirs)[0], compat.tree_leaves(mapped)))


def test_own_pytree_leaves_no_cyclic_garbage():
    """The walks make no reference cycles (a closure that recurses through its own name is one): a cycle
    keeps the leaves it saw, the code under test's tensors, alive until the cyclic collector runs, at a
    moment inside some later watched call; the host-sync scan's op counts then moved from run to run
    (tests/syncs/test_costmodel.py's shape-only test failed one run in three). The control: a walk through
    a self-naming closure leaves garbage that this test sees."""
    import gc

    t = torch.arange(3)
    tree = ((t, [1, t, {"b": 2, "a": (t,)}]), {"size": torch.Size([2, 3]), "p": Pair(t, None), "m": torch.max(t, dim=0)})

    def cyclic_leaves(x):
        out = []

        def walk(y):
            if isinstance(y, (list, tuple)):
                for v in y:
                    walk(v)
            else:
                out.append(y)
        walk(x)
        return out

    def garbage(fn) -> int:
        gc.collect()
        enabled = gc.isenabled()
        gc.disable()
        try:
            for _ in range(5):
                fn()
            return gc.collect()
        finally:
            if enabled:
                gc.enable()

    assert garbage(lambda: cyclic_leaves(tree)) > 0  # the control: the collector finds the closures' cycles
    assert garbage(lambda: compat.tree_leaves(tree)) == 0
    assert garbage(lambda: compat.tree_map(lambda x: x, tree)) == 0


def test_compat_flags_are_consistent_with_this_torch():
    """Here (no hiding) compat's flags describe the installed torch."""
    import importlib

    for key, (dotted, _) in SYMBOLS.items():
        owner, name = dotted.rsplit(".", 1)
        present = hasattr(importlib.import_module(owner) if owner != "torch.Tensor" else torch.Tensor, name)
        assert (dotted in compat.MISSING_PRIVATE) is (not present), dotted
    assert compat.DISPATCH_DETECTOR is (not _native_missing() & _DISPATCH_KEYS)
