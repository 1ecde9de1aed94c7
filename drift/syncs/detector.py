"""Host-device synchronisation detector for the update under test, usable on a CPU-only CI.

A sync happens whenever the host needs a value that lives on the device (docs/semantics.md
§8): ``.item()``, ``bool(t)``, ``float(t)``, ``int(t)``, ops whose output shape
depends on device data (boolean-mask indexing, ``nonzero``, ``masked_select``,
``unique`` ...), host reads (``.cpu()``, ``.tolist()``, ``.numpy()``, and formatting a tensor:
``str``, ``repr``, ``format``, f-strings) and blocking copies.

How it sees them without an accelerator
---------------------------------------
On CPU tensors most syncs are invisible (``.cpu()``, ``.tolist()``, ``.numpy()`` dispatch
nothing), so the code under test runs on a *virtual accelerator*: :class:`VirtualTensor`
reports the non-CPU device ``meta`` and carries real CPU data. A ``TorchDispatchMode``
stacked on top sees every op, classifies it (:func:`sync_reasons`), records the Python
line that caused it and runs it on the CPU data. Control flow therefore follows the real
values and the call runs to its end, so every sync of a call is reported, not only the
first. (``FakeTensorMode`` on a fake ``cuda`` device cannot serve here: it raises at the
first data-dependent op, and a CPU-only torch has no cuda device guard; ``meta`` is the
non-CPU device every build has one for.) A ``TorchFunctionMode`` names the Python-level
call behind each op (``Tensor.item``, ``Tensor.__bool__`` ...) and catches the host reads
that dispatch no op (``.tolist()``, ``.numpy()``, ``__array__``) and host data turned
into a device tensor (``torch.tensor(data, device=...)``). Formatting dispatches no op either: a
virtual tensor prints only its metadata and records each ``repr`` / ``format`` of itself as a host
read in the detector watching (:func:`_formatted`), as the real tensor's repr copies its values.

On a machine with CUDA, ``torch.cuda.set_sync_debug_mode("error")`` is armed around each
call (and restored after: the mode is process-global); with ``torch_npu`` its twin
``torch.npu.set_sync_debug_mode("error")``. They only see work on real device tensors
(:func:`drift.syncs.scan.scan_update` adds a pass on the accelerator when one is present), and they stop
the call at its first sync. Every report lists the detectors that ran.

Without torch's private dispatch API
------------------------------------
The dispatch mode needs three private torch symbols (``TorchDispatchMode``,
``Tensor._make_wrapper_subclass``, ``torch._C._disabled_torch_function_impl``), imported in
:mod:`drift.compat`. On a torch that lacks one of them (:data:`drift.compat.DISPATCH_DETECTOR`
False) the detector is the public ``TorchFunctionMode`` alone (:data:`DETECTOR_FUNCTION`, named
in every report): :class:`VirtualTensor` is then a plain tensor subclass whose
``__torch_function__`` runs each call on the CPU data and reports the device ``meta``, and the
mode classifies the *Python-level* call (:func:`function_sync_reasons`): scalar reads
(``.item()``, ``bool()``, ``int()``, ``float()``, ``__index__``), host reads (``.tolist()``,
``.numpy()``, ``__array__``, ``.cpu()``, ``.to("cpu")``), data-dependent shapes (``nonzero``,
one-argument ``where``, ``masked_select``, ``unique``, ``bincount``, ``repeat_interleave`` without
``output_size``, boolean-mask indexing), host bools (``equal``, ``allclose``), 0-dim tensor
indices and ``narrow`` lengths, host-to-device copies and host operands. Events name the Python
call (``Tensor.item``) instead of the aten op; ops and bytes count Python calls (views: outputs
sharing an input's storage), so cost-model numbers compare only within one detector.

Each :class:`SyncEvent` names the op and the ``file:line`` in the code under test: the
innermost Python frame at dispatch time that is neither torch's nor this module's.
drift's portable kernels (``drift/sim/kernels.py``) are code under test like any other.
"""

from __future__ import annotations

import contextlib
import functools
import linecache
import os
import re
import sys
import types
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch.overrides import TorchFunctionMode

from ..compat import (DISPATCH_DETECTOR, MISSING_PRIVATE, TorchDispatchMode, disabled_torch_function_impl,
                      make_wrapper_subclass, tree_leaves, tree_map)
from ..devices import npu_available
from ..errors import code_frames, display_path


VIRTUAL_DEVICE = torch.device("meta")
_HOST = torch.device("cpu")

# Detector names, as reports list them. The dispatch mode watches virtual and real accelerator tensors.
DETECTOR_DISPATCH = "dispatch mode"
# The fallback on a torch without the private dispatch API (drift.compat), and the one that runs here.
_LACKING = [n for n in MISSING_PRIVATE if n.endswith(("TorchDispatchMode", "_make_wrapper_subclass",
                                                      "_disabled_torch_function_impl"))]
DETECTOR_FUNCTION = ("function mode (fallback: this torch lacks " + (", ".join(_LACKING) or "nothing") + ")")
DETECTOR_VIRTUAL = DETECTOR_DISPATCH if DISPATCH_DETECTOR else DETECTOR_FUNCTION
DETECTOR_CUDA = 'torch.cuda sync debug mode "error"'
DETECTOR_NPU = 'torch.npu sync debug mode "error"'
# The messages the two debug modes raise with (c10 "called a synchronizing CUDA operation",
# torch_npu "called a synchronizing NPU operation").
_DEBUG_MODE_ERROR = re.compile(r"called a synchronizing (CUDA|NPU) operation")

