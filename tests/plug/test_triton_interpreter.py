"""The engines' Triton kernels on a CPU runner (drift/plug/triton_interpreter.py): the interpreter's
fp32 -> bf16 store mended to round to nearest as a GPU does, and what is missing named when a kernel
cannot load. The kernels themselves run under it in tests/sim/test_conformance.py."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

STORE = textwrap.dedent("""
    import sys, torch, triton, triton.language as tl
    @triton.jit
    def store_bf16(x, y, n: tl.constexpr):
        i = tl.arange(0, n)
        tl.store(y + i, tl.load(x + i).to(tl.bfloat16))
    if sys.argv[1] == "mended":
        from drift.plug.triton_interpreter import correct_interpreter
        correct_interpreter()
    # 1 + 3/4 ulp of bf16 at 1 (2^-7), its negative, an exact value, 1 + 1/4 ulp
    x = torch.tensor([1 + 0.75 * 2 ** -7, -(1 + 0.75 * 2 ** -7), 3.0, 1 + 0.25 * 2 ** -7], dtype=torch.float32)
    y = torch.empty(4, dtype=torch.bfloat16)
    store_bf16[(1,)](x, y, 4)
    print(torch.equal(y, x.to(torch.bfloat16)), torch.equal(y, torch.tensor([1.0, -1.0, 3.0, 1.0]).bfloat16()))
""")


def _interpreted(*args: str) -> str:
    res = subprocess.run([sys.executable, "-c", STORE, *args], env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.split()


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (drift's `triton` extra)")
def test_the_mended_interpreter_stores_bf16_as_a_gpu_rounds():
    assert _interpreted("mended") == ["True", "False"]  # torch's round to nearest even, bit for bit
    assert _interpreted("plain") == ["False", "True"]  # the control: unmended, the interpreter truncates


def test_outside_the_interpreter_a_kernel_that_does_not_import_names_the_missing_piece_and_the_way(tmp_path):
    """With vLLM installed --no-deps (as .ci/run installs it), its kernel module lacks the server's
    dependencies: exit 2, naming the missing module and TRITON_INTERPRET=1 (fresh processes: a
    failed import leaves parents behind)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vllm installed (pip install vllm==0.33.0 --no-deps)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    probe = subprocess.run([sys.executable, "-c", "import vllm.third_party.flash_linear_attention.ops.fused_recurrent"],
                           env=env, capture_output=True, text=True, timeout=300)
    if probe.returncode == 0:
        pytest.skip("vllm's kernel module imports here (a full vLLM install): nothing is missing")
    missing = probe.stderr.strip().splitlines()[-1].split("No module named ")[-1]
    res = subprocess.run([sys.executable, "-m", "drift", "run", "--kernel", "vllm-triton", "--steps", "2", "--quiet"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert f"No module named {missing}" in res.stderr and "TRITON_INTERPRET=1" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_under_the_interpreter_without_triton_the_message_says_install_it(monkeypatch):
    from drift.errors import LoadError
    from drift.plug import triton_interpreter

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(LoadError, match=r"triton is not installed: pip install 'triton>=3.2'"):
        triton_interpreter.import_kernel_module("vllm.third_party.flash_linear_attention.ops.fused_recurrent")
