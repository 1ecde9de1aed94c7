"""Nightly long-horizon drift runs: a resumable, shardable matrix with a readable report.

The matrix is presets x seeds x updates x variants:

  rne         MTP, bf16 state stored round-to-nearest (the deployment)
  stochastic  MTP, bf16 state stored with stochastic rounding
  fp32        MTP, fp32 state (CUDA's default profile)
  sequential  non-MTP decode of the same stream, bf16 round-to-nearest after every token
              (no update is involved: one entry per preset and seed)

Each entry is a checked run (every check of ``drift run``, the float64 twin or golden as
reference) to a long horizon, checkpointed every N steps; a resumed run continues a killed one
and reproduces the uninterrupted report byte for byte (timings aside, which live in the
report's ``timings`` entry only). The two newest checkpoints of an entry are kept: a damaged
newest one is set aside and the run resumes from the one before (or starts the entry over),
saying so.
"""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, TextIO

from .. import checkpoint
from ..config import PRESETS, Config
from ..errors import ConfigError, DataError
from ..fileio import atomic_write_json, atomic_write_text
from ..plug.updates import DEFAULT_UPDATE
from ..runner import CheckedRun, versions
from ..check.registry import find_result, result_key
from ..runspec import RunSpec
from .plots import nightly_plots
from .report import nightly_markdown

VARIANTS = ("rne", "stochastic", "fp32", "sequential")
DEFAULT_PRESETS = ("qwen3.5-397b-tp16",)
# The released, sync-free update; add `--update sglang-32130` (which syncs on its tracking path
# by design) or a plug-in to compare. A default that always fails would hide regressions.
DEFAULT_UPDATES = (DEFAULT_UPDATE,)
DEFAULT_STEPS = 100_000
# On a CPU the night fits ~4 layers of the 45-layer preset at 100,000 steps (measured
# ~15 ms per step for 4 layers with the twin on 2 cores); layers are independent streams
# with the same per-layer numerics, so cutting them loses samples, not regimes.
CPU_LAYERS = 4
DEFAULT_CHECKPOINT_EVERY = 5_000
TREND_FACTOR = 1.5  # flag a head whose error at equal horizon grew beyond 1.5x the baseline's
SCHEMA = 1


@dataclass(frozen=True)
class Entry:
    """One cell of the matrix. With ``trace`` the entry replays that trace (drift capture) on the
    preset's batch: its model, its tokens (``steps`` None: the whole trace; ``loop``: positions
    past its end wrap around), its golden data beside it."""

    preset: str
    seed: int
    update: str  # update spec; "-" for sequential decode
    variant: str
    steps: Optional[int]  # None only with a trace: the whole trace
    layers: Optional[int] = None  # None: all of the preset's (the trace's)
    trace: str = ""
    loop: bool = False
    graph: bool = True  # False: eager steps and eager verify arguments (--no-graph)

    @property
    def key(self) -> str:
        update = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.update)
        if self.trace:
            stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(self.trace).name.removesuffix(".npz"))
            return f"{self.preset}.trace-{stem}{'-loop' if self.loop else ''}.seed{self.seed}.{update}.{self.variant}"
        return f"{self.preset}.seed{self.seed}.{update}.{self.variant}"

    def config(self, device: str) -> Config:
        """The entry's run (drift/runspec.py): the variant picks the rounding or the fp32 profile."""
        return RunSpec(preset=self.preset, seed=self.seed, steps=self.steps, device=device,
                       trace=self.trace or None, loop=self.loop, no_graph=not self.graph, layers=self.layers,
                       profile="fp32" if self.variant == "fp32" else None,
                       rounding=None if self.variant == "fp32" else
                       ("stochastic" if self.variant == "stochastic" else "rne")).config()


def build_matrix(presets: Sequence[str], seeds: Sequence[int], updates: Sequence[str], variants: Sequence[str],
                 steps: Optional[int], layers: Optional[int], trace: str = "", loop: bool = False,
                 graph: bool = True) -> list[Entry]:
    if steps is None and not trace:
        raise ConfigError("steps=None is only allowed with a trace (the whole trace)")
    out = []
    for p in presets:
        if p not in PRESETS:
            raise ConfigError(f"preset={p!r} is not known; allowed: {', '.join(PRESETS)}")
        for s in seeds:
            for v in variants:
                if v not in VARIANTS:
                    raise ConfigError(f"variant={v!r} is not known; allowed: {', '.join(VARIANTS)}")
                for update in (["-"] if v == "sequential" else updates):
                    out.append(Entry(p, s, update, v, steps, layers, trace, loop, graph))
    return out