# ---------------------------------------------------------------- classification
_SCALAR_READ = {
    "_local_scalar_dense": "reads a device value on the host (.item(), bool(), float(), int(), "
                           "0-dim tensor index)",
    "is_nonzero": "reads a device value on the host (bool())",
    "equal": "returns a host bool computed from device data",
    "allclose": "returns a host bool computed from device data",
}
_DYNAMIC_SHAPE = {
    name: "output shape depends on device data (the host waits for it)"
    for name in ("nonzero", "argwhere", "nonzero_numpy", "masked_select", "_unique", "_unique2",
                 "unique_dim", "unique_consecutive", "unique_dim_consecutive", "bincount")
}
_MASK_INDEX_OPS = ("index", "_unsafe_index", "index_put", "index_put_", "_index_put_impl_",
                   "_unsafe_index_put")
_HOST_READ_FUNCS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__}
_HOST_DATA_FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray}


class VirtualDeviceError(RuntimeError):
    """The code under test did something the virtual device cannot follow."""


# The detectors whose modes are entered, innermost last: where formatting a virtual tensor (which
# dispatches no op) reports itself (:func:`_formatted`).
_WATCHING: list["SyncDetector"] = []
# str(), repr(), format() and f-strings of a device tensor print its values: torch's _tensor_str
# copies the data to the host first (torch/_tensor_str.py: _str_intern; Tensor.__format__ of a 0-dim
# tensor calls .item()). Only metadata (t.shape, t.dtype, t.device) formats without one.
_FORMAT_READ = "host read of device data: formatting a tensor (str, repr, format, f-string) copies its values"


def _formatted(api: str) -> None:
    """Record formatting a virtual tensor (``api``: Tensor.__repr__ or Tensor.__format__) as a host
    read in the innermost watching detector, unless inside another host read (part of its event)."""
    if _WATCHING and not _WATCHING[-1]._reads:
        _WATCHING[-1]._record(api, api, _FORMAT_READ)


def _virtual_repr(self) -> str:
    """repr / str of a virtual tensor: its metadata, never its data; under a detector a host read,
    as the real tensor's repr is."""
    _formatted("Tensor.__repr__")
    inner = self._inner
    return f"VirtualTensor(shape={tuple(inner.shape)}, dtype={inner.dtype})"


def _virtual_format(self, spec: str) -> str:
    """format() / f-strings of a virtual tensor: under a detector a host read; a 0-dim tensor formats
    its value (as Tensor.__format__, through .item()), another its repr (without a second event)."""
    _formatted("Tensor.__format__")
    inner = self._inner
    if inner.dim() == 0 and inner.device.type == "cpu":
        return format(inner.tolist(), spec)
    return format(f"VirtualTensor(shape={tuple(inner.shape)}, dtype={inner.dtype})", spec)


def _is_device(x: Any) -> bool:
    """A tensor on the (virtual or real) accelerator."""
    return isinstance(x, VirtualTensor) or (isinstance(x, torch.Tensor) and x.device.type not in ("cpu", "meta"))


