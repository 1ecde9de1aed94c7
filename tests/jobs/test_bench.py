"""``drift bench``: report structure and internal consistency, and the naive loop it times.

No timing is asserted: rates depend on the machine and its load.
"""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

from drift.sim import native
from drift.jobs.bench import bench, benchmarked_flows, format_bench, min_bytes_per_step, naive_step
from drift.cli import main
from drift.config import preset
from drift.dtypes import as_bits
from drift.errors import ConfigError
from drift.simulate import Simulation
from drift.runspec import resolve

# A small copy buffer keeps the tests fast; its bandwidth (partly in cache) means nothing here.
SMALL_COPY = 8 << 20
FIELDS = ("preset", "layers", "preset_layers", "device", "verify_kernel", "native_kernel", "torch_threads", "steps", "repeats",
          "naive_steps", "steps_per_s", "naive_steps_per_s", "speedup", "min_bytes_per_step",
          "min_bytes_breakdown", "copy_bandwidth_GBps", "copy_bytes", "effective_bandwidth_GBps",
          "bandwidth_ratio", "naive_bandwidth_ratio", "vectorised", "naive", "bytes_model")
# The report derives every ratio from the same floats; only the GB/s unit conversion
# (x / 1e9 * 1e9) and reassociation can move the last bits.
REL = 1e-12


@pytest.fixture
def small_copies(monkeypatch):
    """The CLI's copy-bandwidth buffer shrunk to SMALL_COPY (the CLI has no option for it)."""
    from drift.jobs import bench as bench_mod

    copies = bench_mod.copy_bandwidths
    monkeypatch.setattr(bench_mod, "copy_bandwidths", lambda dev, nbytes, repeats=2: copies(dev, SMALL_COPY, repeats))


def check_report(res: dict) -> None:
    for name in FIELDS:
        assert name in res, f"report lacks {name!r}"
    for name in ("steps_per_s", "naive_steps_per_s", "speedup", "min_bytes_per_step",
                 "copy_bandwidth_GBps", "effective_bandwidth_GBps", "bandwidth_ratio",
                 "naive_bandwidth_ratio"):
        assert isinstance(res[name], (int, float)) and math.isfinite(res[name]) and res[name] > 0, name
    copy_bps = res["copy_bandwidth_GBps"] * 1e9
    assert math.isclose(res["bandwidth_ratio"], res["steps_per_s"] * res["min_bytes_per_step"] / copy_bps,
                        rel_tol=REL)
    assert math.isclose(res["naive_bandwidth_ratio"],
                        res["naive_steps_per_s"] * res["min_bytes_per_step"] / copy_bps, rel_tol=REL)
    assert math.isclose(res["effective_bandwidth_GBps"],
                        res["steps_per_s"] * res["min_bytes_per_step"] / 1e9, rel_tol=REL)
    assert math.isclose(res["speedup"], res["steps_per_s"] / res["naive_steps_per_s"], rel_tol=REL)
    assert res["min_bytes_per_step"] == sum(res["min_bytes_breakdown"].values())
    assert len(res["steps_per_s_blocks"]) == res["repeats"]
    # Medians over the repeats, with their ranges (the CPU has no captured step).
    blocks = res["steps_per_s_blocks"]
    assert res["steps_per_s"] == statistics.median(blocks)
    assert res["steps_per_s_range"] == [min(blocks), max(blocks)]
    lo, hi = res["copy_bandwidth_GBps_range"]
    assert lo <= res["copy_bandwidth_GBps"] <= hi
    assert lo <= res["copy_bandwidth_GBps_by_threads"][str(res["torch_threads"])] <= hi
    ratio = res["bandwidth_ratio_range"]
    assert math.isclose(ratio[0] / ratio[1], min(blocks) / max(blocks), rel_tol=REL)
    assert ratio[0] <= res["bandwidth_ratio"] <= ratio[1]
    n_lo, n_hi = res["naive_steps_per_s_range"]
    assert n_lo <= res["naive_steps_per_s"] <= n_hi
    v = res["verdict"]
    for name in ("bandwidth_ratio", "speedup"):
        assert math.isclose(v[name]["median"], res[name], rel_tol=REL)
        assert v[name]["range"][0] <= v[name]["median"] <= v[name]["range"][1]
        assert v[name]["target"] == res["targets"][name]
        assert v[name]["met"] == (v[name]["median"] >= v[name]["target"])
    assert v["met"] == (v["bandwidth_ratio"]["met"] and v["speedup"]["met"])
    assert str(res["torch_threads"]) in res["probe_steps_per_s_by_threads"]
    assert json.loads(json.dumps(res)) == res  # JSON-ready as returned


