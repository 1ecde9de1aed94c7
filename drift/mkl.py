"""MKL's code path, pinned to one for every x86 CPU: the same figures on an Intel and an AMD runner.

torch's x86 builds link Intel MKL, which picks a code path for the CPU it finds (``MKL_CBWR=AUTO``): AVX-512
on an Intel Xeon, a generic path on an AMD EPYC. It is more than matrix products: torch's ``exp`` on a
contiguous CPU tensor runs MKL's vector math, whose float64 and float32 results differ bit for bit between
its AVX-512, AVX2 and COMPATIBLE paths (65,536 values, 2026-12-07), as do its batched products (``bmm``: a
commit fold's contraction, the golden check's einsums). Every exp drift takes -- the conv's SiLU, the
gating, the twin's decay -- then differs in its last bits from one CPU to the other, and a bf16 value
rounded from it can land on the other side of a rounding boundary. Over 4,096 steps that moved figures by
up to 1% on one machine (2026-12-07, a Xeon with AVX-512 and AMX): the ReplaySSM design row's worst
drift/bound 0.7408 on its AVX-512 path and 0.7477 on its AVX2 path against 0.7399 recorded on the CI's
machines (docs/design_tradeoff.json, row 0); the default run's output error 0.01596 against 0.01629.
``MKL_CBWR=COMPATIBLE`` (MKL's conditional numerical reproducibility, one code path on every x86 CPU)
gave 0.7399 there, the recorded figure, with no measurable cost in a default run (17.0 s against 17.2 s).

Applied by the ``drift`` command (drift/__main__.py) and by drift's pytest sessions (drift/pytest_plugin.py:
``pytest --pyargs drift``, or any ``--drift-*`` option), never to another project's tests: it changes the
numbers every MKL call returns. A user's ``MKL_CBWR`` stands. MKL reads the variable when it first runs;
where torch was imported and MKL ran before drift could set it, the mode cannot change any more and
:func:`mkl_defaults` says so. Imports no torch (the ``drift`` command calls it before torch loads).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from typing import Optional

ENV = "MKL_CBWR"
PINNED = "COMPATIBLE"
# mkl_cbwr.h: the values mkl_cbwr_get(MKL_CBWR_ALL) returns, a branch with the STRICT flag beside it (1: none
# chosen yet, MKL will take AUTO).
_ALL, _COMPATIBLE, _STRICT = -1, 3, 0x10000
_APPLIED: Optional[str] = None  # what mkl_defaults did in this process
_NAMES = {1: "AUTO", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3", 7: "SSE4_1", 8: "SSE4_2", 9: "AVX",
          10: "AVX2", 11: "AVX512_MIC", 12: "AVX512", 13: "AVX512_MIC_E1", 14: "AVX512_E1"}


def _mkl(torch_module) -> Optional[ctypes.CDLL]:
    """torch's own MKL (its x86 builds link it into libtorch_cpu), or None where this torch has none."""
    return _mkl_in(os.path.join(os.path.dirname(getattr(torch_module, "__file__", "") or ""), "lib"))


@functools.lru_cache(maxsize=None)
def _mkl_in(lib_dir: str) -> Optional[ctypes.CDLL]:
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib", "torch_cpu.dll"):
        path = os.path.join(lib_dir, name)
        if os.path.exists(path):
            try:
                lib = ctypes.CDLL(path)
                lib.mkl_serv_cbwr_get, lib.mkl_serv_cbwr_set  # noqa: B018 (both, or no MKL to talk to)
            except (OSError, AttributeError):
                return None
            return lib
    return None


def mkl_mode(modules=sys.modules) -> str:
    """The code path MKL takes in this process (``MKL_CBWR``'s terms, e.g. ``COMPATIBLE`` or ``AUTO``), or
    ``none`` where torch has no MKL (report.json ``versions.mkl``: the figures' provenance)."""
    torch_module = modules.get("torch")
    lib = _mkl(torch_module) if torch_module is not None else None
    if lib is None:
        return "none"
    value = lib.mkl_serv_cbwr_get(_ALL)
    name = _NAMES.get(value & ~_STRICT, str(value & ~_STRICT))
    return name + (",STRICT" if value & _STRICT else "")


def mkl_defaults(environ=os.environ, modules=sys.modules) -> str:
    """Pin MKL to :data:`PINNED` unless the user chose (``MKL_CBWR`` set); returns what was done, one line
    (for pytest's header). The variable reaches child processes (pytest-xdist's workers, the interpreters
    tests start); where torch is already imported, MKL is told in this process too."""
    global _APPLIED
    if _APPLIED is not None and environ.get(ENV) == PINNED:
        return _APPLIED  # called again in this process (drift's test suite's conftest, then its plugin)
    if ENV in environ:
        return f"{ENV}={environ[ENV]} (the user's)"
    environ[ENV] = PINNED
    _APPLIED = _apply(modules)
    return _APPLIED


def _apply(modules) -> str:
    """Tell MKL in this process too, where torch (and so MKL) is loaded already; the line to report."""
    torch_module = modules.get("torch")
    if torch_module is None:
        return f"{ENV}={PINNED}"
    lib = _mkl(torch_module)
    if lib is None:
        return f"{ENV}={PINNED} (this torch has no MKL)"
    if lib.mkl_serv_cbwr_set(_COMPATIBLE) == 0:
        return f"{ENV}={PINNED}"
    return (f"{ENV}={PINNED} for child processes; MKL had already run on its {mkl_mode(modules)} path in this "
            f"process, which it keeps: figures may differ from another CPU's (set {ENV}={PINNED} before "
            "starting Python)")
