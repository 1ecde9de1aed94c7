"""drift.plug.flashinfer_replayssm: FlashInfer's ReplaySSM GDN MTP verify and commit (flashinfer #5314,
flashinfer-python 0.7.2.post1) in the sglang-replayssm flow, through a torch stand-in written from the
functions' documented contract (tests/fixtures/fake_flashinfer.py), and the real kernels where a
GPU of compute capability 10.x and flashinfer are present (elsewhere those tests skip, naming what is
missing: the adapter's own refusal).

FlashInfer's design keeps the checkpoint fp32 and replays each step's accepted raw inputs into it in
fp32, so its exact-arithmetic result is the recurrent op's state after the last accepted token: the
tests hold the adapter over the stand-in to drift's fp32 recurrence (the ``sglang`` flow's verify,
which stores every token's fp32 state) within the derived fp32 error bound of the gated delta rule
(tests/helpers.py: gdn_state_bound), and each broken clause of the contract to a failing check.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from drift.cli import main
from drift.config import preset
from drift.errors import LoadError
from drift.flows.registry import FLOWS, state_flow
from drift.plug import flashinfer_replayssm as fr
from drift.plug.loader import KERNELS, load_kernel, load_update
from drift.runner import run_checked
from drift.runspec import resolve
from drift.sim import kernels
from drift.syncs import scan
from helpers import bf16_ulp, gdn_state_bound

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "fake_flashinfer.py"
FLOW = next(f for f in FLOWS if FLOWS[f].kind == "kernel-commit")  # sglang-replayssm
CPU = torch.device("cpu")
BF16, F32 = torch.bfloat16, torch.float32
# The kernels take K = V = 128 and an fp32 checkpoint: the Qwen3.5-397B per-TP16-rank shape (1 key head,
# 4 value heads), two of its layers, tracking every 16 tokens so a short run crosses boundaries.
CFG = preset("qwen3.5-397b-tp16", num_layers=2, ssm_dtype="float32", track_interval=16, steps=64, flow=FLOW)
STATE_CHECKS = ("finite_states", "golden", "committed_state", "outputs", "conv_windows", "tracked_snapshots",
                "drift_bound", "untouched_slots")


def kernel_spec(name: str = "api") -> str:
    return f"{fr.STAND_IN}:{FIXTURE}:{name}"


def update_spec(name: str = "commit") -> str:
    return f"{FIXTURE}:{name}"


def _flows(cfg=CFG, device=CPU):
    """The ring flow the adapter runs in and the copy-commit flow whose portable verify stores every
    token's fp32 state, over the same seeded fp32 checkpoint (made on the CPU, then moved)."""
    ring, copy = state_flow(cfg, device), state_flow(cfg.replace(flow="sglang"), device)
    gen = torch.Generator().manual_seed(7)
    start = (0.1 * torch.randn(copy.pool.states[:, copy.pool.active_slots].shape, generator=gen)).to(device)
    for f in (ring, copy):
        f.pool.states[:, f.pool.active_slots] = start
    return ring, copy, start


def _step_inputs(cfg=CFG, seed=3, device=CPU):
    """mix bf16 [L, N, D, C], beta logits bf16 and the gate inputs (a on the bf16 grid, A_log, dt_bias)."""
    gen = torch.Generator().manual_seed(seed)
    L, N, D, HV = cfg.num_layers, cfg.num_rows, cfg.num_draft_tokens, cfg.num_v_heads
    mix = torch.randn(L, N, D, cfg.conv_channels, generator=gen).to(BF16)
    blogit = torch.randn(L, N, D, HV, generator=gen).to(BF16)
    a = torch.randn(L, N, D, HV, generator=gen).to(BF16).float()
    A_log, dt_bias = torch.randn(L, HV, generator=gen) * 0.5 - 1, torch.randn(L, HV, generator=gen)
    return tuple(t.to(device) for t in (mix, blogit)) + (tuple(t.to(device) for t in (a, A_log, dt_bias)),)