EAGER_STAGES = {"input stream", "conv verify, gating", "verify op", "update", "other"}
CHECKED_STAGES = {"input stream", "conv verify, gating", "verify op", "update", "slot guard", "float64 twin",
                  "metrics and checks"}


def check_profile(prof: dict, stages: set, steps: int) -> None:
    """Every stage of the step, each share its part of the step's time (shares of the same floats:
    REL), the twin's recurrence no more than the observers' time it was taken from."""
    assert set(prof["stages"]) == stages and prof["steps"] == steps
    ms = [s["ms_per_step"] for s in prof["stages"].values()]
    assert all(m >= 0 for m in ms)
    assert math.isclose(sum(ms), prof["ms_per_step"], rel_tol=REL)
    assert math.isclose(sum(s["share"] for s in prof["stages"].values()), 1.0, rel_tol=REL)
    assert ms == sorted(ms, reverse=True)  # largest first: the bottleneck leads
    if "metrics and checks" in prof["stages"]:
        assert prof["stages"]["float64 twin"]["ms_per_step"] > 0
        assert prof["stages"]["metrics and checks"]["ms_per_step"] > 0


def test_report_on_ci_small_is_consistent():
    cfg = preset("ci-small")
    threads = torch.get_num_threads()
    res = bench(cfg, steps=2, naive_steps=1, repeats=2, copy_bytes=SMALL_COPY, stage_steps=2)
    check_report(res)
    check_profile(res["stage_profile"]["eager_step"], EAGER_STAGES, 2)
    check_profile(res["stage_profile"]["checked_step"], CHECKED_STAGES, 2)
    assert torch.get_num_threads() == threads  # restored after probing
    assert res["preset"] == "ci-small" and res["layers"] == res["preset_layers"] == cfg.num_layers
    assert res["min_bytes_per_step"] == min_bytes_per_step(cfg)["total"]
    text = format_bench(res)
    assert f"{res['layers']} of {res['preset_layers']} GDN layers" in text
    assert f"{res['bandwidth_ratio']:.3f} of copy bandwidth" in text
    # What the timed simulation ran: ci-small's bf16 npu-layout states with RNE stores are the
    # native kernel's case; the stochastic-rounding run below needs the torch-op path.
    want = "portable, native C kernel (CPU)" if native.available() else "portable, torch ops"
    assert res["verify_kernel"] == want and res["native_kernel"] == native.status()
    assert f"GDN verify: {want}; native kernel status: {native.status()}" in text
    assert "checked step (" in text and "float64 twin" in text
    sr = bench(cfg.replace(store_rounding="stochastic"), steps=1, naive_steps=1, repeats=1, copy_bytes=SMALL_COPY,
               stage_steps=0)
    assert sr["verify_kernel"] == "portable, torch ops" and sr["stage_profile"] == {}


def test_fewer_layers_of_the_deployment_preset():
    res = bench(preset("qwen3.5-397b-tp16"), layers=1, steps=1, naive_steps=1, repeats=1,
                copy_bytes=SMALL_COPY, threads=1, stage_steps=0)
    check_report(res)
    assert (res["layers"], res["preset_layers"], res["torch_threads"]) == (1, 45, 1)
    assert list(res["probe_steps_per_s_by_threads"]) == ["1"]


def test_min_bytes_counts_each_part_once():
    # ci-small: 4 active requests, 2 layers, 4 value heads, K = V = 64, D = 4, bf16 states
    # and conv, C = 2*64 + 4*64 = 384 channels, conv kernel 4.
    parts = min_bytes_per_step(preset("ci-small"))
    state = 4 * 64 * 64 * 2  # one request's state in one layer
    assert parts["state_read"] == 4 * 2 * state
    assert parts["intermediates_write"] == 4 * 2 * 4 * state
    assert parts["commit_copy"] == 4 * 2 * 2 * state
    assert parts["conv_inputs"] == 4 * 2 * (4 * 384 * 2 + 2 * 3 * 384 * 2)
    assert parts["gating_inputs"] == 4 * 2 * 2 * 4 * 4 * 4
    assert parts["outputs"] == 4 * 2 * 4 * 4 * 64 * 4
    assert parts["params"] == 2 * (384 * 4 + 2 * 4) * 4
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total")
    fp32 = min_bytes_per_step(preset("ci-small").with_profile("fp32"))
    assert fp32["state_read"] == 2 * parts["state_read"]


