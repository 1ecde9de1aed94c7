"""drift's OpenMP defaults, for both front ends: the ``drift`` command (drift/__main__.py) and the
pytest gate (drift/pytest_plugin.py, and so every pytest-xdist worker, which imports it afresh).

Imports no torch: it must run before torch loads its OpenMP runtime, which reads
``OMP_WAIT_POLICY`` once, when it loads (``import torch``).
"""

from __future__ import annotations

import os
import sys

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
