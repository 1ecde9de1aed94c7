"""Atomic writes for everything drift persists (reports, golden data, checkpoints).

A write goes to a temporary file in the destination's directory, is flushed and
fsynced, then renamed over the destination: a reader sees the old file or the new
one, never a torn one, even if the writer is killed halfway.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file ordinary permissions
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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
    """Load every array of an .npz without pickle (object arrays are refused)."""
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}
