"""Every file drift reads or writes goes through here: bounded reads, checked outputs, atomic writes.

Writes: a write goes to a temporary file in the destination's directory, is flushed and
fsynced, then renamed over the destination: a reader sees the old file or the new one, never a
torn one, even if the writer is killed halfway. A write that fails (a full disk, a directory
where the file goes) raises :class:`~drift.errors.WriteError` (exit 2) naming the path and the
cause, and leaves no partial file.

Outputs are checked before any work: :func:`writable_dir` and :func:`output_file` prove a file can
be created where it will go and that nothing of the wrong kind (a directory) stands in its way;
:func:`refuse_overwriting` that no output is one of the command's inputs. A directory of outputs is
held by one command at a time (:func:`locked`), and a set of files that belong together (a report)
is replaced as one unit (:func:`staged`).

Reads refuse, with :class:`~drift.errors.DataError` (exit 2) naming the file: what is not a
regular file, JSON nested past what Python's parser can follow, and ``.npz`` members whose
declared shape needs more memory than :func:`memory_limit` allows (checked from the ``.npy``
headers, before anything is allocated) or more bytes than the member holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import shutil
import signal
import stat
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence, Type

import numpy as np

from .errors import ConfigError, DataError, DriftError, WriteError, raise_if_interrupted

MAX_JSON_BYTES = 256 << 20  # drift's JSON files (reports, manifests) are KiB to a few MiB
NPY_MAX_HEADER = 10_000  # numpy's own safe limit on an .npy header (np.lib.format, max_header_size)
MEMORY_LIMIT_ENV = "DRIFT_MAX_BYTES"


# ------------------------------------------------------------------- limits
def memory_limit() -> int:
    """Bytes one array (or one planned allocation) may take: ``$DRIFT_MAX_BYTES`` if set (a number
    of bytes, or with a K/M/G/T suffix), else this machine's physical memory (64 GiB when unknown)."""
    text = os.environ.get(MEMORY_LIMIT_ENV, "").strip()
    if text:
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(text[-1:].upper(), 1)
        try:
            value = float(text[:-1] if scale > 1 else text) * scale
        except ValueError:
            value = -1.0
        if not value > 0:
            raise ConfigError(f"{MEMORY_LIMIT_ENV}={text!r} is not a positive byte count; write e.g. 64G")
        return int(value)
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 64 << 30


def _size(n: float) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def check_memory(nbytes: float, what: str, error: Type[DriftError] = DataError) -> None:
    """Refuse, before allocating, a plan that needs more than :func:`memory_limit` bytes."""
    limit = memory_limit()
    if nbytes > limit:
        raise error(f"{what}: needs {_size(nbytes)}, more than drift's memory limit of {_size(limit)} "
                    f"(this machine's memory unless ${MEMORY_LIMIT_ENV} says otherwise); use a smaller shape, "
                    f"or raise the limit with {MEMORY_LIMIT_ENV}=<bytes, e.g. 512G> on a machine that has it")


