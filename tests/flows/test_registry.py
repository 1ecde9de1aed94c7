"""drift/flows/registry.py and base.py: what a flow kind must provide, what the registries refuse, and
how a run is resolved once against its kind (drift/runspec.py: resolve)."""

from __future__ import annotations

import pytest

from drift.config import preset
from drift.errors import ConfigError, LoadError
from drift.flows.base import FlowKind
from drift.flows.copy_commit.flow import CopyCommitFlow
from drift.flows.registry import FLOW_KINDS, FLOWS, UPDATES, BuiltinUpdate, Flow, default_update, flows_of
from drift.plug.loader import load_kernel
from drift.runspec import RunSpec, resolve
from helpers import FIXTURES

FAKE_OP = f"npu-op:{FIXTURES / 'fake_npu_op.py'}:recurrent_gated_delta_rule"


def test_a_flow_naming_an_unknown_kind_is_refused_when_registered_listing_the_kinds():
    with pytest.raises(ConfigError, match="names kind 'copy-comit', which is not a registered flow kind; kinds: "
                                          + ", ".join(FLOW_KINDS)):
        FLOWS.register("typo", Flow("typo", "-", "-", ("-",), kind="copy-comit"))
    assert "typo" not in FLOWS


def test_a_flow_whose_settings_its_kind_does_not_read_or_whose_drafts_it_cannot_verify_is_refused():
    kind = CopyCommitFlow.name
    with pytest.raises(ConfigError, match="sets accept_count, which kind 'copy-commit' does not read"):
        FLOWS.register("x", Flow("x", "-", "-", ("-",), kind=kind, settings={"accept_count": True}))
    with pytest.raises(ConfigError, match="takes ragged drafts, but kind 'copy-commit' verifies by the npu rule"):
        FLOWS.register("x", Flow("x", "-", "-", ("-",), kind=kind, ragged=True))
    with FLOWS.temporary("x", Flow("x", "-", "-", ("-",), kind=kind, settings={"accept_counts": True})):
        assert "x" in FLOWS  # control: the setting the kind reads is taken


def test_an_incomplete_kind_is_refused_naming_what_it_lacks():
    class Half(FlowKind):
        name = "half"

    with pytest.raises(ConfigError, match="flow kind 'half' does not implement after_verify, buffers, "
                                          "committed_states"):
        FLOW_KINDS.register("half", Half)
    with pytest.raises(ConfigError, match="register a FlowKind subclass whose name is 'other'"):
        FLOW_KINDS.register("other", CopyCommitFlow)


def test_an_update_names_registered_kinds_and_each_kind_has_one_default():
    with pytest.raises(ConfigError, match="must name the flow kinds it is written for; unknown: nope"):
        UPDATES.register("u", BuiltinUpdate("u", "-", lambda *a: None, ("nope",)))
    with pytest.raises(ConfigError, match="is the default of copy-commit, which already has one"):
        UPDATES.register("u", BuiltinUpdate("u", "-", lambda *a: None, (CopyCommitFlow.name,), default=True))
    for kind in FLOW_KINDS.values():
        names = kind.updates()
        assert names and names[0] == default_update(kind.name) and UPDATES[names[0]].default, kind.name
        assert all(kind.name in UPDATES[n].kinds for n in names)
        assert flows_of(kind.name), kind.name


def test_an_update_of_another_kind_runs_in_its_own_flow_unless_the_run_names_one():
    mutant = RunSpec(update="mutant:vllm_align_wrong_block").resolve()
    assert mutant.cfg.flow == "vllm" and mutant.kind.name == FLOWS["vllm"].kind
    assert RunSpec(update="sglang-0.5.23-replayssm").resolve().cfg.flow == "sglang-replayssm"
    assert RunSpec(update="sglang-0.5.23").resolve().cfg.flow == "sglang"  # the preset's own flow
    with pytest.raises(LoadError, match="vllm-0.33.0 is written for the in-place flow kind .*pass --flow vllm"):
        RunSpec(update="vllm-0.33.0", flow="sglang").resolve()


def test_the_flow_kind_asks_the_kernel_and_prints_why_it_refuses():
    with pytest.raises(LoadError, match="--flow sglang-replayssm .*implements the npu rule, not the ring rule this "
                                        "flow verifies by: run it under --flow sglang or npu-accepted"):
        resolve(preset("ci-small", flow="sglang-replayssm"), kernel=FAKE_OP)

    def undeclared(args):
        return None

    ok, why = FLOW_KINDS[FLOWS["sglang-replayssm"].kind].accepts(load_kernel(undeclared))
    assert not ok and "declares no verify rules" in why and "RULES = ('ring',)" in why
    assert FLOW_KINDS[FLOWS["sglang"].kind].accepts(load_kernel(undeclared)) == (True, "")  # stores states: fine
    for kind in FLOW_KINDS.values():  # drift's own op implements every kind's rule
        assert kind.accepts(load_kernel("portable")) == (True, ""), kind.name


def test_the_kinds_own_rules_on_a_config_are_checked():
    """The kernel-commit kind's verify stores no state: its fold stores the checkpoint, to nearest or
    by a declared stochastic rounding; a truncating store is no design its bound is derived for."""
    with pytest.raises(ConfigError, match="store_rounding='truncate' under flow='sglang-replayssm': its verify "
                                          "stores no state"):
        resolve(preset("ci-small", flow="sglang-replayssm", store_rounding="truncate"))
    ring = resolve(preset("ci-small", flow="sglang-replayssm", store_rounding="stochastic"))  # control: declared
    assert ring.cfg.store_rounding == "stochastic"
    assert resolve(preset("ci-small", store_rounding="truncate")).cfg.store_rounding == "truncate"  # control
