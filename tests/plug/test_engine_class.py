"""The engine's class under test as it is: a ``Class.method`` spec runs on a real instance of the
class (built without its constructor, the harness's backend attached), so its helpers,
properties and ``super()`` work; what the harness lacks is exit 2 (drift could not run it),
never exit 1; a file spec imports its sibling modules."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from helpers import checks_of, small_cfg
from drift.cli import main
from drift.errors import EXIT_FAIL, EXIT_PASS, EXIT_USAGE, HarnessLacks
from drift.plug.loader import load_update
from drift.flows.copy_commit.harness import SGLangHarness

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SUBCLASS = FIXTURES / "ascend_subclass.py"
METHOD = "update_mamba_state_after_mtp_verify"
STEPS = 40  # crosses track boundaries of the small config (interval 16): the tracking path runs


def spec(cls: str) -> str:
    return f"{SUBCLASS}:{cls}.{METHOD}"


def test_subclass_with_helper_property_and_super_passes_and_imports_its_sibling():
    upd = load_update(spec("RefactoredAscendBackend"))
    assert upd.owner.__name__ == "RefactoredAscendBackend"
    assert str(FIXTURES) not in sys.path  # the sibling import did not leave the directory on sys.path
    res = checks_of(small_cfg(STEPS), upd)
    assert res["report"].passed, [c.to_dict() for c in res["report"].checks if c.failed]


def test_mutant_of_the_subclass_still_fails_with_exit_1(capsys):
    # --fail-fast: the stale commit is over the bound from the first step, so the run stops there.
    rc = main(["run", "--steps", "16", "--quiet", "--fail-fast", "--update", spec("StaleCommitBackend")])
    out = capsys.readouterr().out
    assert rc == EXIT_FAIL and "committed state    FAIL" in out


def test_what_the_harness_lacks_is_exit_2_naming_the_attribute_and_the_fix(capsys):
    rc = main(["run", "--steps", "8", "--quiet", "--update", spec("NeedsRunnerBackend")])
    err = capsys.readouterr().err
    assert rc == EXIT_USAGE
    assert "read self.model_runner" in err and "NeedsRunnerBackend" in err and "To provide it" in err


PLUGIN = textwrap.dedent('''
    def reads_a_missing_backend_field(self, last, track, steps):
        return self.linear_attn_backend.full_attn_backend

    def reads_a_missing_self_field(self, last, track, steps):
        return self.model_runner

    def has_a_bug(self, last, track, steps):
        return last.no_such_tensor_method()  # an AttributeError of the update's own making

    class Holder:
        @staticmethod
        def update(self, last, track, steps):
            CALLS.append(self)

    CALLS = []
''')


@pytest.fixture
def plugin(tmp_path):
    path = tmp_path / "lacks.py"
    path.write_text(PLUGIN)
    return path


@pytest.mark.parametrize("fn, needle", [("reads_a_missing_backend_field", "'full_attn_backend' of LinearAttnBackend"),
                                        ("reads_a_missing_self_field", "read self.model_runner")])
def test_a_function_reading_what_the_harness_lacks_raises_harness_lacks(plugin, fn, needle):
    with pytest.raises(HarnessLacks, match=needle):
        checks_of(small_cfg(2), load_update(f"{plugin}:{fn}"))


def test_an_attribute_error_of_the_updates_own_making_is_still_a_failed_check(plugin, capsys):
    # Negative control: only reads on drift's harness objects become exit 2.
    rc = main(["run", "--steps", "8", "--quiet", "--update", f"{plugin}:has_a_bug"])
    assert rc == EXIT_FAIL and "no_such_tensor_method" in capsys.readouterr().err


def test_a_staticmethod_gets_the_harness_itself(plugin):
    upd = load_update(f"{plugin}:Holder.update")
    assert upd.owner is None
    checks_of(small_cfg(2), upd)
    assert isinstance(upd.fn.__globals__["CALLS"][0], SGLangHarness)


def test_a_passing_run_exits_0_through_the_command(capsys):
    assert main(["run", "--steps", "8", "--quiet", "--update", spec("RefactoredAscendBackend")]) == EXIT_PASS
