"""drift.loader: the plug point. Specs by module path, file path and Class.method; extra
parameters receive None; the sgl_kernel_npu shim (and the real package when present);
errors that name the spec and what was expected."""

from __future__ import annotations

import re

import importlib
import sys
import textwrap

import pytest

from helpers import checks_of, small_cfg
from drift.sim import kernels
from drift.errors import LoadError
from drift.plug.loader import load_update
from drift.sim.shim import SHIM_MODULE, kernels_in_use, sgl_kernels
from drift.flows.copy_commit.harness import SGLangHarness
from drift.flows.registry import UPDATES

SHIM_NAMES = ("sgl_kernel_npu", "sgl_kernel_npu.mamba", SHIM_MODULE)

# An update written the way SGLang's Ascend backend writes it (newest signature, with
# ``model`` and ``req_pool_indices``), importing its kernels from sgl_kernel_npu. It
# records what it was called with.
PLUGIN = textwrap.dedent('''
    import torch
    from sgl_kernel_npu.mamba.mamba_state_update_triton import move_intermediate_cache, conv_state_rollback

    CALLS = []


    def update(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track, model,
               req_pool_indices=None):
        CALLS.append((self, model, req_pool_indices))
        last = last_correct_step_indices.to(torch.int64)
        n = last.shape[0]
        dst = self.linear_attn_backend.forward_metadata.mamba_cache_indices[:n].to(torch.int64)
        p = self.linear_attn_backend.req_to_token_pool.get_speculative_mamba2_params_all_layers()
        conv, d = p.conv[0], p.intermediate_ssm.shape[2]
        src = torch.arange(n, device=dst.device)
        move_intermediate_cache(p.temporal, p.intermediate_ssm, dst, src, last)
        if mamba_track_indices is not None:
            track, steps = mamba_track_indices.to(torch.int64), mamba_steps_to_track.to(torch.int64)
            move_intermediate_cache(p.temporal, p.intermediate_ssm, track, src, steps)
            conv[:, track] = conv[:, torch.where(steps >= 0, dst, track)]
        conv_state_rollback(conv, dst, last, d)
        if mamba_track_indices is not None:
            conv_state_rollback(conv, track, steps, d)


    class Backend:
        def update_mamba_state_after_mtp_verify(self, last_correct_step_indices, mamba_track_indices,
                                                mamba_steps_to_track, model, req_pool_indices=None):
            return update(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track,
                          model, req_pool_indices)


    def two_args(self, last_correct_step_indices):
        pass


    NOT_CALLABLE = 3
    instance = Backend()
''')

STEPS = 40  # crosses a few track boundaries (interval 16): the tracking path runs too


@pytest.fixture
def plugin_file(tmp_path):
    path = tmp_path / "plug.py"
    path.write_text(PLUGIN)
    return path


def _unload_sgl(monkeypatch):
    for name in SHIM_NAMES:
        monkeypatch.delitem(sys.modules, name)


def _run_and_check_calls(spec):
    upd = load_update(spec)
    res = checks_of(small_cfg(STEPS), upd)
    assert res["report"].passed, [c for c in res["report"].checks if c.failed]
    calls = upd.fn.__globals__["CALLS"]
    assert len(calls) == STEPS
    for self_, model, req_pool_indices in calls:
        assert model is None and req_pool_indices is None
        if upd.owner is None:  # a function: self is drift's harness
            assert isinstance(self_, SGLangHarness)
        else:  # a Class.method: self is one instance of that class carrying the harness's backend
            assert type(self_) is upd.owner and self_ is calls[0][0]
            assert type(self_.linear_attn_backend).__name__ == "_LinearAttnBackend"  # the harness's own
    return upd


def test_builtins_by_name():
    for name, entry in UPDATES.items():
        fn = entry.fn
        upd = load_update(name)
        assert upd.fn is fn and upd.name == name
        # SGLang's method takes model and req_pool_indices; vLLM's bookkeeping nothing more
        assert upd.extra == (("model", "req_pool_indices") if entry.kinds == ("copy-commit",) else ()), name


def test_load_by_file_path(plugin_file):
    upd = _run_and_check_calls(f"{plugin_file}:update")
    assert upd.extra == ("model", "req_pool_indices") and str(plugin_file) in upd.source


