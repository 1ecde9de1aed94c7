"""FlashInfer's ReplaySSM GDN MTP verify and commit (flashinfer #5314) in drift's ``sglang-replayssm``
flow: ``--kernel flashinfer-replayssm`` with ``--update drift.plug.flashinfer_replayssm:commit``
(the real kernels), or ``--kernel flashinfer-replayssm-op:<module|file.py>:<qualname>`` with an
update made by :func:`make_commit` (a stand-in or another build; docs/semantics.md §6).

Read from ``flashinfer-python==0.7.2.post1`` (``flashinfer/gdn_decode.py``,
``flashinfer/gdn_kernels/gdn_decode_mtp.py``, ``gdn_decode_mtp_replayssm_tcgen.py``,
``gdn_replayssm_spec_fold.py``, ``gdn_replayssm_spec_fold_tcgen.py``):

* ``gated_delta_rule_mtp(q, k, v, initial_state, initial_state_indices, A_log, a, dt_bias, b, scale,
  output, intermediate_states_buffer, ssm_state_indices, disable_state_update, use_qk_l2norm,
  output_state_indices, cache_replayssm, replayssm_rawv, replayssm_rawk, replayssm_g, replayssm_beta)
  -> (output, initial_state)``, once per layer: q, k bf16 ``[B, T, H, K]`` (raw: the kernel
  L2-normalises them, ``rsqrt(sum + 1e-6)``), v bf16 ``[B, T, HV, V]``, a and b ``[B, T, HV]`` (cast
  to bf16 by the kernel), A_log fp32 and dt_bias ``[HV]``; the kernel computes ``g = -exp(A_log) *
  softplus(a + dt_bias)`` (threshold 20) and ``beta = sigmoid(b)`` in fp32. ``initial_state`` is the
  fp32 checkpoint pool ``[pool, HV, V, K]`` (K-last), read at ``initial_state_indices [B]`` (negative:
  padding, output and windows untouched) and, with ``cache_replayssm=True``, never written
  (``disable_state_update=True`` is required). Instead the verify writes, by pool slot, the raw input
  window of its T tokens into four caller-owned buffers: ``replayssm_rawv`` bf16 ``[pool, HV, T, V]``
  (v as given), ``replayssm_rawk`` bf16 ``[pool, H, T, K]`` (k before normalisation),
  ``replayssm_g`` fp32 ``[pool, HV, T]`` (the log-decay) and ``replayssm_beta`` fp32 ``[pool, HV, T]``
  (sigmoid beta), "overwritten on every verify, and consumed once by
  gated_delta_rule_replayssm_commit before the next verify". It needs K = V = 128, T >= 3, every
  buffer contiguous and 16-byte aligned, and a GPU of compute capability 10.x (``gdn_device_target(
  q.device).major != 10`` raises "ReplaySSM caching currently requires SM100/SM103"). On SM100 with
  T = 4..8, B = 1..256, int32 indices, even HV and HV / H, it runs the tcgen05 kernel, whose state-key
  and state-query dots are TF32 tensor-core contractions (outputs only: the verify stores no state).
* ``gated_delta_rule_replayssm_commit(checkpoint_state, rawv_cache, rawk_cache, g_cache, beta_cache,
  state_indices, accept_lens, *, track_state_indices, track_steps, use_qk_l2norm, null_block_id,
  backend)``, once per step for every layer: the checkpoint fp32 ``[layers, slots, HV, 128, 128]`` and
  the windows ``[layers, slots, ...]`` (the per-layer buffers above stacked), all contiguous; int32
  ``[B]`` slots (``<= null_block_id``: ignored) and accept lengths in ``[0, T]`` (0: a no-op). For each
  live row it replays the first ``accept_lens[b]`` tokens of the window from the checkpoint, in
  place: ``S <- e^g S``, ``delta = beta (v - S k)``, ``S <- S + delta k^T`` with k re-normalised,
  stored fp32; a tracked row also writes the state after token ``track_steps[b]`` (zero-based; a step
  outside the accepted prefix writes nothing) to ``track_state_indices[b]`` (live track slots
  distinct and disjoint from the live checkpoint slots). ``backend="auto"`` takes the fp32 SIMT
  kernel with tracking and for T < 6; without tracking it takes the TF32 tcgen05 kernel for T = 8,
  or T = 6, 7 with B > 1 and ``layers * B * HV >= 256`` (the checkpoint-key dots in TF32, the rest in
  fp32). No host read of indices or lengths.

The adapter (:class:`FlashInferVerify`, :class:`FlashInferCommit`) calls exactly that over drift's
pool: the checkpoint is ``temporal`` (``--profile fp32``: contiguous fp32), the windows are buffers
of its own, one set per checkpoint tensor, allocated at the first call and shared by the verify and
the commit (:class:`Windows`); padded rows pass slot -1. q, k, v are split from ``mix_qkv`` as the
model passes them, a and b in bf16 (drift's stream keeps them on the bf16 grid: exact). The commit
passes ``accept_lens = last + 1`` (the bonus token included), the track slot only where a step is
tracked (-1 elsewhere: FlashInfer's distinct-live-slot contract), ``backend="auto"``, then drift's
conv rollback. drift's ring and its cursors are never written, so the ring rule's start state is
the checkpoint, which is what FlashInfer's verify reads. No host sync: shapes are host metadata,
every index stays on the device.
"""

