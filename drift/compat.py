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
``torch.utils._pytree.tree_flatten`` / ``tree_map``          None (tests/syncs/test_compat.py's
(tests: the oracle of drift's own pytree)                    oracle test fails, naming it)
``torch._subclasses.fake_tensor.FakeTensorMode``             None (tests/syncs/test_syncs.py's oracle
                                                             test fails, naming it)
``...fake_tensor.DataDependentOutputException``,             placeholder exception classes
``...fake_tensor.DynamicOutputShapeException``               (never raised by torch)
``...fake_tensor.FakeTensorDeviceMismatchError``             ``RuntimeError`` (what torch raised
                                                             for a device mismatch before
                                                             pytorch#185412, 2026: 2.4.1 and
                                                             2.6.0 lack the class)
===========================================================  ====================================

The sync detector walks each op's arguments with drift's own pytree (:func:`tree_flatten`,
:func:`tree_map` below), not torch's: the same leaves on the trees it builds, and about three times
faster per call (torch's builds a ``TreeSpec`` through its node registry), which is most of the
host-sync scan's own overhead: several walks per dispatched op.

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
_SEQUENCES = (list, tuple, torch.Size)


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _is_structseq_class(kind: type) -> bool:
    """A C struct sequence type (``torch.return_types.max`` ...): a tuple built from one sequence."""
    return issubclass(kind, tuple) and all(hasattr(kind, a) for a in ("n_fields", "n_sequence_fields",
                                                                        "n_unnamed_fields"))


def _is_structseq(x: Any) -> bool:
    return isinstance(x, tuple) and _is_structseq_class(type(x))


def tree_flatten(tree: Any) -> tuple[list[Any], Any]:
    """Leaves of ``tree`` in order and a spec for :func:`tree_unflatten`. Containers, as in torch's
    pytree: lists, tuples, namedtuples, struct sequences (``torch.return_types``), ``torch.Size`` and
    dicts (exactly those types, dicts in insertion order); anything else is a leaf."""
    leaves: list[Any] = []

    def walk(x: Any) -> Any:
        kind = type(x)
        if kind in _SEQUENCES or _is_namedtuple(x) or _is_structseq(x):
            return (kind, [walk(v) for v in x])
        if kind is dict:
            return (dict, [(k, walk(v)) for k, v in x.items()])
        leaves.append(x)
        return None

    return leaves, walk(tree)


def tree_unflatten(leaves: list[Any], spec: Any) -> Any:
    """The tree :func:`tree_flatten` took ``spec`` from, with ``leaves`` in its leaves' places."""
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
        return kind(values) if kind in (tuple, torch.Size) or _is_structseq_class(kind) else kind(*values)

    return build(spec)


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree`` with every leaf replaced by ``fn(leaf)`` (new containers; the input is not changed)."""
    kind = type(tree)
    if kind is tuple:
        return tuple([tree_map(fn, v) for v in tree])
    if kind is list:
        return [tree_map(fn, v) for v in tree]
    if kind is dict:
        return {k: tree_map(fn, v) for k, v in tree.items()}
    if kind is torch.Size:
        return torch.Size([tree_map(fn, v) for v in tree])
    if _is_namedtuple(tree):
        return kind(*[tree_map(fn, v) for v in tree])
    if _is_structseq(tree):
        return kind([tree_map(fn, v) for v in tree])
    return fn(tree)


# ------------------------------------------------------------- pytree and fake tensor (tests)
try:  # the oracle drift's own pytree is held to
    from torch.utils._pytree import tree_flatten as torch_tree_flatten, tree_map as torch_tree_map
except ImportError:
    torch_tree_flatten = torch_tree_map = None  # type: ignore[assignment]
    _absent("torch.utils._pytree.tree_flatten")
    _absent("torch.utils._pytree.tree_map")

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
