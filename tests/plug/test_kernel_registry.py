"""Every built-in verify kernel of the registry (drift/plug/loader.py: KERNELS) meets its declared
conformance against drift's portable op, in both verify flows, wherever it can load; a new entry
is tested here without editing this file."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from drift.errors import LoadError
from drift.plug.loader import KERNELS, REORDERED_FP32, load_kernel
from drift.sim import kernels
from helpers import assert_conforms, verify_case

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# Kernels that take an argument are tested with a CPU stand-in written from the op's AscendC source.
ARGS = {"npu-op": f"{FIXTURES / 'fake_npu_op.py'}:recurrent_gated_delta_rule"}
FLOWS = {"sglang": (1, 1, 1), "npu-accepted": (3, 1, 4)}  # num_accepted_tokens per row


@pytest.mark.parametrize("flow", list(FLOWS))
@pytest.mark.parametrize("name", [n for n in KERNELS if "npu" in (KERNELS[n].rules or ("npu",))])
def test_kernel_conforms_to_the_portable_op(name, flow):
    entry = KERNELS[name]
    spec = f"{name}:{ARGS[name]}" if entry.takes_arg else name
    try:
        kernel = load_kernel(spec)
    except LoadError as exc:  # its probe: this machine cannot run it (an NPU op, or an engine not installed)
        pytest.skip(f"{name} cannot load here: {exc}")
    assert_conforms(kernel, kernels.recurrent_gated_delta_rule, verify_case(accepted=FLOWS[flow]),
                    entry.conformance)


def test_the_conformance_assertion_catches_a_kernel_off_by_more_than_its_tolerance():
    """Negative control: drift's op storing by truncation is up to one bf16 ulp off round to
    nearest -- within REORDERED_FP32 -- but a kernel scaling its outputs by 1 + 2^-5 is not."""
    case = verify_case()
    assert_conforms(lambda a: kernels.recurrent_gated_delta_rule(replace(a, rounding="truncate")),
                    kernels.recurrent_gated_delta_rule, case, REORDERED_FP32)
    with pytest.raises(AssertionError, match="outputs"):
        assert_conforms(lambda a: kernels.recurrent_gated_delta_rule(a) * (1 + 2 ** -5),
                        kernels.recurrent_gated_delta_rule, case, REORDERED_FP32)


def test_a_kernel_that_takes_an_argument_says_so_without_it():
    with pytest.raises(LoadError, match="needs its argument"):
        load_kernel("npu-op")


def test_a_kernel_registered_from_outside_loads_by_name():
    from drift.plug.loader import KernelEntry

    entry = KernelEntry("toy-portable", "the portable op under another name", lambda arg: kernels.recurrent_gated_delta_rule,
                        REORDERED_FP32)
    with KERNELS.temporary(entry.name, entry):
        assert load_kernel("toy-portable").fn is kernels.recurrent_gated_delta_rule
    with pytest.raises(LoadError):
        load_kernel("toy-portable")