def _verify_both(spec: str = kernel_spec(), device=CPU):
    ring, copy, start = _flows(device=device)
    mix, blogit, gate = _step_inputs(device=device)
    g = kernels.gdn_gating(*gate)
    out = load_kernel(spec)(ring.verify_args(mix, blogit, g, "rne", 0, None, gate))
    args = copy.verify_args(mix, blogit, g, "rne", 0, None, gate)
    ref = kernels.recurrent_gated_delta_rule(args)
    return ring, copy, start, (mix, blogit, g), out, args, ref


def test_one_verify_is_drifts_fp32_recurrence_and_writes_the_raw_windows_at_each_rows_slot():
    """From the same fp32 checkpoint both run the fp32 token loop (the stand-in's gating in fp32, drift's
    in float64 rounded once: a few fp32 ulps): far below a bf16 spacing, so each bf16 output is at most
    one bf16 ulp from drift's. The windows hold the verify's own inputs at the row's checkpoint slot
    (v and the raw key bit for bit, g to fp32 ulps); padded rows (slot -1) write nothing and output
    zeros; the checkpoint is not written."""
    ring, copy, start, (mix, blogit, g), out, args, ref = _verify_both()
    cfg, R = CFG, CFG.num_requests
    L, N, D, HV, HK, K, V = (cfg.num_layers, cfg.num_rows, cfg.num_draft_tokens, cfg.num_v_heads, cfg.num_k_heads,
                             cfg.head_k_dim, cfg.head_v_dim)
    assert ((out[:, :R].float() - ref[:, :R].float()).abs() <= bf16_ulp(ref[:, :R].float())).all()
    assert (out[:, R:] == 0).all()
    assert torch.equal(ring.pool.states[:, ring.pool.active_slots], start)  # frozen
    win = fr.windows(ring.pool.temporal, HK, D)
    slots = ring.pool.state_indices[:R]
    v = mix[..., 2 * HK * K:].reshape(L, N, D, HV, V)[:, :R].permute(0, 1, 3, 2, 4)
    k = mix[..., HK * K: 2 * HK * K].reshape(L, N, D, HK, K)[:, :R].permute(0, 1, 3, 2, 4)
    assert torch.equal(win.rawv[:, slots], v) and torch.equal(win.rawk[:, slots], k)
    gw, gr = win.g[:, slots], g[:, :R].permute(0, 1, 3, 2)
    assert ((gw - gr).abs() <= 2 ** -20 * gr.abs()).all()  # measured 1.5e-7 relative (~3 ulps)
    assert torch.equal(win.beta[:, slots], torch.sigmoid(blogit[:, :R].float()).permute(0, 1, 3, 2))
    others = torch.ones(win.rawv.shape[1], dtype=torch.bool)
    others[slots] = False
    assert not win.rawv[:, others].any() and not win.g[:, others].any()  # the dummy and unowned slots
    # Negative control: a verify that stores its windows one position late does not hold v in place.
    ring2, *_ = _verify_both(kernel_spec("wrong_position"))
    assert not torch.equal(fr.windows(ring2.pool.temporal, HK, D).rawv[:, slots], v)


