"""drift's models against the real kernels, run by Triton's interpreter on the CPU.

* sgl-kernel-npu's Triton state-update kernels (``mamba_state_update_triton.py``) against the
  shim's portable ones, on every pool layout drift builds: needs ``triton`` and
  ``DRIFT_SGL_KERNEL_NPU_SRC`` pointing at an sgl-kernel-npu checkout (the kernels are loaded
  from that file; nothing of them is copied here).
* SGLang's Triton MTP verify kernel (``--kernel sglang-triton``) against drift's op: needs
  ``triton`` and ``sglang`` (0.5.23, installed without its dependencies). Its parent packages
  import SGLang's whole runtime, so this test stubs them (and two device hooks the interpreter
  cannot take) -- here, not in drift.

``TRITON_INTERPRET=1`` must be set before triton is first imported, so each case runs in a
fresh interpreter process. Where something is missing the test skips, naming it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from drift.layouts import LAYOUTS

REPO_FILE = "python/sgl_kernel_npu/sgl_kernel_npu/mamba/mamba_state_update_triton.py"


def _need(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pins = {"sglang": "==0.5.23 --no-deps", "vllm": "==0.33.0 --no-deps"}
        pytest.skip(f"needs {module!r} installed (pip install {module}{pins.get(module, '')})")


def _run(code: str, timeout: int = 900) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return res.stdout


def test_shim_kernels_match_sgl_kernel_npus_triton_kernels():
    """The raw block copy of move_intermediate_cache is sgl-kernel-npu's, bit for bit, on the
    every registered layout; conv_state_rollback agrees on a contiguous pool and,
    as modelled (docs/semantics.md §3), differs on a strided one, where the 2026-08-21 kernel
    loses its writes to a .contiguous() copy (sgl-kernel-npu #748 made it work in place; drift's
    rollback is the post-#748 one). Shapes keep C a power of two: the real rollback's
    ``tl.arange(0, num_dims)`` needs one."""
    _need("triton")
    src = os.environ.get("DRIFT_SGL_KERNEL_NPU_SRC")
    if not src:
        pytest.skip("needs DRIFT_SGL_KERNEL_NPU_SRC=<an sgl-kernel-npu checkout> (its Triton kernels are read "
                    "from there)")
    path = Path(src) / REPO_FILE
    if not path.is_file():
        pytest.fail(f"DRIFT_SGL_KERNEL_NPU_SRC={src} has no {REPO_FILE}")
    out = _run(f"""
        import importlib.util, torch
        spec = importlib.util.spec_from_file_location("real_msu", {str(path)!r})
        real = importlib.util.module_from_spec(spec); spec.loader.exec_module(real)
        from drift.sim import kernels
        from drift.config import preset
        from drift.layouts import LAYOUTS
        from drift.sim.pool import StatePool
        g = torch.Generator().manual_seed(0)
        from drift.dtypes import as_bits as bits
        for layout in LAYOUTS:
            cfg = preset("ci-small", num_layers=2, head_k_dim=16, head_v_dim=8, num_v_heads=2, num_k_heads=1,
                         decays=(0.5, 0.9), layout=layout)  # C = 2*16 + 2*8 = 48
            pool = StatePool(cfg, torch.device("cpu"))
            for t in (pool.temporal, pool.intermediate_ssm):
                t.copy_(torch.randn(t.shape, generator=g))
            a, b = pool.temporal.clone(), pool.temporal.clone()
            assert a.stride() == pool.temporal.stride()
            dst, src, last = torch.tensor([3, 1, 5, 0, 2]), torch.arange(5), torch.tensor([2, -1, 0, 3, 1])
            real.move_intermediate_cache(a, pool.intermediate_ssm, dst, src, last)
            kernels.move_intermediate_cache(b, pool.intermediate_ssm, dst, src, last)
            print("move", layout, torch.equal(bits(a), bits(b)), not torch.equal(bits(a), bits(pool.temporal)))
        for contiguous in (True, False):
            L, S, W, C, D = 2, 6, 6, 32, 4
            conv = (torch.randn(L, S, W, C, generator=g) if contiguous
                    else torch.randn(L, S, C, W, generator=g).transpose(-1, -2)).bfloat16()
            a, b = conv.clone(), conv.clone()
            idx, steps = torch.tensor([3, 1, 5]), torch.tensor([0, 2, -1])
            real.conv_state_rollback(a, idx, steps, D)
            kernels.conv_state_rollback(b, idx, steps, D)
            print("rollback", contiguous, torch.equal(bits(a), bits(b)), torch.equal(bits(a), bits(conv)))
    """)
    lines = out.strip().splitlines()
    for layout in LAYOUTS:
        assert f"move {layout} True True" in lines, out  # equal, and the copy did something
    assert "rollback True True False" in lines, out  # contiguous: the same in-place rollback
    assert "rollback False False True" in lines, out  # strided: the real one left the pool as it was


# SGLang's and vLLM's package roots import their servers; drift itself stubs them under the
# interpreter (drift/plug/triton_interpreter.py), where the kernel module does not import as
# installed, and mends the interpreter's truncating fp32 -> bf16 cast and its bf16 tl.dot, so the
# tests load the kernels exactly as `TRITON_INTERPRET=1 drift run --kernel ...` does.
PRELUDE = """
    import importlib, importlib.util, os, sys, types
    import torch
"""


# (key heads, value heads): one key head, and two, where fla's i_h = i_hv // (HV // H) and a tiled
# mapping part (the heads_tiled mutant is the negative control there).
@pytest.mark.parametrize("HK,HV", [(1, 2), (2, 4)], ids=["one-key-head", "two-key-heads"])
def test_sglang_triton_kernel_matches_drifts_op_under_the_mended_interpreter(HK, HV):
    """SGLang's Triton verify kernel through drift's adapter, one verify call in both flows, under
    the interpreter as drift mends it (its fp32 -> bf16 stores round to nearest, as on a GPU), so it
    is compared with drift's op storing by round to nearest. Same fp32 math in another summation
    order: nearly every stored element bit-equal, none more than one bf16 ulp apart (a value within
    fp32 noise of a rounding boundary); outputs within one bf16 ulp. Negative controls: against
    drift's op storing by truncation (the unmended interpreter's cast) far fewer elements agree;
    with two key heads, against the heads_tiled mutant (value head h on key head h % HK) far fewer too."""
    _need("triton")
    _need("sglang")
    out = _run(PRELUDE + """
    from dataclasses import replace
    from drift.plug.loader import load_kernel
    from drift.sim import kernels
    from drift.dtypes import as_bits
    from drift.sim.kernels import VerifyArgs
    from drift.flows.copy_commit.rule import NpuRule
    g = torch.Generator().manual_seed(1)
    L, slots, B, S, HK, HV, K, V = 1, 6, 3, 4, HEADS, 16, 16
    C = 2 * HK * K + HV * V
    base = VerifyArgs(torch.randn(L, B, S, C, generator=g).bfloat16(), torch.randn(L, B, S, HV, generator=g).bfloat16(),
                      -torch.rand(L, B, S, HV, generator=g), torch.randn(L, slots, HV, V, K, generator=g).bfloat16(),
                      torch.randn(L, B + 1, S, HV, V, K, generator=g).bfloat16(), torch.tensor([4, 1, 0], dtype=torch.int32),
                      torch.arange(B * S, dtype=torch.int32).view(B, S), torch.ones(B, dtype=torch.int32),
                      torch.full((B,), S, dtype=torch.int32), HK, HV, K ** -0.5, rule=NpuRule())
    triton_kernel = load_kernel("sglang-triton")
    for flow, accepted in (("sglang", [1, 1, 1]), ("npu-accepted", [3, 1, 4])):
        args = replace(base, num_accepted_tokens=torch.tensor(accepted, dtype=torch.int32))
        clone = lambda: replace(args, recurrent_state=args.recurrent_state.clone(),
                                intermediate_state=args.intermediate_state.clone())
        t, rn, tr, tiled, same_path = clone(), clone(), clone(), clone(), clone()
        o_t = triton_kernel(t)
        o_rn = kernels.recurrent_gated_delta_rule(rn)
        kernels.recurrent_gated_delta_rule(replace(tr, rounding="truncate"))
        load_kernel("mutant:heads_tiled")(tiled)
        kernels.recurrent_gated_delta_rule_torch(same_path)  # the mutant's own path, correctly mapped
        a, b, c, d = (x.intermediate_state[:, :B].float() for x in (t, rn, tr, tiled))
        equal_tiled = (d == same_path.intermediate_state[:, :B].float()).float().mean().item()
        equal = (a == b).float().mean().item()
        ulp = 2.0 ** (torch.floor(torch.log2(b.abs().clamp_min(1e-30))) - 7)
        worst = ((a - b).abs() / ulp).max().item()
        equal_trunc = (a == c).float().mean().item()
        o_ulp = 2.0 ** (torch.floor(torch.log2(o_rn.float().abs().clamp_min(1e-30))) - 7)
        o_worst = ((o_t.float() - o_rn.float()).abs() / o_ulp).max().item()
        same_committed = torch.equal(as_bits(t.recurrent_state), as_bits(args.recurrent_state))
        print(flow, equal, worst, equal_trunc, o_worst, same_committed, equal_tiled)
    """.replace("HEADS", f"{HK}, {HV}"))
    for line in out.strip().splitlines():
        flow, equal, worst, equal_trunc, o_worst, same_committed, equal_tiled = line.split()
        # With one key head tiling is the same mapping: bit-equal to the same torch-op path mapped right
        # (drift's op may run its native C kernel, which sums in another order); with two it is not.
        assert (float(equal_tiled) == 1.0) if HK == 1 else float(equal_tiled) < 0.8, line
        # Summation-order noise of fp32 (~K * 2^-24 relative) straddles a rounding boundary for a
        # ~K * 2^-24 / 2^-8 ~ 2e-4 fraction of elements (measured on an H200 at ci-small: 13 of
        # 655,360); 0.995 leaves a wide margin. One bf16 ulp is the most a boundary can move a value.
        assert float(equal) >= 0.995 and float(worst) <= 1.0, line
        # Truncation vs round to nearest differ in about half the elements (the dropped half-ulp).
        assert float(equal_trunc) < 0.8, line
        assert float(o_worst) <= 1.0 and same_committed == "True", line


def test_vllm_triton_kernel_matches_drifts_op_and_runs_the_checks():
    """vLLM 0.33.0's recurrent kernel (--kernel vllm-triton) and its Qwen-path twin with the gating in
    the kernel (--kernel vllm-triton-qwen) through drift's adapter, under the interpreter as drift
    mends it (fp32 -> bf16 stores round to nearest, as on a GPU; sglang-triton above), loaded over
    the --no-deps install as `TRITON_INTERPRET=1 drift run --kernel vllm-triton` loads it:
    * one verify call in both flows: its scratch states and outputs against drift's op (the same
      fp32 math: every element within one bf16 ulp, nearly all bit-equal; measured here: all of
      them), and against drift's op storing by truncation far fewer agree (negative control);
    * a few decode steps of ci-small through every check: every check passes, with the same
      verdicts and worst values as drift's own op."""
    _need("triton")
    _need("vllm")
    out = _run(PRELUDE + """
    from dataclasses import replace
    import torch
    sys.path.insert(0, {tests!r})
    from helpers import clone_case, verify_case
    from drift.config import preset
    from drift.plug.loader import load_kernel
    from drift.runner import run_checked
    from drift.runspec import resolve
    from drift.sim import kernels
    from helpers import blocks_case
    # vLLM's varlen call (--drafts ragged): row 0 verifies 2 of its 4 tokens; packed by cu_seqlens, the
    # kernel stores none of its tokens 2, 3 (blocks 1 and 9) and outputs zeros there, as drift's op
    # (outputs compared on the tokens that ran: row 2 is on the NULL block, its outputs left unwritten).
    ragged = replace(blocks_case(), actual_seq_lengths=torch.tensor([2, 4, 4], dtype=torch.int32))
    def cache_copy(a):  # the cache is both the recurrent state and the scratch (one storage)
        c = a.recurrent_state.clone()
        return replace(a, recurrent_state=c, intermediate_state=c.unsqueeze(2))
    mine, theirs, unpacked = cache_copy(ragged), cache_copy(ragged), cache_copy(ragged)
    o_mine = kernels.recurrent_gated_delta_rule(mine)
    o_theirs = load_kernel("vllm-triton")(theirs)
    x, y = theirs.recurrent_state.float(), mine.recurrent_state.float()
    import drift.plug.vllm_kernel as vk
    packed_call, vk.varlen = vk.varlen, lambda a: vk.Varlen(*a.dims[1:3])  # negative control: no packing
    load_kernel("vllm-triton")(unpacked)
    print("ragged", torch.equal(theirs.recurrent_state[:, [1, 9]], ragged.recurrent_state[:, [1, 9]]),
          bool((o_theirs[:, 0, 2:] == 0).all()), (x == y).float().mean().item(),
          max(((t.float() - m.float()).abs() / 2.0 ** (torch.floor(torch.log2(m.float().abs().clamp_min(1e-30))) - 7))
              .max().item() for t, m in ((o_theirs[:, 0, :2], o_mine[:, 0, :2]), (o_theirs[:, 1], o_mine[:, 1]))),
          torch.equal(unpacked.recurrent_state[:, [1, 9]], ragged.recurrent_state[:, [1, 9]]))
    vk.varlen = packed_call
    for name in ("vllm-triton", "vllm-triton-qwen"):
        k = load_kernel(name)
        for flow, accepted in (("sglang", (1, 1, 1)), ("npu-accepted", (3, 1, 4))):
            args = verify_case(accepted=accepted)
            a, b, c = clone_case(args), clone_case(args), clone_case(args)
            o_a = k(a)
            o_b = kernels.recurrent_gated_delta_rule(b)
            kernels.recurrent_gated_delta_rule(replace(c, rounding="truncate"))
            x, y, z = (t.intermediate_state[:, :3].float() for t in (a, b, c))
            ulp = 2.0 ** (torch.floor(torch.log2(y.abs().clamp_min(1e-30))) - 7)
            o_ulp = 2.0 ** (torch.floor(torch.log2(o_b.float().abs().clamp_min(1e-30))) - 7)
            print(name, flow, (x == y).float().mean().item(), ((x - y).abs() / ulp).max().item(),
                  (x == z).float().mean().item(), ((o_a.float() - o_b.float()).abs() / o_ulp).max().item())
        for flow in ("sglang", "vllm"):  # through the adapter, and in vLLM's own flow with vLLM's own arguments
            cfg = preset("ci-small", steps=4, flow=flow)
            got = run_checked(resolve(cfg, kernel=k), sync_scan=False)
            ref = run_checked(resolve(cfg), sync_scan=False)  # drift's own op
            same = [(c.key, c.passed, c.worst) for c in got.checks] == [(c.key, c.passed, c.worst) for c in ref.checks]
            near = max(abs(g.worst - r.worst) / max(abs(r.worst), 1e-30) for g, r in zip(got.checks, ref.checks)
                       if g.worst is not None and r.worst is not None)
            said = "mended by drift" in got.info.verify_kernel and "interpreter" not in ref.info.verify_kernel
            print("run", name, flow, said, same, near, sorted(c.key for c in got.checks if c.failed))
    """.replace("{tests!r}", repr(str(Path(__file__).resolve().parents[1]))))  # tests/: helpers.py
    lines = out.strip().splitlines()
    ragged = [ln.split() for ln in lines if ln.startswith("ragged ")]
    lines = [ln for ln in lines if not ln.startswith("ragged ")]
    [(_, untouched, zeros, equal, o_worst, unpacked_untouched)] = ragged
    # Packed by cu_seqlens, row 0's tokens past its length are neither stored nor output; the rest is
    # the same fp32 math as drift's op (as the full-length calls below).
    assert untouched == "True" and zeros == "True", ragged
    assert float(equal) >= 0.995 and float(o_worst) <= 1.0, ragged
    assert unpacked_untouched == "False", ragged  # negative control: unpacked, the extra tokens are stored
    calls = [ln for ln in lines if not ln.startswith("run ")]
    runs = [ln.split(maxsplit=5) for ln in lines if ln.startswith("run ")]
    assert len(calls) == 4 and len(runs) == 4, out
    for line in calls:
        name, flow, equal, worst, equal_trunc, o_worst = line.split()
        # fp32 summation-order noise can straddle a rounding boundary (sglang-triton's test above):
        # at most one bf16 ulp, on a tiny fraction of elements; 0.995 leaves a wide margin. The Qwen
        # path's fp32 gating moves g by an fp32 ulp or so: the same bound holds (measured below).
        assert float(equal) >= 0.995 and float(worst) <= 1.0 and float(o_worst) <= 1.0, line
        assert float(equal_trunc) < 0.8, line  # against truncation (the unmended interpreter): about half differ
    for _, name, flow, said, same, rest in runs:
        near, failed = rest.split(maxsplit=1)
        assert failed == "[]", (name, flow, out)  # mended, the interpreter stores as a GPU: every check passes
        assert said == "True", (name, flow, out)  # the report says how it ran (drift's own op: no such words)
        if name == "vllm-triton":  # the same fp32 math as drift's op: the same worst values, bit for bit
            assert same == "True", (name, flow, out)
        else:  # g from fp32 softplus/exp in the kernel, not drift's float64 rounded once: worst values
            # within 1% (measured 2026-12-01: identical in both flows, the fp32 gating landing on the
            # same fp32 values here; 1% is far below a semantic error, order one)
            assert float(near) < 1e-2, (name, flow, out)


