"""Checkpoints of a running simulation, without pickle.

Every stateful piece (simulation, twin, checks, bound model) exposes ``state_dict()`` /
``load_state_dict()`` built on :func:`saveable` / :func:`restore`: tensors, numpy arrays,
numbers, strings, None, and dicts/lists of those. Files are written with ``torch.save``
(atomically) and read with ``torch.load(..., weights_only=True)``, which refuses anything
but those types.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import DataError
from .fileio import atomic_write_bytes, require_file

_ND = "__ndarray__"


def saveable(x: Any) -> Any:
    """A copy of ``x`` made of types ``torch.load(weights_only=True)`` accepts."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu").clone()
    if isinstance(x, np.ndarray):
        return {_ND: torch.from_numpy(np.array(x, copy=True, order="C"))}
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, dict):
        return {str(k): saveable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [saveable(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"cannot checkpoint a {type(x).__name__}; convert it to tensors, arrays or numbers")


def restore(x: Any) -> Any:
    """Inverse of :func:`saveable` (numpy arrays come back as numpy arrays)."""
    if isinstance(x, dict):
        if set(x) == {_ND}:
            return x[_ND].numpy().copy()
        return {k: restore(v) for k, v in x.items()}
    if isinstance(x, list):
        return [restore(v) for v in x]
    return x


class Stateful:
    """Mixin: ``state_dict`` / ``load_state_dict`` over the attributes named in ``_state``."""

    _state: tuple[str, ...] = ()

    def state_dict(self) -> dict:
        return {name: saveable(getattr(self, name)) for name in self._state}

    def load_state_dict(self, state: dict) -> None:
        for name in self._state:
            setattr(self, name, restore(state[name]))


def save(path: str | os.PathLike, payload: dict) -> None:
    """Write ``payload`` (already saveable) atomically."""
    buf = io.BytesIO()
    torch.save(payload, buf)
    atomic_write_bytes(path, buf.getvalue())


def load(path: str | os.PathLike) -> dict:
    """Read a checkpoint written by :func:`save` (no pickle: weights_only)."""
    path = require_file(Path(path), "checkpoint", "delete it, or run without --resume")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        # torch's own message goes on to advise weights_only=False, which would run the file's code: never.
        raise DataError(f"checkpoint {path} cannot be read (it holds objects other than tensors, numbers and "
                        "strings, so it is no drift checkpoint; drift never unpickles code)") from None
    except Exception as exc:
        first = str(exc).splitlines()[0][:300] if str(exc) else ""
        raise DataError(f"checkpoint {path} cannot be read ({type(exc).__name__}: {first})") from None
    if not isinstance(state, dict):
        raise DataError(f"checkpoint {path} holds a {type(state).__name__}, not a drift checkpoint")
    return state
