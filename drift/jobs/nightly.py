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

A run's identity (:func:`identity`) is everything its result depends on: the entry (preset, seed,
update, variant, steps, layers, trace, loop, graph), the full config it ran (profile, flow, device,
horizon, ...), drift's version and the update's source file. Every finished entry and every
checkpoint records it; ``--resume`` reuses only exact matches and says which entries it redid and
why. A report directory is locked (an advisory ``flock`` on ``DIR/.lock``) while a nightly writes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, TextIO

from .. import checkpoint
from ..config import PRESETS, Config, find_profile
from ..errors import ConfigError, DataError, DriftError
from ..fileio import atomic_write_json, atomic_write_text, read_json
from ..flows.registry import FLOWS, default_update
from ..plug.loader import load_update
from ..runner import CheckedRun, versions
from ..check.registry import find_result, result_key
from ..runspec import Resolved, RunSpec
from ..version import __version__
from .plots import nightly_plots
from .report import nightly_markdown

VARIANTS = ("rne", "stochastic", "fp32", "sequential")
# The fp32 variant's profile: fp32 states in dense tensors (CUDA's default).
FP32_PROFILE = find_profile("fp32 states in dense tensors", lambda p, lay: p.ssm_dtype == "float32" and lay.dense)
DEFAULT_PRESETS = ("qwen3.5-397b-tp16",)
# The released, sync-free update; add `--update sglang-32130` (which syncs on its tracking path
# by design) or a plug-in to compare. A default that always fails would hide regressions.
DEFAULT_UPDATES = (default_update(FLOWS[PRESETS[DEFAULT_PRESETS[0]].flow].kind),)
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
    flow: str = ""  # the state flow (drift.config.FLOWS); "": the preset's

    @property
    def key(self) -> str:
        update = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.update)
        if self.flow:  # a flow of its own names it; the preset's flow keeps the keys earlier reports have
            update = f"{self.flow}.{update}"
        if self.trace:
            stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(self.trace).name.removesuffix(".npz"))
            return f"{self.preset}.trace-{stem}{'-loop' if self.loop else ''}.seed{self.seed}.{update}.{self.variant}"
        return f"{self.preset}.seed{self.seed}.{update}.{self.variant}"

    def spec(self, device: str) -> RunSpec:
        """The entry's run (drift/runspec.py): the variant picks the rounding or the fp32 profile, and
        sequential decode (its update is the flow's default, loaded and checked but not run)."""
        return RunSpec(preset=self.preset, seed=self.seed, steps=self.steps, device=device, flow=self.flow or None,
                       trace=self.trace or None, loop=self.loop, no_graph=not self.graph, layers=self.layers,
                       profile=FP32_PROFILE if self.variant == "fp32" else None,
                       rounding=None if self.variant == "fp32" else
                       ("stochastic" if self.variant == "stochastic" else "rne"),
                       update=None if self.update == "-" else self.update,
                       mode="sequential" if self.variant == "sequential" else "mtp")

    def resolve(self, device: str) -> Resolved:
        """The entry's run resolved (the update's own flow when the entry names none)."""
        return self.spec(device).resolve()

    def config(self, device: str) -> Config:
        return self.resolve(device).cfg


def build_matrix(presets: Sequence[str], seeds: Sequence[int], updates: Sequence[str], variants: Sequence[str],
                 steps: Optional[int], layers: Optional[int], trace: str = "", loop: bool = False,
                 graph: bool = True, flow: str = "") -> list[Entry]:
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
                    out.append(Entry(p, s, update, v, steps, layers, trace, loop, graph, flow))
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


# -------------------------------------------------------------------- identity
def _source_hash(spec: str) -> Optional[str]:
    """sha256 (16 hex) of the file an update spec's code lives in; None for sequential decode."""
    if spec == "-":
        return None
    source = load_update(spec).source.rsplit(":", 1)[0]
    try:
        return hashlib.sha256(Path(source).read_bytes()).hexdigest()[:16] if source else None
    except OSError:
        return None


