"""The ``sgl_kernel_npu.mamba.mamba_state_update_triton`` module the code under test imports.

SGLang's Ascend backend imports ``move_intermediate_cache`` and ``conv_state_rollback`` from
that module at import time (``ascend_hybrid_linear_attn_backend.py``, SGLang 0.5.23). Where
the real ``sgl_kernel_npu`` is installed, the code under test gets the real kernels; elsewhere
drift installs a shim package into ``sys.modules`` that serves drift's portable kernels
(:mod:`drift.sim.kernels`, same signatures and semantics) under those names.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

from ..errors import LoadError
from . import kernels

SHIM_MODULE = "sgl_kernel_npu.mamba.mamba_state_update_triton"


def _install_shim() -> types.ModuleType:
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