# SGLang's ReplaySSM module imports two helpers from its runtime, stubbed by drift with the rest of
# the server (PRELUDE above); drift also mends the interpreter's bf16 tl.dot (raw uint16 bits; a GPU
# widens them, the products exact in fp32) and its truncating fp32 -> bf16 cast.
REPLAYSSM_STUBS = PRELUDE


def test_sglang_replayssm_kernels_match_drifts_ring_flow_and_run_the_checks():
    """SGLang 0.5.23's ReplaySSM kernels (--kernel sglang-replayssm-triton, and its commit kernels as
    the update drift.plug.replayssm_engine:sglang_commit) against drift's rendering, under the
    interpreter (REPLAYSSM_STUBS):
    * one verify from a checkpoint whose rings wrap: the records (delta and key, high + low parts)
      agree with drift's recurrence to ~2^-16 relative, g to fp32 ulps; the outputs to bf16 noise;
      padded rows stay zero; against records one position off they disagree (negative control);
    * one commit on the same ring, with tracked rows: the same cursors, and the checkpoint and track
      slots bit-equal to drift's fold in all but a handful of elements, none more than one bf16 ulp
      apart; truncating drift's fold instead agrees in about half (negative control);
    * eight decode steps of ci-small through every check with both engine kernels."""
    _need("triton")
    _need("sglang")
    out = _run(REPLAYSSM_STUBS + """
    from drift.check.registry import find_result
    from drift.config import preset
    from drift.plug import replayssm_engine as eng
    from drift.flows.kernel_commit import updates as rs
    from drift.plug.loader import load_kernel
    from drift.runner import run_checked
    from drift.runspec import resolve
    from drift.sim import kernels
    from drift.flows.registry import state_flow
    cfg = preset("ci-small", flow="sglang-replayssm")
    L, N, R, D, HV = cfg.num_layers, cfg.num_rows, cfg.num_requests, cfg.num_draft_tokens, cfg.num_v_heads
    gen = torch.Generator().manual_seed(5)
    mix = torch.randn(L, N, D, cfg.conv_channels, generator=gen).to(torch.bfloat16)
    blogit = torch.randn(L, N, D, HV, generator=gen).to(torch.bfloat16)
    a = torch.randn(L, N, D, HV, generator=gen)
    A_log, dt_bias = torch.randn(L, HV, generator=gen) * 0.5 - 2, torch.randn(L, HV, generator=gen)
    g = kernels.gdn_gating(a, A_log, dt_bias)
    start = torch.randn(L, R, HV, cfg.head_v_dim, cfg.head_k_dim, generator=gen).to(torch.bfloat16)
    def flow():
        f = state_flow(cfg, torch.device("cpu"))
        f.pool.states[:, f.pool.active_slots] = start
        f.pool.cache_base[:R] = torch.tensor([0, 5, 14, 9], dtype=torch.int32)  # rows 2, 3 wrap
        return f
    def rel(x, y):
        return ((x.float() - y.float()).norm() / y.float().norm()).item()
    mine, theirs = flow(), flow()
    o_mine = kernels.recurrent_gated_delta_rule(mine.verify_args(mix, blogit, g, "rne", 0, None, (a, A_log, dt_bias)))
    o_theirs = load_kernel("sglang-replayssm-triton")(theirs.verify_args(mix, blogit, g, "rne", 0, None,
                                                                        (a, A_log, dt_bias)))
    pm, pt = mine.pool, theirs.pool
    rec = lambda p, hi, lo: getattr(p, hi).float() + getattr(p, lo).float()
    d_rel = rel(rec(pt, "ring_d", "ring_d_lo"), rec(pm, "ring_d", "ring_d_lo"))
    k_rel = rel(rec(pt, "ring_k", "ring_k_lo"), rec(pm, "ring_k", "ring_k_lo"))
    d_off = rel(rec(pt, "ring_d", "ring_d_lo").roll(1, 3), rec(pm, "ring_d", "ring_d_lo"))
    print("verify", rel(o_theirs[:, :R], o_mine[:, :R]), o_theirs[:, R:].abs().max().item(),
          (pt.ring_g - pm.ring_g).abs().max().item(), d_rel, k_rel, d_off)
    c1, c2 = flow(), flow()
    for f in (c1, c2):
        for n, t in f.pool.ring_tensors().items():
            t.copy_(pm.ring_tensors()[n])
    last = torch.tensor([0, 3, 1, 2] + [-1] * (N - R))
    steps = torch.tensor([-1, 1, 0, -1] + [-1] * (N - R))
    trunc = flow()
    for n, t in trunc.pool.ring_tensors().items():
        t.copy_(pm.ring_tensors()[n])
    rs.sglang_0523_replayssm(c1.harness, last, c1.pool.row_track_slots, steps)
    eng.sglang_commit(c2.harness, last, c2.pool.row_track_slots, steps)
    same_cursors = all(torch.equal(c1.pool.ring_tensors()[n], c2.pool.ring_tensors()[n])
                       for n in ("write_pos", "cache_base", "is_flush"))
    slots = torch.cat([c1.pool.active_slots, c1.pool.row_track_slots[1:3]])
    x, y = c2.pool.states[:, slots].float(), c1.pool.states[:, slots].float()
    ulp = 2.0 ** (torch.floor(torch.log2(torch.maximum(x.abs(), y.abs()).clamp_min(1e-30))) - 7)
    c = rs.Commit(trunc.harness, torch.clamp(last + 1, min=0), last, None, None)
    rs.advance_cursors(c)
    d, kh, kl, gg = rs._records(c)
    old = trunc.pool.states.index_select(1, trunc.pool.active_slots).float()
    fold = rs.compensated_fold(old, d[:, :R], kh[:, :R], kl[:, :R], gg[:, :R], trunc.pool.write_pos[:R].long())
    truncated = kernels.round_to(fold, torch.bfloat16, "truncate").float()
    print("commit", same_cursors, (x == y).float().mean().item(), ((x - y).abs() / ulp).max().item(),
          (x[:, :R] == truncated).float().mean().item())
    rep = run_checked(resolve(cfg.replace(steps=8), "drift.plug.replayssm_engine:sglang_commit",
                              "sglang-replayssm-triton"), sync_scan=False)
    own = run_checked(resolve(cfg.replace(steps=8)), sync_scan=False)  # drift's rendering, same steps
    said = ("mended by drift" in rep.info.update and "mended by drift" in rep.info.verify_kernel
            and "interpreter" not in own.info.update + own.info.verify_kernel)
    print("said", said)
    print("run", " ".join(f"{c.key}={c.passed}" for c in rep.checks),
          find_result(own.checks, "output_bound").worst, find_result(rep.checks, "output_bound").worst)
    """)
    verify, commit, said, run = (line.split() for line in out.strip().splitlines()[-4:])
    # The header and report say the engine's kernels ran under drift's mended interpreter (the update's
    # commit kernels and the verify); drift's own rendering says no such thing (the control).
    assert said == ["said", "True"], out
    o_rel, pad, g_diff, d_rel, k_rel, d_off = map(float, verify[1:])
    # Outputs: the kernel's output path takes q and the checkpoint as bf16 tensor-core operands (a
    # 16-bit checkpoint: q_tile = q_precise.to(bf16)), 2^-9 relative each; measured 0.005 relative
    # (norm); 2^-6 allows a factor three.
    assert o_rel <= 2 ** -6 and pad == 0.0, verify
    # g: the kernel's fp32 softplus/exp against drift's float64 gating rounded once: fp32 ulps of |g|
    # <= 1 (measured 6e-8); records: compensated (high + low) deltas and keys, ~2^-16 relative from
    # the chunked form's fp32 sums against drift's recurrence (measured 3e-6 and 2e-7); 2^-12 leaves
    # a factor of ten. Negative control: the same records one ring position off are order-one apart.
    assert g_diff <= 2 ** -20 and d_rel <= 2 ** -12 and k_rel <= 2 ** -12 and d_off > 0.5, verify
    same_cursors, equal, worst, equal_trunc = commit[1] == "True", *map(float, commit[2:])
    # The same fold in another fp32 summation order straddles a bf16 rounding boundary for a few
    # elements (measured 0.99997 equal): one ulp at most. Truncation drops half an ulp on average.
    assert same_cursors and equal >= 0.995 and worst <= 1.0 and equal_trunc < 0.8, commit
    verdicts = dict(kv.split("=") for kv in run[1:-2])
    state_side = ("finite_states", "golden", "committed_state", "outputs", "conv_windows", "tracked_snapshots",
                  "drift_bound", "untouched_slots")
    assert all(verdicts[k] == "True" for k in state_side), run
    # The kernel's output path multiplies q rounded to bf16 with the bf16 checkpoint, a 2^-9 relative
    # rounding drift's op does not make (docs/semantics.md §6): over the same 8 steps its output error
    # sits higher against the same output bound than drift's rendering's (measured 0.997 against 0.660,
    # 1.51x, 2026-12-06; the state checks above agree). 1.3x keeps about 40% of that excess as margin:
    # if SGLang compensates the output path, the two meet and the docs must say so.
    own, kernel = float(run[-2]), float(run[-1])
    assert kernel >= 1.3 * own, run
