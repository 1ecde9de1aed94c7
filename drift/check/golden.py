"""Golden trajectories: the true state of every request at every position, float64 -> float32.

Per PR-gating preset and default seed, ``golden/`` holds one ``.npz`` with

  proj_state  ``[P+1, L, R, HV]``  ``w^T S_p u`` for the state ``S_p [V, K]`` after p tokens (fixed
                                   random unit vectors ``proj_u [L, HV, K]``, ``proj_w [L, HV, V]``)
  state_norm  ``[P+1, L, R, HV]``  ``||S_p||_F``
  proj_out    ``[P, L, R, HV]``    ``o_p . proj_wo`` for the output of token p
  ckpt_pos    ``[n]``              every CHECKPOINT_EVERY positions, with full
  ckpt_state  ``[n, L, R, HV, V, K]``, ckpt_window ``[n, L, R, Kc-1, C]``, ckpt_out ``[n, L, R, HV, V]``

which pins the committed state at every position any acceptance pattern can reach in
the preset's horizon (the truth does not depend on acceptance). ``golden/manifest.json``
records schema, generator version, preset, seed, config hash, versions, creation time
and each file's sha256 and size.

The generator is a second, independent transcription of docs/semantics.md §5 and §10 in
float64 (its own conv, gating, quantisation of the op's inputs, norms and recurrence; no code
shared with drift.sim.kernels beyond the input stream), run one position at a time on one
thread so regeneration is byte-for-byte reproducible. At run time the float64 twin is
validated against it.

A replayed trace (``cfg.trace``, drift.sim.stream) has its golden data beside it: for
``DIR/NAME.npz`` the directory ``DIR/NAME.golden/`` with its own ``manifest.json`` (same schema,
same generator, same array format, covering every position of the trace), one entry per
``trace/seed<S>/<stream_hash>`` -- the hash covers the trace's sha256 and the replayed layers and
sequences, so golden data of one trace never serves another. :func:`load_golden` generates a
missing entry on first use (saying so on stderr, written atomically; review it with ``drift
regen-golden --trace NAME.npz``, which prints the diff against what is stored and overwrites a
changed entry only with ``--force``); a damaged one raises :class:`GoldenError` naming the file.

Serving lifecycle (a churning ``cfg.lifecycle``, drift/lifecycles.py). A request's truth depends on
its own tokens only (drift.sim.stream: a prefix-cache hit's first ``P`` positions are its source's
tokens), so the golden data of a serving run is per request id, and the PR gate's requests are
learnt by running :class:`drift.sim.serving.ServingSchedule` on the host with the stream's accept
lengths over the preset's horizon. Lane ``r``'s first request is request ``r`` with the fixed batch's
prompt and tokens: requests ``0 .. R-1`` are the fixed entry's rows, at every position (the serving
run reads the fixed entry for them). The serving entry, ``NAME/seed<S>/<lifecycle>``, holds for every
later request what the gate compares (:func:`serving_entry`):

  sched_*        ``[NS]``             every start of the horizon (step, lane, request, START_* code,
                                      prefix source, shared positions, start position), in step order
  key_request, key_position ``[M]``   (request, position) of every committed position of a request
                                      ``>= R`` (one per decode step it runs) and of every start of one
  key_proj_state, key_state_norm, key_proj_out ``[M, L, HV]``   the state projection and norm there and
                                      the output projection of the token before it (a step's last
                                      accepted token)
  start_ckpt ``[n]``, start_state ``[n, L, HV, V, K]``, start_window ``[n, L, Kc-1, C]``
                                      full checkpoints at ``n`` starts after step 0 (indices into
                                      sched_*): the first ones of each kind (prefill, prefix hit,
                                      resume) in turn, SERVING_CHECKPOINTS at most, as many as fit in
                                      SERVING_CHECKPOINT_BYTES

A run validates its float64 twin lane by lane: at each step the lane's request and committed
position pick the golden row (the fixed entry's for a lane's first request, a key otherwise); at
each start the twin's fresh lane (a prefill, a prefix hit's restored and extended snapshot, a
resume's own state) is compared with the projection stored for its start position and, where there
is one, with the full checkpoint (state, and the conv window bit for bit); and the run's start is
compared with the schedule the data was made for. The outputs of the other accepted tokens of a
later request, and its positions between steps, are the twin's alone: the budget. Measured at seed
0, the serving entries take ci-small 1.9 MB (90 requests, 10,231 keys, 6 start checkpoints of 140 kB),
ci-heads 1.4 MB, stagnation 0.3 MB, golden/ 15.5 MB of its 16 MiB; every position of ci-small's
later requests alone (64,715) would take 6.2 MB.

Each request is computed from position 0 over its own tokens (a prefix hit's through its source's):
the generator models no prefix cache, snapshot or resume, so the twin's handling of them is checked
against a computation that has none.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.resources
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from ..config import PRESETS, Config, preset
from ..errors import DriftError, GoldenError, WriteError, raise_if_interrupted
from ..fileio import atomic_write_bytes, atomic_write_json, load_npz, npz_bytes, read_bytes, read_json
from ..lifecycles import DEFAULT_LIFECYCLE
from ..sim.stream import StreamParams, TrueTokens, accept_lengths, draft_counts, max_position
from ..sim.tracefile import trace_paths

SCHEMA = 1
GENERATOR_VERSION = "2"  # 2: the op's quantised inputs (bf16 mix_qkv, fp32 g), [V, K] states
CHECKPOINT_EVERY = 4096  # positions between full-state checkpoints
GOLDEN_PRESETS = ("ci-small", "ci-heads", "stagnation")  # the PR-gating presets
# ... and the lifecycles they gate under: the fixed batch and the serving lifecycle the gate runs by default
GOLDEN_LIFECYCLES = ("fixed", DEFAULT_LIFECYCLE)
REGEN_HINT = "drift regen-golden --preset {name} --force"
SERVING_CHECKPOINTS = 6  # full checkpoints at request starts per serving entry: two of each kind ...
SERVING_CHECKPOINT_BYTES = 1 << 20  # ... as many of them as fit in 1 MiB
F64 = torch.float64


def golden_dir() -> Path:
    """``$DRIFT_GOLDEN_DIR`` if set, else the golden data shipped with drift: the package
    ``drift._golden`` (the repository's ``golden/``, mapped into the wheel; editable installs
    map it to the folder itself)."""
    env = os.environ.get("DRIFT_GOLDEN_DIR")
    if env:
        return Path(env)
    try:
        return Path(str(importlib.resources.files("drift._golden")))
    except ModuleNotFoundError:  # run from a source tree without an install: the folder beside drift/
        return Path(__file__).resolve().parents[2] / "golden"


def _entry_key(name: str, seed: int, lifecycle: str = "fixed") -> str:
    """The manifest key: ``NAME/seed<S>`` for the fixed batch (as before lifecycles existed),
    ``NAME/seed<S>/<lifecycle>`` for a churning lifecycle's serving entry."""
    return f"{name}/seed{seed}" if lifecycle == "fixed" else f"{name}/seed{seed}/{lifecycle}"


