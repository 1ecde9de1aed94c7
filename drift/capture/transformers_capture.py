"""Capture a Hugging Face transformers model's GDN inputs during a greedy decode into a drift trace.

What is recorded (see :mod:`drift.sim.tracefile` for the format): for every Gated DeltaNet
layer and every token the model processes -- the ``prompt_len`` prompt tokens (one prefill
forward) and then ``tokens`` decoded tokens (one single-token forward each) -- the pre-conv
channels ``x`` [C], the gating input ``a`` [HV] and the beta logit ``b`` [HV]. So a trace
holds ``T = prompt_len + tokens`` tokens per sequence, starting from an empty conv window
exactly as the model's prefill does, and the manifest's model block says
``"prompt_tokens": prompt_len`` and ``"decoded_tokens": tokens``. ``model.generate`` is run
greedily for ``tokens + 1`` new tokens (``min_new_tokens`` too, so EOS is suppressed and
every sequence runs the full length), because the last generated token is never fed back
through the model.

Facts used, read in transformers 5.24.0 (``transformers/models/qwen3_next/modeling_qwen3_next.py``,
class ``Qwen3NextGatedDeltaNet``; ``transformers/models/qwen3_5/modeling_qwen3_5.py``, class
``Qwen3_5GatedDeltaNet``; the same module also appears as ``Qwen3_5MoeGatedDeltaNet`` and
others with Qwen3.5's projections):

* Both compute ``mixed_qkv = cat(q, k, v)`` over the channel axis, each flattened head-major
  (q: HK heads x K, k: HK x K, v: HV x V), transpose it to [B, C, S] and run it through
  ``causal_conv1d_fn`` (prefill, zero left padding of Kc-1) or ``causal_conv1d_update``
  (single-token decode with the cached conv state) with weight ``conv1d.weight.squeeze(1)``
  [C, Kc], bias ``conv1d.bias`` (``bias=False``: None) and SiLU. That conv is
  ``F.conv1d(..., groups=C)``, a cross-correlation: tap m multiplies token t-(Kc-1)+m.
* Then ``beta = b.sigmoid()`` and ``g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)``
  with the module parameters ``A_log`` [HV] and ``dt_bias`` [HV].
* Qwen3-Next (``in_proj_qkvz``, ``in_proj_ba``; ``fix_query_key_value_ordering``): the
  projection output is grouped per key head g: ``[q_g (K) | k_g (K) | v (r*V) | z (r*V)]``
  with r = HV/HK, the value heads of group g being g*r .. g*r+r-1; ``in_proj_ba`` is grouped
  per key head too: ``[b (r) | a (r)]``. This module un-groups both into the conv order.
* Qwen3.5 (``in_proj_qkv``, ``in_proj_a``, ``in_proj_b``): ``in_proj_qkv`` already emits the
  conv order; a and b are their own projections.
* The decode step calls the module-level *function* ``causal_conv1d_update``, never the
  ``conv1d`` module, so module hooks on ``conv1d`` do not fire; this module hooks the input
  projections instead (their outputs are exactly x, a, b; the padding mask, applied to the
  hidden states before the projections, is all ones here since no prompt is padded).

Not supported (refused with :class:`drift.errors.ConfigError`): other modules named
``*GatedDeltaNet`` with a different projection layout, e.g. OLMo-Hybrid's
``OlmoHybridGatedDeltaNet`` (separate q/k/v projections, and beta = 2*sigmoid(b) when
``linear_allow_neg_eigval``, which is not drift's beta), and models run in float16 (a trace
holds bf16 or fp32).
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError
from ..fileio import read_json
from ..sim.tracefile import bytes_per_token_per_layer, write_trace

GDN_SUFFIX = "GatedDeltaNet"
RUN_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
TINY_ARCHS = ("qwen3_next", "qwen3_5")
# Config fields copied into the manifest (those that exist on the model's text config).
CONFIG_FIELDS = ("model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers", "layer_types",
                 "hidden_act", "rms_norm_eps", "linear_num_key_heads", "linear_num_value_heads",
                 "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts",
                 "dtype", "_name_or_path")


# --------------------------------------------------------------------------- the GDN layers
def find_gdn_layers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """``(layer_idx, module)`` of every submodule whose class name ends in ``GatedDeltaNet``,
    in layer order (``layer_idx`` is the module's own attribute, else its position)."""
    found = [m for m in model.modules() if type(m).__name__.endswith(GDN_SUFFIX)]
    if not found:
        raise ConfigError(f"{type(model).__name__} has no *{GDN_SUFFIX} module; capture needs a Qwen3-Next / "
                          "Qwen3.5 style hybrid model with linear-attention (GDN) layers")
    out = [(int(getattr(m, "layer_idx", i)), m) for i, m in enumerate(found)]
    out.sort(key=lambda t: t[0])
    return out


def gdn_layout(module: torch.nn.Module) -> str:
    """``"qwen3_next"`` (in_proj_qkvz + in_proj_ba) or ``"qwen3_5"`` (in_proj_qkv/a/b)."""
    has = lambda *names: all(isinstance(getattr(module, n, None), torch.nn.Module) for n in names)  # noqa: E731
    if has("in_proj_qkvz", "in_proj_ba"):
        return "qwen3_next"
    if has("in_proj_qkv", "in_proj_a", "in_proj_b"):
        return "qwen3_5"
    raise ConfigError(f"{type(module).__name__} has neither Qwen3-Next's (in_proj_qkvz, in_proj_ba) nor Qwen3.5's "
                      "(in_proj_qkv, in_proj_a, in_proj_b) projections; drift's transformers capture supports those "
                      "two layouts only")


def _dims(module: torch.nn.Module) -> dict[str, int]:
    d = {"num_k_heads": module.num_k_heads, "num_v_heads": module.num_v_heads, "head_k_dim": module.head_k_dim,
         "head_v_dim": module.head_v_dim, "conv_kernel": module.conv_kernel_size}
    d = {k: int(v) for k, v in d.items()}
    d["conv_channels"] = 2 * d["num_k_heads"] * d["head_k_dim"] + d["num_v_heads"] * d["head_v_dim"]
    return d


def gdn_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The layer's float32 constants: A_log [HV], dt_bias [HV], conv_weight [C, Kc], conv_bias [C]."""
    w = module.conv1d.weight.detach().to("cpu", torch.float32)
    w = w.reshape(w.shape[0], w.shape[-1])  # [C, 1, Kc] depthwise -> [C, Kc]
    bias = module.conv1d.bias
    bias = torch.zeros(w.shape[0]) if bias is None else bias.detach().to("cpu", torch.float32)
    return {"A_log": module.A_log.detach().to("cpu", torch.float32), "dt_bias": module.dt_bias.detach().to("cpu", torch.float32),
            "conv_weight": w, "conv_bias": bias}


def split_qwen3_next(qkvz: torch.Tensor, ba: torch.Tensor, d: dict[str, int]) -> tuple[torch.Tensor, ...]:
    """Qwen3-Next's key-head-grouped projections -> (x [..., C] in conv order, a [..., HV], b [..., HV])."""
    HK, HV, K, V = d["num_k_heads"], d["num_v_heads"], d["head_k_dim"], d["head_v_dim"]
    r = HV // HK
    lead = qkvz.shape[:-1]
    g = qkvz.reshape(*lead, HK, 2 * K + 2 * r * V)
    q = g[..., :K].reshape(*lead, HK * K)
    k = g[..., K:2 * K].reshape(*lead, HK * K)
    v = g[..., 2 * K:2 * K + r * V].reshape(*lead, HV * V)  # value head g*r+j sits in group g, slot j
    gba = ba.reshape(*lead, HK, 2 * r)
    b = gba[..., :r].reshape(*lead, HV)
    a = gba[..., r:].reshape(*lead, HV)
    return torch.cat([q, k, v], dim=-1), a, b


class GDNInputRecorder:
    """Forward hooks on every GDN layer's input projections recording x, a, b of each forward.

    Use as a context manager (hooks removed on exit). :meth:`arrays` stacks what was seen:
    x [B, S, L, C], a and b [B, S, L, HV], in the run dtype, S the tokens of all forwards.
    """

    def __init__(self, model: torch.nn.Module):
        self.layers = find_gdn_layers(model)
        self.layouts = [gdn_layout(m) for _, m in self.layers]
        self.dims = _dims(self.layers[0][1])
        for idx, m in self.layers[1:]:
            if _dims(m) != self.dims:
                raise ConfigError(f"GDN layer {idx} has shapes {_dims(m)}, layer {self.layers[0][0]} {self.dims}; "
                                  "a trace needs one shape for every layer")
        self._chunks: list[dict[str, list[torch.Tensor]]] = [{"x": [], "a": [], "b": []} for _ in self.layers]
        self._pending: list[dict[str, torch.Tensor]] = [{} for _ in self.layers]
        self._handles: list[Any] = []

    # hooks ---------------------------------------------------------------
    def _hook(self, li: int, key: str):
        def fn(_mod, _inp, out):
            self._pending[li][key] = out.detach()
            self._flush(li)
        return fn

    def _flush(self, li: int) -> None:
        p, layout = self._pending[li], self.layouts[li]
        need = ("qkvz", "ba") if layout == "qwen3_next" else ("qkv", "a", "b")
        if not all(k in p for k in need):
            return
        if layout == "qwen3_next":
            x, a, b = split_qwen3_next(p["qkvz"], p["ba"], self.dims)
        else:
            x, a, b = p["qkv"], p["a"], p["b"]
        for name, t in (("x", x), ("a", a), ("b", b)):
            self._chunks[li][name].append(t.to("cpu").clone())
        p.clear()

    def install(self) -> "GDNInputRecorder":
        if self._handles:
            return self
        for li, ((_, m), layout) in enumerate(zip(self.layers, self.layouts)):
            names = {"qkvz": "in_proj_qkvz", "ba": "in_proj_ba"} if layout == "qwen3_next" else \
                    {"qkv": "in_proj_qkv", "a": "in_proj_a", "b": "in_proj_b"}
            for key, attr in names.items():
                self._handles.append(getattr(m, attr).register_forward_hook(self._hook(li, key)))
        return self

    def uninstall(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "GDNInputRecorder":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    # results -------------------------------------------------------------
    def tokens_seen(self) -> list[int]:
        return [sum(t.shape[1] for t in c["x"]) for c in self._chunks]

    def arrays(self) -> dict[str, torch.Tensor]:
        seen = self.tokens_seen()
        if len(set(seen)) != 1 or seen[0] == 0:
            raise RuntimeError(f"GDN layers saw different token counts {seen} (or none); capture needs every "
                               "layer to process every token")
        return {name: torch.stack([torch.cat(c[name], dim=1) for c in self._chunks], dim=2) for name in ("x", "a", "b")}


# --------------------------------------------------------------------------- models
def build_tiny_model(arch: str = "qwen3_next", seed: int = 0, dtype: torch.dtype = torch.float32,
                     **overrides: Any) -> torch.nn.Module:
    """A tiny randomly initialised hybrid model (no download), in eval mode, in ``dtype``.

    4 layers alternating linear/full attention (GDN layers 0 and 2), hidden 64, vocab 128,
    2 key heads, 4 value heads, K = V = 32, conv kernel 4, no MoE. ``arch`` is
    ``"qwen3_next"`` (``Qwen3NextForCausalLM``) or ``"qwen3_5"`` (``Qwen3_5ForCausalLM`` with
    ``Qwen3_5TextConfig``, the text-only causal LM of Qwen3.5). ``dt_bias`` is drawn per head
    (transformers initialises it to ones), so a head mix-up in a capture shows. ``overrides``
    go to the config. Initialisation uses its own RNG: the caller's torch RNG is untouched.
    """
    import transformers

    if arch not in TINY_ARCHS:
        raise ConfigError(f"arch {arch!r} is not one of {TINY_ARCHS}")
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
              num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
              layer_types=["linear_attention", "full_attention"] * 2, max_position_embeddings=512,
              initializer_range=0.1, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    if arch == "qwen3_next":
        kw["num_experts"] = 0
    kw.update(overrides)
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        kw["layer_types"] = (["linear_attention", "full_attention"] * kw["num_hidden_layers"])[:kw["num_hidden_layers"]]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if arch == "qwen3_next":
            model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**kw))
        else:
            model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**kw))
        with torch.no_grad():
            for _, m in find_gdn_layers(model):
                m.dt_bias.copy_(torch.randn(m.dt_bias.shape) * 0.5 + 1.0)
    model.config.name_or_path = f"drift-tiny-{arch}"
    return model.to(dtype).eval()


