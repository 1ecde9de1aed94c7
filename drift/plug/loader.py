"""The front door for code under test: an update or a verify kernel from a spec.

Update specs: a built-in (:data:`drift.flows.registry.UPDATES`, each written for the flow kinds its
entry names), ``mutant:<name>``, ``package.module:qualname`` or ``path/to/file.py:qualname``. The
callee is called as ``fn(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track,
**extra)``. A function's ``self`` is the flow kind's harness (:class:`drift.flows.base.Harness`); a ``Class.method``'s
``self`` is a real instance of that class, made without running its constructor
(``cls.__new__(cls)``), with the harness's attributes attached, so the method's own helpers,
properties and ``super()`` work. Every parameter beyond those four (``model``,
``req_pool_indices``, ...) receives ``None``. An update that reads what the harness lacks raises
:class:`~drift.errors.HarnessLacks` (exit 2: drift could not run it), never a failed check.

Kernel specs: a built-in of :data:`KERNELS` (``portable``, the default, and the engines' ops
through their adapters; ``npu-op:<module|file.py>:<qualname>`` takes any callable with the NPU op's
signature), ``mutant:<name>``, or a ``module|file.py:qualname`` that is itself a
:data:`drift.sim.kernels.VerifyKernel` (``kernel(args: VerifyArgs) -> bf16 out``). A loaded kernel
(:class:`Kernel`) answers for itself which flow kinds' verify rules it implements (:meth:`Kernel.verify`).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..errors import ENDS_PROCESS, DriftError, HarnessLacks, LoadError, ended_by_code, raised_at
from ..flows.base import EVERY_CHOICE
from ..flows.registry import FLOW_KINDS, FLOWS, UPDATES
from ..registry import Registry
from ..sim import kernels
from ..sim.kernels import VerifyKernel
from .mutants import MUTANTS, Mutant
from .npu_op import check_op_signature, legacy_adapter, npu_op_adapter, sgl_kernel_npu_op, torch_npu_legacy_op
from ..sim.shim import sgl_kernels
from .specs import MUTANT_PREFIX, callable_name, resolve_spec
from .triton_interpreter import how_it_ran
from .triton_kernel import TritonAdapter
from .replayssm_engine import ReplayVerifyAdapter
from .flashinfer_replayssm import FlashInferVerify, stand_in_kernel as flashinfer_stand_in
from .vllm_ascend_op import OP_KEYWORDS as VLLM_ASCEND_KEYWORDS, vllm_ascend_adapter, vllm_ascend_op
from .vllm_kernel import VllmQwenAdapter, VllmTritonAdapter

REQUIRED = ("self", "last_correct_step_indices", "mamba_track_indices", "mamba_steps_to_track")
# Names earlier drift releases used for the built-in updates, for a message that points at the new one.
RENAMED = {"guarded": "sglang-31659", "sync_free": "sglang-32130", "device_select": "sglang-0.5.23"}
# An engine's own code, which drift drives through an adapter where the engine imports, by a short name:
# name -> (the adapter's spec, the flow it is written for). Not a built-in: no table runs it by default
# (it needs the engine installed). README: In an engine's CI.
ENGINE_UPDATES = {"vllm:builder": ("drift.plug.vllm_engine:bookkeeping", "vllm")}


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
    take one (``npu-op:<spec>``); ``conformance`` is what it must meet against the portable op;
    ``rules`` the flow kinds' verify rules it implements (``VerifyRule.name``: a flow whose kind
    verifies by another refuses it), None for drift's portable op, which implements every rule
    through ``args.plan()``."""

    name: str
    description: str
    factory: Callable[[Optional[str]], VerifyKernel]
    conformance: Conformance
    takes_arg: bool = False
    rules: Optional[tuple[str, ...]] = ("npu",)
    flow_options: Any = None  # the flow-kind option choices it implements (drift.flows.base.implements)


def _npu_op(arg: Optional[str]) -> VerifyKernel:
    op = resolve_spec(arg or "", "kernel", shown=f"npu-op:{arg}")
    if not callable(op):
        raise LoadError(f"kernel spec 'npu-op:{arg}' resolves to a {type(op).__name__}, not the op")
    check_op_signature(op, f"npu-op:{arg}")
    return npu_op_adapter(op)


