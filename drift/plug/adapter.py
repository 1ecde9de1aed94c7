"""One base for the adapters that run an engine's per-layer verify op as a drift verify kernel.

An engine calls its GDN verify op once per layer; drift's kernels take every layer at once
(:class:`drift.sim.kernels.VerifyArgs`). :class:`LayerOpAdapter` owns what every such adapter
needs and nothing engine-specific: the layer loop, each row's start state gathered where the
op takes it gathered (the committed state or the previous scratch block, docs/semantics.md §6),
the write-back of per-token states the op returns in its own buffer into drift's scratch blocks,
the bf16 output assembly, the kernel's name, and a failure named by layer. A subclass says how
one layer is called (:meth:`LayerOpAdapter.call_layer`).
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Callable

import torch

from ..errors import LoadError, UpdateRaised
from ..sim import kernels
from ..sim.kernels import VerifyArgs
from ..sim.pool import raw_state

BF16, F32 = torch.bfloat16, torch.float32


def engine_function(module: str, function: str, kernel: str, engine: str, needed_by: str = "") -> Callable:
    """``module.function`` from an installed engine; LoadError saying what is missing (the
    availability probe of ``--kernel <kernel>``, or of what ``needed_by`` names; ``engine`` names the
    package and the version drift modelled, e.g. "sglang (0.5.23 was modelled)")."""
    from . import triton_interpreter

    who = needed_by or f"--kernel {kernel}"
    try:  # under TRITON_INTERPRET=1 with the interpreter mended, a --no-deps engine's server stubbed
        mod = triton_interpreter.import_kernel_module(module)
    except LoadError:
        raise
    except Exception as exc:
        hint = ("" if triton_interpreter.interpreting() else "; on a CPU runner with the engine installed "
                "--no-deps, TRITON_INTERPRET=1 runs it through triton's interpreter, with the engine's server "
                "stubbed (docs/reference.md: Triton kernels on a CPU)")
        raise LoadError(f"{who} needs an installed {engine} with triton; importing {module} raised "
                        f"{exc!r}{hint}") from exc
    fn = getattr(mod, function, None)
    if fn is None:
        raise LoadError(f"{module} has no {function}; this is not the {engine}")
    triton = getattr(mod, "triton", None)
    if triton is not None and not hasattr(triton, "next_power_of_2"):
        # An engine may hand out a placeholder when it finds no usable triton (vLLM's triton_utils with
        # HAS_TRITON false): the module imports, and every call would fail.
        where = ("; the engine had turned triton off before drift could hand it the interpreter (vLLM's "
                 "triton_utils/importing.py finds no active GPU driver on a CPU: it was imported first, by "
                 "another part of the run)" if triton_interpreter.interpreting() else
                 "; the engines probe their platform for it (a GPU): on a CPU runner TRITON_INTERPRET=1 runs the "
                 "kernel through triton's interpreter, with the installed triton handed to the engine")
        raise LoadError(f"{who}: {module} imported without a usable triton (the engine gave its "
                        f"placeholder){where}; install triton where the engine can import it")
    return fn


def fla_inputs(args: VerifyArgs) -> tuple[torch.Tensor, ...]:
    """The fp32 inputs of a flash-linear-attention style recurrent kernel: q (L2-normalised, times the
    scale) and k (L2-normalised) ``[L, B, S, HK, K]`` with one entry per key head (the kernels group
    value heads themselves), v ``[L, B, S, HV, V]``, g ``[L, B, S, HV]``, beta = sigmoid(b) ``[L, B, S,
    HV]``; passed with ``scale=1.0`` and ``use_qk_l2norm_in_kernel=False``."""
    L, B, S, HV, V, K = args.dims
    q, k, v, _, beta = args.inputs(F32)
    group = HV // args.nk  # op_inputs repeats key heads over their value-head group
    return q[..., ::group, :].contiguous(), k[..., ::group, :].contiguous(), v, args.g.to(F32), beta


def output_problem(out: object, shape: tuple[int, ...], exact: bool = False) -> str:
    """What is wrong with a verify output that should be a bf16 tensor of ``shape`` ('' when nothing);
    ``exact`` False accepts any shape of as many elements (the op's ``[B, S, HV, V]`` or a flat view)."""
    if not isinstance(out, torch.Tensor):
        return f"returned {type(out).__name__}, not a bfloat16 tensor of shape {shape}"
    if out.dtype != BF16:
        return f"returned a {out.dtype} tensor, expected bfloat16 of shape {shape}"
    if (tuple(out.shape) != shape) if exact else (out.numel() != math.prod(shape)):
        return f"returned shape {tuple(out.shape)}, expected {shape}"
    return ""


class LayerOpAdapter:
    """A verify kernel (``adapter(args) -> bf16 [L, B, S, HV, V]``) calling ``op`` once per layer. The
    verify rules it implements are its registry entry's (drift/plug/loader.py: ``KernelEntry.rules``):
    a flow whose kind verifies by another refuses it (exit 2) rather than misread its arguments."""

    def __init__(self, op: Callable, name: str):
        self.op = op
        self.__name__ = self.__qualname__ = name

    # ------------------------------------------------------------------ hooks
    def prepare(self, args: VerifyArgs) -> Any:
        """Per-call work shared by the layers (inputs in the op's dtypes); passed to call_layer."""
        return None

    def call_layer(self, args: VerifyArgs, layer: int, ctx: Any) -> torch.Tensor:  # pragma: no cover
        """Call the op for ``layer``; return its output (``B * S * HV * V`` bf16 elements)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- helpers
    @staticmethod
    def start_states(args: VerifyArgs, layer: int) -> torch.Tensor:
        """Each row's start state of ``layer`` gathered into a new dense ``[B, HV, V, K]`` tensor where
        the flow kind's rule says (``args.plan()``: the committed state ``recurrent_state[cache_indices[b]]``
        or a scratch block), read without a host sync."""
        plan = args.plan()
        start, from_rec = plan.start, plan.from_committed
        rec = raw_state(args.recurrent_state)[layer]
        blocks = kernels.scratch_blocks(args.intermediate_state)[layer]
        slots = args.cache_indices.to(torch.int64)
        return torch.where(from_rec[:, None, None, None], rec.index_select(0, slots),
                           blocks.index_select(0, start)).contiguous()

    @staticmethod
    def write_back(args: VerifyArgs, layer: int, states: torch.Tensor) -> None:
        """Per-token states ``[B * S, HV, V, K]`` (row-major over rows and tokens) into drift's scratch
        blocks at ``ssm_state_indices``, in the scratch's dtype."""
        blocks = kernels.scratch_blocks(args.intermediate_state)[layer]
        blocks.index_copy_(0, args.ssm_state_indices.to(torch.int64).reshape(-1), states.to(blocks.dtype))

    @staticmethod
    def check_output(out: object, shape: tuple[int, ...], layer: int, exact: bool = False) -> None:
        """UpdateRaised naming the layer when the op's own output is not a bf16 tensor of ``shape``'s
        elements (``exact``: of ``shape``): for a :meth:`call_layer` that unpacks it, so that what the op
        returned is judged, never a cast or a reshape of it."""
        problem = output_problem(out, shape, exact)
        if problem:
            raise UpdateRaised(f"layer {layer}: the op {problem}")

    # ------------------------------------------------------------------ call
    def __call__(self, args: VerifyArgs) -> torch.Tensor:
        L, B, S, HV, V, K = args.dims
        out = torch.empty(L, B, S, HV, V, dtype=BF16, device=args.mix_qkv.device)
        ctx = self.prepare(args)
        for layer in range(L):
            try:
                o = self.call_layer(args, layer, ctx)
            except UpdateRaised:
                raise
            except Exception as exc:
                raise UpdateRaised(f"layer {layer}: the op raised {exc!r}") from exc
            self.check_output(o, (B, S, HV, V), layer)
            out[layer] = o.reshape(B, S, HV, V)
        return out