def _is_host(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and not isinstance(x, VirtualTensor) and x.device.type == "cpu"


def _device_kind(dev: Any) -> Optional[str]:
    """'virtual', 'host', 'device' (a real accelerator) or None for a ``device=`` argument."""
    if dev is None:
        return None
    kind = torch.device(dev).type
    return {"meta": "virtual", "cpu": "host"}.get(kind, "device")


def op_name(func) -> str:
    """``aten.nonzero`` for a default overload, ``aten.index.Tensor`` otherwise."""
    ns, name = func.name().split("::", 1)
    return f"{ns}.{name}"


_GATHERS = ("aten.index.Tensor", "aten.index_select", "aten.gather", "aten.take")
_SCATTERS = ("aten.index_put", "aten._index_put_impl", "aten.index_copy", "aten.scatter", "aten.index_add")


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def op_bytes(func, ins: list, outs: list) -> int:
    """Bytes an op moves, from shapes: an indexed read moves what it gathers (read + write of
    the result) and its indices; an indexed write moves its values (read + write in place)
    and its indices; any other op reads its inputs and writes its new outputs."""
    name = op_name(func)
    index = [t for t in ins[1:] if not t.is_floating_point() and not t.is_complex()]
    if name.startswith(_GATHERS):
        return 2 * _nbytes(outs) + _nbytes(index)
    if name.startswith(_SCATTERS):
        values = [t for t in ins[1:] if t.is_floating_point() or t.is_complex()]
        return 2 * _nbytes(values) + _nbytes(index)
    return _nbytes(ins) + _nbytes(outs)


_D2H = "device-to-host copy: the host waits for the data"
_H2D = "blocking host-to-device copy"


def _conversion_reasons(src, target: str, kwargs: dict) -> list[str]:
    """Why a conversion of ``src`` (``.to`` / ``_to_copy``) to a ``target`` device kind syncs: a
    device-to-host read, or a blocking host-to-device copy of more than a scalar."""
    if _is_device(src) and target == "host":
        return [_D2H]
    if _is_host(src) and src.dim() > 0 and target in ("virtual", "device") and not kwargs.get("non_blocking"):
        return [_H2D]
    return []


def _copy_into_reasons(args: tuple, kwargs: dict) -> list[str]:
    """Why ``dst.copy_(src[, non_blocking])`` syncs (the same two cases)."""
    dst, src = args[0], args[1]
    if _is_host(dst) and _is_device(src):
        return [_D2H]
    if _is_device(dst) and _is_host(src) and src.dim() > 0 and not (args[2:3] and args[2]) \
            and not kwargs.get("non_blocking"):
        return [_H2D]
    return []


def sync_reasons(func, args: tuple, kwargs: dict) -> list[str]:
    """Why dispatching ``func(*args, **kwargs)`` synchronises host and device (empty: it does not).

    Applies to device tensors (:class:`VirtualTensor` or a real accelerator tensor); host
    tensors are the host's own business. A blocking copy from a 0-dim host tensor is not
    flagged (CUDA turns it into a fill), a ``non_blocking=True`` one neither.
    """
    name = func.overloadpacket.__name__
    flat = tree_leaves((args, kwargs))
    dev_in = any(_is_device(x) for x in flat)
    target = _device_kind(kwargs.get("device"))
    if name == "_to_copy":
        return _conversion_reasons(args[0], target, kwargs)
    if name == "copy_":
        return _copy_into_reasons(args, kwargs)
    if not dev_in:
        return []
    out = []
    if name in _SCALAR_READ:
        out.append(_SCALAR_READ[name])
    elif name in _DYNAMIC_SHAPE:
        out.append(_DYNAMIC_SHAPE[name])
    elif name == "repeat_interleave" and kwargs.get("output_size") is None:
        out.append("repeat_interleave without output_size: output shape depends on device data")
    elif name in _MASK_INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
            out.append("boolean-mask indexing: an internal nonzero, output shape depends on device data")
    if any(_is_host(x) and x.dim() > 0 for x in flat):
        out.append("host tensor operand: an implicit blocking host-to-device copy on an accelerator "
                   "(or a device-mismatch error)")
    return out


# ------------------------------------------------------------ virtual tensors
def _check_inner(inner: Any) -> None:
    if not isinstance(inner, torch.Tensor) or isinstance(inner, VirtualTensor) \
            or inner.device.type not in ("cpu", "meta"):
        raise TypeError(f"VirtualTensor wraps a plain CPU (or shape-only meta) tensor, got "
                        f"{type(inner).__name__} on {getattr(inner, 'device', '?')}")


if DISPATCH_DETECTOR:
    class VirtualTensor(torch.Tensor):
        """A tensor on the virtual accelerator: reports device ``meta``, holds CPU data in ``_inner``.

        Shape, strides, dtype and storage offset are those of the CPU tensor; views share its
        storage, so writes in place through any view land in the same memory. Reading the data
        on the host is a sync, so ``repr`` shows only the metadata. A *shape-only* virtual tensor
        holds a meta tensor instead (no data: for counting ops and bytes); an op touching one
        runs on meta, and one that needs its values raises :class:`VirtualDeviceError`.
        """

        _inner: torch.Tensor

        @staticmethod
        def __new__(cls, inner: torch.Tensor):
            _check_inner(inner)
            out = make_wrapper_subclass(
                cls, inner.size(), strides=inner.stride(), storage_offset=inner.storage_offset(),
                dtype=inner.dtype, device=VIRTUAL_DEVICE, requires_grad=False)
            out._inner = inner
            return out

        __torch_function__ = disabled_torch_function_impl

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            return _execute(func, args, kwargs or {})  # outside a detector: run, record nothing

        __repr__ = _virtual_repr  # never reads the data; under a detector, a host read
        __format__ = _virtual_format
else:
    class VirtualTensor(torch.Tensor):  # type: ignore[no-redef]
        """A tensor on the virtual accelerator (the fallback without torch's dispatch API): a
        plain subclass aliasing the CPU (or shape-only meta) tensor ``_inner``; every torch call
        on it runs on ``_inner`` (:func:`_call_virtual`) with tensor results wrapped again, and
        ``.device`` reports ``meta``. ``repr`` shows only the metadata."""

        _inner: torch.Tensor

        @staticmethod
        def __new__(cls, inner: torch.Tensor):
            _check_inner(inner)
            out = inner.as_subclass(cls)
            out._inner = inner
            out._meta = (tuple(inner.shape), inner.stride())
            return out

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return _call_virtual(func, args, kwargs or {})  # outside a detector: run, record nothing

        __repr__ = _virtual_repr  # never reads the data; under a detector, a host read
        __format__ = _virtual_format


def to_virtual(tree: Any) -> Any:
    """Every CPU tensor in ``tree`` (a tensor, or lists/tuples/dicts of them) moved onto the
    virtual device, sharing its storage; other leaves unchanged."""
    return tree_map(lambda x: VirtualTensor(x) if _is_host(x) else x, tree)


def host_data(t: torch.Tensor) -> torch.Tensor:
    """The CPU tensor behind a :class:`VirtualTensor` (for tests and setup; not a recorded sync)."""
    if not isinstance(t, VirtualTensor):
        raise TypeError(f"host_data expects a VirtualTensor, got {type(t).__name__}")
    return t._inner


def _unwrapper(op: str, by_inner: dict, meta_device_to_host: bool):
    """The leaf map that runs an op on the host: a virtual tensor becomes its CPU data (recorded
    in ``by_inner`` by the data's id, to wrap outputs back); a plain meta tensor is an error
    naming ``op``; with ``meta_device_to_host`` a ``torch.device('meta')`` argument becomes the host."""
    def unwrap(x):
        if isinstance(x, VirtualTensor):
            by_inner[id(x._inner)] = x
            return x._inner
        if isinstance(x, torch.Tensor) and x.device.type == "meta":
            raise VirtualDeviceError(
                f"{op} got a plain meta tensor next to virtual-device tensors: the code "
                "under test created a device tensor in a way the virtual device cannot follow. "
                "Create it with a factory op (torch.empty/zeros/arange(..., device=t.device)) or "
                "from another device tensor.")
        if meta_device_to_host and isinstance(x, torch.device) and x.type == "meta":
            return _HOST
        return x

    return unwrap


def _run_unwrapped(func, op: str, cargs, ckwargs, to_meta):
    """``func`` on the host data of its operands; when one is shape-only (meta), on meta instead,
    with the operands ``to_meta`` maps there (shapes and dtypes only)."""
    if not any(isinstance(x, torch.Tensor) and x.device.type == "meta" for x in tree_leaves((cargs, ckwargs))):
        return func(*cargs, **ckwargs)
    cargs, ckwargs = to_meta((cargs, ckwargs))
    try:
        return func(*cargs, **ckwargs)
    except (RuntimeError, NotImplementedError) as exc:
        raise VirtualDeviceError(
            f"{op} needs the values of a shape-only tensor ({exc}); the code under "
            "test reads state data, so count it with real data (shape_only=False)") from exc


def _execute(func, args: tuple, kwargs: dict):
    """Run ``func`` on the CPU data of virtual operands; outputs are virtual unless the op
    targets the host (``device='cpu'``) or returns a host operand (``copy_`` into it)."""
    target = _device_kind(kwargs.get("device"))
    flat = tree_leaves((args, kwargs))
    virtual = target == "virtual" or any(isinstance(x, VirtualTensor) for x in flat)
    if not virtual:
        return func(*args, **kwargs)
    by_inner: dict[int, VirtualTensor] = {}
    unwrap = _unwrapper(op_name(func), by_inner, meta_device_to_host=False)
    cargs, ckwargs = tree_map(unwrap, (args, kwargs))
    if target == "virtual":
        ckwargs["device"] = _HOST

    def to_meta(args_kwargs):
        cargs, ckwargs = tree_map(lambda x: x.to(VIRTUAL_DEVICE) if _is_host(x) else x, args_kwargs)
        if target == "virtual":
            ckwargs["device"] = VIRTUAL_DEVICE
        return cargs, ckwargs

    out = _run_unwrapped(func, op_name(func), cargs, ckwargs, to_meta)
    to_host = target == "host"

    def wrap(o):
        if not isinstance(o, torch.Tensor):
            return o
        vt = by_inner.get(id(o))
        if vt is not None:  # in place or out=: the caller's own tensor
            if vt.shape != o.shape or vt.stride() != o.stride():
                raise VirtualDeviceError(f"{op_name(func)} changed a tensor's shape or strides in place; "
                                         "the virtual device does not support that (use the out-of-place op)")
            return vt
        if to_host or o.device.type not in ("cpu", "meta") or any(o is x for x in flat):
            return o
        return VirtualTensor(o)

    return tree_map(wrap, out)


# ------------------------------------------------- the fallback (TorchFunctionMode only)
def _getter(name: str) -> Any:
    return getattr(torch.Tensor, name).__get__


_DEVICE_GETTERS = {"device": (_getter("device"), VIRTUAL_DEVICE), "is_meta": (_getter("is_meta"), True),
                   "is_cpu": (_getter("is_cpu"), False)}
# Python-level calls that answer from metadata: neither syncs nor counted as ops.
_METADATA_CALLS = {"__get__", "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset",
                   "is_contiguous", "is_floating_point", "is_complex", "is_signed", "element_size", "data_ptr",
                   "untyped_storage", "get_device", "__len__", "__hash__",
                   "as_subclass", "__reduce_ex__", "__deepcopy__", "__setstate__"}
# Formatting: a host read, recorded where it lands (VirtualTensor.__repr__, :func:`_formatted`), not
# counted as an op.
_FORMAT_CALLS = {"__repr__", "__format__", "__str__"}
_F_SCALAR_READ = {"item", "__bool__", "__int__", "__float__", "__index__", "__complex__", "__contains__",
                  "_local_scalar_dense", "is_nonzero"}
_F_HOST_BOOL = {"equal", "allclose"}
_F_HOST_READ = {"tolist", "numpy", "__array__"}
_F_DYNAMIC = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount", "_unique",
              "_unique2"}