def _commit_errors(name: str = "api", commit: str = "commit"):
    """One verify, then one commit (rows accepting 1, 4, 2, 3 tokens; rows 1 and 2 tracked at steps 1
    and 0): per row, ||checkpoint - drift's fp32 state after its last accepted token||_F (and the track
    slot's against the tracked token's) over twice the fp32 bound of that many tokens (both
    computations are within the bound of the exact state: tests/helpers.py gdn_state_bound), and the
    same for the next token's state (which a right commit must not be near)."""
    ring, copy, start, (mix, *_), out, args, ref = _verify_both(kernel_spec(name))
    cfg = CFG
    L, N, D, HV, HK, K, V, R = (cfg.num_layers, cfg.num_rows, cfg.num_draft_tokens, cfg.num_v_heads, cfg.num_k_heads,
                                cfg.head_k_dim, cfg.head_v_dim, cfg.num_requests)
    last = torch.tensor([0, 3, 1, 2] + [-1] * (N - R))
    steps = torch.tensor([-1, 1, 0, -1] + [-1] * (N - R))
    tracked_before = ring.pool.states[:, ring.pool.row_track_slots].clone()
    load_update(update_spec(commit))(ring.harness, last, ring.pool.row_track_slots, steps)
    scratch = kernels.scratch_blocks(copy.pool.intermediate_ssm)
    idx = args.ssm_state_indices.long()
    v = mix[..., 2 * HK * K:].reshape(L, N, D, HV, V).double()
    rows = []
    for b in range(R):
        t = int(last[b])
        states = torch.stack([start[:, b].double()] + [scratch[:, idx[b, s]].double() for s in range(D)])
        bound = 2 * gdn_state_bound(t + 1, K, states.norm(dim=(-1, -2)).amax(0), v[:, b].norm(dim=-1).amax(1))

        def ratio(got, token):
            return ((got.double() - scratch[:, idx[b, token]].double()).norm(dim=(-1, -2)) / bound).max().item()

        got = ring.pool.states[:, ring.pool.row_slots[b]]
        tslot = ring.pool.row_track_slots[b]
        track = ratio(ring.pool.states[:, tslot], int(steps[b])) if steps[b] >= 0 else None
        untouched = steps[b] >= 0 or torch.equal(ring.pool.states[:, tslot], tracked_before[:, b])
        rows.append((ratio(got, t), ratio(got, (t + 1) % D), track, untouched))
    return rows


def test_one_commit_replays_each_rows_accepted_prefix_into_its_checkpoint_and_track_slot():
    """Each checkpoint lands within the derived fp32 bound of drift's state after the row's last accepted
    token (the bonus token included: accept_lens = last + 1), each tracked slot within it of the
    tracked token's state (measured: 3e-3 of the bound at most; the bound is the worst case), and an
    untracked row's track slot keeps its bits. Negative controls: the next token's state is ~1e3 bounds
    away (the bound tells tokens apart), and the stand-in writing its windows one position late lands
    far outside."""
    for err, neighbour, track, untouched in _commit_errors():
        assert err <= 1.0 and neighbour > 100.0 and untouched
        assert track is None or track <= 1.0
    assert max(err for err, *_ in _commit_errors("wrong_position")) > 100.0


def test_rows_not_tracked_pass_no_track_slot():
    """FlashInfer's contract: live track slots (> null_block_id) distinct. drift's padded rows all carry
    track slot 0, so the adapter passes -1 wherever no step is tracked: with two padded rows a run
    passes every check. Negative control: the same rows' slots passed as they are break the contract
    (the stand-in checks it on plain CPU tensors)."""
    cfg = CFG.replace(num_padded=2, steps=24)
    rep = run_checked(resolve(cfg, update_spec(), kernel_spec()), sync_scan=False)
    assert rep.passed, [c.key for c in rep.checks if c.failed]
    ring = state_flow(cfg, CPU)
    win = fr.windows(ring.pool.temporal, cfg.num_k_heads, cfg.num_draft_tokens)
    i32 = lambda t: t.to(torch.int32).contiguous()  # noqa: E731
    last = torch.tensor([0, 1, 2, 3, -1, -1])
    api = fr.api_from_spec(f"{FIXTURE}:api")
    with pytest.raises(AssertionError, match="live track slots distinct"):
        api.commit(ring.pool.temporal, win.rawv, win.rawk, win.g, win.beta, i32(ring.pool.state_indices),
                   i32(last + 1), track_state_indices=i32(ring.pool.row_track_slots), track_steps=i32(-torch.ones(6)))


