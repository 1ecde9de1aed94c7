"""The trace file format (drift/sim/tracefile.py): bit-exact round trips, and every damaged or
inconsistent trace refused with a DataError that names the file and the field."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from drift.dtypes import as_bits
from drift.errors import DataError
from drift.fileio import load_npz, npz_bytes
from drift.sim.tracefile import (ARRAYS, bf16_bits_to_float32, float32_to_bf16_bits, read_trace, trace_paths,
                                 write_trace)

# Shapes: R=2 sequences, T=5 tokens, L=2 layers, HK=1, HV=2, K=V=4 -> C = 2*1*4 + 2*4 = 16, Kc=3.
R, T, L, HK, HV, K, V, KC = 2, 5, 2, 1, 2, 4, 4, 3
C = 2 * HK * K + HV * V
MODEL = {"name": "unit", "source": "tiny", "config": {"num_k_heads": HK, "head_k_dim": K, "head_v_dim": V}}


def make(dtype: str, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    return {"x": torch.randn(R, T, L, C, generator=g).to(tdt), "a": torch.randn(R, T, L, HV, generator=g).to(tdt),
            "b": torch.randn(R, T, L, HV, generator=g).to(tdt), "A_log": torch.randn(L, HV, generator=g),
            "dt_bias": torch.randn(L, HV, generator=g), "conv_weight": torch.randn(L, C, KC, generator=g),
            "conv_bias": torch.randn(L, C, generator=g), "dtype": dtype, "model": MODEL, "layers": [0, 3]}


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_round_trip_is_bit_exact(tmp_path, dtype):
    src = make(dtype)
    npz = write_trace(tmp_path / "t", **src, versions_extra={"transformers": "x.y"})
    assert npz == tmp_path / "t.npz" and (tmp_path / "t.json").is_file()
    tr = read_trace(npz)
    for name in ARRAYS:
        want = src[name].float().numpy()
        got = getattr(tr, name)
        assert got.dtype == np.float32 and got.shape == want.shape, name
        assert np.array_equal(bits(got), bits(want)), name  # bit-exact: bf16 decodes exactly to fp32
        assert not got.flags.writeable
    # The npz holds the run dtype: bf16 as its uint16 bit patterns, fp32 as float32.
    raw = load_npz(npz)
    if dtype == "bfloat16":
        assert raw["x"].dtype == np.uint16
        assert np.array_equal(raw["x"], as_bits(src["x"]).numpy().view(np.uint16))
    else:
        assert raw["x"].dtype == np.float32
    m = tr.manifest
    assert (m["kind"], m["schema"], m["dtype"], m["file"]) == ("drift-trace", 1, dtype, "t.npz")
    assert (tr.sequences, tr.tokens, tr.num_layers, tr.num_k_heads, tr.num_v_heads, tr.head_k_dim, tr.head_v_dim,
            tr.conv_kernel, tr.conv_channels) == (R, T, L, HK, HV, K, V, KC, C)
    # x, a, b of one (sequence, token, layer): (C + 2*HV) values of 2 (bf16) or 4 (fp32) bytes.
    assert tr.bytes_per_token_per_layer == (C + 2 * HV) * (2 if dtype == "bfloat16" else 4)
    assert m["bytes"] == npz.stat().st_size and m["sha256"] == hashlib.sha256(npz.read_bytes()).hexdigest()
    assert m["versions"]["transformers"] == "x.y" and {"drift", "torch", "numpy"} <= set(m["versions"])
    assert tr.layers == [0, 3] and m["created"].endswith("Z")
    # The manifest path and the bare stem name the same trace.
    assert np.array_equal(read_trace(tmp_path / "t.json").x, tr.x) and read_trace(tmp_path / "t").tokens == T
    assert "t.npz" in tr.describe() and "\n" not in tr.describe()


def test_bf16_bit_helpers_and_numpy_inputs(tmp_path):
    x = make("bfloat16")["x"]
    u16 = as_bits(x).numpy().view(np.uint16)
    f32 = x.float().numpy()
    assert np.array_equal(bf16_bits_to_float32(u16), f32)
    assert np.array_equal(float32_to_bf16_bits(f32), u16)
    # Negative control: a float32 value off the bf16 grid has no bf16 bit pattern.
    off = f32.copy()
    off.flat[7] = np.nextafter(off.flat[7], np.float32(np.inf))
    assert float32_to_bf16_bits(off) is None
    # uint16 bits and bf16-exact float32 write the same bytes as the bf16 tensor.
    src = make("bfloat16")
    p1 = write_trace(tmp_path / "t1", **src)
    p2 = write_trace(tmp_path / "t2", **{**src, "x": u16, "a": src["a"].float().numpy()})
    assert p1.read_bytes() == p2.read_bytes()
    with pytest.raises(DataError, match=r"t3\.npz: array 'x': .*not exactly bfloat16"):
        write_trace(tmp_path / "t3", **{**src, "x": off})
    assert not (tmp_path / "t3.npz").exists()


# --------------------------------------------------------------------------- bad traces
def _rewrite(npz: Path, arrays: dict) -> None:
    """Replace the npz and fix the manifest's size and hash, so the deeper checks are reached."""
    blob = npz_bytes(arrays)
    npz.write_bytes(blob)
    _edit(npz, bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest())


