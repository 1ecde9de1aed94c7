"""``drift trace-stats``: what a captured trace's GDN heads look like next to the synthetic presets.

Per GDN layer and value head, over every token of every sequence (prompt included):

* **decay per token** ``exp(g)``, ``g = -exp(A_log) * softplus(a + dt_bias)``: quartiles (p25,
  median, p75). It sets how many tokens a state remembers (about ``1 / (1 - decay)``) and so how
  many store roundings pile up in it.
* **beta** ``sigmoid(b)``: median. The fraction of the prediction error written per token; tiny
  writes under slow decay are where bf16 round-to-nearest stagnates.
* **key rank**: the participation ratio ``(sum s_i^2)^2 / sum s_i^4`` of the singular values
  ``s_i`` of the matrix of L2-normalised keys (one row per token; the keys the recurrence sees:
  the conv + SiLU output of the key head serving this value head, normalised as the op does,
  ``k / sqrt(sum k^2 + 1e-6)``). It is ``r`` for keys spread evenly over ``r`` orthogonal
  directions and 1 when every key points the same way; keys confined to few directions leave the
  rest of the state to decay untouched (the stagnation preset's rank-4 keys). ``key_rank99`` in the
  JSON is the number of singular directions holding 99% of the keys' energy.
* **value scale**: the RMS of the value vector the recurrence writes, ``v`` of the conv + SiLU
  output (the op's ``mix_qkv``), over tokens and the head's V channels. The state grows to about
  this scale (per row) when beta and the decay let it.

The conv here is a float64 depthwise causal conv from an empty window at each sequence's first
token, with the trace's weights and bias (what the model computes, without the bf16 rounding of
its output; these are descriptive statistics, not the replay).

The synthetic presets are measured the same way from their own streams (:mod:`drift.sim.stream`:
:class:`TrueTokens` and :class:`StreamParams`, ``tokens`` positions of every request of a copy of
the preset with at most :data:`PRESET_LAYERS` layers -- the presets draw every layer's constants
from one distribution, so more layers add samples, not regimes), each value head pooled over
those layers.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..config import Config, preset
from ..fileio import check_memory, save_figure
from ..sim.stream import StreamParams, TrueTokens
from ..sim.tracefile import Trace

PRESET_LAYERS = 2
DEFAULT_PRESETS = ("ci-small", "qwen3.5-397b-tp16", "stagnation")  # the regimes compared (not every shape)
L2_EPS = 1e-6  # the op's EPSILON_FOR_STABILITY (docs/semantics.md §5)
# Regimes by median per-token decay (docs/traces.md): which presets' heads live there.
FAST, STAGNATING = 0.9, 0.999
STAGNATING_BETA = 0.01

DEFINITIONS = {
    "decay": "exp(g), g = -exp(A_log) * softplus(a + dt_bias), per token; quartiles over sequences and tokens",
    "beta": "sigmoid(b), median over sequences and tokens",
    "key_rank": "participation ratio (sum s^2)^2 / sum s^4 of the singular values of the L2-normalised "
                "post-conv+SiLU keys (one row per token) of the key head serving the value head",
    "key_rank99": "number of singular directions holding 99% of those keys' energy",
    "value_rms": "RMS of the value head's post-conv+SiLU v (the op's mix_qkv) over tokens and channels",
}


# ----------------------------------------------------------------------------- numerics
def _conv_silu(x: np.ndarray, w: np.ndarray, bias: Optional[np.ndarray]) -> np.ndarray:
    """Depthwise causal conv + SiLU in float64 from an empty window: x ``[R, T, C]``, w ``[C, Kc]``
    (tap m multiplies token t-(Kc-1)+m), bias ``[C]`` or None -> ``[R, T, C]``."""
    R, T, C = x.shape
    Kc = w.shape[1]
    pad = np.concatenate([np.zeros((R, Kc - 1, C)), x.astype(np.float64)], axis=1)
    acc = np.zeros((R, T, C)) if bias is None else np.broadcast_to(bias.astype(np.float64), (R, T, C)).copy()
    for m in range(Kc):
        acc += pad[:, m:m + T, :] * w[:, m].astype(np.float64)
    return acc / (1.0 + np.exp(-acc))


def _key_ranks(keys: np.ndarray) -> tuple[float, int]:
    """(participation ratio, 99%-energy rank) of the rows of ``keys [N, K]`` after L2 norm."""
    k = keys / np.sqrt((keys * keys).sum(-1, keepdims=True) + L2_EPS)
    lam = np.clip(np.linalg.eigvalsh(k.T @ k), 0.0, None)[::-1]  # s_i^2, descending
    total = float(lam.sum())
    if total <= 0.0:
        return 0.0, 0
    pr = total * total / float((lam * lam).sum())
    r99 = int(np.searchsorted(np.cumsum(lam), 0.99 * total) + 1)
    return pr, min(r99, len(lam))


def head_stats(x: np.ndarray, a: np.ndarray, b: np.ndarray, A_log: np.ndarray, dt_bias: np.ndarray,
               conv_weight: np.ndarray, conv_bias: Optional[np.ndarray], HK: int, K: int, HV: int,
               V: int) -> list[dict]:
    """The statistics of one layer's value heads. x ``[R, T, C]``, a, b ``[R, T, HV]``, A_log and
    dt_bias ``[HV]``, conv_weight ``[C, Kc]``, conv_bias ``[C]`` or None."""
    z = a.astype(np.float64) + dt_bias.astype(np.float64)
    g = -np.exp(A_log.astype(np.float64)) * np.logaddexp(0.0, z)  # softplus, no overflow
    decay = np.exp(g).reshape(-1, HV)
    beta = (1.0 / (1.0 + np.exp(-b.astype(np.float64)))).reshape(-1, HV)
    mix = _conv_silu(x, conv_weight, conv_bias)
    R, T, _ = mix.shape
    keys = mix[..., HK * K:2 * HK * K].reshape(R * T, HK, K)
    vals = mix[..., 2 * HK * K:].reshape(R * T, HV, V)
    ranks = [_key_ranks(keys[:, j]) for j in range(HK)]
    group = HV // HK
    out = []
    for h in range(HV):
        p25, p50, p75 = np.quantile(decay[:, h], [0.25, 0.5, 0.75])
        pr, r99 = ranks[h // group]
        out.append({"head": h, "decay_p25": float(p25), "decay_median": float(p50), "decay_p75": float(p75),
                    "beta_median": float(np.median(beta[:, h])), "key_rank": float(pr), "key_rank99": r99,
                    "key_dim": K, "value_rms": float(np.sqrt(np.mean(vals[:, h] ** 2)))})
    return out


def regime(heads: Sequence[dict]) -> dict:
    """Counts of heads per decay regime and the sentence saying which preset regime they are in."""
    fast = sum(h["decay_median"] < FAST for h in heads)
    stag = sum(h["decay_median"] >= STAGNATING and h["beta_median"] < STAGNATING_BETA for h in heads)
    slow = len(heads) - fast - stag
    below = sum(h["decay_median"] < 0.5 for h in heads)
    if stag:
        text = (f"{stag} head(s) decay at least {STAGNATING} per token with beta below {STAGNATING_BETA}: the "
                "stagnation preset's regime, where bf16 round-to-nearest stagnates")
    elif slow:
        text = (f"{slow} head(s) decay between {FAST} and {STAGNATING} per token: the regime of ci-small's slow "
                "heads (0.98, 0.995) and qwen3.5-397b-tp16's (0.99, 0.997), where store roundings accumulate")
    else:
        text = (f"every head decays faster than {FAST} per token ({below} of {len(heads)} faster than ci-small's "
                "fastest head, 0.5): ci-small's fast-head regime, where a state forgets its roundings within a "
                "few tokens; no head reaches the slow or stagnation regimes")
    return {"fast": fast, "slow": slow, "stagnating": stag, "heads": len(heads), "text": text}


# ------------------------------------------------------------------------------- sources
def trace_stats(trace: Trace, max_tokens: Optional[int] = None) -> dict:
    """Per GDN layer and value head statistics of ``trace`` (the first ``max_tokens`` tokens of
    each sequence when given)."""
    m = trace.manifest
    HK, K, HV, V = m["num_k_heads"], m["head_k_dim"], m["num_v_heads"], m["head_v_dim"]
    T = m["tokens"] if max_tokens is None else min(int(max_tokens), m["tokens"])
    # Per layer, float64: the conv's padded input, accumulator and output [R, T, C], and the K x K
    # Gram matrix of each key head (with eigvalsh's copy): refused before anything is allocated.
    check_memory(8 * (3 * m["sequences"] * (T + m["conv_kernel"]) * m["conv_channels"] + 2 * K * K),
                 f"drift trace-stats of {trace.path} (K = {K}, C = {m['conv_channels']}, {T} tokens)")
    heads = []
    for li in range(m["num_layers"]):
        for h in head_stats(trace.x[:, :T, li], trace.a[:, :T, li], trace.b[:, :T, li], trace.A_log[li],
                            trace.dt_bias[li], trace.conv_weight[li], trace.conv_bias[li], HK, K, HV, V):
            heads.append({"layer": li, "model_layer": int(m["layers"][li]), **h})
    return {"file": str(trace.path), "describe": trace.describe(), "model": m["model"]["name"],
            "source": m["model"]["source"], "dtype": m["dtype"], "sequences": m["sequences"], "tokens": T,
            "bytes_per_token_per_layer": m["bytes_per_token_per_layer"], "heads": heads, "regime": regime(heads),
            "definitions": DEFINITIONS}


def config_stats(cfg: Config, tokens: int) -> dict:
    """The same statistics of a synthetic config's own stream: ``tokens`` positions of every
    request, each value head pooled over the config's layers."""
    HK, K, HV, V = cfg.num_k_heads, cfg.head_k_dim, cfg.num_v_heads, cfg.head_v_dim
    tok = TrueTokens(cfg)
    prm = StreamParams.generate(cfg)
    got = [tok.get(r, 0, tokens) for r in range(cfg.num_requests)]
    x, a, b = (np.stack([g[i] for g in got]) for i in range(3))  # [R, T, L, .]
    per_layer = [head_stats(x[:, :, li], a[:, :, li], b[:, :, li], prm.A_log[li].numpy(), prm.dt_bias[li].numpy(),
                            prm.conv_weight[li].numpy(), None, HK, K, HV, V) for li in range(cfg.num_layers)]
    # Pool the layers: the medians of per-layer medians, the rest averaged (layers share one distribution).
    heads = []
    for h in range(HV):
        rows = [pl[h] for pl in per_layer]
        heads.append({"head": h, **{k: float(np.median([r[k] for r in rows])) for k in
                                    ("decay_p25", "decay_median", "decay_p75", "beta_median")},
                      "key_rank": float(np.mean([r["key_rank"] for r in rows])),
                      "key_rank99": int(round(np.mean([r["key_rank99"] for r in rows]))), "key_dim": K,
                      "value_rms": float(np.mean([r["value_rms"] for r in rows]))})
    return {"name": cfg.name, "tokens": tokens, "requests": cfg.num_requests, "layers": cfg.num_layers,
            "configured_decays": list(cfg.decays), "heads": heads, "regime": regime(heads)}