def parse_shard(text: Optional[str]) -> tuple[int, int]:
    """'K/N' -> (K, N) with 1 <= K <= N."""
    if not text:
        return 1, 1
    m = re.fullmatch(r"(\d+)/(\d+)", text)
    if not m or not (1 <= int(m.group(1)) <= int(m.group(2))):
        raise ConfigError(f"--shard {text!r} is invalid; expected K/N with 1 <= K <= N, e.g. 2/4")
    return int(m.group(1)), int(m.group(2))


def shard(entries: Sequence[Entry], k: int, n: int) -> list[Entry]:
    """Shard K of N (round robin, so shards get similar mixes)."""
    return [e for i, e in enumerate(entries) if i % n == k - 1]


def layers_for(device: str, requested: Optional[str]) -> Optional[int]:
    if requested in (None, "auto"):
        return CPU_LAYERS if device.startswith("cpu") else None
    if requested == "all":
        return None
    try:
        n = int(requested)
    except ValueError:
        raise ConfigError(f"--layers {requested!r} is invalid; allowed: auto, all or a positive integer") from None
    if n < 1:
        raise ConfigError(f"--layers {requested!r} is invalid; allowed: auto, all or a positive integer")
    return n


# ----------------------------------------------------------------------- entry
def checkpoint_paths(ckpt_dir: Path, entry: Entry) -> tuple[Path, Path]:
    """(newest, previous) checkpoint files of an entry."""
    return ckpt_dir / f"{entry.key}.pt", ckpt_dir / f"{entry.key}.prev.pt"


def load_resume_state(ckpt_dir: Path, entry: Entry, log: Optional[TextIO] = None) -> Optional[dict]:
    """The newest readable checkpoint of ``entry`` (None: start over). A damaged or foreign file is
    renamed ``*.damaged`` (kept for inspection) and the one before it is tried, with a line on ``log``."""
    for path in checkpoint_paths(ckpt_dir, entry):
        if not path.exists():
            continue
        try:
            state = checkpoint.load(path)
            if state.get("entry") != entry.key:
                raise DataError(f"checkpoint {path} belongs to {state.get('entry')!r}, not {entry.key!r}")
            return state
        except DataError as exc:
            aside = path.with_name(path.name + ".damaged")
            path.replace(aside)
            print(f"drift nightly: {exc}; set it aside as {aside.name} and resume from the checkpoint "
                  "before it (or the entry's start)", file=log or sys.stderr)
    return None


def run_entry(entry: Entry, device: str, ckpt_dir: Optional[Path] = None,
              every: int = DEFAULT_CHECKPOINT_EVERY, resume: bool = False,
              progress: Optional[Callable[[int, int], None]] = None,
              log: Optional[TextIO] = None) -> tuple[dict, float]:
    """Run one entry (resuming from its newest good checkpoint when asked); returns (result, seconds)."""
    cfg = entry.config(device)
    mode = "sequential" if entry.variant == "sequential" else "mtp"
    run = CheckedRun(cfg, None if mode == "sequential" else entry.update, mode)
    state = load_resume_state(ckpt_dir, entry, log) if (resume and ckpt_dir is not None) else None
    prior = float(state.get("elapsed", 0.0)) if state else 0.0
    t0 = time.perf_counter()

    def save(done: int, snapshot: dict) -> None:
        newest, previous = checkpoint_paths(ckpt_dir, entry)
        if newest.exists():
            newest.replace(previous)
        checkpoint.save(newest, {"entry": entry.key, "elapsed": prior + time.perf_counter() - t0, **snapshot})

    info = run.run(progress=progress, resume_state=state, checkpoint=save if ckpt_dir is not None else None,
                   checkpoint_every=every)
    seconds = prior + time.perf_counter() - t0
    results = run.results(info)
    syncs = getattr(find_result(results, "host_syncs"), "worst", None)
    from dataclasses import replace

    full = replace(entry, layers=None).config(device)  # the preset's (the trace's) every layer
    cut = (f"{full.num_layers} -> {cfg.num_layers} GDN layers on {device}" if cfg.num_layers < full.num_layers else "")
    return {
        "entry": asdict(entry), "key": entry.key, "config": cfg.to_dict(), "cut": cut,
        "verdict": "fail" if any(r.failed for r in results) else "pass",
        "steps": info.steps, "reference": run.comparison.reference_description(),
        "verify_kernel": info.verify_kernel, "syncs_per_step": syncs, "checks": [r.to_dict() for r in results],
    }, seconds