_F_COPIES = {"to", "cpu", "cuda", "npu"}
_F_FACTORIES = {"tensor", "as_tensor", "asarray"}


def _fn_name(func) -> str:
    return getattr(func, "__name__", "") or ""


def _call_target(func, args: tuple, kwargs: dict) -> Optional[str]:
    """Where a call puts its result: 'virtual', 'host', 'device' or None (with its inputs);
    from ``device=``, or ``.cpu()`` / ``.cuda()`` / ``.to(device | tensor)``."""
    name = _fn_name(func)
    dev = kwargs.get("device")
    if name == "cpu":
        return "host"
    if name in ("cuda", "npu"):
        return "device"
    if name == "to" and dev is None:
        for a in args[1:]:
            if isinstance(a, (str, torch.device)):
                dev = a
                break
            if isinstance(a, torch.Tensor):
                return "virtual" if isinstance(a, VirtualTensor) else _device_kind(a.device)
    return _device_kind(dev)


def function_sync_reasons(func, args: tuple, kwargs: dict) -> list[str]:
    """Why the Python-level call ``func(*args, **kwargs)`` synchronises host and device (the
    fallback detector's :func:`sync_reasons`; empty: it does not)."""
    name = _fn_name(func)
    flat = tree_leaves((args, kwargs))
    target = _call_target(func, args, kwargs)
    if name in _F_COPIES:
        return _conversion_reasons(args[0] if args else None, target, kwargs)
    if name == "copy_":
        return _copy_into_reasons(args, kwargs)
    if name in _F_FACTORIES and target in ("virtual", "device"):
        data = args[0] if args else kwargs.get("data")
        if not isinstance(data, torch.Tensor):
            return ["blocking host-to-device copy of host data"]
        return ["blocking host-to-device copy"] if _is_host(data) and data.dim() > 0 else []
    if not any(_is_device(x) for x in flat):
        return []
    out = []
    if name in _F_SCALAR_READ:
        out.append(_SCALAR_READ["_local_scalar_dense"])
    elif name in _F_HOST_BOOL:
        out.append(_SCALAR_READ["equal"])
    elif name in _F_HOST_READ:
        out.append("host read of device data (a device-to-host copy)")
    elif name in _F_DYNAMIC or (name == "where" and len(args) + len(kwargs) == 1):
        out.append(_DYNAMIC_SHAPE["nonzero"])
    elif name == "repeat_interleave" and kwargs.get("output_size") is None \
            and (len(args) == 1 or isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor)):
        out.append("repeat_interleave without output_size: output shape depends on device data")
    elif name in ("__getitem__", "__setitem__", "index_put_", "index_put", "index"):
        index = args[1] if len(args) > 1 else kwargs.get("indices", ())
        parts = list(index) if isinstance(index, (tuple, list)) else [index]
        tensors = [i for i in parts if isinstance(i, torch.Tensor)]
        if any(i.dtype in (torch.bool, torch.uint8) for i in tensors):
            out.append("boolean-mask indexing: an internal nonzero, output shape depends on device data")
        elif name in ("__getitem__", "__setitem__") and any(_is_device(i) and i.dim() == 0 for i in tensors):
            out.append(_SCALAR_READ["_local_scalar_dense"])
    elif name == "narrow" and any(_is_device(x) for x in args[2:]):
        out.append(_SCALAR_READ["_local_scalar_dense"])
    if any(_is_host(x) and x.dim() > 0 for x in flat):
        out.append("host tensor operand: an implicit blocking host-to-device copy on an accelerator "
                   "(or a device-mismatch error)")
    return out


