"""Shared helpers of the drift test suite (CPU).

Everything here is deterministic: fixed seeds, explicit dtypes, small shapes so the
whole suite stays fast on two cores. Test modules import the plain helpers with
``from conftest import ...`` (pytest puts this directory on sys.path).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch

from drift import preset
from drift.dtypes import as_bits
from drift.check.checks import core_checks
from drift.check.result import CheckResult
from drift.plug.shim import sgl_kernels
from drift.plug.updates import DEFAULT_UPDATE
from drift.runner import run_checked
from drift.simulate import Simulation

# Under pytest-xdist every core runs a worker; torch's own intra-op threads on top would
# oversubscribe the cores (OpenMP threads spinning against the other workers' processes). The
# environment variable reaches the child interpreters the tests start (drift, pytest).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"

TESTS_DIR = Path(__file__).resolve().parent
BAD_UPDATES = TESTS_DIR / "bad_updates.py"

U32 = 2.0 ** -24  # fp32 unit roundoff
U64 = 2.0 ** -53  # float64 unit roundoff

# Small ci-small variant: 1 GDN layer, K = V = 16, everything else as the preset
# (4 request rows + 1 padded row, 4 value heads from fast to slow decay, D = 4,
# conv kernel 4, track interval 16).
SMALL = dict(num_layers=1, head_k_dim=16, head_v_dim=16)

# The PR gate's wiring in this repository's suite runs 64 steps (the released update's precision
# over 512 steps is tests/test_precision.py's); .ci/wheel runs the installed gate (pytest --pyargs
# drift) over the preset's full 4,096 steps, as engine CIs do. Set here, not in pyproject's
# addopts, so a user's run from the checkout never inherits it.
REPO_DRIFT_STEPS = 64


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("drift_steps", None) is None and not config.getoption("drift_trace", None):
        config.option.drift_steps = REPO_DRIFT_STEPS


# Install the sgl_kernel_npu shim once, so modules that import the kernels the way
# SGLang does (tests/bad_updates.py) import cleanly.
sgl_kernels()

# Small tensors: one intra-op thread is as fast, and it keeps the suite from
# oversubscribing the cores when pytest-xdist or another job runs beside it.
torch.set_num_threads(1)


def small_cfg(steps: int = 200, profile: Optional[str] = None, **overrides):
    """``ci-small`` shrunk to :data:`SMALL`, with ``steps`` and any field overrides."""
    cfg = preset("ci-small", steps=steps, **{**SMALL, **overrides})
    return cfg.with_profile(profile) if profile else cfg


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bits(a), as_bits(b))


def digest(*tensors: torch.Tensor) -> str:
    """SHA-1 of the logical contents (dtype, shape and bytes) of tensors."""
    h = hashlib.sha1()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(as_bits(t).numpy().tobytes())
    return h.hexdigest()


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bfloat16 numbers at |x| (normal range): |x| = m 2^e, m in [0.5, 1),
    8 significant bits, so ulp = 2^(e - 8)."""
    _, e = torch.frexp(x.to(torch.float64).abs())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), e - 8)


def gdn_state_bound(t, K: int, h_norm, v_norm, u: float = U32):
    """Frobenius error bound of a fp state after t gated delta-rule tokens computed with unit
    roundoff u (tests/test_kernels.py docstring): t (K + 6) u (||h|| + ||v||)."""
    return t * (K + 6) * u * (h_norm + v_norm)