def test_load_by_module_path(tmp_path, monkeypatch):
    pkg = tmp_path / "drift_test_plugpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "impl.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    _run_and_check_calls("drift_test_plugpkg.impl:update")


def test_load_a_class_method_called_with_an_instance_of_its_class(plugin_file):
    upd = _run_and_check_calls(f"{plugin_file}:Backend.update_mamba_state_after_mtp_verify")
    assert upd.name == "Backend.update_mamba_state_after_mtp_verify" and upd.owner.__name__ == "Backend"


def test_plugin_imports_the_shim_and_gets_drifts_kernels(plugin_file, monkeypatch):
    _unload_sgl(monkeypatch)  # start from a process where nothing installed the shim yet
    upd = load_update(f"{plugin_file}:update")
    assert getattr(sys.modules[SHIM_MODULE], "__drift_shim__", False)
    g = upd.fn.__globals__
    assert g["move_intermediate_cache"] is kernels.move_intermediate_cache
    assert g["conv_state_rollback"] is kernels.conv_state_rollback
    assert kernels_in_use() == "drift portable (shim)"
    _run_and_check_calls(f"{plugin_file}:update")


def _install_fake_sgl_kernel_npu(root, body, monkeypatch):
    """An importable sgl_kernel_npu under ``root`` whose kernel module is ``body``, with the
    shim unloaded (both undone after the test)."""
    mamba = root / "sgl_kernel_npu" / "mamba"
    mamba.mkdir(parents=True)
    (root / "sgl_kernel_npu" / "__init__.py").write_text("")
    (mamba / "__init__.py").write_text("")
    (mamba / "mamba_state_update_triton.py").write_text(textwrap.dedent(body))
    _unload_sgl(monkeypatch)
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()


def test_the_real_package_is_used_when_present(tmp_path, monkeypatch):
    _install_fake_sgl_kernel_npu(tmp_path, '''
        from drift.sim import kernels
        CALLS = {"move": 0, "rollback": 0}
        def move_intermediate_cache(*args):
            CALLS["move"] += 1
            return kernels.move_intermediate_cache(*args)
        def conv_state_rollback(*args):
            CALLS["rollback"] += 1
            return kernels.conv_state_rollback(*args)
    ''', monkeypatch)
    mod = sgl_kernels()
    assert not getattr(mod, "__drift_shim__", False) and kernels_in_use() == "sgl_kernel_npu"
    res = checks_of(small_cfg(STEPS), "sglang-32130")
    assert res["report"].passed and res["report"].info.kernels == "sgl_kernel_npu"
    assert mod.CALLS["move"] >= STEPS and mod.CALLS["rollback"] >= STEPS


def test_a_broken_real_package_is_an_error_not_a_silent_shim(tmp_path, monkeypatch):
    _install_fake_sgl_kernel_npu(tmp_path, "raise ImportError('libascend missing')\n", monkeypatch)
    with pytest.raises(LoadError, match="installed but.*libascend missing"):
        sgl_kernels()


def test_keyword_only_extras_get_none_and_old_signatures_load():
    seen = {}

    def new_style(self, last, track, steps, *, model, req_pool_indices, **kw):
        seen.update(model=model, req_pool_indices=req_pool_indices, kw=kw)

    def old_style(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track):
        pass

    upd = load_update(new_style)
    assert upd.extra == ("model", "req_pool_indices")
    upd(None, None, None, None)
    assert seen == {"model": None, "req_pool_indices": None, "kw": {}}
    assert load_update(old_style).extra == ()


# ----------------------------------------------------------------------- errors
@pytest.mark.parametrize("qualname, expected", [
    ("nope", r"has no attribute 'nope'; it has: .*Backend.*update"),
    ("Backend.nope", r"Backend has no attribute 'nope'"),
    ("two_args", r"signature two_args\(self, last_correct_step_indices\); expected at least four "
                 r"positional parameters \(self, last_correct_step_indices, mamba_track_indices, "
                 r"mamba_steps_to_track\)"),
    ("NOT_CALLABLE", r"resolves to a int, not a function"),
    ("instance.update_mamba_state_after_mtp_verify", r"bound method; name the function through its class"),
])
def test_load_errors_name_the_spec_and_what_was_expected(plugin_file, qualname, expected):
    spec = f"{plugin_file}:{qualname}"
    with pytest.raises(LoadError, match=expected) as exc:
        load_update(spec)
    assert spec in str(exc.value)


