"""The spec grammar that names code under test, and resolving a spec to the object it names.

A spec is one of:

  ``<builtin>``                      a built-in update or verify kernel (see :mod:`drift.plug.loader`)
  ``mutant:<name>``                  a regression of the catalogue (:mod:`drift.plug.mutants`)
  ``package.module:qualname``        an importable function or ``Class.method``
  ``path/to/file.py:qualname``       the same, from a file (its module-level imports of
                                     sibling modules work: its directory leads sys.path
                                     while it is imported)

Verify kernels add ``npu``, ``npu-op:<module|file.py>:<qualname>`` and ``sglang-triton``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import types
from typing import Any

from ..errors import ENDS_PROCESS, LoadError, ended_by_code, raised_at
from ..sim.shim import sgl_kernels

MUTANT_PREFIX = "mutant:"


def module_from_file(path: str, spec: str, what: str) -> types.ModuleType:
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        form = "path/to/file.py" if what == "extension" else "path/to/file.py:qualname"
        found = f"{path!r} is a directory, not a file" if os.path.isdir(full) else f"file {path!r} not found"
        raise LoadError(f"{what} spec {spec!r}: {found} (looked at {full}); expected {form}")
    name = "drift_plugin_" + hashlib.sha1(full.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    mspec = importlib.util.spec_from_file_location(name, full)
    if mspec is None or mspec.loader is None:
        raise LoadError(f"{what} spec {spec!r}: cannot load {full} as a Python module")
    module = importlib.util.module_from_spec(mspec)
    sys.modules[name] = module
    # Its directory leads sys.path while it is imported, so its own imports of sibling modules
    # (``from helpers import x`` beside it) work as they do when Python runs the file.
    here = os.path.dirname(full)
    sys.path.insert(0, here)
    try:
        mspec.loader.exec_module(module)
    except (Exception, *ENDS_PROCESS) as exc:  # sys.exit(main()) at import: refused, not an exit
        del sys.modules[name]
        if not isinstance(exc, Exception) and not ended_by_code(exc):
            raise  # a signal
        fix = "; fix the module or remove it from DRIFT_EXTENSIONS" if what == "extension" else ""
        at, inner = raised_at(exc, full), raised_at(exc)
        ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # drift's package: a refusal of ours
        if (inner and inner != at and not isinstance(exc, ImportError)
                and not os.path.abspath(inner.rsplit(":", 1)[0]).startswith(ours + os.sep)):
            at = f"{inner} (imported from {at})"  # raised in a module the file imports
        raise LoadError(f"{what} spec {spec!r}: importing {full} raised {exc!r} at {at}{fix}") from exc
    finally:
        if sys.path and sys.path[0] == here:
            del sys.path[0]
        elif here in sys.path:
            sys.path.remove(here)
    return module


def callable_name(fn: Any) -> str:
    """How a message names a callable: its qualname, or for an object with ``__call__`` its class's."""
    name = getattr(fn, "__qualname__", None)
    return name if isinstance(name, str) else f"{type(fn).__qualname__}.__call__"


def resolve_spec(spec: str, what: str = "update", shown: str = "") -> Any:
    """``package.module:qualname`` or ``path/to/file.py:qualname`` -> the object it names.

    Installs the sgl_kernel_npu shim first (code under test imports its kernels at import
    time). Raises LoadError naming the spec (as ``shown`` when given: ``npu-op:`` + the spec) and
    what was expected.
    """
    shown = shown or spec
    sgl_kernels()
    if ":" not in spec:
        raise LoadError(f"{what} spec {shown!r} has no ':'; expected package.module:qualname or "
                        "path/to/file.py:qualname")
    target, qualname = spec.rsplit(":", 1)
    if not target or not qualname:
        raise LoadError(f"{what} spec {shown!r}: expected module:qualname or file.py:qualname")
    if target.endswith(".py") or os.sep in target or "/" in target:
        module = module_from_file(target, shown, what)
    else:
        try:
            module = importlib.import_module(target)
        except (Exception, *ENDS_PROCESS) as exc:
            if not isinstance(exc, Exception) and not ended_by_code(exc):
                raise  # a signal
            missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
            if missing and (target == missing or target.startswith(missing + ".")):  # the spec's own module
                raise LoadError(f"{what} spec {shown!r}: no module {missing!r} can be imported here (not "
                                f"installed in this Python, or not on its path: sys.path, PYTHONPATH); a file is "
                                f"named by its path, path/to/file.py:qualname") from exc
            raise LoadError(f"{what} spec {shown!r}: importing module {target!r} raised {exc!r} at "
                            f"{raised_at(exc)}") from exc
    obj = module
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            have = sorted(n for n in dir(obj) if not n.startswith("_"))
            raise LoadError(f"{what} spec {shown!r}: {getattr(obj, '__name__', obj)!s} has no attribute "
                            f"{part!r}; it has: {', '.join(have[:30]) or '(nothing public)'}") from None
    return obj