# The files from_pretrained reads weights from (transformers 5.24.0, transformers.utils: SAFE_WEIGHTS_NAME,
# SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def load_model(path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> torch.nn.Module:
    """A local checkpoint directory via ``AutoModelForCausalLM.from_pretrained`` (no network)."""
    import transformers

    p = Path(path)
    fix = "pass a complete local Hugging Face model directory (config.json and its weights)"
    if not (p / "config.json").is_file():
        raise ConfigError(f"{p} is not a checkpoint directory (no config.json); pass a local Hugging Face model dir")
    if not isinstance(read_json(p / "config.json", "--model config", fix, ConfigError), dict):
        raise ConfigError(f"--model config {p / 'config.json'} is not a JSON object; {fix}")
    if not any((p / name).is_file() for name in WEIGHT_FILES):
        raise ConfigError(f"--model {p} holds no weights (none of {', '.join(WEIGHT_FILES)}); {fix}")
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise ConfigError(f"--model {p} cannot be loaded by transformers ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:300] if str(exc) else ''}); {fix}") from None
    return model.to(device).eval()


def _text_config(model: torch.nn.Module):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _config_json(model: torch.nn.Module) -> dict:
    cfg = _text_config(model)
    out = {}
    for f in CONFIG_FIELDS:
        v = getattr(cfg, f, None)
        if v is None:
            continue
        if isinstance(v, torch.dtype):
            v = str(v).removeprefix("torch.")
        if isinstance(v, (str, int, float, bool)) or (isinstance(v, list) and all(isinstance(i, (str, int)) for i in v)):
            out[f] = v
    return out


