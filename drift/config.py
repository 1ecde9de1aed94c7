"""Validated simulation config and the named presets.

A :class:`Config` describes one tensor-parallel rank of a hybrid Gated DeltaNet
model in MTP decode: the shapes, the request batch, the input stream and the
state-store profile (dtypes, layout, store rounding). Every field is checked in
``__post_init__``; a bad value raises :class:`ConfigError` naming the field and
what is allowed. The state flow (``flow``) names an entry of a registry above this module
(drift/flows/registry.py), which checks it and its kind's rules (``drift.flows.registry.check``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from .dtypes import STORE_DTYPES
from .errors import ConfigError
from .layouts import LAYOUTS, Layout
from .lifecycles import LIFECYCLES, Lifecycle
from .registry import Registry

ROUNDINGS = ("rne", "stochastic", "truncate")
PATTERNS = ("model", "all-1", "all-D", "mixed")
# Draft tokens per row and step: "full" -- every row verifies all D (SGLang's fixed draft_token_num);
# "ragged" -- a seeded count 1..D per row and step, as vLLM's varlen verify takes them (cu_seqlens).
DRAFTS = ("full", "ragged")
DEVICES = ("cpu", "cuda", "npu")


@dataclass(frozen=True)
class Profile:
    """A state-store profile: the dtypes of the committed state / scratch and of the conv window, a
    layout (drift.layouts), and the deployment it models (docs/semantics.md §4)."""

    name: str
    ssm_dtype: str
    conv_dtype: str
    layout: str
    models: str

    def fields(self) -> dict[str, str]:
        """The Config fields this profile sets."""
        return {"ssm_dtype": self.ssm_dtype, "conv_dtype": self.conv_dtype, "layout": self.layout}


PROFILES: Registry[Profile] = Registry("profile")
for _p in (
    # SGLang 0.5.23's Ascend deployment (--mamba-ssm-dtype bfloat16): MambaPool's plain
    # contiguous temporal [L, S, HV, V, K] and intermediate_ssm, _init_npu_conv_state's [L, S, W, C].
    Profile("ascend", "bfloat16", "bfloat16", "contiguous",
            "SGLang 0.5.23's Ascend deployment: srt/mem_cache/memory_pool.py (MambaPool), "
            "srt/hardware_backend/npu/memory_pool_npu.py: _init_npu_conv_state"),
    Profile("ascend-transposed", "bfloat16", "bfloat16", "transposed",
            "the layout sgl-kernel-npu #748 describes (an older SGLang)"),
    Profile("ascend-mixed", "bfloat16", "bfloat16", "state-transposed",
            "where a logical copy and sgl-kernel-npu's raw-memory move_intermediate_cache differ"),
    # CUDA's default (SGLANG_MAMBA_SSM_DTYPE=float32): fp32 states, bf16 conv, contiguous.
    Profile("fp32", "float32", "bfloat16", "contiguous",
            "CUDA's default (SGLANG_MAMBA_SSM_DTYPE=float32, srt/configs/mamba_utils.py)"),
):
    PROFILES.register(_p.name, _p)


def find_profile(what: str, test: Callable[[Profile, Layout], bool]) -> str:
    """The name of the first registered profile (registry order) for which ``test(profile, its
    layout)`` holds: how code that needs a kind of profile (fp32 states, a transposed layout)
    picks one without naming it. ConfigError, saying ``what`` was sought, when none does."""
    for name, p in PROFILES.items():
        if test(p, LAYOUTS[p.layout]):
            return name
    raise ConfigError(f"no registered profile has {what}; profiles: {', '.join(PROFILES)}")


# drift.sim.stream keys its generators with the seed masked to 32 bits: a larger seed would
# silently replay the stream of seed % 2^32 under a different stream_hash.
SEED_MAX = 2**32 - 1
# Request r's prompt is prefill_len + PREFILL_STAGGER * r tokens long, so rows cross track
# boundaries apart (drift.sim.stream.prefill_lengths).
PREFILL_STAGGER = 3
# The fields a trace fixes (its model's head shapes); num_layers may be cut to the trace's first
# N layers and num_requests to its first R sequences, but these must be the trace's own.
TRACE_SHAPE_FIELDS = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel")


@dataclass(frozen=True)
class Config:
    """One simulated rank: shapes, batch, stream and state-store profile.

    Shapes follow SGLang's MambaPool: committed states ``[L, slots, HV, V, K]``,
    scratch ``[L, rows + 1, D, HV, V, K]``, conv windows ``[L, slots, W, C]`` with
    ``W = (conv_kernel - 1) + (D - 1)`` and ``C = 2 * HK * K + HV * V``.
    """

    name: str = "custom"
    num_layers: int = 2  # GDN layers simulated
    num_requests: int = 4  # active batch rows
    num_padded: int = 1  # padded graph rows: step -1, slot 0 (the dummy)
    num_k_heads: int = 1
    num_v_heads: int = 4
    head_k_dim: int = 64
    head_v_dim: int = 64
    conv_kernel: int = 4
    num_draft_tokens: int = 4  # D: root + D-1 drafts verified per step
    track_interval: int = 16  # mamba_track_interval; 0 disables tracking
    steps: int = 4096  # decode steps simulated
    seed: int = 0
    # Marginal acceptance rate of draft positions 1..D-1 (non-increasing).
    acceptance: tuple[float, ...] = (0.85, 0.46, 0.19)
    pattern: str = "mixed"  # acceptance pattern, see drift.sim.stream
    drafts: str = "full"  # draft tokens per row: DRAFTS
    # Median per-token decay exp(g) of each value head (same for every layer).
    decays: tuple[float, ...] = (0.5, 0.9, 0.98, 0.995)
    key_rank: int = 0  # 0: keys span all K dims; r > 0: keys in r coordinates
    beta_bias: float = 0.0  # offset of the gate input b: beta = sigmoid(b + beta_bias)
    prefill_len: int = 24  # tokens of prompt before the first decode step
    spare_slots: int = 2  # pool slots no request owns (must stay untouched)
    ssm_dtype: str = "bfloat16"  # committed state and intermediate_ssm
    conv_dtype: str = "bfloat16"
    layout: str = "contiguous"
    store_rounding: str = "rne"  # how fp32 states are stored into ssm_dtype
    flow: str = "sglang"  # how the engine keeps MTP state: an entry of drift.flows.registry.FLOWS (checked there)
    graph_mode: bool = True  # the verify op's metadata as SGLang's graph mode builds it (else eager)
    # How requests come and go between steps: an entry of drift.lifecycles.LIFECYCLES ("fixed": one
    # request per lane in fixed rows and slots; "serving": churn, prefix hits, preemption, reordering,
    # graph buckets). Config's default is the fixed batch; drift run, the gate and the nightly default
    # to serving (drift.lifecycles.DEFAULT_LIFECYCLE).
    lifecycle: str = "fixed"
    device: str = "cpu"
    description: str = ""
    # Replay of a captured trace (drift.sim.tracefile) instead of the synthetic stream: its path
    # ("" = the synthetic stream), whether positions past its end wrap around (position p reads
    # token p mod tokens), and -- set by Config.from_trace, checked by the stream on load -- the
    # npz's sha256 (part of stream_hash) and its tokens per sequence (bounds the horizon).
    trace: str = ""
    trace_loop: bool = False
    trace_sha256: str = ""
    trace_tokens: int = 0
    # The flow kind's own options (docs/semantics.md §6: the ReplaySSM design's ring records,
    # fold contraction and fold cadence): sorted (name, value) pairs, each read and checked by the
    # kind of ``flow`` (``FlowKind.OPTIONS``, drift.flows.registry.check); () = the kind's defaults,
    # the engine's as modelled.
    flow_options: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        _validate(self)

    # ----------------------------------------------------------------- derived
    @property
    def serving(self) -> Lifecycle:
        """The lifecycle entry (drift.lifecycles)."""
        return LIFECYCLES[self.lifecycle]

    @property
    def num_rows(self) -> int:
        """The most batch rows passed to the kernel and the update in one step: active plus padded
        (fixed lifecycle); under churn the graph bucket that holds every lane (the batch of a step is
        the bucket of its running requests, at most this)."""
        if self.serving.churn:
            return self.serving.graph_bucket(self.num_requests)
        return self.num_requests + self.num_padded

    @property
    def conv_channels(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    @property
    def conv_window(self) -> int:
        """Rows of the NPU extended conv window: (Kc - 1) + (D - 1)."""
        return (self.conv_kernel - 1) + (self.num_draft_tokens - 1)

    @property
    def num_slots(self) -> int:
        """Pool slots: dummy slot 0, one per request, one track slot per request, spares; under churn
        also the slots the prefix cache keeps (the last finished requests' snapshots)."""
        return 1 + 2 * self.num_requests + self.spare_slots + (self.serving.prefix_cache if self.serving.churn else 0)

    @property
    def torch_ssm_dtype(self) -> torch.dtype:
        return STORE_DTYPES[self.ssm_dtype].torch_dtype

    @property
    def torch_conv_dtype(self) -> torch.dtype:
        return STORE_DTYPES[self.conv_dtype].torch_dtype

    @property
    def unit_roundoff(self) -> float:
        """u of the state dtype (drift.dtypes): 2^-8 for bf16, 2^-11 for fp16, 2^-24 for fp32."""
        return STORE_DTYPES[self.ssm_dtype].unit_roundoff

    def replace(self, **changes: Any) -> "Config":
        """A copy with some fields changed (validated again).

        A trace fixes the model's head shapes (:data:`TRACE_SHAPE_FIELDS`): a copy of a trace
        config with other head shapes is another model, so it drops the trace and reads the
        synthetic stream (the schedule-only copies drift.syncs.scan makes; every field that
        shapes the acceptance schedule -- seed, batch, acceptance, prefill -- is kept).
        """
        if self.trace and "trace" not in changes and any(
                f in changes and changes[f] != getattr(self, f) for f in TRACE_SHAPE_FIELDS):
            changes = {**changes, "trace": "", "trace_loop": False, "trace_sha256": "", "trace_tokens": 0}
        return dataclasses.replace(self, **changes)

    @property
    def max_position(self) -> int:
        """The furthest position any request reaches in ``steps`` decode steps (every row accepting
        D tokens every step): its prompt, the longest, plus steps * D."""
        return self.prefill_len + PREFILL_STAGGER * (self.num_requests - 1) + self.steps * self.num_draft_tokens

    @staticmethod
    def from_trace(trace: Any, base: "Config", steps: int | None = None, loop: bool = False) -> "Config":
        """A config replaying ``trace`` (a :class:`drift.sim.tracefile.Trace`) on ``base``'s batch.

        The trace gives the model: num_layers, num_k_heads, num_v_heads, head_k_dim, head_v_dim and
        conv_kernel, one request per recorded sequence (num_requests), the prompt length (the
        manifest's ``model.prompt_tokens`` when recorded, else Kc - 1, at least Kc - 1). ``base``
        keeps everything else: padded rows, D, acceptance and pattern, track interval, profile,
        flow, device, seed. ``decays`` becomes the trace's median per-token decay of each value
        head (informational: with a trace, A_log and dt_bias come from the trace). ``steps``
        (None: the whole trace, the most decode steps whose positions all exist, i.e.
        ``(tokens - longest prompt) // D``) must not need positions past the trace's end unless
        ``loop`` (ConfigError naming the trace, its tokens and the steps asked).
        """
        m = trace.manifest
        path = str(trace.path)
        T, R, Kc, D = int(m["tokens"]), int(m["sequences"]), int(m["conv_kernel"]), base.num_draft_tokens
        prompt = m.get("model", {}).get("prompt_tokens")
        prefill = max(int(prompt), Kc - 1) if isinstance(prompt, int) and not isinstance(prompt, bool) else Kc - 1
        longest = prefill + PREFILL_STAGGER * (R - 1)
        whole = (T - longest) // D
        if steps is None:
            if whole < 1 and not loop:
                raise ConfigError(f"trace {path} has {T} tokens per sequence: too few for one decode step of D = {D} "
                                  f"after the longest prompt ({longest} tokens: {prefill} + {PREFILL_STAGGER} per "
                                  f"request for {R} requests); capture more tokens, or pass --loop to wrap around")
            steps = max(1, whole)
        z = trace.a.astype(np.float64) + trace.dt_bias.astype(np.float64)[None, None]
        g = -np.exp(trace.A_log.astype(np.float64))[None, None] * np.logaddexp(0.0, z)
        med = np.median(np.exp(g), axis=(0, 1, 2))  # [HV], over sequences, tokens and layers
        decays = tuple(float(min(max(d, 1e-300), 1.0 - 2.0**-53)) for d in med)
        name = f"{base.name}+trace:{Path(path).stem}"
        desc = (f"{base.name}'s batch and schedule on trace {Path(path).name} "
                f"({m['model'].get('name', '?')}, {R} sequences x {T} tokens)")
        return base.replace(
            name=name, description=desc, num_layers=int(m["num_layers"]), num_requests=R,
            num_k_heads=int(m["num_k_heads"]), num_v_heads=int(m["num_v_heads"]), head_k_dim=int(m["head_k_dim"]),
            head_v_dim=int(m["head_v_dim"]), conv_kernel=Kc, decays=decays, key_rank=0, beta_bias=0.0,
            prefill_len=prefill, steps=int(steps), trace=path, trace_loop=bool(loop),
            trace_sha256=str(m["sha256"]), trace_tokens=T)

    @property
    def profile(self) -> str:
        """The name of the profile these dtypes and this layout make ('custom' when none)."""
        mine = {"ssm_dtype": self.ssm_dtype, "conv_dtype": self.conv_dtype, "layout": self.layout}
        return next((name for name, p in PROFILES.items() if p.fields() == mine), "custom")

    def with_profile(self, profile: str) -> "Config":
        return self.replace(**PROFILES[profile].fields())

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON values. ``flow_options`` appears only when set: a run of the kind's
        defaults records what it recorded before the options existed (its report and nightly
        identity unchanged)."""
        d = dataclasses.asdict(self)
        d["acceptance"] = list(self.acceptance)
        d["decays"] = list(self.decays)
        if self.flow_options:
            d["flow_options"] = [list(p) for p in self.flow_options]
        else:
            del d["flow_options"]
        return d

    def flow_option(self, name: str) -> str | None:
        """The value of flow option ``name`` (None: not set, the kind's default)."""
        return dict(self.flow_options).get(name)

    def stream_hash(self) -> str:
        """Hash of every field that shapes the true trajectory (not the store profile,
        the device, the horizon or the acceptance): one golden serves all of those."""
        keys = (
            "num_layers", "num_requests", "num_k_heads", "num_v_heads", "head_k_dim",
            "head_v_dim", "conv_kernel", "seed", "decays", "key_rank", "beta_bias", "prefill_len",
        )
        if self.trace:  # the trace's content, never its path: golden data of one trace serves no other
            keys += ("trace_sha256",)
        if self.serving.churn:  # which requests exist, their prompts and shared prefixes (the fixed batch: none)
            keys += ("lifecycle", "num_draft_tokens", "acceptance", "pattern", "drafts", "track_interval")
        payload = json.dumps({k: self.to_dict()[k] for k in keys}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _positive_int(cfg: Config, name: str, minimum: int = 1) -> None:
    value = getattr(cfg, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name}={value!r} is invalid; allowed: an integer >= {minimum}")


def _choice(cfg: Config, name: str, allowed: tuple[str, ...]) -> None:
    value = getattr(cfg, name)
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not known; allowed: {', '.join(allowed)}")


def _validate(cfg: Config) -> None:
    for name in ("num_layers", "num_requests", "num_k_heads", "num_v_heads", "head_k_dim",
                 "head_v_dim", "num_draft_tokens", "steps"):
        _positive_int(cfg, name)
    _positive_int(cfg, "conv_kernel", 2)
    for name in ("num_padded", "track_interval", "key_rank", "spare_slots", "seed"):
        _positive_int(cfg, name, 0)
    _positive_int(cfg, "prefill_len", cfg.conv_kernel - 1)
    if cfg.seed > SEED_MAX:
        raise ConfigError(f"seed={cfg.seed} is invalid; allowed: an integer in [0, {SEED_MAX}] "
                          "(the stream keys its generators with 32-bit words)")
    if cfg.num_v_heads % cfg.num_k_heads:
        raise ConfigError(
            f"num_v_heads={cfg.num_v_heads} is not a multiple of num_k_heads={cfg.num_k_heads}; "
            "allowed: num_v_heads = m * num_k_heads (grouped value heads)")
    if cfg.key_rank > cfg.head_k_dim:
        raise ConfigError(f"key_rank={cfg.key_rank} exceeds head_k_dim={cfg.head_k_dim}; "
                          f"allowed: 0 (full rank) .. {cfg.head_k_dim}")
    for name, allowed in (("ssm_dtype", STORE_DTYPES.names()), ("conv_dtype", STORE_DTYPES.names()),
                          ("store_rounding", ROUNDINGS), ("layout", LAYOUTS.names()),
                          ("pattern", PATTERNS), ("drafts", DRAFTS), ("device", DEVICES),
                          ("lifecycle", LIFECYCLES.names())):
        _choice(cfg, name, allowed)
    if cfg.serving.churn and cfg.trace:
        raise ConfigError(f"lifecycle={cfg.lifecycle!r} with a trace: a trace records one sequence per request and "
                          "no requests that arrive later; allowed with a trace: lifecycle='fixed'")
    if cfg.drafts == "ragged" and cfg.trace:
        raise ConfigError("drafts='ragged' with a trace: a trace replays the accept lengths it recorded; "
                          "allowed with a trace: drafts='full'")
    if not isinstance(cfg.graph_mode, bool):
        raise ConfigError(f"graph_mode={cfg.graph_mode!r} is invalid; allowed: True or False")
    if cfg.store_rounding != "rne" and cfg.ssm_dtype != "bfloat16":
        raise ConfigError(
            f"store_rounding={cfg.store_rounding!r} needs ssm_dtype='bfloat16' "
            f"(got {cfg.ssm_dtype!r}); allowed with other dtypes: 'rne'")
    acc = tuple(cfg.acceptance)
    if len(acc) != cfg.num_draft_tokens - 1:
        raise ConfigError(
            f"acceptance has {len(acc)} entries; allowed: one rate per draft position, "
            f"i.e. num_draft_tokens - 1 = {cfg.num_draft_tokens - 1} values in [0, 1]")
    if any(not (0.0 <= p <= 1.0) for p in acc) or any(b > a for a, b in zip(acc, acc[1:])):
        raise ConfigError(f"acceptance={list(acc)} is invalid; allowed: non-increasing rates in [0, 1] "
                          "(position j can only be accepted if j - 1 was)")
    if len(cfg.decays) != cfg.num_v_heads:
        raise ConfigError(f"decays has {len(cfg.decays)} entries; allowed: one per value head "
                          f"(num_v_heads = {cfg.num_v_heads}), each in (0, 1)")
    if any(not (0.0 < d < 1.0) or math.isnan(d) for d in cfg.decays):
        raise ConfigError(f"decays={list(cfg.decays)} is invalid; allowed: per-token decays in (0, 1)")
    bias = cfg.beta_bias
    if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
        raise ConfigError(f"beta_bias={bias!r} is invalid; allowed: a finite number "
                          "(offset of the gate input b)")
    if cfg.num_draft_tokens > cfg.conv_window + 1:  # guaranteed by the formula, kept as a guard
        raise ConfigError("num_draft_tokens exceeds conv window + 1")
    _validate_flow_options(cfg)
    _validate_trace(cfg)


def _validate_flow_options(cfg: Config) -> None:
    """Their form only (sorted name/value pairs, each name once); what a name and value may be is
    the flow kind's to say (drift.flows.registry.check)."""
    opts = cfg.flow_options
    pairs = isinstance(opts, tuple) and all(
        isinstance(p, tuple) and len(p) == 2 and all(isinstance(x, str) and x for x in p) for p in opts)
    if not pairs:
        raise ConfigError(f"flow_options={opts!r} is invalid; allowed: a tuple of (name, value) string pairs "
                          "(drift.config.flow_options builds one)")
    names = [n for n, _ in opts]
    if names != sorted(set(names)):
        raise ConfigError(f"flow_options={opts!r} is invalid; allowed: each option once, sorted by name "
                          "(drift.config.flow_options builds one)")


def flow_options(values: "dict[str, str] | None" = None, **named: str) -> tuple[tuple[str, str], ...]:
    """``Config.flow_options`` from a mapping (and keywords, ``_`` read as ``-``): sorted pairs."""
    merged = {**(values or {}), **{k.replace("_", "-"): v for k, v in named.items()}}
    return tuple(sorted((str(k), str(v)) for k, v in merged.items()))


def _validate_trace(cfg: Config) -> None:
    if not isinstance(cfg.trace, str):
        raise ConfigError(f"trace={cfg.trace!r} is invalid; allowed: the path of a trace .npz, or '' (synthetic)")
    if not isinstance(cfg.trace_loop, bool):
        raise ConfigError(f"trace_loop={cfg.trace_loop!r} is invalid; allowed: True or False")
    if not cfg.trace:
        if cfg.trace_loop or cfg.trace_sha256 or cfg.trace_tokens:
            raise ConfigError("trace_loop / trace_sha256 / trace_tokens are set without a trace; allowed: "
                              "only with trace (build trace configs with Config.from_trace)")
        return
    if not (isinstance(cfg.trace_sha256, str) and len(cfg.trace_sha256) == 64
            and all(c in "0123456789abcdef" for c in cfg.trace_sha256)):
        raise ConfigError(f"trace_sha256={cfg.trace_sha256!r} is invalid for trace {cfg.trace}; allowed: the "
                          "npz's sha256 from its manifest (build trace configs with Config.from_trace)")
    _positive_int(cfg, "trace_tokens")
    if cfg.key_rank or cfg.beta_bias:
        raise ConfigError(f"key_rank={cfg.key_rank} / beta_bias={cfg.beta_bias} with trace {cfg.trace}; allowed: "
                          "0 (the trace supplies the keys and the beta logits)")
    if not cfg.trace_loop and cfg.max_position > cfg.trace_tokens:
        longest = cfg.prefill_len + PREFILL_STAGGER * (cfg.num_requests - 1)
        most = max(0, (cfg.trace_tokens - longest) // cfg.num_draft_tokens)
        raise ConfigError(f"steps={cfg.steps} needs positions up to {cfg.max_position}, but trace {cfg.trace} has "
                          f"{cfg.trace_tokens} tokens per sequence (longest prompt {longest}, D = "
                          f"{cfg.num_draft_tokens}): at most {most} steps; pass fewer --steps, none (the whole "
                          "trace), or --loop to wrap around")


def spread_decays(decays: tuple[float, ...], n: int) -> tuple[float, ...]:
    """``n`` per-value-head decays spanning ``decays``' fastest to slowest: ``1 - d`` geometric from
    ``1 - min`` to ``1 - max`` (``decays`` itself when it has ``n``; their geometric middle for one)."""
    if len(decays) == n:
        return tuple(decays)
    lo, hi = 1.0 - min(decays), 1.0 - max(decays)
    if n == 1:
        return (1.0 - math.sqrt(lo * hi),)
    return tuple(float(1.0 - lo * (hi / lo) ** (i / (n - 1))) for i in range(n))


# Deployment shapes per tensor-parallel rank. Both models' GDN layers (config.json, transformers 5.24.0
# models/qwen3_next/configuration_qwen3_next.py; Qwen3.5 reuses them):
#   Qwen3-Next-80B-A3B (huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct, config.json): 48 layers,
#     full_attention_interval 4 -> 36 GDN layers; linear_num_key_heads 16, linear_num_value_heads 32,
#     linear_key_head_dim = linear_value_head_dim = 128, linear_conv_kernel_dim 4.
#   Qwen3.5-397B-A17B (huggingface.co/Qwen/Qwen3.5-397B-A17B's card, as mlx-community/Qwen3.5-397B-A17B-4bit
#     copies it): 60 layers = 15 x (3 GDN + 1 full) -> 45 GDN layers; linear heads 16 QK / 64 V, dim 128.
# Each rank holds key heads / TP and value heads / TP: SGLang 0.5.23 srt/models/qwen3_next.py
# (num_k_heads // attn_tp_size, num_v_heads // attn_tp_size), vLLM 0.33.0
# model_executor/layers/mamba/mamba_utils.py: gated_delta_net_state_shape (divide(num_v_heads, tp)) and
# layers/mamba/gdn/qwen_gdn_linear_attn.py: fix_query_key_value_ordering (num_k_heads // tp_size key
# groups). A TP above the key heads (TP 32 for both) leaves a rank 0 key groups, which neither engine's
# view of the projection can hold (docs/semantics.md §5); Config refuses num_k_heads=0.
MODEL_HEADS = {"qwen3-next-80b": (36, 16, 32, 128), "qwen3.5-397b": (45, 16, 64, 128)}  # L, HK, HV, K = V
DEPLOYMENT_TP = (1, 4, 16)
# The 397B preset's decays (fast to slow), spread over each rank's value heads (spread_decays).
_DEPLOYMENT_DECAYS = (0.6, 0.9, 0.99, 0.997)


def _deployment(model: str, tp: int) -> Config:
    L, HK, HV, K = MODEL_HEADS[model]
    hk, hv = HK // tp, HV // tp
    title = {"qwen3-next-80b": "Qwen3-Next-80B-A3B", "qwen3.5-397b": "Qwen3.5-397B-A17B"}[model]
    return Config(
        name=f"{model}-tp{tp}", num_layers=L, num_requests=4, num_padded=1, num_k_heads=hk, num_v_heads=hv,
        head_k_dim=K, head_v_dim=K, conv_kernel=4, num_draft_tokens=4, track_interval=256, steps=4096,
        decays=spread_decays(_DEPLOYMENT_DECAYS, hv), prefill_len=64,
        description=f"{title} per TP{tp} rank: {L} GDN layers, {hk} key head{'s' * (hk > 1)}, {hv} value heads, "
                    f"K = V = {K}, {2 * hk * K + hv * K} conv channels, D = 4.")


PRESETS: dict[str, Config] = {
    "ci-small": Config(
        name="ci-small",
        description="PR-gating: 2 GDN layers, 4 requests + 1 padded row, 4 value heads from "
                    "fast (0.5/token) to very slow (0.995/token) decay, K = V = 64, D = 4.",
    ),
    # The PR gate's multi-key-head shape: Qwen3-Next-80B's per-rank heads at TP 8 (16 / 8 key, 32 / 8
    # value heads), ci-small's batch and head dims, D = 2 (one draft: the common MTP setting); half
    # ci-small's steps (4,096 tokens) keeps the gate's time (ci-small gates the long horizon).
    "ci-heads": Config(
        name="ci-heads", num_k_heads=2, num_v_heads=4, num_draft_tokens=2, acceptance=(0.85,), steps=2048,
        description="PR-gating: ci-small with 2 key heads over 4 value heads (Qwen3-Next-80B per TP8 "
                    "rank), each key head serving 2 value heads, D = 2, 2048 steps.",
    ),
    "qwen3.5-397b-tp16": Config(
        name="qwen3.5-397b-tp16",
        num_layers=45, num_requests=4, num_padded=1, num_k_heads=1, num_v_heads=4,
        head_k_dim=128, head_v_dim=128, conv_kernel=4, num_draft_tokens=4,
        track_interval=256, steps=4096, decays=(0.6, 0.9, 0.99, 0.997), prefill_len=64,
        description="Qwen3.5-397B-A17B per TP16 rank: 45 GDN layers, 1 key head, 4 value heads, "
                    "K = V = 128, 768 conv channels, D = 4.",
    ),
    **{f"{m}-tp{tp}": _deployment(m, tp) for m in MODEL_HEADS for tp in DEPLOYMENT_TP
       if f"{m}-tp{tp}" != "qwen3.5-397b-tp16"},
    "stagnation": Config(
        name="stagnation",
        num_layers=1, num_requests=2, num_padded=1, num_k_heads=1, num_v_heads=2,
        head_k_dim=64, head_v_dim=64, track_interval=16, steps=4096, decays=(0.999, 0.9998),
        key_rank=4, beta_bias=-10.0, pattern="model",
        description="Adversarial: per-token decay 0.999 and 0.9998, keys in a rank-4 coordinate "
                    "subspace, tiny writes (beta ~ 5e-5): bf16 round-to-nearest stagnates.",
    ),
}

DEFAULT_PRESET = "ci-small"
# What the PR gate (pytest --pyargs drift) runs without --drift-preset: the default preset, and a
# multi-key-head shape at D = 2.
GATE_PRESETS = (DEFAULT_PRESET, "ci-heads")


def preset(name: str, **overrides: Any) -> Config:
    """The named preset with optional field overrides; unknown names list the choices."""
    if name not in PRESETS:
        raise ConfigError(f"preset={name!r} is not known; allowed: {', '.join(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