def _edit(npz: Path, **fields) -> None:
    man = npz.with_suffix(".json")
    m = json.loads(man.read_text())
    m.update(fields)
    man.write_text(json.dumps(m))


def _arrays(npz: Path, **replace) -> dict:
    a = load_npz(npz)
    a.update(replace)
    return {k: v for k, v in a.items() if v is not None}


def _bf16_nan_at(npz: Path, name: str, idx: tuple) -> dict:
    arr = load_npz(npz)[name].copy()
    arr[idx] = 0x7FC0  # bf16 quiet NaN
    return _arrays(npz, **{name: arr})


BAD = {
    # case: (mutation(npz), file the message names ("npz"/"json"), substrings it must hold)
    "missing manifest": (lambda p: p.with_suffix(".json").unlink(), "json", ["manifest", "not found"]),
    "missing npz": (lambda p: p.unlink(), "npz", ["npz", "not found"]),
    "manifest not JSON": (lambda p: p.with_suffix(".json").write_text("{not json"), "json", ["manifest", "not valid JSON"]),
    "manifest NaN": (lambda p: p.with_suffix(".json").write_text(
        p.with_suffix(".json").read_text().replace('"bytes": ', '"bytes": NaN, "x": ', 1)), "json", ["not valid JSON"]),
    "manifest a list": (lambda p: p.with_suffix(".json").write_text("[1]"), "json", ["manifest", "not an object"]),
    "wrong kind": (lambda p: _edit(p, kind="drift-report"), "json", ["'kind'"]),
    "wrong schema": (lambda p: _edit(p, schema=2), "json", ["'schema'", "schema 1"]),
    "wrong dtype field": (lambda p: _edit(p, dtype="float16"), "json", ["'dtype'"]),
    "file renamed": (lambda p: _edit(p, file="other.npz"), "json", ["'file'", "other.npz"]),
    "truncated npz": (lambda p: p.write_bytes(p.read_bytes()[:-100]), "npz", ["'bytes'", "truncated"]),
    "flipped byte": (lambda p: _flip(p), "npz", ["'sha256'", "corrupted"]),
    "missing array": (lambda p: _rewrite(p, _arrays(p, b=None)), "npz", ["array 'b'", "missing"]),
    "extra array": (lambda p: _rewrite(p, _arrays(p, z=np.zeros(3, np.float32))), "npz", ["array 'z'"]),
    "wrong dtype": (lambda p: _rewrite(p, _arrays(p, x=bf16_bits_to_float32(load_npz(p)["x"]))), "npz",
                    ["array 'x'", "float32", "uint16"]),
    "wrong param dtype": (lambda p: _rewrite(p, _arrays(p, A_log=load_npz(p)["A_log"].astype(np.float64))), "npz",
                          ["array 'A_log'", "float64"]),
    "shape vs manifest": (lambda p: _edit(p, tokens=T + 1), "npz",
                          ["array 'x'", f"({R}, {T}, {L}, {C})", f"({R}, {T + 1}, {L}, {C})"]),
    "shape of one array": (lambda p: _rewrite(p, _arrays(p, conv_bias=np.zeros((L, C + 1), np.float32))), "npz",
                           ["array 'conv_bias'", f"({L}, {C + 1})", f"({L}, {C})"]),
    "NaN in a": (lambda p: _rewrite(p, _bf16_nan_at(p, "a", (1, 2, 0, 1))), "npz", ["array 'a'", "[1, 2, 0, 1]", "nan"]),
    "Inf in conv_weight": (lambda p: _rewrite(p, _arrays(p, conv_weight=_with(load_npz(p)["conv_weight"], (1, 3, 2), np.inf))),
                           "npz", ["array 'conv_weight'", "[1, 3, 2]", "inf"]),
    "HV not a multiple of HK": (lambda p: _edit(p, num_k_heads=3), "json", ["'num_v_heads'", "multiple"]),
    "C inconsistent": (lambda p: _edit(p, head_k_dim=K + 1), "json", ["'conv_channels'", str(C)]),
    "Kc < 2": (lambda p: _edit(p, conv_kernel=1), "json", ["'conv_kernel'", ">= 2"]),
    "T < 1": (lambda p: _edit(p, tokens=0), "json", ["'tokens'", ">= 1"]),
    "T not an int": (lambda p: _edit(p, tokens="5"), "json", ["'tokens'", "not an integer"]),
    "layers wrong length": (lambda p: _edit(p, layers=[0]), "json", ["'layers'"]),
    "bytes per token wrong": (lambda p: _edit(p, bytes_per_token_per_layer=1), "json", ["'bytes_per_token_per_layer'"]),
    "model block": (lambda p: _edit(p, model={"name": "m"}), "json", ["'model'"]),
}


