"""vLLM 0.33.0's own bookkeeping under test in the ``vllm`` flow (drift/plug/vllm_engine.py; issue 32
item 5): ``GPUModelRunner._update_states_after_model_execute`` (on vLLM's CPUModelRunner) and
``GDNAttentionMetadataBuilder.build``, built through their own ``__init__`` from vLLM configs made
from the preset, pass every check of a 64-step ci-small run; a one-line mutation of each, made from
vLLM's own source, fails it.

Those tests need vLLM importable with its CPU-side dependencies: scripts/vllm_env.sh makes that
environment (CI runs it) and there they must run (DRIFT_REQUIRE_VLLM=1 fails a skip); elsewhere they
skip naming what failed to import. The
refusals below run everywhere: they are decided before vLLM is imported.
"""

from __future__ import annotations

import inspect
import os
import textwrap

import pytest

from drift.cli import main
from drift.errors import EXIT_USAGE, LoadError
from drift.plug import vllm_engine
from drift.runner import run_checked
from drift.runspec import RunSpec

STEPS = 64  # the machinery, not the horizon: a wrong accept count or start block shows at step 0-1
# The serving lifecycle's first finish and arrival on ci-small fall within 128 steps (its schedule,
# drift/lifecycles.py: min_steps 16, mean 128): before them the bucket holds every request and no
# row is padded, so a padded-row bug has nothing to act on (asserted below, not assumed).
SERVING_STEPS = 128
LIFECYCLES = ["fixed", "serving"]


def _vllm_or_skip():
    try:
        return vllm_engine._vllm()
    except LoadError as exc:
        if os.environ.get("DRIFT_REQUIRE_VLLM"):  # scripts/vllm_env.sh: the environment made for them
            pytest.fail(f"vLLM does not import in the environment made for it: {exc}")
        pytest.skip(f"vLLM does not import here: {exc}")


def _run(update, lifecycle="fixed"):
    steps = SERVING_STEPS if lifecycle == "serving" else STEPS
    run = RunSpec(preset="ci-small", flow="vllm", steps=steps, update=update,
                  lifecycle=lifecycle).resolve().replace(track_interval=0)
    rep = run_checked(run, sync_scan=False)  # the scan's virtual device cannot hold vLLM's buffers (refused below)
    if lifecycle == "serving":
        events = rep.info.meta["events"]
        assert max(events["padded_rows"]) > 0 and events["ends"]["finish"] > 0, events
    return rep


def _mutant(cls: type, method: str, line: str, mutated: str) -> type:
    """A subclass of ``cls`` whose ``method`` is vLLM's own source with ``line`` replaced by
    ``mutated`` (exactly one occurrence), compiled in the module vLLM defines it in."""
    source = textwrap.dedent(inspect.getsource(getattr(cls, method)))
    assert source.count(line) == 1, f"{cls.__qualname__}.{method} no longer has {line!r}: vLLM changed"
    module = inspect.getmodule(getattr(cls, method))
    scope = dict(vars(module))
    exec(compile(source.replace(line, mutated), module.__file__, "exec"), scope)
    return type(f"Mutated{cls.__name__}", (cls,), {method: scope[method]})


@pytest.fixture(scope="module")
def vllm():
    return _vllm_or_skip()


@pytest.mark.parametrize("lifecycle", LIFECYCLES)
def test_vllms_own_builder_and_runner_pass_the_vllm_flow(vllm, lifecycle):
    """Under serving, vLLM's builder forms each step's indices (the update's ``serving`` parts), over the
    batch drift's engine condensed and padded to its graph bucket."""
    rep = _run(vllm_engine.bookkeeping, lifecycle)
    assert rep.passed, [(c.name, c.detail) for c in rep.checks if c.failed]


@pytest.mark.parametrize("lifecycle", LIFECYCLES)
def test_a_one_line_mutation_of_the_runner_fails(vllm, lifecycle):
    """The accept count off by one (the root token not counted): the next verify starts a block early."""
    runner = _mutant(vllm["runner_cls"], "_update_states_after_model_execute",  # GPUModelRunner's, inherited
                     "(output_token_ids != -1).sum(dim=1)", "(output_token_ids[:, 1:] != -1).sum(dim=1)")
    rep = _run(vllm_engine.with_classes(runner_cls=runner, name="runner_mutant"), lifecycle)
    failed = {c.name for c in rep.checks if c.failed}
    assert "committed state" in failed, failed