def verify_bounds(ref_inter: torch.Tensor, v: torch.Tensor):
    """For a float32 GDN verify of n rows against its float64 result ``ref_inter [L, n, D, HV, K, V]``
    (v ``[L, n, D, HV, V]``): the state bound after each token ``[L, n, D, HV]`` (gdn_state_bound
    with the largest ||h||, ||v|| over the tokens) and the output bound
    ``K^-1/2 (state bound + K u32 ||h||)`` (||q|| <= K^-1/2)."""
    K = ref_inter.shape[-2]
    h_norm = ref_inter.norm(dim=(-1, -2)).amax(2, keepdim=True)  # max over tokens [L, n, 1, HV]
    v_norm = v.double().norm(dim=-1).amax(2, keepdim=True)
    t = torch.arange(1, ref_inter.shape[2] + 1, dtype=torch.float64)[None, None, :, None]
    state = gdn_state_bound(t, K, h_norm, v_norm)
    return state, K ** -0.5 * (state + K * U32 * h_norm)


def rel_fro(a: torch.Tensor, b: torch.Tensor, dims=(-1, -2)) -> torch.Tensor:
    """||a - b||_F / ||b||_F over ``dims`` (float64)."""
    a, b = a.to(torch.float64), b.to(torch.float64)
    return (a - b).norm(dim=dims) / b.norm(dim=dims)


class StepHook:
    """Observer that calls ``fn(sim, view)`` after every step's update."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.sim = None

    def on_start(self, sim) -> None:
        self.sim = sim

    def on_step(self, view) -> None:
        self.fn(self.sim, view)

    def flush(self) -> None:
        pass

    def on_end(self) -> None:
        pass


def run_sim(cfg, update=DEFAULT_UPDATE, on_step: Optional[Callable] = None, **kwargs) -> Simulation:
    """Build and run a simulation; ``on_step(sim, view)`` sees every step."""
    observers = [StepHook(on_step)] if on_step is not None else []
    sim = Simulation(cfg, update, observers=observers, **kwargs)
    sim.info = sim.run()
    return sim


def pool_digests(cfg, update=DEFAULT_UPDATE, **kwargs) -> list[str]:
    """Per step: digest of the whole pool (committed states, conv windows, scratch) and
    the step's outputs."""
    out: list[str] = []
    run_sim(cfg, update, on_step=lambda sim, view: out.append(
        digest(sim.pool.temporal, sim.pool.conv, sim.pool.intermediate_ssm, view.out)), **kwargs)
    return out


def committed_by_position(cfg, **kwargs) -> dict:
    """Run ``cfg`` and return ``{(row, position): committed state}`` (float64,
    ``[L, HV, K, V]``) for every position some step committed."""
    states: dict = {}

    def grab(sim, view):
        st = sim.pool.states[:, sim.pool.active_slots].to(torch.float64)
        for r, pos in enumerate(view.pre + view.accept):
            states[(r, int(pos))] = st[:, r].clone()

    run_sim(cfg, on_step=grab, **kwargs)
    return states


def checks_of(cfg, update=DEFAULT_UPDATE, **kwargs) -> dict[str, CheckResult]:
    """``run_checked`` with the semantic core checks (not the drift bound, which is
    calibrated on the presets' shapes, not on these small configs; nor the host-sync scan,
    which tests/test_syncs.py covers) as a dict check key -> result, plus the report under
    'report'."""
    kwargs.setdefault("checks", core_checks())
    kwargs.setdefault("sync_scan", False)
    rep = run_checked(cfg, update, **kwargs)
    out = {c.key: c for c in rep.checks}
    out["report"] = rep
    return out


@pytest.fixture
def cpu_only(monkeypatch):
    """Pin the accelerator probes to "absent": no CUDA, and torch_npu fails to import."""
    from drift import devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def no_torch_npu(name, *args, **kwargs):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(devices.importlib, "import_module", no_torch_npu)


def bad_spec(name: str) -> str:
    """File spec of a known-bad update in tests/bad_updates.py."""
    return f"{BAD_UPDATES}:{name}"



# The longest shared-fixture groups first: under --dist loadgroup a group is one unit of work,
# so a group that starts last keeps one core busy alone at the end. Collection order is
# otherwise kept (a stable sort), and every worker sorts the same way.
FIRST_GROUPS = ("teeth", "compat", "nightly", "precision-bf16-runs")


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