def _special_ids(model: torch.nn.Module) -> set[int]:
    ids: set[int] = set()
    for cfg in {id(c): c for c in (model.config, _text_config(model))}.values():
        for k, v in cfg.to_dict().items():
            if k.endswith("_token_id") or k.endswith("_token_ids"):
                for i in (v if isinstance(v, list) else [v]):
                    if isinstance(i, int):
                        ids.add(i)
    return ids


def random_prompt(model: torch.nn.Module, prompt_len: int, sequences: int, seed: int) -> torch.Tensor:
    """[sequences, prompt_len] token ids drawn uniformly from the vocabulary minus special ids."""
    vocab = int(_text_config(model).vocab_size)
    allowed = np.setdiff1d(np.arange(vocab), np.fromiter(_special_ids(model), dtype=np.int64))
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, 0xCA97])
    return torch.from_numpy(rng.choice(allowed, size=(sequences, prompt_len)).astype(np.int64))


def _source(model: torch.nn.Module) -> str:
    nop = str(getattr(model.config, "name_or_path", "") or "")
    if nop.startswith("drift-tiny-"):
        return "tiny"
    if nop and Path(nop).is_dir():
        return str(Path(nop).resolve())
    return nop or "unknown"


def _run_dtype(model: torch.nn.Module, layers) -> str:
    m = layers[0][1]
    w = (m.in_proj_qkvz if gdn_layout(m) == "qwen3_next" else m.in_proj_qkv).weight
    if w.dtype not in RUN_DTYPES:
        raise ConfigError(f"the model runs in {w.dtype}; a drift trace holds bfloat16 or float32 inputs: "
                          "load it with dtype=torch.bfloat16 or torch.float32")
    return RUN_DTYPES[w.dtype]


