"""The engines' Triton kernels on a CPU runner: Triton's interpreter (``TRITON_INTERPRET=1``), made
to store and multiply as a GPU does, and the engines' kernel modules imported without their servers.

An engine CI on a CPU installs the engine with ``--no-deps`` (as drift's own ``.ci/run`` does): the
kernel files are there, but the package roots import the whole server (SGLang 0.5.23's
``sglang/srt/utils/common.py`` and vLLM 0.33.0's ``vllm/__init__.py`` need psutil, einops, regex,
pyzmq, ...). Under the interpreter, :func:`prepare` lets :func:`drift.plug.adapter.engine_function`
import the kernel module anyway, by the ``PARENTS`` of each engine below: the parent packages as
bare namespace modules over the installed files, and the few names the kernel files read from the
server, with the values a CPU run has (no CUDA, no gfx95; vLLM's ``triton_utils`` re-exporting the
installed triton, as it does where triton imports). Nothing is stubbed when the engine itself
imports, nor outside the interpreter.

Two gaps of the interpreter (triton 3.x ``triton/runtime/interpreter.py``) against a GPU, mended
under ``TRITON_INTERPRET=1`` by :func:`correct_interpreter`:

* its fp32 -> bf16 cast truncates (numpy's view of the top 16 bits); a GPU's ``cvt.rn.bf16.f32``
  rounds to nearest even. Uncorrected, every stored state carries a one-sided half-ulp bias,
  which drift's bound catches by design (a CLI run failed it at 2.9);
* it multiplies bf16 ``tl.dot`` operands as their raw uint16 bits; a GPU widens them to fp32
  (bf16 products are exact in fp32).

Both are exact where they apply: the corrected cast is torch's round-to-nearest-even of the same
fp32 values, the widening is a bit shift.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import types

import torch

from ..errors import LoadError


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


MENDED = ("through Triton's interpreter (TRITON_INTERPRET=1), mended by drift to compute as a GPU does: "
          "fp32 -> bf16 casts round to nearest even, bf16 dot operands widen to fp32")


def how_it_ran(fn) -> str:
    """What a run's header and report add to the name of ``fn``, a verify kernel or an update: where it runs
    an engine's Triton kernels (``TRITON`` true) under the interpreter, that and drift's mending
    (:data:`MENDED`), so a reader knows the arithmetic was not the interpreter's own; else ''."""
    return f", {MENDED}" if getattr(fn, "TRITON", False) and interpreting() else ""


# ------------------------------------------------------------------ the engines' servers
STUB = "_drift_stub"  # marks a module drift made in place of an engine's server package


def _namespace(name: str, root: str) -> None:
    mod = types.ModuleType(name)
    mod.__path__ = [os.path.join(root, *name.split(".")[1:])]
    setattr(mod, STUB, True)
    sys.modules[name] = mod


def stubbed(package: str) -> bool:
    return getattr(sys.modules.get(package), STUB, False)


def _sglang(root: str) -> None:
    """SGLang 0.5.23: the parents of ``kernels/ops/attention/{fla,linear}`` and ``srt/utils``, and the
    two helpers its kernel files read from ``sglang.srt.utils.common`` (``torch_release``,
    ``is_gfx95_supported``)."""
    for name in ("sglang", "sglang.kernels", "sglang.kernels.ops", "sglang.kernels.ops.attention",
                 "sglang.kernels.ops.attention.fla", "sglang.kernels.ops.attention.linear", "sglang.srt",
                 "sglang.srt.utils"):
        _namespace(name, root)
    common = types.ModuleType("sglang.srt.utils.common")
    common.torch_release = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    common.is_gfx95_supported = lambda: False
    sys.modules["sglang.srt.utils.common"] = common
    sys.modules["sglang.srt.utils"].is_gfx95_supported = common.is_gfx95_supported


def _vllm(root: str) -> None:
    """vLLM 0.33.0: the parents of ``third_party/flash_linear_attention/ops``, the platform probe
    (``vllm/platforms``: not CUDA) and ``vllm/triton_utils`` (the installed triton, ``HAS_TRITON``)."""
    import triton
    import triton.language as tl
    import triton.language.extra.libdevice as tldevice

    for name in ("vllm", "vllm.third_party", "vllm.third_party.flash_linear_attention",
                 "vllm.third_party.flash_linear_attention.ops"):
        _namespace(name, root)
    plat = types.ModuleType("vllm.platforms")
    plat.current_platform = types.SimpleNamespace(is_cuda_alike=lambda: False, is_cuda=lambda: False)
    sys.modules["vllm.platforms"] = plat
    tu = types.ModuleType("vllm.triton_utils")
    tu.tl, tu.triton, tu.tldevice, tu.HAS_TRITON = tl, triton, tldevice, True
    sys.modules["vllm.triton_utils"] = tu


