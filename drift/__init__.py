"""drift: precision-drift and sync-freedom regression suite for the MTP state update of
hybrid linear-attention models (Gated DeltaNet) -- SGLang's
``update_mamba_state_after_mtp_verify`` on Ascend NPU, CUDA and CPU.

Packages follow the data flow, each importing only the ones before it:
  config, errors, devices, fileio, checkpoint   foundations
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

from .config import PRESETS, Config, preset  # noqa: E402
from .errors import ConfigError, DriftError, LoadError  # noqa: E402
from .plug.loader import load_kernel, load_update  # noqa: E402
from .runner import run_checked  # noqa: E402
from .simulate import Simulation  # noqa: E402
from .version import __version__  # noqa: E402

__all__ = ["Config", "ConfigError", "DriftError", "LoadError", "PRESETS", "preset", "load_update", "load_kernel",
           "Simulation", "run_checked", "__version__"]
