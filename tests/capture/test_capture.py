"""Capturing GDN inputs (drift/capture): from a tiny transformers model, validated against the
model's own computation, and from an SGLang-shaped verify loop through SGLangTraceRecorder."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from drift.capture.sglang_hook import SGLangTraceRecorder, install_from_env
from drift.errors import ConfigError
from drift.sim.tracefile import read_trace

from drift.capture import transformers_capture as tc  # imports transformers lazily


def _have_transformers5() -> bool:
    if importlib.util.find_spec("transformers") is None:
        return False
    try:
        import transformers
    except ImportError:
        return False
    return int(transformers.__version__.split(".")[0]) >= 5


needs_transformers = pytest.mark.skipif(not _have_transformers5(), reason="needs transformers>=5 "
                                        "(pip install 'transformers>=5'; drift's capture extra)")

U32 = 2.0 ** -24  # fp32 unit roundoff
UBF16 = 2.0 ** -8  # bf16 unit roundoff (8 significand bits)
PROMPT, NEW, SEQ = 6, 12, 2  # T = 18 tokens: prefill path for 6, single-token decode path for 12


# --------------------------------------------------------------------------- float64 reference
def conv_silu64(x: np.ndarray, w: np.ndarray, bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal conv + SiLU in float64 from an empty window: x [B, T, C], w [C, Kc]
    (tap m multiplies token t-(Kc-1)+m), bias [C]. Returns (out, sum of |terms|)."""
    B, T, C = x.shape
    Kc = w.shape[1]
    pad = np.concatenate([np.zeros((B, Kc - 1, C)), x], axis=1)
    acc = np.broadcast_to(bias, (B, T, C)).copy()
    mag = np.abs(acc)
    for m in range(Kc):
        term = pad[:, m:m + T, :] * w[:, m]
        acc += term
        mag += np.abs(term)
    return acc / (1.0 + np.exp(-acc)), mag


def gates64(a, b, A_log, dt_bias):
    """g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), float64. torch's softplus
    returns s itself above 20: log1p(exp(-s)) < 2.1e-9 there, < U32 relative to s > 20."""
    s = a + dt_bias
    sp = np.where(s > 20, s, np.log1p(np.exp(np.minimum(s, 20))))
    return -np.exp(A_log) * sp, 1.0 / (1.0 + np.exp(-b)), s


def grouped_order(HK: int, HV: int, K: int, V: int) -> np.ndarray:
    """A wrong channel order (negative control): per key head [q_g | k_g | v of its HV/HK
    value heads], the layout of Qwen3-Next's in_proj_qkvz rows (without z)."""
    r = HV // HK
    idx = []
    for g in range(HK):
        idx += list(range(g * K, (g + 1) * K))
        idx += list(range(HK * K + g * K, HK * K + (g + 1) * K))
        idx += list(range(2 * HK * K + g * r * V, 2 * HK * K + (g + 1) * r * V))
    return np.array(idx)


def model_view(seen, idx):
    """The model's own post-conv q|k|v [B, T, C], g and beta [B, T, HV] of layer ``idx``."""
    ent = seen[idx]
    q, k, v = (torch.cat([e[n] for e in ent], dim=1) for n in ("q", "k", "v"))
    B, T = q.shape[:2]
    out = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)
    g, beta = (torch.cat([e[n] for e in ent], dim=1) for n in ("g", "beta"))
    return out.double().numpy(), g.double().numpy(), beta.double().numpy()


