"""drift.config: every invalid field raises ConfigError naming the field and what is
allowed; the presets have their documented shapes."""

from __future__ import annotations

import re

import math

import pytest

from drift.config import PRESETS, PROFILES, Config, Profile, find_profile, preset

from drift.flows.registry import FLOWS, check
from drift.jobs.nightly import FP32_PROFILE
from drift.plug.mutants import MUTANTS
from drift.layouts import LAYOUTS
from drift.errors import ConfigError

BASE = preset("ci-small")

# (field changes, words the message must contain besides the field name and "allowed").
INVALID = [
    *[({f: 0}, ">= 1") for f in ("num_layers", "num_requests", "num_k_heads", "num_v_heads",
                                "head_k_dim", "head_v_dim", "num_draft_tokens", "steps")],
    ({"num_layers": -3}, ">= 1"),
    ({"num_layers": 1.5}, "integer"),
    ({"num_layers": True}, "integer"),  # a bool is not a size
    ({"steps": "100"}, "integer"),
    ({"conv_kernel": 1}, ">= 2"),
    *[({f: -1}, ">= 0") for f in ("num_padded", "track_interval", "key_rank", "spare_slots", "seed")],
    ({"seed": 2**32}, "[0, 4294967295]"),  # would alias seed 0 (32-bit generator keys)
    ({"prefill_len": 2}, ">= 3"),  # needs at least conv_kernel - 1 prompt tokens
    ({"num_k_heads": 4, "num_v_heads": 6, "decays": (0.5,) * 6}, "multiple"),
    ({"key_rank": 65}, "0 (full rank) .. 64"),
    ({"ssm_dtype": "float64"}, "bfloat16, float16, float32"),
    ({"conv_dtype": "int8"}, "bfloat16, float16, float32"),
    ({"store_rounding": "nearest"}, "rne, stochastic, truncate"),
    ({"ssm_dtype": "float32", "store_rounding": "truncate"}, "'rne'"),
    ({"layout": "nhwc"}, ", ".join(LAYOUTS)),
    ({"pattern": "all-2"}, "model, all-1, all-D, mixed"),
    ({"device": "tpu"}, "cpu, cuda, npu"),
    ({"acceptance": (0.8, 0.4)}, "num_draft_tokens - 1 = 3"),
    ({"acceptance": (0.5, 0.6, 0.1)}, "non-increasing"),
    ({"acceptance": (1.2, 0.5, 0.1)}, "[0, 1]"),
    ({"acceptance": (math.nan, 0.5, 0.1)}, "[0, 1]"),
    ({"decays": (0.5, 0.9)}, "one per value head"),
    ({"decays": (0.5, 0.9, 0.98, 1.0)}, "(0, 1)"),
    ({"decays": (0.0, 0.9, 0.98, 0.99)}, "(0, 1)"),
    ({"decays": (math.nan, 0.9, 0.98, 0.99)}, "(0, 1)"),
    ({"beta_bias": math.nan}, "finite"),
    ({"beta_bias": math.inf}, "finite"),
    ({"beta_bias": "0.5"}, "finite number"),
]


def _field(changes: dict) -> str:
    """The field the message must name: the one whose value is bad (last key changed,
    except where a companion field is only changed to keep the others consistent)."""
    if "store_rounding" in changes:
        return "store_rounding"
    if "num_v_heads" in changes:
        return "num_v_heads"
    return next(iter(changes))


@pytest.mark.parametrize("changes, allowed", INVALID, ids=[repr(c) for c, _ in INVALID])
def test_invalid_field_raises_config_error_naming_it(changes, allowed):
    with pytest.raises(ConfigError) as exc:
        BASE.replace(**changes)
    msg = str(exc.value)
    assert _field(changes) in msg and "allowed" in msg and allowed in msg, msg
    # The same through the constructor (not only replace) and through preset().
    with pytest.raises(ConfigError):
        Config(**{**BASE.to_dict(), **changes})
    with pytest.raises(ConfigError):
        preset("ci-small", **changes)


@pytest.mark.parametrize("changes", [
    {"num_draft_tokens": 2, "acceptance": (0.5,)},
    {"num_draft_tokens": 1, "acceptance": ()},
    {"num_padded": 0, "track_interval": 0, "key_rank": 0, "spare_slots": 0, "seed": 0},
    {"conv_kernel": 2, "prefill_len": 1},
    {"num_k_heads": 2, "num_v_heads": 4},
    {"ssm_dtype": "float16", "conv_dtype": "float32", "layout": "contiguous"},
    {"store_rounding": "stochastic"},
    {"acceptance": (1.0, 1.0, 0.0), "beta_bias": -2.5},
])
def test_valid_edge_values_are_accepted(changes):
    """Positive controls: the boundaries of what is allowed construct fine."""
    cfg = BASE.replace(**changes)
    for k, v in changes.items():
        assert getattr(cfg, k) == v


def test_unknown_preset_and_profile_list_the_choices():
    with pytest.raises(ConfigError, match=re.escape(f"preset='nope' is not known; allowed: {', '.join(PRESETS)}")):
        preset("nope")
    with pytest.raises(ConfigError, match=re.escape(f"profile 'tpu' is not known; allowed: {', '.join(PROFILES)}")):
        BASE.with_profile("tpu")