# --------------------------------------------------------------------------- capture
@torch.no_grad()
def capture(model: torch.nn.Module, tokens: int = 32, prompt_len: int = 8, sequences: int = 1, seed: int = 0, *,
            name: str | None = None, source: str | None = None,
            prompt_ids: torch.Tensor | None = None) -> dict[str, Any]:
    """Greedy-decode ``tokens`` tokens after a random ``prompt_len`` prompt for ``sequences``
    sequences and return the trace's contents: ``x`` [R, T, L, C], ``a``/``b`` [R, T, L, HV]
    (tensors in the run dtype, T = prompt_len + tokens), float32 ``A_log``, ``dt_bias``
    [L, HV], ``conv_weight`` [L, C, Kc], ``conv_bias`` [L, C], ``dtype``, ``model`` (manifest
    block), ``layers``, ``num_k_heads``, ``head_k_dim``, ``head_v_dim``,
    ``bytes_per_token_per_layer``, ``versions_extra`` and ``token_ids`` [R, T + 1] (prompt and
    generated ids). Keys accepted by :func:`drift.sim.tracefile.write_trace` go straight to it.
    ``source`` defaults to the checkpoint directory the model was loaded from, or ``"tiny"``
    for :func:`build_tiny_model`'s models.
    """
    import transformers

    if tokens < 0 or prompt_len < 1 or sequences < 1:
        raise ConfigError(f"tokens={tokens}, prompt_len={prompt_len}, sequences={sequences}: need tokens >= 0, "
                          "prompt_len >= 1 and sequences >= 1")
    layers = find_gdn_layers(model)
    dtype = _run_dtype(model, layers)
    device = next(model.parameters()).device
    ids = random_prompt(model, prompt_len, sequences, seed) if prompt_ids is None else prompt_ids.to(torch.long)
    if tuple(ids.shape) != (sequences, prompt_len):
        raise ConfigError(f"prompt_ids has shape {tuple(ids.shape)}, expected ({sequences}, {prompt_len})")
    ids = ids.to(device)
    tcfg = _text_config(model)
    gen = transformers.GenerationConfig(max_new_tokens=tokens + 1, min_new_tokens=tokens + 1, do_sample=False,
                                        num_beams=1, use_cache=True,
                                        pad_token_id=tcfg.pad_token_id if tcfg.pad_token_id is not None else 0,
                                        eos_token_id=tcfg.eos_token_id)
    with GDNInputRecorder(model) as rec:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    arrays = rec.arrays()
    T = prompt_len + tokens
    if arrays["x"].shape[:2] != (sequences, T):
        raise RuntimeError(f"recorded {tuple(arrays['x'].shape[:2])} (sequences, tokens), expected {(sequences, T)}: "
                           "generate stopped early or ran extra forwards")
    params = [gdn_params(m) for _, m in layers]
    d = rec.dims
    model_block = {"name": name or getattr(model.config, "name_or_path", None) or type(model).__name__,
                   "source": str(source) if source is not None else _source(model), "config": _config_json(model), "class": type(model).__name__,
                   "gdn_class": type(layers[0][1]).__name__, "layout": rec.layouts[0],
                   "prompt_tokens": prompt_len, "decoded_tokens": tokens, "seed": seed, "decode": "greedy"}
    return {**arrays, **{k: torch.stack([p[k] for p in params]) for k in params[0]},
            "dtype": dtype, "model": model_block, "layers": [i for i, _ in layers],
            "num_k_heads": d["num_k_heads"], "head_k_dim": d["head_k_dim"], "head_v_dim": d["head_v_dim"],
            "bytes_per_token_per_layer": bytes_per_token_per_layer(d["conv_channels"], d["num_v_heads"], dtype),
            "versions_extra": {"transformers": transformers.__version__}, "token_ids": out.to("cpu")}


