"""Command-line options, declared once and shared by the ``drift`` command and the pytest plugin.

:func:`add_options` takes an ``addoption`` callable (argparse's ``add_argument``, or pytest's
``parser.addoption`` / a group's ``addoption``) and a ``prefix``: ``""`` for the ``drift``
command (``--update``), ``"drift-"`` for pytest (``--drift-update``) -- pytest-benchmark's
``add_*_options(addoption, prefix)`` pattern. One name per idea everywhere:

  --preset P      a named preset            --steps N      decode steps
  --seed S        the stream's seed         --device D     cpu, cuda or npu
  --profile P     state-store profile       --rounding R   store rounding of the state
  --pattern P     acceptance pattern        --mode M       mtp or sequential decode
  --drafts K      full or ragged drafts     --draft-tokens D  tokens verified per row and step
  --key-heads HK  key heads per rank        --value-heads HV  value heads per rank
  --update SPEC   the update under test     --kernel SPEC  the verify kernel under test
  --trace FILE    replay a captured trace   --loop         wrap positions past the trace's end
  --flow F        state flow (FLOWS)        --no-graph     eager steps (no capture)
  --lifecycle L   how requests come and go (LIFECYCLES: serving, or fixed)
  --track-interval T  prefix-cache tracking every T positions (0: off)

and one option per flow-kind option (``FlowKind.OPTIONS``: the ReplaySSM design's
``--ring-records``, ``--fold-contraction``, ``--fold-cadence``), generated from the registry: a kind
that adds an option adds its registry line, not code here.

Values are checked by the type functions below, so a bad one is a usage error (exit 2) before
any work starts.
"""

from __future__ import annotations

import argparse
import re
from typing import Callable, Iterable, Optional

from .config import DEFAULT_PRESET, DRAFTS, PATTERNS, PRESETS, PROFILES, ROUNDINGS, SEED_MAX
from .flows.registry import FLOW_KINDS, FLOWS, UPDATES, default_update, flows_of
from .lifecycles import DEFAULT_LIFECYCLE, LIFECYCLES
from .plug.loader import ENGINE_UPDATES, KERNELS
from .runspec import MODES



