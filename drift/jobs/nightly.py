"""Nightly long-horizon drift runs: a resumable, shardable matrix with a readable report.

The matrix is presets x seeds x updates x variants:

  rne         MTP, bf16 state stored round-to-nearest (the deployment)
  stochastic  MTP, bf16 state stored with stochastic rounding
  fp32        MTP, fp32 state (CUDA's default profile)
  sequential  non-MTP decode of the same stream, bf16 round-to-nearest after every token
              (no update is involved: one entry per preset and seed)

Each entry is a checked run (every check of ``drift run``, the float64 twin or golden as
reference) to a long horizon, checkpointed every N steps; a resumed run continues a killed one
and reproduces the uninterrupted report.json byte for byte except its ``timings`` block (wall-clock
seconds), and report.md and the plots exactly. While an entry runs, its two newest checkpoints are
kept: a damaged newest one is set aside and the run resumes from the one before (or starts the
entry over), saying so. A finished entry keeps none (its result is in ``entries/``) unless asked
to keep its last.

A run's identity (:func:`identity`) is everything its result depends on: the entry (preset, seed,
update, variant, steps, layers, trace, loop, graph), the full config it ran (profile, flow, device,
horizon, ...), drift's version, the update's code by content, the checks with their limits, the
extensions, and what computes the figures (the CPU architecture, torch, numpy, Python, MKL's code path)
(drift/jobs/identity.py). Every finished entry, every checkpoint and every report entry
records it; ``--resume`` reuses only exact matches and says which entries it redid and why, and
``drift report merge`` combines only the shards of one matrix made alike. A baseline pairs entries
by configuration, not by key (:func:`drift.jobs.identity.pair`). A report directory is locked
(drift/fileio.py: locked) while a nightly writes it, and its report files are replaced as one unit.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, TextIO

from .. import checkpoint
from ..config import PRESETS, Config, find_profile, flow_options
from ..errors import ConfigError, DataError, DriftError
from ..fileio import atomic_write_json, atomic_write_text, read_json, staged
from ..flows.base import DesignConfig
from ..flows.registry import FLOW_KINDS, FLOWS, default_update, flows_of
from ..openmp import run_threads
from ..runner import CheckedRun, versions
from ..check.metrics import BINS_PER_OCTAVE
from ..check.registry import find_result, result_key
from ..runspec import Resolved, RunSpec
from ..version import __version__
from .identity import checks_identity, differences, extensions_identity, numerics_identity, pair, update_identity
from .plots import nightly_plots
from .report import NIGHTLY_FILES, nightly_markdown

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
    flow_options: tuple = ()  # Config.flow_options (sorted name/value pairs); (): the kind's defaults
    lifecycle: str = "fixed"  # how requests come and go (drift/lifecycles.py); the nightly's long horizon: fixed

    def __post_init__(self) -> None:  # read back from JSON: lists of [name, value]
        object.__setattr__(self, "flow_options", tuple(tuple(p) for p in self.flow_options))

    @property
    def key(self) -> str:
        update = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.update)
        if self.flow_options:  # the design's choices, as name-value
            update += "+" + "+".join(re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{n}-{v}") for n, v in self.flow_options)
        if self.flow:  # a flow of its own names it; the preset's flow keeps the keys earlier reports have
            update = f"{self.flow}.{update}"
        if self.trace:
            stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(self.trace).name.removesuffix(".npz"))
            return f"{self.preset}.trace-{stem}{'-loop' if self.loop else ''}.seed{self.seed}.{update}.{self.variant}"
        life = "" if self.lifecycle == "fixed" else f".{self.lifecycle}"  # the fixed batch keeps earlier keys
        return f"{self.preset}{life}.seed{self.seed}.{update}.{self.variant}"

    def spec(self, device: str) -> RunSpec:
        """The entry's run (drift/runspec.py): the variant picks the rounding or the fp32 profile, and
        sequential decode (its update is the flow's default, loaded and checked but not run)."""
        return RunSpec(preset=self.preset, seed=self.seed, steps=self.steps, device=device, flow=self.flow or None,
                       lifecycle=self.lifecycle,
                       trace=self.trace or None, loop=self.loop, no_graph=not self.graph, layers=self.layers,
                       profile=FP32_PROFILE if self.variant == "fp32" else None,
                       rounding=None if self.variant == "fp32" else
                       ("stochastic" if self.variant == "stochastic" else "rne"),
                       update=None if self.update == "-" else self.update, flow_options=self.flow_options,
                       mode="sequential" if self.variant == "sequential" else "mtp")

    def resolve(self, device: str) -> Resolved:
        """The entry's run resolved (the update's own flow when the entry names none)."""
        return self.spec(device).resolve()

    def config(self, device: str) -> Config:
        return self.resolve(device).cfg


def entry_dict(entry: Entry) -> dict:
    """An entry as its report records it: without ``flow_options`` when the design is the kind's
    default, nor ``lifecycle`` for the fixed batch (the form reports of earlier drifts have, so their
    entries pair and merge as before)."""
    d = asdict(entry)
    if not entry.flow_options:
        del d["flow_options"]
    if entry.lifecycle == "fixed":  # likewise the fixed batch
        del d["lifecycle"]
    return d


def build_matrix(presets: Sequence[str], seeds: Sequence[int], updates: Sequence[str], variants: Sequence[str],
                 steps: Optional[int], layers: Optional[int], trace: str = "", loop: bool = False,
                 graph: bool = True, flow: str = "", flow_options: tuple = (),
                 lifecycle: str = "fixed") -> list[Entry]:
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
                    # sequential decode keeps no MTP state: the flow's design does not reach it
                    out.append(Entry(p, s, update, v, steps, layers, trace, loop, graph, flow,
                                     () if v == "sequential" else flow_options, lifecycle=lifecycle))
    return out


def design_variant(design: DesignConfig) -> str:
    """The variant that runs a design configuration's checkpoint: ``fp32`` (the fp32 profile) for an
    fp32 checkpoint, else its store rounding (``rne`` or a declared ``stochastic``)."""
    if design.ssm_dtype == "float32":
        return "fp32"
    return "stochastic" if design.store_rounding == "stochastic" else "rne"


def design_matrix(which: str, presets: Sequence[str], seeds: Sequence[int], steps: Optional[int],
                  layers: Optional[int], graph: bool = True, flow: str = "") -> list[Entry]:
    """Each flow kind's design configurations (``FlowKind.NIGHTLY_DESIGNS`` for ``which="nightly"``,
    ``TRADEOFF_DESIGNS`` for ``"table"``; only ``flow``'s kind when given), in its first flow (or
    ``flow``) with its default update, each on its checkpoint's variant, per preset and seed."""
    out = []
    for kind_name, kind in FLOW_KINDS.items():
        flows = flows_of(kind_name)
        if not flows or (flow and FLOWS[flow].kind != kind_name):
            continue
        designs = kind.NIGHTLY_DESIGNS if which == "nightly" else kind.TRADEOFF_DESIGNS
        for p in presets:
            for s in seeds:
                for d in designs:
                    out.append(Entry(p, s, default_update(kind_name), design_variant(d), steps, layers, graph=graph,
                                     flow=flow or flows[0], flow_options=flow_options(d.options)))
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
def mode_of(variant: str) -> str:
    """The decode mode of an entry of ``variant``: sequential decode for its variant, else MTP."""
    return "sequential" if variant == "sequential" else "mtp"


def identity(entry: Entry, device: str, run: Optional[Resolved] = None) -> dict:
    """Everything an entry's result depends on (see the module docstring), JSON-comparable;
    ``run``: the entry already resolved on ``device`` (resolved here when not given)."""
    run = run if run is not None else entry.resolve(device)
    cfg = run.cfg
    ident = {"entry": entry_dict(entry), "config": {**cfg.to_dict(), "profile": cfg.profile}, "drift": __version__,
             "update": None if entry.update == "-" else update_identity(run.update),
             "checks": checks_identity(cfg, run.mode), "extensions": extensions_identity(),
             "numerics": numerics_identity()}
    return json.loads(json.dumps(ident, sort_keys=True))  # as a file holds it: tuples are lists


def _listed(items: Sequence[str], most: int = 6, sep: str = ", ") -> str:
    return sep.join(items[:most]) + (f"{sep}and {len(items) - most} more" if len(items) > most else "")


def identity_diff(saved: object, wanted: dict) -> str:
    """Why ``saved`` (an identity read back, or None) is not ``wanted``: the differing fields."""
    if not isinstance(saved, dict):
        return "it records no configuration (written by an older drift)"
    diff = differences(saved, wanted)
    return "it was made with " + _listed([d for d in diff if not d.startswith("entry.")] or diff)


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
    ident = identity(entry, device, resolved)
    state = load_resume_state(ckpt_dir, entry, log, ident) if (resume and ckpt_dir is not None) else None
    prior = float(state.get("elapsed", 0.0)) if state else 0.0
    t0 = time.perf_counter()

    def save(done: int, snapshot: dict) -> None:
        newest, previous = checkpoint_paths(ckpt_dir, entry)
        if newest.exists():
            newest.replace(previous)
        checkpoint.save(newest, {"entry": entry.key, "identity": ident, "elapsed": prior + time.perf_counter() - t0,
                                 **snapshot})

    # A small run on one intra-op thread, as run_checked's, so its comparison may run in a process of its own
    # (drift/openmp.py: run_threads; drift.check.pipeline.worth_a_worker).
    with run_threads(cfg):
        info = run.run(progress=progress, resume_state=state, checkpoint=save if ckpt_dir is not None else None,
                       checkpoint_every=every)
    seconds = prior + time.perf_counter() - t0
    results = run.results(info)
    syncs = getattr(find_result(results, "host_syncs"), "worst", None)
    from dataclasses import replace

    full = replace(entry, layers=None).config(device)  # the preset's (the trace's) every layer
    cut = (f"{full.num_layers} -> {cfg.num_layers} GDN layers on {device}" if cfg.num_layers < full.num_layers else "")
    return {
        "entry": entry_dict(entry), "key": entry.key, "config": cfg.to_dict(), "cut": cut,
        "verdict": "fail" if any(r.failed for r in results) else "pass",
        "steps": info.steps, "reference": run.comparison.reference_description(),
        "verify_kernel": info.verify_kernel, "syncs_per_step": syncs, "checks": [r.to_dict() for r in results],
    }, seconds


# ---------------------------------------------------------------------- trend
def trend(current: dict, baseline: dict, factor: float = TREND_FACTOR,
          pairs: Optional[dict[str, str]] = None) -> list[dict]:
    """Heads whose mean relative error at the largest horizon both reports reach grew by more
    than ``factor``; each entry against its baseline entry (``pairs``: key -> baseline key,
    default :func:`drift.jobs.identity.pair`). ``step``: the last step of that log bin both runs
    reached (an integer)."""
    flags = []
    pairs = pair(current["entries"], baseline.get("entries", {})) if pairs is None else pairs
    for key, entry in current["entries"].items():
        old = baseline.get("entries", {}).get(pairs.get(key))
        if old is None:
            continue
        a, b = _curve(old), _curve(entry)
        if a is None or b is None:
            continue
        common = sorted(set(a[0]) & set(b[0]))
        if not common:
            continue
        centre = common[-1]
        va, vb = a[1][a[0].index(centre)], b[1][b[0].index(centre)]
        step = _last_step(centre, old.get("steps"), entry.get("steps"))
        for l, (ra, rb) in enumerate(zip(va, vb)):
            for h, (x, y) in enumerate(zip(ra, rb)):
                if x is not None and y is not None and x > 0 and y > factor * x:
                    flags.append({"key": key, "baseline_key": pairs[key], "layer": l, "head": h, "step": step,
                                  "baseline": x, "current": y, "ratio": y / x})
    return flags


def _last_step(centre: float, *horizons: Optional[int]) -> int:
    """The last step of the log bin whose centre (drift/check/metrics.py: bin_center, in the
    report rounded to 0.01) is ``centre``, at most each run's horizon: steps s with
    floor(log2(s + 1) * BINS_PER_OCTAVE) = b end below 2^((b + 1) / BINS_PER_OCTAVE) - 1."""
    b = round(math.log2(centre + 1.0) * BINS_PER_OCTAVE - 0.5)
    last = math.ceil(2.0 ** ((b + 1) / BINS_PER_OCTAVE)) - 2
    return int(min([last] + [int(h) for h in horizons if isinstance(h, int)]))


def _curve(entry: dict):
    for c in entry["checks"]:
        if result_key(c) == "drift_bound" and c.get("bound"):
            cur = c["bound"]["curves"].get("rel_err")
            return (cur["step"], cur["mean"]) if cur else None
    return None


# --------------------------------------------------------------------- report
def assemble(results: dict[str, dict], meta: dict, timings: dict[str, float],
             baseline: Optional[dict] = None, factor: float = TREND_FACTOR) -> dict:
    """The report of ``results`` (entries by key). ``timings`` (wall-clock seconds per entry, a
    resumed entry's summed over the runs that computed it) are the only part two runs of the same
    matrix may differ in."""
    report = {"schema": SCHEMA, "kind": "drift-nightly", **meta,
              "entries": {k: results[k] for k in sorted(results)},
              "timings": {k: round(v, 3) for k, v in sorted(timings.items())}}
    pairs = pair(report["entries"], baseline.get("entries", {})) if baseline is not None else {}
    report["trend"] = trend(report, baseline, factor, pairs) if baseline is not None else None
    if baseline is not None:  # each entry's baseline entry; those the trend could not compare
        report["trend_pairs"] = pairs
        report["trend_unmatched"] = sorted(k for k in report["entries"] if k not in pairs)
    report["trend_factor"] = factor if baseline is not None else None
    report["verdict"] = "pass" if all(e["verdict"] == "pass" for e in report["entries"].values()) \
        and not report["trend"] else "fail"
    return report


def write(report: dict, out: Path, baseline: Optional[dict] = None) -> list[Path]:
    """report.json, report.md and the PNG plots (the baseline's curves overlaid) under ``out``,
    replaced as one unit (drift/fileio.py: staged)."""
    out.mkdir(parents=True, exist_ok=True)
    with staged(out, NIGHTLY_FILES) as stage:
        atomic_write_json(stage / "report.json", report)
        atomic_write_text(stage / "report.md", nightly_markdown(report))
        plots = nightly_plots(report, stage, baseline)
    return [out / "report.json", out / "report.md"] + [out / p.name for p in plots]


def check_shards(shards: Sequence[tuple[Path, dict]]) -> tuple[int, list[dict]]:
    """``(N, matrix)`` when ``shards`` (directory, report) are shards 1..N of one matrix, each
    once, holding exactly their own entries, made alike (:func:`_unlike`); else ConfigError
    naming every problem."""
    (first_dir, first), by_shard, holders = shards[0], defaultdict(list), defaultdict(list)
    problems = [f"{d} differs from {first_dir} in its {field} "
                f"({_listed(differences({field: first.get(field)}, {field: rep.get(field)}), 3)})"
                for d, rep in shards[1:] for field in ("matrix", "device", "versions") if rep.get(field) != first.get(field)]
    for d, rep in shards:
        try:
            by_shard[parse_shard(rep.get("shard") if isinstance(rep.get("shard"), str) else "?")].append(d)
        except ConfigError:
            problems.append(f"{d} is not one shard of a nightly run (its shard is {rep.get('shard')!r})")
        for key in rep["entries"]:
            holders[key].append(str(d))
    splits = sorted({n for _, n in by_shard})
    if len(splits) > 1:
        problems.append("the shards split the matrix differently (" + ", ".join(f"{k}/{n}" for k, n in by_shard) + ")")
    n = splits[0] if splits else 1
    problems += [f"shard {k}/{n} is missing" for k in range(1, n + 1) if (k, n) not in by_shard]
    problems += [f"shard {k}/{m} is given {len(ds)} times ({', '.join(map(str, ds))})"
                 for (k, m), ds in by_shard.items() if len(ds) > 1]
    problems += [f"entry {key} is in {len(ds)} shards ({', '.join(ds)})" for key, ds in holders.items() if len(ds) > 1]
    if not problems:  # each shard holds its own part of the matrix
        try:
            matrix = [Entry(**m) for m in first.get("matrix") or []]
        except TypeError as exc:
            raise DataError(f"{first_dir}: its matrix is not of this drift's entries ({exc}); merge the reports "
                            "of this drift's nightly") from None
        for (k, _), (d,) in sorted(by_shard.items()):
            want, have = {e.key for e in shard(matrix, k, n)}, set(dict(shards)[d]["entries"])
            problems += [f"{d} (shard {k}/{n}) lacks entry {key}" for key in sorted(want - have)]
            problems += [f"{d} (shard {k}/{n}) holds entry {key}, which is not of its shard" for key in sorted(have - want)]
    problems += _unlike(shards)
    if problems:
        raise ConfigError("these reports are not the shards of one nightly run: " + _listed(problems, 8, "; ")
                          + "; merge every shard directory of one run (the same matrix and options, each shard once)")
    return n, first.get("matrix")


def _unlike(shards: Sequence[tuple[Path, dict]]) -> list[str]:
    """What differs between the entries' identities where they must be alike: drift's version, the
    extensions, per update its code, per decode mode the checks, what computes the figures; an entry
    without an identity."""
    problems, facets = [], defaultdict(lambda: defaultdict(list))  # what must be alike -> value (JSON) -> where
    for d, rep in shards:
        for key, e in rep["entries"].items():
            ident = e.get("identity")
            if not isinstance(ident, dict) or not {"entry", "update", "checks", "extensions", "drift"} <= set(ident):
                problems.append(f"entry {key} of {d} records no identity (written by an older drift): run that "
                                "shard again")
                continue
            for facet, value in (("drift's version", ident["drift"]), ("the extensions", ident["extensions"]),
                                 (f"the code of update {ident['entry'].get('update')}", ident["update"]),
                                 (f"the checks of {mode_of(ident['entry'].get('variant'))} entries", ident["checks"]),
                                 ("what computes the figures", ident.get("numerics"))):
                facets[facet][json.dumps(value, sort_keys=True)].append(f"{key} of {d}")
    for facet, values in facets.items():
        if len(values) > 1:
            (a, (where_a, *_)), (b, (where_b, *_)) = list(values.items())[:2]
            problems.append(f"{facet} differs between {where_a} and {where_b} "
                            f"({_listed(differences(json.loads(a), json.loads(b)), 3)})")
    return problems


def merge(dirs: Sequence[Path], out: Path) -> dict:
    """Combine shard reports (``drift report merge``), after :func:`check_shards`."""
    shards = [(Path(d), read_report(Path(d) / "report.json")) for d in dirs]
    n, matrix = check_shards(shards)
    results, timings = {}, {}
    for _, rep in shards:
        results.update(rep["entries"])
        timings.update(rep.get("timings", {}))
    first = shards[0][1]
    meta = {"versions": first.get("versions"), "device": first.get("device"), "matrix": matrix,
            "shard": "merged " + ", ".join(f"{k}/{n}" for k in range(1, n + 1)), "shards": [str(d) for d in dirs]}
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


def match_baseline(baseline: dict, identities: dict[str, dict], path: Path) -> list[str]:
    """The keys of this run's entries (``identities``: key -> identity) that have no entry in
    ``baseline`` to compare with (:func:`drift.jobs.identity.pair`); ConfigError naming both key
    sets when none has."""
    theirs = set(baseline["entries"])
    paired = pair({k: {"identity": ident} for k, ident in identities.items()}, baseline["entries"])
    unmatched = [k for k in identities if k not in paired]
    if identities and len(unmatched) == len(identities):
        raise ConfigError(f"--baseline {path} matches no entry of this run (by configuration: preset, seed, variant, "
                          f"layers, profile, flow, device, trace content, update name), so no trend could be "
                          f"computed: this run's keys are {', '.join(sorted(identities))}; the baseline's are "
                          f"{', '.join(sorted(theirs)) or '(none)'}; pass the report of a run of the same matrix")
    return unmatched


def written_by(out: Path, entries: Sequence[Entry]) -> list[Path]:
    """Every file a nightly of ``entries`` may write under ``out``."""
    ckpt = [p for e in entries for p in checkpoint_paths(out / "checkpoints", e)]
    return [out / name for name in NIGHTLY_FILES] + [out / "entries" / f"{e.key}.json" for e in entries] + ckpt


def drop_checkpoints(ckpt_dir: Path, entry: Entry, keep_last: bool = False) -> None:
    """A finished entry's checkpoints removed (``keep_last``: all but the newest)."""
    newest, previous = checkpoint_paths(ckpt_dir, entry)
    for path in (previous,) if keep_last else (previous, newest):
        path.unlink(missing_ok=True)


def finished(done_file: Path, key: str, ident: dict, log: TextIO) -> Optional[tuple[dict, float]]:
    """(result, seconds) of the finished-entry file ``done_file`` when it was made with identity
    ``ident``; else None, saying on ``log`` why entry ``key`` is run again."""
    if not os.path.lexists(done_file):
        return None
    try:
        saved = read_json(done_file, "finished-entry file", "it is run again")
        if saved.get("identity") == ident:
            return saved["result"], float(saved["seconds"])
        print(f"drift nightly: redoing {key}: its finished result {done_file} is of another configuration "
              f"({identity_diff(saved.get('identity'), ident)})", file=log)
    except (DriftError, AttributeError, KeyError, TypeError, ValueError) as exc:
        print(f"drift nightly: redoing {key}: finished-entry file {done_file} is damaged ({exc})", file=log)
    return None


def run_nightly(entries: Sequence[Entry], mine: Sequence[Entry], shard_text: str, device: str, out: Path,
                checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY, resume: bool = False,
                baseline: Optional[dict] = None, trend_factor: float = TREND_FACTOR,
                progress: Optional[Callable[[str], Callable[[int, int], None]]] = None,
                log: Optional[TextIO] = None, keep_checkpoint: bool = False) -> tuple[dict, list[Path]]:
    """Run this shard's entries (``mine``) and write the report under ``out``; returns the report
    and the files written. A finished entry's checkpoints are removed (``keep_checkpoint``: all
    but its newest)."""
    log = log or sys.stderr
    (out / "entries").mkdir(parents=True, exist_ok=True)
    ckpt_dir = out / "checkpoints"
    results, timings = {}, {}
    for e in mine:
        done_file = out / "entries" / f"{e.key}.json"
        ident = identity(e, device)
        done = finished(done_file, e.key, ident, log) if resume else None
        if done is None:
            res, secs = run_entry(e, device, ckpt_dir, checkpoint_every, resume,
                                  progress(e.key) if progress else None, log)
            atomic_write_json(done_file, {"result": res, "seconds": secs, "identity": ident})
            print(f"{e.key}: {res['verdict'].upper()}", file=log)
            done = res, secs
        results[e.key], timings[e.key] = {**done[0], "identity": ident}, done[1]
        drop_checkpoints(ckpt_dir, e, keep_checkpoint)
    if ckpt_dir.is_dir() and not any(ckpt_dir.iterdir()):
        ckpt_dir.rmdir()
    meta = {"versions": versions(), "device": device, "matrix": [entry_dict(e) for e in entries], "shard": shard_text}
    report = assemble(results, meta, timings, baseline, trend_factor)
    return report, write(report, out, baseline)