class EngineKernelAdapter(LayerOpAdapter):
    """An adapter for a kernel an engine ships: where it lives (``MODULE``, ``FUNCTION``), the
    ``--kernel`` name and the engine drift modelled; :meth:`load` is its availability probe."""

    MODULE = FUNCTION = KERNEL = ENGINE = ""

    @classmethod
    def load(cls) -> "EngineKernelAdapter":
        fn = engine_function(cls.MODULE, cls.FUNCTION, cls.KERNEL, cls.ENGINE)
        return cls(fn, f"{cls.KERNEL} ({cls.MODULE}.{cls.FUNCTION})")


class FlaKernelAdapter(EngineKernelAdapter):
    """An engine's FLA-style recurrent kernel: drift's inputs in the op's dtypes (:func:`fla_inputs`),
    sliced per layer, and its output ``[B, S, HV, V]`` cast to bf16. A subclass says which indices
    the op takes (:meth:`indices`, once per call) and how it is called for a layer (:meth:`call_op`)."""

    TRITON = True  # the engines' FLA-style kernels are Triton kernels (drift.plug.triton_interpreter.how_it_ran)

    def indices(self, args: VerifyArgs, device: torch.device) -> Any:
        raise NotImplementedError  # pragma: no cover

    def call_op(self, args: VerifyArgs, layer: int, qkvgb: tuple, indices: Any) -> torch.Tensor:
        raise NotImplementedError  # pragma: no cover

    def prepare(self, args: VerifyArgs):
        inputs = fla_inputs(args)
        return inputs, self.indices(args, inputs[0].device)

    def call_layer(self, args: VerifyArgs, layer: int, ctx) -> torch.Tensor:
        inputs, indices = ctx
        q, k, v, g, beta = (t[layer] for t in inputs)
        o = self.call_op(args, layer, (q, k, v.contiguous(), g.contiguous(), beta.contiguous()), indices)
        L, B, S, HV, V, K = args.dims
        return o.reshape(B, S, HV, V).to(BF16)
