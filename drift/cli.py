"""The ``drift`` command: one parser, every sub-command registered in :data:`COMMANDS`.

  drift run            simulate MTP decode through an update and check it (the main job)
  drift bench          simulator steps/s and bandwidth vs a naive loop and memcpy
  drift bench-update   ops, bytes and host syncs per step of each update (cost model)
  drift nightly        the long-horizon drift matrix with checkpoints and a report
  drift report merge   combine the reports of nightly shards
  drift tradeoff       syncs, bytes, drift and verdicts per built-in update
  drift mutants        mutation score of the PR-gating checks
  drift regen-golden   regenerate golden trajectories (deliberately: review the diff)
  drift capture        record a transformers model's GDN inputs into a trace file
  drift trace-stats    decay, beta, key rank and value scale of a trace next to the presets'

Exit codes (:mod:`drift.errors`): 0 every check passed; 1 a check failed; 2 usage, config,
load, data or device error -- every bad input is rejected before any work starts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional, Sequence

from .config import Config, preset
from .devices import resolve_device
from .errors import (EXIT_FAIL, EXIT_PASS, ConfigError, DriftError, Terminated, UpdateRaised, clear_interrupt, ended_by_code,
                     interrupt, no_process_exit, raise_if_interrupted, what_raised)
from .fileio import locked, output_file, output_files, refuse_overwriting, writable_dir
from .options import (CONFIG_OPTIONS, RUN_OPTIONS, add_options, dest, flow_option_names, non_negative_int,
                      positive_int)
from .plug.mutants import MUTANTS
from .runspec import Resolved, RunSpec
from .version import __version__

PROG = "drift"


# ------------------------------------------------------------------ helpers
def spec_from_args(args: argparse.Namespace, **fixed) -> RunSpec:
    """The :class:`RunSpec` of the options this command has (drift/runspec.py)."""
    return RunSpec.from_options(lambda name: getattr(args, dest("", name), None), **fixed)


def config_from_args(args: argparse.Namespace, **fixed) -> Config:
    """:func:`spec_from_args` as a validated Config whose states fit this machine (refused here, not
    by the allocator), its flow and that kind's rules checked."""
    from .flows.registry import check
    from .sim.pool import check_fits

    cfg = spec_from_args(args, **fixed).config()
    check(cfg)
    check_fits(cfg)
    return cfg


def resolve_args(args: argparse.Namespace, **fixed) -> Resolved:
    """:func:`spec_from_args` resolved once (the code under test loaded and accepted by the flow
    kind), its states fitting this machine."""
    from .sim.pool import check_fits

    run = spec_from_args(args, **fixed).resolve()
    check_fits(run.cfg)
    return run


def _inputs(trace: Optional[str], golden: bool = True) -> list[tuple[str, Path]]:
    """The data files a command reads, which no output may be: a trace (npz and manifest) and
    the golden data a run compares with (the trace's, else the golden directory's)."""
    from .check.golden import golden_dir, trace_golden_dir
    from .sim.tracefile import trace_paths

    found = list(zip(("the trace", "the trace's manifest"), trace_paths(trace))) if trace else []
    gdir = trace_golden_dir(trace) if trace else golden_dir()
    if golden and gdir.is_dir():
        found += [("golden data", p) for p in sorted(gdir.iterdir()) if p.is_file()]
    return found


def _output_format(p: argparse.ArgumentParser) -> None:
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print JSON")
    fmt.add_argument("--markdown", action="store_true", help="print the Markdown table (the default)")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def _item_progress(args: argparse.Namespace, label: str):
    """Per-item progress with an ETA on stderr (tqdm), or None with --quiet."""
    from .jobs.report import progress_printer

    return None if args.quiet else progress_printer(label, unit="run")


