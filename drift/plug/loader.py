"""The front door for code under test: an update or a verify kernel from a spec.

Update specs: a built-in (:data:`drift.plug.updates.BUILTINS`), ``mutant:<name>``,
``package.module:qualname`` or ``path/to/file.py:qualname``. The callee is called as
``fn(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track, **extra)``.
A function's ``self`` is drift's harness (:class:`drift.sim.pool.Harness`); a ``Class.method``'s
``self`` is a real instance of that class, made without running its constructor
(``cls.__new__(cls)``), with the harness's attributes attached, so the method's own helpers,
properties and ``super()`` work. Every parameter beyond those four (``model``,
``req_pool_indices``, ...) receives ``None``. An update that reads what the harness lacks raises
:class:`~drift.errors.HarnessLacks` (exit 2: drift could not run it), never a failed check.

Kernel specs: a built-in of :data:`KERNELS` (``portable``, the default, and the engines' ops
through their adapters; ``npu-op:<module|file.py>:<qualname>`` takes any callable with the NPU op's
signature), ``mutant:<name>``, or a ``module|file.py:qualname`` that is itself a
:data:`drift.sim.kernels.VerifyKernel` (``kernel(args: VerifyArgs) -> bf16 out``).
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..errors import HarnessLacks, LoadError
from ..registry import Registry
from ..sim import kernels
from ..flows.registry import flow_kind
from ..sim.kernels import VerifyKernel
from ..sim.pool import HOW_TO_PROVIDE, PROVIDED
from .mutants import MUTANTS, Mutant
from .npu_op import check_op_signature, legacy_adapter, npu_op_adapter, sgl_kernel_npu_op, torch_npu_legacy_op
from ..sim.shim import sgl_kernels
from .specs import MUTANT_PREFIX, resolve_spec
from .triton_kernel import TritonAdapter
from .updates import BUILTINS, RENAMED, check_flow
from .replayssm_engine import ReplayVerifyAdapter
from .vllm_ascend_op import vllm_ascend_adapter, vllm_ascend_op
from .vllm_kernel import VllmQwenAdapter, VllmTritonAdapter

REQUIRED = ("self", "last_correct_step_indices", "mamba_track_indices", "mamba_steps_to_track")


@dataclass(frozen=True)
class Conformance:
    """How close a kernel must come to drift's portable op on one verify call of the same inputs
    (the kernel tests assert it with :func:`torch.testing.assert_close` on the stored scratch
    states and the outputs): ``rtol``/``atol`` per quantity, and why that much."""

    state_rtol: float
    state_atol: float
    output_rtol: float
    output_atol: float
    why: str


# The same fp32 math summed in another order: a stored state can land on the other side of a
# bf16 rounding boundary, one bf16 ulp (2^-7 relative at most); outputs likewise.
REORDERED_FP32 = Conformance(2 ** -7, 1e-3, 2 ** -7, 2e-3, "fp32 math in another summation order: one bf16 "
                             "rounding boundary (2^-7 relative) at most")


@dataclass(frozen=True)
class KernelEntry:
    """A built-in verify kernel: ``factory(arg)`` loads it (LoadError saying what is missing when it
    cannot run here: the availability probe); ``arg`` is the text after ``name:`` for kernels that
    take one (``npu-op:<spec>``); ``conformance`` is what it must meet against the portable op."""

    name: str
    description: str
    factory: Callable[[Optional[str]], VerifyKernel]
    conformance: Conformance
    takes_arg: bool = False
    # The argument rules it runs (drift.sim.kernels.START_RULES): "ring" kernels verify in the
    # kernel-commit flow only and are held against drift's ring op (tests/sim/test_conformance.py).
    start_rules: tuple[str, ...] = ("npu", "blocks")


def _npu_op(arg: Optional[str]) -> VerifyKernel:
    op = resolve_spec(arg or "", "kernel")
    if not callable(op):
        raise LoadError(f"kernel spec 'npu-op:{arg}' resolves to a {type(op).__name__}, not the op")
    check_op_signature(op, f"npu-op:{arg}")
    return npu_op_adapter(op)


def _vllm_ascend_op(arg: Optional[str]) -> VerifyKernel:
    op = resolve_spec(arg or "", "kernel")
    if not callable(op):
        raise LoadError(f"kernel spec 'vllm-ascend-op:{arg}' resolves to a {type(op).__name__}, not the op")
    return vllm_ascend_adapter(op)


# q, k and beta rounded to bf16 before the op (vllm-ascend's l2norm_fwd and fused_gdn_gating store
# them in the activation dtype): about 2^-9 relative per input, as npu-legacy's beta (vLLM #53877).
BF16_INPUTS = Conformance(2 ** -6, 1e-2, 2 ** -6, 1e-2, "q, k and beta rounded to bf16 before the op")

KERNELS: Registry[KernelEntry] = Registry("verify kernel")
for _k in (
    KernelEntry("portable", "drift's own op (drift.sim.kernels.recurrent_gated_delta_rule)",
                lambda arg: kernels.recurrent_gated_delta_rule,
                Conformance(0.0, 0.0, 0.0, 0.0, "the reference itself")),
    KernelEntry("npu", "torch.ops.npu.recurrent_gated_delta_rule from sgl_kernel_npu, called as SGLang 0.5.23 "
                "calls it (srt/hardware_backend/npu/attention/ascend_gdn_backend.py)",
                lambda arg: npu_op_adapter(sgl_kernel_npu_op()), REORDERED_FP32),
    KernelEntry("npu-op", "any callable with that op's signature through the same adapter (a stand-in or a new "
                "build): npu-op:<module|file.py>:<qualname>", _npu_op, REORDERED_FP32, takes_arg=True),
    KernelEntry("npu-legacy", "torch_npu.npu_recurrent_gated_delta_rule (the older public op)",
                lambda arg: legacy_adapter(torch_npu_legacy_op()),
                # its post-sigmoid beta in bf16 moves states by about 2^-9 relative per token (vLLM #53877)
                Conformance(2 ** -6, 1e-2, 2 ** -6, 1e-2, "beta rounded to bf16 after the sigmoid")),
    KernelEntry("sglang-triton", "SGLang 0.5.23's Triton fused_recurrent_gated_delta_rule_update (CUDA; "
                "kernels/ops/attention/fla/fused_recurrent.py)",
                lambda arg: TritonAdapter.load(), REORDERED_FP32),
    KernelEntry("vllm-triton", "vLLM 0.33.0's Triton fused_recurrent_gated_delta_rule (CUDA; "
                "vllm/third_party/flash_linear_attention/ops/fused_recurrent.py) through drift's flows",
                lambda arg: VllmTritonAdapter.load(), REORDERED_FP32),
    KernelEntry("vllm-triton-qwen", "vLLM 0.33.0's Qwen-path Triton fused_sigmoid_gating_delta_rule_update "
                "(the gating computed in the kernel in fp32) through drift's flows",
                # g from fp32 softplus/exp in the kernel against drift's float64 one rounded once: an fp32
                # ulp or so per gate, carried through the decay, on top of the reordered fp32 sums
                lambda arg: VllmQwenAdapter.load(), REORDERED_FP32),
    KernelEntry("vllm-ascend", "vllm-ascend 0.23.0.post1's AscendC torch.ops._C_ascend.npu_recurrent_gated_delta_rule, "
                "called as vllm_ascend/ops/gdn.py calls it (bf16 normalised q, k and post-sigmoid beta), under --flow vllm",
                lambda arg: vllm_ascend_adapter(vllm_ascend_op()), BF16_INPUTS, start_rules=("blocks",)),
    KernelEntry("vllm-ascend-op", "any callable with that op's signature through the same adapter (a stand-in or a "
                "new build): vllm-ascend-op:<module|file.py>:<qualname>", _vllm_ascend_op, BF16_INPUTS, takes_arg=True,
                start_rules=("blocks",)),
    KernelEntry("sglang-replayssm-triton", "SGLang 0.5.23's ReplaySSM spec verify gdn_replayssm_spec_decode (CUDA; "
                "kernels/ops/attention/linear/gdn_replayssm_spec_decode.py), under --flow sglang-replayssm",
                lambda arg: ReplayVerifyAdapter.load(),
                # the chunked UT form with bf16 tensor-core dots against drift's fp32 recurrence
                Conformance(2 ** -6, 1e-2, 2 ** -6, 1e-2, "chunked form, bf16 dot operands"), start_rules=("ring",)),
):
    KERNELS.register(_k.name, _k)


@dataclass
class Update:
    """A loaded update implementation, callable as the simulation calls it (with the harness).

    owner: the class of a ``Class.method`` spec (its ``self`` is then an instance of it), else None.
    """

    name: str
    spec: str
    fn: Callable[..., Any]
    extra: tuple[str, ...] = field(default_factory=tuple)
    source: str = ""
    owner: Optional[type] = None

    def __call__(self, backend, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track):
        kwargs = {name: None for name in self.extra}
        me = backend if self.owner is None else self.instance(backend)
        try:
            return self.fn(me, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track, **kwargs)
        except AttributeError as exc:
            lacks = self._lacks(exc, backend, me)
            if lacks is None:
                raise
            raise lacks from exc

    def instance(self, harness) -> Any:
        """The ``self`` of a ``Class.method``: one instance of :attr:`owner` per harness, made
        without its constructor, carrying the harness's attributes (:attr:`Harness.ATTRIBUTES`)."""
        cache = harness.__dict__.setdefault("_drift_instances", {})
        inst = cache.get(self.owner)
        if inst is None:
            inst = cache[self.owner] = _bare_instance(self.owner, self.spec)
            for name in harness.ATTRIBUTES:
                try:
                    object.__setattr__(inst, name, getattr(harness, name))
                except (AttributeError, TypeError) as exc:
                    raise LoadError(f"update spec {self.spec!r}: cannot attach drift's {name} to a "
                                    f"{self.owner.__qualname__} ({exc}); a read-only property or __slots__ "
                                    f"without {name!r} blocks it") from None
        return inst

    def _lacks(self, exc: AttributeError, harness, me) -> Optional[HarnessLacks]:
        """A :class:`HarnessLacks` when ``exc`` is an attribute read on the instance or a harness
        object that drift does not provide (None for any other AttributeError: a bug of the update)."""
        obj, name = getattr(exc, "obj", None), getattr(exc, "name", None)
        objects = harness.objects() if hasattr(type(harness), "objects") else (harness,)
        if name is None or not any(obj is o for o in (*objects, me)):
            return None
        if obj is me and me is not harness:
            what = f"self.{name}, on a {type(me).__qualname__} built without running its constructor"
        elif obj is harness:
            what = f"self.{name}"
        else:
            what = f"{name!r} of {type(obj).__name__.lstrip('_')}"
        provided = getattr(type(harness), "PROVIDED", PROVIDED)
        how = getattr(type(harness), "HOW_TO_PROVIDE", HOW_TO_PROVIDE)
        return HarnessLacks(f"the update under test ({self.spec}) read {what}, which drift's harness does "
                            f"not provide, so drift could not run it (not a regression). drift provides "
                            f"{provided}. To provide it: {how}.")


