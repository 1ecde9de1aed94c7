"""Capture a real model's GDN verify inputs into a drift trace (:mod:`drift.sim.tracefile`).

* :mod:`drift.capture.transformers_capture` -- hooks on a Hugging Face transformers
  Qwen3-Next / Qwen3.5 model during a greedy decode (needs ``transformers>=5``).
* :mod:`drift.capture.sglang_hook` -- :class:`SGLangTraceRecorder`, wrapping an SGLang GDN
  attention backend's target-verify ``forward_extend`` and the hybrid backend's
  ``update_mamba_state_after_mtp_verify`` (needs nothing beyond torch and numpy).

Names are imported lazily, so ``import drift.capture`` does not import transformers.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "SGLangTraceRecorder": "sglang_hook",
    "GDNInputRecorder": "transformers_capture",
    "build_tiny_model": "transformers_capture",
    "load_model": "transformers_capture",
    "capture": "transformers_capture",
    "capture_to_file": "transformers_capture",
    "find_gdn_layers": "transformers_capture",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