WRITE_KEYS = ("x", "a", "b", "A_log", "dt_bias", "conv_weight", "conv_bias", "dtype", "model", "layers",
              "versions_extra", "num_k_heads", "head_k_dim", "head_v_dim")


def capture_to_file(model: torch.nn.Module, out_path: str | os.PathLike, tokens: int = 32, prompt_len: int = 8,
                    sequences: int = 1, seed: int = 0, **kw: Any) -> Path:
    """:func:`capture` then :func:`drift.sim.tracefile.write_trace`; returns the npz path."""
    c = capture(model, tokens=tokens, prompt_len=prompt_len, sequences=sequences, seed=seed, **kw)
    return write_trace(out_path, **{k: c[k] for k in WRITE_KEYS})


@contextmanager
def record_gdn_internals(model: torch.nn.Module):
    """Record what the model's own GDN code hands its delta-rule kernels, per layer: the
    post-conv+SiLU q [B, S, HK, K], k, v [B, S, HV, V], g and beta [B, S, HV], one entry per
    forward (prefill, then each decode step). Yields ``{layer_idx: [dict, ...]}``.

    It wraps the modeling module's ``torch_chunk_gated_delta_rule`` and
    ``torch_recurrent_gated_delta_rule`` (module globals the GDN ``forward`` looks up at call
    time; transformers 5.24.0) -- an independent view of the model's computation, used to
    validate captures (tests/capture/test_capture.py).
    """
    layers = find_gdn_layers(model)
    current: list[int] = [-1]
    seen: dict[int, list[dict[str, torch.Tensor]]] = {i: [] for i, _ in layers}
    mods = {sys.modules[type(m).__module__] for _, m in layers}
    names = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
    saved = [(mod, n, getattr(mod, n)) for mod in mods for n in names]

    def wrap(fn):
        def inner(query, key, value, *args, **kwargs):
            seen[current[0]].append({"q": query.detach().clone(), "k": key.detach().clone(),
                                     "v": value.detach().clone(), "g": kwargs["g"].detach().clone(),
                                     "beta": kwargs["beta"].detach().clone()})
            return fn(query, key, value, *args, **kwargs)
        return inner

    handles = [m.register_forward_pre_hook(lambda _m, _a, i=i: current.__setitem__(0, i)) for i, m in layers]
    for mod, n, fn in saved:
        setattr(mod, n, wrap(fn))
    try:
        yield seen
    finally:
        for mod, n, fn in saved:
            setattr(mod, n, fn)
        for h in handles:
            h.remove()