def _vllm_ascend_op(arg: Optional[str]) -> VerifyKernel:
    op = resolve_spec(arg or "", "kernel", shown=f"vllm-ascend-op:{arg}")
    if not callable(op):
        raise LoadError(f"kernel spec 'vllm-ascend-op:{arg}' resolves to a {type(op).__name__}, not the op")
    check_op_signature(op, f"vllm-ascend-op:{arg}", positional=0, keywords=VLLM_ASCEND_KEYWORDS,
                       caller="vllm-ascend's call")
    return vllm_ascend_adapter(op)


# q, k and beta rounded to bf16 before the op (vllm-ascend's l2norm_fwd and fused_gdn_gating store
# them in the activation dtype): about 2^-9 relative per input, as npu-legacy's beta (vLLM #53877).
BF16_INPUTS = Conformance(2 ** -6, 1e-2, 2 ** -6, 1e-2, "q, k and beta rounded to bf16 before the op")

KERNELS: Registry[KernelEntry] = Registry("verify kernel")
for _k in (
    KernelEntry("portable", "drift's own op (drift.sim.kernels.recurrent_gated_delta_rule)",
                lambda arg: kernels.recurrent_gated_delta_rule,
                Conformance(0.0, 0.0, 0.0, 0.0, "the reference itself"), rules=None),
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
                lambda arg: VllmTritonAdapter.load(), REORDERED_FP32, rules=("npu", "blocks")),
    KernelEntry("vllm-triton-qwen", "vLLM 0.33.0's Qwen-path Triton fused_sigmoid_gating_delta_rule_update "
                "(the gating computed in the kernel in fp32) through drift's flows",
                # g from fp32 softplus/exp in the kernel against drift's float64 one rounded once: an fp32
                # ulp or so per gate, carried through the decay, on top of the reordered fp32 sums
                lambda arg: VllmQwenAdapter.load(), REORDERED_FP32, rules=("npu", "blocks")),
    KernelEntry("vllm-ascend", "vllm-ascend 0.23.0.post1's AscendC torch.ops._C_ascend.npu_recurrent_gated_delta_rule, "
                "called as vllm_ascend/ops/gdn.py calls it (bf16 normalised q, k and post-sigmoid beta), under --flow vllm",
                lambda arg: vllm_ascend_adapter(vllm_ascend_op()), BF16_INPUTS, rules=("blocks",)),
    KernelEntry("vllm-ascend-op", "any callable with that op's signature through the same adapter (a stand-in or a "
                "new build): vllm-ascend-op:<module|file.py>:<qualname>", _vllm_ascend_op, BF16_INPUTS, takes_arg=True,
                rules=("blocks",)),
    KernelEntry("sglang-replayssm-triton", "SGLang 0.5.23's ReplaySSM spec verify gdn_replayssm_spec_decode (CUDA; "
                "kernels/ops/attention/linear/gdn_replayssm_spec_decode.py), under --flow sglang-replayssm",
                lambda arg: ReplayVerifyAdapter.load(),
                # the chunked UT form with bf16 tensor-core dots against drift's fp32 recurrence
                Conformance(2 ** -6, 1e-2, 2 ** -6, 1e-2, "chunked form, bf16 dot operands"), rules=("ring",)),
    KernelEntry("flashinfer-replayssm", "FlashInfer 0.7.2.post1's ReplaySSM GDN MTP verify gated_delta_rule_mtp("
                "cache_replayssm=True) (SM100/SM103; flashinfer/gdn_decode.py), under --flow sglang-replayssm with "
                "--update drift.plug.flashinfer_replayssm:commit",
                lambda arg: FlashInferVerify.load(),
                # its tcgen05 path takes the state-key and state-query dots in TF32 (10-bit operand mantissas,
                # 2^-11 relative each) against drift's fp32 recurrence; the verify stores no state
                Conformance(0.0, 0.0, 2 ** -6, 1e-2, "TF32 dot operands; no state stored"), rules=("ring",)),
    KernelEntry("flashinfer-replayssm-op", "any object holding gated_delta_rule_mtp and "
                "gated_delta_rule_replayssm_commit through the same adapter (a stand-in or a new build): "
                "flashinfer-replayssm-op:<module|file.py>:<qualname>", flashinfer_stand_in, REORDERED_FP32,
                takes_arg=True, rules=("ring",)),
):
    KERNELS.register(_k.name, _k)


