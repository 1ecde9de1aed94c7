"""``drift trace-stats``: per layer and head decay, beta, key rank and value scale of a trace, next
to the synthetic presets', as a table, JSON and one PNG.

The statistics are checked on a hand-made trace whose answers are known in closed form, on the
presets (whose streams are built to hit configured decays, beta offsets and key ranks), and on a
captured tiny model through the command line.
"""

from __future__ import annotations

import contextlib
import io
import json
import math

import numpy as np
import pytest

from drift.cli import main
from drift.config import preset
from drift.errors import EXIT_PASS, EXIT_USAGE
from drift.jobs.trace_stats import config_stats, trace_stats
from drift.sim.tracefile import read_trace, write_trace

R, T, L, HK, HV, K, V, KC = 2, 48, 2, 1, 2, 8, 4, 3
C = 2 * HK * K + HV * V
PRESET_TOKENS = 128  # enough tokens for the preset statistics below, fast


def cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def silu(z: float) -> float:
    return z / (1.0 + math.exp(-z))


def crafted(tmp_path, key_dirs: int = 4, a_val: float = 0.5, A_log: float = -1.0, dt_bias: float = 0.25,
            b_val: float = 1.5, v_val: float = 2.0, name: str = "crafted"):
    """A float32 trace with closed-form statistics: the conv passes each token through (tap Kc-1
    is 1, the others 0), keys are one-hot cycling over ``key_dirs`` coordinates (x = 4 there, so
    the post-SiLU key is SiLU(4) there and 0 elsewhere), every v channel is ``v_val``, a and b
    are constant."""
    x = np.zeros((R, T, L, C), np.float32)
    for t in range(T):
        x[:, t, :, HK * K + t % key_dirs] = 4.0  # key head 0, coordinate t mod key_dirs
    x[..., 2 * HK * K:] = v_val
    x[..., :HK * K] = 1.0  # queries (not measured)
    w = np.zeros((L, C, KC), np.float32)
    w[..., KC - 1] = 1.0
    a = np.full((R, T, L, HV), a_val, np.float32)
    b = np.full((R, T, L, HV), b_val, np.float32)
    p = write_trace(tmp_path / f"{name}.npz", x=x, a=a, b=b, A_log=np.full((L, HV), A_log, np.float32),
                    dt_bias=np.full((L, HV), dt_bias, np.float32), conv_weight=w, conv_bias=np.zeros((L, C), np.float32),
                    dtype="float32", model={"name": name, "source": "test", "config": {}}, layers=[0, 2],
                    num_k_heads=HK, head_k_dim=K, head_v_dim=V)
    return p


def test_statistics_of_a_crafted_trace_are_the_closed_forms(tmp_path):
    p = crafted(tmp_path)
    st = trace_stats(read_trace(p))
    assert len(st["heads"]) == L * HV
    # All inputs are exact float32, every statistic is float64 arithmetic on them: agreement to a
    # few float64 ulps of each quantity (1e-12 relative is ~5000 ulps of slack).
    decay = math.exp(-math.exp(-1.0) * math.log1p(math.exp(0.5 + 0.25)))
    beta = 1.0 / (1.0 + math.exp(-1.5))
    for h in st["heads"]:
        assert h["decay_median"] == pytest.approx(decay, rel=1e-12)
        assert h["decay_p25"] == pytest.approx(decay, rel=1e-12) and h["decay_p75"] == pytest.approx(decay, rel=1e-12)
        assert h["beta_median"] == pytest.approx(beta, rel=1e-12)
        # One-hot keys cycling over 4 coordinates, 48 tokens each = 12 per coordinate: the key
        # Gram matrix is 12 * I_4 (the L2 norm of a one-hot vector is 1, up to the 1e-6 eps), so the
        # participation ratio is exactly 4, and 99% of the energy needs all 4 directions.
        assert h["key_rank"] == pytest.approx(4.0, rel=1e-12) and h["key_rank99"] == 4
        assert h["value_rms"] == pytest.approx(silu(2.0), rel=1e-12)
    assert [h["model_layer"] for h in st["heads"]] == [0, 0, 2, 2]
    # Negative controls: one key direction has rank 1; other a and b move decay and beta.
    other = trace_stats(read_trace(crafted(tmp_path, key_dirs=1, a_val=-3.0, b_val=-2.0, name="other")))
    for h in other["heads"]:
        assert h["key_rank"] == pytest.approx(1.0, rel=1e-12) and h["key_rank99"] == 1
        assert h["decay_median"] > decay and h["beta_median"] < beta


