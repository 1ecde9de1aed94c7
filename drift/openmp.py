"""drift's OpenMP (and OpenBLAS) defaults, for both front ends: the ``drift`` command (drift/__main__.py)
and the pytest gate (drift/pytest_plugin.py, and so every pytest-xdist worker, which imports it afresh).

Imports no torch and no numpy: it must run before torch loads its OpenMP runtime, which reads
``OMP_WAIT_POLICY`` once, when it loads (``import torch``), and before numpy starts OpenBLAS's threads.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

WAIT_POLICY = "PASSIVE"


def openmp_defaults(environ=os.environ, modules=sys.modules) -> str:
    """Let idle OpenMP threads sleep unless the user chose otherwise; returns what was done (one
    line, for pytest's header).

    Spinning workers fight every other process for the cores: on this project's 2-core machine
    with one other job running, a default ``drift run`` took 48.6 s and 91.6 s spinning against
    25.4 s and 23.0 s passive (2026-12-01, docs/speed.md). A user's ``OMP_WAIT_POLICY`` stands.
    Otherwise it is set to ``PASSIVE`` (child processes, xdist workers included, inherit it), and
    when torch is already imported (``modules``) -- its runtime read the environment without it --
    torch gets one intra-op thread, so no OpenMP worker is left to spin, unless the user set
    ``OMP_NUM_THREADS``.
    """
    if "OMP_WAIT_POLICY" in environ:
        return f"OMP_WAIT_POLICY={environ['OMP_WAIT_POLICY']} (the user's)"
    environ["OMP_WAIT_POLICY"] = WAIT_POLICY
    if "torch" not in modules:
        return f"OMP_WAIT_POLICY={WAIT_POLICY}"
    if "OMP_NUM_THREADS" in environ:
        return (f"OMP_WAIT_POLICY={WAIT_POLICY} for child processes; torch was imported before it, "
                f"{environ['OMP_NUM_THREADS']} thread(s) as OMP_NUM_THREADS says")
    modules["torch"].set_num_threads(1)
    return f"OMP_WAIT_POLICY={WAIT_POLICY} for child processes; torch was imported before it: 1 intra-op thread"


def blas_defaults(environ=os.environ, modules=sys.modules) -> str:
    """One OpenBLAS thread in drift's own process unless the user chose otherwise; returns what was done.

    numpy's OpenBLAS starts a pool of threads (one per core but one) when numpy loads, and a process with
    threads does not fork its comparison (drift.check.forked.fork_refusal: a default run then compares on
    a thread, 16.7 s against 13.1 s on this project's 2-core box, 2026-12-07, docs/speed.md). drift's
    numpy BLAS calls are a few small fits: figures unchanged (report.json equal). A user's
    ``OPENBLAS_NUM_THREADS`` stands; where numpy is already loaded its pool stands too.
    """
    if "OPENBLAS_NUM_THREADS" in environ:
        return f"OPENBLAS_NUM_THREADS={environ['OPENBLAS_NUM_THREADS']} (the user's)"
    if "numpy" in modules:
        return "numpy was imported before it: its OpenBLAS threads stand"
    environ["OPENBLAS_NUM_THREADS"] = "1"
    return "OPENBLAS_NUM_THREADS=1"


# A run whose committed states hold fewer elements than this takes one intra-op thread. Below it a
# tensor op lasts about a millisecond or less on one core (ci-small: 163,840 elements), and waking a
# passive OpenMP worker for it costs as much again (a whole scheduler slice where another job holds
# the other core): a default ci-small run took 21.5 s on one thread against 41.7 s on two at load
# 2.3-2.8, and 17.4 s of CPU against 22.1 s (2026-12-02, docs/speed.md). qwen3.5-397b-tp16's
# 14.7 M elements keep torch's count (its ops are tens of milliseconds; drift bench picks two
# threads there on a quiet box). Thread counts do not change the figures of a run of this size
# (every report.json equal, docs/speed.md).
SMALL_RUN_STATE_ELEMENTS = 1 << 20


def state_elements(cfg) -> int:
    """Elements of a run's committed states: layers x batch rows x value heads x V x K."""
    return cfg.num_layers * cfg.num_rows * cfg.num_v_heads * cfg.head_v_dim * cfg.head_k_dim


@contextmanager
def run_threads(cfg, environ=os.environ):
    """For the duration of one checked run of ``cfg`` (a :class:`drift.config.Config`): one torch
    intra-op thread where the run is small (:data:`SMALL_RUN_STATE_ELEMENTS`), the count as it was
    afterwards. A user's ``OMP_NUM_THREADS`` stands, and so does a larger run's count."""
    import torch  # here, not at import: drift/__main__.py calls openmp_defaults before torch loads

    before = torch.get_num_threads()
    if "OMP_NUM_THREADS" in environ or state_elements(cfg) >= SMALL_RUN_STATE_ELEMENTS or before == 1:
        yield before
        return
    torch.set_num_threads(1)
    try:
        yield 1
    finally:
        torch.set_num_threads(before)