def _call_virtual(func, args: tuple, kwargs: dict):
    """The fallback's :func:`_execute`: run a Python-level torch call on the CPU data of its
    virtual operands (the virtual device read as the CPU); tensor results are virtual unless the
    call targets the host or returns a host operand."""
    name = _fn_name(func)
    if name == "__get__" and args and isinstance(args[0], VirtualTensor):
        for getter, value in _DEVICE_GETTERS.values():
            if func == getter:
                return value
    if name == "__format__" and args and isinstance(args[0], VirtualTensor):
        return object.__format__(args[0], *args[1:])  # repr, never the data (as torch for subclasses)
    target = _call_target(func, args, kwargs)
    flat = tree_leaves((args, kwargs))
    if not (target == "virtual" or any(isinstance(x, VirtualTensor) for x in flat)):
        return func(*args, **kwargs)
    by_inner: dict[int, VirtualTensor] = {}
    unwrap = _unwrapper(_api_name(func), by_inner, meta_device_to_host=True)
    cargs, ckwargs = tree_map(unwrap, (list(args), dict(kwargs)))
    if _device_kind(ckwargs.get("device")) == "virtual":
        ckwargs["device"] = _HOST
    if name == "to":
        cargs = [_HOST if isinstance(a, str) and _device_kind(a) == "virtual" else a for a in cargs]

    def to_meta(args_kwargs):
        return tree_map(lambda x: x.to(VIRTUAL_DEVICE) if _is_host(x) else
                        (VIRTUAL_DEVICE if isinstance(x, torch.device) and x == _HOST else x), args_kwargs)

    out = _run_unwrapped(func, _api_name(func), cargs, ckwargs, to_meta)
    if name == "__iter__":
        out = list(out)

    def wrap(o):
        if not isinstance(o, torch.Tensor):
            return o
        vt = by_inner.get(id(o))
        if target == "host":  # .cpu() / .to("cpu"): a copy, never the device tensor's own memory
            return o.clone() if vt is not None else o
        if vt is not None:  # in place or out=: the caller's own tensor
            if (tuple(o.shape), o.stride()) != vt._meta:
                raise VirtualDeviceError(f"{_api_name(func)} changed a tensor's shape or strides in place; "
                                         "the virtual device does not support that (use the out-of-place op)")
            return vt
        if any(o is x for x in flat):  # a host operand returned (copy_ into it, .to() to its own device)
            return VirtualTensor(o.clone()) if target == "virtual" else o
        if o.device.type not in ("cpu", "meta"):
            return o
        return VirtualTensor(o)

    out = tree_map(wrap, out)
    return iter(out) if name == "__iter__" else out


