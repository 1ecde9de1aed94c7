"""Helpers the test modules import (``from helpers import ...``): small configs and runs, bit views
and digests, the fp32 GDN error bounds, one verify-case factory and one conformance assertion for
every kernel test. Deterministic: fixed seeds, explicit dtypes, small shapes."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

import torch

from drift import preset
from drift.check.checks import core_checks
from drift.check.result import CheckResult
from drift.dtypes import as_bits
from drift.flows.copy_commit.rule import NpuRule
from drift.flows.in_place.rule import BlockRule
from drift.flows.registry import FLOWS, default_update
from drift.plug.loader import Conformance
from drift.runner import run_checked
from drift.runspec import resolve
from drift.sim.kernels import VerifyArgs
from drift.simulate import Simulation

BF16 = torch.bfloat16
DEFAULT_UPDATE = default_update(FLOWS["sglang"].kind)  # the update ci-small's flow runs by default


def blocks_case(seed=5, L=2, B=3, S=4, HK=1, HV=2, K=16, V=16, blocks=16):
    """VerifyArgs by vLLM's rule: one cache of blocks (recurrent and scratch the same storage), row 2 NULL
    (bf16 mix_qkv, beta logits and cache, fp32 g, int32 indices ``[B, S]``, accept counts 2, 4, 1)."""
    g = torch.Generator().manual_seed(seed)
    C = 2 * HK * K + HV * V
    cache = torch.randn(L, blocks, HV, V, K, generator=g).to(torch.bfloat16)
    idx = torch.tensor([[3, 7, 1, 9], [12, 4, 15, 2], [0, 0, 0, 0]], dtype=torch.int32)
    return VerifyArgs(torch.randn(L, B, S, C, generator=g).to(torch.bfloat16),
                              torch.randn(L, B, S, HV, generator=g).to(torch.bfloat16), -torch.rand(L, B, S, HV, generator=g),
                              cache, cache.unsqueeze(2), idx[:, 0].clone(), idx, torch.tensor([2, 4, 1], dtype=torch.int32),
                              torch.full((B,), S, dtype=torch.int32), HK, HV, K ** -0.5, rule=BlockRule())


def verify_case(seed: int = 3, L: int = 2, slots: int = 7, B: int = 3, S: int = 4, HK: int = 1, HV: int = 2,
                K: int = 16, V: int = 16, accepted=(1, 1, 1)) -> VerifyArgs:
    """VerifyArgs over a small random pool, as SGLang's Ascend backend builds them: bf16 mix_qkv
    ``[L, B, S, C]`` and beta logit ``[L, B, S, HV]``, fp32 g, bf16 committed states ``[L, slots, HV,
    V, K]`` and scratch ``[L, B + 1, S, HV, V, K]``, int32 cache indices (row 2 on the dummy slot 0),
    ``ssm_state_indices = arange(B * S)``; ``accepted``: num_accepted_tokens per row (all 1: SGLang's
    flow; other counts: the accepted-count flow)."""
    g = torch.Generator().manual_seed(seed)
    C = 2 * HK * K + HV * V
    args = VerifyArgs(torch.randn(L, B, S, C, generator=g).to(BF16), torch.randn(L, B, S, HV, generator=g).to(BF16),
                      -torch.rand(L, B, S, HV, generator=g), torch.randn(L, slots, HV, V, K, generator=g).to(BF16),
                      torch.randn(L, B + 1, S, HV, V, K, generator=g).to(BF16),
                      torch.tensor([4, 1, 0][:B], dtype=torch.int32),
                      torch.arange(B * S, dtype=torch.int32).view(B, S), torch.tensor(accepted, dtype=torch.int32),
                      torch.full((B,), S, dtype=torch.int32), HK, HV, K ** -0.5, rule=NpuRule())
    # The raw gate inputs of that g, for a kernel that computes its gating (A_log = dt_bias = 0:
    # g = -softplus(a), so a = log(expm1(-g)) in float64); no draw of the generator changes.
    a = torch.log(torch.expm1(-args.g.double())).float()
    return replace(args, gate_inputs=(a, torch.zeros(L, HV), torch.zeros(L, HV)))


def clone_case(args: VerifyArgs) -> VerifyArgs:
    """The same case with its own copies of the state tensors the kernel writes."""
    return replace(args, recurrent_state=args.recurrent_state.clone(), intermediate_state=args.intermediate_state.clone())


def assert_conforms(kernel, reference, args: VerifyArgs, conformance: Conformance) -> None:
    """``kernel`` and ``reference`` on copies of ``args``: stored scratch states and outputs within
    ``conformance``; the committed states never written (the op writes only the scratch)."""
    got, ref = clone_case(args), clone_case(args)
    out, ref_out = kernel(got), reference(ref)
    B = args.cache_indices.shape[0]
    c = conformance
    torch.testing.assert_close(got.intermediate_state[:, :B].float(), ref.intermediate_state[:, :B].float(),
                               rtol=c.state_rtol, atol=c.state_atol, msg=lambda m: f"scratch states ({c.why}): {m}")
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=c.output_rtol, atol=c.output_atol,
                               msg=lambda m: f"outputs ({c.why}): {m}")
    assert same_bits(got.recurrent_state, args.recurrent_state), \
        "the kernel wrote the committed states"


TESTS_DIR = Path(__file__).resolve().parent
FIXTURES = TESTS_DIR / "fixtures"
BAD_UPDATES = FIXTURES / "bad_updates.py"
TOY_EXTENSION = FIXTURES / "toy_extension.py"  # loaded through $DRIFT_EXTENSIONS (the toy fixture, tests/conftest.py)


def loaded_for_one_test(monkeypatch, path, registries):
    """A fixture body: the extension at ``path`` named in $DRIFT_EXTENSIONS for one test; the entries
    it added to ``registries`` and its module removed afterwards."""
    import sys

    from drift.plug import extensions

    monkeypatch.setenv(extensions.ENV, str(path))
    before = {r: set(r) for r in registries}
    yield
    for reg, names in before.items():
        for name in set(reg) - names:
            reg.unregister(name)
    extensions._loaded.pop(str(path), None)
    sys.modules.pop(next((m for m, mod in sys.modules.items()
                          if getattr(mod, "__file__", None) == str(path)), ""), None)

U32 = 2.0 ** -24  # fp32 unit roundoff
U64 = 2.0 ** -53  # float64 unit roundoff

# Small ci-small variant: 1 GDN layer, K = V = 16, everything else as the preset
# (4 request rows + 1 padded row, 4 value heads from fast to slow decay, D = 4,
# conv kernel 4, track interval 16).
SMALL = dict(num_layers=1, head_k_dim=16, head_v_dim=16)


def small_cfg(steps: int = 200, profile: Optional[str] = None, **overrides):
    """``ci-small`` shrunk to :data:`SMALL`, with ``steps`` and any field overrides."""
    cfg = preset("ci-small", steps=steps, **{**SMALL, **overrides})
    return cfg.with_profile(profile) if profile else cfg


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bits(a), as_bits(b))


def digest(*tensors: torch.Tensor) -> str:
    """SHA-1 of the logical contents (dtype, shape and bytes) of tensors."""
    h = hashlib.sha1()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(as_bits(t).numpy().tobytes())
    return h.hexdigest()


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bfloat16 numbers at |x| (normal range): |x| = m 2^e, m in [0.5, 1),
    8 significant bits, so ulp = 2^(e - 8)."""
    _, e = torch.frexp(x.to(torch.float64).abs())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), e - 8)


