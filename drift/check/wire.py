"""The bytes the simulation and the comparison's process exchange (drift.check.forked): a closed set of
types, packed and unpacked without pickle.

What crosses is what a step leaves to compare besides its tensors in shared memory (the starts of
requests, the measures' snapshots), a chunk's per-step arrays, a lane's truth, and a checkpoint's part
of the comparison: ``None``, ``bool``, ``int`` (int64), ``float``, ``str``, tuples, lists, dicts (str or
int keys), numpy arrays of numbers or bools, CPU tensors (any dtype, bfloat16 included),
:class:`drift.sim.serving.Start`, and :class:`Placed` (a tensor the sender wrote into memory both processes
share: only its place crosses, and the receiver's ``placed`` function reads it back). Anything else raises :class:`TypeError` naming its type, at packing,
in the process that made it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, fields
from typing import Callable, Optional

import numpy as np
import torch

from ..sim.serving import Start

_LEN = struct.Struct("<Q")
_INT = struct.Struct("<q")
_FLOAT = struct.Struct("<d")
_TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool)}


@dataclass(frozen=True)
class Placed:
    """A tensor the sender wrote into shared memory: ``offset`` bytes into it, its dtype and shape."""

    offset: int
    dtype: torch.dtype
    shape: tuple

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def pack(obj) -> bytes:
    """``obj`` as bytes (:func:`unpack` restores it)."""
    return b"".join(pack_parts(obj))


def pack_parts(obj) -> list:
    """``obj`` as a list of bytes-like parts whose concatenation is :func:`pack`'s (arrays and tensors are
    views of their memory, not copies: write them out before they change)."""
    out: list = []
    _pack(obj, out)
    return out


def unpack(data: bytes, placed: Optional[Callable[[Placed], torch.Tensor]] = None):
    """What :func:`pack` packed; each :class:`Placed` becomes ``placed(it)`` (a ValueError without one)."""
    obj, end = _unpack(memoryview(data), 0, placed)
    if end != len(data):
        raise ValueError(f"{len(data) - end} bytes left after the value")
    return obj


def _blob(out: list, raw) -> None:
    out.append(_LEN.pack(raw.nbytes if isinstance(raw, memoryview) else len(raw)))
    out.append(raw)


def _pack(obj, out: list) -> None:
    if obj is None:
        out.append(b"N")
    elif isinstance(obj, (bool, np.bool_)):
        out.append(b"T" if obj else b"F")
    elif isinstance(obj, (int, np.integer)):
        out.append(b"i" + _INT.pack(int(obj)))
    elif isinstance(obj, (float, np.floating)):
        out.append(b"f" + _FLOAT.pack(float(obj)))
    elif isinstance(obj, str):
        out.append(b"s")
        _blob(out, obj.encode())
    elif isinstance(obj, (tuple, list)):
        out.append((b"t" if isinstance(obj, tuple) else b"l") + _LEN.pack(len(obj)))
        for item in obj:
            _pack(item, out)
    elif isinstance(obj, dict):
        out.append(b"d" + _LEN.pack(len(obj)))
        for key, value in obj.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"cannot send a dict keyed by {type(key).__name__} to the comparison's process")
            _pack(key, out)
            _pack(value, out)
    elif isinstance(obj, np.ndarray):
        if obj.dtype.kind not in "biuf":
            raise TypeError(f"cannot send a numpy array of {obj.dtype} to the comparison's process")
        out.append(b"a")
        _blob(out, obj.dtype.str.encode())
        _pack(tuple(obj.shape), out)
        _blob(out, memoryview(np.ascontiguousarray(obj)).cast("B") if obj.size else b"")
    elif isinstance(obj, torch.Tensor):
        name = str(obj.dtype).removeprefix("torch.")
        if name not in _TORCH_DTYPES or obj.device.type != "cpu":
            raise TypeError(f"cannot send a {obj.dtype} tensor on {obj.device} to the comparison's process")
        out.append(b"x")
        _blob(out, name.encode())
        _pack(tuple(obj.shape), out)
        flat = obj.detach().contiguous().reshape(-1)
        _blob(out, memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else b"")
    elif isinstance(obj, Placed):
        name = str(obj.dtype).removeprefix("torch.")
        if name not in _TORCH_DTYPES:
            raise TypeError(f"cannot send a placed {obj.dtype} tensor to the comparison's process")
        out.append(b"P" + _INT.pack(obj.offset))
        _blob(out, name.encode())
        _pack(tuple(obj.shape), out)
    elif isinstance(obj, Start):
        out.append(b"S")
        _pack({f.name: getattr(obj, f.name) for f in fields(obj)}, out)
    else:
        raise TypeError(f"cannot send a {type(obj).__name__} to the comparison's process (drift/check/wire.py "
                        "lists what it takes)")


def _take(data: memoryview, at: int) -> tuple[memoryview, int]:
    (n,) = _LEN.unpack_from(data, at)
    at += _LEN.size
    return data[at:at + n], at + n


def _unpack(data: memoryview, at: int, placed=None):
    tag = bytes(data[at:at + 1])
    at += 1
    if tag == b"N":
        return None, at
    if tag in (b"T", b"F"):
        return tag == b"T", at
    if tag == b"i":
        return _INT.unpack_from(data, at)[0], at + _INT.size
    if tag == b"f":
        return _FLOAT.unpack_from(data, at)[0], at + _FLOAT.size
    if tag == b"s":
        raw, at = _take(data, at)
        return bytes(raw).decode(), at
    if tag in (b"t", b"l"):
        (n,) = _LEN.unpack_from(data, at)
        at += _LEN.size
        items = []
        for _ in range(n):
            item, at = _unpack(data, at, placed)
            items.append(item)
        return (tuple(items) if tag == b"t" else items), at
    if tag == b"d":
        (n,) = _LEN.unpack_from(data, at)
        at += _LEN.size
        out = {}
        for _ in range(n):
            key, at = _unpack(data, at, placed)
            out[key], at = _unpack(data, at, placed)
        return out, at
    if tag == b"a":
        dtype, at = _take(data, at)
        shape, at = _unpack(data, at)
        raw, at = _take(data, at)
        return np.frombuffer(raw, dtype=np.dtype(bytes(dtype).decode())).reshape(shape).copy(), at
    if tag == b"x":
        name, at = _take(data, at)
        shape, at = _unpack(data, at)
        raw, at = _take(data, at)
        dtype = _TORCH_DTYPES[bytes(name).decode()]
        if not len(raw):
            return torch.empty(shape, dtype=dtype), at
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape), at
    if tag == b"P":
        (offset,) = _INT.unpack_from(data, at)
        name, at = _take(data, at + _INT.size)
        shape, at = _unpack(data, at)
        if placed is None:
            raise ValueError(f"a placed tensor at byte {offset} of shared memory, and no shared memory to read it from")
        return placed(Placed(offset, _TORCH_DTYPES[bytes(name).decode()], shape)), at
    if tag == b"S":
        values, at = _unpack(data, at)
        return Start(**values), at
    raise ValueError(f"unknown tag {tag!r} at byte {at - 1}")
