"""Native CPU kernel for the hot loop of :func:`drift.sim.kernels.recurrent_gated_delta_rule`
(optional, built on demand).

On the CPU the torch-op verify makes five passes over every float32 state per verify token
(decay, ``h k``, rank-1 update, ``h q``, store), each a separate tensor op. The C kernel in
``_native/gdn_verify.c`` makes one per state row, with each head's state kept in a float32
scratch buffer across the D tokens, and is what lets ``drift run`` afford more decode steps.
The same library holds the float64 twin's decode (one step, or a batch of steps in one call), the
comparison's state metrics, the slot guard's byte comparison (:func:`changed_slots`) and the conv's
taps and output rounding (:func:`conv_taps`, :func:`conv_silu_bf16`: bit for bit torch's).
The verify kernel computes the same thing: float32 arithmetic (summation order may differ, so results agree
to float32 rounding, not bit for bit), round-to-nearest-even stores that give the same bits
as a torch cast of the same float32 value.

It is compiled with the system C compiler (``$CC``, else ``cc``/``gcc``/``clang``) the first
time it is needed, into ``$DRIFT_CACHE_DIR`` (default ``~/.cache/drift``), keyed by a hash of
source, compiler and CPU, written atomically with the sha256 of its bytes beside it
(``NAME.so.sha256``); a cached library whose bytes do not hash to that record (truncated,
damaged, or put there by hand) is rebuilt, never loaded. It is loaded with :mod:`ctypes` (no torch or
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
ABI = 7  # drift_native_abi() of the source this module drives
# -ffp-contract=off: each multiply and add rounds on its own, as the source writes them, whatever the
# compiler's default. GCC contracts nothing in ISO C mode (-std=c99), but clang fuses a*b + c into one FMA
# by default ("on"): built with -ffp-contract=fast, a 512-step default run's report.json differed in 1,075
# fields from GCC's (2026-12-07), so the figures would have depended on which compiler $CC names.
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-std=c99", "-lm"]
OPENMP = "-fopenmp"  # tried first; without it the kernel runs on one thread
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}
_LOAD_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float64: 2}  # the conv's inputs, read as float64

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


def _record(lib: Path) -> Path:
    return lib.with_name(lib.name + ".sha256")


def _verified(lib: Path) -> bool:
    """Whether ``lib`` is a regular file whose bytes hash to the sha256 recorded beside it at build."""
    try:
        if not lib.is_file():
            return False
        want = _record(lib).read_text().strip()
        return hashlib.sha256(lib.read_bytes()).hexdigest() == want
    except (OSError, UnicodeDecodeError):
        return False


def _build(cc: str, flags: list[str]) -> Path:
    """Compile :data:`SOURCE` (cached by content, compiler, flags and CPU); returns the library path."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + "\0".join([version, _cpu_id(), *flags]).encode()).hexdigest()[:16]
    for folder in (cache_dir(), Path(tempfile.gettempdir()) / f"drift-cache-{os.getuid() if hasattr(os, 'getuid') else 0}"):
        lib = folder / f"gdn_verify-{key}.so"
        if _verified(lib):
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
        digest = hashlib.sha256(Path(tmp).read_bytes()).hexdigest()
        os.replace(tmp, lib)  # atomic: a concurrent builder sees no file or the whole file
        fd, tmp = tempfile.mkstemp(prefix=".gdn_verify-", suffix=".sha256", dir=folder)
        with os.fdopen(fd, "w") as f:
            f.write(digest + "\n")
        os.replace(tmp, _record(lib))  # the record last: until it is there the library is not trusted
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
        i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        lib.drift_rgdr.argtypes = ([i64] * 6 + [c_int] + [ptr, c_int, i64, i64, ptr, c_int, i64, i64]
                                   + [ptr] * 3 + [ptr] * 7)
        lib.drift_rgdr.restype = None
        lib.drift_decode_f64.argtypes = [i64] * 6 + [c_int] + [ptr] * 9 + [i64, ptr, ptr]
        lib.drift_decode_f64.restype = None
        lib.drift_decode_f64_steps.argtypes = [i64] * 7 + [c_int] + [ptr] * 13
        lib.drift_decode_f64_steps.restype = None
        lib.drift_changed_slots.argtypes = [i64] * 3 + [ptr] * 3
        lib.drift_changed_slots.restype = None
        lib.drift_state_metrics.argtypes = [i64, i64, i64, c_int, ptr, c_int, c_int, ptr, ptr, ptr, ptr]
        lib.drift_state_metrics.restype = None
        lib.drift_conv_taps.argtypes = [i64] * 5 + ([ptr, c_int] + [i64] * 4) * 2 + [ptr, c_int] + [i64] * 3 + [ptr] * 3
        lib.drift_conv_taps.restype = None
        lib.drift_conv_silu_bf16.argtypes = [i64] + [ptr] * 3
        lib.drift_conv_silu_bf16.restype = c_int
        lib.drift_stochastic_bf16_bits.argtypes = [i64] * 3 + [ptr] * 2
        lib.drift_stochastic_bf16_bits.restype = None
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