def _bare_instance(cls: type, spec: str) -> Any:
    """``cls.__new__(cls)`` (``object.__new__`` when that needs arguments), no ``__init__``."""
    try:
        return cls.__new__(cls)
    except TypeError:
        pass
    try:
        return object.__new__(cls)
    except TypeError as exc:
        raise LoadError(f"update spec {spec!r}: cannot make a {cls.__qualname__} without its constructor "
                        f"({exc}); name a concrete class (every abstract method implemented)") from None


def _owner(fn: Callable, spec: str) -> Optional[type]:
    """The class whose method ``fn`` is: the class a ``module:Class.method`` spec names, or for
    a callable its ``__qualname__``'s class; None for a function or a staticmethod."""
    if isinstance(spec, str) and ":" in spec:
        target, qualname = spec.rsplit(":", 1)
        parts = qualname.split(".")
        if len(parts) < 2:
            return None
        holder = resolve_spec(f"{target}:{'.'.join(parts[:-1])}", "update")
    else:
        parts = getattr(fn, "__qualname__", "").split(".")
        if len(parts) < 2 or "<locals>" in parts:
            return None
        holder = sys.modules.get(getattr(fn, "__module__", ""), None)
        for part in parts[:-1]:
            holder = getattr(holder, part, None)
    if not inspect.isclass(holder):
        return None
    try:
        raw = inspect.getattr_static(holder, parts[-1])
    except AttributeError:
        return None
    return None if isinstance(raw, (staticmethod, classmethod)) or not inspect.isfunction(raw) else holder


