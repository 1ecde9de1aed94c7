"""The one place drift (and its tests) import private torch symbols, each with a fallback.

torch's underscore modules and attributes carry no compatibility promise: a release may move,
rename or drop any of them. Every one drift uses is imported here, inside ``try``; what is
absent is listed in :data:`MISSING_PRIVATE` (dotted names) and the fallback takes over:

===========================================================  ====================================
private symbol                                               fallback when absent
===========================================================  ====================================
``torch.utils._python_dispatch.TorchDispatchMode``           the sync detector runs on
``torch.Tensor._make_wrapper_subclass``                      ``torch.overrides.TorchFunctionMode``
``torch._C._disabled_torch_function_impl``                   alone (:data:`DISPATCH_DETECTOR`
                                                             False; drift.syncs.detector)
``torch.utils._pytree.tree_flatten`` / ``tree_map``          :func:`_flatten` / :func:`_map` below
                                                             (lists, tuples, namedtuples,
                                                             torch.Size, dicts)
``torch._subclasses.fake_tensor.FakeTensorMode``             None (tests/syncs/test_syncs.py's oracle
                                                             test fails, naming it)
``...fake_tensor.DataDependentOutputException``,             placeholder exception classes
``...fake_tensor.DynamicOutputShapeException``               (never raised by torch)
``...fake_tensor.FakeTensorDeviceMismatchError``             ``RuntimeError`` (what torch raised
                                                             for a device mismatch before
                                                             pytorch#185412, 2026: 2.4.1 and
                                                             2.6.0 lack the class)
===========================================================  ====================================

Only torch is imported here (a bottom-stage module, tests/test_layout.py).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

_missing: list[str] = []


def _absent(name: str) -> None:
    _missing.append(name)


# ------------------------------------------------------------ python dispatch
try:
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:
    TorchDispatchMode = None  # type: ignore[assignment,misc]
    _absent("torch.utils._python_dispatch.TorchDispatchMode")

#: ``torch.Tensor._make_wrapper_subclass`` (a tensor subclass with its own device and no storage).
make_wrapper_subclass: Optional[Callable[..., torch.Tensor]] = getattr(torch.Tensor, "_make_wrapper_subclass", None)
if make_wrapper_subclass is None:
    _absent("torch.Tensor._make_wrapper_subclass")

#: ``torch._C._disabled_torch_function_impl`` (a subclass without a ``__torch_function__`` layer).
disabled_torch_function_impl: Optional[Callable[..., Any]] = getattr(torch._C, "_disabled_torch_function_impl", None)
if disabled_torch_function_impl is None:
    _absent("torch._C._disabled_torch_function_impl")


# --------------------------------------------------------------------- pytree
def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _flatten(tree: Any) -> tuple[list[Any], Any]:
    """Leaves of ``tree`` in order and a spec for :func:`_unflatten`. Containers, as in torch's
    pytree: lists, tuples, namedtuples, ``torch.Size`` and dicts (exactly those types, dicts in
    insertion order); anything else is a leaf."""
    leaves: list[Any] = []

    def walk(x: Any) -> Any:
        if type(x) in (list, tuple, torch.Size) or _is_namedtuple(x):
            return (type(x), [walk(v) for v in x])
        if type(x) is dict:
            return (dict, [(k, walk(v)) for k, v in x.items()])
        leaves.append(x)
        return None

    return leaves, walk(tree)


def _unflatten(leaves: list[Any], spec: Any) -> Any:
    it = iter(leaves)

    def build(s: Any) -> Any:
        if s is None:
            return next(it)
        kind, items = s
        if kind is dict:
            return {k: build(v) for k, v in items}
        values = [build(v) for v in items]
        if kind is list:
            return values
        return kind(values) if kind in (tuple, torch.Size) else kind(*values)

    return build(spec)


def _map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree`` with every leaf replaced by ``fn(leaf)`` (new containers; the input is not changed)."""
    leaves, spec = _flatten(tree)
    return _unflatten([fn(x) for x in leaves], spec)


try:
    from torch.utils._pytree import tree_flatten, tree_map
except ImportError:
    tree_flatten, tree_map = _flatten, _map  # type: ignore[assignment]
    _absent("torch.utils._pytree.tree_flatten")
    _absent("torch.utils._pytree.tree_map")


# ---------------------------------------------------------------- fake tensor (tests)
class _NeverRaised(Exception):
    """Stands in for a fake-tensor exception this torch lacks; torch never raises it."""


try:
    from torch._subclasses.fake_tensor import FakeTensorMode
except ImportError:
    FakeTensorMode = None  # type: ignore[assignment,misc]
    _absent("torch._subclasses.fake_tensor.FakeTensorMode")

try:
    from torch._subclasses.fake_tensor import DataDependentOutputException
except ImportError:
    DataDependentOutputException = type("DataDependentOutputException", (_NeverRaised,), {})  # type: ignore
    _absent("torch._subclasses.fake_tensor.DataDependentOutputException")

try:
    from torch._subclasses.fake_tensor import DynamicOutputShapeException
except ImportError:
    DynamicOutputShapeException = type("DynamicOutputShapeException", (_NeverRaised,), {})  # type: ignore
    _absent("torch._subclasses.fake_tensor.DynamicOutputShapeException")

try:  # pytorch#185412 (2026); before it a plain RuntimeError ("... found two different devices ...")
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError
except ImportError:
    FakeTensorDeviceMismatchError = RuntimeError  # type: ignore[assignment,misc]
    _absent("torch._subclasses.fake_tensor.FakeTensorDeviceMismatchError")


#: Dotted names of the private torch symbols this torch lacks (empty: every one is present).
MISSING_PRIVATE: tuple[str, ...] = tuple(_missing)

#: The sync detector's dispatch-mode implementation can run (it needs all three symbols).
DISPATCH_DETECTOR: bool = (TorchDispatchMode is not None and make_wrapper_subclass is not None
                           and disabled_torch_function_impl is not None)