def _unalias_exp(mod: types.ModuleType) -> None:
    """SGLang's and vLLM's ``fused_recurrent.py`` bind ``exp`` from their ``op.py`` at import
    (``tldevice.fast_expf`` or ``tl.exp``); an alias bound at import escapes the interpreter's
    patching of ``tl``: the module's name then calls ``tl.exp``."""
    import triton.language as tl

    if hasattr(mod, "exp"):
        mod.exp = lambda x, **kw: tl.exp(x)


def _sglang_after(mod: types.ModuleType) -> None:
    """Also: SGLang's ``fla/utils.py: custom_device_ctx`` enters ``torch.<device>.device(index)``, which
    ``torch.cpu`` lacks: on the CPU no device context."""
    import contextlib

    _unalias_exp(mod)
    utils = sys.modules.get("sglang.kernels.ops.attention.fla.utils")
    if utils is not None and hasattr(utils, "custom_device_ctx"):
        utils.custom_device_ctx = lambda index: contextlib.nullcontext()


# package -> (its server stubbed, what its kernel modules need mended after import under the interpreter)
PARENTS = {"sglang": (_sglang, _sglang_after), "vllm": (_vllm, _unalias_exp)}


@contextlib.contextmanager
def _vllm_keeps_triton(package: str):
    """Around the first import of an installed vLLM under the interpreter on a machine without CUDA:
    ``CUDA_VISIBLE_DEVICES=""``. vLLM 0.33.0's ``vllm/triton_utils/importing.py`` turns triton off
    (``HAS_TRITON = False``, placeholders for ``triton`` and ``tl``) unless it finds exactly one active
    driver -- none on a CPU runner, and the interpreter is not one -- except where the visible devices
    are set and empty (its "distributed environment", where 0 drivers are allowed). The variable is
    restored once the import is done."""
    if package != "vllm" or "vllm.triton_utils" in sys.modules or torch.cuda.is_available():
        yield
        return
    # vLLM's CPU platform, as drift/plug/vllm_engine.py sets it (else vLLM cannot infer a device type when
    # the same run puts vLLM's own bookkeeping under test, --update vllm:builder)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def import_kernel_module(module: str) -> types.ModuleType:
    """``importlib.import_module(module)``; under the interpreter, first the interpreter's gaps
    mended, and where the module does not import as installed (a ``--no-deps`` engine: ImportError)
    again over the engine's server stubbed. Outside the interpreter, the plain import."""
    if not interpreting():
        return importlib.import_module(module)
    if importlib.util.find_spec("triton") is None:
        raise LoadError("TRITON_INTERPRET=1 runs the engines' Triton kernels on the CPU through triton's "
                        "interpreter, and triton is not installed: pip install 'triton>=3.2' (drift's "
                        "`triton` extra; docs/torch_range.md says which torch builds allow it)")
    correct_interpreter()
    package = module.split(".")[0]
    stub, after = PARENTS.get(package, (None, None))
    try:
        with _vllm_keeps_triton(package):
            mod = importlib.import_module(module)
    except ImportError:
        if stub is None or stubbed(package):
            raise
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise LoadError(f"{package} is not installed: pip install --no-deps {package}"
                            f"{'==0.5.23' if package == 'sglang' else '==0.33.0'} (the version drift models)") from None
        for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
            del sys.modules[name]  # the partial import, undone
        stub(os.path.dirname(spec.origin))
        mod = importlib.import_module(module)
    if after is not None:
        after(mod)
    return mod


# ------------------------------------------------------------------ the interpreter's gaps
_CORRECTED = "_drift_corrected"


def correct_interpreter() -> None:
    """fp32 -> bf16 casts round to nearest even, bf16 dot operands widened to fp32 (see above);
    idempotent."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    B = interp.InterpreterBuilder
    if getattr(B, _CORRECTED, False):
        return
    dot, cast = B.create_dot, B.cast_impl

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            return interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    def rne_cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            x = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
            return interp.TensorHandle(x.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    B.create_dot = lambda self, a, b, d, p, m: dot(self, widen(a), widen(b), d, p, m)
    B.cast_impl = rne_cast
    B.create_fp_trunc = lambda self, src, dst_type: self.cast_impl(src, dst_type)
    setattr(B, _CORRECTED, True)