from __future__ import annotations

import importlib
import inspect
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..errors import LoadError, UpdateRaised
from ..flows.kernel_commit.updates import Commit, conv_rollback
from ..sim.kernels import VerifyArgs
from ..sim.pool import raw_state
from .adapter import LayerOpAdapter
from .specs import resolve_spec

BF16, F32, I32 = torch.bfloat16, torch.float32, torch.int32
MODULE = "flashinfer.gdn_decode"
VERIFY_FN, COMMIT_FN = "gated_delta_rule_mtp", "gated_delta_rule_replayssm_commit"
# Imported by those two functions when they run (they import the CuTe DSL: nvidia-cutlass-dsl).
KERNEL_MODULES = ("flashinfer.gdn_kernels.gdn_decode_mtp", "flashinfer.gdn_kernels.gdn_replayssm_spec_fold")
KERNEL, STAND_IN = "flashinfer-replayssm", "flashinfer-replayssm-op"
MODELLED = "flashinfer-python 0.7.2.post1"
COMMIT_SPEC = "drift.plug.flashinfer_replayssm:commit"
CAPABILITY_MAJOR = 10  # gdn_decode.py: gdn_device_target(q.device).major != 10 -> "requires SM100/SM103"
HEAD_DIM, MIN_TOKENS, ALIGN = 128, 3, 16  # "ReplaySSM requires K=V=128", "requires T >= 3", 16-byte bases
NULL = -1  # null_block_id: drift's padded rows carry slot -1 (SGLang's convention)
VERIFY_KEYWORDS = ("q", "k", "v", "initial_state", "initial_state_indices", "A_log", "a", "dt_bias", "b", "scale",
                   "output", "intermediate_states_buffer", "ssm_state_indices", "disable_state_update", "use_qk_l2norm",
                   "output_state_indices", "cache_replayssm", "replayssm_rawv", "replayssm_rawk", "replayssm_g",
                   "replayssm_beta")
COMMIT_KEYWORDS = ("checkpoint_state", "rawv_cache", "rawk_cache", "g_cache", "beta_cache", "state_indices",
                   "accept_lens", "track_state_indices", "track_steps", "use_qk_l2norm", "null_block_id", "backend")


@dataclass(frozen=True)
class FlashInferApi:
    """The two functions under test and where they came from (``source``, for messages)."""

    verify: Callable
    commit: Callable
    source: str


