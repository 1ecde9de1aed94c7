"""Deployment shapes: the per-rank presets against the models' published head counts, more than one
key head in every flow, D = 2 and 3, the options that set them, and the head-mapping mutant.

The numbers below are written out again from their sources (not read from drift.config), so a
preset that drifts from them fails:
  Qwen3-Next-80B-A3B: huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct config.json (transformers 5.24.0
    models/qwen3_next/configuration_qwen3_next.py defaults): 48 layers, full_attention_interval 4,
    linear_num_key_heads 16, linear_num_value_heads 32, key / value head dim 128, conv kernel 4.
  Qwen3.5-397B-A17B: the model card (huggingface.co/Qwen/Qwen3.5-397B-A17B, as
    mlx-community/Qwen3.5-397B-A17B-4bit copies it): 60 layers = 15 x (3 GDN + 1 full attention),
    linear attention heads 16 QK / 64 V, head dim 128.
A rank holds heads / TP (SGLang 0.5.23 srt/models/qwen3_next.py, vLLM 0.33.0
layers/mamba/mamba_utils.py: gated_delta_net_state_shape).
"""

from __future__ import annotations

import pytest
import torch

from drift.cli import main
from drift.config import GATE_PRESETS, PRESETS, _deployment, preset
from drift.check.golden import GOLDEN_PRESETS
from drift.errors import EXIT_PASS, EXIT_USAGE, ConfigError
from drift.flows.registry import FLOWS
from drift.plug.mutants import tile_key_heads
from drift.pytest_plugin import gate_presets
from drift.runner import run_checked
from drift.runspec import RunSpec, resolve
from drift.sim import kernels

