"""Record an SGLang engine's GDN target-verify inputs, keep the accepted tokens, save a drift trace.

Written against SGLang 0.5.23's Ascend GDN backend
(``sglang/srt/hardware_backend/npu/attention/ascend_gdn_backend.py``, ``AscendGDNAttnBackend``):

* ``forward_extend(self, layer, forward_batch, mixed_qkv, a, b, **kwargs)``: in target verify
  (``forward_batch.forward_mode.is_target_verify()``) ``mixed_qkv`` is the pre-conv
  ``[B*D, C]`` input of the D verify tokens of each of B rows (``D =
  forward_batch.spec_info.draft_token_num``), ``a`` and ``b`` are ``[B*D, HV]``; ``layer``
  (a ``RadixLinearAttention``) carries ``layer_id``, ``A_log``, ``dt_bias``,
  ``conv_weights`` ([C, Kc], or [C, 1, Kc]), ``bias`` (None: no conv bias), ``num_k_heads``,
  ``num_v_heads``, ``head_k_dim``, ``head_v_dim``. Under graph capture the backend sets
  ``self.graph_mode = True``; a replayed graph never calls Python again.
* the hybrid backend's ``update_mamba_state_after_mtp_verify(self, last_correct_step_indices,
  mamba_track_indices, mamba_steps_to_track, model, req_pool_indices=None)`` is called after
  verify with the last accepted window position of each row (-1 for a padded row). Callers
  pass it by keyword (``last_correct_step_indices=`` or, in spec v2, ``accepted_steps=``) or
  positionally; both are understood.

:class:`SGLangTraceRecorder` wraps both methods (on the instances or classes it is given;
``uninstall()`` or leaving the ``with`` block restores them). Each verify forward buffers
every GDN layer's window ``[B, D, ...]`` (a CPU copy, taken before the backend runs); the
update then appends window positions ``0..last_correct_step`` of each row to that request's
token list -- exactly the tokens the target model's state advanced over, in order. A request
is keyed by ``req_pool_indices`` when the update is given them, else by the verify batch's
``forward_batch.req_pool_indices``, else by row position. With ``record_prefill=True`` the
prompt (non-verify extend forwards, split by ``forward_batch.extend_seq_lens_cpu``) is
recorded first, so the trace starts from the empty conv window like the engine; and a fresh
prefill (``extend_prefix_lens == 0``) of a reused pool index always starts a new request, so
two requests are never spliced. :meth:`SGLangTraceRecorder.save` writes the R longest
requests truncated to a common length T.

Install in an engine's nightly (eager verify: launch with ``--disable-cuda-graph``, since a
replayed graph skips ``forward_extend``; the recorder refuses to commit windows it never saw)::

    # in the process that runs the model (the scheduler / TP rank), before serving:
    from drift.capture.sglang_hook import SGLangTraceRecorder
    from sglang.srt.hardware_backend.npu.attention.ascend_gdn_backend import AscendGDNAttnBackend
    from sglang.srt.hardware_backend.npu.attention.ascend_hybrid_linear_attn_backend import (
        AscendHybridLinearAttnBackend)
    rec = SGLangTraceRecorder(AscendGDNAttnBackend, AscendHybridLinearAttnBackend, record_prefill=True)
    rec.install()
    ...  # serve the nightly's prompts
    rec.save("traces/qwen3-next-nightly.npz", model_name="Qwen3-Next-80B-A3B", sequences=8)

SGLang starts its scheduler in a separate (spawned) process, so when the nightly drives
``sglang.Engine`` / ``launch_server`` the recorder must be installed there: set
``DRIFT_SGLANG_TRACE=/path/trace-{pid}.npz`` (and optionally ``DRIFT_SGLANG_TRACE_MODEL``,
``DRIFT_SGLANG_TRACE_EVERY`` = commits between autosaves, default 64,
``DRIFT_SGLANG_TRACE_SEQUENCES``) and put a ``sitecustomize.py`` holding
``import drift.capture.sglang_hook as h; h.install_from_env()`` on the engine's
``PYTHONPATH``. Every process imports it; the ones that commit verify steps (each TP rank,
recording its own head shard -- a consistent smaller GDN layer) save atomically every N
commits (a scheduler killed by its parent loses at most the last N) and at exit.

Cost: a device-to-host copy of every GDN layer's verify window per step (a sync per layer)
and ``(C + 2*HV) * itemsize`` bytes per token per layer of host memory (16.5 KB for
Qwen3-Next-80B in bf16 on one rank, ~0.6 MB per token over its 36 GDN layers);
``max_tokens_per_request`` caps it.
"""