@pytest.mark.parametrize("lifecycle", LIFECYCLES)
def test_a_one_line_mutation_of_the_builder_fails(vllm, lifecycle):
    """Padded rows given block 1 instead of the NULL block: the verify writes a block a row owns, or a spare."""
    builder = _mutant(vllm["GDNAttentionMetadataBuilder"], "build",
                      "spec_state_indices_tensor[num_spec_decodes:].fill_(NULL_BLOCK_ID)",
                      "spec_state_indices_tensor[num_spec_decodes:].fill_(NULL_BLOCK_ID + 1)")
    rep = _run(vllm_engine.with_classes(builder_cls=builder, name="builder_mutant"), lifecycle)
    assert not rep.passed, [(c.name, c.detail) for c in rep.checks]


@pytest.mark.parametrize("extra, words", [
    ([], "--track-interval 0 (pytest: --drift-track-interval 0)"),  # tracking on: the preset's
    (["--track-interval", "0", "--drafts", "ragged"], "drop --drafts ragged"),
])
def test_what_it_cannot_run_is_refused_before_vllm_is_imported(capsys, extra, words):
    rc = main(["run", "--flow", "vllm", "--steps", "8", "--quiet", "--update", "vllm:builder", *extra])
    err = capsys.readouterr().err
    assert rc == EXIT_USAGE and words in err and "Traceback" not in err, err


@pytest.mark.parametrize("change, words", [(dict(track_interval=16), "without prefix caching"),
                                           (dict(drafts="ragged"), "reads each row's draft count on the host")])
def test_prefix_caching_and_ragged_drafts_are_refused(change, words):
    """The control of the refusals: with tracking off and full drafts the same run reaches vLLM (it
    passes above, or skips naming what did not import)."""
    run = RunSpec(preset="ci-small", flow="vllm", steps=4, update=vllm_engine.bookkeeping).resolve()
    run = run.replace(**{"track_interval": 0, **change})
    with pytest.raises(LoadError, match=words):
        run_checked(run, sync_scan=False)


def test_drift_run_and_the_gate_run_vllm_builder_with_tracking_off(vllm, tmp_path):
    """The user's path (issue 32 item 5): ``drift run --update vllm:builder --track-interval 0`` passes with
    the host-sync check n/a saying why (no accelerator here), and the pytest gate over the same passes its
    precision test with its host-sync tests SKIPPED saying why -- a pass is never claimed for a scan that
    did not run."""
    import subprocess
    import sys

    from drift.syncs.scan import NOT_SCANNED

    rc = main(["run", "--flow", "vllm", "--update", "vllm:builder", "--track-interval", "0", "--steps", "16",
               "--lifecycle", "fixed", "--quiet", "--report", str(tmp_path / "r")])
    assert rc == 0
    report = (tmp_path / "r" / "report.md").read_text()
    reason = NOT_SCANNED.format(spec="vllm:builder")
    if torch_has_accelerator():
        pytest.skip("an accelerator is present: the scan runs there (the not-scanned path is this test's subject)")
    assert reason.split(";")[0] in report
    gate = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--pyargs", "drift",
                           "--drift-preset", "ci-small", "--drift-flow", "vllm", "--drift-update", "vllm:builder",
                           "--drift-track-interval", "0", "--drift-steps", "16", "--drift-lifecycle", "fixed"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    out = gate.stdout + gate.stderr
    assert gate.returncode == 0 and "1 passed" in out and "not scanned: the update vllm:builder" in out, out[-3000:]


def torch_has_accelerator() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.parametrize("update", [[], ["--update", "vllm:builder", "--track-interval", "0"]],
                         ids=["drifts-bookkeeping", "vllms-own"])
def test_vllms_triton_kernel_runs_under_the_interpreter_where_vllm_is_fully_installed(vllm, tmp_path, update):
    """--kernel vllm-triton with TRITON_INTERPRET=1 in vLLM's own environment: vLLM's triton_utils turns
    triton off on a CPU (no active driver) unless the visible devices are set and empty, which drift
    sets around that import (drift/plug/triton_interpreter.py: _vllm_keeps_triton); it was refused
    saying triton was unusable while triton was installed (a user trial). With vLLM's own bookkeeping under
    test too, the kernel's import comes first and sets vLLM's CPU platform as the bookkeeping does."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("triton") is None:
        pytest.fail("triton is not installed in the vLLM environment (.ci/run installs drift's triton extra)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.pop("VLLM_TARGET_DEVICE", None)
    res = subprocess.run([sys.executable, "-m", "drift", "run", "--flow", "vllm", "--kernel", "vllm-triton", "--steps",
                          "2", "--lifecycle", "fixed", "--quiet", *update], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