def mutant(spec: str, kind: str) -> Mutant:
    """The catalogue entry a ``mutant:<name>`` spec names; LoadError lists those of ``kind``."""
    m = MUTANTS.get(spec[len(MUTANT_PREFIX):])
    if m is None or m.kind != kind:
        known = ", ".join(f"{MUTANT_PREFIX}{n}" for n, x in MUTANTS.items() if x.kind == kind)
        raise LoadError(f"{kind} spec {spec!r} is not {'an' if kind == 'update' else 'a'} {kind} mutant; "
                        f"known: {known}")
    return m


def _check_signature(fn: Callable, spec: str) -> tuple[str, ...]:
    if inspect.ismethod(fn):
        raise LoadError(f"update spec {spec!r} resolves to a bound method; name the function through "
                        "its class (Class.method) so drift can pass its harness as self")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise LoadError(f"update spec {spec!r}: cannot read its signature ({exc})") from exc
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    has_varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    if len(positional) < 4 and not has_varargs:
        raise LoadError(
            f"update spec {spec!r} has signature {fn.__name__}{sig}; expected at least four positional "
            f"parameters ({', '.join(REQUIRED)}), extra ones such as model or req_pool_indices allowed")
    return tuple(p.name for p in params[4:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def load_update(spec: "str | Callable | Update") -> Update:
    """Turn a spec (or a callable) into an :class:`Update`; raises LoadError naming the spec."""
    if isinstance(spec, Update):
        return spec
    sgl_kernels()  # code under test imports its kernels at module import time
    if callable(spec):
        fn, name, text = spec, getattr(spec, "__qualname__", repr(spec)), getattr(spec, "__qualname__", "")
    elif spec in BUILTINS:
        fn, name, text = BUILTINS[spec], spec, spec
    elif spec in RENAMED:
        raise LoadError(f"update spec {spec!r} was renamed: use {RENAMED[spec]!r} (built-ins: "
                        f"{', '.join(BUILTINS)})")
    elif spec.startswith(MUTANT_PREFIX):
        fn, name, text = mutant(spec, "update").fn, spec, spec
    elif ":" in spec:
        fn, name, text = resolve_spec(spec, "update"), spec.rsplit(":", 1)[1], spec
    else:
        raise LoadError(f"update spec {spec!r} is not a built-in ({', '.join(BUILTINS)}) and has no "
                        "':'; expected package.module:qualname or path/to/file.py:qualname")
    if not callable(fn):
        raise LoadError(f"update spec {text!r} resolves to a {type(fn).__name__}, not a function")
    extra = _check_signature(fn, text)
    try:
        source = f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
    except (TypeError, OSError):
        source = ""
    resolved = isinstance(spec, str) and not spec.startswith(MUTANT_PREFIX) and spec not in BUILTINS
    owner = _owner(fn, spec if resolved else None) if resolved or callable(spec) else None
    return Update(name=name, spec=text, fn=fn, extra=extra, source=source, owner=owner)


def update_for(cfg, update: "str | Callable | Update | None" = None) -> Update:
    """The update a run of ``cfg`` puts under test: ``update`` loaded (None: the state flow's own
    built-in, drift/flows/registry.py), refused (LoadError, exit 2) when it is a built-in written for
    another kind of flow (:func:`drift.plug.updates.check_flow`)."""
    upd = update if isinstance(update, Update) else load_update(update or flow_kind(cfg).default_update)
    check_flow(upd.spec, cfg.flow)
    return upd

def load_kernel(spec: "str | VerifyKernel | None") -> VerifyKernel:
    """A verify kernel from a spec (see the module docstring); LoadError names the spec."""
    if spec is None:
        return kernels.recurrent_gated_delta_rule
    if callable(spec):
        return spec
    name, _, arg = spec.partition(":")
    if name in KERNELS and KERNELS[name].takes_arg and not arg:
        raise LoadError(f"kernel spec {spec!r} needs its argument: {name}:<module|file.py>:<qualname>")
    if name in KERNELS and KERNELS[name].takes_arg == bool(arg):
        return KERNELS[name].factory(arg or None)
    if spec.startswith(MUTANT_PREFIX):
        return mutant(spec, "kernel").fn
    if ":" not in spec:
        raise LoadError(f"kernel spec {spec!r} is not a built-in ({', '.join(KERNELS)}) and has no ':'; "
                        "expected npu-op:<spec>, mutant:<name>, package.module:qualname or path/to/file.py:qualname")
    fn = resolve_spec(spec, "kernel")
    if not callable(fn):
        raise LoadError(f"kernel spec {spec!r} resolves to a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind(None)
    except TypeError as exc:
        raise LoadError(f"kernel spec {spec!r} has signature {getattr(fn, '__name__', fn)}"
                        f"{inspect.signature(fn)}, which cannot take one VerifyArgs ({exc}); expected "
                        "kernel(args: VerifyArgs) -> bfloat16 out, or npu-op:<spec> for a callable with the NPU "
                        "op's signature") from None
    except ValueError:  # a signature that cannot be read (a builtin): taken on trust
        pass
    return fn


def mutant_config(spec: Optional[str]) -> dict:
    """Config overrides a ``mutant:`` spec needs to show its bug (empty for other specs)."""
    if isinstance(spec, str) and spec.startswith(MUTANT_PREFIX):
        m = MUTANTS.get(spec[len(MUTANT_PREFIX):])
        return dict(m.config or {}) if m else {}
    return {}
