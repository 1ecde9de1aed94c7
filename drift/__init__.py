"""drift: precision-drift and sync-freedom regression suite for the MTP state update of
hybrid linear-attention models (Gated DeltaNet) -- SGLang's
``update_mamba_state_after_mtp_verify`` on Ascend NPU, CUDA and CPU.

Packages follow the data flow, each importing only the ones before it:
  config, defaults, errors, devices, fileio, checkpoint   foundations
  sim      input stream -> kernels (+ naive float64 definitions, native CPU kernel)
           -> float64 twin -> state pool and backend harness
  plug     the code under test: spec grammar, sgl_kernel_npu shim, built-in updates
           (named parts), mutants, NPU op adapter, one loader
  simulate the decode loop
  check    result type, metrics, golden, comparison, checks, drift bound, sequential shadow
  syncs    host-sync detector, the scan of an update, cost model
  runner   one checked run
  jobs     bench, nightly, teeth, reports, plots
  cli, options, pytest_plugin, test_gate   the entry points
"""

from .version import __version__

# Everything else on first use (PEP 562): `import drift` (and `drift --help`) stays free of torch.
_LAZY = {"PRESETS": "config", "Config": "config", "preset": "config", "ConfigError": "errors",
         "DriftError": "errors", "LoadError": "errors", "load_kernel": "plug.loader",
         "load_update": "plug.loader", "run_checked": "runner", "Simulation": "simulate"}

__all__ = ["Config", "ConfigError", "DriftError", "LoadError", "PRESETS", "preset", "load_update", "load_kernel",
           "Simulation", "run_checked", "__version__"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'drift' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value