@pytest.fixture(scope="module")
def runs():
    """64 steps of the flow: the adapter over the stand-in, the controls, and drift's renderings (its ring
    flow, SGLang's design; and its fp32 recurrence, the sglang flow, FlashInfer's design in exact
    arithmetic)."""
    def checks(cfg, kernel=None, update=None):
        return {c.key: c for c in run_checked(resolve(cfg, update, kernel)).checks}

    return {
        "stand-in": checks(CFG, kernel_spec(), update_spec()),
        "drift-ring": checks(CFG),
        "drift-recurrent": checks(CFG.replace(flow="sglang")),
        "wrong_position": checks(CFG, kernel_spec("wrong_position"), update_spec()),
        "wrong_g_dtype": checks(CFG, kernel_spec("wrong_g_dtype"), update_spec()),
        "no_tracking": checks(CFG, kernel_spec(), update_spec("commit_without_tracking")),
    }


def test_a_run_through_the_stand_in_is_drifts_fp32_recurrence(runs):
    """Every check passes, as in drift's renderings, with no host sync (the scan runs the commit on
    drift's virtual device). The worst values equal those of drift's fp32 recurrence (the sglang flow)
    to 1% (measured: 0.1% at most; the same fp32 maths summed in another order). SGLang's ring design
    in drift's rendering (records as bf16 high + low parts, 2^-16 relative each) drifts further than
    FlashInfer's replay of raw inputs (measured: committed-state error 5.0e-6 against 4.7e-7), a finding
    about the two designs under an fp32 checkpoint."""
    mine, rec, ring = runs["stand-in"], runs["drift-recurrent"], runs["drift-ring"]
    assert all(c.passed for c in mine.values()), [c.key for c in mine.values() if c.failed]
    assert all(c.passed for c in ring.values()) and all(c.passed for c in rec.values())
    for key in ("committed_state", "outputs", "tracked_snapshots", "drift_bound", "output_bound"):
        assert abs(mine[key].worst - rec[key].worst) <= 1e-2 * rec[key].worst, (key, mine[key].worst, rec[key].worst)
    assert mine["committed_state"].worst < 0.5 * ring["committed_state"].worst


@pytest.mark.parametrize("control,fails", [
    ("wrong_position", {"committed_state", "drift_bound"}),  # the commit replays the wrong tokens
    ("wrong_g_dtype", {"drift_bound"}),  # the log-decay through bf16: 2^-9 relative per token
    ("no_tracking", {"tracked_snapshots"}),  # track slots never written
])
def test_each_broken_clause_of_the_contract_fails_a_check(runs, control, fails):
    failed = {k for k, c in runs[control].items() if c.failed}
    assert fails <= failed, failed


@pytest.mark.parametrize("control,says", [
    ("wrong_shape", "the op returned shape (4, 4, 256), expected (4, 4, 2, 128)"),  # the serving run's first bucket
    ("output_only", "the op returned Tensor, not (output, initial_state)"),
])
def test_a_contract_violation_is_the_kernels_failure_exit_1(capsys, control, says):
    """A verify returning [B, T, HV * V] (the contract's [B, T, HV, V] flattened), or its output alone,
    fails the run naming the kernel, the step, the layer and what it returned: exit 1, no traceback."""
    code = main(["run", "--flow", FLOW, "--preset", "qwen3-next-80b-tp16", "--profile", "fp32", "--steps", "2",
                 "--kernel", kernel_spec(control), "--update", update_spec()])
    err = capsys.readouterr().err
    assert code == 1, err
    assert f"failed at decode step 0, layer 0: {says}" in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv,says", [
    (["--preset", "ci-small", "--profile", "fp32"], "K = V = 128"),
    (["--preset", "qwen3-next-80b-tp16", "--profile", "ascend"], "--profile fp32"),
    (["--preset", "qwen3-next-80b-tp16", "--profile", "fp32", "--draft-tokens", "2", "--pattern", "all-1"],
     "--draft-tokens 3 or more"),
])
def test_shapes_the_kernels_cannot_take_are_refused_exit_2(capsys, argv, says):
    code = main(["run", "--flow", FLOW, "--steps", "2", "--kernel", kernel_spec(), "--update", update_spec(), *argv])
    err = capsys.readouterr().err
    assert code == 2 and says in err, err


