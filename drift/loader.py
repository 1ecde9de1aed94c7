"""Plug point: load the update under test from a spec, and the sgl_kernel_npu shim.

Specs:
  ``guarded`` / ``sync_free`` / ``device_select``  a built-in (:mod:`drift.updates`)
  ``package.module:qualname``                      an importable function or ``Class.method``
  ``path/to/file.py:qualname``                     the same, from a file

The callee is called as ``fn(backend, last_correct_step_indices, mamba_track_indices,
mamba_steps_to_track, **extra)``: a class method receives drift's harness as ``self``,
and every parameter it declares beyond those four (``model``, ``req_pool_indices``, ...)
receives ``None``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable

SHIM_MODULE = "sgl_kernel_npu.mamba.mamba_state_update_triton"
REQUIRED = ("self", "last_correct_step_indices", "mamba_track_indices", "mamba_steps_to_track")


class LoadError(ValueError):
    """A plug-in spec could not be turned into a callable update."""


def _install_shim() -> types.ModuleType:
    from . import kernels

    names = ("sgl_kernel_npu", "sgl_kernel_npu.mamba", SHIM_MODULE)
    mods = []
    for name in names:
        mod = types.ModuleType(name)
        mod.__drift_shim__ = True  # type: ignore[attr-defined]
        mod.__doc__ = "drift shim: portable torch kernels standing in for sgl_kernel_npu"
        if name != SHIM_MODULE:
            mod.__path__ = []  # type: ignore[attr-defined]  # a package, so submodules import
        mods.append(mod)
    mods[-1].move_intermediate_cache = kernels.move_intermediate_cache  # type: ignore[attr-defined]
    mods[-1].conv_state_rollback = kernels.conv_state_rollback  # type: ignore[attr-defined]
    mods[0].mamba = mods[1]  # type: ignore[attr-defined]
    mods[1].mamba_state_update_triton = mods[2]  # type: ignore[attr-defined]
    for name, mod in zip(names, mods):
        sys.modules[name] = mod
    return mods[-1]


def sgl_kernels() -> types.ModuleType:
    """The module ``sgl_kernel_npu.mamba.mamba_state_update_triton``: the real one when the
    package is installed, otherwise drift's shim (installed into ``sys.modules`` once)."""
    mod = sys.modules.get(SHIM_MODULE)
    if mod is not None:
        return mod
    if importlib.util.find_spec("sgl_kernel_npu") is None:
        return _install_shim()
    try:
        return importlib.import_module(SHIM_MODULE)
    except Exception as exc:  # installed but broken: say so rather than silently shim
        raise LoadError(
            f"sgl_kernel_npu is installed but {SHIM_MODULE} failed to import ({exc!r}); fix the "
            "install, or uninstall it to use drift's portable kernels") from exc


def kernels_in_use() -> str:
    """'sgl_kernel_npu' or 'drift portable (shim)', for reports."""
    return "drift portable (shim)" if getattr(sgl_kernels(), "__drift_shim__", False) else "sgl_kernel_npu"


@dataclass
class Update:
    """A loaded update implementation, callable as the simulation calls it."""

    name: str
    spec: str
    fn: Callable[..., Any]
    extra: tuple[str, ...] = field(default_factory=tuple)
    source: str = ""

    def __call__(self, backend, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track):
        kwargs = {name: None for name in self.extra}
        return self.fn(backend, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track,
                       **kwargs)


def _module_from_file(path: str, spec: str, what: str) -> types.ModuleType:
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise LoadError(f"{what} spec {spec!r}: file {path!r} not found (looked at {full}); "
                        "expected path/to/file.py:qualname")
    name = "drift_plugin_" + hashlib.sha1(full.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    mspec = importlib.util.spec_from_file_location(name, full)
    if mspec is None or mspec.loader is None:
        raise LoadError(f"{what} spec {spec!r}: cannot load {full} as a Python module")
    module = importlib.util.module_from_spec(mspec)
    sys.modules[name] = module
    try:
        mspec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise LoadError(f"{what} spec {spec!r}: importing {full} raised {exc!r}") from exc
    return module


def resolve_spec(spec: str, what: str = "update") -> Any:
    """``package.module:qualname`` or ``path/to/file.py:qualname`` -> the object it names.

    Installs the sgl_kernel_npu shim first (code under test imports its kernels at import
    time). Raises LoadError naming the spec and what was expected.
    """
    sgl_kernels()
    if ":" not in spec:
        raise LoadError(f"{what} spec {spec!r} has no ':'; expected package.module:qualname or "
                        "path/to/file.py:qualname")
    target, qualname = spec.rsplit(":", 1)
    if not target or not qualname:
        raise LoadError(f"{what} spec {spec!r}: expected module:qualname or file.py:qualname")
    if target.endswith(".py") or os.sep in target or "/" in target:
        module = _module_from_file(target, spec, what)
    else:
        try:
            module = importlib.import_module(target)
        except Exception as exc:
            raise LoadError(f"{what} spec {spec!r}: importing module {target!r} raised {exc!r}") from exc
    obj = module
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            have = sorted(n for n in dir(obj) if not n.startswith("_"))
            raise LoadError(f"{what} spec {spec!r}: {getattr(obj, '__name__', obj)!s} has no attribute "
                            f"{part!r}; it has: {', '.join(have[:30]) or '(nothing public)'}") from None
    return obj


def _check_signature(fn: Callable, spec: str) -> tuple[str, ...]:
    if inspect.ismethod(fn):
        raise LoadError(f"update spec {spec!r} resolves to a bound method; name the function through "
                        "its class (Class.method) so drift can pass its harness as self")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise LoadError(f"update spec {spec!r}: cannot read its signature ({exc})") from exc
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    has_varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    if len(positional) < 4 and not has_varargs:
        raise LoadError(
            f"update spec {spec!r} has signature {fn.__name__}{sig}; expected at least four positional "
            f"parameters ({', '.join(REQUIRED)}), extra ones such as model or req_pool_indices allowed")
    extra = tuple(p.name for p in params[4:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return extra


def load_update(spec: str | Callable) -> Update:
    """Turn a spec (or a callable) into an :class:`Update`; raises LoadError naming the spec."""
    from .updates import BUILTINS

    sgl_kernels()  # code under test imports its kernels at module import time
    if callable(spec):
        fn, name, text = spec, getattr(spec, "__qualname__", repr(spec)), getattr(spec, "__qualname__", "")
    elif spec in BUILTINS:
        fn, name, text = BUILTINS[spec], spec, spec
    elif spec.startswith("mutant:"):
        from .mutants import MUTANTS

        m = MUTANTS.get(spec.split(":", 1)[1])
        if m is None or m.kind != "update":
            known = ", ".join(f"mutant:{n}" for n, x in MUTANTS.items() if x.kind == "update")
            raise LoadError(f"update spec {spec!r} is not an update mutant; known: {known}")
        fn, name, text = m.fn, spec, spec
    elif ":" in spec:
        fn, name, text = resolve_spec(spec, "update"), spec.rsplit(":", 1)[1], spec
    else:
        raise LoadError(f"update spec {spec!r} is not a built-in ({', '.join(BUILTINS)}) and has no "
                        "':'; expected package.module:qualname or path/to/file.py:qualname")
    if not callable(fn):
        raise LoadError(f"update spec {text!r} resolves to a {type(fn).__name__}, not a function")
    extra = _check_signature(fn, text)
    try:
        source = f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
    except (TypeError, OSError):
        source = ""
    return Update(name=name, spec=text, fn=fn, extra=extra, source=source)
