"""Measures (drift/check/measures.py): checks declare what they read, the comparison computes
that and nothing else, and the state measure's native C pass equals its torch reducer."""

from __future__ import annotations

import pytest
import torch

import drift.check  # noqa: F401  (registers the built-in checks)
from drift.check.checks import Check, StateCheck
from drift.check.measures import MEASURES, declared, state_sums_native, state_sums_torch, with_needs
from drift.check.registry import CHECKS, RunContext, find_result
from drift.config import preset
from drift.errors import ConfigError
from drift.runner import run_checked
from drift.sim import native
from drift.runspec import resolve

CFG = preset("ci-small", steps=24)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_native_state_pass_equals_the_torch_reducer(dtype):
    if not native.available():
        pytest.skip(f"the native C kernel is not built here: {native.status()}")
    gen = torch.Generator().manual_seed(7)
    truth = torch.randn(2, 3, 4, 16, 8, generator=gen, dtype=torch.float64)
    run = (truth + 1e-3 * torch.randn(truth.shape, generator=gen, dtype=torch.float64)).to(dtype)
    run[0, 0, 0, 0, 0] = 0.0  # the ulp of an exact zero is 0 in both
    run[1, 2, 3, 5, 1] = float("nan")  # one non-finite head
    (a, fa, ca, ra), (b, fb, cb, rb) = state_sums_torch(run, truth, dtype), state_sums_native(run, truth, dtype)
    assert torch.equal(fa, fb) and not fa[1, 2, 3] and fa.sum() == fa.numel() - 1
    finite = fa[..., None].expand_as(ca)
    for name in a:
        # float64 sums of at most 128 terms in another order: a few ulp of the sum (2^-52 each),
        # far below 1e-12 relative; a wrong term (a missing square, another dtype's ulp) is order one
        torch.testing.assert_close(b[name][fa], a[name][fa], rtol=1e-12, atol=0.0, msg=name)
    torch.testing.assert_close(cb[finite], ca[finite], rtol=1e-12, atol=1e-300)
    # the row concentration: between 1/V (even) and 1 (one row), the same in both reducers
    torch.testing.assert_close(rb[fa], ra[fa], rtol=1e-12, atol=0.0)
    assert (ra[fa] >= 1.0 / truth.shape[-2] - 1e-12).all() and (ra[fa] <= 1.0).all()


def test_each_registered_check_declares_measures_that_exist():
    ctx = RunContext(CFG)
    for spec in CHECKS.in_order():
        if spec.shape != "consumer":
            continue
        check = spec.build(ctx)
        assert check.measures, f"{spec.key} declares no measure: it would make every run compute everything"
        with_needs(check.measures)  # an unknown key raises


def test_needs_come_first_and_an_unknown_measure_names_the_choices():
    keys = [m.key for m in with_needs(["bound_terms"])]
    assert keys == ["state", "bound_terms"]
    assert [m.key for m in declared([Check()])] == list(MEASURES.names())  # declares nothing: reads all
    with pytest.raises(ConfigError, match="measure 'nope' is not known; allowed: state"):
        with_needs(["nope"])


def test_a_run_computes_only_what_its_checks_declare_and_the_same_figures():
    only = run_checked(resolve(CFG), checks=[StateCheck()], sync_scan=False)
    full = run_checked(resolve(CFG), sync_scan=False)
    a, b = find_result(only.checks, "committed_state"), find_result(full.checks, "committed_state")
    assert (a.worst, a.where) == (b.worst, b.where) and a.passed

    class ReadsOutputs(Check):  # a check that reads what it did not declare: told which measure
        key, measures = "reads_outputs", ("state",)

        def consume(self, chunk):
            chunk.out_err2

    with pytest.raises(AttributeError, match="'out_err2' belongs to measure 'outputs'"):
        run_checked(resolve(CFG), checks=[ReadsOutputs()], sync_scan=False)


def test_the_comparison_allocates_only_the_declared_arrays():
    class Recorder(StateCheck):
        def start(self, comparison):
            super().start(comparison)
            self.arrays = set(comparison.buf)

    rec = Recorder()
    run_checked(resolve(CFG), checks=[rec], sync_scan=False)
    assert rec.arrays == set(MEASURES["state"].arrays)
    assert not rec.arrays & set(MEASURES["outputs"].arrays)