# ------------------------------------------------------------------------------ loading
def gpu_problem() -> str:
    """What keeps this machine's GPU from running the ReplaySSM kernels ('' when nothing): FlashInfer
    checks the compute capability's major version of the tensors' device (``gdn_device_target``,
    which reads ``torch.cuda.get_device_capability``); drift reads the current device's."""
    if not torch.cuda.is_available():
        return "a CUDA GPU (torch.cuda.is_available() is False)"
    dev = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(dev)
    if major != CAPABILITY_MAJOR:
        return (f"a GPU of compute capability {CAPABILITY_MAJOR}.x (SM100/SM103: gdn_decode.py raises 'ReplaySSM "
                f"caching currently requires SM100/SM103'); cuda:{dev} is {torch.cuda.get_device_name(dev)}, "
                f"compute capability {major}.{minor} (SM{major}{minor})")
    return ""


def package_problem() -> str:
    """What keeps flashinfer's ReplaySSM functions from importing here ('' when nothing)."""
    try:
        mod = importlib.import_module(MODULE)
    except Exception as exc:
        return f"flashinfer importable (pip install flashinfer-python; {MODELLED} was modelled): importing {MODULE} raised {exc!r}"
    missing = [f for f in (VERIFY_FN, COMMIT_FN) if not callable(getattr(mod, f, None))]
    if missing:
        version = getattr(importlib.import_module("flashinfer"), "__version__", "?")
        return f"a flashinfer with {' and '.join(missing)} (this is flashinfer {version}; {MODELLED} has them)"
    for name in KERNEL_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:
            return (f"flashinfer's CuTe DSL kernels importable (nvidia-cutlass-dsl, cuda-python): importing {name} "
                    f"raised {exc!r}")
    return ""


def load_api(who: str = f"--kernel {KERNEL}") -> FlashInferApi:
    """FlashInfer's own functions: the availability probe. LoadError naming every missing thing."""
    problems = [p for p in (package_problem(), gpu_problem()) if p]
    if problems:
        raise LoadError(f"{who} needs " + "; and ".join(problems) + f". Elsewhere run its contract's stand-in: "
                        f"--kernel {STAND_IN}:<module|file.py>:<qualname> (docs/reference.md)")
    mod = importlib.import_module(MODULE)
    return FlashInferApi(getattr(mod, VERIFY_FN), getattr(mod, COMMIT_FN), MODULE)


def _check_signature(fn: Callable, keywords: tuple[str, ...], what: str) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin: taken on trust
    try:
        sig.bind(**{k: None for k in keywords})
    except TypeError as exc:
        raise LoadError(f"{what} has signature {getattr(fn, '__name__', fn)}{sig}, which cannot take the adapter's "
                        f"call ({exc}); expected keywords {', '.join(keywords)}") from None


def api_from_spec(arg: str) -> FlashInferApi:
    """A stand-in or another build: ``<module|file.py>:<qualname>`` naming an object (a module, a
    namespace) with both functions, whose signatures must take the adapter's keyword calls."""
    obj = resolve_spec(arg, "kernel")
    spec = f"{STAND_IN}:{arg}"
    fns = [getattr(obj, f, None) for f in (VERIFY_FN, COMMIT_FN)]
    if not all(callable(f) for f in fns):
        raise LoadError(f"kernel spec {spec!r} names {type(obj).__name__} {getattr(obj, '__name__', '')}, which lacks "
                        f"{' or '.join(f for f, fn in zip((VERIFY_FN, COMMIT_FN), fns) if not callable(fn))}; name an "
                        f"object holding both ({MODULE} has them)")
    _check_signature(fns[0], VERIFY_KEYWORDS, f"{spec}'s {VERIFY_FN}")
    _check_signature(fns[1], COMMIT_KEYWORDS, f"{spec}'s {COMMIT_FN}")
    return FlashInferApi(fns[0], fns[1], arg)


