"""One run spec (drift/runspec.py): the ``drift`` command and the pytest plugin offer every shared
option, read it into the same RunSpec, and build the same Config from the same values; each rule
that ties options together is written once and names the option as the caller spells it."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from drift import cli, pytest_plugin
from drift.config import DEFAULT_PRESET, PROFILES, ROUNDINGS, preset
from drift.flows.registry import FLOW_KINDS, FLOWS, check
from drift.errors import ConfigError
from drift.options import RUN_OPTIONS, SPECS
from drift.runspec import RunSpec


def _plugin_parser() -> argparse.ArgumentParser:
    """pytest_addoption's options declared on a plain argparse parser (the same signature)."""
    ap = argparse.ArgumentParser()

    class Group:
        addoption = staticmethod(ap.add_argument)

    class Parser:
        @staticmethod
        def getgroup(*_a, **_k):
            return Group

    pytest_plugin.pytest_addoption(Parser)
    return ap


def _cli_run_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    cli.add_run(ap)
    return ap


def _flags(ap: argparse.ArgumentParser) -> set[str]:
    return {s for a in ap._actions for s in a.option_strings}


def test_every_spec_field_is_a_shared_option_and_every_shared_option_is_offered():
    """Every RunSpec field is an option, and so is every flow kind's option (its flow_options)."""
    fields = {f.name.replace("_", "-") for f in dataclasses.fields(RunSpec)} - {"prefix", "layers", "flow-options"}
    kind_options = {o for kind in FLOW_KINDS.values() for o in kind.OPTIONS}
    assert kind_options, "no flow kind declares an option: the generated flags are not exercised"
    assert fields | kind_options == set(RUN_OPTIONS) <= set(SPECS)
    assert {f"--{n}" for n in RUN_OPTIONS} <= _flags(_cli_run_parser())
    assert {f"--drift-{n}" for n in RUN_OPTIONS} <= _flags(_plugin_parser())


# One value of every config-changing option away from the default preset's.
ARGS = {"steps": "8", "seed": "3", "profile": [p for p in PROFILES if p != preset(DEFAULT_PRESET).profile][0],
        "rounding": [r for r in ROUNDINGS if r != "rne"][0], "pattern": "all-D",
        "flow": [f for f in FLOWS if f != "sglang"][0]}


def test_the_command_and_the_plugin_build_the_same_config():
    argv = [x for k, v in ARGS.items() for x in (f"--{k}", v)] + ["--no-graph", "--mode", "sequential"]
    ns_cli = _cli_run_parser().parse_args(argv)
    ns_plug = _plugin_parser().parse_args([a.replace("--", "--drift-", 1) if a.startswith("--") else a for a in argv])
    from_cli = RunSpec.from_options(lambda n: getattr(ns_cli, n.replace("-", "_"), None))
    from_plugin = pytest_plugin.spec_from_options(lambda d, default=None: getattr(ns_plug, d, default))
    assert from_plugin.mode == from_cli.mode == "sequential"
    a, b = from_cli.config(), from_plugin.config()
    assert a == b
    assert (a.steps, a.seed, a.profile, a.store_rounding, a.pattern, a.flow, a.graph_mode) == (
        8, 3, ARGS["profile"], ARGS["rounding"], "all-D", ARGS["flow"], False)
    # Control: the preset alone differs, so the comparison above can fail.
    assert RunSpec().config() != a


def test_flow_options_reach_the_config_from_the_command_and_the_plugin_alike():
    """Each kind option's generated flag (--ring-records, --drift-ring-records ...) lands in
    Config.flow_options, sorted; the kind checks it (an option its kind does not read: exit 2)."""
    kind = next(k for k in FLOW_KINDS.values() if k.OPTIONS)
    flow = next(f for f in FLOWS if FLOWS[f].kind == kind.name)
    opts = list(kind.OPTIONS)[:2]
    values = [[n for n in kind.OPTIONS[o] if not kind.OPTIONS[o][n].default and not kind.OPTIONS[o][n].takes_arg][0]
              for o in opts]
    argv = ["--flow", flow] + [x for o, v in zip(opts[::-1], values[::-1]) for x in (f"--{o}", v)]
    ns_cli = _cli_run_parser().parse_args(argv)
    ns_plug = _plugin_parser().parse_args([a.replace("--", "--drift-", 1) if a.startswith("--") else a for a in argv])
    a = RunSpec.from_options(lambda n: getattr(ns_cli, n.replace("-", "_"), None)).config()
    b = pytest_plugin.spec_from_options(lambda d, default=None: getattr(ns_plug, d, default)).config()
    assert a == b and a.flow_options == tuple(sorted(zip(opts, values)))
    assert check(a) is kind
    # Negative control: the same options under a flow whose kind reads none are refused, naming where they apply.
    other = next(f for f in FLOWS if not FLOW_KINDS[FLOWS[f].kind].OPTIONS)
    with pytest.raises(ConfigError, match=f"does not apply to --flow {other} .*read under --flow {flow}"):
        check(a.replace(flow=other))
    with pytest.raises(SystemExit):  # an unknown choice is a usage error before any work
        _cli_run_parser().parse_args(["--flow", flow, f"--{opts[0]}", "no-such-choice"])


@pytest.mark.parametrize("prefix", ["", "drift-"])
def test_loop_without_trace_is_one_error_in_the_callers_spelling(prefix):
    with pytest.raises(ConfigError, match=f"^--{prefix}loop needs --{prefix}trace FILE"):
        RunSpec(loop=True, prefix=prefix).config()


def test_layers_cut_the_preset():
    cfg = RunSpec(preset="qwen3.5-397b-tp16", layers=3).config()
    assert cfg.num_layers == 3 and RunSpec(preset="qwen3.5-397b-tp16").config().num_layers == 45
