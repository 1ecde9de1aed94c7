"""The vllm flow's serving bookkeeping on an accelerator (docs/semantics.md §12, "vLLM's serving
bookkeeping"): the built-in passes a serving run of ci-small and ci-heads on the device, and each
serving mutant is caught there, as on the CPU (tests/flows/in_place/test_vllm_serving.py).

    python scripts/vllm_serving_device.py [DEVICE] [STEPS]   # default: cuda 256

Prints one JSON line per run (name, device, verdict, failed checks, wall seconds) and exits 1 when the
built-in fails or a mutant passes. Needs the device (DeviceUnavailable, exit 2, without it).
"""

from __future__ import annotations

import json
import sys
import time

from drift import preset
from drift.plug.mutants import MUTANTS
from drift.runner import run_checked
from drift.runspec import resolve


def main() -> int:
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    runs = [(name, None, True) for name in ("ci-small", "ci-heads")]
    runs += [("ci-small", f"mutant:{m}", False) for m, entry in MUTANTS.items()
             if entry.flow == "vllm" and (entry.config or {}).get("lifecycle") == "serving"]
    bad = 0
    for name, update, should_pass in runs:
        cfg = preset(name, flow="vllm", lifecycle="serving", steps=steps, device=device)
        t0 = time.perf_counter()
        rep = run_checked(resolve(cfg, update))
        failed = [c.key for c in rep.checks if c.failed]
        ok = rep.passed if should_pass else bool(failed)
        bad += not ok
        print(json.dumps({"preset": name, "update": update or "vllm-0.33.0", "device": device, "ok": ok,
                          "failed_checks": failed, "events": rep.info.meta.get("events"),
                          "wall_s": round(time.perf_counter() - t0, 1)}), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
