"""Device selection: ``cpu`` by default, ``cuda`` when present, ``npu`` through torch_npu."""

from __future__ import annotations

import importlib

import torch

from .errors import DeviceUnavailable


def npu_available() -> bool:
    """True when ``torch_npu`` imports and reports at least one NPU."""
    try:
        importlib.import_module("torch_npu")
    except Exception:  # ImportError, or a broken CANN install raising at import
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available() and npu.device_count() > 0)


def available_devices() -> list[str]:
    out = ["cpu"]
    if torch.cuda.is_available():
        out.append("cuda")
    if npu_available():
        out.append("npu")
    return out


def resolve_device(name: str) -> torch.device:
    """The torch device for ``name`` ('cpu', 'cuda', 'npu', optionally ':index').

    Raises DeviceUnavailable, naming what is present, when the device is absent.
    """
    kind = name.split(":")[0]
    if kind == "cpu":
        return torch.device(name)
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailable(
                f"device={name!r} requested but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}); available here: {', '.join(available_devices())}")
        return torch.device(name)
    if kind == "npu":
        if not npu_available():
            raise DeviceUnavailable(
                f"device={name!r} requested but torch_npu is not installed or finds no NPU; "
                f"install the 'npu' extra on an Ascend host. Available here: "
                f"{', '.join(available_devices())}")
        return torch.device(name)
    raise DeviceUnavailable(f"device={name!r} is not known; allowed: cpu, cuda, npu")


def supports_float64(device: torch.device) -> bool:
    """Ascend NPUs lack general float64 support; the float64 twin then runs on the CPU."""
    return device.type != "npu"


def synchronize(device: torch.device) -> None:
    """Wait for queued work (for timings only; never called on the hot path)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)


def on_host(*tensors: torch.Tensor) -> bool:
    """Whether every tensor is a plain CPU ``torch.Tensor`` (no subclass: not the host-sync scan's virtual
    device): reading its values is no host-device sync, so a path may branch on them."""
    for t in tensors:  # a loop, not all(<generator>): called about a dozen times a step
        if type(t) is not torch.Tensor or t.device.type != "cpu":
            return False
    return True