# ---------------------------------------------------------------------- run
def add_run(p: argparse.ArgumentParser) -> None:
    add_options(p.add_argument, RUN_OPTIONS + ("all-checks", "fail-fast"))
    p.add_argument("--vs-sequential", action="store_true",
                   help="also decode the stream sequentially in lockstep and report the MTP-vs-sequential divergence")
    p.add_argument("--report", type=Path, metavar="DIR", help="write report.json, report.md and drift_vs_step.png here")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def cmd_run(args: argparse.Namespace) -> int:
    from .jobs.report import REPORT_FILES, progress_printer, summary_text, write_failure_report, write_report
    from .runner import run_checked
    from .syncs.scan import RUN_SAMPLE

    run = resolve_args(args)
    cfg = run.cfg
    report_dir = output_files(args.report, REPORT_FILES, "--report") if args.report else None
    if report_dir is not None:
        refuse_overwriting([("--report", report_dir / name) for name in REPORT_FILES], _inputs(cfg.trace))
    golden = None
    if cfg.trace:  # the trace's golden data beside it, generated on first use (saying so), before the run
        from .check.golden import load_golden

        golden, _ = load_golden(cfg)
    progress = None if args.quiet else progress_printer(f"drift run {cfg.name}")
    with locked(report_dir, "drift run") if report_dir is not None else contextlib.nullcontext():
        try:
            rep = run_checked(run, progress=progress, vs_sequential=args.vs_sequential, golden=golden,
                              sync_first=not args.all_checks, fail_fast=args.fail_fast, sync_sample=RUN_SAMPLE)
        except UpdateRaised as exc:  # the code under test ended the run: the report says so (main prints it)
            if report_dir is not None:
                for path in write_failure_report(str(exc), run, report_dir):
                    print(f"wrote {path}")
            raise
        print(summary_text(rep))
        if report_dir is not None:
            for path in write_report(rep, report_dir):
                print(f"wrote {path}")
    return EXIT_PASS if rep.passed else EXIT_FAIL