def test_the_verify_without_flashinfers_commit_is_refused_exit_2(capsys):
    """The flow's built-in update folds drift's own ring, which this verify never writes: the second
    verify finds its windows never consumed and says which update to pass."""
    code = main(["run", "--flow", FLOW, "--preset", "qwen3-next-80b-tp16", "--profile", "fp32", "--steps", "3",
                 "--kernel", kernel_spec()])
    err = capsys.readouterr().err
    assert code == 2 and f"--update {fr.COMMIT_SPEC}" in err, err


def test_it_verifies_by_the_ring_rule_only(capsys):
    assert main(["run", "--flow", "sglang", "--kernel", kernel_spec(), "--steps", "2"]) == 2
    assert "ring rule" in capsys.readouterr().err


def test_a_stand_in_without_both_functions_or_their_keywords_is_refused(tmp_path):
    """Exit 2 at load, naming what is wrong: an object lacking the commit, and a verify whose signature
    cannot take the adapter's keywords. Control: the fixture's namespace loads."""
    with pytest.raises(LoadError, match="which lacks gated_delta_rule_mtp or gated_delta_rule_replayssm_commit"):
        load_kernel(f"{fr.STAND_IN}:{FIXTURE}:_wrong_shape_mtp")
    bad = tmp_path / "bad_flashinfer.py"
    bad.write_text("from types import SimpleNamespace\n"
                   "bad = SimpleNamespace(gated_delta_rule_mtp=lambda q, k, v: None,\n"
                   "                      gated_delta_rule_replayssm_commit=lambda *a, **k: None)\n")
    with pytest.raises(LoadError, match="cannot take the adapter's call"):
        load_kernel(f"{fr.STAND_IN}:{bad}:bad")
    assert callable(load_kernel(kernel_spec()))


# ------------------------------------------------------------------------------ refusals of the real one
def _no_flashinfer(monkeypatch):
    real = fr.importlib.import_module

    def fake(name, *a, **k):
        if name.startswith("flashinfer"):
            raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}")
        return real(name, *a, **k)

    monkeypatch.setattr(fr.importlib, "import_module", fake)


def _gpu(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "NVIDIA H200")


@pytest.mark.parametrize("gpu,says", [
    (None, "a CUDA GPU (torch.cuda.is_available() is False)"),
    ((9, 0), "compute capability 10.x (SM100/SM103"),
])
def test_the_real_kernels_refusal_names_everything_missing(monkeypatch, gpu, says):
    """Without flashinfer and without a GPU of compute capability 10.x, loading names both (the package
    first, with its import error), exit 2 from the command line; an H200 (9.0) is named with its
    capability. Negative control: with both present (faked) the probe finds nothing missing."""
    _no_flashinfer(monkeypatch)
    _gpu(monkeypatch, gpu)
    with pytest.raises(LoadError) as exc:
        load_kernel(fr.KERNEL)
    msg = str(exc.value)
    assert "flashinfer importable" in msg and "No module named 'flashinfer'" in msg and says in msg, msg
    if gpu == (9, 0):
        assert "cuda:0 is NVIDIA H200, compute capability 9.0 (SM90)" in msg
    _gpu(monkeypatch, (10, 0))
    assert fr.gpu_problem() == ""


def test_the_real_commit_refuses_as_its_verify_does(monkeypatch, capsys):
    _no_flashinfer(monkeypatch)
    _gpu(monkeypatch, None)
    code = main(["run", "--flow", FLOW, "--preset", "qwen3-next-80b-tp16", "--profile", "fp32", "--steps", "2",
                 "--update", fr.COMMIT_SPEC])
    err = capsys.readouterr().err
    assert code == 2 and f"--update {fr.COMMIT_SPEC} needs flashinfer importable" in err, err