# ------------------------------------------------------------------------------ the windows
class Windows:
    """FlashInfer's caller-owned ReplaySSM windows of one checkpoint ``[L, slots, HV, V, K]``: rawv
    bf16 ``[L, slots, HV, T, V]``, rawk bf16 ``[L, slots, H, T, K]``, g and beta fp32 ``[L, slots, HV,
    T]`` (zeros until a verify writes them; layer l's verify gets the contiguous views ``[l]``), and
    how many verify and commit calls used them (host counters of the eager calls)."""

    def __init__(self, checkpoint: torch.Tensor, H: int, T: int):
        L, slots, HV, V, K = checkpoint.shape
        new = checkpoint.new_zeros  # on the checkpoint's device (drift's virtual one too)
        self.rawv = new((L, slots, HV, T, V), dtype=BF16)
        self.rawk = new((L, slots, H, T, K), dtype=BF16)
        self.g = new((L, slots, HV, T), dtype=F32)
        self.beta = new((L, slots, HV, T), dtype=F32)
        self.verifies = self.commits = 0


# id(checkpoint) -> (a weak reference to it, its windows); an entry goes with its tensor. (A
# WeakKeyDictionary would compare tensors with ==, which is elementwise.)
_WINDOWS: dict[int, tuple[weakref.ref, Windows]] = {}


def windows(checkpoint: torch.Tensor, H: int, T: int) -> Windows:
    """The windows of ``checkpoint`` (the pool's ``temporal``, the same tensor the verify and the
    commit see), made at the first call."""
    key = id(checkpoint)
    held = _WINDOWS.get(key)
    if held is not None and held[0]() is checkpoint:
        return held[1]
    win = Windows(raw_state(checkpoint), H, T)
    _WINDOWS[key] = (weakref.ref(checkpoint, lambda _ref, key=key: _WINDOWS.pop(key, None)), win)
    return win


def shape_problem(checkpoint: torch.Tensor, HV: int, T: int) -> str:
    """What keeps FlashInfer 0.7.2.post1's ReplaySSM from taking this run's shapes ('' when nothing):
    an fp32 K-last contiguous checkpoint, K = V = 128, T >= 3, and 16-byte aligned per-layer g and
    beta windows (``[slots, HV, T]`` fp32: slots * HV * T a multiple of 4)."""
    V, K = checkpoint.shape[-2:]
    slots = checkpoint.shape[1]
    if checkpoint.dtype != F32:
        return (f"an fp32 checkpoint (gdn_decode.py: 'initial_state must be float32'; this run's is "
                f"{checkpoint.dtype}): pass --profile fp32")
    if not checkpoint.is_contiguous():
        return "a contiguous K-last checkpoint [L, slots, HV, V, K] (this profile's layout is transposed): pass --profile fp32"
    if (K, V) != (HEAD_DIM, HEAD_DIM):
        return (f"K = V = {HEAD_DIM} ('ReplaySSM requires K=V=128'; this run: K = {K}, V = {V}): run a preset "
                "with K = V = 128 (qwen3.5-397b-*, qwen3-next-80b-*)")
    if T < MIN_TOKENS:
        return f"at least {MIN_TOKENS} tokens per verify ('ReplaySSM caching requires T >= 3'; this run: {T}): pass --draft-tokens 3 or more"
    if (slots * HV * T * F32.itemsize) % ALIGN:
        return (f"16-byte aligned per-layer windows ('must have a 16-byte aligned base address'): each layer's g and "
                f"beta window is [slots, HV, T] fp32, and {slots} * {HV} * {T} is not a multiple of 4")
    return ""