# ---------------------------------------------------------------------- events
_INTERNAL_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch,))
_THIS_FILE = os.path.normcase(os.path.abspath(__file__))


def _is_internal(filename: str) -> bool:
    """torch's (and torch_npu's) own frames and this detector's: skipped when locating a sync."""
    if filename.startswith(_INTERNAL_DIRS) or os.path.normcase(os.path.abspath(filename)) == _THIS_FILE:
        return True
    npu = sys.modules.get("torch_npu")
    return npu is not None and filename.startswith(os.path.dirname(npu.__file__) + os.sep)


@dataclass(frozen=True)
class SyncEvent:
    """One host-device synchronisation.

    op: the dispatched aten op (``aten._local_scalar_dense``) or the Python host read
    (``Tensor.tolist``); api: the Python call that led to it (``Tensor.item``) or "".
    file/line/function/code: the innermost frame of the code under test. stack: that frame
    and its callers inside the call, ``path:line in function``, innermost first.
    label: the caller's tag of the call (e.g. ``step 3``). seen_by: detectors that flagged it.
    """

    op: str
    api: str
    reason: str
    file: str
    line: int
    function: str
    code: str
    stack: tuple[str, ...] = ()
    label: str = ""
    seen_by: tuple[str, ...] = (DETECTOR_VIRTUAL,)

    @property
    def where(self) -> str:
        return f"{display_path(self.file)}:{self.line}"

    def describe(self) -> str:
        api = f" ({self.api})" if self.api and self.api != self.op else ""
        return f"{self.op}{api} at {self.where} in {self.function}"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["where"] = self.where
        d["stack"] = list(self.stack)
        d["seen_by"] = list(self.seen_by)
        return d


@dataclass
class SyncReport:
    """Everything one :class:`SyncDetector` saw.

    events: every sync, in order. detectors: those that ran. devices: device types the
    watched ops touched (``virtual`` for the virtual accelerator). ops / view_ops: dispatched
    aten ops (views included / views only). bytes: for every non-view op, the bytes of its
    tensor inputs plus those of its outputs that are not one of its inputs -- a shape-based
    upper bound on the memory it touches. stopped: calls a debug mode cut short at a sync.
    """

    events: list[SyncEvent] = field(default_factory=list)
    detectors: list[str] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)
    calls: int = 0
    ops: int = 0
    view_ops: int = 0
    bytes: int = 0
    stopped: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.events)

    @property
    def clean(self) -> bool:
        return not self.events

    def by_label(self) -> dict[str, list[SyncEvent]]:
        out: dict[str, list[SyncEvent]] = {}
        for e in self.events:
            out.setdefault(e.label, []).append(e)
        return out

    def format(self, limit: int = 20) -> str:
        head = (f"{len(self.events)} host-device sync(s) in {self.calls} call(s); detectors: "
                f"{'; '.join(self.detectors) or 'none'}")
        lines = [head]
        for e in self.events[:limit]:
            tag = f"[{e.label}] " if e.label else ""
            lines.append(f"  {tag}{e.describe()}: {e.code}  -- {e.reason}")
        if len(self.events) > limit:
            lines.append(f"  ... {len(self.events) - limit} more")
        lines += [f"  stopped: {s}" for s in self.stopped]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"syncs": len(self.events), "calls": self.calls, "ops": self.ops, "view_ops": self.view_ops,
                "bytes": self.bytes, "detectors": list(self.detectors), "devices": list(self.devices),
                "stopped": list(self.stopped), "events": [e.to_dict() for e in self.events]}


# -------------------------------------------------------------------- detector
def _api_name(func) -> str:
    qual = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    for prefix, repl in (("TensorBase.", "Tensor."), ("_VariableFunctionsClass.", "torch."),
                         ("_TensorBase.", "Tensor.")):
        if qual.startswith(prefix):
            return repl + qual[len(prefix):]
    mod = getattr(func, "__module__", "") or ""
    return f"torch.{qual}" if mod.startswith("torch") and "." not in qual else qual


class _BoundMode:
    """A torch mode that reports to its detector."""

    def __init__(self, det: "SyncDetector"):
        super().__init__()
        self.det = det


