"""A result's identity: what decided it, so that a resume reuses and a merge combines only exact
matches, and a baseline pairs entries by what they measured rather than by a path.

* :func:`code_identity`: code under test by content -- the sha256 of the module that defines it
  (for a ``Class.method`` also each module of the class and its bases) and of every module those
  import, transitively, outside drift and the standard library. Imports are read from the source
  (every import statement, those inside functions too) and found without importing anything; an
  installed package other than the code's own (torch, transformers) is recorded by its version
  instead of walked. File contents are hashed, never mtimes.
* :func:`checks_identity`: the checks that run, each with its settings (its limits).
* :func:`extensions_identity`: ``$DRIFT_EXTENSIONS`` and the code identity of each module it names.
* :func:`numerics_identity`: what computes the figures beside the code: the CPU architecture, torch,
  numpy and Python by version, and MKL's code path (drift/mkl.py).
* :func:`comparable` and :func:`pair`: what a baseline entry must share with an entry to be compared.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.machinery
import importlib.metadata
import inspect
import math
import os
import platform
import sys
from pathlib import Path
from typing import Iterable, Optional

from ..check.checks import Check
from ..check.registry import CHECKS, RunContext
from ..plug import extensions
from ..plug.specs import MUTANT_PREFIX
from ..runner import build_extension_check, extension_of, versions

HASH_CHARS = 16
FILE_MODULE = "<file>"  # the label of a module loaded from a spec's file path (its name derives from the path)


def _sha(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:HASH_CHARS]


@functools.lru_cache(maxsize=1)
def _distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def _version(top: str) -> str:
    dist = _distributions()[top][0]
    try:
        return f"{dist} {importlib.metadata.version(dist)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{dist} (no version)"


def _outside(top: str) -> bool:
    """Whether a top-level module is neither drift's nor the standard library's."""
    return top not in ("drift", "__main__") and top not in sys.stdlib_module_names \
        and top not in sys.builtin_module_names


def _locate(name: str, search: list[str]) -> tuple[Optional[str], Optional[list[str]]]:
    """(file, package search path) of module ``name``: the imported module's, else found on
    ``search`` without importing it; (None, None) where there is none (an attribute, not a module)."""
    mod = sys.modules.get(name)
    if mod is not None:
        return getattr(mod, "__file__", None), list(getattr(mod, "__path__", None) or []) or None
    parent, _, last = name.rpartition(".")
    where = _locate(parent, search)[1] if parent else search
    if not where:
        return None, None
    try:
        spec = importlib.machinery.PathFinder.find_spec(last, where)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return None, None
    return (spec.origin if spec.has_location else None), list(spec.submodule_search_locations or []) or None


def _imports(name: str, path: str) -> set[str]:
    """Every module the source of module ``name`` at ``path`` imports (and their parent packages)."""
    try:
        tree = ast.parse(Path(path).read_bytes())
    except (SyntaxError, ValueError):
        return set()
    package = name if Path(path).name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".") if package else []
                if node.level - 1 > len(parts):
                    continue
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names if a.name != "*")  # a submodule, or an attribute
    return {".".join(m.split(".")[:i]) for m in found if m for i in range(1, m.count(".") + 2)}


def code_identity(roots: Iterable, file_modules: Iterable[str] = ()) -> dict:
    """The content of code under test whose defining modules are ``roots`` (module objects):
    ``{"modules": {name: sha256}, "packages": {top-level name: "distribution version"}}``.
    ``file_modules``: root names loaded from a file path, recorded as ``<file>``."""
    roots = [m for m in roots if getattr(m, "__file__", None)]
    own = {m.__name__.split(".")[0] for m in roots}
    search = [os.path.dirname(m.__file__) for m in roots] + [p for p in sys.path if isinstance(p, str)]
    labels = {name: FILE_MODULE for name in file_modules}
    modules, packages, seen = {}, {}, set()
    todo = [m.__name__ for m in roots]
    root_names = set(todo)
    while todo:
        name = todo.pop()
        top = name.split(".")[0]
        if name in seen or (name not in root_names and not _outside(top)):
            continue
        seen.add(name)
        if top not in own and top in _distributions():
            packages[top] = _version(top)
            continue
        path, _ = _locate(name, search)
        if not path or not os.path.isfile(path):
            continue
        modules[labels.get(name, name)] = _sha(path)
        if path.endswith(".py") and (name in root_names or _outside(top)):
            todo.extend(sorted(_imports(name, path) - seen))
    return {"modules": dict(sorted(modules.items())), "packages": dict(sorted(packages.items()))}


def _from_file(roots: list, text: str) -> list[str]:
    """The names of ``roots`` loaded from the file path ``text`` names (none when it names a module)."""
    if not (text.endswith(".py") or "/" in text or os.sep in text):
        return []
    return [m.__name__ for m in roots if os.path.abspath(getattr(m, "__file__", "") or "") == os.path.abspath(text)]


def update_identity(update) -> dict:
    """:func:`code_identity` of a loaded update (drift.plug.loader.Update): its function's module and,
    for a ``Class.method``, the modules of the class and its bases, and of its ``--update-factory``."""
    fn = inspect.unwrap(update.fn)
    roots = [inspect.getmodule(fn)] + [sys.modules.get(c.__module__) for c in getattr(update.owner, "__mro__", ())]
    if getattr(update, "factory", None) is not None:  # --update-factory: the code that builds its self
        roots.append(inspect.getmodule(inspect.unwrap(update.factory)))
    roots = list({id(m): m for m in roots if m is not None}.values())
    return code_identity(roots, _from_file(roots, update.spec.rsplit(":", 1)[0] if ":" in update.spec else ""))


def _setting(name: str, value) -> bool:
    """A check's setting: a number it is built with, not the running state every check starts with."""
    return (not name.startswith("_") and name not in _CHECK_STATE and isinstance(value, (int, float))
            and math.isfinite(value))


