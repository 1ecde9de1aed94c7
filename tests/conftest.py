"""pytest's side of the drift test suite (CPU): threads, the repository's gate horizon, the
sgl_kernel_npu shim, the ``cpu_only`` fixture and the xdist group order. The plain helpers the
test modules import live in tests/helpers.py (``from helpers import ...``: pytest puts this
directory on sys.path)."""

from __future__ import annotations

import os

import pytest
import torch

from drift.mkl import mkl_defaults
from drift.sim.shim import sgl_kernels

# drift's own suite compares figures recorded on other machines: MKL on the one code path every x86 CPU
# shares (drift/mkl.py), as drift's own command and gate sessions take it. Before any test computes.
mkl_defaults()

# Under pytest-xdist every core runs a worker; torch's own intra-op threads on top would
# oversubscribe the cores (OpenMP threads spinning against the other workers' processes). The
# environment variable reaches the child interpreters the tests start (drift, pytest).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"

# The PR gate's wiring in this repository's suite runs 64 steps (the released update's precision
# over 512 steps is tests/check/test_precision.py's); .ci/wheel runs the installed gate (pytest --pyargs
# drift) over the preset's full 4,096 steps, as engine CIs do. Set here, not in pyproject's
# addopts, so a user's run from the checkout never inherits it.
REPO_DRIFT_STEPS = 64


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("drift_steps", None) is None and not config.getoption("drift_trace", None):
        config.option.drift_steps = REPO_DRIFT_STEPS


# Install the sgl_kernel_npu shim once, so modules that import the kernels the way
# SGLang does (tests/fixtures/bad_updates.py) import cleanly.
sgl_kernels()

# Small tensors: one intra-op thread is as fast, and it keeps the suite from
# oversubscribing the cores when pytest-xdist or another job runs beside it.
torch.set_num_threads(1)


@pytest.fixture
def toy(monkeypatch):
    """The toy extension (tests/fixtures/toy_extension.py) loaded through $DRIFT_EXTENSIONS for one
    test; its registry entries and module removed afterwards."""
    from drift.check.registry import CHECKS
    from drift.config import PROFILES
    from drift.plug.loader import KERNELS
    from helpers import TOY_EXTENSION, loaded_for_one_test

    yield from loaded_for_one_test(monkeypatch, TOY_EXTENSION, (KERNELS, CHECKS, PROFILES))


@pytest.fixture
def cpu_only(monkeypatch):
    """Pin the accelerator probes to "absent": no CUDA, and torch_npu fails to import."""
    from drift import devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def no_torch_npu(name, *args, **kwargs):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(devices.importlib, "import_module", no_torch_npu)


# The longest shared-fixture groups first: under --dist loadgroup a group is one unit of work,
# so a group that starts last keeps one core busy alone at the end. Collection order is
# otherwise kept (a stable sort), and every worker sorts the same way.
FIRST_GROUPS = ("teeth", "front-ends", "compat", "nightly", "precision-bf16-runs")


def pytest_collection_modifyitems(config, items: list) -> None:
    def rank(item) -> int:
        mark = item.get_closest_marker("xdist_group")
        name = (mark.args[0] if mark.args else mark.kwargs.get("name")) if mark else None
        return FIRST_GROUPS.index(name) if name in FIRST_GROUPS else len(FIRST_GROUPS)

    items.sort(key=rank)
    _xdist_group_ids(config, items)


def _xdist_group_ids(config, items: list) -> None:
    """--dist loadgroup on pytest 9: pytest-xdist (3.8) keys a work unit by the ``@group`` suffix it
    appends to each grouped test's node id by setting ``item._nodeid``, which pytest 9 no longer
    reads (it keeps the id as ``item._id``). Without the suffix every grouped test is a unit of its
    own, spread over all workers, and each worker recomputes the group's module fixtures (measured:
    the mutant catalogue and the trade-off runs twice). Set the suffix where pytest 9 reads it;
    a pytest that still honours xdist's own (the id already ends in it) is left alone."""
    if not getattr(config.option, "loadgroup", False):  # set in xdist workers under --dist loadgroup
        return
    try:
        from _pytest.nodeid import NodeId  # pytest >= 9
    except ImportError:
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        suffix = "@" + "_".join(names)
        if names and not item.nodeid.endswith(suffix) and isinstance(getattr(item, "_id", None), NodeId):
            item._id = NodeId.parse(item.nodeid + suffix)
