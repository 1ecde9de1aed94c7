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

The sync detector walks each op's arguments with drift's own pytree (:func:`tree_leaves`,
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
class _Kinds(dict):
    """A container type's kind, as torch's pytree treats it: "list", "dict" (exactly those types, dicts
    in insertion order), "tuple" (tuple, torch.Size: built from one sequence), "struct" (a C struct
    sequence such as torch.return_types.max: built from one sequence too), "named" (a namedtuple: built
    from its fields); any other type is a leaf (None). Classified on first sight, then one dict lookup:
    the detector walks every op's arguments."""

    def __missing__(self, cls: type) -> Optional[str]:
        kind = None
        if issubclass(cls, tuple):
            if hasattr(cls, "_fields"):
                kind = "named"
            elif all(hasattr(cls, a) for a in ("n_fields", "n_sequence_fields", "n_unnamed_fields")):
                kind = "struct"
        self[cls] = kind
        return kind


_KINDS = _Kinds({list: "list", dict: "dict", tuple: "tuple", torch.Size: "tuple"})


# The walks recurse through module-level functions, never through a closure that names itself: such a
# closure is a reference cycle that keeps every leaf it saw (the code under test's tensors) alive until
# the cyclic collector runs, at a moment no one chose, possibly inside a watched call.
def _leaves_into(x: Any, leaves: list) -> None:
    kind = _KINDS[type(x)]
    if kind is None:
        leaves.append(x)
    else:
        for v in (x.values() if kind == "dict" else x):
            _leaves_into(v, leaves)


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of ``tree`` in order, as torch's ``tree_flatten`` lists them. Containers: lists,
    tuples, namedtuples, struct sequences (``torch.return_types``), ``torch.Size`` and dicts (exactly
    those types, dicts in insertion order); anything else is a leaf."""
    leaves: list[Any] = []
    _leaves_into(tree, leaves)
    return leaves


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree`` with every leaf replaced by ``fn(leaf)`` (new containers of the same types; the input is
    not changed)."""
    cls = type(tree)
    kind = _KINDS[cls]
    if kind is None:
        return fn(tree)
    if kind == "dict":
        return {k: tree_map(fn, v) for k, v in tree.items()}
    values = [tree_map(fn, v) for v in tree]
    if kind == "list":
        return values
    return cls(*values) if kind == "named" else cls(values)


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