# ------------------------------------------------------------------- reads
def require_file(path: Path, what: str, fix: str, error: Type[DriftError] = DataError) -> Path:
    """``path`` as a regular file (symlinks followed), else ``error`` saying what stands there."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise error(f"{what} {path} not found; {fix}") from None
    except OSError as exc:  # a symlink loop, a component that is not a directory, no permission
        raise error(f"{what} {path} cannot be opened ({exc.strerror or exc}); {fix}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise error(f"{what} {path} is {kind}; {fix}")
    return path


def read_bytes(path: Path, what: str, fix: str, error: Type[DriftError] = DataError) -> bytes:
    require_file(path, what, fix, error)
    try:
        return path.read_bytes()
    except OSError as exc:
        raise error(f"{what} {path} cannot be read ({exc.strerror or exc}); {fix}") from None


def _reject_constant(name: str):
    raise ValueError(f"non-finite number {name} (strict JSON has no NaN/Infinity)")


def read_json(path: str | os.PathLike, what: str, fix: str, error: Type[DriftError] = DataError) -> Any:
    """The JSON value in ``path``: a regular file of at most MAX_JSON_BYTES, UTF-8, strict JSON
    (no NaN), nested no deeper than Python's parser follows; else ``error`` naming the file and ``fix``."""
    path = Path(path)
    require_file(path, what, fix, error)
    if path.stat().st_size > MAX_JSON_BYTES:
        raise error(f"{what} {path} is {_size(path.stat().st_size)}, larger than any file drift writes "
                    f"({_size(MAX_JSON_BYTES)}); {fix}")
    try:
        return json.loads(read_bytes(path, what, fix, error).decode("utf-8"), parse_constant=_reject_constant)
    except RecursionError:
        raise error(f"{what} {path} is nested deeper than any file drift writes (not parsed); {fix}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise error(f"{what} {path} is not valid JSON ({exc}); {fix}") from None


def npz_members(path: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Each array of an .npz with its declared shape and dtype, read from the ``.npy`` headers only
    (nothing allocated); DataError for a header that is too long, an object dtype, or a shape that
    needs more bytes than the member holds or than :func:`memory_limit` allows."""
    out = {}
    try:
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                name = info.filename.removesuffix(".npy")
                with zf.open(info) as f:
                    try:
                        version = np.lib.format.read_magic(f)
                        if version not in ((1, 0), (2, 0)):
                            raise ValueError(f".npy format {version}; drift writes 1.0 and 2.0")
                        read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                                else np.lib.format.read_array_header_2_0)
                        shape, _, dtype = read(f, max_header_size=NPY_MAX_HEADER)
                    except ValueError as exc:
                        raise DataError(f"{path}: array {name!r} has a malformed or oversized .npy header "
                                        f"({str(exc).splitlines()[0][:200]}): a damaged or hostile file") from None
                if dtype.hasobject:
                    raise DataError(f"{path}: array {name!r} holds Python objects (dtype {dtype}); drift never "
                                    "stores pickled objects and does not load them")
                nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
                if nbytes > info.file_size:
                    raise DataError(f"{path}: array {name!r} declares shape {tuple(shape)} {dtype} "
                                    f"({_size(nbytes)}) but holds {_size(info.file_size)}: a damaged or hostile file")
                check_memory(nbytes, f"{path}: array {name!r} of shape {tuple(shape)} {dtype}")
                out[name] = (tuple(shape), dtype)
    except (zipfile.BadZipFile, EOFError, OSError) as exc:
        raise DataError(f"{path} is not a readable .npz ({exc})") from None
    return out


# ------------------------------------------------------------------ outputs
def writable_dir(path: str | os.PathLike, option: str) -> Path:
    """Create ``path`` and prove a file can be written there, before any work starts."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".drift-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except FileExistsError:
        raise ConfigError(f"{option} {path}: is a file, not a directory; pass a directory") from None
    except OSError as exc:
        raise ConfigError(f"{option} {path}: cannot write there ({exc.strerror or exc}); pass a writable "
                          "directory") from None
    return path


def output_file(path: str | os.PathLike, option: str) -> Path:
    """``path`` as a file drift will write: its directory writable (created), and the path itself
    free or a regular file it may replace (a directory there is refused), before any work starts."""
    path = Path(path)
    writable_dir(path.parent if str(path.parent) else Path("."), option)
    if path.is_dir():
        raise ConfigError(f"{option} {path}: is a directory; drift writes a file there: pass a file path, or "
                          "move the directory away")
    if path.exists() and not path.is_file():
        raise ConfigError(f"{option} {path}: is not a regular file; pass a file path")
    return path


def output_files(directory: str | os.PathLike, names: tuple[str, ...], option: str) -> Path:
    """:func:`writable_dir`, then :func:`output_file` for each of ``names`` under it."""
    directory = writable_dir(directory, option)
    for name in names:
        output_file(directory / name, option)
    return directory


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether ``a`` and ``b`` name one file: the same real path (``./x`` and ``x``, symlinks
    resolved), or, where both exist, the same inode (a hard link)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


def refuse_overwriting(outputs: Iterable[tuple[str, Path]], inputs: Sequence[tuple[str, Path]]) -> None:
    """ConfigError, before any work, when an output (``(option, path)``) is one of the command's
    inputs (``(what, path)``): the same path, or the same file through a symlink or a hard link."""
    for option, out in outputs:
        for what, src in inputs:
            if same_file(out, src):
                raise ConfigError(f"{option} {out} is the same file as {what} ({src}): drift never writes over "
                                  f"its own inputs; pass another {option} path")


LOCK_NAME = ".lock"


@contextlib.contextmanager
def locked(directory: Path, holder: str, option: str = "--report") -> Iterator[None]:
    """Hold an advisory lock (``flock``) on output directory ``directory`` for ``holder`` (e.g.
    "drift run"): a second command on it gets ConfigError naming the holder's pid. The lock
    file (``DIR/.lock``) is removed when the block ends, however it ends; one a killed process
    left behind holds no lock and is taken over."""
    path = Path(directory) / LOCK_NAME
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            raise ConfigError(f"{option} {directory}: cannot create its lock file {path} ({exc.strerror or exc}); "
                              f"pass a writable {option} directory") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid, _, who = os.pread(fd, 256, 0).decode(errors="replace").strip().partition(" ")
            os.close(fd)
            raise ConfigError(f"{option} {directory} is in use by another {who or 'drift command'} (pid "
                              f"{pid or 'unknown'}); wait for it to finish, or pass another {option} directory") from None
        try:  # a holder unlinked the file on release after this one opened it: open the new one
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {holder}\n".encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)  # while still locked: one who opened it meanwhile re-opens (above)
        os.close(fd)  # closing releases the lock


UNIT_DIR = ".drift-unit"  # a committed unit whose files are being moved into place
UNIT_LIST = ".unit.json"  # in it: the names to move into place and the names to remove


@contextlib.contextmanager
def staged(directory: Path, names: Sequence[str]) -> Iterator[Path]:
    """A set of files in ``directory`` (``names``) replaced as one unit: the block writes the new
    ones into the yielded staging directory (a hidden sibling of the files, on the same file
    system); when it ends without error they replace the old set -- a name it did not write is
    removed -- and when it raises the old set is left as it was. The staging directory is
    renamed to ``DIR/.drift-unit`` (the commit) before the files are moved, and the moves run
    with SIGINT/SIGTERM held back; a unit a killed process left committed is completed by the
    next :func:`staged` on the directory, one left uncommitted is discarded. Hold
    :func:`locked` on ``directory`` around it."""
    directory = Path(directory)
    _finish_unit(directory)
    try:
        stage = Path(tempfile.mkdtemp(prefix=UNIT_DIR + "-", dir=directory))
    except OSError as exc:
        _write_error(exc, directory)
        raise
    try:
        yield stage
        written = sorted(p.name for p in stage.iterdir())
        atomic_write_json(stage / UNIT_LIST, {"move": written, "remove": sorted(set(names) - set(written))})
        os.rename(stage, directory / UNIT_DIR)  # the commit point
    except BaseException as exc:
        shutil.rmtree(stage, ignore_errors=True)
        if isinstance(exc, WriteError):  # name the file where it goes, not its staging copy
            raise WriteError(str(exc).replace(str(stage), str(directory))) from None
        _write_error(exc, directory)
        raise
    _finish_unit(directory)


def _write_error(exc: BaseException, path: Path) -> None:
    """An OSError (not drift's own) while writing ``path`` raised as WriteError (exit 2)."""
    if isinstance(exc, OSError) and not isinstance(exc, DriftError):
        raise WriteError(f"cannot write {path} ({exc.strerror or exc}); nothing was written there: "
                         "free space or fix the permissions, or pass another path") from None


def _finish_unit(directory: Path) -> None:
    """Complete a committed unit (move its files into place) and drop uncommitted staging dirs."""
    for leftover in directory.glob(UNIT_DIR + "-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    unit = directory / UNIT_DIR
    if not unit.is_dir():
        return
    fix = f"remove {unit} (a damaged unit of drift's) and run the command again"
    plan = read_json(unit / UNIT_LIST, "report unit list", fix)
    if not (isinstance(plan, dict) and all(isinstance(plan.get(k), list) for k in ("move", "remove"))
            and all(isinstance(n, str) and n and n == Path(n).name for n in plan["move"] + plan["remove"])):
        raise DataError(f"{unit / UNIT_LIST} does not list plain file names to move and remove; {fix}")
    masked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        for name in plan["move"]:
            if (unit / name).exists():  # absent: moved before the process that committed it was killed
                os.replace(unit / name, directory / name)
        for name in plan["remove"]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(directory / name)
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        shutil.rmtree(unit)
    except OSError as exc:
        _write_error(exc, directory)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, masked)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically; WriteError (exit 2) naming the path and the cause."""
    path = Path(path)
    tmp = None
    raise_if_interrupted()  # nothing is written after an interrupt, even one a callback swallowed
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file ordinary permissions
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        _write_error(exc, path)
        raise


def save_figure(fig, path: str | os.PathLike, **kwargs) -> Path:
    """A matplotlib figure written as PNG atomically (rendered in memory first)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", **kwargs)
    atomic_write_bytes(path, buf.getvalue())
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n")


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """Deterministic .npz bytes (uncompressed zip; no pickled objects allowed)."""
    buf = io.BytesIO()
    for k, v in arrays.items():
        if v.dtype == object:
            raise ValueError(f"array {k!r} has dtype object; drift never stores pickled objects")
    np.savez(buf, **arrays)
    return buf.getvalue()




def load_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Load every array of an .npz without pickle, its headers checked first (:func:`npz_members`):
    DataError naming the file for a non-file, a damaged zip, an object array, a shape too large."""
    path = require_file(Path(path), "npz", "pass an intact .npz written by drift")
    npz_members(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path} is not a readable .npz ({str(exc).splitlines()[0][:200]})") from None