# ---------------------------------------------------------------------- trend
def trend(current: dict, baseline: dict, factor: float = TREND_FACTOR) -> list[dict]:
    """Heads whose mean relative error at the largest horizon both reports reach grew by more
    than ``factor`` (entries matched by key)."""
    flags = []
    for key, entry in current["entries"].items():
        old = baseline.get("entries", {}).get(key)
        if old is None:
            continue
        a, b = _curve(old), _curve(entry)
        if a is None or b is None:
            continue
        common = sorted(set(a[0]) & set(b[0]))
        if not common:
            continue
        step = common[-1]
        va, vb = a[1][a[0].index(step)], b[1][b[0].index(step)]
        for l, (ra, rb) in enumerate(zip(va, vb)):
            for h, (x, y) in enumerate(zip(ra, rb)):
                if x > 0 and y > factor * x:
                    flags.append({"key": key, "layer": l, "head": h, "step": step, "baseline": x,
                                  "current": y, "ratio": y / x})
    return flags


def _curve(entry: dict):
    for c in entry["checks"]:
        if result_key(c) == "drift_bound" and c.get("bound"):
            cur = c["bound"]["curves"].get("rel_err")
            return (cur["step"], cur["mean"]) if cur else None
    return None


# --------------------------------------------------------------------- report
def assemble(results: dict[str, dict], meta: dict, timings: dict[str, float],
             baseline: Optional[dict] = None, factor: float = TREND_FACTOR) -> dict:
    report = {"schema": SCHEMA, "kind": "drift-nightly", **meta,
              "entries": {k: results[k] for k in sorted(results)},
              "timings": {k: round(v, 3) for k, v in sorted(timings.items())}}
    report["trend"] = trend(report, baseline, factor) if baseline is not None else None
    report["trend_factor"] = factor if baseline is not None else None
    report["verdict"] = "pass" if all(e["verdict"] == "pass" for e in report["entries"].values()) \
        and not report["trend"] else "fail"
    return report


def write(report: dict, out: Path) -> list[Path]:
    """report.json, report.md and the PNG plots under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "report.json", report)
    atomic_write_text(out / "report.md", nightly_markdown(report))
    return [out / "report.json", out / "report.md"] + nightly_plots(report, out)


def merge(dirs: Sequence[Path], out: Path) -> dict:
    """Combine shard reports (``drift report merge``)."""
    results, timings, meta = {}, {}, None
    for d in dirs:
        rep = read_report(Path(d) / "report.json")
        results.update(rep["entries"])
        timings.update(rep.get("timings", {}))
        meta = meta or {k: rep[k] for k in ("versions", "device", "matrix") if k in rep}
    meta = {**(meta or {}), "shards": [str(d) for d in dirs]}
    report = assemble(results, meta, timings)
    write(report, out)
    return report


# ------------------------------------------------------------------------ run
def read_report(path: Path) -> dict:
    """A nightly report.json (a baseline or a shard), or DataError naming the file."""
    try:
        rep = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{path} not found; pass the report.json of an earlier nightly run") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"{path} cannot be read as JSON ({exc}); pass an intact report.json") from exc
    if not isinstance(rep, dict) or rep.get("kind") != "drift-nightly":
        raise DataError(f"{path} is not a drift nightly report (kind {rep.get('kind') if isinstance(rep, dict) else None!r})")
    return rep


def run_nightly(entries: Sequence[Entry], mine: Sequence[Entry], shard_text: str, device: str, out: Path,
                checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY, resume: bool = False,
                baseline: Optional[dict] = None, trend_factor: float = TREND_FACTOR,
                progress: Optional[Callable[[str], Callable[[int, int], None]]] = None,
                log: Optional[TextIO] = None) -> tuple[dict, list[Path]]:
    """Run this shard's entries (``mine``) and write the report under ``out``; returns the report
    and the files written."""
    log = log or sys.stderr
    (out / "entries").mkdir(parents=True, exist_ok=True)
    results, timings = {}, {}
    for e in mine:
        done_file = out / "entries" / f"{e.key}.json"
        if resume and done_file.exists():
            try:
                saved = json.loads(done_file.read_text())
                results[e.key], timings[e.key] = saved["result"], saved["seconds"]
                continue
            except (OSError, ValueError, KeyError, TypeError) as exc:
                print(f"drift nightly: finished-entry file {done_file} is damaged ({exc!r}); running "
                      f"{e.key} again", file=log)
        res, secs = run_entry(e, device, out / "checkpoints", checkpoint_every, resume,
                              progress(e.key) if progress else None, log)
        results[e.key], timings[e.key] = res, secs
        atomic_write_json(done_file, {"result": res, "seconds": secs})
        print(f"{e.key}: {res['verdict'].upper()}", file=log)
    meta = {"versions": versions(), "device": device, "matrix": [asdict(e) for e in entries], "shard": shard_text}
    report = assemble(results, meta, timings, baseline, trend_factor)
    return report, write(report, out)
