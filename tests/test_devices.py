"""drift.devices: cpu by default; asking for an absent accelerator is a clear
DeviceUnavailable (asserted, never skipped).

The accelerator probes are pinned to "absent" (conftest's ``cpu_only``) so the tests
state a CPU-only host everywhere (a runner with a GPU would otherwise flip the premise).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers import small_cfg
from drift import devices
from drift.devices import DeviceUnavailable, resolve_device, supports_float64
from drift.config import PROFILES, preset
from drift.flows.registry import FLOWS
from drift.simulate import Simulation
from drift.runspec import resolve


def test_cpu_resolves():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("cpu:0") == torch.device("cpu:0")


def test_probes_report_cpu_only(cpu_only):
    assert devices.npu_available() is False
    assert devices.available_devices() == ["cpu"]


@pytest.mark.parametrize("name, words", [
    ("cuda", r"device='cuda' requested but torch\.cuda\.is_available\(\) is False.*available here: cpu"),
    ("cuda:1", r"device='cuda:1' requested"),
    ("npu", r"device='npu' requested but torch_npu is not installed or finds no NPU.*'npu' extra.*"
            r"Available here: cpu"),
    ("tpu", r"device='tpu' is not known; allowed: cpu, cuda, npu"),
])
def test_absent_device_is_a_clear_error(cpu_only, name, words):
    with pytest.raises(DeviceUnavailable, match=words):
        resolve_device(name)


@pytest.mark.parametrize("name", ["cuda", "npu"])
def test_simulation_on_an_absent_device_raises_before_running(cpu_only, name):
    cfg = small_cfg(5, device=name)
    with pytest.raises(DeviceUnavailable, match=f"device='{name}'"):
        Simulation(resolve(cfg))


def test_npu_probe_survives_a_broken_cann_install(monkeypatch):
    def broken(name, *a, **k):
        raise RuntimeError("libascendcl.so: cannot open shared object file")

    monkeypatch.setattr(devices.importlib, "import_module", broken)
    assert devices.npu_available() is False


def test_float64_support():
    assert supports_float64(torch.device("cpu")) and supports_float64(torch.device("cuda"))
    # torch.device("npu") only parses once torch_npu registered it; the probe reads .type.
    assert not supports_float64(SimpleNamespace(type="npu"))  # the twin then runs on the CPU


# ---------------------------------------------------------------- device placement
# Without an accelerator, the meta device stands in for one: an op mixing a meta tensor with a
# CPU tensor (anything but a 0-dim scalar) raises, as CUDA and NPU do. So a step that runs on
# meta creates every tensor on the run's device. Data-dependent code (a host sync) cannot run
# on meta at all: the sync-free built-in update is what runs here; the syncing ones are the
# host-syncs check's business.
META = torch.device("meta")


@pytest.mark.parametrize("profile", list(PROFILES))
@pytest.mark.parametrize("flow", FLOWS.names())
def test_every_tensor_of_a_step_lives_on_the_run_device(profile, flow):
    cfg = preset("ci-small").with_profile(profile).replace(flow=flow)
    sim = Simulation(resolve(cfg, None), device=META, check_untouched=False, graph=False)  # the flow's own update
    sim.run(3)
    assert sim.pool.temporal.device == META and sim.pool.conv.device == META


def test_sequential_decode_and_the_naive_loops_run_on_the_run_device():
    cfg = preset("ci-small")
    Simulation(resolve(cfg, mode="sequential"), device=META, check_untouched=False).run(2)
    from drift.sim import naive
    conv = torch.zeros(1, 3, 6, 8, device=META)
    mix = naive.conv_verify(conv, [0, 2], torch.zeros(1, 2, 3, 8, device=META), torch.zeros(1, 8, 4, device=META))
    assert mix.device == META


def test_the_placement_check_can_fail():
    """Negative control: a CPU tensor created inside a device step is caught on meta."""
    with pytest.raises((RuntimeError, NotImplementedError)):
        torch.zeros(3, device=META) + torch.zeros(3)