class Described:
    """What the header and the report say ran, for a loaded update or verify kernel (``name``, ``fn``)."""

    name: str
    fn: Callable[..., Any]

    @property
    def description(self) -> str:
        """The name, and how it ran where that is not the code's own arithmetic (an engine's Triton
        kernels under drift's mended interpreter: drift.plug.triton_interpreter.how_it_ran)."""
        return self.name + how_it_ran(self.fn)


@dataclass
class Update(Described):
    """A loaded update implementation, callable as the simulation calls it (with the harness).

    owner: the class of a ``Class.method`` spec (its ``self`` is then an instance of it), else None.
    kinds: the flow kinds it is written for (a built-in's entry, a mutant's flow); empty for a
    plug-in, which may run in any (the harness says what it lacks when it reads it). flow: the flow
    it runs in when the run names none (a mutant's); "" for the first flow of its first kind.
    """

    name: str
    spec: str
    fn: Callable[..., Any]
    extra: tuple[str, ...] = field(default_factory=tuple)
    source: str = ""
    owner: Optional[type] = None
    kinds: tuple[str, ...] = ()
    flow: str = ""
    factory: Optional[Callable[[Any], Any]] = None  # make(harness) -> the owner's instance (--update-factory)
    factory_spec: str = ""
    factory_option: str = "--update-factory"  # as the front end spells it (--drift-update-factory under pytest)
    # The engine's serving bookkeeping the update runs with under a churning lifecycle (a serving mutant's
    # broken one, drift/plug/mutants.py, or what the update's function carries as ``serving``: the vllm
    # flow's drift.flows.in_place.updates.ServingParts); None: its flow kind's own (drift/flows/slots.py
    # and the like).
    serving: Any = None

    @property
    def flow_options(self) -> Any:
        """The flow-kind option choices it implements (its function's ``FLOW_OPTIONS``;
        drift.flows.base.implements): None, the kind's defaults alone."""
        return getattr(self.fn, "FLOW_OPTIONS", None)

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
        without its constructor (or by :attr:`factory`, as the engine makes it), carrying the
        harness's attributes (:attr:`Harness.ATTRIBUTES`)."""
        cache = harness.__dict__.setdefault("_drift_instances", {})
        inst = cache.get(self.owner)
        if inst is None:
            inst = cache[self.owner] = (_bare_instance(self.owner, self.spec) if self.factory is None
                                        else self._made(harness))
            for name in harness.ATTRIBUTES:
                try:
                    object.__setattr__(inst, name, getattr(harness, name))
                except (AttributeError, TypeError) as exc:
                    raise LoadError(f"update spec {self.spec!r}: cannot attach drift's {name} to a "
                                    f"{self.owner.__qualname__} ({exc}); a read-only property or __slots__ "
                                    f"without {name!r} blocks it") from None
        return inst

    def _made(self, harness) -> Any:
        """:attr:`factory`'s object for ``harness``: LoadError (exit 2) when it raises or returns
        something that is not an :attr:`owner`."""
        try:
            inst = self.factory(harness)
        except DriftError:
            raise
        except (Exception, *ENDS_PROCESS) as exc:  # sys.exit in the CI's glue: refused as a raise is, not a FAIL
            if not isinstance(exc, Exception) and not ended_by_code(exc):
                raise  # a signal
            raise LoadError(f"{self.factory_option} {self.factory_spec}: make(harness) raised {exc!r} at {raised_at(exc)}; "
                            "it must return "
                            f"the {self.owner.__qualname__} the update {self.spec} runs on") from exc
        if not isinstance(inst, self.owner):
            same_name = any(c.__qualname__ == self.owner.__qualname__ for c in type(inst).__mro__)
            hint = (f"; it is a class of the same name from another module ({type(inst).__module__}: the file spec "
                    f"{self.spec} was loaded as its own module, and the factory imported the file again): name the "
                    "update as a module (PYTHONPATH=DIR, module:Class.method), or define make in the update's file"
                    if same_name else "; return the engine's object")
            raise LoadError(f"{self.factory_option} {self.factory_spec}: make(harness) returned a "
                            f"{type(inst).__qualname__}, not a {self.owner.__qualname__} (the class of --update "
                            f"{self.spec}){hint}")
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
        provided, how = type(harness).PROVIDED, type(harness).HOW_TO_PROVIDE
        on_instance = obj is me and me is not harness  # the engine class's own attribute, not drift's harness
        elsewhere = [f for f in FLOWS if not on_instance and name in FLOW_KINDS[FLOWS[f].kind].HARNESS.ATTRIBUTES]
        hint = (f" The harness of --flow {' or '.join(elsewhere)} provides self.{name}: if the update is written for "
                f"that engine, pass --flow {elsewhere[0]}." if elsewhere else "")
        if on_instance:
            owner = self.owner.__qualname__
            hint += (f" Or build the {owner} as the engine does, with --update-factory FILE.py:make (pytest: --drift-update-factory) where FILE.py "
                     f"holds the one line `make = lambda harness: {owner}(...)` (its own __init__), or "
                     f"`def make(harness): o = {owner}.__new__({owner}); o.{name} = ...; return o` "
                     "(docs/reference.md: The engine's class, built as it builds it).")
        return HarnessLacks(f"the update under test ({self.spec}) read {what}, which drift's harness does "
                            f"not provide, so drift could not run it (not a regression). drift provides "
                            f"{provided}. To provide it: {how}.{hint}")


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