def gdn_state_bound(t, K: int, h_norm, v_norm, u: float = U32):
    """Frobenius error bound of a fp state after t gated delta-rule tokens computed with unit
    roundoff u (tests/sim/test_kernels.py docstring): t (K + 6) u (||h|| + ||v||)."""
    return t * (K + 6) * u * (h_norm + v_norm)


def verify_bounds(ref_inter: torch.Tensor, v: torch.Tensor):
    """For a float32 GDN verify of n rows against its float64 result ``ref_inter [L, n, D, HV, K, V]``
    (v ``[L, n, D, HV, V]``): the state bound after each token ``[L, n, D, HV]`` (gdn_state_bound
    with the largest ||h||, ||v|| over the tokens) and the output bound
    ``K^-1/2 (state bound + K u32 ||h||)`` (||q|| <= K^-1/2)."""
    K = ref_inter.shape[-2]
    h_norm = ref_inter.norm(dim=(-1, -2)).amax(2, keepdim=True)  # max over tokens [L, n, 1, HV]
    v_norm = v.double().norm(dim=-1).amax(2, keepdim=True)
    t = torch.arange(1, ref_inter.shape[2] + 1, dtype=torch.float64)[None, None, :, None]
    state = gdn_state_bound(t, K, h_norm, v_norm)
    return state, K ** -0.5 * (state + K * U32 * h_norm)


def rel_fro(a: torch.Tensor, b: torch.Tensor, dims=(-1, -2)) -> torch.Tensor:
    """||a - b||_F / ||b||_F over ``dims`` (float64)."""
    a, b = a.to(torch.float64), b.to(torch.float64)
    return (a - b).norm(dim=dims) / b.norm(dim=dims)


class StepHook:
    """Observer that calls ``fn(sim, view)`` after every step's update."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.sim = None

    def on_start(self, sim) -> None:
        self.sim = sim

    def on_step(self, view) -> None:
        self.fn(self.sim, view)

    def flush(self) -> None:
        pass

    def on_end(self) -> None:
        pass


def run_sim(cfg, update=DEFAULT_UPDATE, on_step: Optional[Callable] = None, kernel=None, mode: str = "mtp",
            **kwargs) -> Simulation:
    """Build (``cfg`` resolved with ``update``, ``kernel`` and ``mode``) and run a simulation;
    ``on_step(sim, view)`` sees every step."""
    observers = [StepHook(on_step)] if on_step is not None else []
    sim = Simulation(resolve(cfg, update, kernel, mode), observers=observers, **kwargs)
    sim.info = sim.run()
    return sim


def pool_digests(cfg, update=DEFAULT_UPDATE, **kwargs) -> list[str]:
    """Per step: digest of the whole pool (committed states, conv windows, scratch) and
    the step's outputs."""
    out: list[str] = []
    run_sim(cfg, update, on_step=lambda sim, view: out.append(
        digest(sim.pool.temporal, sim.pool.conv, sim.pool.intermediate_ssm, view.out)), **kwargs)
    return out