class _FunctionMode(_BoundMode, TorchFunctionMode):
    """Names the Python call behind each op; records host reads that dispatch nothing."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        det = self.det
        if func in _HOST_READ_FUNCS and args and _is_device(args[0]):
            name = _api_name(func)
            det._reads.append(len(det.report.events))  # ops inside are this read's: not recorded again
            det._record(name, name, "host read of device data (a device-to-host copy)")
            try:
                if isinstance(args[0], VirtualTensor):
                    return func(args[0]._inner, *args[1:], **kwargs)
                return func(*args, **kwargs)
            finally:
                det._reads.pop()
        if func in _HOST_DATA_FACTORIES and _device_kind(kwargs.get("device")) == "virtual" \
                and not (args and isinstance(args[0], torch.Tensor)):
            name = _api_name(func)
            det._record(name, name, "blocking host-to-device copy of host data")
            return VirtualTensor(func(*args, **{**kwargs, "device": _HOST}))
        det._api.append(_api_name(func))
        try:
            return func(*args, **kwargs)
        finally:
            det._api.pop()


if TorchDispatchMode is not None:
    class _DispatchMode(_BoundMode, TorchDispatchMode):
        """Counts every op, records the syncing ones, runs virtual ops on their CPU data."""

        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            """False: torch's ``__init_subclass__`` would wrap ``__torch_dispatch__`` in
            ``torch._disable_dynamo``, whose first call imports torch._dynamo (a third of the scan's
            time). The detector is never compiled: there is nothing for the wrap to disable."""
            return False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            det = self.det
            reasons = [] if det._reads else sync_reasons(func, args, kwargs)
            first = det._reads[-1] if det._reads else len(det.report.events)
            for reason in reasons:
                det._record(op_name(func), det._api[-1] if det._api else "", reason)
            try:
                out = _execute(func, args, kwargs)
            except RuntimeError as exc:
                debug = _DEBUG_MODE_ERROR.search(str(exc))
                if debug:
                    det._flag_debug(op_name(func), debug.group(1), first)
                raise
            det._count(func, args, kwargs, out)
            return out


class _FallbackMode(_BoundMode, TorchFunctionMode):
    """The detector without torch's dispatch API: classifies each Python-level torch call
    (:func:`function_sync_reasons`), runs it on the CPU data (:func:`_call_virtual`), counts it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _fn_name(func) in _METADATA_CALLS or _fn_name(func) in _FORMAT_CALLS:
            return _call_virtual(func, args, kwargs)
        det = self.det
        api = _api_name(func)
        first = len(det.report.events)
        for reason in function_sync_reasons(func, args, kwargs):
            det._record(api, api, reason)
        try:
            out = _call_virtual(func, args, kwargs)
        except RuntimeError as exc:
            debug = _DEBUG_MODE_ERROR.search(str(exc))
            if debug:
                det._flag_debug(api, debug.group(1), first)
            raise
        det._count_call(args, kwargs, out)
        return out