@pytest.mark.parametrize("field,kwargs", [("steps", {"steps": 0}), ("naive_steps", {"naive_steps": -1}),
                                          ("layers", {"layers": 0}), ("threads", {"threads": 0}),
                                          ("stage_steps", {"stage_steps": -1})])
def test_bad_arguments_name_the_field(field, kwargs):
    with pytest.raises(ConfigError, match=f"bench {field}="):
        bench(preset("ci-small"), **kwargs)


def test_cli_json_and_usage_error(capsys, small_copies):
    rc = main(["bench", "--preset", "ci-small", "--flow", "sglang", "--bench-steps", "1", "--naive-steps", "1",
               "--repeats", "1", "--threads", "1", "--stage-steps", "0", "--json"])
    assert rc == 0
    check_report(json.loads(capsys.readouterr().out))
    with pytest.raises(SystemExit) as exc:  # rejected by the parser: exit 2 before any work
        main(["bench", "--preset", "ci-small", "--bench-steps", "0"])
    assert exc.value.code == 2


@pytest.mark.parametrize("argv,says", [(["--flow", "nosuch"], "flow 'nosuch' is not benchmarked; allowed: sglang"),
                                       (["--drafts", "ragged"], "unrecognized arguments: --drafts")])
def test_bench_offers_only_what_it_times(capsys, argv, says):
    """drift bench lists only the flows it has a naive step for and no --drafts: the parser refuses
    the others with exit 2 (the control: the benchmarked flow parses, in test_cli_json_and_usage_error)."""
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--preset", "ci-small", *argv])
    assert exc.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize("scale,verdict", [(1e-12, "targets met"), (1e12, "below target")])
def test_gate_exits_on_the_median_verdict(monkeypatch, capsys, small_copies, scale, verdict):
    """--gate: exit 1 exactly when a median misses its target. Targets scaled out of reach of any
    machine (x 1e12) and into reach of every one (x 1e-12): the exit code and the verdict line
    follow, whatever this machine's speed (a negative and a positive control)."""
    from drift.jobs import bench as bench_mod

    for name, value in dict(bench_mod.TARGETS).items():
        monkeypatch.setitem(bench_mod.TARGETS, name, value * scale)
    args = ["bench", "--preset", "ci-small", "--bench-steps", "1", "--naive-steps", "1", "--repeats", "3",
            "--threads", "1", "--stage-steps", "0"]
    assert main([*args, "--gate"]) == (0 if verdict == "targets met" else 1)
    assert f"verdict     {verdict}" in capsys.readouterr().out
    if verdict != "targets met":
        assert main(args) == 0  # reported, not gated


class _Outputs:
    """Observer keeping the last step's outputs and tracked steps."""

    def on_start(self, sim):
        pass

    def on_step(self, view):
        self.out, self.track = view.out.clone(), view.track.copy()

    def flush(self):
        pass

    def on_end(self):
        pass