def test_a_device_only_update_is_scanned_on_the_accelerator_alone(monkeypatch):
    """The real commit takes CUDA tensors only (DEVICE_ONLY): the host-sync scan skips its virtual pass
    where an accelerator pass runs. Stood in here by the CPU as that pass; negative control: the same
    update without the declaration gets both passes."""
    monkeypatch.setattr(scan, "_device_pass", lambda cfg, device: "cpu")
    upd = load_update(update_spec())
    assert set(scan.scan_update(resolve(CFG, upd, kernel_spec()), steps=2).passes) == {"virtual", "cpu"}
    monkeypatch.setattr(upd.fn, "DEVICE_ONLY", True)
    assert set(scan.scan_update(resolve(CFG, upd, kernel_spec()), steps=2).passes) == {"cpu"}


# ------------------------------------------------------------------------------ on a GPU
def _real_or_skip():
    try:
        return load_kernel(fr.KERNEL)
    except LoadError as exc:  # the adapter's own refusal names what this machine lacks
        pytest.skip(f"the real kernels cannot run here: {exc}")


def test_flashinfers_own_functions_take_the_adapters_calls():
    """Wherever flashinfer imports (no GPU needed): its two functions' signatures bind every keyword
    the adapter passes (the stand-in's are held to the same list)."""
    try:
        mod = fr.importlib.import_module(fr.MODULE)
    except Exception as exc:
        pytest.skip(f"needs flashinfer importable (pip install flashinfer-python==0.7.2.post1): {exc!r}")
    fr._check_signature(getattr(mod, fr.VERIFY_FN), fr.VERIFY_KEYWORDS, fr.VERIFY_FN)
    fr._check_signature(getattr(mod, fr.COMMIT_FN), fr.COMMIT_KEYWORDS, fr.COMMIT_FN)


@pytest.mark.cuda
def test_the_adapter_is_captured_in_a_cuda_graph_over_the_stand_in(drift_device):
    """On CUDA the whole step (the adapter's verify and commit over the stand-in) is captured and replays
    bit for bit as eager: no host sync in the hot path."""
    from drift.simulate import Simulation

    cfg = CFG.replace(device=drift_device, steps=24)
    finals = []
    for graph in (False, True):
        sim = Simulation(resolve(cfg, update_spec(), kernel_spec()), graph=graph)
        sim.run(24)
        finals.append(sim.pool.bits()[0].clone())
        if graph:
            assert sim.graph_status.captured, sim.graph_status
    assert torch.equal(*finals)


@pytest.mark.cuda
def test_the_real_verify_meets_its_declared_conformance(drift_device):
    """One verify of FlashInfer's own kernel against drift's fp32 recurrence from the same checkpoint:
    the outputs within the entry's conformance (its tcgen05 path takes the dots in TF32: 2^-11
    relative operands, a few bf16 ulps at most), the checkpoint not written."""
    _real_or_skip()
    ring, copy, start, _, out, args, ref = _verify_both(fr.KERNEL, torch.device(drift_device))
    c, R = KERNELS[fr.KERNEL].conformance, CFG.num_requests
    torch.testing.assert_close(out[:, :R].float(), ref[:, :R].float(), rtol=c.output_rtol, atol=c.output_atol)
    assert torch.equal(ring.pool.states[:, ring.pool.active_slots], start)


@pytest.mark.cuda
def test_the_real_kernels_run_the_flow(drift_device):
    """FlashInfer's own verify and commit (a GPU of compute capability 10.x with flashinfer): every state
    check passes. The output bound (drift's models fp32 operands) is printed, not asserted: the SM100
    verify's tcgen05 path takes its dots in TF32."""
    _real_or_skip()
    cfg = CFG.replace(device=drift_device, steps=256)
    rep = run_checked(resolve(cfg, fr.COMMIT_SPEC, fr.KERNEL))
    verdicts = {c.key: c for c in rep.checks}
    print({k: (c.passed, c.worst) for k, c in verdicts.items()})
    assert all(verdicts[k].passed for k in STATE_CHECKS + ("host_syncs",)), verdicts