class SyncDetector:
    """Runs callables and reports every host-device sync they cause.

    As a context manager the ``with`` block is the watched call; or call :meth:`run`.
    Tensors must be on the virtual device (:func:`to_virtual`, :func:`virtual_harness`) or
    a real accelerator to be watched; host tensors are not. Set :attr:`label` to tag the
    events of the next calls (e.g. ``"step 3"``). ``device_debug``: arm the CUDA / NPU sync
    debug mode ("error") around each call when that backend is present.

    >>> det = SyncDetector()
    >>> t = to_virtual(torch.arange(4))
    >>> det.run(lambda: t.sum().item())
    6
    >>> det.report.events[0].op
    'aten._local_scalar_dense'
    """

    def __init__(self, device_debug: bool = True, stack_limit: int = 8):
        self.report = SyncReport()
        self.label = ""
        self.stack_limit = stack_limit
        self._api: list[str] = []
        self._reads: list[int] = []  # open host reads (.tolist() ...): index of their event
        self._flagged = False  # a debug-mode error was already recorded at its op
        self._boundary: Optional[types.FrameType] = None
        self._modes: Optional[contextlib.ExitStack] = None
        self._debug = _debug_backends() if device_debug else []
        self.report.detectors = [DETECTOR_VIRTUAL] + [name for name, _ in self._debug]

    # ---------------------------------------------------------------- entry
    def __enter__(self) -> "SyncDetector":
        self._boundary = sys._getframe(1)
        self._enter_modes()
        self._armed = _armed(self._debug)
        self._armed.__enter__()
        self.report.calls += 1
        self._flagged = False
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            self._armed.__exit__(None, None, None)
        finally:
            self._exit_modes()
            self._boundary = None
        return exc is not None and self._debug_stop(exc)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` watched; returns its result (None when a debug mode stopped it)."""
        outer, own = self._boundary, self._modes is None
        self._boundary = sys._getframe(0)
        if own:
            self._enter_modes()
        self.report.calls += 1
        self._flagged = False
        try:
            with _armed(self._debug):
                return fn(*args, **kwargs)
        except RuntimeError as exc:
            if self._debug_stop(exc):
                return None
            raise
        finally:
            if own:
                self._exit_modes()
            self._boundary = outer

    def _enter_modes(self) -> None:
        stack = contextlib.ExitStack()
        if DISPATCH_DETECTOR:
            stack.enter_context(_FunctionMode(self))
            stack.enter_context(_DispatchMode(self))
        else:
            stack.enter_context(_FallbackMode(self))
        _WATCHING.append(self)
        stack.callback(_WATCHING.remove, self)
        self._modes = stack

    def _exit_modes(self) -> None:
        if self._modes is not None:
            self._modes.close()
            self._modes = None

    # ------------------------------------------------------------- recording
    def _stack(self, start: Optional[types.FrameType] = None) -> list[tuple[str, int, str]]:
        return code_frames(start if start is not None else sys._getframe(1), _is_internal, self._boundary,
                           self.stack_limit)

    def _event(self, op: str, api: str, reason: str, frames: list[tuple[str, int, str]],
               seen_by: tuple[str, ...]) -> SyncEvent:
        if not frames:
            return SyncEvent(op, api, reason, "<unknown>", 0, "", "", (), self.label, seen_by)
        fn, line, func = frames[0]
        stack = tuple(f"{display_path(p)}:{n} in {c}" for p, n, c in frames)
        return SyncEvent(op, api, reason, fn, line, func, linecache.getline(fn, line).strip(), stack,
                         self.label, seen_by)

    def _record(self, op: str, api: str, reason: str) -> None:
        self.report.events.append(self._event(op, api, reason, self._stack(), (DETECTOR_VIRTUAL,)))

    def _flag_debug(self, op: str, backend: str, first: int) -> None:
        """A debug mode raised inside ``op``: confirm the events recorded for it from index
        ``first`` on (the op's own, or the host read it belongs to), or add one."""
        name = DETECTOR_CUDA if backend == "CUDA" else DETECTOR_NPU
        ev = self.report.events
        if len(ev) > first:
            ev[first:] = [replace(e, seen_by=e.seen_by + (name,)) for e in ev[first:]]
        else:
            ev.append(self._event(op, self._api[-1] if self._api else "",
                                  f"flagged by {name}", self._stack(), (name,)))
        self._flagged = True

    def _debug_stop(self, exc: BaseException) -> bool:
        """True when ``exc`` is a debug mode's sync error (recorded; the call stops there)."""
        m = _DEBUG_MODE_ERROR.search(str(exc)) if isinstance(exc, RuntimeError) else None
        if not m:
            return False
        if not self._flagged:  # raised outside any dispatched op
            tb = exc.__traceback__
            frames = []
            while tb is not None:
                frames.append(tb.tb_frame)
                tb = tb.tb_next
            start = next((f for f in reversed(frames) if not _is_internal(f.f_code.co_filename)), None)
            name = DETECTOR_CUDA if m.group(1) == "CUDA" else DETECTOR_NPU
            self.report.events.append(self._event("(outside dispatch)", "", f"flagged by {name}",
                                                  self._stack(start) if start else [], (name,)))
        self._flagged = False
        self.report.stopped.append(f"{self.label or 'call'}: {m.group(0)}")
        return True

    def _count(self, func, args: tuple, kwargs: dict, out: Any) -> None:
        rep = self.report
        rep.ops += 1
        flat_in = tree_leaves((args, kwargs))
        for x in flat_in:
            if isinstance(x, torch.Tensor):
                kind = "virtual" if isinstance(x, VirtualTensor) else x.device.type
                if kind not in rep.devices:
                    rep.devices.append(kind)
        if func.is_view:
            rep.view_ops += 1
            return
        ins = [x for x in flat_in if isinstance(x, torch.Tensor)]
        outs = [o for o in tree_leaves(out)
                if isinstance(o, torch.Tensor) and not any(o is x for x in ins)]
        rep.bytes += op_bytes(func, ins, outs)

    def _count_call(self, args: tuple, kwargs: dict, out: Any) -> None:
        """The fallback's :meth:`_count`: one op per Python-level call touching a device tensor;
        a view when every new output shares an input's storage."""
        rep = self.report
        flat_in = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        flat_out = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor)]
        if not any(_is_device(x) for x in flat_in + flat_out):
            return
        rep.ops += 1
        for x in flat_in:
            kind = "virtual" if isinstance(x, VirtualTensor) else x.device.type
            if kind not in rep.devices:
                rep.devices.append(kind)

        def plain(x: torch.Tensor) -> torch.Tensor:
            return x._inner if isinstance(x, VirtualTensor) else x

        ins = [plain(x) for x in flat_in]
        new = [plain(o) for o in flat_out if not any(o is x for x in flat_in)]
        storages = {x.untyped_storage().data_ptr() for x in ins if x.device.type != "meta"} - {0}
        if new and all(o.device.type != "meta" and o.untyped_storage().data_ptr() in storages for o in new):
            rep.view_ops += 1
            return
        rep.bytes += _nbytes(ins) + _nbytes(new)


def detect_syncs(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> SyncReport:
    """Run ``fn(*args, **kwargs)`` under a fresh :class:`SyncDetector`; CPU tensors among
    ``args``/``kwargs`` (at any depth of lists/tuples/dicts) are moved onto the virtual device first."""
    det = SyncDetector()
    det.run(fn, *to_virtual(args), **to_virtual(kwargs))
    return det.report


# ---------------------------------------------------------- device debug modes
def _debug_backends() -> list[tuple[str, types.ModuleType]]:
    """(detector name, torch.cuda / torch.npu) for each backend present with a sync debug mode."""
    out = []
    if torch.cuda.is_available():
        out.append((DETECTOR_CUDA, torch.cuda))
    if npu_present():
        npu = getattr(torch, "npu", None)
        if npu is not None and hasattr(npu, "set_sync_debug_mode") and hasattr(npu, "get_sync_debug_mode"):
            out.append((DETECTOR_NPU, npu))
    return out


@functools.lru_cache(maxsize=1)
def npu_present() -> bool:
    """torch_npu imports and sees an NPU (asked once per process)."""
    return npu_available()


@contextlib.contextmanager
def _armed(backends: Sequence[tuple[str, types.ModuleType]]) -> Iterator[None]:
    """Sync debug mode "error" on each backend for the block, the previous mode restored after."""
    previous = []
    try:
        for _, mod in backends:
            previous.append((mod, mod.get_sync_debug_mode()))
            mod.set_sync_debug_mode("error")
        yield
    finally:
        for mod, mode in reversed(previous):
            mod.set_sync_debug_mode(mode)