def positive_int(text: str) -> int:
    """An integer >= 1 (``--steps 0`` is an error, never a silent default)."""
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0 (``--track-interval 0``: tracking off)."""
    try:
        value = int(text)
    except (TypeError, ValueError):
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0")
    return value


def seed_int(text: str) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer seed") from None
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"seed {text!r} is invalid; allowed: an integer in [0, {SEED_MAX}] "
                                         "(the stream keys its generators with 32-bit words)")
    return value


def device_name(text: str) -> str:
    if not re.fullmatch(r"(cpu|cuda|npu)(:\d+)?", text or ""):
        raise argparse.ArgumentTypeError(f"device {text!r} is not known; allowed: cpu, cuda, npu "
                                         "(optionally :index)")
    return text


def _choice(allowed: Iterable[str], what: str) -> Callable[[str], str]:
    """A type function accepting the names of ``allowed`` (a registry is read when the option is
    parsed, so entries an extension registered count)."""

    def check(text: str) -> str:
        names = tuple(allowed)
        if text not in names:
            raise argparse.ArgumentTypeError(f"{what} {text!r} is not known; allowed: {', '.join(names)}")
        return text
    check.__name__ = what
    return check


# name -> argparse keyword arguments (help without the default, which add_options appends)
SPECS: dict[str, dict] = {
    "preset": dict(type=_choice(PRESETS, "preset"), metavar="P", help=f"preset: {', '.join(PRESETS)}"),
    "steps": dict(type=positive_int, metavar="N", help="decode steps"),
    "seed": dict(type=seed_int, metavar="S", help="seed of the input stream"),
    "device": dict(type=device_name, metavar="D", help="cpu, cuda or npu"),
    "profile": dict(type=_choice(PROFILES, "profile"), metavar="P",
                    help=lambda: f"state-store profile: {', '.join(PROFILES)}"),
    "rounding": dict(type=_choice(ROUNDINGS, "rounding"), metavar="R",
                     help=f"store rounding of the state: {', '.join(ROUNDINGS)}"),
    "pattern": dict(type=_choice(PATTERNS, "pattern"), metavar="P",
                    help=f"acceptance pattern: {', '.join(PATTERNS)}"),
    "drafts": dict(type=_choice(DRAFTS, "drafts"), metavar="K",
                   help=lambda: "draft tokens per row: full (all D) or ragged (a seeded 1..D per row and step; "
                        "flows whose engine verifies varlen: " + ", ".join(f for f in FLOWS if FLOWS[f].ragged) + ")"),
    "draft-tokens": dict(type=positive_int, metavar="D", help="tokens verified per row and step, D: the root and "
                         "D - 1 drafts (SGLang's --speculative-num-draft-tokens; vLLM's num_speculative_tokens "
                         "is D - 1); the preset's acceptance rates of the first D - 1 draft positions"),
    "key-heads": dict(type=positive_int, metavar="HK", help="GDN key heads per rank (the model's "
                      "linear_num_key_heads / TP); the value heads must be a multiple"),
    "value-heads": dict(type=positive_int, metavar="HV", help="GDN value heads per rank (linear_num_value_heads "
                        "/ TP); value head h reads key head h // (HV / HK), as the engines' kernels"),
    "track-interval": dict(type=non_negative_int, metavar="T", help="the engine's prefix-cache tracking: "
                           "every T-th token position a request's state is also kept (SGLang's mamba_track_interval; "
                           "vLLM's mamba_block_size in align mode); 0: tracking off (vLLM's mamba_cache_mode none)"),
    "mode": dict(type=_choice(MODES, "mode"), metavar="M", help="mtp or sequential (non-MTP) decode"),
    "update": dict(metavar="SPEC", help=lambda: f"update under test: a built-in ({', '.join(UPDATES)}), "
                   f"an engine's own code where it imports ({', '.join(ENGINE_UPDATES)}), "
                   "mutant:<name>, package.module:qualname or path/to/file.py:qualname (default: the flow's "
                   "own built-in: " + "; ".join(f"{default_update(kind)} under {', '.join(flows_of(kind))}"
                                                for kind in FLOW_KINDS if flows_of(kind)) + "; without --flow, "
                   "an update written for another flow's kind runs in its own flow)"),
    "update-factory": dict(metavar="SPEC", help="builds the self of a Class.method --update the way the engine "
                           "builds it: package.module:callable or path/to/file.py:callable, called as "
                           "make(harness) -> the engine's object (e.g. through its own __init__); drift then "
                           "attaches its harness's state (default: the class made without its constructor, "
                           "docs/reference.md: The engine's class, built as it builds it)"),
    "kernel": dict(metavar="SPEC", help=lambda: "verify kernel under test: "
                   f"{', '.join(n + (':<spec>' if KERNELS[n].takes_arg else '') for n in KERNELS)}, "
                   "mutant:<name>, package.module:qualname or path/to/file.py:qualname"),
    "lifecycle": dict(type=_choice(LIFECYCLES, "lifecycle"), metavar="L",
                      help=lambda: "how requests come and go between steps (docs/semantics.md §12): "
                                   + "; ".join(f"{n} ({LIFECYCLES[n].description})" for n in LIFECYCLES)),
    "flow": dict(type=_choice(FLOWS, "flow"), metavar="F",
                 help=lambda: "how the engine keeps MTP state between steps (docs/semantics.md §6): "
                              + "; ".join(f"{n} ({FLOWS[n].engine})" for n in FLOWS)),
    "trace": dict(metavar="FILE", help="replay a captured trace (NAME.npz + NAME.json, from drift capture) "
                  "instead of the synthetic stream: its model shapes, tokens and constants; golden data "
                  "beside it (NAME.golden/, generated on first use); without --steps the whole trace"),
    "loop": dict(action="store_true", help="with --trace: positions past the trace's end wrap around "
                 "(token p mod tokens; the conv window wraps too), so --steps may exceed the trace"),
    "no-graph": dict(action="store_true", help="eager decode, as SGLang without graph mode: no device "
                     "graph capture of the step, and the verify op's eager arguments (prepare_gdn_inputs)"),
    "all-checks": dict(action="store_true", help="run every check even when the host-sync scan (started first) "
                       "finds a sync; without it a sync fails the run at once, its precision checks not run"),
    "fail-fast": dict(action="store_true", help="stop the simulation at the end of the chunk in which a check "
                      "first fails (16 steps, then as many as are done, up to 256), and report the table so far"),
}


def flow_option_names() -> tuple[str, ...]:
    """Every flow kind's options (``FlowKind.OPTIONS``), in registry order, each once."""
    return tuple(dict.fromkeys(o for kind in FLOW_KINDS.values() for o in kind.OPTIONS))


