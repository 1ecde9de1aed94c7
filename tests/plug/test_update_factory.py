"""--update-factory: the engine's class built as the engine builds it (issue 32 item 3). The factory's
object is what the update runs on (a wrong build fails as a regression, exit 1); a factory that cannot
build it, or a spec with nothing to build, is exit 2 naming it; a harness gap suggests the factory."""

from __future__ import annotations

from pathlib import Path

import pytest

from drift.cli import main
from drift.errors import EXIT_FAIL, EXIT_PASS, EXIT_USAGE

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
UPDATE = f"{FIXTURES / 'engine_init.py'}:InitBackend.update_mamba_state_after_mtp_verify"
STEPS = 40  # crosses track boundaries of ci-small at its least acceptance: the tracking path runs


def _run(capsys, *args):
    rc = main(["run", "--steps", str(STEPS), "--quiet", "--update", UPDATE, *args])
    return rc, capsys.readouterr()


def factory(name: str) -> str:
    return f"{FIXTURES / 'engine_init.py'}:{name}"


def test_without_the_factory_the_gap_names_the_attribute_and_the_factory_that_fills_it(capsys):
    rc, out = _run(capsys)
    assert rc == EXIT_USAGE
    assert "self.draft_token_num" in out.err and "--update-factory FILE.py:make" in out.err
    assert "make = lambda harness: InitBackend(...)" in out.err and "Traceback" not in out.err


def test_the_engines_own_init_builds_it_and_every_check_passes(capsys):
    rc, out = _run(capsys, "--update-factory", factory("make"))
    assert rc == EXIT_PASS, out.err + out.out


def test_a_wrong_build_is_a_regression_not_a_refusal(capsys):
    """The negative control: the factory's object is the one that runs (one draft token: root commits)."""
    rc, out = _run(capsys, "--update-factory", factory("make_wrong"))
    assert rc == EXIT_FAIL, out.err + out.out
    assert "committed state" in out.out


@pytest.mark.parametrize("name, needle", [("make_not_a_backend", "returned a object, not a InitBackend"),
                                          ("make_raises", "make(harness) raised RuntimeError"),
                                          # ending the process is the glue failing as a raise is: exit 2 at its
                                          # line (it was exit 1, blamed on the update)
                                          ("make_exits", "make(harness) raised SystemExit(0) at "),
                                          ("make_os_exits", "make(harness) raised os._exit(0) at ")])
def test_a_factory_that_cannot_build_it_is_exit_2_naming_it(capsys, name, needle):
    rc, out = _run(capsys, "--update-factory", factory(name))
    assert rc == EXIT_USAGE and needle in out.err and "Traceback" not in out.err, out.err


def test_a_function_update_has_nothing_to_build(capsys):
    rc = main(["run", "--steps", "8", "--quiet", "--update", "sglang-0.5.23", "--update-factory", factory("make")])
    err = capsys.readouterr().err
    assert rc == EXIT_USAGE and "is not a Class.method" in err


def test_the_gate_takes_the_factory(tmp_path):
    """pytest --pyargs drift --drift-update-factory: the same object through the plugin."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "drift",
                          "-k", "precision", "--drift-steps", str(STEPS), "--drift-update", UPDATE,
                          "--drift-update-factory", factory("make_wrong")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 1 and "committed state" in res.stdout, res.stdout[-2000:]


def _shipped_sglang_init():
    """SGLang 0.5.23's own ``HybridLinearAttnBackend.__init__``, compiled from the installed source (its module
    does not import without SGLang's server dependencies), with the names it reads from that module: the
    graph config unpublished (``check_cuda_graph_backend`` is False then, cuda_graph_config.py), a logger."""
    import ast
    import importlib.util
    import logging
    import types

    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        pytest.skip("sglang is not installed (.ci/run installs sglang==0.5.23 --no-deps)")
    path = Path(spec.origin).parent / "srt" / "layers" / "attention" / "hybrid_linear_attn_backend.py"
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "HybridLinearAttnBackend")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    scope = {"check_cuda_graph_backend": lambda phase, backend: False, "logger": logging.getLogger("sglang-init"),
             "Phase": types.SimpleNamespace(PREFILL="prefill"), "Backend": types.SimpleNamespace(BREAKABLE="breakable"),
             "AttentionBackend": object, "MambaAttnBackendBase": object}
    exec(compile(ast.Module([init], []), str(path), "exec"), scope)
    return scope["__init__"]


def test_the_readmes_sglang_factory_builds_through_sglangs_own_constructor():
    """The README's ci_factory.py recipe, run as written against SGLang 0.5.23's shipped constructor: it read
    needs_cpu_seq_lens of the stand-in and of drift's linear backend, which had neither (a user trial's
    AttributeError, exit 2)."""
    import re
    import textwrap
    import sys
    import types

    from drift import preset
    from drift.flows.registry import state_flow

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    recipe = re.search(r"# ci_factory.py\n(.*?)```", readme, re.S).group(1)
    shipped = type("AscendHybridLinearAttnBackend", (), {"__init__": _shipped_sglang_init()})
    name = "sglang.srt.hardware_backend.npu.attention.ascend_hybrid_linear_attn_backend"
    fake = types.ModuleType(name)
    fake.AscendHybridLinearAttnBackend = shipped
    saved = {k: sys.modules.get(k) for k in (name,)}
    sys.modules[name] = fake
    try:
        scope: dict = {}
        exec(compile(textwrap.dedent(recipe), "README.md:ci_factory.py", "exec"), scope)
    finally:
        for k, v in saved.items():
            sys.modules.pop(k) if v is None else sys.modules.__setitem__(k, v)
    harness = state_flow(preset("ci-small"), __import__("torch").device("cpu")).harness
    backend = scope["make"](harness)
    assert backend.linear_attn_backend is harness.linear_attn_backend and backend.needs_cpu_seq_lens is True


def test_a_factory_that_imports_the_update_file_again_is_told_how_to_name_it(capsys, tmp_path):
    """A file spec is loaded as its own module; a factory that imports the same file by module name gets a
    second class of the same name. Refused (exit 2) saying so and what to do, not "a X, not a X"."""
    import shutil

    for name in ("engine_init.py", "ascend_subclass.py", "ascend_backend.py"):
        shutil.copy(FIXTURES / name, tmp_path / name)
    (tmp_path / "fac.py").write_text(f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\nfrom engine_init import make\n")
    rc = main(["run", "--steps", "8", "--quiet", "--update",
               f"{tmp_path / 'engine_init.py'}:InitBackend.update_mamba_state_after_mtp_verify",
               "--update-factory", f"{tmp_path / 'fac.py'}:make"])
    err = capsys.readouterr().err
    assert rc == EXIT_USAGE and "a class of the same name from another module" in err and "Traceback" not in err, err