def test_regimes(tmp_path):
    fast = trace_stats(read_trace(crafted(tmp_path)))["regime"]
    assert fast["fast"] == L * HV and "fast-head regime" in fast["text"]
    # decay exp(-exp(-9) softplus(0.75)) = 0.99985 per token, beta = sigmoid(-9) = 1.2e-4: stagnation.
    stag = trace_stats(read_trace(crafted(tmp_path, A_log=-9.0, b_val=-9.0, name="stag")))["regime"]
    assert stag["stagnating"] == L * HV and "stagnation preset" in stag["text"]
    slow = trace_stats(read_trace(crafted(tmp_path, A_log=-4.0, name="slow")))["regime"]  # 0.98 per token
    assert slow["slow"] == L * HV and "slow" in slow["text"]


def test_preset_statistics_match_what_the_presets_are_built_to_be():
    """The presets' streams measured the same way reproduce their configuration: median decays
    (the stream sets A_log so a = 0 hits them; a's jitter is symmetric around 0 so the median
    softplus is ln 2, and the per-layer A_log spread is 0.05 sigma: log(-log decay) within 0.2,
    four sigma), beta = sigmoid(U(-sqrt3, sqrt3) + beta_bias) has median sigmoid(beta_bias)
    (sampling: within 0.1 of 0.5 for the bias-free presets, a factor 2 for stagnation's 4.5e-5),
    and stagnation's keys lie in 4 coordinates (rank at most 4) while ci-small's span many."""
    for name in ("ci-small", "stagnation"):
        cfg = preset(name).replace(num_layers=2)
        st = config_stats(cfg, PRESET_TOKENS)
        for h, want in zip(st["heads"], cfg.decays):
            assert abs(math.log(-math.log(h["decay_median"])) - math.log(-math.log(want))) < 0.2, (name, h, want)
            want_beta = 1.0 / (1.0 + math.exp(-cfg.beta_bias))
            if cfg.beta_bias == 0:
                assert abs(h["beta_median"] - want_beta) < 0.1
            else:
                assert want_beta / 2 < h["beta_median"] < 2 * want_beta
            if cfg.key_rank:
                assert h["key_rank"] <= cfg.key_rank + 1e-9 and h["key_rank99"] <= cfg.key_rank
            else:
                assert h["key_rank"] > 8


@pytest.fixture(scope="module")
def tiny_trace(tmp_path_factory):
    pytest.importorskip("transformers", reason="needs transformers>=5 (drift's capture extra)")
    import torch

    from drift.capture.transformers_capture import build_tiny_model, capture_to_file

    model = build_tiny_model("qwen3_next", dtype=torch.bfloat16)
    return capture_to_file(model, tmp_path_factory.mktemp("tiny") / "t.npz", tokens=24, prompt_len=8, sequences=2)


def test_cli_prints_every_layer_and_head_next_to_the_presets(tiny_trace):
    rc, out, _ = cli("trace-stats", tiny_trace, "--preset-tokens", PRESET_TOKENS)
    assert rc == EXIT_PASS
    tr = read_trace(tiny_trace)
    for li, model_layer in enumerate(tr.layers):
        rows = [line for line in out.splitlines() if line.startswith(f"trace layer {li} (L{model_layer})")]
        assert [int(r.split()[4]) for r in rows] == list(range(tr.num_v_heads))
    for name in ("ci-small", "qwen3.5-397b-tp16", "stagnation"):
        assert sum(line.startswith(name) for line in out.splitlines()) == preset(name).num_v_heads
    assert "regime:" in out and "participation ratio" in out


def test_cli_json_parses_and_matches_the_library(tiny_trace):
    rc, out, _ = cli("trace-stats", tiny_trace, "--json", "--preset-tokens", PRESET_TOKENS)
    assert rc == EXIT_PASS
    st = json.loads(out)
    tr = read_trace(tiny_trace)
    assert len(st["trace"]["heads"]) == tr.num_layers * tr.num_v_heads
    assert st["trace"]["heads"] == json.loads(json.dumps(trace_stats(tr)["heads"]))
    assert set(st["presets"]) == {"ci-small", "qwen3.5-397b-tp16", "stagnation"}
    assert st["trace"]["bytes_per_token_per_layer"] == 528 and "key_rank" in st["trace"]["definitions"]


def test_cli_plot_writes_a_real_png(tiny_trace, tmp_path):
    import matplotlib.image as mpimg

    png = tmp_path / "plots" / "stats.png"
    rc, out, _ = cli("trace-stats", tiny_trace, "--plot", png, "--preset-tokens", PRESET_TOKENS)
    assert rc == EXIT_PASS and f"wrote {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(png)[..., :3]
    ink = (img < 0.9).any(-1).mean()  # share of pixels that are not (near) white
    colors = len(np.unique((img * 255).astype(np.uint8).reshape(-1, 3), axis=0))
    assert 0.02 < ink < 0.9 and colors > 20, (ink, colors)  # axes, points and text; not blank, not solid


def test_cli_rejects_an_unwritable_plot_before_work(tiny_trace, capsys):
    assert main(["trace-stats", str(tiny_trace), "--plot", "/proc/drift-no/x.png"]) == EXIT_USAGE
    assert "cannot write there" in capsys.readouterr().err