# -------------------------------------------------------------------- bench
def add_bench(p: argparse.ArgumentParser) -> None:
    from .jobs.bench import benchmarked_flows

    # Only what drift bench times: full drafts, and the flows its naive loop mirrors.
    add_options(p.add_argument, [n for n in CONFIG_OPTIONS if n not in ("drafts", "flow")],
                defaults={"preset": "qwen3.5-397b-tp16", "lifecycle": "fixed"},
                default_text={"lifecycle": "fixed: the naive loop it compares with runs one fixed batch"})
    p.add_argument("--flow", metavar="F", type=_benchmarked_flow,
                   help=f"the flow timed: {', '.join(benchmarked_flows())} (default: the preset's)")
    p.add_argument("--layers", type=positive_int, help="simulate only this many layers (default: all)")
    p.add_argument("--bench-steps", type=positive_int, default=20, help="timed steps per block of the vectorised simulator")
    p.add_argument("--naive-steps", type=positive_int, default=3, help="timed steps of the naive loop (median kept)")
    p.add_argument("--repeats", type=positive_int, default=5, help="timed blocks of --bench-steps steps (median kept)")
    p.add_argument("--stage-steps", type=non_negative_int,
                   help="steps per stage profile of the eager and the checked step (0: none; default 4)")
    p.add_argument("--gate", action="store_true",
                   help="exit 1 when a median misses its target (bandwidth ratio 0.15, speedup 10x)")
    p.add_argument("--threads", type=positive_int, help="CPU threads (default: the faster of 1 and torch's default, probed)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def _benchmarked_flow(text: str) -> str:
    from .jobs.bench import benchmarked_flows

    if text not in benchmarked_flows():
        raise argparse.ArgumentTypeError(f"flow {text!r} is not benchmarked; allowed: {', '.join(benchmarked_flows())}")
    return text


def cmd_bench(args: argparse.Namespace) -> int:
    from .jobs.bench import bench, format_bench
    from .jobs.report import progress_printer

    cfg = config_from_args(args)
    extra = {} if args.stage_steps is None else {"stage_steps": args.stage_steps}
    res = bench(cfg, layers=args.layers, steps=args.bench_steps, naive_steps=args.naive_steps,
                repeats=args.repeats, threads=args.threads,
                progress=None if args.quiet else progress_printer(f"drift bench {cfg.name}", unit="part"), **extra)
    print(json.dumps(res, indent=2) if args.json else format_bench(res))
    return EXIT_FAIL if args.gate and not res["verdict"]["met"] else EXIT_PASS


def _batch_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of batch sizes >= 1 (e.g. 1,2,4)")
    return out


def add_bench_update(p: argparse.ArgumentParser) -> None:
    from .syncs.costmodel import BATCH_SIZES, DEFAULT_STEPS

    add_options(p.add_argument, ("preset", "device", "flow", "update"), repeat=("update",))
    p.add_argument("--batches", type=_batch_list, default=list(BATCH_SIZES),
                   help="comma-separated active-request counts (default 1,2,4,...,256)")
    p.add_argument("--steps", type=positive_int, default=DEFAULT_STEPS, metavar="N",
                   help=f"decode steps averaged (default: {DEFAULT_STEPS})")
    p.add_argument("--json", action="store_true", help="print JSON (a list of objects)")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def cmd_bench_update(args: argparse.Namespace) -> int:
    from .syncs.costmodel import format_table, measure, to_json

    spec = RunSpec(preset=args.preset, device=args.device, flow=args.flow, lifecycle="fixed")  # a batch of each size
    kind = spec.resolve().kind  # the built-ins of the flow's kind when no --update is given
    runs = [replace(spec, update=u).resolve() for u in (args.update or kind.updates())]
    rows = measure(runs, batch_sizes=args.batches, steps=args.steps,
                   progress=_item_progress(args, f"drift bench-update {runs[0].cfg.name}"))
    print(to_json(rows) if args.json else format_table(rows))
    return EXIT_PASS


# ------------------------------------------------------------------ nightly
def add_nightly(p: argparse.ArgumentParser) -> None:
    from .jobs.nightly import (CPU_LAYERS, DEFAULT_CHECKPOINT_EVERY, DEFAULT_PRESETS, DEFAULT_STEPS,
                               DEFAULT_UPDATES, TREND_FACTOR, VARIANTS)

    add_options(p.add_argument, ("preset", "seed", "update"), repeat=("preset", "seed", "update"))
    add_options(p.add_argument, ("steps", "device", "flow", "lifecycle", "trace", "loop", "no-graph"),
                defaults={"steps": None, "lifecycle": "fixed"},
                default_text={"steps": f"{DEFAULT_STEPS}; with --trace the whole trace",
                              "lifecycle": "fixed: the nightly measures the long horizon of one request per lane"})
    add_options(p.add_argument, flow_option_names())
    p.add_argument("--design-table", action="store_true",
                   help="run each flow kind's design trade-off configurations instead (docs/teeth.md; only --flow's "
                        "kind with --flow), each on its checkpoint's variant with the kind's default update")
    p.add_argument("--variant", action="append", default=[], choices=VARIANTS,
                   help=f"store variant (repeatable; default: all of {', '.join(VARIANTS)})")
    p.add_argument("--layers", default="auto", help=f"auto ({CPU_LAYERS} on cpu, all elsewhere), all, or N")
    p.add_argument("--report", type=Path, default=Path("nightly-report"), metavar="DIR",
                   help="report directory (default: nightly-report; one holding a report is refused without "
                        "--resume or --force)")
    p.add_argument("--checkpoint-every", type=positive_int, default=DEFAULT_CHECKPOINT_EVERY, metavar="N",
                   help=f"write a checkpoint every N steps of an entry (default: {DEFAULT_CHECKPOINT_EVERY})")
    p.add_argument("--keep-checkpoint", action="store_true", help="keep the last checkpoint of each finished entry "
                   "(default: a finished entry keeps none; its result is in DIR/entries/)")
    p.add_argument("--resume", action="store_true", help="continue from checkpoints and finished entries (those "
                   "of exactly this configuration; the others are redone, saying why)")
    p.add_argument("--force", action="store_true", help="overwrite a report already in --report (without --resume "
                   "or --force a directory that holds one is refused)")
    p.add_argument("--shard", help="run shard K of N (K/N), e.g. 2/4")
    p.add_argument("--baseline", type=Path, help="previous report.json: flag heads whose error grew")
    p.add_argument("--trend-factor", type=float, default=TREND_FACTOR, metavar="X",
                   help=f"with --baseline: flag a head whose error grew past X times the baseline's "
                        f"(default: {TREND_FACTOR})")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(nightly_defaults=(DEFAULT_PRESETS, DEFAULT_UPDATES))


def _variants_of_flow(variants, args, preset: str, update: str, steps, layers, options=()) -> list[str]:
    """The default variants that apply under ``--flow`` and the flow options (a variant the kind
    refuses: a store rounding or checkpoint its design has no bound for); each one left out is named
    on stderr with the reason."""
    from .jobs.nightly import Entry

    keep = []
    for v in variants:
        probe = Entry(preset, 0, "-" if v == "sequential" else update, v, steps, layers, trace=args.trace or "",
                      loop=args.loop, flow=args.flow or "", flow_options=options if v != "sequential" else (),
                      lifecycle=args.lifecycle)
        try:
            probe.config(args.device)
        except ConfigError as exc:
            print(f"drift nightly: the {v} variant does not apply here, left out: {exc}", file=sys.stderr)
            continue
        keep.append(v)
    return keep


def cmd_nightly(args: argparse.Namespace) -> int:
    from .jobs.nightly import (DEFAULT_STEPS, VARIANTS, build_matrix, design_matrix, identity, layers_for,
                               match_baseline, parse_shard, read_report, run_nightly, shard, written_by)
    from .jobs.report import NIGHTLY_FILES, progress_printer

    presets, updates = args.nightly_defaults
    resolve_device(args.device)
    layers = layers_for(args.device, args.layers)
    options = spec_from_args(args).flow_options
    if args.flow and not args.update:  # that flow's own default, not the preset flow's
        from .flows.registry import FLOWS, default_update

        updates = [default_update(FLOWS[args.flow].kind)]
    updates = args.update or list(updates)
    steps = args.steps if (args.steps is not None or args.trace) else DEFAULT_STEPS
    if args.design_table:
        if args.update or options or args.variant or args.trace:
            raise ConfigError("--design-table runs each design configuration with its kind's default update on its "
                              "checkpoint's variant: drop --update, --variant, --trace and the flow options")
        entries = design_matrix("table", args.preset or presets, args.seed or [0], steps, layers,
                                graph=not args.no_graph, flow=args.flow or "")
    else:
        variants = args.variant or _variants_of_flow(VARIANTS, args, (args.preset or presets)[0], updates[0], steps,
                                                     layers, options)
        entries = build_matrix(args.preset or presets, args.seed or [0], updates, variants,
                               steps, layers, trace=args.trace or "", loop=args.loop, graph=not args.no_graph,
                               flow=args.flow or "", flow_options=options,
                               lifecycle=args.lifecycle)
        if not (args.preset or args.flow or args.update or args.variant or args.trace or options):
            # the full default matrix: each flow kind's nightly design configurations too
            entries += design_matrix("nightly", presets, args.seed or [0], steps, layers, graph=not args.no_graph)
    from .sim.pool import check_fits

    from .jobs.identity import checks_identity

    for e in entries:  # a bad trace, option, steps past a trace's end, states too large, an update of
        run = e.resolve(args.device)  # another flow, an extension's check that cannot be built: an error
        check_fits(run.cfg)  # now, not after hours
        checks_identity(run.cfg, run.mode)
    for e in build_matrix(args.preset or presets, [(args.seed or [0])[0]], updates, ["rne"], steps, layers,
                          trace=args.trace or "", loop=args.loop, graph=not args.no_graph, flow=args.flow or "",
                          flow_options=options, lifecycle=args.lifecycle):
        e.resolve(args.device)  # every --update loaded and checked, also where only sequential decode runs
    k, n = parse_shard(args.shard)
    mine = shard(entries, k, n)
    baseline = read_report(args.baseline) if args.baseline else None
    out = output_files(args.report, NIGHTLY_FILES, "--report")
    refuse_overwriting([("--report", p) for p in written_by(out, mine)],
                       _inputs(args.trace) + ([("the baseline", args.baseline)] if args.baseline else []))
    if baseline is not None:
        unmatched = match_baseline(baseline, {e.key: identity(e, args.device) for e in mine}, args.baseline)
        if unmatched:
            print(f"drift nightly: --baseline {args.baseline} has no entry for {len(unmatched)} of this run's "
                  f"{len(mine)} entries; they get no trend: {', '.join(unmatched)}", file=sys.stderr)
    if not args.trend_factor > 0:
        raise ConfigError(f"--trend-factor {args.trend_factor} is invalid; allowed: a number > 0")
    for sub in ("entries", "checkpoints"):
        writable_dir(out / sub, "--report")
    if (out / "report.json").exists() and not (args.resume or args.force):
        raise ConfigError(f"--report {out} already holds a report (report.json); pass --resume to continue that "
                          "run, --force to overwrite it, or another --report directory")
    interrupted = sorted(p.name for p in (out / "checkpoints").glob("*") if p.is_file()) \
        if (out / "checkpoints").is_dir() else []
    if interrupted and not (args.resume or args.force):  # a killed run's work: never thrown away unasked
        raise ConfigError(f"--report {out} holds the checkpoints of a run that did not finish ({len(interrupted)} "
                          f"files in {out / 'checkpoints'}); pass --resume to continue it, --force to start over "
                          "(they are then replaced), or another --report directory")
    steps_text = f"{steps} steps" if steps is not None else "the whole trace"
    with locked(out, "drift nightly"):
        print(f"drift nightly: {len(mine)} of {len(entries)} entries (shard {k}/{n}), {steps_text} each, "
              f"device {args.device}" + (f", at most {layers} layers per preset" if layers else "")
              + (f", trace {args.trace}" + (" (looped)" if args.loop else "") if args.trace else ""), file=sys.stderr)
        report, written = run_nightly(entries, mine, f"{k}/{n}", args.device, out, args.checkpoint_every,
                                      args.resume, baseline, args.trend_factor,
                                      None if args.quiet else progress_printer, keep_checkpoint=args.keep_checkpoint)
    for path in written:
        print(f"wrote {path}")
    if report["trend"]:
        print(f"drift nightly: {len(report['trend'])} head(s) regressed past {args.trend_factor}x the baseline",
              file=sys.stderr)
    return EXIT_PASS if report["verdict"] == "pass" else EXIT_FAIL


def add_report(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="report_command", required=True, metavar="{merge}",
                           help="merge: combine the reports of nightly shards")
    m = sub.add_parser("merge", help="combine shard reports into one", description="Combine nightly shard reports.")
    m.add_argument("dirs", nargs="+", type=Path, help="--report directories of the shards")
    m.add_argument("-o", "--out", type=Path, required=True, help="output directory (one holding a report is "
                   "refused without --force; never one of the shard directories)")
    m.add_argument("--force", action="store_true", help="overwrite a report already in --out")


def cmd_report(args: argparse.Namespace) -> int:
    from .jobs.nightly import merge
    from .jobs.report import NIGHTLY_FILES

    out = output_files(args.out, NIGHTLY_FILES, "--out")
    refuse_overwriting([("--out", out / name) for name in NIGHTLY_FILES],
                       [(f"a file of shard {d}", d / name) for d in args.dirs for name in NIGHTLY_FILES])
    if (out / "report.json").exists() and not args.force:
        raise ConfigError(f"--out {out} already holds a report (report.json); pass --force to overwrite it, or "
                          "another --out directory")
    with locked(out, "drift report merge", "--out"):
        rep = merge(args.dirs, out)
    print(f"merged {len(rep['entries'])} entries into {out}")
    return EXIT_PASS if rep["verdict"] == "pass" else EXIT_FAIL


# -------------------------------------------------------------------- teeth
def _teeth_config(args: argparse.Namespace) -> Config:
    from .jobs.teeth import TEETH_STEPS

    return preset(args.preset, steps=args.steps or TEETH_STEPS)


def add_tradeoff(p: argparse.ArgumentParser) -> None:
    from .jobs.teeth import DESIGN_STEPS, TEETH_STEPS

    add_options(p.add_argument, ("preset", "steps"), defaults={"steps": None},
                default_text={"steps": f"{TEETH_STEPS}; with --designs {DESIGN_STEPS}"})
    add_options(p.add_argument, ("flow",), default_text={"flow": "every flow"})
    p.add_argument("--update", action="append", default=[], metavar="SPEC",
                   help="also a row for this implementation (a spec as drift run --update takes it: "
                        "package.module:qualname, path/to/file.py:qualname, mutant:<name>), in the flows "
                        "of the kinds it is written for, else in --flow (default: the preset's) (repeatable)")
    p.add_argument("--designs", action="store_true",
                   help="instead, each flow kind's design configurations (the ReplaySSM design's ring "
                        "records, fold contraction, cadence and checkpoint: docs/teeth.md), with the bytes per "
                        "step their kernels move; --steps defaults to 4096 (the PR gate's horizon)")
    _output_format(p)


def cmd_tradeoff(args: argparse.Namespace) -> int:
    from .flows.registry import UPDATES
    from .jobs.teeth import DESIGN_STEPS, design_markdown, design_record, design_tradeoff, tradeoff, tradeoff_markdown

    if args.designs:
        if args.update or args.flow:
            raise ConfigError("--designs runs each flow kind's design configurations in its own flow: drop --update "
                              "and --flow")
        import datetime

        cfg = preset(args.preset, steps=args.steps or DESIGN_STEPS)
        record = design_record(design_tradeoff(cfg, progress=_item_progress(args, f"drift tradeoff --designs {cfg.name}")),
                               cfg, datetime.date.today().isoformat())
        print(json.dumps(record, indent=2) if args.json else design_markdown(record, None))
        return EXIT_PASS
    cfg = _teeth_config(args)
    if args.flow:
        cfg = cfg.replace(flow=args.flow)
    impls = tuple(UPDATES) + tuple(u for u in args.update if u not in UPDATES) if args.update else None
    rows = tradeoff(cfg, impls, flows=[args.flow] if args.flow else None,
                    progress=_item_progress(args, f"drift tradeoff {cfg.name}"))
    print(json.dumps(rows, indent=2) if args.json else tradeoff_markdown(rows, cfg))
    return EXIT_PASS


def add_mutants(p: argparse.ArgumentParser) -> None:
    from .jobs.teeth import TEETH_STEPS

    add_options(p.add_argument, ("preset", "steps"), defaults={"steps": TEETH_STEPS})
    p.add_argument("--mutant", action="append", choices=sorted(MUTANTS), metavar="NAME",
                   help=f"only these (repeatable; default: all): {', '.join(sorted(MUTANTS))}")
    _output_format(p)


def cmd_mutants(args: argparse.Namespace) -> int:
    from .jobs.teeth import catalogue, mutants_markdown

    cfg = _teeth_config(args)
    rows = catalogue(cfg, args.mutant, progress=_item_progress(args, f"drift mutants {cfg.name}"))
    print(json.dumps(rows, indent=2) if args.json else mutants_markdown(rows, cfg))
    return EXIT_PASS if all(r["caught"] for r in rows) else EXIT_FAIL


# ------------------------------------------------------------------- golden
def add_regen_golden(p: argparse.ArgumentParser) -> None:
    from .check.golden import GOLDEN_PRESETS

    add_options(p.add_argument, ("preset",), repeat=("preset",))
    add_options(p.add_argument, ("seed",))
    p.set_defaults(golden_presets=GOLDEN_PRESETS)
    p.add_argument("--force", action="store_true", help="overwrite golden data that changed")
    p.add_argument("--golden-dir", type=Path, metavar="DIR",
                   help="golden directory (default: $DRIFT_GOLDEN_DIR, else the one drift reads)")
    p.add_argument("--trace", metavar="FILE", help="the golden data of this trace instead, beside it in NAME.golden/ "
                   "(drift run --trace makes it on first use; this shows the diff and overwrites only with --force)")


def cmd_regen_golden(args: argparse.Namespace) -> int:
    from .check.golden import golden_dir, regenerate, trace_golden_dir, write_trace_golden

    if args.trace:
        from .config import DEFAULT_PRESET
        from .sim.stream import load_trace

        if args.golden_dir:
            raise ConfigError("--golden-dir does not apply with --trace: a trace's golden data lives beside it "
                              f"({trace_golden_dir(args.trace)})")
        if len(args.preset) > 1:
            raise ConfigError("--trace takes at most one --preset (its batch; the golden data depends on the trace "
                              "and the seed only)")
        base = preset(args.preset[0] if args.preset else DEFAULT_PRESET)
        base = base.replace(seed=args.seed) if args.seed is not None else base
        cfg = Config.from_trace(load_trace(args.trace), base)
        gdir = trace_golden_dir(args.trace)  # created only once its data is generated: none is left empty
        writable_dir(gdir if gdir.exists() else gdir.parent, "--trace (its golden directory)")
        return write_trace_golden(cfg, force=args.force, out=sys.stdout)
    where = "--golden-dir" if args.golden_dir else "the golden directory ($DRIFT_GOLDEN_DIR or drift's own)"
    directory = writable_dir(args.golden_dir or golden_dir(), where)
    return regenerate(args.preset or args.golden_presets, args.seed, args.force, directory)


# ------------------------------------------------------------------ capture
def add_capture(p: argparse.ArgumentParser) -> None:
    from .capture.transformers_capture import TINY_ARCHS
    from .options import device_name, seed_int

    p.add_argument("--model", default="tiny", metavar="tiny|PATH",
                   help="tiny: a tiny randomly initialised Qwen3-Next/Qwen3.5 (no download); PATH: a local "
                        "Hugging Face checkpoint directory (default: tiny)")
    p.add_argument("--arch", choices=TINY_ARCHS, default="qwen3_next", help="architecture of --model tiny "
                   "(default: qwen3_next)")
    p.add_argument("--tokens", type=positive_int, default=64, metavar="N",
                   help="tokens decoded (greedily) per sequence after the prompt (default: 64)")
    p.add_argument("--prompt-len", type=positive_int, default=16, metavar="P",
                   help="random prompt tokens per sequence, recorded too (default: 16)")
    p.add_argument("--sequences", type=positive_int, default=4, metavar="R",
                   help="sequences decoded together; a replay runs one request per sequence (default: 4)")
    p.add_argument("--seed", type=seed_int, default=0, metavar="S",
                   help="seed of the random prompts (and of --model tiny's weights) (default: 0)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="dtype the model runs in, and the trace stores (default: bfloat16)")
    p.add_argument("--device", type=device_name, default="cpu", metavar="D",
                   help="where the model runs: cpu, cuda or npu (default: cpu)")
    p.add_argument("--out", type=Path, required=True, metavar="FILE",
                   help="the trace: FILE.npz and its manifest FILE.json, written atomically")


def _need_transformers() -> None:
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError(f"drift capture needs transformers>=5, which is not importable ({exc}); install "
                          "drift's capture extra from the checkout: pip install -e '.[capture]'") from None
    major = transformers.__version__.split(".")[0]
    if not major.isdigit() or int(major) < 5:
        raise ConfigError(f"drift capture needs transformers>=5, this is {transformers.__version__}; install "
                          "drift's capture extra from the checkout: pip install -e '.[capture]'")


def cmd_capture(args: argparse.Namespace) -> int:
    import torch

    from .sim.tracefile import read_trace, trace_paths

    npz, man = trace_paths(args.out)
    output_file(npz, "--out")
    output_file(man, "--out")
    if args.model != "tiny" and not (Path(args.model) / "config.json").is_file():
        raise ConfigError(f"--model {args.model}: not a checkpoint directory (no config.json); pass tiny or a local "
                          "Hugging Face model directory (drift capture downloads nothing)")
    if args.model != "tiny":
        refuse_overwriting([("--out", npz), ("--out", man)],
                           [("a file of --model", p) for p in Path(args.model).iterdir() if p.is_file()])
    _need_transformers()
    resolve_device(args.device)
    from .capture.transformers_capture import build_tiny_model, capture_to_file, load_model

    dtype = getattr(torch, args.dtype)
    if args.model == "tiny":
        # Rotary positions past max_position_embeddings work but make generate warn: size it to the trace.
        model = build_tiny_model(args.arch, seed=args.seed, dtype=dtype,
                                 max_position_embeddings=max(512, args.prompt_len + args.tokens + 1))
        model = model.to(args.device)
        what = f"tiny {args.arch} (random weights, seed {args.seed})"
    else:
        model = load_model(args.model, dtype=dtype, device=args.device)
        what = args.model
    print(f"drift capture: {what}, {args.dtype}, {args.sequences} sequence(s) x ({args.prompt_len} prompt + "
          f"{args.tokens} decoded) tokens on {args.device} ...", file=sys.stderr, flush=True)
    path = capture_to_file(model, npz, tokens=args.tokens, prompt_len=args.prompt_len, sequences=args.sequences,
                           seed=args.seed)
    tr = read_trace(path)
    m = tr.manifest
    per_tok = m["bytes_per_token_per_layer"]
    print(f"wrote {path} and {man}")
    print(tr.describe())
    itemsize = 2 if m["dtype"] == "bfloat16" else 4
    print(f"bytes per token per layer: {per_tok} (x, a, b: (C + 2*HV) * {itemsize} = ({m['conv_channels']} + "
          f"2*{m['num_v_heads']}) * {itemsize}); {per_tok * m['num_layers']} B per token over {m['num_layers']} GDN "
          f"layers; npz {m['bytes']} bytes, sha256 {m['sha256'][:16]}...")
    print(f"model {m['model']['name']} ({m['model']['source']}), GDN layers {m['layers']}, prompt "
          f"{m['model'].get('prompt_tokens')} + decoded {m['model'].get('decoded_tokens')} tokens per sequence")
    print(f"replay: drift run --trace {path}    statistics: drift trace-stats {path}")
    return EXIT_PASS


# -------------------------------------------------------------- trace-stats
def add_trace_stats(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE", help="a trace (NAME.npz, NAME.json or NAME)")
    p.add_argument("--plot", type=Path, metavar="PNG", help="also write one PNG comparing the trace with the presets")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--preset-tokens", type=positive_int, default=512, metavar="N",
                   help="tokens per request of each synthetic preset's stream measured alongside (default: 512)")


def cmd_trace_stats(args: argparse.Namespace) -> int:
    from .jobs.trace_stats import format_stats, plot_stats, preset_stats, trace_stats
    from .sim.tracefile import read_trace

    if args.plot is not None:
        output_file(args.plot, "--plot")
        refuse_overwriting([("--plot", args.plot)], _inputs(args.file, golden=False))
    tr = read_trace(args.file)
    stats = {"trace": trace_stats(tr), "presets": preset_stats(tokens=args.preset_tokens)}
    if args.plot is not None:
        plot_stats(stats, args.plot)
    if args.json:
        print(json.dumps(stats, indent=2, allow_nan=False))
    else:
        print(format_stats(stats))
    if args.plot is not None:
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return EXIT_PASS


# ---------------------------------------------------------------- registry
COMMANDS: dict[str, tuple[str, Callable, Callable]] = {
    "run": ("simulate MTP decode through an update and check it (the main job)", add_run, cmd_run),
    "bench": ("simulated steps/s and bandwidth vs a naive loop and memcpy", add_bench, cmd_bench),
    "bench-update": ("cost model of the update: ops, bytes and host syncs per step", add_bench_update,
                     cmd_bench_update),
    "nightly": ("long-horizon drift matrix with checkpoints and a report", add_nightly, cmd_nightly),
    "report": ("report tools: drift report merge SHARD_DIRS... -o OUT", add_report, cmd_report),
    "tradeoff": ("syncs, bytes, drift and verdicts per built-in update", add_tradeoff, cmd_tradeoff),
    "mutants": ("mutation score of the PR-gating checks", add_mutants, cmd_mutants),
    "regen-golden": ("regenerate golden trajectories (review the printed diff)", add_regen_golden,
                     cmd_regen_golden),
    "capture": ("record a transformers model's GDN verify inputs into a trace file", add_capture, cmd_capture),
    "trace-stats": ("decay, beta, key rank and value scale of a trace next to the presets'", add_trace_stats,
                    cmd_trace_stats),
}


def build_parser(argv: Optional[Sequence[str]] = None) -> argparse.ArgumentParser:
    """The ``drift`` parser. With ``argv``, only the sub-command it names gets its options (the
    others a stub with their help line), so a command loads only the modules its own options
    need; without, every sub-command is complete (help texts, documentation, tests)."""
    ap = argparse.ArgumentParser(prog=PROG, description="Precision-drift and host-sync regression suite "
                                 "for the MTP state update of hybrid linear-attention models.",
                                 epilog="Exit codes: 0 every check passed, 1 a check failed, 2 usage, config, "
                                        "load, data or device error.")
    ap.add_argument("--version", action="version", version=f"{PROG} {__version__}",
                    help="print drift's version and exit")
    sub = ap.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    named = None if argv is None else next((a for a in argv if a in COMMANDS), "")
    for name, (text, add, run) in COMMANDS.items():
        p = sub.add_parser(name, help=text, description=text[:1].upper() + text[1:] + ".")
        if named is None or named == name:
            add(p)
        p.set_defaults(func=run)
    return ap


HELP_WIDTH = 100  # columns of the stored help texts (drift/_help.py) and the README's synopsis


def help_texts() -> dict[str, str]:
    """Every ``--help`` text at :data:`HELP_WIDTH` columns: ``""`` the top level, then each
    sub-command (``"report merge"`` for a nested one). drift/_help.py stores these, so
    ``drift [CMD] --help`` answers without importing torch (drift/__main__.py);
    tests/test_cli.py checks they are fresh (regenerate: python scripts/update_readme.py)."""
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(HELP_WIDTH)
    try:
        ap = build_parser()
        out = {"": ap.format_help()}
        for action in ap._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, p in action.choices.items():
                    out[name] = p.format_help()
                    for inner in p._actions:
                        if isinstance(inner, argparse._SubParsersAction):
                            out.update({f"{name} {n}": q.format_help() for n, q in inner.choices.items()})
        return out
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def synopsis_markdown() -> str:
    """Every command's usage, from the parser (the README's ``drift:synopsis`` block)."""
    texts = help_texts()
    usage = {name: text.split("\n\n", 1)[0] for name, text in texts.items() if name}
    lines = [" ".join(u.split()) for u in usage.values()]
    return "```text\n" + "\n".join(line.removeprefix("usage: ") for line in lines) + "\n```"


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .plug.extensions import load_extensions

    try:
        with no_process_exit():  # an extension's os._exit at import: refused, not the process ended
            load_extensions()  # $DRIFT_EXTENSIONS: entries they register become choices of the options
    except DriftError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    previous = blocked = None
    if threading.current_thread() is threading.main_thread():
        clear_interrupt()
        previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, interrupt)}
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # an ignored SIGINT stays ignored
            previous[signal.SIGINT] = signal.signal(signal.SIGINT, interrupt)
        # A launcher may start drift with SIGTERM blocked (a CI runner's inherited signal mask did):
        # the handler would then never run and a SIGTERM would be lost. Unblock it while drift runs.
        blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    try:
        with no_process_exit():  # code drift runs that calls os._exit fails, it does not end drift
            code = args.func(args)
        raise_if_interrupted()  # one whose exception a callback swallowed: the command still ends so
        return code
    except UpdateRaised as exc:
        print(f"{PROG} {args.command}: FAIL: {exc}", file=sys.stderr)
        return exc.exit_code
    except DriftError as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except (SystemExit, KeyboardInterrupt) as exc:
        if not ended_by_code(exc):
            return _interrupted(args, exc)
        # drift never exits from inside a command: code it ran (under test, an extension) did
        print(f"{PROG} {args.command}: FAIL: code drift ran {what_raised(exc)}; code under test must return, "
              "not end the process", file=sys.stderr)
        return EXIT_FAIL
    except Terminated as exc:
        return _interrupted(args, exc)
    finally:
        if previous is not None:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            clear_interrupt()  # handled: a caller in the same process (a test) goes on undisturbed


def _interrupted(args: argparse.Namespace, exc: BaseException) -> int:
    """The one line and exit code of a command ended by SIGINT (130) or SIGTERM (143)."""
    name, code = ("SIGINT", 130) if isinstance(exc, KeyboardInterrupt) else ("SIGTERM", 143)
    print(f"{PROG} {args.command}: interrupted ({name}); finished files are intact, nothing half-written "
          "is left (run it again; a nightly continues with --resume)", file=sys.stderr)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