@pytest.mark.parametrize("spec, expected", [
    ("/nonexistent/dir/upd.py:fn", r"file '/nonexistent/dir/upd.py' not found .*expected path/to/file.py:qualname"),
    ("no_such_module_for_drift:fn", r"no module 'no_such_module_for_drift' can be imported here"),
    ("sglang-0.5.2", r"not a built-in \(" + re.escape(", ".join(UPDATES)) + r"\).*expected "
                     r"package.module:qualname or path/to/file.py:qualname"),
    ("sync_free", r"'sync_free' was renamed: use 'sglang-32130'"),
    ("drift.flows.copy_commit.updates:", r"expected module:qualname or file.py:qualname"),
])
def test_load_errors_for_bad_targets(spec, expected):
    with pytest.raises(LoadError, match=expected) as exc:
        load_update(spec)
    assert repr(spec) in str(exc.value)


def test_a_file_that_fails_to_import_names_the_spec(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('boom at import')\n")
    spec = f"{path}:fn"
    with pytest.raises(LoadError, match=r"importing .*broken.py raised RuntimeError\('boom at import'\)") as exc:
        load_update(spec)
    assert repr(spec) in str(exc.value)


class _VllmShapedBuilder:  # vLLM 0.33.0's signatures (gdn_attn.py, gpu_model_runner.py), no vLLM needed
    def build(self, common_prefix_len, common_attn_metadata, num_accepted_tokens=None,
              num_decode_draft_tokens_cpu=None, fast_build=False):
        raise AssertionError("never called")

    def _update_states_after_model_execute(self, output_token_ids, scheduler_output):
        raise AssertionError("never called")


@pytest.mark.parametrize("method, words", [
    ("build", "vLLM's attention-metadata builder"),
    ("_update_states_after_model_execute", "vLLM's model-runner step")])
def test_vllms_own_methods_named_as_an_update_are_refused_pointing_at_vllm_builder(method, words):
    """The builder's build takes four positional parameters, so the signature alone let it through and
    it failed as a regression (exit 1) on its first call; refused now (LoadError: exit 2 / 4)."""
    with pytest.raises(LoadError, match=f"{words}.*not an update.*the update vllm:builder"):
        load_update(getattr(_VllmShapedBuilder, method))



def test_a_module_spec_that_is_not_importable_says_so_and_how(tmp_path, monkeypatch):
    """A module spec naming nothing importable said where importlib's frozen machinery raised
    (``<frozen importlib._bootstrap>:1140``, a user trial); now that no such module can be imported and
    how to name one. Its control: a module that exists but imports a missing one is named at that
    import's own line, not at importlib's."""
    with pytest.raises(LoadError, match=r"no module 'drift_no_such_pkg' can be imported here .*PYTHONPATH.*"
                                        r"path/to/file\.py:qualname") as info:
        load_update("drift_no_such_pkg.mod:update")
    assert "frozen" not in str(info.value)
    pkg = tmp_path / "drift_pkg_imports_missing"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "m.py").write_text("X = 1\nimport drift_no_such_module_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(LoadError, match=r"importing module 'drift_pkg_imports_missing\.m' raised "
                                        r"ModuleNotFoundError.*drift_pkg_imports_missing.m\.py:2$"):
        load_update("drift_pkg_imports_missing.m:update")


def test_an_error_in_a_module_the_spec_file_imports_names_that_modules_line(tmp_path):
    """It named the spec file's import line alone (a user trial); now the line that raised, then where from."""
    (tmp_path / "drift_sibling_raises.py").write_text("X = 1\ny = undefined_name\n")
    (tmp_path / "upd.py").write_text("import drift_sibling_raises\n\ndef update(self, a, b, c):\n    pass\n")
    with pytest.raises(LoadError, match=r"drift_sibling_raises\.py:2 \(imported from .*upd\.py:1\)"):
        load_update(f"{tmp_path / 'upd.py'}:update")