def committed_by_position(cfg, **kwargs) -> dict:
    """Run ``cfg`` and return ``{(row, position): committed state}`` (float64,
    ``[L, HV, K, V]``) for every position some step committed."""
    states: dict = {}

    def grab(sim, view):
        st = sim.pool.states[:, sim.pool.active_slots].to(torch.float64)
        for r, pos in enumerate(view.pre + view.accept):
            states[(r, int(pos))] = st[:, r].clone()

    run_sim(cfg, on_step=grab, **kwargs)
    return states


def checks_of(cfg, update=DEFAULT_UPDATE, kernel=None, mode: str = "mtp", **kwargs) -> dict[str, CheckResult]:
    """``run_checked`` with the semantic core checks (not the drift bound, which is
    calibrated on the presets' shapes, not on these small configs; nor the host-sync scan,
    which tests/syncs/test_syncs.py covers) as a dict check key -> result, plus the report under
    'report'."""
    kwargs.setdefault("checks", core_checks())
    kwargs.setdefault("sync_scan", False)
    rep = run_checked(resolve(cfg, update, kernel, mode), **kwargs)
    out = {c.key: c for c in rep.checks}
    out["report"] = rep
    return out


def bad_spec(name: str) -> str:
    """File spec of a known-bad update in tests/fixtures/bad_updates.py."""
    return f"{BAD_UPDATES}:{name}"


def naive_of(args: VerifyArgs, dtype: torch.dtype = torch.float64, store=None):
    """The naive reference of ``args.rule``'s flow kind (``FlowKind.naive``) on a ``dtype`` copy of
    the scratch: (outputs ``[L, B, S, HV, V]``, the scratch blocks it wrote ``[L, I, HV, V, K]``)."""
    from drift.flows.registry import FLOW_KINDS
    from drift.sim.kernels import scratch_blocks

    kind = next(k for k in FLOW_KINDS.values() if isinstance(args.rule, k.RULE))
    blocks = scratch_blocks(args.intermediate_state).to(dtype, copy=True)
    L, I = blocks.shape[:2]
    D = args.intermediate_state.shape[2]
    inter = blocks.view(L, I // D, D, *blocks.shape[2:]) if D else args.intermediate_state
    out = kind.naive(replace(args, intermediate_state=inter), dtype, store)
    return out, blocks


def figures(rep) -> dict:
    """A report's verdicts and figures per check, the scan-dependent ones (host syncs, graph capture) left out."""
    return {c.key: (c.passed, c.worst, c.where) for c in rep.checks if c.key not in ("host_syncs", "graph_capture")}


def resumed_from_checkpoint(cfg, path: Path, every: int):
    """``cfg`` run whole, and run again from the checkpoint file ``path`` (no pickle) a first run wrote at
    its first ``every``-step boundary: (the uninterrupted report, the resumed report)."""
    from drift import checkpoint
    from drift.runner import CheckedRun

    whole = CheckedRun(resolve(cfg))
    whole_rep = whole.report(whole.run(), sync_scan=False)
    first = CheckedRun(resolve(cfg))
    first.run(checkpoint=lambda done, snap: checkpoint.save(path, snap) if not path.exists() else None,
              checkpoint_every=every)
    resumed = CheckedRun(resolve(cfg))
    return whole_rep, resumed.report(resumed.run(resume_state=checkpoint.load(path)), sync_scan=False)


def python_json(code: str, drop: tuple = (), **env) -> dict:
    """Run ``code`` in a fresh interpreter (the environment less the variables ``drop`` names, plus ``env``);
    the JSON it prints last. For what must start in a process of its own: one that may fork (an xdist
    worker has threads), or whose imports are observed."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**{k: v for k, v in os.environ.items() if k not in drop}, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def threads_inside(monkeypatch, owner, method: str, call: Callable[[], object]) -> tuple[list[int], int, object]:
    """Torch's intra-op thread count each time ``owner.method`` runs during ``call()``, started from two threads
    with no ``OMP_NUM_THREADS`` (a user's count stands in drift.openmp.run_threads; tests/conftest.py sets one);
    returns (those counts, the count after ``call``, what it returned). The count is restored afterwards."""
    seen, real = [], getattr(owner, method)

    def spy(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(owner, method, spy)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        result = call()
        return seen, torch.get_num_threads(), result
    finally:
        torch.set_num_threads(before)