def excess(x, w, bias, a, b, A_log, dt_bias, model_out, model_g, model_beta, u):
    """max |ref - model| / tolerance for conv+SiLU, g and beta (<= 1 means they agree).

    Tolerances (inputs are exact in float64; the model rounds in its run dtype, unit u):
    * conv: a Kc-term dot product (+ bias) rounded in the run dtype errs by at most about
      Kc*u*sum|terms| in any summation order (taken twice for margin); SiLU's slope is below
      1.1, and evaluating it costs a few ulps: + 4u|out|.
    * g: computed in float32 by the model in both dtypes (a.float() + dt_bias, softplus, exp):
      the sum rounds by U32*|s| and softplus' slope is below 1 -> exp(A)*U32*|s| (twice), the
      rest a few ulps -> 8*U32*|g|.
    * beta: sigmoid in the run dtype: 4 ulps for fp32; bf16 rounds the result (u) and its
      input was exact -> 2u.
    """
    ref, mag = conv_silu64(x, w, bias)
    tol = 1.1 * 2 * w.shape[1] * u * mag + 4 * u * np.abs(ref)
    g, beta, s = gates64(a, b, A_log, dt_bias)
    tol_g = 8 * U32 * np.abs(g) + 2 * U32 * np.exp(A_log) * np.abs(s)
    tol_b = (4 * U32 if u == U32 else 2 * u) * beta
    return (np.abs(ref - model_out) / tol).max(), (np.abs(g - model_g) / tol_g).max(), \
        (np.abs(beta - model_beta) / tol_b).max()