def preset_stats(names: Sequence[str] = DEFAULT_PRESETS, tokens: int = 512) -> dict:
    """:func:`config_stats` of each named preset (at most :data:`PRESET_LAYERS` layers)."""
    out = {}
    for name in names:
        cfg = preset(name)
        cfg = cfg.replace(num_layers=min(cfg.num_layers, PRESET_LAYERS))
        out[name] = config_stats(cfg, tokens)
    return out


# -------------------------------------------------------------------------------- output
def _g(v: float, digits: int = 3) -> str:
    return f"{v:.{digits}g}"


def _row(label: str, h: dict) -> str:
    d = lambda v: _g(v, 4)  # noqa: E731 - decays near 1 (0.9998) need the fourth digit
    return (f"{label:<24} {h['head']:>4}  {d(h['decay_p25']):>9} {d(h['decay_median']):>9} {d(h['decay_p75']):>9}"
            f"  {_g(h['beta_median']):>9}  {h['key_rank']:>6.1f}/{h['key_dim']:<4} {h['key_rank99']:>4}"
            f"  {_g(h['value_rms']):>9}")


def format_stats(stats: dict) -> str:
    tr, presets = stats["trace"], stats["presets"]
    head = (f"{'source':<24} {'head':>4}  {'decay p25':>9} {'median':>9} {'p75':>9}  {'beta med':>9}  "
            f"{'key rank/K':>11} {'r99':>4}  {'value RMS':>9}")
    lines = [tr["describe"], f"statistics over {tr['sequences']} sequence(s) x {tr['tokens']} tokens "
             "(prompt included)", "", head, "-" * len(head)]
    for h in tr["heads"]:
        lines.append(_row(f"trace layer {h['layer']} (L{h['model_layer']})", h))
    lines.append("")
    for name, p in presets.items():
        for h in p["heads"]:
            lines.append(_row(f"{name}", h))
    lines += ["", f"presets: their own streams, {next(iter(presets.values()))['tokens'] if presets else 0} tokens "
              f"x every request, each head pooled over {PRESET_LAYERS} layers",
              "key rank: participation ratio of the singular values of the L2-normalised post-conv keys "
              "(r99: directions holding 99% of their energy); value RMS: of the post-conv+SiLU v",
              "", f"regime: {tr['regime']['text']}"]
    return "\n".join(lines)