def _flow_option(option: str) -> Callable[[str], str]:
    """A type function accepting a choice of ``option`` in any kind that has it (``name`` or
    ``name:N``); whether the run's flow reads it is the kind's to say (drift.flows.registry.check)."""

    def check(text: str) -> str:
        regs = [kind.OPTIONS[option] for kind in FLOW_KINDS.values() if option in kind.OPTIONS]
        name, colon, arg = (text or "").partition(":")
        for reg in regs:
            if name in reg and reg[name].takes_arg == bool(colon) and (not colon or (arg.isdigit() and int(arg) >= 1)):
                return text
        allowed = ", ".join(dict.fromkeys(f"{n}:N" if reg[n].takes_arg else n for reg in regs for n in reg))
        raise argparse.ArgumentTypeError(f"{option} {text!r} is not known; allowed: {allowed} (N an integer >= 1)")
    check.__name__ = option
    return check


def flow_option_help(option: str) -> str:
    """``--<option>``'s help: what it chooses, the flows whose kind reads it, and its choices (default first)."""
    kinds = [kind for kind in FLOW_KINDS.values() if option in kind.OPTIONS]
    title = kinds[0].OPTION_TITLES.get(option, option)
    reg = kinds[0].OPTIONS[option]
    choices = [f"{n}:N" if reg[n].takes_arg else n for n in reg]
    default = kinds[0].default_choice(option).name
    flows = ", ".join(f for kind in kinds for f in flows_of(kind.name))
    return (f"{title} (flows: {flows}; docs/semantics.md §6): {', '.join(choices)} (default: {default}, the engine as "
            "modelled)")


SPECS.update({o: dict(type=_flow_option(o), metavar="C", help=lambda o=o: flow_option_help(o))
              for o in flow_option_names()})
# The shared options (every entry point that runs a simulation has them; docs/extending.md): the
# options that make a Config, and those plus what is under test.
CONFIG_OPTIONS = ("preset", "steps", "seed", "device", "profile", "rounding", "pattern", "drafts", "flow",
                  "draft-tokens", "key-heads", "value-heads", "lifecycle", "track-interval") + flow_option_names()
RUN_OPTIONS = CONFIG_OPTIONS + ("update", "update-factory", "kernel", "mode", "trace", "loop", "no-graph")
DEFAULTS: dict[str, object] = {"preset": DEFAULT_PRESET, "device": "cpu", "update": None,
                               "kernel": "portable", "mode": "mtp", "loop": False}


def dest(prefix: str, name: str) -> str:
    """The attribute an option lands in: ``update`` for ``--update``, ``drift_update`` for ``--drift-update``."""
    return f"{prefix}{name}".replace("-", "_")


def add_options(addoption: Callable, names: Iterable[str], prefix: str = "", repeat: Iterable[str] = (),
                defaults: Optional[dict] = None, default_text: Optional[dict] = None) -> None:
    """Declare ``names`` (keys of :data:`SPECS`) through ``addoption``; those in ``repeat`` may be
    given more than once (a list, empty when absent); ``defaults`` override :data:`DEFAULTS`;
    ``default_text`` says in the help what a default means where the value alone would not."""
    repeat = set(repeat)
    for name in names:
        kw = dict(SPECS[name])
        if callable(kw.get("help")):  # read from a registry now (an extension may have added entries)
            kw["help"] = kw["help"]()
        if name in repeat:
            kw.update(action="append", default=[])
            kw["help"] += " (repeatable)"
        elif kw.get("action") == "store_true":
            kw["default"] = False
        else:
            default = {**DEFAULTS, **(defaults or {})}.get(name)
            kw["default"] = default
            text = (default_text or {}).get(name)
            if text is not None:
                kw["help"] += f" (default: {text})"
            elif name == "lifecycle":
                kw["help"] += (f" (default: {DEFAULT_LIFECYCLE}; fixed with --trace or under a flow whose kind models "
                               "no churn)")
            elif name == "update" or name in flow_option_names():
                pass  # its help says the default (it depends on the flow, or on --trace)
            elif name == "trace":
                kw["help"] += " (default: none, the synthetic stream)" if default is None else f" (default: {default})"
            else:
                kw["help"] += f" (default: {default})" if default is not None else " (default: the preset's)"
        addoption(f"--{prefix}{name}", dest=dest(prefix, name), **kw)