# --------------------------------------------------------------------------- transformers
@pytest.fixture(scope="module", params=[(a, d) for a in tc.TINY_ARCHS for d in ("float32", "bfloat16")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def captured(request):
    arch, dtype = request.param
    model = tc.build_tiny_model(arch, seed=3, dtype=getattr(torch, dtype))
    with tc.record_gdn_internals(model) as seen:
        c = tc.capture(model, tokens=NEW, prompt_len=PROMPT, sequences=SEQ, seed=5)
    return arch, dtype, model, c, seen


@needs_transformers
def test_tiny_capture_file_matches_manifest(captured, tmp_path):
    arch, dtype, model, c, _ = captured
    npz = tc.capture_to_file(model, tmp_path / "tiny", tokens=NEW, prompt_len=PROMPT, sequences=SEQ, seed=5)
    tr = read_trace(npz)
    T = PROMPT + NEW
    L, HK, HV, K, V, Kc = 2, 2, 4, 32, 32, 4  # build_tiny_model: GDN layers 0 and 2
    C = 2 * HK * K + HV * V
    assert (tr.sequences, tr.tokens, tr.num_layers, tr.num_k_heads, tr.num_v_heads, tr.head_k_dim, tr.head_v_dim,
            tr.conv_kernel, tr.conv_channels) == (SEQ, T, L, HK, HV, K, V, Kc, C)
    assert tr.x.shape == (SEQ, T, L, C) and tr.a.shape == tr.b.shape == (SEQ, T, L, HV)
    assert tr.conv_weight.shape == (L, C, Kc) and tr.A_log.shape == tr.dt_bias.shape == (L, HV)
    assert tr.layers == [0, 2] and tr.dtype == dtype
    assert tr.model["prompt_tokens"] == PROMPT and tr.model["decoded_tokens"] == NEW and tr.model["source"] == "tiny"
    assert tr.model["config"]["linear_num_value_heads"] == HV and tr.manifest["versions"]["transformers"]
    # (C + 2*HV) values per token per layer: (256 + 8) * 4 B = 1056 (fp32), * 2 B = 528 (bf16).
    assert tr.bytes_per_token_per_layer == {"float32": 1056, "bfloat16": 528}[dtype] == c["bytes_per_token_per_layer"]
    # Same seed, same greedy decode: the file holds exactly what capture() returned.
    assert np.array_equal(tr.x, c["x"].float().numpy()) and np.array_equal(tr.b, c["b"].float().numpy())
    assert np.array_equal(tr.conv_weight, c["conv_weight"].numpy())
    assert not tr.conv_bias.any()  # the Qwen GDN conv has no bias


@needs_transformers
def test_capture_is_a_greedy_decode_of_prompt_plus_new_tokens(captured):
    """token_ids = prompt + NEW + 1 generated; a no-cache forward over the first T tokens
    predicts every generated one (greedy, EOS suppressed so all NEW tokens come), so the
    trace's T = PROMPT + NEW are the tokens fed."""
    _, dtype, model, c, _ = captured
    ids = c["token_ids"]
    assert ids.shape == (SEQ, PROMPT + NEW + 1)
    with torch.no_grad():
        logits = model(ids[:, :-1]).logits.float()
    logits[..., model.config.eos_token_id] = -torch.inf
    L = logits[:, PROMPT - 1:]  # [SEQ, NEW + 1, vocab]
    top = L.max(-1).values

    def gap(tokens):  # how far below the no-cache forward's best logit each token's logit is
        n = tokens.shape[1]
        return top[:, :n] - L[:, :n].gather(-1, tokens[..., None]).squeeze(-1)

    # In bf16 the cached decode and this no-cache forward round the same logits separately: a
    # generated token whose logit is within one bf16 ulp of the maximum is a tie, not another
    # decode (transformers 5.24 breaks one exact tie the other way here). fp32: exact argmax.
    tie = 2.0 ** (torch.floor(torch.log2(top.abs())) - 7) if dtype == "bfloat16" else torch.zeros_like(top)
    assert (gap(ids[:, PROMPT:]) <= tie).all(), (gap(ids[:, PROMPT:]), tie)
    # Ties are rare: measured 1 of 26 positions in bf16 (transformers 5.24), none in fp32; 0.9 allows two.
    assert (L.argmax(-1) == ids[:, PROMPT:]).float().mean() >= 0.9
    assert not (gap(ids[:, PROMPT + 1:]) <= tie[:, :-1]).all()  # negative control: off by one token


@needs_transformers
def test_capture_matches_the_models_own_conv_and_gates(captured):
    """Recompute, in float64 from the trace alone, conv+SiLU, g and beta for every token of every
    GDN layer (prefill and decode paths), and compare with what the model's own forward handed
    its delta-rule kernels; then break the capture three ways and see each one caught."""
    arch, dtype, model, c, seen = captured
    u = U32 if dtype == "float32" else UBF16
    d = tc.GDNInputRecorder(model).dims
    wrong = grouped_order(d["num_k_heads"], d["num_v_heads"], d["head_k_dim"], d["head_v_dim"])
    assert not np.array_equal(wrong, np.arange(d["conv_channels"]))
    for li, idx in enumerate(c["layers"]):
        x, a, b = (c[n][:, :, li].double().numpy() for n in ("x", "a", "b"))
        w, bias = c["conv_weight"][li].double().numpy(), c["conv_bias"][li].double().numpy()
        A_log, dt_bias = c["A_log"][li].double().numpy(), c["dt_bias"][li].double().numpy()
        out, g, beta = model_view(seen, idx)
        assert out.shape == x.shape and g.shape == a.shape  # the model saw all T tokens
        ok = excess(x, w, bias, a, b, A_log, dt_bias, out, g, beta, u)  # every token, the last included
        assert max(ok) <= 1.0, (arch, dtype, idx, ok)
        # Negative controls, each must break the comparison it touches.
        grouped = excess(x[..., wrong], w, bias, a, b, A_log, dt_bias, out, g, beta, u)[0]
        shifted = excess(np.roll(x, 1, axis=1), w, bias, a, b, A_log, dt_bias, out, g, beta, u)[0]
        swapped = excess(x, w, bias, b, a, A_log, dt_bias, out, g, beta, u)
        heads = excess(x, w, bias, a, b, A_log, dt_bias[::-1], out, g, beta, u)[1]
        assert grouped > 10 and shifted > 10, (grouped, shifted)
        assert swapped[1] > 10 and swapped[2] > 10 and heads > 10, (swapped, heads)


@needs_transformers
def test_capture_refuses_what_it_cannot_trace():
    with pytest.raises(ConfigError, match="GatedDeltaNet"):
        tc.find_gdn_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(ConfigError, match="bfloat16 or float32"):
        tc.capture(tc.build_tiny_model(dtype=torch.float16), tokens=1, prompt_len=2)
    with pytest.raises(ConfigError, match="not a checkpoint directory"):
        tc.load_model("/nonexistent/model")


@needs_transformers
def test_split_qwen3_next_against_the_models_own_reordering():
    """split_qwen3_next reorders Qwen3-Next's grouped projections; the model's own
    fix_query_key_value_ordering on the same projections must give the same q, k, v, b, a."""
    model = tc.build_tiny_model("qwen3_next")
    _, m = tc.find_gdn_layers(model)[0]
    h = torch.randn(2, 3, model.config.hidden_size)
    qkvz, ba = m.in_proj_qkvz(h), m.in_proj_ba(h)
    q, k, v, _, b, a = m.fix_query_key_value_ordering(qkvz, ba)
    x, a2, b2 = tc.split_qwen3_next(qkvz, ba, tc.GDNInputRecorder(model).dims)
    want = torch.cat([q.reshape(2, 3, -1), k.reshape(2, 3, -1), v.reshape(2, 3, -1)], dim=-1)
    assert torch.equal(x, want) and torch.equal(a2, a) and torch.equal(b2, b)
    assert not torch.equal(a2, b)  # negative control: a and b differ, so a swap would show


@needs_transformers
def test_load_model_from_a_local_checkpoint(tmp_path):
    """load_model on a saved tiny checkpoint (offline): same weights, so the same capture, and
    the manifest's source is the checkpoint directory."""
    tiny = tc.build_tiny_model("qwen3_5", seed=4)
    tiny.save_pretrained(tmp_path / "ckpt")
    loaded = tc.load_model(tmp_path / "ckpt", dtype=torch.float32)
    a = tc.capture(tiny, tokens=3, prompt_len=4, seed=1)
    b = tc.capture(loaded, tokens=3, prompt_len=4, seed=1)
    assert torch.equal(a["x"], b["x"]) and torch.equal(a["conv_weight"], b["conv_weight"])
    assert b["model"]["source"] == str((tmp_path / "ckpt").resolve()) and a["model"]["source"] == "tiny"
    other = tc.capture(tc.build_tiny_model("qwen3_5", seed=5), tokens=3, prompt_len=4, seed=1)
    assert not torch.equal(a["x"], other["x"])  # negative control: other weights, other inputs


# --------------------------------------------------------------------------- SGLang recorder
HKs, HVs, Ks, Vs, KCs, D = 1, 2, 2, 2, 3, 4
Cs = 2 * HKs * Ks + HVs * Vs  # 8
LAYERS = (0, 3)


class Mode:
    def __init__(self, name):
        self.name = name

    def is_target_verify(self):
        return self.name == "TARGET_VERIFY"

    def is_extend(self):
        return self.name in ("EXTEND", "MIXED", "DRAFT_EXTEND", "TARGET_VERIFY")

    def is_draft_extend(self):
        return self.name == "DRAFT_EXTEND"


def fake_layer(lid):
    g = torch.Generator().manual_seed(lid)
    return SimpleNamespace(layer_id=lid, A_log=torch.randn(HVs, generator=g), dt_bias=torch.randn(HVs, generator=g),
                           conv_weights=torch.randn(Cs, 1, KCs, generator=g), bias=None, num_q_heads=HKs,
                           num_k_heads=HKs, num_v_heads=HVs, head_q_dim=Ks, head_k_dim=Ks, head_v_dim=Vs)


class StandInGDNBackend:
    """Same interface as SGLang 0.5.23's AscendGDNAttnBackend.forward_extend."""

    graph_mode = False

    def __init__(self):
        self.calls = []

    def forward_extend(self, layer, forward_batch, mixed_qkv, a, b, **kwargs):
        self.calls.append((layer.layer_id, forward_batch.forward_mode.name, mixed_qkv.shape))
        return ("out", layer.layer_id)


class StandInHybridBackend:
    """Same interface as the hybrid backend's update_mamba_state_after_mtp_verify."""

    def __init__(self):
        self.updates = []

    def update_mamba_state_after_mtp_verify(self, last_correct_step_indices, mamba_track_indices,
                                            mamba_steps_to_track, model, req_pool_indices=None):
        self.updates.append(list(last_correct_step_indices.tolist()))
        return "updated"


class Engine:
    """A verify loop over true token streams: a window's positions 0..s are the request's next
    true tokens, positions s+1.. rejected drafts (different values)."""

    def __init__(self, gdn, hybrid, streams, dtype=torch.bfloat16, seed=0):
        self.gdn, self.hybrid, self.dtype = gdn, hybrid, dtype
        self.layers = [fake_layer(i) for i in LAYERS]
        self.streams = streams  # key -> (x [N, L, C], a [N, L, HV], b [N, L, HV])
        self.pos = {k: 0 for k in streams}
        self.g = torch.Generator().manual_seed(seed)

    def prefill(self, keys, lens, prefix=None):
        fb = SimpleNamespace(forward_mode=Mode("EXTEND"), req_pool_indices=torch.tensor(keys),
                             extend_seq_lens_cpu=lens, extend_prefix_lens_cpu=prefix or [0] * len(keys))
        for li, layer in enumerate(self.layers):
            parts = [[self.streams[k][j][self.pos[k]:self.pos[k] + n, li] for k, n in zip(keys, lens)]
                     for j in range(3)]
            self.gdn.forward_extend(layer, fb, *(torch.cat(p) for p in parts))
        for k, n in zip(keys, lens):
            self.pos[k] += n

    def verify(self, rows, steps, pass_keys="update", graph=False, draft_token_num=D, report=None):
        """rows: request keys (None = padded row); steps: last correct index per row; report:
        what the update is told instead (a mutant engine), default the steps themselves."""
        fb = SimpleNamespace(forward_mode=Mode("TARGET_VERIFY"), spec_info=SimpleNamespace(draft_token_num=draft_token_num),
                             req_pool_indices=torch.tensor([-1 if k is None else k for k in rows]))
        if pass_keys != "batch":
            del fb.req_pool_indices
        self.gdn.graph_mode = graph
        for li, layer in enumerate(self.layers):
            win = [torch.randn(len(rows), D, n, generator=self.g).to(self.dtype) for n in (Cs, HVs, HVs)]
            for r, (k, s) in enumerate(zip(rows, steps)):
                if k is not None and s >= 0:
                    for j in range(3):
                        win[j][r, :s + 1] = self.streams[k][j][self.pos[k]:self.pos[k] + s + 1, li]
            ret = self.gdn.forward_extend(layer, fb, win[0].reshape(-1, Cs), win[1].reshape(-1, HVs),
                                          win[2].reshape(-1, HVs))
            assert ret == ("out", layer.layer_id)  # the wrapper returns what the backend returned
        kw = {"req_pool_indices": torch.tensor([-1 if k is None else k for k in rows])} if pass_keys == "update" else {}
        ret = self.hybrid.update_mamba_state_after_mtp_verify(
            last_correct_step_indices=torch.tensor([report(v) if report else v for v in steps]), mamba_track_indices=None, mamba_steps_to_track=None,
            model=None, **kw)
        assert ret == "updated"
        for k, s in zip(rows, steps):
            if k is not None and s >= 0:
                self.pos[k] += s + 1


def streams(keys, n=40, dtype=torch.bfloat16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {k: tuple(torch.randn(n, len(LAYERS), w, generator=g).to(dtype) for w in (Cs, HVs, HVs)) for k in keys}


SCHEDULE = [  # (rows as request keys, last correct step per row); None = padded row
    ([7, 2, None], [3, 0, -1]),
    ([2, 7, None], [1, 2, -1]),  # rows reordered between steps
    ([7, 2, 9], [0, 3, 1]),       # request 9 joins
    ([9, 7, 2], [2, -1, 0]),      # request 7 gets no row this step (-1)
]


def run_schedule(gdn, hybrid, pass_keys="update", schedule=SCHEDULE, **kw):
    st = streams([7, 2, 9])
    eng = Engine(gdn, hybrid, st)
    for rows, steps in schedule:
        eng.verify(rows, steps, pass_keys=pass_keys, **kw)
    return eng, st


@pytest.mark.parametrize("pass_keys", ["update", "batch"])
def test_sglang_recorder_keeps_exactly_the_accepted_tokens(tmp_path, pass_keys):
    gdn, hybrid = StandInGDNBackend(), StandInHybridBackend()
    with SGLangTraceRecorder(gdn, hybrid) as rec:
        eng, st = run_schedule(gdn, hybrid, pass_keys=pass_keys)
    assert "forward_extend" not in vars(gdn) and UPDATE not in vars(hybrid)  # restored
    assert len(gdn.calls) == len(SCHEDULE) * len(LAYERS) and len(hybrid.updates) == len(SCHEDULE)
    # committed per request: 7: 4+3+1 = 8, 2: 1+2+4+1 = 8, 9: 2+3 = 5 tokens
    assert dict(rec.requests()) == {7: 8, 2: 8, 9: 5} == {k: eng.pos[k] for k in (7, 2, 9)}
    for k in (7, 2, 9):
        got = rec.tokens(k)
        for j, name in enumerate(("x", "a", "b")):
            assert torch.equal(got[name], st[k][j][:eng.pos[k]]), (k, name)
    npz = rec.save(tmp_path / "sg", model_name="stand-in", sequences=2)
    tr = read_trace(npz)
    assert tr.model["requests"] == ["7", "2"] and tr.tokens == 8 and tr.layers == list(LAYERS)
    assert (tr.num_k_heads, tr.num_v_heads, tr.head_k_dim, tr.head_v_dim, tr.conv_kernel) == (HKs, HVs, Ks, Vs, KCs)
    assert tr.dtype == "bfloat16" and tr.model["source"] == "sglang"
    for r, k in enumerate((7, 2)):
        assert np.array_equal(tr.x[r], st[k][0][:8].float().numpy())
        assert np.array_equal(tr.a[r], st[k][1][:8].float().numpy())
    layer = fake_layer(3)
    assert np.array_equal(tr.conv_weight[1], layer.conv_weights[:, 0].numpy())
    assert np.array_equal(tr.A_log[1], layer.A_log.numpy()) and not tr.conv_bias.any()
    all3 = read_trace(rec.save(tmp_path / "sg3"))  # all requests, cut to the shortest (5)
    assert all3.sequences == 3 and all3.tokens == 5


def test_sglang_recorder_negative_controls():
    """The comparison above notices (a) an engine reporting accepted counts where the recorder
    expects the last correct index (one rejected draft slips in per row), (b) row-position keys
    when rows are reordered between steps."""
    gdn, hybrid = StandInGDNBackend(), StandInHybridBackend()
    with SGLangTraceRecorder(gdn, hybrid) as rec:
        eng, st = run_schedule(gdn, hybrid, report=lambda s: s + 1 if 0 <= s < D - 1 else s)
    assert rec.requests()[0][1] > eng.pos[7]
    assert not torch.equal(rec.tokens(7)["x"][:eng.pos[7]], st[7][0][:eng.pos[7]])
    gdn, hybrid = StandInGDNBackend(), StandInHybridBackend()
    with SGLangTraceRecorder(gdn, hybrid) as rec:
        eng, st = run_schedule(gdn, hybrid, pass_keys="none", schedule=SCHEDULE[:2])
    assert {k for k, _ in rec.requests()} == {0, 1}  # keyed by row
    assert not torch.equal(rec.tokens(0)["x"], st[7][0][:eng.pos[7]])


UPDATE = "update_mamba_state_after_mtp_verify"


def test_sglang_recorder_on_classes_prefill_and_pool_reuse(tmp_path):
    class GDN(StandInGDNBackend):
        pass

    class Hybrid(StandInHybridBackend):
        pass

    orig_fwd, orig_upd = GDN.forward_extend, Hybrid.__dict__.get(UPDATE)
    gdn, hybrid = GDN(), Hybrid()
    rec = SGLangTraceRecorder(GDN, Hybrid, record_prefill=True).install()
    assert GDN.forward_extend is not orig_fwd
    st = streams([4, 5], n=60)
    eng = Engine(gdn, hybrid, st)
    eng.prefill([4, 5], [3, 5])
    eng.verify([4, 5], [2, 1])
    eng.prefill([5], [2], prefix=[eng.pos[5]])  # a later chunk of 5's prompt would append...
    eng.verify([4, 5], [0, 3])
    assert dict(rec.requests()) == {4: 3 + 3 + 1, 5: 5 + 2 + 2 + 4}
    for k in (4, 5):
        assert torch.equal(rec.tokens(k)["x"], st[k][0][:eng.pos[k]])
    # ...but a fresh prefill (prefix 0) on pool index 4 is a new request, never spliced on.
    first4 = rec.tokens(4)["x"]
    st_new = streams([4], n=20, seed=9)
    eng.streams[4], eng.pos[4] = st_new[4], 0
    eng.prefill([4], [2])
    eng.verify([4], [1])
    assert [n for k, n in rec.requests() if k == 4] == [7, 4]
    assert torch.equal(rec.tokens(4)["x"], st_new[4][0][:4])
    tr = read_trace(rec.save(tmp_path / "p", sequences=3))
    assert tr.tokens == 4  # the shortest of the three (the new request 4)
    assert tr.model["prompt_tokens"] == [min(5 + 2, 4), 3, 2]  # prefilled tokens within the T kept
    assert np.array_equal(tr.x[1], first4[:4].float().numpy())
    rec.uninstall()
    assert GDN.forward_extend is orig_fwd and UPDATE not in vars(GDN) and Hybrid.__dict__.get(UPDATE) is orig_upd
    assert "forward_extend" not in vars(GDN)


def test_sglang_recorder_refuses_graph_replays_and_bad_windows():
    gdn, hybrid = StandInGDNBackend(), StandInHybridBackend()
    with SGLangTraceRecorder(gdn, hybrid):
        eng = Engine(gdn, hybrid, streams([1]))
        with pytest.raises(RuntimeError, match="--disable-cuda-graph"):
            eng.verify([1], [2], graph=True)
        eng.verify([1], [-1])  # nothing accepted: nothing to commit, no error
        with pytest.raises(RuntimeError, match="outside the window"):
            eng.verify([1], [1], report=lambda s: D)  # the update claims position D of a D-token window
    with SGLangTraceRecorder(gdn, hybrid):
        with pytest.raises(RuntimeError, match="draft_token_num"):
            Engine(gdn, hybrid, streams([1])).verify([1], [0], draft_token_num=None)
    with pytest.raises(TypeError, match="forward_extend"):
        SGLangTraceRecorder(object(), hybrid)


def test_install_from_env_autosaves(tmp_path):
    class GDN(StandInGDNBackend):
        pass

    class Hybrid(StandInHybridBackend):
        pass

    assert install_from_env(GDN, Hybrid, environ={}) is None
    env = {"DRIFT_SGLANG_TRACE": str(tmp_path / "t-{pid}.npz"), "DRIFT_SGLANG_TRACE_EVERY": "2",
           "DRIFT_SGLANG_TRACE_MODEL": "nightly"}
    rec = install_from_env(GDN, Hybrid, environ=env, register_atexit=False)
    try:
        eng = Engine(GDN(), Hybrid(), streams([3]))
        eng.verify([3], [1])
        assert not list(tmp_path.glob("t-*.npz"))  # saved every 2 commits
        eng.verify([3], [2])
        (npz,) = tmp_path.glob("t-*.npz")
        tr = read_trace(npz)
        assert tr.tokens == 5 and tr.model["name"] == "nightly"
    finally:
        rec.uninstall()
