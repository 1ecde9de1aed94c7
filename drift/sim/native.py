"""Native CPU kernel for the hot loop of :func:`drift.kernels.gdn_verify` (optional, built on demand).

On the CPU the torch-op GDN verify makes five passes over every float32 state per verify
token (decay, ``k^T h``, rank-1 update, ``q^T h``, store), each a separate tensor op. The C
kernel in ``_native/gdn_verify.c`` makes two, with each head's state kept in a float32
scratch buffer across the D tokens, and is what lets ``drift run`` afford more decode steps.
It computes the same thing: float32 arithmetic (summation order may differ, so results agree
to float32 rounding, not bit for bit), round-to-nearest-even stores that give the same bits
as a torch cast of the same float32 value.

It is compiled with the system C compiler (``$CC``, else ``cc``/``gcc``/``clang``) the first
time it is needed, into ``$DRIFT_CACHE_DIR`` (default ``~/.cache/drift``), keyed by a hash of
source, compiler and CPU, written atomically, and loaded with :mod:`ctypes` (no torch or
Python headers, no pybind); an unwritable cache directory falls back to one under the
system temporary directory. Heads are split over ``torch.get_num_threads()`` OpenMP
threads, torch's own where the runtime is shared (see :func:`_load`). When no compiler is
found or the build fails, :func:`status` says why and the torch-op path runs;
``DRIFT_NATIVE=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch

SOURCE = Path(__file__).resolve().parent / "_native" / "gdn_verify.c"
ABI = 1  # drift_native_abi() of the source this module drives
FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-std=c99"]
OPENMP = "-fopenmp"  # tried first; without it the kernel runs on one thread
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_status: Optional[str] = None


def enabled() -> bool:
    """Whether the environment allows the native kernel (``DRIFT_NATIVE`` not ``0``/``off``)."""
    return os.environ.get("DRIFT_NATIVE", "1").strip().lower() not in ("0", "off", "false", "no")


def cache_dir() -> Path:
    return Path(os.environ.get("DRIFT_CACHE_DIR") or Path.home() / ".cache" / "drift")


def _compiler() -> Optional[str]:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_id() -> str:
    """What ``-march=native`` depends on: the machine and, on Linux, the CPU's model and flags."""
    ident = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            ident += "".join(sorted({ln for ln in f if ln.startswith(("model name", "flags", "Features"))}))
    except OSError:
        pass
    return ident


def _build(cc: str, flags: list[str]) -> Path:
    """Compile :data:`SOURCE` (cached by content, compiler, flags and CPU); returns the library path."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + "\0".join([version, _cpu_id(), *flags]).encode()).hexdigest()[:16]
    for folder in (cache_dir(), Path(tempfile.gettempdir()) / f"drift-cache-{os.getuid() if hasattr(os, 'getuid') else 0}"):
        lib = folder / f"gdn_verify-{key}.so"
        if lib.exists():
            return lib
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".gdn_verify-", suffix=".so", dir=folder)
            break
        except OSError as exc:
            unwritable = exc
    else:
        raise RuntimeError(f"no writable cache directory (set DRIFT_CACHE_DIR): {unwritable}")
    os.close(fd)
    try:
        res = subprocess.run([cc, *flags, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} {' '.join(flags)} failed ({res.returncode}): {res.stderr.strip()[:2000]}")
        os.replace(tmp, lib)  # atomic: a concurrent builder sees no file or the whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _openmp_runtimes() -> set[str]:
    """Paths of the OpenMP runtimes mapped into this process (Linux; empty elsewhere)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            return {ln.split()[-1] for ln in f if any(m in ln for m in ("libgomp", "libiomp", "libomp"))}
    except OSError:
        return set()


def _load() -> Optional[ctypes.CDLL]:
    """The loaded library, building it on first use; None (and :func:`status` says why) if unavailable.

    Built with OpenMP, the library's ``libgomp.so.1`` resolves to the one torch already loaded
    (glibc matches it by soname), so the kernel runs on torch's own worker threads. A second
    runtime would leave torch's workers spinning beside the kernel's (measured: 1.6x slower).
    """
    global _lib, _status
    with _lock:
        if _lib is not None or _status is not None:
            return _lib
        if not enabled():
            _status = "off (DRIFT_NATIVE=0): torch-op path"
            return None
        cc = _compiler()
        if cc is None:
            _status = "unavailable: no C compiler found ($CC, cc, gcc, clang); install one (e.g. gcc): torch-op path"
            return None
        errors = []
        for flags in ([*FLAGS, OPENMP], FLAGS):
            try:
                path = _build(cc, flags)
                before = _openmp_runtimes()
                lib = ctypes.CDLL(str(path))
                if lib.drift_native_abi() != ABI:
                    raise RuntimeError(f"{path} reports ABI {lib.drift_native_abi()}, expected {ABI}")
                break
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                errors.append(str(exc))
        else:
            _status = f"unavailable: build or load failed: {'; '.join(errors)}: torch-op path"
            return None
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.drift_gdn_verify.argtypes = ([i64, ctypes.c_int] + [i64] * 5 + [ptr, ctypes.c_int, ptr, i64, i64, i64,
                                         ptr, ctypes.c_int] + [i64] * 4 + [ptr] * 7)
        lib.drift_gdn_verify.restype = None
        if not lib.drift_native_openmp():
            threads = "one thread (built without OpenMP)"
        elif len(_openmp_runtimes() - before) == 0:
            threads = "torch's OpenMP threads"
        else:
            threads = "its own OpenMP runtime beside torch's (threads may contend)"
        _lib, _status = lib, f"native C kernel ({path.name}, built with {cc}; {threads})"
        return _lib