def mutant(spec: str, target: str) -> Mutant:
    """The catalogue entry a ``mutant:<name>`` spec names; LoadError lists those of ``target``
    ("update" or "kernel", the plug point it replaces)."""
    name = spec[len(MUTANT_PREFIX):]
    m = MUTANTS[name] if name in MUTANTS else None
    if m is None or m.target != target:
        known = ", ".join(f"{MUTANT_PREFIX}{n}" for n, x in MUTANTS.items() if x.target == target)
        raise LoadError(f"{target} spec {spec!r} is not {'an' if target == 'update' else 'a'} {target} mutant; "
                        f"known: {known}")
    return m


# Engine methods an update spec may name by mistake, each known by a parameter only it takes: what it
# is, and how drift runs it instead (vllm/v1/attention/backends/gdn_attn.py: GDNAttentionMetadataBuilder.build
# and vllm/v1/worker/gpu_model_runner.py: _update_states_after_model_execute, vLLM 0.33.0).
NOT_AN_UPDATE = {
    "common_attn_metadata": "vLLM's attention-metadata builder (build(common_prefix_len, common_attn_metadata, ...))",
    "output_token_ids": "vLLM's model-runner step (_update_states_after_model_execute(output_token_ids, "
                        "scheduler_output))",
}


def _check_signature(fn: Callable, spec: str) -> tuple[str, ...]:
    if inspect.ismethod(fn):
        raise LoadError(f"update spec {spec!r} resolves to a bound method; name the function through "
                        "its class (Class.method) so drift can pass its harness as self")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise LoadError(f"update spec {spec!r}: cannot read its signature ({exc})") from exc
    params = list(sig.parameters.values())
    engine = next((NOT_AN_UPDATE[p.name] for p in params if p.name in NOT_AN_UPDATE), None)
    if engine:
        raise LoadError(f"update spec {spec!r} is {engine}, not an update: drift calls an update as "
                        f"{fn.__name__}({', '.join(REQUIRED)}); vLLM's own runner and builder run together as "
                        "the update vllm:builder (drift/plug/vllm_engine.py, where vLLM imports)")
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    has_varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    if len(positional) < 4 and not has_varargs:
        raise LoadError(
            f"update spec {spec!r} has signature {fn.__name__}{sig}; expected at least four positional "
            f"parameters ({', '.join(REQUIRED)}), extra ones such as model or req_pool_indices allowed")
    return tuple(p.name for p in params[4:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def load_update(spec: "str | Callable | Update", factory: Optional[str] = None,
                opt: Callable[[str], str] = lambda name: f"--{name}") -> Update:
    """Turn a spec (or a callable) into an :class:`Update`; raises LoadError naming the spec.
    ``factory``: a ``module|file.py:callable`` spec of ``make(harness)``, the ``self`` of a
    ``Class.method`` update built as the engine builds it (``--update-factory``)."""
    if factory:
        upd = load_update(spec)
        if upd.owner is None:
            raise LoadError(f"{opt('update-factory')} {factory}: the update {upd.spec} is not a Class.method, so "
                            "there is no object to build (a function's self is drift's harness); drop "
                            f"{opt('update-factory')} or name the engine's Class.method")
        make = resolve_spec(factory, "update factory")
        if not callable(make):
            raise LoadError(f"{opt('update-factory')} {factory} resolves to a {type(make).__name__}, not a "
                            "callable make(harness)")
        return dataclasses.replace(upd, factory=make, factory_spec=factory, factory_option=opt("update-factory"))
    if isinstance(spec, Update):
        return spec
    sgl_kernels()  # code under test imports its kernels at module import time
    kinds, flow, serving = (), "", None
    if callable(spec):
        fn, name, text = spec, getattr(spec, "__qualname__", repr(spec)), getattr(spec, "__qualname__", "")
    elif spec in UPDATES:
        fn, name, text, kinds = UPDATES[spec].fn, spec, spec, UPDATES[spec].kinds
    elif spec in RENAMED:
        raise LoadError(f"update spec {spec!r} was renamed: use {RENAMED[spec]!r} (built-ins: "
                        f"{', '.join(UPDATES)})")
    elif spec in ENGINE_UPDATES:
        target, its_flow = ENGINE_UPDATES[spec]
        fn, name, text, kinds = resolve_spec(target, "update"), spec, spec, (FLOWS[its_flow].kind,)
    elif spec.startswith(MUTANT_PREFIX):
        m = mutant(spec, "update")
        fn, name, text, flow, serving = m.fn, spec, spec, m.flow, m.serving
        kinds = (FLOWS[m.flow].kind,) if m.flow else ()
    elif ":" in spec:
        fn, name, text = resolve_spec(spec, "update"), spec.rsplit(":", 1)[1], spec
    else:
        raise LoadError(f"update spec {spec!r} is not a built-in ({', '.join(UPDATES)}) and has no "
                        "':'; expected package.module:qualname or path/to/file.py:qualname")
    if not callable(fn):
        raise LoadError(f"update spec {text!r} resolves to a {type(fn).__name__}, not a function")
    extra = _check_signature(fn, text)
    try:
        source = f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
    except (TypeError, OSError):
        source = ""
    resolved = (isinstance(spec, str) and not spec.startswith(MUTANT_PREFIX) and spec not in UPDATES
                and spec not in ENGINE_UPDATES)
    owner = _owner(fn, spec if resolved else None) if resolved or callable(spec) else None
    return Update(name=name, spec=text, fn=fn, extra=extra, source=source, owner=owner, kinds=kinds, flow=flow,
                  serving=serving if serving is not None else getattr(fn, "serving", None))


@dataclass(frozen=True)
class Kernel(Described):
    """A loaded verify kernel: ``fn(args: VerifyArgs) -> bf16 [L, B, S, HV, V]``. ``name``: what ran
    (the report names it); ``rules``: the flow kinds' verify rules it implements (``VerifyRule.name``),
    None where it declares none (it is then taken to store per-token states where ``args.plan()``
    says); ``portable``: drift's own op, which implements every rule."""

    name: str
    fn: VerifyKernel
    rules: Optional[tuple[str, ...]] = None
    portable: bool = False
    declared: Any = None  # its entry's flow_options (KernelEntry), else read from fn

    @property
    def flow_options(self) -> Any:
        """The flow-kind option choices it implements (drift.flows.base.implements): every one for
        drift's portable op (the flow kind's verify rule writes what the options choose), else its
        entry's or its function's ``FLOW_OPTIONS`` (None: the kind's defaults alone)."""
        if self.portable:
            return EVERY_CHOICE
        return self.declared if self.declared is not None else getattr(self.fn, "FLOW_OPTIONS", None)

    def __call__(self, args) -> Any:
        return self.fn(args)

    def verify(self, rule: type) -> tuple[bool, str]:
        """Whether this kernel implements ``rule`` (a :class:`~drift.sim.kernels.VerifyRule` class), and
        why not: the kernel answers for itself, as flash-linear-attention's backends do."""
        if self.portable or (self.rules is None and rule.per_token_states) or rule.name in (self.rules or ()):
            return True, ""
        if self.rules is None:
            return False, (f"the verify kernel {self.name} declares no verify rules, so it is taken to store the state "
                           f"after each token, which the {rule.name} rule keeps none of: run it under a flow whose "
                           f"rule stores them ({', '.join(flows_verifying(lambda r: r.per_token_states))}), or give "
                           f"it RULES = ({rule.name!r},) and implement that rule")
        return False, (f"the verify kernel {self.name} implements the {' and '.join(self.rules)} rule"
                       f"{'s' if len(self.rules) > 1 else ''}, not the {rule.name} rule this flow verifies by: run it "
                       f"under --flow {' or '.join(flows_verifying(lambda r: r.name in self.rules)) or '(none registered)'}")


def flows_verifying(test: Callable[[type], bool]) -> tuple[str, ...]:
    """The flows whose kind's verify rule passes ``test``, in registry order."""
    return tuple(f for f in FLOWS if test(FLOW_KINDS[FLOWS[f].kind].RULE))


def load_kernel(spec: "str | VerifyKernel | Kernel | None") -> Kernel:
    """A verify kernel from a spec (see the module docstring), as a :class:`Kernel`; LoadError names
    the spec, and refuses a factory that yields no callable."""
    if isinstance(spec, Kernel):
        return spec
    if spec is None or spec == "portable":
        return Kernel("portable", kernels.recurrent_gated_delta_rule, portable=True)
    if callable(spec):
        return Kernel(getattr(spec, "__qualname__", repr(spec)), spec, getattr(spec, "RULES", None))
    name, _, arg = spec.partition(":")
    if name in KERNELS and KERNELS[name].takes_arg and not arg:
        raise LoadError(f"kernel spec {spec!r} needs its argument: {name}:<module|file.py>:<qualname>")
    if name in KERNELS and KERNELS[name].takes_arg == bool(arg):
        entry = KERNELS[name]
        try:
            fn = entry.factory(arg or None)
        except DriftError:
            raise
        except (Exception, *ENDS_PROCESS) as exc:  # an extension's factory: refused naming its line, not a crash
            if not isinstance(exc, Exception) and not ended_by_code(exc):
                raise  # a signal
            raise LoadError(f"kernel {spec!r}: its entry's factory raised {exc!r} at {raised_at(exc)}; it must return "
                            "kernel(args) -> bf16 out, or raise LoadError saying what is missing") from exc
        if not callable(fn):
            raise LoadError(f"kernel {spec!r}: its factory returned {type(fn).__name__}, not a kernel; the entry "
                            f"{name!r} must return kernel(args) -> bf16 out or raise LoadError saying what is missing")
        _check_kernel_signature(fn, f"kernel {spec!r}: its factory returned a kernel that", f"the entry {name!r} "
                                "must return kernel(args: VerifyArgs) -> bfloat16 out")
        return Kernel(spec, fn, entry.rules, portable=fn is kernels.recurrent_gated_delta_rule,
                      declared=entry.flow_options)
    if spec.startswith(MUTANT_PREFIX):
        fn = mutant(spec, "kernel").fn
        return Kernel(spec, fn, getattr(fn, "RULES", None))
    if ":" not in spec:
        raise LoadError(f"kernel spec {spec!r} is not a built-in ({', '.join(KERNELS)}) and has no ':'; "
                        "expected npu-op:<spec>, mutant:<name>, package.module:qualname or path/to/file.py:qualname")
    fn = resolve_spec(spec, "kernel")
    if not callable(fn):
        raise LoadError(f"kernel spec {spec!r} resolves to a {type(fn).__name__}, not a function")
    _check_kernel_signature(fn, f"kernel spec {spec!r}", "expected kernel(args: VerifyArgs) -> bfloat16 out, or "
                            "npu-op:<spec> for a callable with the NPU op's signature")
    return Kernel(spec, fn, getattr(fn, "RULES", None))


def _check_kernel_signature(fn: Callable, what: str, fix: str) -> None:
    """LoadError (exit 2) unless ``fn`` can be called with one VerifyArgs, as the simulation calls a
    kernel: a plugging error found at load, not a regression at the first step."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a signature that cannot be read (a builtin): taken on trust
        return
    try:
        sig.bind(None)
    except TypeError as exc:
        raise LoadError(f"{what} has signature {callable_name(fn)}{sig}, which cannot take one VerifyArgs ({exc}); "
                        f"{fix}") from None


def entry_flow_options(spec: Any) -> tuple[bool, Any]:
    """``(True, declared)`` for a spec naming a built-in kernel entry -- what it implements is known
    without loading it (drift.flows.base.implements) -- else ``(False, None)``."""
    if spec is None or spec == "portable":
        return True, EVERY_CHOICE
    name = spec.partition(":")[0] if isinstance(spec, str) else ""
    return (True, KERNELS[name].flow_options) if name in KERNELS else (False, None)


def mutant_config(spec: Optional[str]) -> dict:
    """Config overrides a ``mutant:`` spec needs to show its bug (empty for other specs)."""
    name = spec[len(MUTANT_PREFIX):] if isinstance(spec, str) and spec.startswith(MUTANT_PREFIX) else ""
    return dict(MUTANTS[name].config or {}) if name in MUTANTS else {}