def supports(rec: torch.Tensor, blocks: torch.Tensor, rounding: str) -> bool:
    """Whether :func:`recurrent_gated_delta_rule` handles this call: plain dense CPU tensors of
    float32 / bfloat16 states (committed ``[L, S, HV, V, K]``, scratch blocks ``[L, I, HV, V, K]``),
    round-to-nearest-even stores (or none: a float32 scratch stores exactly)."""
    for t in (rec, blocks):
        if not (type(t) is torch.Tensor and t.device.type == "cpu" and t.dtype in _DTYPE_CODE and t.is_contiguous()):
            return False
    if rounding != "rne" and blocks.dtype != torch.float32:
        return False
    return available()


def recurrent_gated_delta_rule(rec: torch.Tensor, blocks: torch.Tensor, start: list[int], from_rec: list[bool],
                               dst: list[list[int]], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               decay: torch.Tensor, beta: torch.Tensor, out: torch.Tensor) -> None:
    """Run the C kernel (check :func:`supports` first).

    rec ``[L, S, HV, V, K]`` committed states and blocks ``[L, I, HV, V, K]`` scratch blocks by flat
    index (float32 or bfloat16, dense); start / from_rec: B host values, where each row starts
    (a slot of rec, or a block of the scratch); dst: B lists of S scratch blocks receiving the
    state after each token (-1: that token's state is not stored); q, k ``[L, B, S, HV, K]``, v and out ``[L, B, S, HV, V]``, decay
    (= exp(g)) and beta (= sigmoid(b)) ``[L, B, S, HV]``: dense float32.
    """
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the native verify kernel is {status()}")
    L, B, S, HV, K = q.shape
    V = v.shape[-1]
    for t in (q, k, v, decay, beta, out):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError("native recurrent_gated_delta_rule takes dense float32 q, k, v, decay, beta and out")
    slots, n_blocks = rec.shape[1], blocks.shape[1]
    # The C kernel trusts these (it reads and writes through raw pointers): check them all.
    ok = (tuple(rec.shape[2:]) == (HV, V, K) and tuple(blocks.shape[2:]) == (HV, V, K) and rec.shape[0] == L
          and blocks.shape[0] == L and k.shape == q.shape and v.shape == out.shape and tuple(v.shape) == (L, B, S, HV, V)
          and decay.shape == beta.shape and tuple(decay.shape) == (L, B, S, HV)
          and len(start) == len(from_rec) == len(dst) == B and all(len(d) == S for d in dst)
          and all(0 <= i < (slots if fr else n_blocks) for i, fr in zip(start, from_rec))
          and all(-1 <= i < n_blocks for d in dst for i in d)
          and rec.is_contiguous() and blocks.is_contiguous())
    if not ok:
        raise ValueError(f"native recurrent_gated_delta_rule: inconsistent arguments: states {tuple(rec.shape)}, "
                         f"scratch {tuple(blocks.shape)}, q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}, out {tuple(out.shape)}, decay {tuple(decay.shape)}, "
                         f"beta {tuple(beta.shape)}, start {start} (from committed {from_rec}), dst {dst}")
    start_t = torch.tensor(start, dtype=torch.int64)
    from_t = torch.tensor([bool(x) for x in from_rec], dtype=torch.uint8)
    dst_t = torch.tensor(dst, dtype=torch.int64).reshape(B * S)
    items = L * B * HV
    nthreads = max(1, min(torch.get_num_threads(), items))
    work = torch.empty(nthreads, 2 * K * V, dtype=torch.float32)
    lib.drift_rgdr(L, B, S, HV, K, V, nthreads, rec.data_ptr(), _DTYPE_CODE[rec.dtype], rec.stride(0),
                   rec.stride(1), blocks.data_ptr(), _DTYPE_CODE[blocks.dtype], blocks.stride(0), blocks.stride(1),
                   start_t.data_ptr(), from_t.data_ptr(), dst_t.data_ptr(), q.data_ptr(), k.data_ptr(),
                   v.data_ptr(), decay.data_ptr(), beta.data_ptr(), out.data_ptr(), work.data_ptr())


