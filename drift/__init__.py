"""drift: precision-drift and sync-freedom regression suite for the MTP state update of
hybrid linear-attention models (Gated DeltaNet) -- SGLang's
``update_mamba_state_after_mtp_verify`` on Ascend NPU, CUDA and CPU.

Data flow, one module per stage:
  stream (inputs) -> kernels (+ naive) -> pool (state pool, harness) -> updates / loader
  (update under test) -> simulate (loop) -> reference, compare, checks (comparison)
  -> report, cli.
"""

__version__ = "0.1.0"

from .config import PRESETS, Config, ConfigError, preset  # noqa: E402
from .loader import LoadError, load_update  # noqa: E402
from .simulate import Simulation  # noqa: E402

__all__ = ["Config", "ConfigError", "PRESETS", "preset", "load_update", "LoadError", "Simulation",
           "__version__"]