def _own(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype`` as a fresh contiguous tensor (a new allocation: a 16-byte aligned base)."""
    return t.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)


# ------------------------------------------------------------------------------ the verify
class FlashInferVerify(LayerOpAdapter):
    """``gated_delta_rule_mtp(..., cache_replayssm=True)`` per layer over drift's pool (the module
    docstring); a drift verify kernel of the ring rule."""

    RULES = ("ring",)

    def __init__(self, api: FlashInferApi, name: str, real: bool = False):
        super().__init__(api.verify, name)
        self.api, self.real = api, real

    @classmethod
    def load(cls) -> "FlashInferVerify":
        return cls(load_api(), f"{KERNEL} ({MODULE}.{VERIFY_FN}, cache_replayssm=True)", real=True)

    def prepare(self, args: VerifyArgs):
        """The per-call operands, after the refusals (LoadError, exit 2: drift could not run it)."""
        if getattr(args.rule, "name", None) != "ring":
            raise LoadError(f"{self.__name__} verifies by the ring rule: run it under --flow sglang-replayssm")
        if args.gate_inputs is None:
            raise LoadError(f"{self.__name__} computes the gating itself and needs VerifyArgs.gate_inputs (a, A_log, dt_bias)")
        L, B, S, HV, V, K = args.dims
        problem = shape_problem(args.recurrent_state, HV, S)
        if problem:
            raise LoadError(f"{self.__name__} needs {problem}")
        dev = args.mix_qkv.device
        if self.real and dev.type != "cuda":
            raise LoadError(f"{self.__name__} runs on CUDA tensors: pass --device cuda (this run's device is {dev})")
        win = windows(args.recurrent_state, args.nk, S)
        if win.verifies and not win.commits:
            raise LoadError(f"{self.__name__} wrote its windows and no update called FlashInfer's commit before the next "
                            f"verify: its windows are consumed by {COMMIT_FN}, so the update under test must call it "
                            f"(--update {COMMIT_SPEC}, or an update from make_commit); the flow's built-in update "
                            "folds drift's own ring, which this verify does not write")
        win.verifies += 1
        args.rule.records_elsewhere = True  # its records are its windows; drift's ring stays empty
        H = args.nk
        mix = args.mix_qkv.reshape(L, B, S, -1)
        a, A_log, dt_bias = args.gate_inputs
        return dict(
            q=mix[..., : H * K].reshape(L, B, S, H, K), k=mix[..., H * K: 2 * H * K].reshape(L, B, S, H, K),
            v=mix[..., 2 * H * K:].reshape(L, B, S, HV, V), a=a.reshape(L, B, S, HV), b=args.beta.reshape(L, B, S, HV),
            A_log=A_log, dt_bias=dt_bias, state=raw_state(args.recurrent_state),
            idx=_own(args.cache_indices, I32), win=win, out=torch.zeros(L, B, S, HV, V, dtype=BF16, device=dev))

    def call_layer(self, args: VerifyArgs, layer: int, ctx) -> torch.Tensor:
        L, B, S, HV, V, K = args.dims
        w, lay = ctx["win"], layer  # layer's contiguous per-layer views
        res = self.op(q=_own(ctx["q"][lay], BF16), k=_own(ctx["k"][lay], BF16), v=_own(ctx["v"][lay], BF16),
                      initial_state=ctx["state"][lay], initial_state_indices=ctx["idx"], A_log=_own(ctx["A_log"][lay], F32),
                      a=_own(ctx["a"][lay], BF16), dt_bias=_own(ctx["dt_bias"][lay], F32), b=_own(ctx["b"][lay], BF16),
                      scale=K ** -0.5, output=ctx["out"][lay], intermediate_states_buffer=None, ssm_state_indices=None,
                      disable_state_update=True, use_qk_l2norm=True, output_state_indices=None, cache_replayssm=True,
                      replayssm_rawv=w.rawv[lay], replayssm_rawk=w.rawk[lay], replayssm_g=w.g[lay],
                      replayssm_beta=w.beta[lay])
        if not (isinstance(res, tuple) and len(res) == 2):
            raise UpdateRaised(f"layer {layer}: the op returned {type(res).__name__}, not (output, initial_state)")
        self.check_output(res[0], (B, S, HV, V), layer, exact=True)  # the op's own [B, T, HV, V] bf16
        return res[0]


def stand_in_kernel(arg: Optional[str]) -> FlashInferVerify:
    """``--kernel flashinfer-replayssm-op:<module|file.py>:<qualname>``."""
    api = api_from_spec(arg or "")
    return FlashInferVerify(api, f"{STAND_IN}:{arg} ({VERIFY_FN}, cache_replayssm=True)")


# ------------------------------------------------------------------------------ the commit
class FlashInferCommit:
    """An update under test of the ``sglang-replayssm`` flow: ``gated_delta_rule_replayssm_commit`` on
    the windows the verify wrote (:class:`Windows`), then drift's conv rollback. ``api``: the
    functions to call (None: FlashInfer's own, probed at the first call; they take CUDA tensors only,
    so drift's host-sync scan runs this update on the accelerator alone: ``DEVICE_ONLY``)."""

    def __init__(self, api: Optional[FlashInferApi] = None):
        self._api, self.real = api, api is None
        self.DEVICE_ONLY = self.real
        self.__name__ = self.__qualname__ = "flashinfer_replayssm_commit" if self.real else f"commit({api.source})"

    def api(self) -> FlashInferApi:
        if self._api is None:
            self._api = load_api(f"--update {COMMIT_SPEC}")
        return self._api

    def __call__(self, harness, last_correct_step_indices, mamba_track_indices=None, mamba_steps_to_track=None):
        ss = harness.spec_state  # first: under another flow the harness names what it lacks
        ckpt = ss.temporal
        H, HV, T = ss.replayssm_k.shape[2], ckpt.shape[2], harness.draft_token_num
        problem = shape_problem(ckpt, HV, T)
        if problem:
            raise LoadError(f"the update {self.__name__} (FlashInfer's ReplaySSM commit) needs {problem}")
        api = self.api()
        if self.real and ckpt.device.type != "cuda":
            raise LoadError(f"the update {COMMIT_SPEC} runs FlashInfer's commit on CUDA tensors: pass --device cuda "
                            f"(this checkpoint is on {ckpt.device})")
        win = windows(ckpt, H, T)
        last = last_correct_step_indices.to(torch.int64)
        accept = torch.clamp(last + 1, min=0)  # accept_lens: the accepted drafts and the bonus token
        track = steps = None
        tracked = {}
        if mamba_track_indices is not None:
            track, steps = mamba_track_indices.to(torch.int64), mamba_steps_to_track.to(torch.int64)
            live = torch.where(steps >= 0, track, torch.full_like(track, NULL))  # distinct live track slots
            tracked = dict(track_state_indices=_own(live, I32), track_steps=_own(steps, I32))
        api.commit(raw_state(ckpt), win.rawv, win.rawk, win.g, win.beta, _own(harness.state_batch_indices, I32),
                   _own(accept, I32), use_qk_l2norm=True, null_block_id=NULL, backend="auto", **tracked)
        win.commits += 1
        conv_rollback(Commit(harness, accept, last, track, steps))


def make_commit(api: Any) -> FlashInferCommit:
    """The commit update over ``api`` (an object with both functions, e.g. a stand-in module or
    namespace), for ``--update <file.py>:<name>`` where the file holds ``<name> = make_commit(...)``."""
    if not isinstance(api, FlashInferApi):
        fns = [getattr(api, f, None) for f in (VERIFY_FN, COMMIT_FN)]
        if not all(callable(f) for f in fns):
            raise LoadError(f"make_commit({api!r}): needs an object with {VERIFY_FN} and {COMMIT_FN}")
        _check_signature(fns[1], COMMIT_KEYWORDS, f"{getattr(api, '__name__', api)}'s {COMMIT_FN}")
        api = FlashInferApi(fns[0], fns[1], getattr(api, "__name__", type(api).__name__))
    return FlashInferCommit(api)


commit = FlashInferCommit()