def identity(entry: Entry, device: str) -> dict:
    """Everything an entry's result depends on (see the module docstring), JSON-comparable."""
    cfg = entry.config(device)
    ident = {"entry": asdict(entry), "config": {**cfg.to_dict(), "profile": cfg.profile}, "drift": __version__,
             "update_source_sha256": _source_hash(entry.update)}
    return json.loads(json.dumps(ident, sort_keys=True))  # as a file holds it: tuples are lists


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def identity_diff(saved: object, wanted: dict) -> str:
    """Why ``saved`` (an identity read back, or None) is not ``wanted``: the differing fields."""
    if not isinstance(saved, dict):
        return "it records no configuration (written by an older drift)"
    a, b = _flatten(saved), _flatten(wanted)
    diff = [f"{k} {a.get(k, '(none)')!r} -> {b.get(k, '(none)')!r}" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and not k.startswith("entry.")]
    diff = diff or [f"{k} {a.get(k, '(none)')!r} -> {b.get(k, '(none)')!r}" for k in sorted(set(a) | set(b))
                    if a.get(k) != b.get(k)]
    return "it was made with " + ", ".join(diff[:6]) + (f" and {len(diff) - 6} more" if len(diff) > 6 else "")


# ----------------------------------------------------------------------- entry
def checkpoint_paths(ckpt_dir: Path, entry: Entry) -> tuple[Path, Path]:
    """(newest, previous) checkpoint files of an entry."""
    return ckpt_dir / f"{entry.key}.pt", ckpt_dir / f"{entry.key}.prev.pt"


def load_resume_state(ckpt_dir: Path, entry: Entry, log: Optional[TextIO] = None,
                      wanted: Optional[dict] = None) -> Optional[dict]:
    """The newest readable checkpoint of ``entry`` made with identity ``wanted`` (None: start
    over). A damaged or foreign file is renamed ``*.damaged``, one of another configuration
    ``*.stale`` (both kept for inspection), and the one before it is tried, with a line on ``log``."""
    for path in checkpoint_paths(ckpt_dir, entry):
        if not os.path.lexists(path):
            continue
        suffix, why = ".damaged", "resume from the checkpoint before it (or the entry's start)"
        try:
            state = checkpoint.load(path)
            if state.get("entry") != entry.key:
                raise DataError(f"checkpoint {path} belongs to {state.get('entry')!r}, not {entry.key!r}")
            if wanted is not None and state.get("identity") != wanted:
                suffix = ".stale"
                raise DataError(f"checkpoint {path} is of another configuration: "
                                f"{identity_diff(state.get('identity'), wanted)}")
            return state
        except DataError as exc:
            aside = path.with_name(path.name + suffix)
            path.replace(aside)
            print(f"drift nightly: {exc}; set it aside as {aside.name} and {why}", file=log or sys.stderr)
    return None