_CHECK_STATE = set(vars(Check())) - {"limit"}  # what the base check tracks as it runs (worst value, where)


def checks_identity(cfg, mode: str) -> dict:
    """The checks a run of ``cfg`` in ``mode`` has (drift/check/registry.py), each with the numbers
    it is built with (its limit, constants): ``{key: {name: value}}``."""
    ctx = RunContext(cfg, mode=mode)
    out = {}
    for spec in CHECKS.in_order():
        if not spec.applies(ctx):
            continue
        settings = {}
        if spec.shape != "run":
            origin = extension_of(spec)  # an extension's that raises or builds no check: refused naming it
            ctx.checks[spec.key] = built = build_extension_check(spec, origin, ctx) if origin else spec.build(ctx)
            settings = {k: v for k, v in sorted(getattr(built, "__dict__", {}).items()) if _setting(k, v)}
        out[spec.key] = settings
    return out


def extensions_identity() -> dict:
    """``$DRIFT_EXTENSIONS`` as set, and the code identity of each extension it names."""
    names = extensions.load_extensions()
    code = {}
    for name in names:
        module = extensions._loaded[name]
        code[name] = code_identity([module], _from_file([module], name))
    return {"env": os.environ.get(extensions.ENV, ""), "code": code}


def numerics_identity() -> dict:
    """What computes the figures beside the code: the CPU architecture (``platform.machine()``), torch,
    numpy and Python by version, and MKL's code path (report.json's ``versions``, less drift's own,
    which the identity holds as ``drift``). A float kernel of another library or another architecture
    rounds differently; MKL's pinned path gives every x86 CPU the same (docs/reliability.md)."""
    return {"machine": platform.machine(), **{k: v for k, v in versions().items() if k != "drift"}}


# ------------------------------------------------------------------ comparing
def _flatten(value, prefix: str = "") -> dict:
    if isinstance(value, (dict, list)) and value:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        out = {}
        for k, v in items:
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): value}


def differences(a, b) -> list[str]:
    """``field old -> new`` for every field (dotted path) in which ``a`` and ``b`` differ."""
    fa, fb = _flatten(a), _flatten(b)
    return [f"{k} {fa.get(k, '(none)')!r} -> {fb.get(k, '(none)')!r}" for k in sorted(set(fa) | set(fb))
            if fa.get(k) != fb.get(k)]


# Paths and the horizon: a baseline of another length, or of a moved trace or update file, still compares.
NOT_COMPARED = {"entry": ("update", "trace", "steps"), "config": ("trace", "name", "description", "steps")}


def update_name(spec: str) -> str:
    """An update spec without its module or file: ``path/x.py:Class.method`` -> ``Class.method``."""
    return spec.rsplit(":", 1)[1] if ":" in spec and not spec.startswith(MUTANT_PREFIX) else spec


def comparable(ident: dict) -> dict:
    """What a baseline entry must share with an entry to be compared: the configuration (the
    identity's entry and config, a trace by its content) without paths or the horizon, and the
    update by its name. Not the code, drift's version or the checks: a trend exists to show what
    a change of those did."""
    out = {part: {k: v for k, v in ident[part].items() if k not in drop} for part, drop in NOT_COMPARED.items()}
    out["update"] = update_name(ident["entry"]["update"])
    return out


def pair(current: dict, baseline: dict) -> dict[str, str]:
    """Each entry of ``current`` (report entries by key, an ``identity`` in each) -> the key of its
    entry in ``baseline``: the one of the same :func:`comparable` configuration; among several, the
    one of the same code, then of the same update spec. An entry of a baseline written before
    entries carried identities pairs by key. Entries without a unique match are left out."""
    out = {}
    for key, entry in current.items():
        ident = entry.get("identity")
        if not isinstance(ident, dict):
            continue
        want = comparable(ident)
        found = [k for k, e in baseline.items() if isinstance(e.get("identity"), dict)
                 and comparable(e["identity"]) == want]
        for narrow in (lambda i: i.get("update"), lambda i: i["entry"]["update"]):
            if len(found) > 1:
                found = [k for k in found if narrow(baseline[k]["identity"]) == narrow(ident)]
        if not found and key in baseline and "identity" not in baseline[key]:
            found = [key]
        if len(found) == 1:
            out[key] = found[0]
    return out