def _naive_against_vectorised(flow: str) -> list[str]:
    """From identical pools, one vectorised and one naive step (a step where rows cross a track
    boundary); what differs beyond the bounds below, as lines (none: the naive step did the step)."""
    cfg = preset("ci-small", flow=flow)
    obs = _Outputs()
    vec = Simulation(resolve(cfg), observers=[obs], check_untouched=False)
    nai = Simulation(resolve(cfg), check_untouched=False)
    vec.run(steps=1)
    nai.run(steps=1)  # both at step 1, where rows 1 and 2 cross a track boundary
    vec.run(steps=1)
    out = naive_step(nai, nai.stream.chunk(1), 0)
    assert (obs.track >= 0).any(), "the compared step must exercise the tracking path"
    bad = []
    # Conv windows, rollback and tracked conv copies are pure copies: bit-identical; so are the
    # kind's integer bookkeeping (ring cursors, accept counts, state indices).
    if not torch.equal(as_bits(vec.pool.conv), as_bits(nai.pool.conv)):
        bad.append("conv windows")
    for i, (x, y) in enumerate(zip(vec.flow.buffers(), nai.flow.buffers())):
        if not x.dtype.is_floating_point and not torch.equal(x, y):
            bad.append(f"bookkeeping buffer {i}")
    a, b = vec.pool.temporal.float(), nai.pool.temporal.float()
    both_nan = a.isnan() & b.isnan()  # the dummy slot
    if not torch.equal(a.isnan(), b.isnan()):
        bad.append("NaN pattern of the states")
        return bad
    # Both verify in float32 from the same bf16 state (summation order, rsqrt vs sqrt and the
    # gating's float64 differ at ~K * 2^-24 of the head's scale), then round to bf16: a stored
    # value differs by at most one bf16 ulp (<= 2^-7 |x|) plus that float32 noise (which is all
    # of a value that cancels to near zero: measured 1.9e-7 in a head of scale 1 under vllm), and
    # only for values that land within the noise of a rounding boundary (a ~1e-4 fraction; 1% allowed).
    # The kernel-commit kind's naive fold adds each record in turn, the update's its compensated
    # high and low parts: the same float32 noise.
    K = cfg.head_k_dim
    head = torch.maximum(a.nan_to_num().abs().amax((-2, -1), keepdim=True),
                         b.nan_to_num().abs().amax((-2, -1), keepdim=True)).expand_as(a)[~both_nan]
    diff = (a - b).abs()[~both_nan]
    scale = torch.maximum(a.abs(), b.abs())[~both_nan]
    if not (diff <= 2.0**-7 * scale + K * 2.0**-24 * head).all() or (diff > 0).float().mean() >= 0.01:
        bad.append(f"states: {float((diff / scale.clamp_min(1e-30)).max()):.3g} relative at worst")
    R = cfg.num_requests  # padded rows read the NaN dummy slot: outputs meaningless
    # Outputs of the same float32 recurrence from the same state, the op's bf16 output: the
    # float32 noise of 128-term dot products (~128 * 2^-24 ~ 1e-5 of the output scale) moves a
    # value across a bf16 rounding boundary at most: one bf16 ulp (<= 2^-7 |o|) apart.
    o_vec, o_nai = obs.out[:, :R].float(), out[:, :R].to(torch.bfloat16).float()
    if not torch.allclose(o_vec, o_nai, rtol=2.0 ** -7, atol=1e-5 * float(o_vec.abs().max())):
        bad.append("outputs")
    return bad


@pytest.mark.parametrize("flow", benchmarked_flows())
def test_naive_step_does_the_vectorised_step(flow):
    """In every flow drift bench times, the naive step (its kind's conv, verify rule and default
    update in loops) leaves the pool as the simulator's step does."""
    assert _naive_against_vectorised(flow) == []


@pytest.mark.parametrize("flow", benchmarked_flows())
def test_a_naive_step_without_its_update_is_caught(monkeypatch, flow):
    """The control: with the kind's naive update dropped, the comparison above fails in every flow."""
    from drift.flows.registry import FLOW_KINDS, FLOWS

    monkeypatch.setattr(FLOW_KINDS[FLOWS[flow].kind], "naive_update", staticmethod(lambda *args: None))
    assert _naive_against_vectorised(flow) != []


def test_bench_times_every_flow_and_refuses_a_kind_without_a_naive_step(monkeypatch):
    """Every registered flow has a naive step to time against; a kind without one (its
    ``naive_update`` None) is refused with one line naming the flows that have one."""
    from drift.flows.registry import FLOW_KINDS, FLOWS
    from drift.errors import ConfigError

    assert benchmarked_flows() == tuple(FLOWS)
    kind = FLOW_KINDS[FLOWS["vllm"].kind]
    monkeypatch.setattr(kind, "naive_update", None)
    assert "vllm" not in benchmarked_flows()
    with pytest.raises(ConfigError, match="--flow vllm has none yet: pass --flow sglang"):
        bench(preset("ci-small", flow="vllm"), steps=1, naive_steps=1, repeats=1)


def test_min_bytes_count_each_kinds_state_traffic():
    # ci-small as above: one request's bf16 state in one layer is 4 * 64 * 64 * 2 bytes, 4 requests, 2 layers.
    state = 4 * 2 * 4 * 64 * 64 * 2
    vllm = min_bytes_per_step(preset("ci-small", flow="vllm"))
    assert (vllm["state_read"], vllm["blocks_write"]) == (state, 4 * state) and "commit_copy" not in vllm
    ring = min_bytes_per_step(preset("ci-small", flow="sglang-replayssm"))
    record = 4 * 2 * (2 * 2 * (4 * 64 + 1 * 64) + 4 * 4)  # d and k high + low bf16, g fp32, per token
    assert ring["checkpoint_read"] == state and ring["records_write"] == 4 * record
    assert ring["fold"] == 4 * record + 2 * state
    for parts in (vllm, ring):
        assert parts["total"] == sum(v for k, v in parts.items() if k != "total")