def run_entry(entry: Entry, device: str, ckpt_dir: Optional[Path] = None,
              every: int = DEFAULT_CHECKPOINT_EVERY, resume: bool = False,
              progress: Optional[Callable[[int, int], None]] = None,
              log: Optional[TextIO] = None) -> tuple[dict, float]:
    """Run one entry (resuming from its newest good checkpoint when asked); returns (result, seconds)."""
    resolved = entry.resolve(device)
    cfg = resolved.cfg
    run = CheckedRun(resolved)
    ident = identity(entry, device)
    state = load_resume_state(ckpt_dir, entry, log, ident) if (resume and ckpt_dir is not None) else None
    prior = float(state.get("elapsed", 0.0)) if state else 0.0
    t0 = time.perf_counter()

    def save(done: int, snapshot: dict) -> None:
        newest, previous = checkpoint_paths(ckpt_dir, entry)
        if newest.exists():
            newest.replace(previous)
        checkpoint.save(newest, {"entry": entry.key, "identity": ident, "elapsed": prior + time.perf_counter() - t0,
                                 **snapshot})

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
                if x is not None and y is not None and x > 0 and y > factor * x:
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
    if baseline is not None:  # entries the trend could not compare: the baseline has no entry of their key
        report["trend_unmatched"] = sorted(k for k in report["entries"] if k not in baseline.get("entries", {}))
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
    """A nightly report.json (a baseline or a shard), its structure checked (every field the
    trend and a merge read), or DataError naming the file and the field."""
    fix = "pass the report.json an earlier drift nightly wrote, intact"
    rep = read_json(path, "nightly report", fix)
    if not isinstance(rep, dict) or rep.get("kind") != "drift-nightly":
        kind = rep.get("kind") if isinstance(rep, dict) else None
        raise DataError(f"{path} is not a drift nightly report (kind {kind!r}); {fix}")

    def bad(field: str, problem: str) -> DataError:
        return DataError(f"nightly report {path}: {field} {problem}; {fix}")

    if not isinstance(rep.get("entries"), dict):
        raise bad("'entries'", f"is a {type(rep.get('entries')).__name__}, not an object of entries by key")
    if not isinstance(rep.get("timings", {}), dict):
        raise bad("'timings'", "is not an object")
    for key, entry in rep["entries"].items():
        if not isinstance(entry, dict) or entry.get("verdict") not in ("pass", "fail") \
                or not isinstance(entry.get("checks"), list) or not all(isinstance(c, dict) for c in entry["checks"]):
            raise bad(f"entry {key!r}", "is not a result object (verdict pass/fail, checks a list of objects)")
        try:
            curve = _curve(entry)
            if curve is not None:
                steps, mean = curve
                if not (isinstance(steps, list) and isinstance(mean, list) and len(steps) == len(mean)):
                    raise TypeError("steps and mean are not two lists of one length")
                for row in mean:  # [layers][heads] per step; null where a run went non-finite
                    for x in (x for layer in row for x in layer):
                        if x is not None:
                            float(x)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise bad(f"entry {key!r}", f"has a malformed drift-bound curve ({exc!r})") from None
    return rep


def match_baseline(baseline: dict, keys: Sequence[str], path: Path) -> list[str]:
    """The keys of this run that ``baseline`` has no entry for (a trend compares entries by key);
    ConfigError naming both key sets when it matches none."""
    theirs = set(baseline["entries"])
    unmatched = [k for k in keys if k not in theirs]
    if keys and len(unmatched) == len(keys):
        raise ConfigError(f"--baseline {path} matches no entry of this run, so no trend could be computed: "
                          f"this run's keys are {', '.join(sorted(keys))}; the baseline's are "
                          f"{', '.join(sorted(theirs)) or '(none)'}; pass the report of a run of the same matrix")
    return unmatched


@contextlib.contextmanager
def locked(out: Path) -> Iterator[None]:
    """Hold an advisory lock on report directory ``out`` (``out/.lock``, holding the pid); a second
    nightly on the same directory gets ConfigError naming the holder."""
    path = out / ".lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise ConfigError(f"--report {out} is in use by another drift nightly (pid {holder}); wait for it to "
                              "finish, or pass another --report directory") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the lock


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
        ident = identity(e, device)
        if resume and os.path.lexists(done_file):
            try:
                saved = read_json(done_file, "finished-entry file", "it is run again")
                if saved.get("identity") != ident:
                    print(f"drift nightly: redoing {e.key}: its finished result {done_file} is of another "
                          f"configuration ({identity_diff(saved.get('identity'), ident)})", file=log)
                else:
                    results[e.key], timings[e.key] = saved["result"], float(saved["seconds"])
                    continue
            except (DriftError, AttributeError, KeyError, TypeError, ValueError) as exc:
                print(f"drift nightly: redoing {e.key}: finished-entry file {done_file} is damaged ({exc})", file=log)
        res, secs = run_entry(e, device, out / "checkpoints", checkpoint_every, resume,
                              progress(e.key) if progress else None, log)
        results[e.key], timings[e.key] = res, secs
        atomic_write_json(done_file, {"result": res, "seconds": secs, "identity": ident})
        print(f"{e.key}: {res['verdict'].upper()}", file=log)
    meta = {"versions": versions(), "device": device, "matrix": [asdict(e) for e in entries], "shard": shard_text}
    report = assemble(results, meta, timings, baseline, trend_factor)
    return report, write(report, out)
