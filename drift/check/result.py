"""The result of one check: verdict, worst value, its limit, where it happened (a leaf module)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class CheckResult:
    name: str
    passed: bool
    worst: Optional[float] = None
    limit: Optional[float] = None
    where: str = ""
    detail: str = ""
    extra: dict = field(default_factory=dict)
    key: str = ""  # the check's registry key (drift.check.registry), set by the run

    @property
    def applicable(self) -> bool:
        return self.extra.get("applicable", True)

    @property
    def informational(self) -> bool:
        """Reported, never gated (e.g. the MTP-vs-sequential divergence)."""
        return self.extra.get("role") == "info"

    @property
    def failed(self) -> bool:
        """This check gates the run and did not pass (n/a and informational results never fail)."""
        return not self.passed and self.applicable and not self.informational

    @property
    def verdict(self) -> str:
        if self.informational:
            return "info"
        return "n/a" if not self.applicable else ("PASS" if self.passed else "FAIL")

    def to_dict(self) -> dict:
        def clean(v):
            # Non-finite floats anywhere (a NaN run's worst values, its bound ratios in
            # extra) become None: the report must stay strict JSON.
            if isinstance(v, dict):
                return {k: clean(x) for k, x in v.items()}
            if isinstance(v, (list, tuple)):
                return [clean(x) for x in v]
            return None if v is None or (isinstance(v, float) and not math.isfinite(v)) else v
        return {"key": self.key, "name": self.name, "passed": self.passed, "failed": self.failed, "verdict": self.verdict,
                "worst": clean(self.worst),
                "limit": clean(self.limit), "where": self.where, "detail": self.detail,
                **clean(self.extra)}


def locate(idx: tuple, step0: int, dims: tuple[str, ...] = ("layer", "row", "head")) -> str:
    """'step S, layer l, row r, head h' for an index into a ``[S, ...]`` chunk array."""
    parts = [f"step {step0 + int(idx[0])}"] + [f"{d} {int(i)}" for d, i in zip(dims, idx[1:])]
    return ", ".join(parts)