from __future__ import annotations

import atexit
import logging
import os
from pathlib import Path
from typing import Any, Mapping

import torch

from ..sim.tracefile import write_trace

log = logging.getLogger(__name__)

FORWARD = "forward_extend"
UPDATE = "update_mamba_state_after_mtp_verify"
STEP_KWARGS = ("last_correct_step_indices", "accepted_steps", "accepted_indices")
RUN_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


def _ints(t: Any) -> list[int]:
    if isinstance(t, torch.Tensor):
        return [int(v) for v in t.detach().to("cpu").reshape(-1).tolist()]
    return [int(v) for v in t]


def _arg(args: tuple, kwargs: dict, pos: int, *names: str) -> Any:
    for n in names:
        if n in kwargs:
            return kwargs[n]
    return args[pos] if len(args) > pos else None


def _is_draft_extend(mode: Any) -> bool:
    """DRAFT_EXTEND (and V2) run the draft model: neither prompt nor verify of the target."""
    if getattr(mode, "is_draft_extend_v2", None) is not None and mode.is_draft_extend_v2():
        return True
    fn = getattr(mode, "is_draft_extend", None)
    return bool(fn()) if fn is not None else False


class _Request:
    """One request's committed tokens: chunks of x [n, L, C], a/b [n, L, HV]."""

    def __init__(self, key: Any, order: int):
        self.key, self.order, self.n, self.prefill = key, order, 0, 0
        self.chunks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def add(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, cap: int | None) -> None:
        if cap is not None:
            room = cap - self.n
            if room <= 0:
                return
            x, a, b = x[:room], a[:room], b[:room]
        self.chunks.append((x, a, b))
        self.n += x.shape[0]


