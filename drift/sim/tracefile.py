"""The drift trace file: a model's recorded GDN inputs, written atomically and read back validated.

A trace is two files with one stem: ``NAME.npz`` (``np.savez``, uncompressed, no object
arrays, read with ``allow_pickle=False``) and its manifest ``NAME.json``. The manifest holds
the npz's length and sha256, so a truncated, corrupted or swapped npz is refused on read.

Shapes (R sequences, T tokens each, L GDN layers, HK key heads, HV value heads with
HV % HK == 0, K = head_k_dim, V = head_v_dim, C = 2*HK*K + HV*V conv channels, Kc = conv
kernel width >= 2):

===============  ===============  =============================================================
array            shape            dtype / meaning
===============  ===============  =============================================================
``x``            [R, T, L, C]     the model's run dtype: the pre-conv mixed q/k/v channels of
                                  every token (the input of the depthwise causal conv1d), in
                                  the order the conv weights expect: q of key head 0..HK-1
                                  (each K wide), then k likewise, then v of value head
                                  0..HV-1 (each V wide)
``a``            [R, T, L, HV]    run dtype: the gating input, decay
                                  ``g = -exp(A_log) * softplus(a + dt_bias)``
``b``            [R, T, L, HV]    run dtype: the beta logit, ``beta = sigmoid(b)``
``A_log``        [L, HV]          float32
``dt_bias``      [L, HV]          float32
``conv_weight``  [L, C, Kc]       float32, depthwise; tap m multiplies token t - (Kc-1) + m
``conv_bias``    [L, C]           float32 (zeros when the model has no conv bias)
===============  ===============  =============================================================

The run dtype is the manifest's ``"dtype"``: ``"bfloat16"`` (x, a, b stored as the uint16 bit
patterns of the bf16 values) or ``"float32"`` (stored as float32). :func:`read_trace` decodes
bf16 exactly to float32. Token 0 of every sequence starts from an empty (all-zero) conv
window, as a model's prefill does.

Manifest (strict JSON, sorted keys)::

    {"schema": 1, "kind": "drift-trace", "file": "NAME.npz", "sha256": ..., "bytes": ...,
     "dtype": "bfloat16" | "float32",
     "model": {"name": str, "source": "tiny" | <checkpoint path> | "sglang", "config": {...}, ...},
     "layers": [original layer index of each GDN layer], "num_layers": L,
     "num_k_heads": HK, "num_v_heads": HV, "head_k_dim": K, "head_v_dim": V,
     "conv_kernel": Kc, "conv_channels": C, "sequences": R, "tokens": T,
     "bytes_per_token_per_layer": (C + 2*HV) * itemsize,   # x, a, b of one (sequence, token, layer)
     "created": ISO-8601 UTC, "versions": {"drift", "torch", "numpy", ...}}

Every problem found on read (or on write, before anything is written) raises
:class:`drift.errors.DataError` naming the file, the field and what to do.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from ..errors import DataError
from ..fileio import atomic_write_bytes, atomic_write_json, load_npz, npz_bytes, read_bytes, read_json
from ..version import __version__

SCHEMA = 1
KIND = "drift-trace"
DTYPES = {"bfloat16": np.uint16, "float32": np.float32}  # run dtype -> stored numpy dtype
ITEMSIZE = {"bfloat16": 2, "float32": 4}
ACTIVATIONS = ("x", "a", "b")
PARAMS = ("A_log", "dt_bias", "conv_weight", "conv_bias")
ARRAYS = ACTIVATIONS + PARAMS
SHAPE_FIELDS = ("sequences", "tokens", "num_layers", "num_k_heads", "num_v_heads",
                "head_k_dim", "head_v_dim", "conv_kernel", "conv_channels")
_FIX = "re-capture the trace (drift.capture) or restore an intact copy"


# --------------------------------------------------------------------------- paths
def trace_paths(path: str | os.PathLike) -> tuple[Path, Path]:
    """``(npz, manifest)`` for a trace given as ``NAME.npz``, ``NAME.json`` or ``NAME``."""
    p = Path(path)
    if p.suffix in (".npz", ".json"):
        p = p.with_suffix("")
    return p.with_name(p.name + ".npz"), p.with_name(p.name + ".json")


# --------------------------------------------------------------------------- bf16 bits
def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """uint16 bf16 bit patterns -> the exact float32 values (bf16 is float32's top half)."""
    return (np.ascontiguousarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray | None:
    """float32 values that are exactly bf16 -> their uint16 bit patterns; None if any is not."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    if np.any(u & 0xFFFF):
        return None
    return (u >> 16).astype(np.uint16)


def bytes_per_token_per_layer(conv_channels: int, num_v_heads: int, dtype: str) -> int:
    """Bytes of x, a and b of one (sequence, token, layer): ``(C + 2*HV) * itemsize``."""
    return (int(conv_channels) + 2 * int(num_v_heads)) * ITEMSIZE[dtype]


# --------------------------------------------------------------------------- the trace
@dataclass(frozen=True, eq=False)
class Trace:
    """A validated trace; every array float32 (x, a, b decoded exactly from the run dtype),
    read-only. Shapes as in the module docstring."""

    path: Path
    manifest: dict
    x: np.ndarray
    a: np.ndarray
    b: np.ndarray
    A_log: np.ndarray
    dt_bias: np.ndarray
    conv_weight: np.ndarray
    conv_bias: np.ndarray

    dtype = property(lambda self: self.manifest["dtype"])
    sequences = property(lambda self: self.manifest["sequences"])
    tokens = property(lambda self: self.manifest["tokens"])
    num_layers = property(lambda self: self.manifest["num_layers"])
    num_k_heads = property(lambda self: self.manifest["num_k_heads"])
    num_v_heads = property(lambda self: self.manifest["num_v_heads"])
    head_k_dim = property(lambda self: self.manifest["head_k_dim"])
    head_v_dim = property(lambda self: self.manifest["head_v_dim"])
    conv_kernel = property(lambda self: self.manifest["conv_kernel"])
    conv_channels = property(lambda self: self.manifest["conv_channels"])
    layers = property(lambda self: list(self.manifest["layers"]))
    model = property(lambda self: self.manifest["model"])
    bytes_per_token_per_layer = property(lambda self: self.manifest["bytes_per_token_per_layer"])

    def describe(self) -> str:
        m = self.manifest
        return (f"trace {self.path.name}: {m['model']['name']} ({m['model']['source']}), {m['dtype']}, "
                f"{m['sequences']} seq x {m['tokens']} tokens x {m['num_layers']} GDN layers {m['layers']}, "
                f"HK={m['num_k_heads']} HV={m['num_v_heads']} K={m['head_k_dim']} V={m['head_v_dim']} "
                f"Kc={m['conv_kernel']} C={m['conv_channels']}, "
                f"{m['bytes_per_token_per_layer']} B/token/layer")


# --------------------------------------------------------------------------- validation
def _err(where: Path, field: str, problem: str, fix: str = _FIX) -> DataError:
    return DataError(f"trace {where}: {field}: {problem}; {fix}")


def _check_dims(where: Path, dims: Mapping[str, Any]) -> None:
    """The manifest's shape fields: positive ints, and the GDN structure they must have."""
    for f in SHAPE_FIELDS:
        v = dims.get(f)
        if isinstance(v, bool) or not isinstance(v, int):
            raise _err(where, f"field {f!r}", f"is {v!r}, not an integer", "write it as a positive integer or re-capture")
        if v < 1:
            raise _err(where, f"field {f!r}", f"is {v}, must be >= 1"
                       + (" (a trace needs at least one token)" if f == "tokens" else ""))
    hk, hv = dims["num_k_heads"], dims["num_v_heads"]
    if hv % hk:
        raise _err(where, "field 'num_v_heads'", f"{hv} is not a multiple of num_k_heads {hk}",
                   "GDN shares each key head among HV/HK value heads; fix the head counts")
    c = 2 * hk * dims["head_k_dim"] + hv * dims["head_v_dim"]
    if dims["conv_channels"] != c:
        raise _err(where, "field 'conv_channels'",
                   f"is {dims['conv_channels']}, but 2*num_k_heads*head_k_dim + num_v_heads*head_v_dim = {c}",
                   "the conv channels are q, k and v of every head; fix the head fields")
    if dims["conv_kernel"] < 2:
        raise _err(where, "field 'conv_kernel'", f"is {dims['conv_kernel']}, must be >= 2",
                   "GDN's causal conv spans the token and at least one before it")


def _expected_shapes(d: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
    R, T, L = d["sequences"], d["tokens"], d["num_layers"]
    HV, C, Kc = d["num_v_heads"], d["conv_channels"], d["conv_kernel"]
    return {"x": (R, T, L, C), "a": (R, T, L, HV), "b": (R, T, L, HV), "A_log": (L, HV),
            "dt_bias": (L, HV), "conv_weight": (L, C, Kc), "conv_bias": (L, C)}


_SHAPE_NAMES = {"x": "(sequences, tokens, num_layers, conv_channels)",
                "a": "(sequences, tokens, num_layers, num_v_heads)",
                "b": "(sequences, tokens, num_layers, num_v_heads)",
                "A_log": "(num_layers, num_v_heads)", "dt_bias": "(num_layers, num_v_heads)",
                "conv_weight": "(num_layers, conv_channels, conv_kernel)",
                "conv_bias": "(num_layers, conv_channels)"}


def _check_arrays(where: Path, stored: Mapping[str, np.ndarray], dims: Mapping[str, int], dtype: str) -> None:
    """Stored arrays (as in the npz): presence, no extras, dtype, shape."""
    for name in ARRAYS:
        if name not in stored:
            raise _err(where, f"array {name!r}", "is missing")
    extra = sorted(set(stored) - set(ARRAYS))
    if extra:
        raise _err(where, f"array {extra[0]!r}", f"is not part of a drift trace (arrays are {', '.join(ARRAYS)})")
    want_dtype = {**{n: np.dtype(DTYPES[dtype]) for n in ACTIVATIONS}, **{n: np.dtype(np.float32) for n in PARAMS}}
    shapes = _expected_shapes(dims)
    for name in ARRAYS:
        arr = stored[name]
        if arr.dtype != want_dtype[name]:
            what = "object (drift never stores pickled objects)" if arr.dtype == object else str(arr.dtype)
            raise _err(where, f"array {name!r}", f"has dtype {what}, expected {want_dtype[name]} "
                       f"(trace dtype {dtype!r})")
        if tuple(arr.shape) != shapes[name]:
            raise _err(where, f"array {name!r}", f"has shape {tuple(arr.shape)}, the manifest says "
                       f"{shapes[name]} {_SHAPE_NAMES[name]}")


def _check_finite(where: Path, name: str, arr: np.ndarray) -> None:
    bad = ~np.isfinite(arr)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise _err(where, f"array {name!r}", f"holds {arr[idx]} at index {list(idx)} (NaN/Inf)",
                   "a trace must be finite: re-capture from a model run that stays finite")


def _decode(stored: Mapping[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    out = {}
    for name in ARRAYS:
        arr = stored[name]
        if name in ACTIVATIONS and dtype == "bfloat16":
            arr = bf16_bits_to_float32(arr)
        out[name] = np.ascontiguousarray(arr, dtype=np.float32)
    return out


# --------------------------------------------------------------------------- write
def _activation_to_stored(where: Path, name: str, value: Any, dtype: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        want = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
        if t.dtype != want:
            raise _err(where, f"array {name!r}", f"is a {t.dtype} tensor, the trace dtype is {dtype!r}",
                       "pass the tensor in the dtype the model ran in, and that dtype")
        if dtype == "bfloat16":
            return t.view(torch.int16).numpy().view(np.uint16)
        return t.numpy()
    arr = np.asarray(value)
    if arr.dtype == object:
        raise _err(where, f"array {name!r}", "has dtype object; drift never stores pickled objects",
                   "pass a numeric array")
    if dtype == "bfloat16":
        if arr.dtype == np.uint16:
            return arr
        if arr.dtype == np.float32:
            bits = float32_to_bf16_bits(arr)
            if bits is None:
                raise _err(where, f"array {name!r}", "holds float32 values that are not exactly bfloat16",
                           "pass the bf16 tensor itself (or uint16 bit patterns)")
            return bits
    elif arr.dtype == np.float32:
        return arr
    raise _err(where, f"array {name!r}", f"has dtype {arr.dtype}, expected "
               f"{'bfloat16 (tensor), uint16 bits or bf16-exact float32' if dtype == 'bfloat16' else 'float32'}",
               "convert it to the trace dtype")


def _param_to_stored(where: Path, name: str, value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            raise _err(where, f"array {name!r}", f"is a {value.dtype} tensor, expected floating point",
                       "pass the model's parameter")
        return value.detach().to("cpu", torch.float32).contiguous().numpy()
    arr = np.asarray(value)
    if arr.dtype == object:
        raise _err(where, f"array {name!r}", "has dtype object; drift never stores pickled objects",
                   "pass a numeric array")
    if arr.dtype.kind != "f":
        raise _err(where, f"array {name!r}", f"has dtype {arr.dtype}, expected floating point",
                   "pass the model's parameter")
    f32 = arr.astype(np.float32)
    if not np.array_equal(f32.astype(arr.dtype), arr, equal_nan=True):
        raise _err(where, f"array {name!r}", f"{arr.dtype} values are not exactly float32",
                   "pass float32 (or bf16/fp16) parameters")
    return f32


def _json_ok(where: Path, field: str, obj: Any) -> None:
    try:
        json.dumps(obj, allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise _err(where, f"field {field!r}", f"is not strict JSON ({exc})",
                   "pass plain str/int/float/bool/list/dict values, finite numbers only") from exc


def write_trace(path: str | os.PathLike, *, x, a, b, A_log, dt_bias, conv_weight, conv_bias,
                dtype: str, model: Mapping[str, Any], layers, versions_extra: Mapping[str, str] | None = None,
                num_k_heads: int | None = None, head_k_dim: int | None = None,
                head_v_dim: int | None = None) -> Path:
    """Validate and write ``NAME.npz`` + ``NAME.json`` atomically; return the npz path.

    ``x``, ``a``, ``b``: torch tensors in the run dtype (bf16 or fp32), or numpy arrays (uint16
    bf16 bits or bf16-exact float32 for ``"bfloat16"``, float32 for ``"float32"``). The
    parameters: any float tensor/array exactly representable in float32. ``model`` needs
    ``name`` (str), ``source`` (str) and ``config`` (a JSON object); other JSON keys are kept.
    ``num_k_heads``, ``head_k_dim`` and ``head_v_dim`` (the shapes alone cannot split C) come
    from ``model["config"]`` when not given: ``num_k_heads``/``head_k_dim``/``head_v_dim``, or
    transformers' ``linear_num_key_heads``/``linear_key_head_dim``/``linear_value_head_dim``. The npz is written first and
    the manifest (holding its sha256) second, so a reader never accepts a half-written pair.
    """
    npz, man = trace_paths(path)
    if dtype not in DTYPES:
        raise _err(npz, "field 'dtype'", f"is {dtype!r}, expected one of {sorted(DTYPES)}",
                   "cast the model to bfloat16 or float32 before capturing")
    if not isinstance(model, Mapping) or not isinstance(model.get("name"), str) \
            or not isinstance(model.get("source"), str) or not isinstance(model.get("config"), Mapping):
        raise _err(npz, "field 'model'", "needs 'name' (str), 'source' (str) and 'config' (object)",
                   "pass model={'name': ..., 'source': ..., 'config': {...}}")
    _json_ok(npz, "model", dict(model))
    stored = {n: _activation_to_stored(npz, n, v, dtype) for n, v in (("x", x), ("a", a), ("b", b))}
    stored.update({n: _param_to_stored(npz, n, v) for n, v in
                   (("A_log", A_log), ("dt_bias", dt_bias), ("conv_weight", conv_weight), ("conv_bias", conv_bias))})
    xs = stored["x"].shape
    if len(xs) != 4 or stored["a"].ndim != 4 or stored["conv_weight"].ndim != 3:
        raise _err(npz, "array 'x'", f"x/a/conv_weight have shapes {xs}/{stored['a'].shape}/"
                   f"{stored['conv_weight'].shape}, expected [R, T, L, C]/[R, T, L, HV]/[L, C, Kc]",
                   "stack the arrays as the module docstring says")
    cfg = model["config"]

    def _dim(given, *keys):
        if given is not None:
            return given
        for k in keys:
            if cfg.get(k) is not None:
                return cfg[k]
        raise _err(npz, f"field {keys[0]!r}", "is not given and model['config'] has none of " + ", ".join(keys),
                   f"pass {keys[0]}=... to write_trace")

    hk = _dim(num_k_heads, "num_k_heads", "linear_num_key_heads")
    kd = _dim(head_k_dim, "head_k_dim", "linear_key_head_dim")
    vd = _dim(head_v_dim, "head_v_dim", "linear_value_head_dim")
    dims = {"sequences": xs[0], "tokens": xs[1], "num_layers": xs[2], "conv_channels": xs[3],
            "num_v_heads": stored["a"].shape[3], "conv_kernel": stored["conv_weight"].shape[2],
            "num_k_heads": hk, "head_k_dim": kd, "head_v_dim": vd}
    _check_dims(npz, dims)
    _check_arrays(npz, stored, dims, dtype)
    decoded = _decode(stored, dtype)
    for name in ARRAYS:
        _check_finite(npz, name, decoded[name])
    layers = [int(i) for i in layers]
    if len(layers) != dims["num_layers"] or len(set(layers)) != len(layers):
        raise _err(npz, "field 'layers'", f"{layers} does not name {dims['num_layers']} distinct layers",
                   "pass the original index of every GDN layer, in the order of axis 2 of x")
    versions = {"drift": __version__, "torch": torch.__version__, "numpy": np.__version__}
    versions.update({str(k): str(v) for k, v in (versions_extra or {}).items()})
    blob = npz_bytes({n: np.ascontiguousarray(stored[n]) for n in ARRAYS})
    manifest = {"schema": SCHEMA, "kind": KIND, "file": npz.name, "sha256": hashlib.sha256(blob).hexdigest(),
                "bytes": len(blob), "dtype": dtype, "model": dict(model), "layers": layers, **dims,
                "bytes_per_token_per_layer": bytes_per_token_per_layer(dims["conv_channels"], dims["num_v_heads"], dtype),
                "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "versions": versions}
    atomic_write_bytes(npz, blob)
    atomic_write_json(man, manifest)
    return npz


# --------------------------------------------------------------------------- read
def read_manifest(path: str | os.PathLike) -> tuple[Path, Path, dict]:
    """``(npz, manifest_path, manifest)`` with the manifest's own fields checked (not the npz)."""
    npz, man = trace_paths(path)
    if not os.path.lexists(man):
        raise _err(man, "manifest", "not found",
                   f"a trace is NAME.npz plus NAME.json; copy {man.name} next to {npz.name} or re-capture")
    m = read_json(man, "trace manifest", _FIX)
    if not isinstance(m, dict):
        raise _err(man, "manifest", f"holds a JSON {type(m).__name__}, not an object")
    if m.get("kind") != KIND:
        raise _err(man, "field 'kind'", f"is {m.get('kind')!r}, not {KIND!r}: not a drift trace manifest",
                   "pass the .npz/.json of a trace written by drift.capture")
    if m.get("schema") != SCHEMA:
        raise _err(man, "field 'schema'", f"is {m.get('schema')!r}; this drift reads schema {SCHEMA}",
                   "re-capture the trace with this drift version")
    if m.get("dtype") not in DTYPES:
        raise _err(man, "field 'dtype'", f"is {m.get('dtype')!r}, expected one of {sorted(DTYPES)}")
    _check_dims(man, m)
    for f in ("file", "sha256", "created"):
        if not isinstance(m.get(f), str):
            raise _err(man, f"field {f!r}", f"is {m.get(f)!r}, not a string")
    if m["file"] != npz.name:
        raise _err(man, "field 'file'", f"names {m['file']!r}, but the npz beside it is {npz.name!r}",
                   "rename both files back to one stem, or re-capture")
    for f in ("bytes", "bytes_per_token_per_layer"):
        if isinstance(m.get(f), bool) or not isinstance(m.get(f), int) or m[f] < 0:
            raise _err(man, f"field {f!r}", f"is {m.get(f)!r}, not a non-negative integer")
    bpt = bytes_per_token_per_layer(m["conv_channels"], m["num_v_heads"], m["dtype"])
    if m["bytes_per_token_per_layer"] != bpt:
        raise _err(man, "field 'bytes_per_token_per_layer'", f"is {m['bytes_per_token_per_layer']}, the "
                   f"shape fields give (conv_channels + 2*num_v_heads) * itemsize = {bpt}")
    lay = m.get("layers")
    if not isinstance(lay, list) or len(lay) != m["num_layers"] or \
            any(isinstance(i, bool) or not isinstance(i, int) for i in lay) or len(set(lay)) != len(lay):
        raise _err(man, "field 'layers'", f"is {lay!r}, expected {m['num_layers']} distinct integers (num_layers)")
    mod = m.get("model")
    if not isinstance(mod, dict) or not isinstance(mod.get("name"), str) or \
            not isinstance(mod.get("source"), str) or not isinstance(mod.get("config"), dict):
        raise _err(man, "field 'model'", f"is {mod!r}; needs 'name' (str), 'source' (str), 'config' (object)")
    if not isinstance(m.get("versions"), dict):
        raise _err(man, "field 'versions'", f"is {m.get('versions')!r}, not an object")
    return npz, man, m


def read_trace(path: str | os.PathLike) -> Trace:
    """Read and validate a trace given as ``NAME.npz`` (or ``NAME.json`` / ``NAME``)."""
    npz, man, m = read_manifest(path)
    if not os.path.lexists(npz):
        raise _err(npz, "npz", f"not found (the manifest {man.name} names it)",
                   f"copy {npz.name} next to {man.name} or re-capture")
    blob = read_bytes(npz, "trace npz", _FIX)
    if len(blob) != m["bytes"]:
        raise _err(npz, "field 'bytes'", f"the npz has {len(blob)} bytes, the manifest says {m['bytes']} "
                   f"({'truncated' if len(blob) < m['bytes'] else 'grown'})")
    digest = hashlib.sha256(blob).hexdigest()
    if digest != m["sha256"]:
        raise _err(npz, "field 'sha256'", f"the npz hashes to {digest[:16]}..., the manifest says "
                   f"{m['sha256'][:16]}... (corrupted or replaced)")
    try:
        stored = load_npz(npz)  # headers checked first: object arrays, oversized shapes and headers refused
    except DataError as exc:
        raise _err(npz, "npz", f"cannot be loaded: {str(exc).removeprefix(f'{npz}: ')}") from None
    _check_arrays(npz, stored, m, m["dtype"])
    arrays = _decode(stored, m["dtype"])
    for name in ARRAYS:
        _check_finite(npz, name, arrays[name])
        arrays[name].setflags(write=False)
    return Trace(path=npz, manifest=m, **arrays)
