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
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.resources
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from ..config import PRESETS, Config, preset
from ..errors import GoldenError
from ..fileio import atomic_write_bytes, atomic_write_json, load_npz, npz_bytes
from ..sim.stream import StreamParams, TrueTokens, max_position

SCHEMA = 1
GENERATOR_VERSION = "2"  # 2: the op's quantised inputs (bf16 mix_qkv, fp32 g), [V, K] states
CHECKPOINT_EVERY = 4096  # positions between full-state checkpoints
GOLDEN_PRESETS = ("ci-small", "stagnation")  # the PR-gating presets
REGEN_HINT = "drift regen-golden --preset {name} --force"
F64 = torch.float64

ARRAYS_PER_POSITION = ("proj_state", "state_norm", "proj_out")


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


def _entry_key(name: str, seed: int) -> str:
    return f"{name}/seed{seed}"


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


def generate(cfg: Config, steps: Optional[int] = None) -> dict[str, np.ndarray]:
    """The golden arrays for ``cfg`` over ``steps`` decode steps (default: the preset's)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # fixed reduction order: byte-identical regeneration
    try:
        return _generate(cfg, steps)
    finally:
        torch.set_num_threads(threads)


def _generate(cfg: Config, steps: Optional[int]) -> dict[str, np.ndarray]:
    L, R, HV, K, V = cfg.num_layers, cfg.num_requests, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim
    P = max_position(cfg, steps)
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
    ckpt_pos = np.arange(CHECKPOINT_EVERY, P + 1, CHECKPOINT_EVERY, dtype=np.int64)
    ckpt_state = np.zeros((len(ckpt_pos), L, R, HV, V, K), np.float32)
    ckpt_window = np.zeros((len(ckpt_pos), L, R, cfg.conv_kernel - 1, cfg.conv_channels), np.float32)
    ckpt_out = np.zeros((len(ckpt_pos), L, R, HV, V), np.float32)
    block = 256
    for p0 in range(0, P, block):
        n = min(block, P - p0)
        got = [tokens.get(r, p0, p0 + n) for r in range(R)]
        xs, as_, bs = (torch.from_numpy(np.stack([g[i] for g in got], 2)).to(F64) for i in range(3))  # [n, L, R, .]
        for j in range(n):
            p = p0 + j
            h, window, o = _golden_step(cfg, prm, h, window, xs[j], as_[j], bs[j])
            proj_state[p + 1] = torch.einsum("lhv,lrhvk,lhk->lrh", w, h, u).numpy()
            state_norm[p + 1] = torch.linalg.vector_norm(h, dim=(-2, -1)).numpy()
            proj_out[p] = torch.einsum("lrhv,lhv->lrh", o, wo).numpy()
            if (p + 1) % CHECKPOINT_EVERY == 0:
                c = (p + 1) // CHECKPOINT_EVERY - 1
                ckpt_state[c], ckpt_window[c], ckpt_out[c] = h.numpy(), window.numpy(), o.numpy()
    return {"proj_state": proj_state, "state_norm": state_norm, "proj_out": proj_out,
            "ckpt_pos": ckpt_pos, "ckpt_state": ckpt_state, "ckpt_window": ckpt_window,
            "ckpt_out": ckpt_out, **vec}


# ------------------------------------------------------------------- loading
@dataclass
class Golden:
    """Loaded golden arrays (host numpy) with where they came from."""

    name: str
    seed: int
    steps: int
    path: Path
    arrays: dict

    @property
    def max_position(self) -> int:
        return self.arrays["proj_state"].shape[0] - 1

    def describe(self) -> str:
        return (f"golden {self.path.name} (float64 truth stored as float32; positions 0..{self.max_position}, "
                f"{len(self.arrays['ckpt_pos'])} full checkpoints)")


def _read_manifest(directory: Path) -> dict:
    path = directory / "manifest.json"
    if not path.exists():
        return {"schema": SCHEMA, "generator_version": GENERATOR_VERSION, "entries": {}}
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise GoldenError(f"{path} is not valid JSON ({exc}); restore it from git or regenerate all "
                          "golden data: drift regen-golden --force") from exc
    if manifest.get("schema") != SCHEMA:
        raise GoldenError(f"{path} has schema {manifest.get('schema')!r}, this drift reads schema {SCHEMA}; "
                          "regenerate: drift regen-golden --force")
    return manifest


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def requires_golden(cfg: Config) -> bool:
    """A PR-gating preset as it gates (its own seed, its trajectory): golden data is mandatory."""
    return cfg.name in GOLDEN_PRESETS and cfg.seed == preset(cfg.name).seed and _is_preset_config(cfg)


def _is_preset_config(cfg: Config) -> bool:
    return cfg.name in PRESETS and cfg.stream_hash() == preset(cfg.name).replace(seed=cfg.seed).stream_hash()


def load_golden(cfg: Config, directory: Optional[Path] = None) -> tuple[Optional[Golden], str]:
    """The golden for ``cfg`` or None, with a sentence saying which and why.

    Raises GoldenError (naming the file and the regeneration command) when an entry exists
    but its file is missing, truncated, corrupted or stale for the preset it claims.
    """
    directory = golden_dir() if directory is None else Path(directory)
    manifest = _read_manifest(directory)
    entry = manifest["entries"].get(_entry_key(cfg.name, cfg.seed))
    if entry is None:
        if requires_golden(cfg):
            raise GoldenError(f"{directory / 'manifest.json'} has no golden data for the PR-gating preset "
                              f"{cfg.name} seed {cfg.seed}; a PR-gating run needs it: regenerate it with "
                              f"`drift regen-golden --preset {cfg.name} --golden-dir {directory}`, or point "
                              "DRIFT_GOLDEN_DIR at the golden data drift ships")
        return None, f"no golden for preset {cfg.name!r} seed {cfg.seed} in {directory}"
    hint = REGEN_HINT.format(name=cfg.name)
    if entry.get("config_hash") != cfg.stream_hash():
        if _is_preset_config(cfg):
            raise GoldenError(f"golden for {cfg.name} seed {cfg.seed} was made from config hash "
                              f"{entry.get('config_hash')}, but the preset now hashes to {cfg.stream_hash()}: "
                              f"the preset changed; regenerate: {hint}")
        return None, (f"config differs from preset {cfg.name!r} in fields that shape the trajectory; "
                      "golden does not apply")
    if entry.get("generator_version") != GENERATOR_VERSION:
        raise GoldenError(f"golden for {cfg.name} was made by generator {entry.get('generator_version')}, "
                          f"this drift is generator {GENERATOR_VERSION}; regenerate: {hint}")
    (fname, meta), = entry["files"].items()
    path = directory / fname
    if not path.exists():
        raise GoldenError(f"golden file {path} listed in manifest.json is missing; regenerate: {hint}")
    data = path.read_bytes()
    if len(data) != meta["size"] or _sha256(data) != meta["sha256"]:
        raise GoldenError(f"golden file {path} is truncated or corrupted (size {len(data)} vs "
                          f"{meta['size']}, sha256 mismatch={_sha256(data) != meta['sha256']}); "
                          f"restore it from git or regenerate: {hint}")
    try:
        arrays = load_npz(path)
    except Exception as exc:
        raise GoldenError(f"golden file {path} cannot be read ({exc}); regenerate: {hint}") from exc
    _check_shapes(cfg, arrays, path, hint)
    g = Golden(cfg.name, cfg.seed, int(entry["steps"]), path, arrays)
    return g, g.describe()


def _check_shapes(cfg: Config, arrays: dict, path: Path, hint: str) -> None:
    L, R, HV, K, V = cfg.num_layers, cfg.num_requests, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim
    expect = {"proj_state": (L, R, HV), "state_norm": (L, R, HV), "proj_out": (L, R, HV),
              "ckpt_state": (L, R, HV, V, K), "ckpt_out": (L, R, HV, V),
              "ckpt_window": (L, R, cfg.conv_kernel - 1, cfg.conv_channels),
              "proj_u": (L, HV, K), "proj_w": (L, HV, V), "proj_wo": (L, HV, V)}
    for name, tail in expect.items():
        arr = arrays.get(name)
        if arr is None or arr.dtype != np.float32 or tuple(arr.shape[-len(tail):]) != tail:
            raise GoldenError(f"golden file {path}: array {name!r} missing or shaped "
                              f"{None if arr is None else (arr.dtype, arr.shape)}, expected float32 [..., "
                              f"{', '.join(map(str, tail))}]; regenerate: {hint}")


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


def regenerate(names: Sequence[str], seed: Optional[int] = None, force: bool = False,
               directory: Optional[Path] = None, steps: Optional[int] = None,
               out=None) -> int:
    """Regenerate golden data for ``names``; returns 0, or 1 when a change was refused.

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
        cfg = preset(name) if seed is None else preset(name, seed=seed)
        key = _entry_key(name, cfg.seed)
        print(f"{key}: generating {max_position(cfg, steps)} positions ...", file=out, flush=True)
        arrays = generate(cfg, steps)
        data = npz_bytes(arrays)
        digest = _sha256(data)
        old_entry = manifest["entries"].get(key)
        old_file = None
        if old_entry:
            (old_name, old_meta), = old_entry["files"].items()
            old_file = directory / old_name
            if old_meta["sha256"] == digest and old_file.exists():
                print(f"{key}: unchanged ({old_file.name})", file=out)
                continue
            old_arrays = load_npz(old_file) if old_file.exists() else {}
            print(f"{key}: differs from {old_file.name}:", file=out)
            for line in diff_summary(old_arrays, arrays):
                print(line, file=out)
            if not force:
                print(f"{key}: refusing to overwrite without --force", file=out)
                refused = 1
                continue
        elif key in shipped_manifest["entries"]:
            ((ref_name, ref_meta),) = shipped_manifest["entries"][key]["files"].items()
            if ref_meta["sha256"] == digest:
                print(f"{key}: identical to the golden data drift ships ({shipped / ref_name})", file=out)
            else:
                print(f"{key}: differs from the golden data drift ships ({shipped / ref_name}):", file=out)
                for line in diff_summary(load_npz(shipped / ref_name) if (shipped / ref_name).exists() else {}, arrays):
                    print(line, file=out)
        fname = f"{name}-seed{cfg.seed}-{digest[:12]}.npz"
        atomic_write_bytes(directory / fname, data)
        manifest["entries"][key] = {
            "preset": name, "seed": cfg.seed, "config_hash": cfg.stream_hash(),
            "generator_version": GENERATOR_VERSION, "steps": cfg.steps if steps is None else steps,
            "positions": int(arrays["proj_state"].shape[0] - 1), "checkpoint_every": CHECKPOINT_EVERY,
            "torch": torch.__version__, "numpy": np.__version__,
            "created": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
            "files": {fname: {"sha256": digest, "size": len(data)}},
        }
        manifest["schema"], manifest["generator_version"] = SCHEMA, GENERATOR_VERSION
        atomic_write_json(directory / "manifest.json", manifest)
        if old_file is not None and old_file.exists() and old_file.name != fname:
            old_file.unlink()
        print(f"{key}: wrote {fname} ({len(data) / 2**20:.2f} MiB)", file=out)
    return refused