class SGLangTraceRecorder:
    """Wraps a GDN backend's ``forward_extend`` and a hybrid backend's
    ``update_mamba_state_after_mtp_verify``; see the module docstring.

    ``gdn_backend``/``hybrid_backend``: instances or classes (patched in place). Both may be
    the same object. ``draft_token_num``: D when ``forward_batch.spec_info`` lacks it.
    """

    def __init__(self, gdn_backend: Any, hybrid_backend: Any, *, draft_token_num: int | None = None,
                 record_prefill: bool = False, max_tokens_per_request: int | None = None):
        for obj, name in ((gdn_backend, FORWARD), (hybrid_backend, UPDATE)):
            if not callable(getattr(obj, name, None)):
                raise TypeError(f"{obj!r} has no method {name}; pass the GDN backend and the hybrid backend")
        self.gdn_backend, self.hybrid_backend = gdn_backend, hybrid_backend
        self.draft_token_num = draft_token_num
        self.record_prefill = record_prefill
        self.max_tokens_per_request = max_tokens_per_request
        self._saved: list[tuple[Any, str, bool, Any]] = []
        self._windows: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._window_keys: list[int] | None = None
        self._graph_windows_skipped = 0
        self._params: dict[int, dict[str, Any]] = {}
        self._layer_ids: list[int] | None = None
        self._live: dict[Any, _Request] = {}
        self._done: list[_Request] = []
        self._order = 0
        self._last_prefill_batch: Any = None
        self._prefill_rows: dict[int, list[Any]] = {}  # layer -> chunks of this prefill forward
        self.commits = 0
        self.dtype: str | None = None
        self.on_commit = None  # optional callback(recorder) after every commit (autosave)

    # ------------------------------------------------------------------ install
    def _patch(self, obj: Any, name: str, make) -> None:
        is_cls = isinstance(obj, type)
        had_own = name in vars(obj)
        old_own = vars(obj).get(name)
        orig = getattr(obj, name)  # a function (class) or a bound method (instance)
        setattr(obj, name, make(orig, None if is_cls else obj))
        self._saved.append((obj, name, had_own, old_own))

    def install(self) -> "SGLangTraceRecorder":
        if self._saved:
            return self
        rec = self

        def make_forward(orig, instance):
            if instance is None:
                def forward_extend(backend, *args, **kwargs):
                    rec._on_forward(backend, args, kwargs)
                    return orig(backend, *args, **kwargs)
            else:
                def forward_extend(*args, **kwargs):
                    rec._on_forward(instance, args, kwargs)
                    return orig(*args, **kwargs)
            return forward_extend

        def make_update(orig, instance):
            if instance is None:
                def update(backend, *args, **kwargs):
                    out = orig(backend, *args, **kwargs)
                    rec._on_update(args, kwargs)
                    return out
            else:
                def update(*args, **kwargs):
                    out = orig(*args, **kwargs)
                    rec._on_update(args, kwargs)
                    return out
            return update

        self._patch(self.gdn_backend, FORWARD, make_forward)
        self._patch(self.hybrid_backend, UPDATE, make_update)
        return self

    def uninstall(self) -> None:
        for obj, name, had_own, old_own in reversed(self._saved):
            if had_own:
                setattr(obj, name, old_own)
            else:
                delattr(obj, name)
        self._saved = []

    def __enter__(self) -> "SGLangTraceRecorder":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    # ------------------------------------------------------------------ recording
    def _layer_params(self, layer: Any, C: int, HV: int) -> None:
        lid = int(layer.layer_id)
        if lid in self._params:
            return
        w = layer.conv_weights.detach().to("cpu", torch.float32)
        w = w.reshape(w.shape[0], w.shape[-1])
        if w.shape[0] != C:
            raise RuntimeError(f"layer {lid}: conv_weights has {w.shape[0]} channels, mixed_qkv {C}")
        bias = layer.bias
        bias = torch.zeros(C) if bias is None else bias.detach().to("cpu", torch.float32).reshape(C)
        dims = {k: int(getattr(layer, k)) for k in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")}
        if dims["num_v_heads"] != HV:
            raise RuntimeError(f"layer {lid}: num_v_heads {dims['num_v_heads']} but a has {HV} heads")
        self._params[lid] = {"A_log": layer.A_log.detach().to("cpu", torch.float32).reshape(HV),
                             "dt_bias": layer.dt_bias.detach().to("cpu", torch.float32).reshape(HV),
                             "conv_weight": w, "conv_bias": bias, **dims}

    def _set_dtype(self, t: torch.Tensor) -> None:
        if t.dtype not in RUN_DTYPES:
            raise RuntimeError(f"mixed_qkv is {t.dtype}; a drift trace holds bfloat16 or float32 inputs")
        d = RUN_DTYPES[t.dtype]
        if self.dtype not in (None, d):
            raise RuntimeError(f"mixed_qkv switched from {self.dtype} to {d}")
        self.dtype = d

    def _on_forward(self, backend: Any, args: tuple, kwargs: dict) -> None:
        layer = _arg(args, kwargs, 0, "layer")
        fb = _arg(args, kwargs, 1, "forward_batch")
        mixed_qkv, a, b = (_arg(args, kwargs, i, n) for i, n in ((2, "mixed_qkv"), (3, "a"), (4, "b")))
        mode = fb.forward_mode
        if mode.is_target_verify():
            if getattr(backend, "graph_mode", False):
                self._graph_windows_skipped += 1  # graph capture: dummy inputs, and replays skip Python
                return
            spec = getattr(fb, "spec_info", None)
            D = int(getattr(spec, "draft_token_num", None) or self.draft_token_num or 0)
            if D < 1:
                raise RuntimeError("target verify without forward_batch.spec_info.draft_token_num; "
                                   "pass SGLangTraceRecorder(..., draft_token_num=D)")
            N, C = mixed_qkv.shape
            if N % D:
                raise RuntimeError(f"verify mixed_qkv has {N} tokens, not a multiple of D={D}")
            B, HV = N // D, a.shape[-1]
            self._set_dtype(mixed_qkv)
            self._layer_params(layer, C, HV)
            self._windows[int(layer.layer_id)] = (
                mixed_qkv.detach().reshape(B, D, C).to("cpu").clone(),
                a.detach().reshape(B, D, HV).to("cpu").clone(),
                b.detach().reshape(B, D, HV).to("cpu").clone())
            rpi = getattr(fb, "req_pool_indices", None)
            self._window_keys = _ints(rpi) if rpi is not None else None
        elif mode.is_extend() and not _is_draft_extend(mode):
            self._on_prefill(layer, fb, mixed_qkv, a, b)

    def _on_prefill(self, layer: Any, fb: Any, mixed_qkv, a, b) -> None:
        rpi = getattr(fb, "req_pool_indices", None)
        if rpi is None:
            return
        keys = _ints(rpi)
        prefix = getattr(fb, "extend_prefix_lens_cpu", None)
        if prefix is None and getattr(fb, "extend_prefix_lens", None) is not None:
            prefix = _ints(fb.extend_prefix_lens)
        if fb is not self._last_prefill_batch:  # first GDN layer of this forward
            self._flush_prefill()
            self._last_prefill_batch = fb
            for key, p in zip(keys, prefix if prefix is not None else [None] * len(keys)):
                if p == 0 and key in self._live:  # pool index reused by a new request
                    self._done.append(self._live.pop(key))
        if not self.record_prefill:
            return
        lens = getattr(fb, "extend_seq_lens_cpu", None)
        if lens is None:
            raise RuntimeError("record_prefill needs forward_batch.extend_seq_lens_cpu")
        lens = [int(n) for n in lens]
        self._set_dtype(mixed_qkv)
        N, C = mixed_qkv.shape[0], mixed_qkv.shape[-1]
        if sum(lens) > N:
            raise RuntimeError(f"extend_seq_lens_cpu sums to {sum(lens)} but mixed_qkv has {N} tokens")
        self._layer_params(layer, C, a.shape[-1])
        x, ac, bc = (t.detach()[:sum(lens)].to("cpu").clone() for t in (mixed_qkv, a, b))
        self._prefill_rows[int(layer.layer_id)] = [(k, n, x, ac, bc) for k, n in zip(keys, lens)]

    def _flush_prefill(self) -> None:
        """Commit the buffered prefill forward (all its GDN layers) to its requests."""
        if not self._prefill_rows:
            return
        lids = sorted(self._prefill_rows)
        self._check_layers(lids)
        first = self._prefill_rows[lids[0]]
        start = 0
        for row, (key, n, *_) in enumerate(first):
            per = [self._prefill_rows[lid][row] for lid in lids]
            x = torch.stack([p[2][start:start + n] for p in per], dim=1)
            a = torch.stack([p[3][start:start + n] for p in per], dim=1)
            b = torch.stack([p[4][start:start + n] for p in per], dim=1)
            req = self._request(key)
            req.add(x, a, b, self.max_tokens_per_request)
            req.prefill += n
            start += n
        self._prefill_rows = {}

    def _check_layers(self, lids: list[int]) -> None:
        if self._layer_ids is None:
            self._layer_ids = lids
        elif lids != self._layer_ids:
            raise RuntimeError(f"this step recorded GDN layers {lids}, earlier steps {self._layer_ids}")

    def _request(self, key: Any) -> _Request:
        if key not in self._live:
            self._live[key] = _Request(key, self._order)
            self._order += 1
        return self._live[key]

    def _on_update(self, args: tuple, kwargs: dict) -> None:
        steps = _arg(args, kwargs, 0, *STEP_KWARGS)
        rpi = _arg(args, kwargs, 4, "req_pool_indices")
        self._flush_prefill()
        self._last_prefill_batch = None
        steps = _ints(steps)
        if not self._windows:
            if any(s >= 0 for s in steps):
                why = (f"{self._graph_windows_skipped} verify forward(s) ran under graph capture"
                       if self._graph_windows_skipped else "no verify forward_extend was seen")
                raise RuntimeError(f"verify update with accepted steps but no recorded verify window ({why}); run "
                                   "the engine with --disable-cuda-graph so every verify calls forward_extend")
            return
        lids = sorted(self._windows)
        self._check_layers(lids)
        B, D = self._windows[lids[0]][0].shape[:2]
        if len(steps) > B:
            raise RuntimeError(f"update has {len(steps)} rows, the verify windows {B}")
        if rpi is not None:
            keys = _ints(rpi)
        elif self._window_keys is not None:
            keys = self._window_keys
        else:
            keys = list(range(len(steps)))
        for row, s in enumerate(steps):
            if s < 0:
                continue
            if s >= D:
                raise RuntimeError(f"row {row}: last correct step {s} outside the window of D={D}")
            n = s + 1
            x = torch.stack([self._windows[lid][0][row, :n] for lid in lids], dim=1)
            a = torch.stack([self._windows[lid][1][row, :n] for lid in lids], dim=1)
            b = torch.stack([self._windows[lid][2][row, :n] for lid in lids], dim=1)
            self._request(keys[row]).add(x, a, b, self.max_tokens_per_request)
        self._windows = {}
        self._window_keys = None
        self.commits += 1
        if self.on_commit is not None:
            self.on_commit(self)

    # ------------------------------------------------------------------ results
    def requests(self) -> list[tuple[Any, int]]:
        """``(key, tokens)`` of every request seen, finished ones first, in order of appearance."""
        return [(r.key, r.n) for r in sorted(self._done + list(self._live.values()), key=lambda r: r.order)]

    def tokens(self, key: Any) -> dict[str, torch.Tensor]:
        """The live request ``key``'s tokens: x [n, L, C], a/b [n, L, HV] (run dtype)."""
        return self._stack(self._live[key])

    @staticmethod
    def _stack(r: _Request) -> dict[str, torch.Tensor]:
        return {name: torch.cat([c[i] for c in r.chunks], dim=0) for i, name in enumerate(("x", "a", "b"))}

    def save(self, path: str | os.PathLike, model_name: str = "sglang", *, sequences: int | None = None,
             tokens: int | None = None, config: Mapping[str, Any] | None = None) -> Path:
        """Write the ``sequences`` longest requests (all when None; ties: first seen), each cut
        to the common length T (the shortest chosen, or ``tokens``); returns the npz path."""
        self._flush_prefill()
        reqs = sorted((r for r in self._done + list(self._live.values()) if r.n > 0), key=lambda r: (-r.n, r.order))
        if not reqs:
            raise RuntimeError("no committed tokens recorded; nothing to save")
        R = len(reqs) if sequences is None else int(sequences)
        if R < 1 or R > len(reqs):
            raise ValueError(f"sequences={sequences}: {len(reqs)} request(s) hold tokens")
        chosen = reqs[:R]
        T = min(r.n for r in chosen) if tokens is None else int(tokens)
        if T < 1 or T > min(r.n for r in chosen):
            raise ValueError(f"tokens={tokens}: the chosen requests hold {[r.n for r in chosen]} tokens")
        st = [self._stack(r) for r in chosen]
        arrays = {name: torch.stack([s[name][:T] for s in st]) for name in ("x", "a", "b")}
        lids = self._layer_ids
        p0 = self._params[lids[0]]
        params = {k: torch.stack([self._params[lid][k] for lid in lids]) for k in
                  ("A_log", "dt_bias", "conv_weight", "conv_bias")}
        model = {"name": model_name, "source": "sglang", "config": dict(config or {}),
                 "requests": [str(r.key) for r in chosen], "prompt_tokens": [min(r.prefill, T) for r in chosen],
                 "prefill_recorded": self.record_prefill, "verify_commits": self.commits}
        try:
            import sglang  # noqa: F401
            extra = {"sglang": getattr(sglang, "__version__", "unknown")}
        except Exception:
            extra = {}
        return write_trace(path, **arrays, **params, dtype=self.dtype, model=model, layers=lids,
                           versions_extra=extra, num_k_heads=p0["num_k_heads"], head_k_dim=p0["head_k_dim"],
                           head_v_dim=p0["head_v_dim"])


# ---------------------------------------------------------------------- env install
ENV_PATH, ENV_MODEL, ENV_EVERY, ENV_SEQ = ("DRIFT_SGLANG_TRACE", "DRIFT_SGLANG_TRACE_MODEL",
                                           "DRIFT_SGLANG_TRACE_EVERY", "DRIFT_SGLANG_TRACE_SEQUENCES")


def install_from_env(gdn_backend: Any = None, hybrid_backend: Any = None,
                     environ: Mapping[str, str] | None = None,
                     register_atexit: bool = True) -> SGLangTraceRecorder | None:
    """Install a recorder when ``DRIFT_SGLANG_TRACE`` is set (else do nothing, return None).

    The backends default to SGLang's Ascend ``AscendGDNAttnBackend`` and
    ``AscendHybridLinearAttnBackend`` classes. ``{pid}`` in the path becomes the process id.
    The trace is saved every ``DRIFT_SGLANG_TRACE_EVERY`` commits (default 64) and at exit.
    """
    env = os.environ if environ is None else environ
    target = env.get(ENV_PATH)
    if not target:
        return None
    if gdn_backend is None or hybrid_backend is None:
        from sglang.srt.hardware_backend.npu.attention.ascend_gdn_backend import AscendGDNAttnBackend
        from sglang.srt.hardware_backend.npu.attention.ascend_hybrid_linear_attn_backend import (
            AscendHybridLinearAttnBackend)
        gdn_backend = gdn_backend or AscendGDNAttnBackend
        hybrid_backend = hybrid_backend or AscendHybridLinearAttnBackend
    path = target.replace("{pid}", str(os.getpid()))
    every = max(1, int(env.get(ENV_EVERY, "64")))
    seq = int(env[ENV_SEQ]) if env.get(ENV_SEQ) else None
    name = env.get(ENV_MODEL, "sglang")
    rec = SGLangTraceRecorder(gdn_backend, hybrid_backend, record_prefill=True).install()

    def save(r: SGLangTraceRecorder) -> None:
        held = sum(1 for _, t in r.requests() if t > 0)
        if held == 0:
            return
        try:
            r.save(path, model_name=name, sequences=None if seq is None else min(seq, held))
        except Exception as exc:  # never take the engine down for a trace
            log.warning("drift: saving the SGLang trace to %s failed: %s", path, exc)

    rec.on_commit = lambda r: save(r) if r.commits % every == 0 else None
    if register_atexit:
        atexit.register(save, rec)
    return rec