def plot_stats(stats: dict, path: Path) -> Path:
    """One PNG: per head, the trace's and each preset's median decay per token (with its
    quartiles; placed by -ln(decay) on a log axis, so 0.999 and 1e-9 both read, and labelled in
    decay as the table is), beta, key rank / K and value RMS."""
    from matplotlib import colormaps

    from .plots import METADATA, new_figure

    groups = [(f"trace L{h['layer']}", h) for h in stats["trace"]["heads"]]
    for name, p in stats["presets"].items():
        groups += [(name, h) for h in p["heads"]]
    sources = list(dict.fromkeys(lbl for lbl, _ in groups))
    colors = {s: colormaps["tab10"](i % 10) for i, s in enumerate(sources)}
    xs = np.arange(len(groups))
    fig = new_figure(figsize=(max(6.0, 0.32 * len(groups) + 2.5), 9.5))
    axes = fig.subplots(4, 1, sharex=True)
    tiny = 1e-300

    def logdec(v: float) -> float:
        return max(-math.log(max(v, tiny)), 1e-12)

    panels = (("decay per token\n(axis: -ln decay)", lambda h: logdec(h["decay_median"]), True),
              ("beta (median)", lambda h: max(h["beta_median"], 1e-12), True),
              ("key rank / K", lambda h: h["key_rank"] / h["key_dim"], False),
              ("value RMS", lambda h: h["value_rms"], True))
    for ax, (title, fn, log) in zip(axes, panels):
        for i, (lbl, h) in enumerate(groups):
            ax.scatter([i], [fn(h)], color=colors[lbl], s=22, label=lbl)
            if title.startswith("decay"):
                lo, hi = logdec(h["decay_p75"]), logdec(h["decay_p25"])
                ax.plot([i, i], [lo, hi], color=colors[lbl], lw=1.2)
        if log:
            ax.set_yscale("log")
        if title.startswith("decay"):  # ticks say the decay itself, as the table does
            from matplotlib.ticker import FuncFormatter

            ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{math.exp(-y):.4g}"))
            ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: ""))
            ax.invert_yaxis()  # slower decay (closer to 1) higher up
        ax.set_ylabel(title, fontsize=8)
        ax.grid(True, which="major", alpha=0.3)
    handles = {lbl: h for h, lbl in zip(*axes[0].get_legend_handles_labels())}
    axes[0].legend(handles.values(), handles.keys(), fontsize=7, ncol=min(4, len(handles)), loc="best")
    axes[-1].set_xticks(xs)
    axes[-1].set_xticklabels([f"{lbl} h{h['head']}" for lbl, h in groups], rotation=90, fontsize=6)
    fig.suptitle(f"{Path(stats['trace']['file']).name} vs the synthetic presets (per value head)", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    save_figure(fig, path, dpi=100, metadata=METADATA)
    return path