def status() -> str:
    """One line: which GDN verify the CPU uses, and why when it is not the native kernel."""
    _load()
    return _status or ""


def available() -> bool:
    return _load() is not None


def supports(state_kv: torch.Tensor, inter_kv: torch.Tensor, rounding: str,
             compute_dtype: torch.dtype) -> bool:
    """Whether :func:`gdn_verify` handles this call: plain CPU tensors, float32 compute,
    float32/bfloat16 states and scratch with dense ``[K, V]`` blocks, round-to-nearest-even
    stores (or none: a float32 scratch stores exactly)."""
    if not (type(state_kv) is torch.Tensor and type(inter_kv) is torch.Tensor
            and state_kv.device.type == "cpu" and inter_kv.device.type == "cpu"):
        return False
    if compute_dtype != torch.float32 or state_kv.dtype not in _DTYPE_CODE or inter_kv.dtype not in _DTYPE_CODE:
        return False
    if rounding != "rne" and inter_kv.dtype != torch.float32:
        return False
    K, V = state_kv.shape[-2:]
    dense = lambda t: t.stride(-1) == 1 and t.stride(-2) == V  # noqa: E731
    return dense(state_kv) and dense(inter_kv) and available()


def gdn_verify(state_kv: torch.Tensor, slots: list[int], q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor, inter_kv: torch.Tensor,
               out: torch.Tensor) -> None:
    """Run the C kernel (check :func:`supports` first).

    state_kv ``[L, S, HV, K, V]``, inter_kv ``[L, N, D, HV, K, V]`` (float32 or bfloat16, dense
    ``[K, V]`` blocks, any outer strides); slots: N host ints; q, k ``[L, N, D, HV, K]``, v and
    out ``[L, N, D, HV, V]``, decay (= exp(g)) and beta ``[L, N, D, HV]``: dense float32.
    """
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the native GDN verify kernel is {status()}")
    L, N, D, HV, K = q.shape
    V = v.shape[-1]
    for t in (q, k, v, decay, beta, out):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError("native gdn_verify takes dense float32 q, k, v, decay, beta and out")
    S = state_kv.shape[1]
    # The C kernel trusts these (it reads and writes through raw pointers): check them all.
    if (tuple(state_kv.shape[2:]) != (HV, K, V) or tuple(inter_kv.shape) != (L, N, D, HV, K, V)
            or k.shape != q.shape or v.shape != out.shape or tuple(v.shape) != (L, N, D, HV, V)
            or decay.shape != beta.shape or tuple(decay.shape) != (L, N, D, HV)
            or len(slots) != N or any(not 0 <= s < S for s in slots)):
        raise ValueError(f"native gdn_verify: inconsistent shapes: state {tuple(state_kv.shape)}, scratch "
                         f"{tuple(inter_kv.shape)}, q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"out {tuple(out.shape)}, decay {tuple(decay.shape)}, beta {tuple(beta.shape)}, "
                         f"{len(slots)} slots in [0, {S})")
    slot_t = torch.tensor(slots, dtype=torch.int64)
    B = L * N * HV
    nthreads = max(1, min(torch.get_num_threads(), B))
    work = torch.empty(nthreads, 2 * K * V + 2 * V, dtype=torch.float32)
    ss, st = state_kv.stride(), inter_kv.stride()
    lib.drift_gdn_verify(B, nthreads, N, D, HV, K, V, state_kv.data_ptr(), _DTYPE_CODE[state_kv.dtype],
                         slot_t.data_ptr(), ss[0], ss[1], ss[2], inter_kv.data_ptr(), _DTYPE_CODE[inter_kv.dtype],
                         st[0], st[1], st[2], st[3], q.data_ptr(), k.data_ptr(), v.data_ptr(), decay.data_ptr(),
                         beta.data_ptr(), out.data_ptr(), work.data_ptr())