# model -> (GDN layers, key heads, value heads, head dim): the sources above.
MODELS = {"qwen3-next-80b": (48 - 48 // 4, 16, 32, 128), "qwen3.5-397b": (15 * 3, 16, 64, 128)}


@pytest.mark.parametrize("tp", [1, 4, 16])
@pytest.mark.parametrize("model", list(MODELS))
def test_deployment_preset_is_the_models_rank(model, tp):
    L, HK, HV, K = MODELS[model]
    cfg = preset(f"{model}-tp{tp}")
    assert (cfg.num_layers, cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim, cfg.conv_kernel) \
        == (L, HK // tp, HV // tp, K, K, 4)
    assert cfg.conv_channels == (2 * HK * K + HV * K) // tp  # vLLM's conv_dim, divided by TP
    assert (cfg.num_k_heads > 1) == (tp < HK)  # more than one key head wherever the model has them
    assert len(cfg.decays) == cfg.num_v_heads and cfg.num_draft_tokens == 4


def test_the_existing_397b_tp16_preset_is_the_same_shape():
    """qwen3.5-397b-tp16 predates the table (its figures must not move); it is the table's shape."""
    old, new = PRESETS["qwen3.5-397b-tp16"], _deployment("qwen3.5-397b", 16)
    fields = ("num_layers", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel", "decays")
    assert [getattr(old, f) for f in fields] == [getattr(new, f) for f in fields]


def test_a_tp_above_the_key_heads_is_refused():
    """TP 32 leaves a rank no key head (16 // 32 = 0): neither engine runs it, nor does drift."""
    with pytest.raises(ConfigError, match="num_k_heads=0"):
        _deployment("qwen3-next-80b", 32)


def test_value_heads_read_their_key_head_by_repeating_not_tiling():
    """op_inputs (drift's kernels and the float64 twin) maps value head h to key head h // (HV / HK),
    as HF's torch_chunk_gated_delta_rule (repeat_interleave) and fla's i_hv // (HV // H); tiling
    (h % HK) differs with two key heads and agrees with one."""
    HK, K, HV = 2, 8, 4
    mix = torch.randn(3, 2 * HK * K + HV * K, dtype=torch.float32, generator=torch.Generator().manual_seed(1))
    z = torch.zeros(3, HV)
    q, k, *_ = kernels.op_inputs(mix, z, z, HK, K, HV, K, 1.0)
    k_heads = kernels.l2norm(mix[:, HK * K: 2 * HK * K].reshape(3, HK, K))
    assert torch.equal(k, k_heads.repeat_interleave(HV // HK, dim=1))
    assert not torch.equal(tile_key_heads(k, HK), k)
    q1, k1, *_ = kernels.op_inputs(mix[:, : 2 * K + HV * K], z, z, 1, K, HV, K, 1.0)
    assert torch.equal(tile_key_heads(k1, 1), k1)


@pytest.mark.parametrize("flow", list(FLOWS))
def test_the_gate_shape_passes_in_every_flow(flow):
    """ci-heads (2 key heads, D = 2) in each flow with its built-in update: every check passes, against
    golden data (the generator's own hv // group mapping) where the flow reads it."""
    rep = run_checked(resolve(preset("ci-heads", steps=64, flow=flow), None))
    assert rep.passed, [(c.key, c.detail) for c in rep.checks if c.failed]
    golden = next(c for c in rep.checks if c.key == "golden")
    assert golden.passed and "n/a" not in str(golden.verdict), golden.detail


@pytest.mark.parametrize("flow", list(FLOWS))
def test_four_key_heads_and_three_draft_tokens_pass_in_every_flow(flow):
    cfg = RunSpec(steps=48, flow=flow, key_heads=4, value_heads=8, draft_tokens=3).config()
    assert (cfg.num_k_heads, cfg.num_v_heads, cfg.num_draft_tokens, cfg.acceptance) == (4, 8, 3, (0.85, 0.46))
    rep = run_checked(resolve(cfg, None))
    assert rep.passed, [(c.key, c.detail) for c in rep.checks if c.failed]


# The kernel-commit flow's ring rule keeps no per-token states: a verify-kernel mutant cannot run
# there (its own mapping, pool.py's repeat_interleave, is what the runs above check).
PER_TOKEN_FLOWS = [f for f in FLOWS if f != "sglang-replayssm"]


@pytest.mark.parametrize("flow", PER_TOKEN_FLOWS)
def test_tiled_heads_fail_with_two_key_heads_and_pass_with_one(flow):
    """The held-out head-mapping bug: caught at 2 key heads; at 1 key head the two mappings are the
    same tensor, so it passes there (why every shape had to gain a second key head)."""
    two = run_checked(resolve(preset("ci-small", steps=48, flow=flow, num_k_heads=2), None, "mutant:heads_tiled"))
    assert not two.passed and {"committed_state", "outputs"} <= {c.key for c in two.checks if c.failed}
    one = run_checked(resolve(preset("ci-small", steps=48, flow=flow), None, "mutant:heads_tiled"))
    assert one.passed, [(c.key, c.detail) for c in one.checks if c.failed]


def test_the_gate_runs_a_multi_key_head_shape_at_d2_with_golden_data():
    shapes = {(preset(p).num_k_heads > 1, preset(p).num_draft_tokens) for p in GATE_PRESETS}
    assert (True, 2) in shapes and GATE_PRESETS[0] == "ci-small"
    assert set(GATE_PRESETS) <= set(GOLDEN_PRESETS)
    opts = {"drift_preset": None, "drift_trace": None}
    assert gate_presets(lambda k, d=None: opts.get(k, d)) == GATE_PRESETS
    assert gate_presets(lambda k, d=None: {**opts, "drift_preset": "stagnation"}.get(k, d)) == ("stagnation",)
    assert gate_presets(lambda k, d=None: {**opts, "drift_trace": "t.npz"}.get(k, d)) == ("ci-small",)


def _exit_code(argv) -> int:
    """drift's exit code for ``argv`` (argparse exits 2 on a bad value; drift returns 2 on a bad config)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def test_shape_options_on_the_command_line(capsys):
    assert main(["run", "--steps", "24", "--quiet", "--draft-tokens", "2", "--key-heads", "2"]) == EXIT_PASS
    for bad, why in ((["--draft-tokens", "5"], "allowed: 2 .. 4"), (["--draft-tokens", "1"], "allowed: 2 .. 4"),
                     (["--key-heads", "3"], "not a multiple of --key-heads 3"),
                     (["--value-heads", "0"], "not an integer >= 1")):
        capsys.readouterr()
        assert _exit_code(["run", "--steps", "8", "--quiet", *bad]) == EXIT_USAGE, bad
        err = capsys.readouterr().err
        assert why in err and "Traceback" not in err, err