def test_profiles_set_the_state_store():
    """Each profile names what it models (docs/semantics.md §4); the default is SGLang 0.5.23's
    Ascend deployment."""
    got = {name: BASE.with_profile(name) for name in PROFILES}
    assert all(PROFILES[name].models for name in got)  # each says what it models
    assert (got["ascend"].ssm_dtype, got["ascend"].conv_dtype, got["ascend"].layout) == ("bfloat16", "bfloat16", "contiguous")
    assert got["ascend-transposed"].layout == "transposed" and got["ascend-mixed"].layout == "state-transposed"
    assert (got["fp32"].ssm_dtype, got["fp32"].layout) == ("float32", "contiguous")
    assert all(c.profile == name for name, c in got.items())
    assert BASE.profile == "ascend" and BASE.replace(ssm_dtype="float16").profile == "custom"
    assert got["ascend"].unit_roundoff == 2.0 ** -8 and got["fp32"].unit_roundoff == 2.0 ** -24


def test_code_that_needs_a_kind_of_profile_finds_it_by_its_properties():
    """find_profile: the first profile in registry order whose entry and layout pass the test, so
    a renamed profile keeps serving (the mutant catalogue's layout-bound entries, nightly's fp32
    variant); when none passes, an error says what was sought."""
    fp32 = find_profile("fp32 states", lambda p, lay: p.ssm_dtype == "float32")
    assert PROFILES[fp32].ssm_dtype == "float32"
    assert all(PROFILES[n].ssm_dtype != "float32" for n in PROFILES.names()[:PROFILES.names().index(fp32)])
    with PROFILES.temporary("zz-renamed", Profile("zz-renamed", "bfloat16", "bfloat16", "scratch-transposed", "")):
        assert find_profile("a transposed scratch only", lambda p, lay: lay.scratch_kv_storage
                            and not lay.state_kv_storage) == "zz-renamed"
    with pytest.raises(ConfigError, match="no registered profile has an fp8 state"):
        find_profile("an fp8 state", lambda p, lay: p.ssm_dtype == "float8")
    # The catalogue's layout-bound mutants run where their bug shows.
    rollback = LAYOUTS[PROFILES[MUTANTS["rollback_contiguous"].config["profile"]].layout]
    reshape = LAYOUTS[PROFILES[MUTANTS["reshape_commit"].config["profile"]].layout]
    mixed = LAYOUTS[PROFILES[MUTANTS["logical_commit"].config["profile"]].layout]
    assert rollback.conv_channel_major and reshape.state_kv_storage
    assert mixed.state_kv_storage != mixed.scratch_kv_storage
    assert PROFILES[FP32_PROFILE].ssm_dtype == "float32" and LAYOUTS[PROFILES[FP32_PROFILE].layout].dense


@pytest.mark.parametrize("field, value, words", [("graph_mode", 1, "graph_mode=1 is invalid"),
                                                 ("layout", "npu", "layout='npu' is not known")])
def test_graph_mode_and_layout_are_checked(field, value, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        BASE.replace(**{field: value})


def test_the_flow_is_checked_by_the_flow_registry():
    """A Config names its flow; the registry above it (drift.flows.registry.check) knows the flows."""
    cfg = BASE.replace(flow="real")  # the config module cannot know the flows registered above it
    with pytest.raises(ConfigError, match=re.escape("flow 'real' is not known; allowed: " + ", ".join(FLOWS))):
        check(cfg)
    assert check(BASE).name == FLOWS[BASE.flow].kind


def test_ci_small_meets_the_issue():
    c = PRESETS["ci-small"]
    assert c.num_requests >= 4 and c.num_padded >= 1
    assert c.num_v_heads >= 4 and min(c.decays) <= 0.6 and max(c.decays) >= 0.99  # fast .. very slow
    assert c.num_layers >= 2 and c.head_k_dim == c.head_v_dim >= 64
    assert c.num_draft_tokens == 4 and c.conv_kernel == 4 and c.steps >= 4096
    # Tracking fires many times: each row advances >= 1 token per step.
    assert 0 < c.track_interval and c.steps // c.track_interval >= 100


def test_qwen_preset_has_the_real_per_rank_shapes():
    c = PRESETS["qwen3.5-397b-tp16"]
    assert (c.num_layers, c.num_k_heads, c.num_v_heads, c.head_k_dim, c.head_v_dim) == (45, 1, 4, 128, 128)
    assert c.conv_channels == 768 and c.num_draft_tokens == 4 and c.conv_kernel == 4


def test_stagnation_preset_is_adversarial():
    c = PRESETS["stagnation"]
    assert all(0.998 <= d < 1 for d in c.decays)  # above bf16's stagnation threshold (docs/bounds.md)
    assert 0 < c.key_rank <= c.head_k_dim // 8


def test_derived_sizes():
    c = BASE
    assert c.num_rows == c.num_requests + c.num_padded
    assert c.conv_window == (c.conv_kernel - 1) + (c.num_draft_tokens - 1)
    assert c.conv_channels == 2 * c.num_k_heads * c.head_k_dim + c.num_v_heads * c.head_v_dim
    assert c.num_slots == 1 + 2 * c.num_requests + c.spare_slots


def test_stream_hash_covers_the_trajectory_only():
    """One golden serves every store profile, device, horizon and acceptance pattern."""
    h = BASE.stream_hash()
    for same in ({"steps": 7}, {"pattern": "all-1"}, {"acceptance": (0.9, 0.1, 0.0)},
                 {"ssm_dtype": "float32"}, {"store_rounding": "stochastic"}, {"layout": "contiguous"}):
        assert BASE.replace(**same).stream_hash() == h, same
    for other in ({"seed": 1}, {"decays": (0.5, 0.9, 0.98, 0.99)}, {"key_rank": 4}, {"prefill_len": 25},
                  {"beta_bias": 0.5}, {"num_layers": 3}):
        assert BASE.replace(**other).stream_hash() != h, other


def test_to_dict_round_trips():
    d = BASE.to_dict()
    assert Config(**{**d, "acceptance": tuple(d["acceptance"]), "decays": tuple(d["decays"])}) == BASE
