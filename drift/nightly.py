"""Nightly long-horizon drift runs: a resumable, shardable matrix with a readable report.

The matrix is presets x seeds x implementations x store modes:

  rne         MTP, bf16 state stored round-to-nearest (the deployment)
  stochastic  MTP, bf16 state stored with stochastic rounding
  fp32        MTP, fp32 state (CUDA's default profile)
  sequential  non-MTP decode of the same stream, bf16 round-to-nearest after every token
              (no update is involved: one entry per preset and seed)

Each entry is a checked run (every check of ``drift run``, the float64 twin or golden as
reference) to a long horizon, checkpointed every N steps; ``--resume`` continues a killed
run and reproduces the uninterrupted report byte for byte (timings aside, which live in
the report's ``timings`` entry only).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from . import checkpoint
from .config import PRESETS, Config, ConfigError, preset
from .devices import DeviceUnavailable, resolve_device
from .fileio import atomic_write_json
from .loader import LoadError
from .runner import CheckedRun
from .simulate import UpdateRaised

STORE_MODES = ("rne", "stochastic", "fp32", "sequential")
DEFAULT_PRESETS = ("qwen3.5-397b-tp16",)
# The sync-free implementation; add `--impl sync_free` (which syncs on its tracking path by
# design) or a plug-in to compare. A default that always fails would hide regressions.
DEFAULT_IMPLS = ("device_select",)
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
    """One cell of the matrix."""

    preset: str
    seed: int
    impl: str  # update spec; "-" for sequential decode
    mode: str
    steps: int
    layers: Optional[int] = None  # None: all of the preset's

    @property
    def key(self) -> str:
        impl = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.impl)
        return f"{self.preset}.seed{self.seed}.{impl}.{self.mode}"

    def config(self, device: str) -> Config:
        cfg = preset(self.preset, seed=self.seed, steps=self.steps, device=device)
        if self.layers is not None and self.layers < cfg.num_layers:
            cfg = cfg.replace(num_layers=self.layers)
        if self.mode == "fp32":
            return cfg.with_profile("fp32")
        return cfg.replace(store_rounding="stochastic" if self.mode == "stochastic" else "rne")


def build_matrix(presets: Sequence[str], seeds: Sequence[int], impls: Sequence[str], modes: Sequence[str],
                 steps: int, layers: Optional[int]) -> list[Entry]:
    out = []
    for p in presets:
        if p not in PRESETS:
            raise ConfigError(f"preset={p!r} is not known; allowed: {', '.join(PRESETS)}")
        for s in seeds:
            for m in modes:
                if m not in STORE_MODES:
                    raise ConfigError(f"mode={m!r} is not known; allowed: {', '.join(STORE_MODES)}")
                for impl in (["-"] if m == "sequential" else impls):
                    out.append(Entry(p, s, impl, m, steps, layers))
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
def run_entry(entry: Entry, device: str, ckpt_dir: Optional[Path] = None,
              every: int = DEFAULT_CHECKPOINT_EVERY, resume: bool = False,
              progress: Optional[Callable[[int, int], None]] = None) -> tuple[dict, float]:
    """Run one entry (resuming from its checkpoint when asked); returns (result, seconds)."""
    cfg = entry.config(device)
    mode = "sequential" if entry.mode == "sequential" else "mtp"
    run = CheckedRun(cfg, None if mode == "sequential" else entry.impl, mode)
    path = ckpt_dir / f"{entry.key}.pt" if ckpt_dir is not None else None
    state = checkpoint.load(path) if (resume and path is not None and path.exists()) else None
    if state is not None and state.get("entry") != entry.key:
        raise RuntimeError(f"checkpoint {path} belongs to {state.get('entry')!r}, not {entry.key!r}; delete it")
    prior = float(state.get("elapsed", 0.0)) if state else 0.0
    t0 = time.perf_counter()

    def save(done: int, snapshot: dict) -> None:
        checkpoint.save(path, {"entry": entry.key, "elapsed": prior + time.perf_counter() - t0, **snapshot})

    info = run.run(progress=progress, resume_state=state, checkpoint=save if path is not None else None,
                   checkpoint_every=every)
    seconds = prior + time.perf_counter() - t0
    results = run.results(info)
    syncs = next((r.worst for r in results if r.name == "host syncs"), None)
    full = preset(entry.preset)
    cut = (f"{full.num_layers} -> {cfg.num_layers} GDN layers on {device}" if cfg.num_layers < full.num_layers else "")
    gated = [r for r in results if r.extra.get("kind") != "info" and r.applicable]
    return {
        "entry": asdict(entry), "key": entry.key, "config": cfg.to_dict(), "cut": cut,
        "verdict": "pass" if all(r.passed for r in gated) else "fail",
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
        if c["name"] == "drift bound" and c.get("bound"):
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
    from .plots import nightly_plots
    from .report import nightly_markdown
    from .fileio import atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "report.json", report)
    atomic_write_text(out / "report.md", nightly_markdown(report))
    return [out / "report.json", out / "report.md"] + nightly_plots(report, out)


def merge(dirs: Sequence[Path], out: Path) -> dict:
    """Combine shard reports (``drift report merge``)."""
    results, timings, meta = {}, {}, None
    for d in dirs:
        path = Path(d) / "report.json"
        if not path.exists():
            raise ConfigError(f"{path} not found; pass the --report directories of the shards")
        rep = json.loads(path.read_text())
        if rep.get("kind") != "drift-nightly":
            raise ConfigError(f"{path} is not a nightly report")
        results.update(rep["entries"])
        timings.update(rep.get("timings", {}))
        meta = meta or {k: rep[k] for k in ("versions", "device", "matrix") if k in rep}
    meta = {**(meta or {}), "shards": [str(d) for d in dirs]}
    report = assemble(results, meta, timings)
    write(report, out)
    return report


# ------------------------------------------------------------------------ CLI
def main(argv: Optional[Sequence[str]] = None) -> int:
    from .report import progress_printer
    from .runner import versions

    ap = argparse.ArgumentParser(prog="drift nightly", description="Long-horizon drift matrix with a report.")
    ap.add_argument("--preset", action="append", help=f"(repeatable; default {', '.join(DEFAULT_PRESETS)})")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    ap.add_argument("--impl", action="append", help=f"update spec (repeatable; default {', '.join(DEFAULT_IMPLS)})")
    ap.add_argument("--modes", default=",".join(STORE_MODES), help=f"comma-separated of {', '.join(STORE_MODES)}")
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"decode steps (default {DEFAULT_STEPS})")
    ap.add_argument("--layers", default="auto", help=f"auto ({CPU_LAYERS} on cpu, all elsewhere), all, or N")
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda or npu")
    ap.add_argument("--report", type=Path, default=Path("nightly-report"), help="report directory")
    ap.add_argument("--checkpoint-every", type=int, default=DEFAULT_CHECKPOINT_EVERY)
    ap.add_argument("--resume", action="store_true", help="continue from checkpoints and finished entries")
    ap.add_argument("--shard", help="run shard K of N (K/N), e.g. 2/4")
    ap.add_argument("--baseline", type=Path, help="previous report.json: flag heads whose error grew")
    ap.add_argument("--trend-factor", type=float, default=TREND_FACTOR)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    try:
        if args.steps < 1 or args.checkpoint_every < 1:
            raise ConfigError("--steps and --checkpoint-every must be positive integers")
        resolve_device(args.device)
        layers = layers_for(args.device, args.layers)
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        entries = build_matrix(args.preset or DEFAULT_PRESETS, seeds, args.impl or DEFAULT_IMPLS, modes,
                               args.steps, layers)
        k, n = parse_shard(args.shard)
        mine = shard(entries, k, n)
        baseline = json.loads(args.baseline.read_text()) if args.baseline else None
    except (ConfigError, DeviceUnavailable, ValueError, OSError) as exc:
        print(f"drift nightly: error: {exc}", file=sys.stderr)
        return 2
    out = args.report
    (out / "entries").mkdir(parents=True, exist_ok=True)
    results, timings = {}, {}
    print(f"drift nightly: {len(mine)} of {len(entries)} entries (shard {k}/{n}), {args.steps} steps each, "
          f"device {args.device}" + (f", at most {layers} layers per preset" if layers else ""), file=sys.stderr)
    for e in mine:
        done_file = out / "entries" / f"{e.key}.json"
        if args.resume and done_file.exists():
            saved = json.loads(done_file.read_text())
            results[e.key], timings[e.key] = saved["result"], saved["seconds"]
            continue
        prog = None if args.quiet else progress_printer(e.key)
        try:
            res, secs = run_entry(e, args.device, out / "checkpoints", args.checkpoint_every, args.resume, prog)
        except (ConfigError, LoadError) as exc:
            print(f"drift nightly: error in {e.key}: {exc}", file=sys.stderr)
            return 2
        except UpdateRaised as exc:
            print(f"drift nightly: FAIL in {e.key}: {exc}", file=sys.stderr)
            return 1
        results[e.key], timings[e.key] = res, secs
        atomic_write_json(done_file, {"result": res, "seconds": secs})
        print(f"{e.key}: {res['verdict'].upper()}", file=sys.stderr)
    meta = {"versions": versions(), "device": args.device, "matrix": [asdict(e) for e in entries],
            "shard": f"{k}/{n}"}
    report = assemble(results, meta, timings, baseline, args.trend_factor)
    for p in write(report, out):
        print(f"wrote {p}")
    if report["trend"]:
        print(f"drift nightly: {len(report['trend'])} head(s) regressed past {args.trend_factor}x the baseline",
              file=sys.stderr)
    return 0 if report["verdict"] == "pass" else 1


def report_main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="drift report", description="Report tools.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="combine shard reports into one")
    m.add_argument("dirs", nargs="+", type=Path, help="--report directories of the shards")
    m.add_argument("-o", "--out", type=Path, required=True, help="output directory")
    args = ap.parse_args(argv)
    try:
        rep = merge(args.dirs, args.out)
    except ConfigError as exc:
        print(f"drift report: error: {exc}", file=sys.stderr)
        return 2
    print(f"merged {len(rep['entries'])} entries into {args.out}")
    return 0 if rep["verdict"] == "pass" else 1
