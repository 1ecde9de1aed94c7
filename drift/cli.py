"""Command line: ``drift run`` (the main job), ``bench``, ``bench-update``, ``nightly``, ``report merge``,
``tradeoff``, ``mutants``, ``regen-golden``.

Exit codes: 0 every check passed; 1 a check failed; 2 usage, config, load or device error.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from .config import DEFAULT_PRESET, PATTERNS, PRESETS, PROFILES, ROUNDINGS, ConfigError, preset
from .devices import DeviceUnavailable, resolve_device
from .golden import GoldenError
from .loader import LoadError
from .simulate import UpdateRaised
from .costmodel import BATCH_SIZES, DEFAULT_STEPS
from .updates import BUILTINS, DEFAULT_UPDATE

EXIT_PASS, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default=DEFAULT_PRESET, help=f"one of: {', '.join(PRESETS)} (default {DEFAULT_PRESET})")
    p.add_argument("--steps", type=int, help="decode steps (default: the preset's)")
    p.add_argument("--seed", type=int, help="stream seed (default: the preset's)")
    p.add_argument("--device", default=None, help="cpu (default), cuda or npu")
    p.add_argument("--profile", choices=sorted(PROFILES), help="state-store profile (default: the preset's: npu)")
    p.add_argument("--rounding", choices=ROUNDINGS, help="store rounding of the state (default rne)")
    p.add_argument("--pattern", choices=PATTERNS, help="acceptance pattern (default: the preset's)")


def config_from_args(args: argparse.Namespace):
    cfg = preset(args.preset)
    if args.profile:
        cfg = cfg.with_profile(args.profile)
    changes = {k: v for k, v in (("steps", args.steps), ("seed", args.seed), ("device", args.device),
                                 ("store_rounding", args.rounding), ("pattern", args.pattern)) if v is not None}
    return cfg.replace(**changes) if changes else cfg


def cmd_run(args: argparse.Namespace) -> int:
    from .report import progress_printer, summary_text, write_report
    from .runner import run_checked

    cfg = config_from_args(args)
    resolve_device(cfg.device)
    progress = None if args.quiet else progress_printer(f"drift run {cfg.name}")
    from .verify_kernels import load_kernel

    kernel = load_kernel(args.kernel)
    rep = run_checked(cfg, args.update, mode=args.mode, progress=progress, vs_sequential=args.vs_sequential,
                      verify_kernel=kernel)
    print(summary_text(rep))
    if args.report:
        for path in write_report(rep, args.report):
            print(f"wrote {path}")
    return EXIT_PASS if rep.passed else EXIT_FAIL


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import bench, format_bench

    cfg = config_from_args(args)
    resolve_device(cfg.device)
    res = bench(cfg, layers=args.layers, steps=args.bench_steps, naive_steps=args.naive_steps,
                repeats=args.repeats, threads=args.threads)
    print(json.dumps(res, indent=2) if args.json else format_bench(res))
    return EXIT_PASS


def cmd_bench_update(args: argparse.Namespace) -> int:
    from .costmodel import format_table, measure, to_json

    cfg = preset(args.preset)
    if args.device:
        cfg = cfg.replace(device=args.device)
    resolve_device(cfg.device)
    rows = measure(cfg, updates=args.update or tuple(BUILTINS), batch_sizes=args.batches, steps=args.steps)
    print(to_json(rows) if args.json else format_table(rows))
    return EXIT_PASS


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return int(text)


def _batch_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of batch sizes >= 1 (e.g. 1,2,4)")
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="drift", description="Precision-drift and host-sync regression suite "
                                 "for the MTP state update of hybrid linear-attention models.",
                                 epilog="Exit codes: 0 every check passed, 1 a check failed, 2 usage, config, "
                                        "golden, load or device error.")
    sub = ap.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="simulate MTP decode through an update and check it (the main job)")
    _add_config_args(run)
    run.add_argument("--update", default=DEFAULT_UPDATE,
                     help="built-in (guarded, sync_free, device_select), module:qualname or file.py:qualname "
                          f"(default {DEFAULT_UPDATE})")
    run.add_argument("--kernel", default=None, metavar="SPEC",
                     help="verify kernel under test: portable (default), npu, npu-op:<spec>, mutant:<name>, "
                          "module:qualname or file.py:qualname")
    run.add_argument("--mode", choices=("mtp", "sequential"), default="mtp",
                     help="mtp (default) or sequential non-MTP decode of the same stream")
    run.add_argument("--vs-sequential", action="store_true",
                     help="also decode the stream sequentially in lockstep and report the MTP-vs-sequential divergence")
    run.add_argument("--report", metavar="DIR", help="write report.json and report.md here")
    run.add_argument("--quiet", action="store_true", help="no progress output")
    run.set_defaults(func=cmd_run)

    b = sub.add_parser("bench", help="simulated steps/s and bandwidth vs a naive loop and memcpy")
    _add_config_args(b)
    b.set_defaults(preset="qwen3.5-397b-tp16")
    b.add_argument("--layers", type=int, default=None, help="simulate only this many layers (default: all)")
    b.add_argument("--bench-steps", type=int, default=20, help="timed steps per block of the vectorised simulator")
    b.add_argument("--naive-steps", type=int, default=2, help="timed steps of the naive loop")
    b.add_argument("--repeats", type=int, default=3, help="timed blocks of --bench-steps steps (best kept)")
    b.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: the faster of 1 and torch's default, probed)")
    b.add_argument("--json", action="store_true", help="print JSON")
    b.set_defaults(func=cmd_bench)

    bu = sub.add_parser("bench-update", help="cost model of the update: ops, bytes (from shapes) and host "
                                             "syncs per step, per implementation and batch size")
    bu.add_argument("--preset", default=DEFAULT_PRESET, help=f"one of: {', '.join(PRESETS)} (default {DEFAULT_PRESET})")
    bu.add_argument("--device", default=None, help="cpu (default); cuda or npu adds device latency")
    bu.add_argument("--update", action="append", help="implementation (repeatable; default: the built-ins)")
    bu.add_argument("--batches", type=_batch_list, default=list(BATCH_SIZES),
                    help="comma-separated active-request counts (default 1,2,4,...,256)")
    bu.add_argument("--steps", type=_positive, default=DEFAULT_STEPS,
                    help=f"decode steps averaged (default {DEFAULT_STEPS})")
    bu.add_argument("--json", action="store_true", help="print JSON (a list of objects)")
    bu.set_defaults(func=cmd_bench_update)
    sub.add_parser("nightly", help="long-horizon drift matrix with checkpoints and a report (see drift nightly --help)")
    sub.add_parser("report", help="report tools: drift report merge SHARD_DIRS... -o OUT")
    sub.add_parser("tradeoff", help="syncs, bytes, drift and verdicts per built-in (see drift tradeoff --help)")
    sub.add_parser("mutants", help="mutation score of the PR-gating checks (see drift mutants --help)")
    sub.add_parser("regen-golden", help="regenerate golden trajectories (same as scripts/regen_golden.py; "
                                        "see drift regen-golden --help)")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["regen-golden"]:
        from .golden import regen_main
        return regen_main(argv[1:])
    if argv[:1] == ["nightly"]:
        from .nightly import main as nightly_main
        return nightly_main(argv[1:])
    if argv[:1] == ["report"]:
        from .nightly import report_main
        return report_main(argv[1:])
    if argv[:1] == ["tradeoff"]:
        from .teeth import tradeoff_main
        return tradeoff_main(argv[1:])
    if argv[:1] == ["mutants"]:
        from .teeth import mutants_main
        return mutants_main(argv[1:])
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, LoadError, DeviceUnavailable, GoldenError) as exc:
        print(f"drift: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except UpdateRaised as exc:
        print(f"drift: FAIL: {exc}", file=sys.stderr)
        return EXIT_FAIL


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