# ------------------------------------------------------------------ generator
def projection_vectors(cfg: Config) -> dict[str, np.ndarray]:
    """Fixed random unit vectors (float32) for the two-sided state and output projections."""
    rng = np.random.default_rng([cfg.seed, 0x901D])
    out = {}
    for name, dim in (("proj_u", cfg.head_k_dim), ("proj_w", cfg.head_v_dim), ("proj_wo", cfg.head_v_dim)):
        x = rng.standard_normal((cfg.num_layers, cfg.num_v_heads, dim))
        out[name] = (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)
    return out


def _golden_step(cfg: Config, prm: dict, S: torch.Tensor, window: torch.Tensor, x, a, b):
    """One true token for every (layer, request), float64, written from the formulas.

    S ``[L, R, HV, V, K]``, window ``[L, R, Kc-1, C]``, x ``[L, R, C]``, a/b ``[L, R, HV]``.
    The op's inputs are quantised as the deployment feeds them (docs/semantics.md §10): the conv
    output to fp32 then bf16, g to fp32, b is on the bf16 grid already.
    Returns (new S, new window, output ``[L, R, HV, V]``).
    """
    HK, K, HV, V, Kc = cfg.num_k_heads, cfg.head_k_dim, cfg.num_v_heads, cfg.head_v_dim, cfg.conv_kernel
    seq = torch.cat([window, x[:, :, None, :]], dim=2)  # [L, R, Kc, C]
    conv = sum(prm["conv_weight"][:, None, :, m] * seq[:, :, m, :] for m in range(Kc))
    act = conv / (1.0 + torch.exp(-conv))  # SiLU
    mix = act.to(torch.float32).to(torch.bfloat16).to(F64)  # the op's bf16 mix_qkv
    L, R = mix.shape[:2]
    q = mix[..., : HK * K].reshape(L, R, HK, K)
    k = mix[..., HK * K: 2 * HK * K].reshape(L, R, HK, K)
    v = mix[..., 2 * HK * K:].reshape(L, R, HV, V)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / math.sqrt(K)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    group = HV // HK
    q = q[:, :, [hv // group for hv in range(HV)]]
    k = k[:, :, [hv // group for hv in range(HV)]]
    z = a + prm["dt_bias"][:, None, :]
    softplus = torch.where(z > 20.0, z, torch.log1p(torch.exp(torch.clamp(z, max=20.0))))
    g = (-torch.exp(prm["A_log"])[:, None, :] * softplus).to(torch.float32).to(F64)  # the op's fp32 g
    decay = torch.exp(g)
    beta = 1.0 / (1.0 + torch.exp(-b))
    S = S * decay[..., None, None]
    Sk = torch.einsum("lrhvk,lrhk->lrhv", S, k)
    S = S + torch.einsum("lrhv,lrhk->lrhvk", (v - Sk) * beta[..., None], k)
    o = torch.einsum("lrhvk,lrhk->lrhv", S, q)
    return S, seq[:, :, 1:], o


def generate(cfg: Config, steps: Optional[int] = None, positions: Optional[int] = None,
             checkpoint_every: int = CHECKPOINT_EVERY) -> dict[str, np.ndarray]:
    """The golden arrays for ``cfg`` over ``steps`` decode steps (default: the preset's), or over
    exactly ``positions`` positions when given (a trace: all of its tokens); a full checkpoint
    every ``checkpoint_every`` positions."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # fixed reduction order: byte-identical regeneration
    try:
        return _generate(cfg, steps, positions, checkpoint_every)
    finally:
        torch.set_num_threads(threads)


def _generate(cfg: Config, steps: Optional[int], positions: Optional[int] = None,
              checkpoint_every: int = CHECKPOINT_EVERY) -> dict[str, np.ndarray]:
    L, R, HV, K, V = cfg.num_layers, cfg.num_requests, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim
    P = max_position(cfg, steps) if positions is None else int(positions)
    params = StreamParams.generate(cfg)
    prm = {k: getattr(params, k).to(F64) for k in ("A_log", "dt_bias", "conv_weight")}
    vec = projection_vectors(cfg)
    u, w, wo = (torch.from_numpy(vec[k]).to(F64) for k in ("proj_u", "proj_w", "proj_wo"))
    tokens = TrueTokens(cfg)
    h = torch.zeros(L, R, HV, V, K, dtype=F64)
    window = torch.zeros(L, R, cfg.conv_kernel - 1, cfg.conv_channels, dtype=F64)
    proj_state = np.zeros((P + 1, L, R, HV), np.float32)
    state_norm = np.zeros((P + 1, L, R, HV), np.float32)
    proj_out = np.zeros((P, L, R, HV), np.float32)
    ckpt_pos = np.arange(checkpoint_every, P + 1, checkpoint_every, dtype=np.int64)
    ckpt_state = np.zeros((len(ckpt_pos), L, R, HV, V, K), np.float32)
    ckpt_window = np.zeros((len(ckpt_pos), L, R, cfg.conv_kernel - 1, cfg.conv_channels), np.float32)
    ckpt_out = np.zeros((len(ckpt_pos), L, R, HV, V), np.float32)
    block = 256
    for p0 in range(0, P, block):
        raise_if_interrupted()  # between blocks of positions: a swallowed interrupt still ends the job
        n = min(block, P - p0)
        got = [tokens.get(r, p0, p0 + n) for r in range(R)]
        xs, as_, bs = (torch.from_numpy(np.stack([g[i] for g in got], 2)).to(F64) for i in range(3))  # [n, L, R, .]
        for j in range(n):
            p = p0 + j
            h, window, o = _golden_step(cfg, prm, h, window, xs[j], as_[j], bs[j])
            proj_state[p + 1] = torch.einsum("lhv,lrhvk,lhk->lrh", w, h, u).numpy()
            state_norm[p + 1] = torch.linalg.vector_norm(h, dim=(-2, -1)).numpy()
            proj_out[p] = torch.einsum("lrhv,lhv->lrh", o, wo).numpy()
            if (p + 1) % checkpoint_every == 0:
                c = (p + 1) // checkpoint_every - 1
                ckpt_state[c], ckpt_window[c], ckpt_out[c] = h.numpy(), window.numpy(), o.numpy()
    return {"proj_state": proj_state, "state_norm": state_norm, "proj_out": proj_out,
            "ckpt_pos": ckpt_pos, "ckpt_state": ckpt_state, "ckpt_window": ckpt_window,
            "ckpt_out": ckpt_out, **vec}


# ----------------------------------------------------------- serving lifecycle
SCHED_FIELDS = ("step", "lane", "request", "code", "source", "p0", "p1")  # the sched_* arrays, in this order


def serving_schedule(cfg: Config, steps: Optional[int] = None) -> dict[str, np.ndarray]:
    """The starts and steps of ``cfg``'s serving lifecycle over ``steps`` decode steps (default: the
    config's), replayed on the host as a run replays them (drift.sim.serving.ServingSchedule with the
    stream's accept lengths; the batch order does not change which requests run, nor where): the
    ``sched_*`` arrays (int64 ``[NS]``, every start in step order, :data:`SCHED_FIELDS`), ``request``
    ``[S, R]`` (-1 idle), ``post`` ``[S, R]`` (the committed position after each step), and the request
    -> (source, shared positions) map of the prefix hits (``prefixes``)."""
    from ..sim.serving import START_PREFIX, ServingSchedule

    n = cfg.steps if steps is None else int(steps)
    sch = ServingSchedule(cfg)
    plan = sch.advance(accept_lengths(cfg, 0, n), draft_counts(cfg, 0, n))
    step, lane = np.nonzero(plan.start)  # row-major: step order, then lane
    code = plan.start[step, lane]
    out = {"sched_step": step, "sched_lane": lane, "sched_request": plan.request[step, lane], "sched_code": code,
           "sched_source": plan.source[step, lane],
           "sched_p0": np.where(code == START_PREFIX, plan.prefix[step, lane], 0), "sched_p1": plan.pre[step, lane]}
    out = {k: np.ascontiguousarray(v, dtype=np.int64) for k, v in out.items()}
    live = plan.request >= 0
    return {**out, "request": plan.request.copy(), "post": np.where(live, plan.pre + plan.accept, -1),
            "prefixes": dict(sch.prefixes)}


def start_checkpoints(cfg: Config, sched: dict) -> np.ndarray:
    """Which starts get a full checkpoint (indices into ``sched_*``): those after step 0 (the first
    requests' prefills at step 0 are the fixed entry's rows), the first of each kind -- prefill,
    prefix hit, resume -- in turn, then the second of each, ...: at most :data:`SERVING_CHECKPOINTS`,
    as many as fit in :data:`SERVING_CHECKPOINT_BYTES`."""
    L, HV, K, V, Kc, C = (cfg.num_layers, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim, cfg.conv_kernel,
                          cfg.conv_channels)
    per = 4 * L * (HV * V * K + (Kc - 1) * C)
    n = min(SERVING_CHECKPOINTS, SERVING_CHECKPOINT_BYTES // per)
    later = sched["sched_step"] > 0
    kinds = [np.nonzero(later & (sched["sched_code"] == c))[0].tolist() for c in sorted(set(sched["sched_code"].tolist()))]
    picked: list[int] = []
    for i in range(max((len(k) for k in kinds), default=0)):
        picked += [k[i] for k in kinds if i < len(k)]
    return np.array(sorted(picked[:n]), np.int64)


def serving_entry(cfg: Config, steps: Optional[int] = None) -> dict[str, np.ndarray]:
    """The serving entry's arrays for ``cfg`` (a churning lifecycle) over ``steps`` decode steps
    (default: the preset's); module docstring. One thread, as :func:`generate`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _serving_entry_arrays(cfg, steps)
    finally:
        torch.set_num_threads(threads)


def _serving_entry_arrays(cfg: Config, steps: Optional[int]) -> dict[str, np.ndarray]:
    if not cfg.serving.churn:
        raise ValueError(f"serving_entry needs a churning lifecycle, not {cfg.lifecycle!r}")
    L, R, HV, K, V = cfg.num_layers, cfg.num_requests, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim
    Kc, C = cfg.conv_kernel, cfg.conv_channels
    sched = serving_schedule(cfg, steps)
    req, post = sched["request"], sched["post"]
    later = req >= R  # a lane's first request is the fixed entry's row
    starts = sched["sched_request"] >= R
    kq = np.concatenate([req[later], sched["sched_request"][starts]])
    kp = np.concatenate([post[later], sched["sched_p1"][starts]])
    keys = np.unique(kq.astype(np.int64) << 32 | kp.astype(np.int64))  # sorted by (request, position)
    key_request, key_position = keys >> 32, keys & 0xFFFFFFFF
    ck = start_checkpoints(cfg, sched)
    ck_request, ck_position = sched["sched_request"][ck], sched["sched_p1"][ck]
    # Per request: the positions it must reach (its keys, its checkpoints), from position 0.
    wanted: dict[int, list[int]] = {}
    for q, p in zip(np.concatenate([key_request, ck_request]).tolist(), np.concatenate([key_position, ck_position]).tolist()):
        wanted.setdefault(int(q), []).append(int(p))
    params = StreamParams.generate(cfg)
    prm = {k: getattr(params, k).to(F64) for k in ("A_log", "dt_bias", "conv_weight")}
    vec = projection_vectors(cfg)
    u, w, wo = (torch.from_numpy(vec[k]).to(F64) for k in ("proj_u", "proj_w", "proj_wo"))
    tokens = TrueTokens(cfg, prefixes=sched["prefixes"])
    M, n = len(keys), len(ck)
    key_ps, key_sn, key_po = (np.zeros((M, L, HV), np.float32) for _ in range(3))
    start_state = np.zeros((n, L, HV, V, K), np.float32)
    start_window = np.zeros((n, L, Kc - 1, C), np.float32)
    key_at = {(int(q), int(p)): i for i, (q, p) in enumerate(zip(key_request.tolist(), key_position.tolist()))}
    ck_at = {(int(q), int(p)): i for i, (q, p) in enumerate(zip(ck_request.tolist(), ck_position.tolist()))}
    # Requests in groups of similar reach (longest first), each group stepped together.
    order = sorted(wanted, key=lambda q: (-max(wanted[q]), q))
    group, block = 4, 256
    for g0 in range(0, len(order), group):
        qs = order[g0:g0 + group]
        G, P = len(qs), max(max(wanted[q]) for q in qs)
        marks = {p: [] for q in qs for p in wanted[q]}  # position -> [(slot in group, request)]
        for i, q in enumerate(qs):
            for p in set(wanted[q]):
                marks[p].append((i, q))
        h = torch.zeros(L, G, HV, V, K, dtype=F64)
        window = torch.zeros(L, G, Kc - 1, C, dtype=F64)
        for p0 in range(0, P, block):
            raise_if_interrupted()
            m = min(block, P - p0)
            got = [tokens.get(q, p0, p0 + m) for q in qs]
            xs, as_, bs = (torch.from_numpy(np.stack([t[j] for t in got], 2)).to(F64) for j in range(3))  # [m, L, G, .]
            for j in range(m):
                p = p0 + j + 1  # the state after p tokens
                h, window, o = _golden_step(cfg, prm, h, window, xs[j], as_[j], bs[j])
                for i, q in marks.get(p, ()):
                    k = key_at.get((q, p))
                    if k is not None:
                        key_ps[k] = torch.einsum("lhv,lhvk,lhk->lh", w, h[:, i], u).numpy()
                        key_sn[k] = torch.linalg.vector_norm(h[:, i], dim=(-2, -1)).numpy()
                        key_po[k] = torch.einsum("lhv,lhv->lh", o[:, i], wo).numpy()
                    c = ck_at.get((q, p))
                    if c is not None:
                        start_state[c], start_window[c] = h[:, i].numpy(), window[:, i].numpy()
    out = {k: v for k, v in sched.items() if k.startswith("sched_")}
    out.update({"key_request": key_request.astype(np.int32), "key_position": key_position.astype(np.int32),
                "key_proj_state": key_ps, "key_state_norm": key_sn, "key_proj_out": key_po,
                "start_ckpt": ck, "start_state": start_state, "start_window": start_window, **vec})
    return out


def serving_coverage(golden: "Golden", cfg: Config, steps: Optional[int] = None) -> list[str]:
    """What ``golden`` (a serving golden, :func:`load_golden`) leaves uncovered of ``cfg``'s serving run
    over ``steps`` decode steps (default: the config's), one sentence per gap; empty when it covers
    every request the run has: its starts as scheduled, a lane's first request at every position it
    reaches (the fixed entry), every later request at each committed position and its start."""
    sched = serving_schedule(cfg, steps)
    a, R = golden.arrays, cfg.num_requests
    gaps = []
    horizon = min(golden.steps, cfg.steps if steps is None else int(steps))
    mine, theirs = (sched["sched_step"] < horizon), (a["sched_step"] < horizon)
    for f in SCHED_FIELDS:
        if not np.array_equal(sched[f"sched_{f}"][mine], a[f"sched_{f}"][theirs]):
            gaps.append(f"the starts of the first {horizon} steps differ from the golden's (sched_{f})")
            break
    req, post = sched["request"], sched["post"]
    first = (req >= 0) & (req < R)
    if first.any() and int(post[first].max()) > golden.max_position:
        gaps.append(f"a lane's first request reaches position {int(post[first].max())}, past the fixed entry's "
                    f"{golden.max_position}")
    later, starts = req >= R, sched["sched_request"] >= R
    want = set(zip(req[later].tolist(), post[later].tolist()))
    want |= set(zip(sched["sched_request"][starts].tolist(), sched["sched_p1"][starts].tolist()))
    lacking = sorted(want - set(zip(a["key_request"].tolist(), a["key_position"].tolist())))
    if lacking:
        gaps.append(f"{len(lacking)} committed or start positions of later requests have no key "
                    f"(the first: request {lacking[0][0]} at position {lacking[0][1]})")
    return gaps


# ------------------------------------------------------------------- loading
@dataclass
class Golden:
    """Loaded golden arrays (host numpy) with where they came from. A serving golden (``lifecycle``
    churning) holds the fixed entry's arrays (requests ``0 .. R-1``) and the serving entry's
    (``sched_*``, ``key_*``, ``start_*``; module docstring) together; ``path`` is the serving file's,
    ``fixed_path`` the fixed one's."""

    name: str
    seed: int
    steps: int
    path: Path
    arrays: dict
    regen_hint: str = ""  # the command that regenerates it (set for a trace's golden data)
    lifecycle: str = "fixed"
    fixed_path: Optional[Path] = None

    @property
    def serving(self) -> bool:
        """Whether it covers a churning lifecycle's requests (the serving entry's arrays are there)."""
        return "key_request" in self.arrays

    @property
    def max_position(self) -> int:
        return self.arrays["proj_state"].shape[0] - 1

    def describe(self) -> str:
        n = len(self.arrays['ckpt_pos'])
        if not self.serving:
            return (f"golden {self.path.name} (float64 truth stored as float32; positions 0..{self.max_position}, "
                    f"{n} full checkpoints)")
        a = self.arrays
        fixed = f"positions 0..{self.max_position}, {n} full checkpoint{'s' * (n != 1)}"
        return (f"golden {self.path.name} with {self.fixed_path.name if self.fixed_path else 'the fixed entry'} "
                f"(float64 truth stored as float32; the {self.lifecycle} lifecycle's "
                f"{len(np.unique(a['sched_request']))} requests over {self.steps} steps: the first "
                f"{a['proj_state'].shape[2]} at {fixed}, the later ones at their {len(a['key_request'])} "
                f"committed and start positions, {len(a['start_ckpt'])} full checkpoints at request starts)")


def _check_directory(directory: Path) -> None:
    """A golden directory that exists must be a directory (``$DRIFT_GOLDEN_DIR`` or ``--golden-dir``
    set to a file is named as such, not reported as missing golden data)."""
    if directory.exists() and not directory.is_dir():
        source = "$DRIFT_GOLDEN_DIR" if os.environ.get("DRIFT_GOLDEN_DIR") == str(directory) else "the golden directory"
        raise GoldenError(f"{source} {directory} is a file, not a directory; point it at a golden directory "
                          "(one holding manifest.json), or unset DRIFT_GOLDEN_DIR to use the golden data drift ships")


def plain_name(name: object) -> bool:
    """A manifest's file name: one plain name inside its directory (no separator, no ``..``, not absolute)."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name and Path(name).name == name and not os.path.isabs(name))


def _read_manifest(directory: Path, regen: Optional[str] = None) -> dict:
    """``directory/manifest.json`` checked (an empty one when there is none): strict JSON, the
    schema, every entry an object whose files are plain names inside ``directory``. ``regen``: the
    command that regenerates the data once the broken manifest is out of the way."""
    _check_directory(directory)
    path = directory / "manifest.json"
    regen = regen or f"drift regen-golden --force --golden-dir {directory}"
    fix = f"restore it from git, or move it aside and regenerate every entry: {regen}"
    if not os.path.lexists(path):
        return {"schema": SCHEMA, "generator_version": GENERATOR_VERSION, "entries": {}}
    manifest = read_json(path, "golden manifest", fix, GoldenError)
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        raise GoldenError(f"{path} has schema {manifest.get('schema') if isinstance(manifest, dict) else None!r}, "
                          f"this drift reads schema {SCHEMA}; {fix}")
    if not isinstance(manifest.get("entries"), dict):
        raise GoldenError(f"{path} has no 'entries' object; {fix}")
    for key, entry in manifest["entries"].items():
        files = entry.get("files") if isinstance(entry, dict) else None
        if not isinstance(files, dict):
            raise GoldenError(f"{path}: entry {key!r} has no 'files' object; {fix}")
        for name in files:
            if not plain_name(name):
                raise GoldenError(f"{path}: entry {key!r} names the file {name!r}, which is not a plain file name "
                                  f"inside {directory} (golden files live in the golden directory itself; drift "
                                  f"touches nothing outside it); {fix}")
    return manifest


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def requires_golden(cfg: Config) -> bool:
    """A PR-gating preset as it gates (its own seed, its trajectory, a lifecycle it gates under): golden
    data is mandatory."""
    return (cfg.name in GOLDEN_PRESETS and cfg.lifecycle in GOLDEN_LIFECYCLES and cfg.seed == preset(cfg.name).seed
            and _is_preset_config(cfg))


def _is_preset_config(cfg: Config) -> bool:
    """``cfg`` runs its preset's trajectory (and, under a churning lifecycle, its preset's requests)."""
    return cfg.name in PRESETS and cfg.stream_hash() == preset(cfg.name).replace(
        seed=cfg.seed, lifecycle=cfg.lifecycle).stream_hash()


def load_golden(cfg: Config, directory: Optional[Path] = None) -> tuple[Optional[Golden], str]:
    """The golden for ``cfg`` or None, with a sentence saying which and why.

    Raises GoldenError (naming the file and the regeneration command) when an entry exists
    but its file is missing, truncated, corrupted or stale for the preset it claims. Under a
    churning lifecycle both entries are read: the fixed one (the lanes' first requests) and the
    lifecycle's serving entry (every later request); a PR-gating preset needs both.
    """
    if cfg.trace:
        return _load_trace_golden(cfg, directory)
    directory = golden_dir() if directory is None else Path(directory)
    manifest = _read_manifest(directory)
    if not cfg.serving.churn:
        return _load_preset_entry(cfg, directory, manifest)
    fixed, note = _load_preset_entry(cfg.replace(lifecycle="fixed"), directory, manifest)
    if fixed is None:
        return None, note
    serving, note = _load_preset_entry(cfg, directory, manifest)
    if serving is None:
        return None, note
    for name in ("proj_u", "proj_w", "proj_wo"):
        if not np.array_equal(fixed.arrays[name], serving.arrays[name]):
            raise GoldenError(f"golden files {fixed.path} and {serving.path} hold different projection vectors "
                              f"({name}): they were not made for the same config; regenerate both: "
                              f"{REGEN_HINT.format(name=cfg.name)}")
    g = Golden(cfg.name, cfg.seed, serving.steps, serving.path, {**fixed.arrays, **serving.arrays},
               lifecycle=cfg.lifecycle, fixed_path=fixed.path)
    return g, g.describe()


def _load_preset_entry(cfg: Config, directory: Path, manifest: dict) -> tuple[Optional[Golden], str]:
    """The entry of ``cfg``'s preset, seed and lifecycle in ``manifest`` (the fixed entry for the fixed
    lifecycle, the serving entry for a churning one), or None and why."""
    churn = cfg.serving.churn
    entry = manifest["entries"].get(_entry_key(cfg.name, cfg.seed, cfg.lifecycle))
    which = f" (lifecycle {cfg.lifecycle})" if churn else ""
    if entry is None:
        if requires_golden(cfg):
            raise GoldenError(f"{directory / 'manifest.json'} has no golden data for the PR-gating preset "
                              f"{cfg.name} seed {cfg.seed}{which}; a PR-gating run needs it: regenerate it with "
                              f"`drift regen-golden --preset {cfg.name} --golden-dir {directory}`, or point "
                              "DRIFT_GOLDEN_DIR at the golden data drift ships")
        return None, f"no golden for preset {cfg.name!r} seed {cfg.seed}{which} in {directory}"
    hint = REGEN_HINT.format(name=cfg.name)
    if entry.get("config_hash") != cfg.stream_hash():
        if _is_preset_config(cfg):
            raise GoldenError(f"golden for {cfg.name} seed {cfg.seed}{which} was made from config hash "
                              f"{entry.get('config_hash')}, but the preset now hashes to {cfg.stream_hash()}: "
                              f"the preset changed; regenerate: {hint}")
        return None, (f"config differs from preset {cfg.name!r} in fields that shape the trajectory"
                      f"{' or the requests of its lifecycle' if churn else ''}; golden does not apply")
    g = _load_entry(cfg, directory, entry, hint)
    return g, "" if churn else g.describe()


def _load_entry(cfg: Config, directory: Path, entry: dict, hint: str) -> Golden:
    """The arrays of a manifest entry, every file check made (GoldenError naming the file and ``hint``)."""
    if entry.get("generator_version") != GENERATOR_VERSION:
        raise GoldenError(f"golden for {cfg.name} in {directory / 'manifest.json'} was made by generator "
                          f"{entry.get('generator_version')}, this drift is generator {GENERATOR_VERSION}; "
                          f"regenerate: {hint}")
    try:
        (fname, meta), = entry["files"].items()
        size, digest, steps = int(meta["size"]), str(meta["sha256"]), int(entry["steps"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise GoldenError(f"golden entry for {cfg.name} in {directory / 'manifest.json'} is malformed ({exc!r}); "
                          f"regenerate: {hint}") from exc
    path = directory / fname
    if not os.path.lexists(path):
        raise GoldenError(f"golden file {path} listed in manifest.json is missing; regenerate: {hint}")
    data = read_bytes(path, "golden file", f"restore it from git or regenerate: {hint}", GoldenError)
    if len(data) != size or _sha256(data) != digest:
        raise GoldenError(f"golden file {path} is truncated or corrupted (size {len(data)} vs "
                          f"{size}, sha256 mismatch={_sha256(data) != digest}); "
                          f"restore it from git or regenerate: {hint}")
    try:
        arrays = load_npz(path)
    except Exception as exc:
        raise GoldenError(f"golden file {path} cannot be read ({exc}); regenerate: {hint}") from exc
    _check_shapes(cfg, arrays, path, hint)
    return Golden(cfg.name, cfg.seed, steps, path, arrays)


# --------------------------------------------------------------- trace golden
def trace_golden_dir(trace: str | os.PathLike) -> Path:
    """Where a trace's golden data lives: ``DIR/NAME.golden/`` beside ``DIR/NAME.npz``."""
    npz, _ = trace_paths(trace)
    return npz.with_name(npz.stem + ".golden")


TRACE_CHECKPOINTS = 4  # full-state checkpoints spread over a trace ...
TRACE_CHECKPOINT_BYTES = 64 << 20  # ... as many of the 4 as fit in 64 MiB


def trace_checkpoint_every(cfg: Config) -> int:
    """Positions between full checkpoints of a trace's golden data: up to TRACE_CHECKPOINTS evenly
    over the trace (a trace is usually far shorter than CHECKPOINT_EVERY), as many as fit in
    TRACE_CHECKPOINT_BYTES (a full checkpoint of a large model is big); none past the trace."""
    L, R, HV, K, V, Kc, C = (cfg.num_layers, cfg.num_requests, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim,
                             cfg.conv_kernel, cfg.conv_channels)
    per = 4 * L * R * (HV * V * K + (Kc - 1) * C + HV * V)
    n = min(TRACE_CHECKPOINTS, TRACE_CHECKPOINT_BYTES // max(per, 1), cfg.trace_tokens)
    return max(1, cfg.trace_tokens // n) if n >= 1 else cfg.trace_tokens + 1


def _trace_key(cfg: Config) -> str:
    return f"trace/seed{cfg.seed}/{cfg.stream_hash()}"


def trace_regen_hint(cfg: Config) -> str:
    seed = f" --seed {cfg.seed}" if cfg.seed else ""
    return f"drift regen-golden --trace {cfg.trace}{seed} --force (or delete the entry's directory to start over)"


def _load_trace_golden(cfg: Config, directory: Optional[Path]) -> tuple[Golden, str]:
    directory = trace_golden_dir(cfg.trace) if directory is None else Path(directory)
    hint = trace_regen_hint(cfg)
    manifest = _read_manifest(directory, hint)
    key = _trace_key(cfg)
    entry = manifest["entries"].get(key)
    if entry is None:
        print(f"drift: no golden data for trace {cfg.trace} (seed {cfg.seed}, {cfg.num_layers} layers, "
              f"{cfg.num_requests} sequences) in {directory}: generating it now from the trace (float64, "
              f"{cfg.trace_tokens} positions); review it with drift regen-golden --trace {cfg.trace}",
              file=sys.stderr, flush=True)
        try:
            write_trace_golden(cfg, directory, force=False, out=sys.stderr)
        except WriteError:  # names the file and the cause (a full disk) itself
            raise
        except OSError as exc:
            raise GoldenError(f"cannot write the golden data of trace {cfg.trace} into {directory} "
                              f"({exc.strerror or exc}); copy the trace (NAME.npz and NAME.json) into a writable "
                              "directory and run again there") from None
        manifest = _read_manifest(directory, hint)
        entry = manifest["entries"].get(key)
        if entry is None:  # pragma: no cover - write_trace_golden wrote it
            raise GoldenError(f"{directory / 'manifest.json'}: the entry {key} just written is gone; {hint}")
    if entry.get("trace_sha256") != cfg.trace_sha256 or entry.get("config_hash") != cfg.stream_hash():
        raise GoldenError(f"golden entry {key} in {directory / 'manifest.json'} was made from trace "
                          f"{str(entry.get('trace_sha256'))[:16]}... (config hash {entry.get('config_hash')}), "
                          f"not this trace {cfg.trace_sha256[:16]}...; regenerate: {hint}")
    g = _load_entry(cfg, directory, entry, hint)
    g.regen_hint = hint
    return g, f"{g.describe()} beside trace {Path(cfg.trace).name}"


def write_trace_golden(cfg: Config, directory: Optional[Path] = None, force: bool = False, out=None) -> int:
    """Generate the golden data of trace config ``cfg`` over every position of the trace into
    ``directory`` (default :func:`trace_golden_dir`); returns 0, or 1 when a changed entry was
    refused without ``force``. Same discipline as :func:`regenerate`: unchanged data leaves the
    files alone, a change prints its diff, the new file is written under a content-addressed name
    before the manifest is swapped atomically. Entries made from another version of the trace
    (another sha256: the trace was re-captured) are removed with their files."""
    if not cfg.trace:
        raise ValueError("write_trace_golden needs a trace config (Config.from_trace)")
    out = out or sys.stdout
    directory = trace_golden_dir(cfg.trace) if directory is None else Path(directory)
    manifest = _read_manifest(directory, trace_regen_hint(cfg))
    key = _trace_key(cfg)
    every = trace_checkpoint_every(cfg)
    arrays = generate(cfg, positions=cfg.trace_tokens, checkpoint_every=every)  # before the directory exists
    data = npz_bytes(arrays)
    digest = _sha256(data)
    directory.mkdir(parents=True, exist_ok=True)
    refused, old_file = _replacing(directory, manifest, key, data, arrays, force, out)
    if refused is not None:
        return refused
    fname = f"seed{cfg.seed}-{cfg.stream_hash()}-{digest[:12]}.npz"
    atomic_write_bytes(directory / fname, data)
    stale = [k for k, e in manifest["entries"].items() if k != key and e.get("trace_sha256") != cfg.trace_sha256]
    stale_files = [directory / f for k in stale for f in manifest["entries"][k].get("files", {})]
    for k in stale:
        del manifest["entries"][k]
    manifest["entries"][key] = {
        "trace": Path(cfg.trace).name, "trace_sha256": cfg.trace_sha256, "trace_tokens": cfg.trace_tokens,
        "seed": cfg.seed, "num_layers": cfg.num_layers, "sequences": cfg.num_requests,
        "config_hash": cfg.stream_hash(), "generator_version": GENERATOR_VERSION, "steps": cfg.steps,
        "positions": int(arrays["proj_state"].shape[0] - 1), "checkpoint_every": every,
        "torch": torch.__version__, "numpy": np.__version__,
        "created": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "files": {fname: {"sha256": digest, "size": len(data)}},
    }
    manifest["schema"], manifest["generator_version"] = SCHEMA, GENERATOR_VERSION
    manifest["kind"] = "drift-trace-golden"
    atomic_write_json(directory / "manifest.json", manifest)
    for f in stale_files + ([old_file] if old_file is not None and old_file.name != fname else []):
        if f.exists():
            f.unlink()
    if stale:
        print(f"removed {len(stale)} entr{'y' if len(stale) == 1 else 'ies'} made from another version of "
              f"the trace: {', '.join(stale)}", file=out)
    print(f"{key}: wrote {directory / fname} ({len(data) / 2**20:.2f} MiB)", file=out)
    return 0


def _check_shapes(cfg: Config, arrays: dict, path: Path, hint: str) -> None:
    L, R, HV, K, V = cfg.num_layers, cfg.num_requests, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim
    win = (L, cfg.conv_kernel - 1, cfg.conv_channels)
    if cfg.serving.churn:  # the serving entry: per (request, position) rows
        expect = {"key_proj_state": (L, HV), "key_state_norm": (L, HV), "key_proj_out": (L, HV),
                  "start_state": (L, HV, V, K), "start_window": win}
        ints = {f"sched_{f}": np.int64 for f in SCHED_FIELDS}
        ints.update(key_request=np.int32, key_position=np.int32, start_ckpt=np.int64)
    else:
        expect = {"proj_state": (L, R, HV), "state_norm": (L, R, HV), "proj_out": (L, R, HV),
                  "ckpt_state": (L, R, HV, V, K), "ckpt_out": (L, R, HV, V),
                  "ckpt_window": (L, R, cfg.conv_kernel - 1, cfg.conv_channels)}
        ints = {}
    expect.update({"proj_u": (L, HV, K), "proj_w": (L, HV, V), "proj_wo": (L, HV, V)})
    for name, tail in expect.items():
        arr = arrays.get(name)
        if arr is None or arr.dtype != np.float32 or tuple(arr.shape[-len(tail):]) != tail:
            raise GoldenError(f"golden file {path}: array {name!r} missing or shaped "
                              f"{None if arr is None else (arr.dtype, arr.shape)}, expected float32 [..., "
                              f"{', '.join(map(str, tail))}]; regenerate: {hint}")
    for name, dtype in ints.items():
        arr = arrays.get(name)
        if arr is None or arr.dtype != dtype or arr.ndim != 1:
            raise GoldenError(f"golden file {path}: array {name!r} missing or shaped "
                              f"{None if arr is None else (arr.dtype, arr.shape)}, expected {np.dtype(dtype).name} [n]; "
                              f"regenerate: {hint}")
    if cfg.serving.churn:
        n_sched, n_key, n_ck = len(arrays["sched_step"]), len(arrays["key_request"]), len(arrays["start_ckpt"])
        bad = [f"sched_{f}" for f in SCHED_FIELDS if len(arrays[f"sched_{f}"]) != n_sched]
        bad += [k for k in ("key_position", "key_proj_state", "key_state_norm", "key_proj_out") if len(arrays[k]) != n_key]
        bad += [k for k in ("start_state", "start_window") if len(arrays[k]) != n_ck]
        keys = arrays["key_request"].astype(np.int64) << 32 | arrays["key_position"].astype(np.int64)
        if np.any(np.diff(keys) <= 0):
            bad.append("key_request/key_position (not sorted by request, then position, without repeats)")
        if n_ck and (arrays["start_ckpt"].min() < 0 or arrays["start_ckpt"].max() >= n_sched):
            bad.append("start_ckpt (an index outside sched_*)")
        if bad:
            raise GoldenError(f"golden file {path}: inconsistent arrays {', '.join(bad)}; regenerate: {hint}")


# -------------------------------------------------------------- regeneration
def diff_summary(old: dict, new: dict) -> list[str]:
    """One line per array: the largest relative change ``max|new - old| / max|old|``."""
    lines = []
    for name in sorted(set(old) | set(new)):
        if name not in old or name not in new:
            lines.append(f"  {name}: {'added' if name in new else 'removed'}")
            continue
        a, b = old[name], new[name]
        if a.shape != b.shape:
            lines.append(f"  {name}: shape {a.shape} -> {b.shape}")
            continue
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        scale = float(np.max(np.abs(a64))) if a64.size else 0.0
        change = float(np.max(np.abs(b64 - a64))) if a64.size else 0.0
        rel = change / scale if scale > 0 else change
        lines.append(f"  {name}: largest relative change {rel:.3e}" + (" (identical)" if change == 0 else ""))
    return lines


def _file_sha256(path: Optional[Path]) -> Optional[str]:
    """sha256 of the regular file at ``path`` as it is on disk; None when there is none."""
    if path is None or not path.is_file():
        return None
    try:
        return _sha256(path.read_bytes())
    except OSError:
        return None


def _against_stored(directory: Path, entry: dict, key: str, data: bytes, arrays: dict,
                    out) -> tuple[str, Optional[Path]]:
    """Freshly generated ``data`` against a manifest entry and its file ON DISK: ``"unchanged"``
    (both hold this data), ``"repaired"`` (the manifest records exactly this data but the file on
    disk was missing or damaged: rewritten now, as the manifest vouches for it) or ``"differs"``
    (the diff printed). Returns (verdict, the entry's file)."""
    digest = _sha256(data)
    try:
        (name, meta), = entry["files"].items()
        recorded = str(meta["sha256"])
    except (KeyError, TypeError, ValueError, AttributeError):
        name, recorded = None, None
    old_file = directory / name if name else None
    on_disk = _file_sha256(old_file)
    if recorded == digest:
        if on_disk == digest:
            print(f"{key}: unchanged ({old_file.name})", file=out)
            return "unchanged", old_file
        state = "missing" if on_disk is None else "damaged (its sha256 differs from the manifest's)"
        atomic_write_bytes(old_file, data)
        print(f"{key}: {old_file.name} was {state}; the manifest records exactly the data generated now: "
              f"repaired {old_file}", file=out)
        return "repaired", old_file
    try:
        old_arrays = load_npz(old_file) if old_file is not None and on_disk == recorded else {}
    except DriftError:
        old_arrays = {}
    intact = "" if on_disk == recorded else " (missing or damaged on disk: compared with nothing)"
    print(f"{key}: differs from {old_file.name if old_file else '(no file)'}{intact}:", file=out)
    for line in diff_summary(old_arrays, arrays):
        print(line, file=out)
    return "differs", old_file


def golden_lifecycles() -> tuple[str, ...]:
    """The lifecycles golden data is made and required for (:data:`GOLDEN_LIFECYCLES`): the fixed entry,
    then the serving entry. Another churning lifecycle (a test's, a user's) finds none and says so."""
    return GOLDEN_LIFECYCLES


def regenerate(names: Sequence[str], seed: Optional[int] = None, force: bool = False,
               directory: Optional[Path] = None, steps: Optional[int] = None,
               out=None, lifecycles: Optional[Sequence[str]] = None) -> int:
    """Regenerate golden data for ``names``, each entry of ``lifecycles`` (default: every one golden
    covers, :func:`golden_lifecycles`: the fixed entry and the serving entry); returns 0, or 1 when a
    change was refused.

    Unchanged data leaves files and manifest untouched. Changed data is written only with
    ``force``: the new file under a content-addressed name, then the manifest swapped
    atomically, then the old file removed -- an interrupted run leaves the old golden intact.
    Into a directory without an entry (a fresh ``--golden-dir`` from an install), the new data
    is compared with the golden data drift ships, so the diff is there to review either way.
    """
    out = out or sys.stdout
    directory = golden_dir() if directory is None else Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    manifest = _read_manifest(directory)
    shipped = golden_dir()
    shipped_manifest = _read_manifest(shipped) if shipped.resolve() != directory.resolve() else {"entries": {}}
    refused = 0
    for name in names:
        for lifecycle in (golden_lifecycles() if lifecycles is None else lifecycles):
            base = preset(name) if seed is None else preset(name, seed=seed)
            cfg = base.replace(lifecycle=lifecycle)
            key = _entry_key(name, cfg.seed, lifecycle)
            if cfg.serving.churn:
                print(f"{key}: generating the requests of {cfg.steps if steps is None else steps} steps ...",
                      file=out, flush=True)
                arrays = serving_entry(cfg, steps)
                stem = f"{name}-seed{cfg.seed}-{lifecycle}"
                meta = {"lifecycle": lifecycle, "positions": int(len(arrays["key_request"])),
                        "requests": int(len(np.unique(arrays["sched_request"]))),
                        "checkpoints": int(len(arrays["start_ckpt"]))}
            else:
                print(f"{key}: generating {max_position(cfg, steps)} positions ...", file=out, flush=True)
                arrays = generate(cfg, steps)
                stem = f"{name}-seed{cfg.seed}"
                meta = {"positions": int(arrays["proj_state"].shape[0] - 1), "checkpoint_every": CHECKPOINT_EVERY}
            meta = {"preset": name, "seed": cfg.seed, "config_hash": cfg.stream_hash(),
                    "generator_version": GENERATOR_VERSION, "steps": cfg.steps if steps is None else steps, **meta}
            refused |= _write_entry(directory, manifest, shipped, shipped_manifest, key, stem, arrays, meta, force, out)
    return refused


def _replacing(directory: Path, manifest: dict, key: str, data: bytes, arrays: dict, force: bool, out) -> tuple:
    """Whether entry ``key``'s new ``data`` may be written over what the manifest holds: (None, the
    stored file to remove once replaced, or None) to write; (0, None) when it is unchanged; (1, None)
    when it differs and ``force`` is not given (the diff and the refusal printed)."""
    old_entry = manifest["entries"].get(key)
    if not old_entry:
        return None, None
    verdict, old_file = _against_stored(directory, old_entry, key, data, arrays, out)
    if verdict != "differs":
        return 0, None
    if not force:
        print(f"{key}: refusing to overwrite without --force", file=out)
        return 1, None
    return None, old_file


def _write_entry(directory: Path, manifest: dict, shipped: Path, shipped_manifest: dict, key: str, stem: str,
                 arrays: dict, meta: dict, force: bool, out) -> int:
    """One entry of :func:`regenerate`: compared with what is stored (or shipped), written when new or
    changed with ``force``; returns 1 when a change was refused."""
    data = npz_bytes(arrays)
    digest = _sha256(data)
    refused, old_file = _replacing(directory, manifest, key, data, arrays, force, out)
    if refused is not None:
        return refused
    if key not in manifest["entries"] and key in shipped_manifest["entries"]:
        ((ref_name, ref_meta),) = shipped_manifest["entries"][key]["files"].items()
        if ref_meta["sha256"] == digest:
            print(f"{key}: identical to the golden data drift ships ({shipped / ref_name})", file=out)
        else:
            print(f"{key}: differs from the golden data drift ships ({shipped / ref_name}):", file=out)
            ref_ok = _file_sha256(shipped / ref_name) == ref_meta.get("sha256")
            for line in diff_summary(load_npz(shipped / ref_name) if ref_ok else {}, arrays):
                print(line, file=out)
    fname = f"{stem}-{digest[:12]}.npz"
    atomic_write_bytes(directory / fname, data)
    manifest["entries"][key] = {
        **meta, "torch": torch.__version__, "numpy": np.__version__,
        "created": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "files": {fname: {"sha256": digest, "size": len(data)}},
    }
    manifest["schema"], manifest["generator_version"] = SCHEMA, GENERATOR_VERSION
    atomic_write_json(directory / "manifest.json", manifest)
    if old_file is not None and old_file.exists() and old_file.name != fname:
        old_file.unlink()
    print(f"{key}: wrote {fname} ({len(data) / 2**20:.2f} MiB)", file=out)
    return 0
