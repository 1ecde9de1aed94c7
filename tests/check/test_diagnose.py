"""The diagnosis of a precision failure (drift/check/diagnose.py): a failed run names the call that
wrote its first out-of-bound committed state, that call's file and line, and the cause; a passing
run has none. Negative controls are known-bad variants (drift/plug/mutants.py) whose bug is known:
each must be named for what it is, in the copy-commit (sglang) and in-place (vllm) flows, and the
kernel-commit (sglang-replayssm) flow. Short runs: 64 steps with fail-fast (a semantic bug fails at
step 0, so the replay is one step)."""

from __future__ import annotations

import inspect

import pytest
import torch

from drift.config import preset
from drift.cli import main
from drift.errors import EXIT_FAIL
from drift.plug.mutants import SGLANG_0523, _kernel_heads_tiled, accept_one_ahead, commit_next_step, commit_previous_step
from drift.runner import run_checked
from drift.runspec import resolve


def _line(fn, text: str = "") -> int:
    """The line of ``fn`` holding ``text`` (default: its last line): where the mutant writes."""
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i in range(len(lines) - 1, -1, -1) if text in lines[i])


def _diagnosis(flow="sglang", update=None, kernel=None, name="ci-small"):
    run = resolve(preset(name).replace(flow=flow, steps=64), update, kernel)
    rep = run_checked(run, sync_scan=False, fail_fast=True)
    assert not rep.passed
    return rep.extra["diagnosis"]


@pytest.mark.parametrize("flow,update,at", [
    ("sglang", "mutant:step_plus1", f"mutants.py:{_line(commit_next_step)} in commit_next_step"),
    ("sglang", "mutant:step_minus1", f"mutants.py:{_line(commit_previous_step)} in commit_previous_step"),
    ("vllm", "mutant:vllm_start_plus1", f"mutants.py:{_line(accept_one_ahead, '.copy_(')} in accept_one_ahead"),
    ("sglang-replayssm", "mutant:replay_no_bonus", "kernel_commit/updates.py:"),
])
def test_wrong_step_is_the_update(flow, update, at):
    d = _diagnosis(flow, update)
    assert (d["cause"], d["call"]) == ("wrong step", "the update"), d["text"]
    assert at in d["text"] and "the accept count says token" in d["text"], d["text"]


@pytest.mark.parametrize("flow", ["sglang", "vllm"])
def test_truncating_store_is_the_verify_kernel(flow):
    d = _diagnosis(flow, kernel="mutant:truncate_store")
    assert (d["cause"], d["call"]) == ("store rounding", "the verify kernel"), d["text"]
    assert "one-sided" in d["text"] and d["at"].startswith("drift/sim/kernels.py:"), d
    assert "_kernel_truncate" in d["text"], d["text"]


def test_wrong_maths_in_the_kernel_is_the_kernel():
    d = _diagnosis(kernel="mutant:heads_tiled", name="ci-heads")
    assert (d["cause"], d["call"]) == ("unexplained", "the verify kernel"), d["text"]
    assert f"mutants.py:{_line(_kernel_heads_tiled, 'return')} in _kernel_heads_tiled" in d["text"], d["text"]


def _wrong_slot(b):
    """Commit each row from the next row's scratch (a wrong-slot bug: the source rows rolled by one)."""
    b.k.move_intermediate_cache(b.ssm, b.inter, b.dst, torch.roll(b.src, -1), b.last)


def test_wrong_slot_is_the_update():
    d = _diagnosis(update=SGLANG_0523.but(commit=_wrong_slot).build("wrong-slot", "rows rolled by one"))
    assert (d["cause"], d["call"]) == ("wrong slot", "the update"), d["text"]
    assert "it holds row " in d["text"] and "test_diagnose.py" in d["text"], d["text"]


def test_a_passing_run_has_no_diagnosis():
    rep = run_checked(resolve(preset("ci-small").replace(steps=64)), sync_scan=False, fail_fast=True)
    assert rep.passed and "diagnosis" not in rep.extra and "diagnosis" not in rep.to_dict()


def test_the_failure_says_it_in_drift_run_and_in_the_gate(capsys, tmp_path):
    rc = main(["run", "--update", "mutant:step_plus1", "--steps", "64", "--quiet", "--fail-fast",
               "--report", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == EXIT_FAIL and "diagnosis (committed_state): step 0" in out and "the wrong step" in out, out
    assert "in commit_next_step" in (tmp_path / "report.json").read_text()
    from drift.gate_ahead import failures_text

    rep = run_checked(resolve(preset("ci-small").replace(steps=64), "mutant:step_plus1"), sync_scan=False,
                      fail_fast=True)
    assert "\ndiagnosis: step 0" in failures_text(rep) and "in commit_next_step" in failures_text(rep)


def test_a_replay_that_raises_says_so_and_leaves_the_verdict(monkeypatch):
    import drift.check.diagnose as diagnose
    from drift.compat import TorchDispatchMode

    def broken(sim):  # the replay's step raises while the recorder is armed
        raise RuntimeError("boom")

    monkeypatch.setattr(diagnose._Replay, "on_step", lambda self, view: broken(self))
    run = resolve(preset("ci-small").replace(steps=64), "mutant:step_plus1")
    rep = run_checked(run, sync_scan=False, fail_fast=True)
    assert not rep.passed and rep.extra["diagnosis"]["text"].startswith("no diagnosis: the replay raised RuntimeError")
    if TorchDispatchMode is not None:
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        assert _get_current_dispatch_mode() is None  # no recorder left on the mode stack


def test_an_accept_count_that_did_not_change_points_at_the_update_too():
    """vLLM's flow: one too few accepted (at least 1) leaves the count unchanged on some steps, so the last write
    of the committed state is the kernel's (it wrote that token's state where it should); the diagnosis says
    the start is the update's bookkeeping and names it (it named the kernel alone: a user trial)."""
    from drift.flows.in_place.updates import bookkeeping, kept_tokens

    def accept_minus1(self, last):
        R = self.num_spec_decodes
        self.num_accepted_tokens[:R].copy_((kept_tokens(last)[:R] - 1).clamp(min=1))
        self.num_accepted_tokens[R:].fill_(1)

    run = resolve(preset("ci-small").replace(flow="vllm", steps=64), bookkeeping(accept=accept_minus1, name="minus1"),
                  None)
    d = run_checked(run, sync_scan=False, fail_fast=True).extra["diagnosis"]
    assert d["cause"] == "wrong step", d["text"]
    assert "the next verify starts from is the update's bookkeeping: minus1" in d["text"], d["text"]