def _dense(t: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    if type(t) is not torch.Tensor or t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous():
        raise ValueError(f"native: {name} must be a dense CPU {dtype} tensor, got {t.dtype} "
                         f"{'dense' if t.is_contiguous() else 'strided'} on {t.device}")


def decode_f64(state: torch.Tensor, num_tokens: list[int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               decay: torch.Tensor, beta: torch.Tensor, out: torch.Tensor, norms: torch.Tensor,
               captures: list[tuple[list[int], torch.Tensor]] = ()) -> None:
    """The float64 truth's sequential decode in C (check :func:`available` first): state
    ``[L, R, HV, V, K]`` updated in place, all dense float64; num_tokens: R host ints (tokens past
    them are identities); q, k ``[L, R, D, HV, K]``, v and out ``[L, R, D, HV, V]``, decay, beta,
    norms ``[L, R, D, HV]``; captures: (R host steps, -1 = none; out ``[L, R, HV, V, K]``)."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the native kernels are {status()}")
    L, R, D, HV, K = q.shape
    V = v.shape[-1]
    f64 = torch.float64
    for name, t in (("state", state), ("q", q), ("k", k), ("v", v), ("decay", decay), ("beta", beta),
                    ("out", out), ("norms", norms)):
        _dense(t, f64, name)
    for steps, cap in captures:
        _dense(cap, f64, "capture")
        if tuple(cap.shape) != (L, R, HV, V, K) or len(steps) != R:
            raise ValueError(f"native decode_f64: capture {tuple(cap.shape)} / {len(steps)} steps do not fit")
    if (tuple(state.shape) != (L, R, HV, V, K) or k.shape != q.shape or tuple(v.shape) != (L, R, D, HV, V)
            or v.shape != out.shape or tuple(decay.shape) != (L, R, D, HV) or beta.shape != decay.shape
            or norms.shape != decay.shape or len(num_tokens) != R):
        raise ValueError(f"native decode_f64: inconsistent shapes: state {tuple(state.shape)}, q {tuple(q.shape)}, "
                         f"v {tuple(v.shape)}, decay {tuple(decay.shape)}, {len(num_tokens)} token counts")
    ntok = torch.tensor(num_tokens, dtype=torch.int64)
    cap_steps = torch.tensor([list(s) for s, _ in captures] or [[-1] * R], dtype=torch.int64)
    cap_ptrs = (ctypes.c_void_p * max(1, len(captures)))(*[c.data_ptr() for _, c in captures])
    items = L * R * HV
    nthreads = max(1, min(torch.get_num_threads(), items))
    lib.drift_decode_f64(L, R, D, HV, K, V, nthreads, state.data_ptr(), ntok.data_ptr(), q.data_ptr(), k.data_ptr(),
                         v.data_ptr(), decay.data_ptr(), beta.data_ptr(), out.data_ptr(), norms.data_ptr(),
                         len(captures), cap_steps.data_ptr(), cap_ptrs)


def decode_f64_steps(state: torch.Tensor, num_tokens: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor, out: torch.Tensor, norms: torch.Tensor,
                     states_out: Optional[torch.Tensor] = None,
                     captures: list[tuple[int, list[int], torch.Tensor]] = ()) -> None:
    """``n`` calls of :func:`decode_f64` in one (the comparison's batch of steps), the same bits:
    step j's arguments are the leading index j of num_tokens (int64 ``[n, R]``), q, k ``[n, L, R, D,
    HV, K]``, v, out ``[n, L, R, D, HV, V]``, decay, beta, norms ``[n, L, R, D, HV]``; states_out
    (``[n, L, R, HV, V, K]``, or None) receives the state after each step; captures: (step j, R host
    token indices, -1 = none; out ``[L, R, HV, V, K]``), each taken at its step as :func:`decode_f64`'s."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the native kernels are {status()}")
    n, L, R, D, HV, K = q.shape
    V = v.shape[-1]
    f64 = torch.float64
    for name, t in (("state", state), ("q", q), ("k", k), ("v", v), ("decay", decay), ("beta", beta),
                    ("out", out), ("norms", norms)) + ((("states_out", states_out),) if states_out is not None else ()):
        _dense(t, f64, name)
    _dense(num_tokens, torch.int64, "num_tokens")
    if (tuple(state.shape) != (L, R, HV, V, K) or k.shape != q.shape or tuple(v.shape) != (n, L, R, D, HV, V)
            or v.shape != out.shape or tuple(decay.shape) != (n, L, R, D, HV) or beta.shape != decay.shape
            or norms.shape != decay.shape or tuple(num_tokens.shape) != (n, R)
            or (states_out is not None and tuple(states_out.shape) != (n, L, R, HV, V, K))):
        raise ValueError(f"native decode_f64_steps: inconsistent shapes: state {tuple(state.shape)}, q {tuple(q.shape)}, "
                         f"v {tuple(v.shape)}, decay {tuple(decay.shape)}, num_tokens {tuple(num_tokens.shape)}")
    captures = sorted(captures, key=lambda c: c[0])
    for j, steps, cap in captures:
        _dense(cap, f64, "capture")
        if tuple(cap.shape) != (L, R, HV, V, K) or len(steps) != R or not 0 <= j < n:
            raise ValueError(f"native decode_f64_steps: capture at step {j}, {tuple(cap.shape)} / {len(steps)} steps "
                             "do not fit")
    first = torch.zeros(n + 1, dtype=torch.int64)
    for j, _, _ in captures:
        first[j + 1:] += 1
    cap_steps = torch.tensor([list(s) for _, s, _ in captures] or [[-1] * R], dtype=torch.int64)
    cap_ptrs = (ctypes.c_void_p * max(1, len(captures)))(*[c.data_ptr() for _, _, c in captures])
    nthreads = max(1, min(torch.get_num_threads(), L * R * HV))
    lib.drift_decode_f64_steps(n, L, R, D, HV, K, V, nthreads, state.data_ptr(), num_tokens.data_ptr(), q.data_ptr(),
                               k.data_ptr(), v.data_ptr(), decay.data_ptr(), beta.data_ptr(), out.data_ptr(),
                               norms.data_ptr(), states_out.data_ptr() if states_out is not None else None,
                               first.data_ptr(), cap_steps.data_ptr(), cap_ptrs)


def changed_slots(now: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """``[S]`` bool: the slots (dimension 1) of ``now`` and ``before`` (dense CPU tensors of one shape and
    dtype, ``[L, S, ...]``) whose bytes differ in any layer (check :func:`available` first)."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the native kernels are {status()}")
    for name, t in (("now", now), ("before", before)):
        if type(t) is not torch.Tensor or t.device.type != "cpu" or not t.is_contiguous() or t.dim() < 2:
            raise ValueError(f"native changed_slots: {name} must be a dense CPU tensor [L, S, ...]")
    if now.shape != before.shape or now.dtype != before.dtype:
        raise ValueError(f"native changed_slots: {tuple(now.shape)} {now.dtype} and {tuple(before.shape)} "
                         f"{before.dtype} differ")
    L, S = now.shape[:2]
    flags = torch.empty(S, dtype=torch.bool)
    nbytes = now[0, 0].numel() * now.element_size() if now.numel() else 0
    lib.drift_changed_slots(L, S, nbytes, now.data_ptr(), before.data_ptr(), flags.data_ptr())
    return flags


def state_metrics(run: torch.Tensor, truth: torch.Tensor, mantissa_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per state block of ``run`` (dense bfloat16 or float32 ``[..., V, K]``) against ``truth`` (dense
    float64, same shape): ``m [..., 8]`` = err2, ref2, run2, ulp2_run, ulp4_run, ulp2_bf16(truth),
    ulp2_rows2 (sum over the V rows of each row's ulp^2 sum, squared), finite, and ``col [..., K]`` (the run's ulp^2 per key column); ulps on the grid with
    ``mantissa_bits`` significant bits for the run, bf16's for the truth. Float64 sums."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the native kernels are {status()}")
    if run.dtype not in _DTYPE_CODE:
        raise ValueError(f"native state_metrics: run dtype {run.dtype} is not float32 or bfloat16")
    _dense(run, run.dtype, "run")
    _dense(truth, torch.float64, "truth")
    if run.shape != truth.shape:
        raise ValueError(f"native state_metrics: shapes {tuple(run.shape)} and {tuple(truth.shape)} differ")
    V, K = run.shape[-2:]
    lead = run.shape[:-2]
    items = run.numel() // (V * K) if run.numel() else 0
    m = torch.empty(*lead, 8, dtype=torch.float64)
    col = torch.empty(*lead, K, dtype=torch.float64)
    nthreads = max(1, min(torch.get_num_threads(), max(items, 1)))
    acc = torch.empty(nthreads, 7 * K, dtype=torch.float64)  # per-thread column sums
    lib.drift_state_metrics(items, K, V, nthreads, run.data_ptr(), _DTYPE_CODE[run.dtype], mantissa_bits,
                            truth.data_ptr(), m.data_ptr(), col.data_ptr(), acc.data_ptr())
    return m, col


def conv_takes(window: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`conv_mix` runs in C for these inputs: plain CPU tensors (any strides) of float32,
    bfloat16 or float64, and the library built."""
    return (all(type(t) is torch.Tensor and t.device.type == "cpu" and t.dtype in _LOAD_CODE
                for t in (window, x, weight)) and available())


def conv_taps(window: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The taps of :func:`drift.sim.kernels.conv_mix` in C, the same bits (check :func:`conv_takes`
    first): ``acc`` and ``-acc``, dense float64 ``[L, N, D, C]``, of window ``[L, N, Kc-1, C]``, x
    ``[L, N, D, C]`` and weight ``[L, C, Kc]``, each read through its strides in its own dtype."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the native kernels are {status()}")
    L, N, D, C = x.shape
    Kc = weight.shape[-1]
    if tuple(window.shape) != (L, N, Kc - 1, C) or tuple(weight.shape) != (L, C, Kc):
        raise ValueError(f"native conv_taps: window {tuple(window.shape)}, x {tuple(x.shape)} and weight "
                         f"{tuple(weight.shape)} do not fit")
    acc = torch.empty(L, N, D, C, dtype=torch.float64)
    neg = torch.empty(L, N, D, C, dtype=torch.float64)
    scratch = torch.empty((Kc - 1 + D + Kc) * C, dtype=torch.float64)
    lib.drift_conv_taps(L, N, D, Kc, C, window.data_ptr(), _LOAD_CODE[window.dtype], *window.stride(),
                        x.data_ptr(), _LOAD_CODE[x.dtype], *x.stride(), weight.data_ptr(), _LOAD_CODE[weight.dtype],
                        *weight.stride(), acc.data_ptr(), neg.data_ptr(), scratch.data_ptr())
    return acc, neg


def conv_silu_bf16(acc: torch.Tensor, exp_neg: torch.Tensor) -> Optional[torch.Tensor]:
    """``bf16(float32(acc / (1 + exp_neg)))`` in C (dense float64 inputs of one shape): the rounding
    :func:`drift.sim.kernels.conv_mix` makes, the same bits; None where a result is NaN (torch's cast
    gives a NaN the bits of where it falls in its vector loop, so the caller rounds such a call)."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the native kernels are {status()}")
    _dense(acc, torch.float64, "acc")
    _dense(exp_neg, torch.float64, "exp_neg")
    if acc.shape != exp_neg.shape:
        raise ValueError(f"native conv_silu_bf16: shapes {tuple(acc.shape)} and {tuple(exp_neg.shape)} differ")
    out = torch.empty(acc.shape, dtype=torch.bfloat16)
    if lib.drift_conv_silu_bf16(acc.numel(), acc.data_ptr(), exp_neg.data_ptr(), out.data_ptr()):
        return None
    return out


def stochastic_bf16_bits(bits: torch.Tensor, key: int, offset: int) -> torch.Tensor:
    """:func:`drift.sim.kernels.store_state`'s stochastic rounding in C, the same bits: of the float32 values
    whose bits are ``bits`` (a dense int32 tensor), element i's noise hashed from (``offset`` + i, ``key``),
    the int32 bits of the float32 that holds each one's bf16 (low 16 bits zero); the caller casts them to
    bf16 with torch, as the torch path does (exact, and a NaN gets the bits torch's cast gives it)."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the native kernels are {status()}")
    _dense(bits, torch.int32, "bits")
    out = torch.empty(bits.shape, dtype=torch.int32)
    lib.drift_stochastic_bf16_bits(bits.numel(), offset, key & 0xFFFFFFFF, bits.data_ptr(), out.data_ptr())
    return out
