"""drift/openmp.py: run_threads, the intra-op thread count of one checked run."""

import torch

from drift.config import preset
from drift.openmp import SMALL_RUN_STATE_ELEMENTS, run_threads, state_elements


def _with_threads(n, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def test_a_small_run_takes_one_thread_and_gives_the_count_back():
    cfg = preset("ci-small")
    assert state_elements(cfg) < SMALL_RUN_STATE_ELEMENTS

    def probe():
        with run_threads(cfg, environ={}) as n:
            inside = torch.get_num_threads()
        return n, inside, torch.get_num_threads()

    assert _with_threads(2, probe) == (1, 1, 2)


def test_a_large_run_and_the_users_thread_count_are_left_alone():
    big = preset("qwen3.5-397b-tp16")
    assert state_elements(big) >= SMALL_RUN_STATE_ELEMENTS

    def probe(cfg, environ):
        with run_threads(cfg, environ=environ):
            return torch.get_num_threads()

    assert _with_threads(2, lambda: probe(big, {})) == 2
    assert _with_threads(2, lambda: probe(preset("ci-small"), {"OMP_NUM_THREADS": "2"})) == 2
    assert _with_threads(2, lambda: probe(preset("ci-small"), {})) == 1  # the control: the same call, no setting