BF16_CASES = {"NaN in a", "wrong dtype"}  # mutations that work on uint16 bf16 bits


def _flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


def _with(arr: np.ndarray, idx: tuple, value) -> np.ndarray:
    arr = arr.copy()
    arr[idx] = value
    return arr


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_trace_is_refused_naming_file_and_field(tmp_path, case):
    mutate, which, needles = BAD[case]
    npz = write_trace(tmp_path / "t", **make("bfloat16" if case in BF16_CASES else "float32"))
    read_trace(npz)  # positive control: intact, it reads
    mutate(npz)
    with pytest.raises(DataError) as ei:
        read_trace(npz)
    msg = str(ei.value)
    npz_p, man_p = trace_paths(npz)
    assert str(npz_p if which == "npz" else man_p) in msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    assert "; " in msg.split(": ", 2)[-1], msg  # a fix follows the problem


def test_object_array_is_refused_on_write_and_on_read(tmp_path):
    src = make("float32")
    obj = np.empty((L, HV), dtype=object)
    obj[:] = 1.0
    with pytest.raises(DataError, match=r"t\.npz: array 'A_log': .*object.*pickled"):
        write_trace(tmp_path / "t", **{**src, "A_log": obj})
    assert not any(tmp_path.iterdir())  # nothing written
    with pytest.raises(ValueError, match="pickled"):  # the shared writer refuses them too
        npz_bytes({"A_log": obj})
    # An npz smuggling an object array (np.savez pickles it), with a matching manifest:
    # read with allow_pickle=False, it is refused, not unpickled.
    npz = write_trace(tmp_path / "u", **src)
    arrays = load_npz(npz)
    arrays["A_log"] = obj
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    blob = buf.getvalue()
    npz.write_bytes(blob)
    _edit(npz, bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest())
    with pytest.raises(DataError, match=r"u\.npz: npz: cannot be loaded: array 'A_log' holds Python objects"):
        read_trace(npz)


@pytest.mark.parametrize("bad, needle", [
    ({"b": torch.randn(R, T, L, HV + 1)}, "array 'b'"),  # a defines HV; b disagrees
    ({"x": torch.randn(R, T, L, C + 1)}, "'conv_channels'"),
    ({"conv_weight": torch.randn(L, C, 1)}, "'conv_kernel'"),
    ({"x": torch.randn(R, 0, L, C), "a": torch.randn(R, 0, L, HV), "b": torch.randn(R, 0, L, HV)}, "'tokens'"),
    ({"model": {**MODEL, "config": {"num_k_heads": 3, "head_k_dim": K, "head_v_dim": V}}}, "'num_v_heads'"),
    ({"x": _with(torch.randn(R, T, L, C).numpy(), (0, 4, 1, 9), np.nan)}, "[0, 4, 1, 9]"),
    ({"layers": [0, 0]}, "'layers'"),
    ({"dtype": "float16"}, "'dtype'"),
    ({"x": torch.randn(R, T, L, C).to(torch.bfloat16)}, "array 'x'"),  # tensor dtype != trace dtype
    ({"model": {**MODEL, "config": {"bad": float("nan")}}}, "'model'"),
])
def test_write_validates_before_writing(tmp_path, bad, needle):
    with pytest.raises(DataError) as ei:
        write_trace(tmp_path / "t", **{**make("float32"), **bad})
    assert "t.npz" in str(ei.value) and needle in str(ei.value), str(ei.value)
    assert not any(tmp_path.iterdir())
