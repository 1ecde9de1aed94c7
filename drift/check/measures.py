"""Measures: the per-step reductions that checks declare and the comparison computes.

A check names the measures it reads (``Check.measures``); :class:`~drift.check.compare.Comparison`
computes the union of what its consumers declare (plus what those measures ``need``) and nothing
else, one generic loop over :data:`MEASURES`. Each measure is one registry entry: the arrays it
fills in the :class:`~drift.check.compare.MetricsChunk` and up to four hooks, all device-side torch
(the state measure also has a native C implementation, tested equal to its torch reducer in
tests/check/test_measures.py):

* ``start(comp)``: once, when the run starts (``comp.sim`` is there);
* ``snapshot(comp, view) -> Any``: at the simulation step, what must be taken before the next step
  overwrites it (stored with the step, read back as ``batch.extra[key][j]``);
* ``on_step(comp, batch, j)``: once the float64 twin has advanced through buffered step ``j``
  (``comp.twin`` at that step);
* ``on_batch(comp, batch)``: after the twin went through the whole batch of steps (its values at
  every step in ``batch.twin``; with ``states``, its committed states too; with ``deltas``, each
  token's delta and key). The built-in measures all compute here, over the batch at once;
* ``save(comp)`` / ``load(comp, state)``: what a measure carries across batches, in a checkpoint.

Arrays are float64 on the comparison's reference device: per head ``[S, L, R, HV]`` (``head``),
per row ``[S, R]`` (``row``), and boolean per-head flags that start True (``flags``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import numpy as np
import torch

from ..checkpoint import restore, saveable
from ..dtypes import store_dtype
from .golden import SCHED_FIELDS
from ..flows.fold_model import FoldSchedule
from ..registry import Registry
from ..sim import native
from ..sim.twin import TwinSteps

F64 = torch.float64


@dataclass(frozen=True)
class Measure:
    """One measure: ``key``, the arrays it fills, the measures it ``needs``, and its hooks."""

    key: str
    doc: str
    head: tuple[str, ...] = ()
    row: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    states: bool = False  # reads the twin's committed state of every step (batch.twin.state)
    deltas: bool = False  # reads each token's delta and key (batch.twin.delta / .key)
    start: Optional[Callable[[Any], None]] = None
    # what it takes of a step: snapshot(comp, view) of the run, as the step ends (before the next step
    # changes the run); twin_snapshot(comp, taken) of the twin, in order with the twin, once the lanes
    # that start at the step have restarted (taken: drift.check.compare.TakenStep)
    snapshot: Optional[Callable[[Any, Any], Any]] = None
    twin_snapshot: Optional[Callable[[Any, Any], Any]] = None
    on_step: Optional[Callable[[Any, "Batch", int], None]] = None
    on_batch: Optional[Callable[[Any, "Batch"], None]] = None
    # what it carries from one batch to the next, for a checkpoint (a nightly's resume): save(comp)
    # -> a dict already saveable (drift.checkpoint.saveable), load(comp, dict); None when it carries nothing
    save: Optional[Callable[[Any], dict]] = None
    load: Optional[Callable[[Any, dict], None]] = None

    @property
    def arrays(self) -> tuple[str, ...]:
        return self.head + self.row + self.flags


MEASURES: Registry[Measure] = Registry("measure")


def with_needs(keys: Iterable[str]) -> list[Measure]:
    """The measures ``keys`` and everything they need, in registry order (a need comes first)."""
    wanted: set[str] = set()

    def add(key: str) -> None:
        if key not in wanted:
            for need in MEASURES[key].needs:  # an unknown key raises, listing the measures
                add(need)
            wanted.add(key)

    for key in keys:
        add(key)
    return [m for name, m in MEASURES.items() if name in wanted]


def declared(consumers) -> list[Measure]:
    """What ``consumers`` declare (``measures``); one that declares nothing reads every measure."""
    keys: list[str] = []
    for c in consumers:
        keys.extend(getattr(c, "measures", None) or MEASURES.names())
    return with_needs(keys)


@dataclass
class Batch:
    """The buffered steps the comparison processes at once (``n`` of them).

    snap: the run's views per step (``run`` committed states, ``out``, ``win``, inputs), stacked
    ``[n, ...]`` on the reference device; idx ``[n]`` chunk rows; pre / accept ``[n, R]`` host int;
    marks: per step, the golden checkpoint marks (None or ``[R]``); extra: per measure, what its
    ``snapshot`` took at each step. Filled once the twin ran: ``twin``, its values at every step
    (:class:`~drift.sim.twin.TwinSteps`), rows ``[n]`` device, m ``[n, R, D]`` accepted tokens.
    """

    n: int
    snap: dict
    idx: list
    pre: np.ndarray
    accept: np.ndarray
    marks: list
    extra: dict = field(default_factory=dict)
    scratch: dict = field(default_factory=dict)  # per-batch values a measure hands a later one
    twin: Optional[TwinSteps] = None
    rows: Optional[torch.Tensor] = None
    m: Optional[torch.Tensor] = None


# ------------------------------------------------------------------------------------ helpers
def ulp_sq(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``ulp(x)^2`` elementwise: ulp = spacing of ``dtype``'s grid at each element of float64
    ``x`` (``2^(e - p)`` with ``x = m 2^e``, ``m`` in [0.5, 1), p mantissa bits), 0 where x is 0."""
    return ulp_sq_bits(x, store_dtype(dtype).mantissa_bits)


def ulp_sq_bits(x: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`ulp_sq` on the grid of ``bits`` mantissa bits (the implicit bit included; fp32's
    exponent range: no subnormal or overflow limit, which the bound leaves out, docs/bounds.md §9)."""
    _, e = torch.frexp(x)
    sq = torch.exp2((e - bits).to(x.dtype) * 2.0)
    return torch.where(x == 0, torch.zeros_like(x), sq)


def ulp2_sum(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``sum(ulp(x)^2)`` over the last two dims (float64, x's shape minus two dims)."""
    return ulp_sq(x, dtype).sum((-1, -2))


def key_columns(u2: torch.Tensor) -> torch.Tensor:
    """``[L, R, HV, K]``: each key column's share of a store rounding's error energy (ulp^2 summed
    over the state's V rows): how the committed error is spread over the key directions."""
    col = u2.sum(-2)
    return col / col.sum(-1, keepdim=True).clamp(min=1e-300)


def row_concentration(rows2: torch.Tensor, u2_sum: torch.Tensor) -> torch.Tensor:
    """``sum_v r_v^2`` ``[L, R, HV]`` (float64): the concentration of a store rounding's error energy
    over the state's V rows, ``r_v`` row v's share (``1/V`` for an even spread, 1 for one row), from
    ``rows2 = sum_v (sum_k ulp_vk^2)^2`` and ``u2_sum = sum ulp^2``: how much an output, which reads
    the error row by row, fluctuates around its expectation (docs/bounds.md §8)."""
    return rows2 / u2_sum.square().clamp(min=1e-300)


def state_rows2(u2: torch.Tensor) -> torch.Tensor:
    """``sum_v (sum_k ulp_vk^2)^2`` over a block's rows ``[..., V, K]`` -> ``[...]``."""
    return u2.sum(-1).square().sum(-1)


# ----------------------------------------------------------------------- committed state
STATE_SUMS = ("err2", "ref2", "run2", "ulp2_run", "ulp4_run", "ulp2_bf16")  # native column order


def state_sums_torch(run: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype):
    """The committed-state reductions, torch reducer: ``run`` the committed states ``[..., L, R, HV,
    V, K]`` (the state dtype; one step or a batch of them), ``truth`` the twin's (float64). Returns
    the float64 sums ``[..., L, R, HV]`` by name (:data:`STATE_SUMS`), ``finite`` ``[..., L, R, HV]``
    bool, the run's key-column shares of its rounding energy ``[..., L, R, HV, K]`` and its row
    concentration ``[..., L, R, HV]`` (:func:`row_concentration`)."""
    run = run.to(truth.device, F64)
    u2 = ulp_sq(run, dtype)
    sums = {"err2": (run - truth).square().sum((-1, -2)), "ref2": truth.square().sum((-1, -2)),
            "run2": run.square().sum((-1, -2)), "ulp2_run": u2.sum((-1, -2)),
            "ulp4_run": u2.square().sum((-1, -2)), "ulp2_bf16": ulp2_sum(truth, torch.bfloat16)}
    rows = row_concentration(state_rows2(u2), sums["ulp2_run"])
    return sums, torch.isfinite(run).all(-1).all(-1), key_columns(u2), rows


def state_sums_native(run: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype):
    """The same as :func:`state_sums_torch` in one pass of drift.sim.native's C kernel (CPU)."""
    m, col = native.state_metrics(run.contiguous(), truth, store_dtype(dtype).mantissa_bits)
    sums = {name: m[..., j] for j, name in enumerate(STATE_SUMS)}
    rows = row_concentration(m[..., 6], sums["ulp2_run"])
    return sums, m[..., 7] > 0, col / col.sum(-1, keepdim=True).clamp(min=1e-300), rows


def _state_start(comp) -> None:
    pool, dev = comp.sim.pool, comp.ref_device
    # One rounding of the prefill state on load: the bound model's starting point.
    u2 = ulp_sq(pool.states[:, pool.active_slots].to(dev, F64), pool.temporal.dtype)
    comp.ulp2_initial = u2.sum((-1, -2)).cpu().numpy()
    comp.ulp4_initial = u2.square().sum((-1, -2)).cpu().numpy()
    comp.col_frac = key_columns(u2)  # of the last committed state compared
    comp.row_conc = row_concentration(state_rows2(u2), u2.sum((-1, -2)))  # likewise
    comp.native_state_sums = (dev.type == "cpu" and native.available()
                              and store_dtype(pool.temporal.dtype).native)


def _state_batch(comp, batch: Batch) -> None:
    """Every step's committed state against the twin's, in one pass (each state block's sums are
    its own: the same numbers as step by step). Leaves ``scratch["col_before"]`` ``[n, L, R, HV,
    K]`` and ``scratch["rows_before"]`` ``[n, L, R, HV]``: the key-column shares and the row
    concentration of the state each step started from."""
    run, truth, dtype = batch.snap["run"], batch.twin.state, comp.sim.pool.temporal.dtype
    native_ok = comp.native_state_sums and type(run) is torch.Tensor and run.device.type == "cpu"
    sums, finite, col, rows = (state_sums_native if native_ok else state_sums_torch)(run, truth, dtype)
    for name, value in sums.items():
        comp.buf[name][batch.rows] = value
    comp.buf["finite"][batch.rows] = finite
    batch.scratch["col_before"] = torch.cat([comp.col_frac[None], col[:-1]])
    batch.scratch["rows_before"] = torch.cat([comp.row_conc[None], rows[:-1]])
    comp.col_frac, comp.row_conc = col[-1], rows[-1]


MEASURES.register("state", Measure(
    "state", "committed states of the active rows vs the twin (relative error, ULP units, finiteness)",
    head=("err2",        # ||run - twin||_F^2 of the committed state
          "ref2",        # ||twin||_F^2
          "run2",        # ||run||_F^2
          "ulp2_run",    # ||ulp(run)||_F^2 in the state dtype: the size of one store rounding
          "ulp4_run",    # sum ulp(run)^4: how much one rounding's energy fluctuates
          "ulp2_bf16"),  # ||ulp_bf16(twin)||_F^2: the unit of the bf16-ULP error metric
    flags=("finite",), states=True, start=_state_start, on_batch=_state_batch))


# ----------------------------------------------------------------------- bound model terms
def _bound_batch(comp, batch: Batch) -> None:
    """Contraction of the error energy over each step, and the weight of its roundings.

    Per token the error is multiplied by ``a (I - beta k k^T)``; for an error spread evenly
    over the ``r_eff``-dimensional key span, E||(I - beta k k^T) e||^2 = (1 - (2 beta -
    beta^2) / r_eff) ||e||^2 (docs/bounds.md). A rounding after token j is contracted by
    the tokens after it and scales with the state's size there, ||h_j||^2 / ||h_last||^2
    (the bound multiplies by the ulp^2 of the committed state). MTP stores once, after the
    last accepted token; sequential decode after every token; the fp32 compute rounds
    at every token in both.
    """
    buf, rows, m, tw = comp.buf, batch.rows, batch.m, batch.twin
    mm = m[:, None, :, :, None]  # [n, 1, R, D, 1]
    decay, beta, norm2 = tw.decay, tw.beta, tw.norm2
    # sum_k q_k^2 c_k with c the key-column shares of the state each step started from
    qc = (tw.q_sq * batch.scratch["col_before"][:, :, :, None]).sum(-1)
    r_eff = comp.sim.cfg.key_rank or comp.sim.cfg.head_k_dim
    c = decay.square() * (1.0 - (2.0 * beta - beta.square()) / r_eff)  # [n, L, R, D, HV]
    c = torch.where(mm, c, torch.ones_like(c))
    buf["rho2"][rows] = c.prod(3)
    buf["logdecay"][rows] = torch.where(mm, torch.log(decay), torch.zeros_like(decay)).sum(3)
    # The output of token t sees the step's starting error E contracted by tokens 1..t, read by
    # q_t: E||E q||^2 = sum_k q_k^2 E||E[:, k]||^2 = ||E||_F^2 sum_k q_k^2 c_k, c_k the share of
    # the error energy in key column k (that of the last store's rounding; 1/K when even).
    buf["out_w"][rows] = (qc * torch.cumprod(c, 3) * mm).sum(3)
    buf["out_rows"][rows] = batch.scratch["rows_before"]
    suffix = torch.flip(torch.cumprod(torch.flip(c, [3]), 3), [3])  # prod_{t >= j}
    after = torch.cat([suffix[..., 1:, :], torch.ones_like(suffix[..., :1, :])], 3)  # prod_{t > j}
    last = (m.sum(2) - 1).clamp(min=0)  # [n, R] index of the last accepted token
    n_last = norm2.gather(3, last[:, None, :, None, None].expand(-1, norm2.shape[1], -1, 1, norm2.shape[4]))
    size = norm2 / n_last.clamp(min=1e-300)
    tok_w = (after * size * mm).sum(3)
    buf["tok_w"][rows] = tok_w
    buf["round_w"][rows] = torch.ones_like(tok_w) if comp.sim.mode == "mtp" else tok_w


MEASURES.register("bound_terms", Measure(
    "bound_terms", "what the drift bound's envelope is built of: contraction, decay and rounding weights",
    head=("rho2",      # contraction of the error energy over this step's accepted tokens (bound model)
          "logdecay",  # sum of g over the accepted tokens: log of the pure decay of this step
          "round_w",   # store roundings this step, each weighted by the contraction that follows it
          "tok_w",     # the same for the fp32 compute of every accepted token
          "out_w",     # sum over accepted tokens of rho2(<= t) sum_k q_tk^2 c_k: how the committed error reaches them
          "out_rows"),  # sum_v r_v^2 of the state the step started from: how unevenly the outputs read that error
    needs=("state",), on_batch=_bound_batch))


# ----------------------------------------------------------------------- fold design terms
# One rounding to nearest of a record or a contraction operand: variance 1/12 ulp^2, variance of
# its square 1/180 ulp^4 (docs/bounds.md §2; drift.check.bounds.KAPPA / KAPPA4 of "rne").
FOLD_KAPPA, FOLD_KAPPA4 = 1.0 / 12.0, 1.0 / 180.0


def _fold_start(comp) -> None:
    """The run's fold design (``FlowKind.fold_rounding``), its schedule (which rows fold when, from
    the accept lengths alone) and, for a cadence that folds records of several steps with rounded
    operands, each row's pending records decayed to the current step, in float64 (``[L, R, RL, HV,
    V]`` / ``[L, R, RL, HV, K]``)."""
    cfg, dev = comp.sim.cfg, comp.ref_device
    fr = type(comp.sim.flow).fold_rounding(cfg) if comp.sim.mode == "mtp" else None
    comp.fold_rounding, comp.fold_pending = fr, None
    if fr is None or fr.trivial:  # nothing to count (read by a consumer that reads every measure):
        comp.keep_deltas = False  # the twin keeps its fast path, its truth as without this measure
        return
    comp.fold_schedule = FoldSchedule(fr, cfg.num_requests)
    if fr.operand_bits is not None and not fr.folds_every_commit:
        L, R, HV = cfg.num_layers, cfg.num_requests, cfg.num_v_heads
        comp.fold_pending = {
            "u": torch.zeros(L, R, fr.ring_len, HV, cfg.head_v_dim, dtype=F64, device=dev),
            "k": torch.zeros(L, R, fr.ring_len, HV, cfg.head_k_dim, dtype=F64, device=dev),
            "n": np.zeros(R, np.int64)}


def _operand_terms(u: torch.Tensor, k: torch.Tensor, bits: int, key_exact: bool, dims) -> tuple:
    """Energy and variance of rounding the contraction operands ``u`` (``[..., V]``, decayed deltas) and
    ``k`` (``[..., K]``, unit keys) to ``bits``: ``||du||^2 ||k||^2 + ||u||^2 ||dk||^2`` per product,
    summed over ``dims`` (the records); the key's term left out where it is already on the grid."""
    uu2 = ulp_sq_bits(u, bits)
    e2, e4 = uu2.sum(-1), uu2.square().sum(-1)
    if not key_exact:
        un2, uk2 = u.square().sum(-1), ulp_sq_bits(k, bits)
        e2, e4 = e2 + un2 * uk2.sum(-1), e4 + un2.square() * uk2.square().sum(-1)
    return FOLD_KAPPA * e2.sum(dims), FOLD_KAPPA4 * e4.sum(dims)


def _fold_snapshot(comp, view) -> np.ndarray:
    """The lanes where a request starts at this step (host int64, sorted; empty under a fixed batch)."""
    return np.array(sorted(view.starts) if view.starts else (), np.int64)


def _fold_batch(comp, batch: Batch) -> None:
    """Per step and (layer, row, head) the rounding the fold design injects (docs/bounds.md §9),
    from the twin's per-token deltas and keys, and per row whether it folds:

    * ``rec2`` / ``rec4``: each accepted token's record rounded to the record precision, weighted by
      its decay to the step's end ``w_t = prod_{s > t} a_s`` (it enters the state the next verify
      starts from there): ``sum_t w_t^2 (ulp(d_t)^2 + ||d_t||^2 ulp(k_t)^2) / 12``, and its variance;
    * ``op2`` / ``op4``: at a row's fold, each folded record's contraction operands -- the delta
      decayed to the fold ``u = w d`` and the key -- rounded to the operand precision;
    * ``fold`` (per row): 1 where the row folds (its checkpoint is stored), from the schedule."""
    fr, buf, rows, tw = comp.fold_rounding, comp.buf, batch.rows, batch.twin
    if fr is None or fr.trivial:
        buf["fold"][rows] = 1.0  # every row stores every step, as in docs/bounds.md §4
        return
    dev = comp.ref_device
    begun = batch.extra["fold_terms"]  # per step, the lanes where a request starts (before its verify)
    fold = np.zeros(batch.accept.shape, bool)  # [n, R], in step order
    for j, a in enumerate(batch.accept):
        if len(begun[j]):
            comp.fold_schedule.restart(begun[j])
        fold[j] = comp.fold_schedule.step(a)
    buf["fold"][rows] = torch.from_numpy(fold.astype(np.float64)).to(dev)
    mm = batch.m[:, None, :, :, None]  # [n, 1, R, D, 1]
    logd = torch.where(mm, torch.log(tw.decay), torch.zeros_like(tw.decay))  # [n, L, R, D, HV]
    after = torch.flip(torch.cumsum(torch.flip(logd, [3]), 3), [3]) - logd  # sum over later accepted tokens
    w = torch.exp(after) * mm  # [n, L, R, D, HV], 0 past the accepted tokens
    d, k = tw.delta, tw.key  # [n, L, R, D, HV, V], [n, L, R, D, HV, K]
    if fr.record_bits is not None:
        ud2, uk2 = ulp_sq_bits(d, fr.record_bits), ulp_sq_bits(k, fr.record_bits)
        dn2 = d.square().sum(-1)
        buf["rec2"][rows] = FOLD_KAPPA * (w.square() * (ud2.sum(-1) + dn2 * uk2.sum(-1))).sum(3)
        buf["rec4"][rows] = FOLD_KAPPA4 * (w.square().square() * (ud2.square().sum(-1)
                                                                   + dn2.square() * uk2.square().sum(-1))).sum(3)
    if fr.operand_bits is None:
        return
    if comp.fold_pending is None:  # every commit folds this step's records, decayed to its end
        e2, e4 = _operand_terms(d * w[..., None], k, fr.operand_bits, fr.key_operand_exact, 3)
        f = torch.from_numpy(fold).to(dev)[:, None, :, None]
        buf["op2"][rows], buf["op4"][rows] = e2 * f, e4 * f
        return
    P, total = comp.fold_pending, logd.sum(3)  # [n, L, R, HV]
    e2 = torch.zeros_like(total)
    e4 = torch.zeros_like(total)
    for j in range(batch.n):  # records of several steps: carried, decayed, folded when the row folds
        if len(begun[j]):  # a starting request's ring holds none of its row's previous records
            bi = torch.from_numpy(begun[j]).to(dev)
            P["u"][:, bi] = 0.0
            P["k"][:, bi] = 0.0
            P["n"][begun[j]] = 0
        P["u"].mul_(torch.exp(total[j])[:, :, None, :, None])
        r_idx, t_idx = np.nonzero(batch.accept[j][:, None] > np.arange(d.shape[3])[None, :])
        pos = P["n"][r_idx] + t_idx
        ri, ti, pi = (torch.from_numpy(x).to(dev) for x in (r_idx, t_idx, pos))
        P["u"][:, ri, pi] = d[j][:, ri, ti] * w[j][:, ri, ti][..., None]
        P["k"][:, ri, pi] = k[j][:, ri, ti]
        P["n"] += batch.accept[j]
        f = np.nonzero(fold[j])[0]
        if len(f):
            fi = torch.from_numpy(f).to(dev)
            a2, a4 = _operand_terms(P["u"][:, fi], P["k"][:, fi], fr.operand_bits, fr.key_operand_exact, 2)
            e2[j][:, fi], e4[j][:, fi] = a2, a4
            P["u"][:, fi] = 0.0
            P["k"][:, fi] = 0.0
            P["n"][f] = 0
    buf["op2"][rows], buf["op4"][rows] = e2, e4


def _fold_save(comp) -> dict:
    if comp.fold_rounding is None or comp.fold_rounding.trivial:
        return {}
    return saveable({"schedule": comp.fold_schedule.state_dict(),
                     "pending": None if comp.fold_pending is None else dict(comp.fold_pending)})


def _fold_load(comp, state: dict) -> None:
    state = restore(state)
    if not state:
        return
    comp.fold_schedule.load_state_dict(state["schedule"])
    if state.get("pending") is not None:
        P = state["pending"]
        comp.fold_pending = {"u": torch.as_tensor(P["u"]).to(comp.ref_device, F64),
                             "k": torch.as_tensor(P["k"]).to(comp.ref_device, F64), "n": np.asarray(P["n"], np.int64)}


MEASURES.register("fold_terms", Measure(
    "fold_terms", "the rounding a commit's fold design injects (records, contraction operands) and when it folds",
    head=("rec2", "rec4",  # record rounding energy entering the state this step, and its variance
          "op2", "op4"),   # contraction-operand rounding energy of the folds this step, and its variance
    row=("fold",),         # 1 where the row folds (its checkpoint is stored) this step
    deltas=True, start=_fold_start, snapshot=_fold_snapshot, on_batch=_fold_batch, save=_fold_save,
    load=_fold_load))


# ----------------------------------------------------------------------- outputs, conv windows
def _outputs_batch(comp, batch: Batch) -> None:
    buf, rows = comp.buf, batch.rows
    o_run = batch.snap["out"].to(F64)
    m6 = batch.m[:, None, :, :, None, None]
    # In place where the operand is a temporary of its own: fewer batch-sized buffers, the same values.
    buf["out_err2"][rows] = (o_run - batch.twin.out).mul_(m6).square_().sum((3, 5))
    buf["out_ref2"][rows] = (batch.twin.out * m6).square_().sum((3, 5))
    # Round to nearest moves a value by at most half an ulp of the result (an ulp of a bf16
    # output bounds the ulp of the fp32 value it was rounded from).
    buf["out_round2"][rows] = (ulp_sq(o_run, torch.bfloat16) * m6).sum((3, 5)) / 4.0


MEASURES.register("outputs", Measure(
    "outputs", "outputs of the accepted tokens vs the twin's (summed over them)",
    head=("out_err2", "out_ref2",
          "out_round2"),  # sum over accepted tokens of ||ulp_bf16(o_run)/2||^2: the most the op's bf16 output rounding moves them
    on_batch=_outputs_batch))


def _conv_batch(comp, batch: Batch) -> None:
    comp.buf["conv_bad"][batch.rows] = (batch.snap["win"].to(F64) != batch.twin.window).sum((1, 3, 4)).to(F64)


MEASURES.register("conv", Measure("conv", "bits of each row's committed conv window that differ from the "
                                  "true inputs", row=("conv_bad",), on_batch=_conv_batch))


# ----------------------------------------------------------------------- tracked snapshots
def _tracked_snapshot(comp, view):
    """What the tracking rows hold now (the flow's :meth:`tracked_snapshot`): rows, tracked states,
    their windows, bit mismatches of each against what the run held [n], and what the flow's reference
    mismatches are counted from in the comparison's process; None when none tracks."""
    sim = comp.sim
    if sim.mode != "mtp" or not sim.flow.tracks or not (view.track >= 0).any():
        return None
    return sim.flow.tracked_snapshot(view.track)


def _tracked_batch(comp, batch: Batch) -> None:
    """The batch's tracked snapshots (taken when their steps ran) against the twin's track states
    and windows at those steps, all at once: one entry per tracked (step, row)."""
    steps = [j for j, t in enumerate(batch.extra["tracked"]) if t is not None]
    if not steps:
        return
    buf, dev, tw = comp.buf, comp.ref_device, batch.twin
    snaps = [batch.extra["tracked"][j] for j in steps]  # (rows, got, win, bits_bad[, reference]) each
    i = torch.tensor([batch.idx[j] for j, s in zip(steps, snaps) for _ in s[0]], device=dev)
    local = torch.tensor([j for j, s in zip(steps, snaps) for _ in s[0]], device=dev)
    r = torch.from_numpy(np.concatenate([s[0] for s in snaps])).to(dev)
    got = torch.cat([s[1] for s in snaps], 1).to(dev)  # [L, m, HV, V, K] in the state dtype
    ref = torch.cat([tw.tracked[j][1] for j in steps], 1)  # the twin's, same rows in the same order
    flow = comp.sim.flow  # a snapshot's reference (its fifth part, optional): counted here, in the comparison
    bits_bad = [s[3] if len(s) < 5 or s[4] is None else s[3] + flow.reference_mismatches(s[1], s[4]) for s in snaps]
    buf["trk_bits_bad"][i, r] = torch.cat(bits_bad).to(dev, F64)
    # got - ref computes in float64 (exact upcast); squared in place: fewer batch-sized buffers
    buf["trk_err2"][i, :, r] = (got - ref).square_().sum((-1, -2)).transpose(0, 1)
    buf["trk_ref2"][i, :, r] = ref.square_().sum((-1, -2)).transpose(0, 1)
    win = torch.cat([s[2] for s in snaps], 1).to(dev, F64)  # [L, m, Kc-1, C]
    buf["trk_conv_bad"][i, r] = (win != tw.track_window[local, :, r].transpose(0, 1)).sum((0, 2, 3)).to(F64)


MEASURES.register("tracked", Measure(
    "tracked", "prefix-cache snapshots vs the twin's boundary state, and bit for bit vs what the run held",
    head=("trk_err2", "trk_ref2"), row=("trk_bits_bad", "trk_conv_bad"),
    snapshot=_tracked_snapshot, on_batch=_tracked_batch))


# ----------------------------------------------------------------------- golden validation
def _checkpoint(comp, i: int, pre: np.ndarray, mark: np.ndarray, state: torch.Tensor, window: torch.Tensor,
                request: Optional[np.ndarray] = None) -> None:
    """Full state and conv window of the twin (its mark_state, mark_window) against golden
    checkpoints passed at step i. Under a churning lifecycle (``request [R]``, each lane's request) only
    a lane's first request has them: it is the fixed entry's row."""
    ga, buf, dev = comp.golden.arrays, comp.buf, comp.ref_device
    for r in np.nonzero(mark >= 0)[0]:
        if request is not None and request[r] != r:
            continue
        c = comp.golden_ckpt[int(pre[r] + mark[r] + 1)]
        ref = torch.from_numpy(ga["ckpt_state"][c][:, r]).to(dev, F64)
        d = torch.linalg.vector_norm(state[:, r] - ref) / torch.linalg.vector_norm(ref)
        wref = torch.from_numpy(ga["ckpt_window"][c][:, r]).to(dev, F64)
        buf["gold_ckpt_dev"][i, r] = d
        buf["gold_ckpt_bad"][i, r] = (window[:, r] != wref).sum().to(F64)
        comp.golden_checkpoints += 1


def _golden_start(comp) -> None:
    """A serving golden (drift/check/golden.py): its per-request rows on the reference device, the key
    lookup, the schedule it was made for and its start checkpoints (``comp.gold_serving``; None
    otherwise)."""
    g = comp.golden
    comp.gold_serving = None
    if g is None or not g.serving:
        return
    ga, dev = g.arrays, comp.ref_device
    sched = {f: ga[f"sched_{f}"] for f in SCHED_FIELDS}
    ck = ga["start_ckpt"]
    comp.gold_serving = {
        "keys": ga["key_request"].astype(np.int64) << 32 | ga["key_position"].astype(np.int64),
        **{k: torch.from_numpy(ga[f"key_{k}"]).to(dev, F64) for k in ("proj_state", "state_norm", "proj_out")},
        "steps": g.steps,
        "sched": {(int(s), int(r)): i for i, (s, r) in enumerate(zip(sched["step"], sched["lane"]))},
        "sched_rows": np.stack([sched[f] for f in ("request", "code", "source", "p0", "p1")], 1),
        "ckpt": {(int(sched["request"][i]), int(sched["p1"][i])): c for c, i in enumerate(ck)},
    }


def _key_rows(gs: dict, request: np.ndarray, position: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The serving golden's rows of (request, position) pairs (any shape): (row index, found)."""
    keys = gs["keys"]
    if not len(keys):
        return np.zeros(request.shape, np.int64), np.zeros(request.shape, bool)
    want = request.astype(np.int64) << 32 | np.maximum(position, 0).astype(np.int64)
    idx = np.minimum(np.searchsorted(keys, want), len(keys) - 1)
    return idx, (keys[idx] == want) & (request >= 0)


def _golden_starts(comp, view):
    """At a step where requests start (a churning lifecycle), the twin's fresh lanes -- it has just
    reset them: a prefill's truth, a prefix hit's restored and extended snapshot, a resume's own state
    -- against the golden: the state projection at the start position (the fixed entry's for a lane's
    first request), the full checkpoint where the data has one (state; window bit for bit), and the
    run's start against the schedule the data was made for (within its horizon). Returns, per starting
    lane, (lane, projection deviation ``[L, HV]`` or None, checkpoint deviation or None, window bits
    that differ, schedule mismatch 0/1); None when there is nothing to compare."""
    gs = getattr(comp, "gold_serving", None)
    if gs is None or not view.starts:
        return None
    cfg, g, twin = comp.sim.cfg, comp.gold, comp.twin
    scale_kv = math.sqrt(cfg.head_k_dim * cfg.head_v_dim)
    found = []
    for lane, (start, _, _) in sorted(view.starts.items()):
        q, p = int(start.request), int(start.p1)
        i = gs["sched"].get((view.step, lane))
        ran = (q, int(start.code), int(start.source), int(start.p0), p)
        mismatch = view.step < gs["steps"] and (i is None or tuple(gs["sched_rows"][i].tolist()) != ran)
        state = twin.state[:, lane]  # [L, HV, V, K] float64: the lane's start, as the twin holds it
        if q == lane and p <= comp.golden_limit:
            p_gold, n_gold = g["proj_state"][p, :, lane], g["state_norm"][p, :, lane]
        else:
            k, ok = _key_rows(gs, np.array([q]), np.array([p]))
            p_gold, n_gold = (gs["proj_state"][int(k[0])], gs["state_norm"][int(k[0])]) if ok[0] else (None, None)
        dev_p = None
        if p_gold is not None:
            proj = torch.einsum("lhv,lhvk,lhk->lh", g["proj_w"], state, g["proj_u"])
            dev_p = (proj - p_gold).abs() / (p_gold.abs() + n_gold / scale_kv + 1e-300)
            comp.golden_positions += 1
        ck_dev, ck_bad = None, 0.0
        c = gs["ckpt"].get((q, p))
        if c is not None:
            ga = comp.golden.arrays
            ref = torch.from_numpy(ga["start_state"][c]).to(state.device, F64)
            ck_dev = torch.linalg.vector_norm(state - ref) / torch.linalg.vector_norm(ref)
            wref = torch.from_numpy(ga["start_window"][c]).to(state.device, F64)
            ck_bad = (twin.window[:, lane] != wref).sum().to(F64)
            comp.golden_checkpoints += 1
        found.append((lane, dev_p, ck_dev, ck_bad, float(mismatch)))
    return found


def _golden_snapshot(comp, taken) -> tuple:
    """What the golden measure takes at a step: (the step, :func:`_golden_starts`' findings)."""
    return taken.step, _golden_starts(comp, taken)


def _golden_batch(comp, batch: Batch) -> None:
    """Twin vs golden for a batch of steps ``[n]``: projections at every committed position and
    accepted output. Positions past the golden horizon are NaN. Under a churning lifecycle each lane is
    compared with its request's golden rows (a lane's first request: the fixed entry's, at every
    accepted output; a later one: the serving entry's key at the committed position, the output of the
    last accepted token), and the starts of the batch are added (:func:`_golden_starts`)."""
    if comp.golden is None:
        return
    cfg, buf, dev, g = comp.sim.cfg, comp.buf, comp.ref_device, comp.gold
    gs = getattr(comp, "gold_serving", None)
    request = getattr(batch, "request", None) if gs is not None else None
    for j, (mark_state, mark_window) in batch.twin.marks.items():
        _checkpoint(comp, batch.idx[j], batch.pre[j], batch.marks[j], mark_state, mark_window,
                    None if request is None else request[j])
    # The projection of each step's state, one einsum per step (one over the batch copies all its
    # states into einsum's layout first, and is slower)
    p_twin = torch.stack([torch.einsum("lhv,lrhvk,lhk->lrh", g["proj_w"], state, g["proj_u"])
                          for state in batch.twin.state])
    pre, rows, m, tw_out = batch.pre, batch.rows, batch.m, batch.twin.out
    post = pre + batch.accept
    if request is None:
        inside = post <= comp.golden_limit  # [n, R]
        comp.beyond_golden_steps += int((~inside.all(1)).sum())
    else:
        live = request >= 0
        first = live & (request == np.arange(cfg.num_requests)[None, :])  # the fixed entry's rows
        key, found = _key_rows(gs, request, post)
        keyed = live & ~first & found
        inside = (first & (post <= comp.golden_limit)) | keyed
        comp.beyond_golden_steps += int((live & ~inside).any(1).sum())
    comp.golden_positions += int(inside.sum())
    R = cfg.num_requests
    r_idx = torch.arange(R, device=dev)
    pos = torch.from_numpy(np.minimum(post, comp.golden_limit)).to(dev)  # [n, R]
    scale_kv = math.sqrt(cfg.head_k_dim * cfg.head_v_dim)
    p_gold = g["proj_state"][pos, :, r_idx[None, :]].permute(0, 2, 1, 3)  # [n, L, R, HV]
    n_gold = g["state_norm"][pos, :, r_idx[None, :]].permute(0, 2, 1, 3)
    keyed_any = request is not None and bool(keyed.any())
    if keyed_any:
        k = torch.from_numpy(key).to(dev)
        use = torch.from_numpy(keyed).to(dev)[:, None, :, None]
        p_gold = torch.where(use, gs["proj_state"][k].permute(0, 2, 1, 3), p_gold)
        n_gold = torch.where(use, gs["state_norm"][k].permute(0, 2, 1, 3), n_gold)
    dev_s = (p_twin - p_gold).abs() / (p_gold.abs() + n_gold / scale_kv + 1e-300)
    inside_t = torch.from_numpy(inside).to(dev)[:, None, :, None]
    buf["gold_dev"][rows] = torch.where(inside_t, dev_s, torch.full_like(dev_s, math.nan))
    # Outputs of accepted tokens j sit at positions pre + j.
    opos = torch.from_numpy(pre).to(dev)[:, :, None] + torch.arange(cfg.num_draft_tokens, device=dev)  # [n, R, D]
    ok = m & (opos < g["proj_out"].shape[0])
    o_gold = g["proj_out"][opos.clamp(max=g["proj_out"].shape[0] - 1), :, r_idx[None, :, None]]  # [n, R, D, L, HV]
    if request is not None:  # a lane's first request at every accepted output (the fixed entry's rows) ...
        ok = ok & torch.from_numpy(first).to(dev)[:, :, None]
    if keyed_any:  # ... a later request at its last accepted token's (its key)
        last = torch.arange(cfg.num_draft_tokens, device=dev) == torch.from_numpy(batch.accept - 1).to(dev)[:, :, None]
        sel = last & torch.from_numpy(keyed).to(dev)[:, :, None]  # [n, R, D]
        o_gold = torch.where(sel[..., None, None], gs["proj_out"][k][:, :, None], o_gold)
        ok = ok | sel
    o_twin = torch.einsum("nlrdhv,lhv->nrdlh", tw_out, g["proj_wo"])
    o_norm = torch.linalg.vector_norm(tw_out, dim=-1).permute(0, 2, 3, 1, 4) / math.sqrt(cfg.head_v_dim)
    o_dev = (o_twin - o_gold).abs() / (o_gold.abs() + o_norm + 1e-300)
    o_dev = torch.where(ok[..., None, None], o_dev, torch.zeros_like(o_dev)).amax(2)  # [n, R, L, HV]
    buf["gold_out_dev"][rows] = torch.where(inside_t, o_dev.permute(0, 2, 1, 3), torch.full_like(dev_s, math.nan))
    if request is not None:
        _golden_serving_extras(comp, batch, live & ~first & ~found)


def _golden_serving_extras(comp, batch: Batch, missing: np.ndarray) -> None:
    """The starts of the batch (:func:`_golden_starts`' findings, folded into the step's rows) and the
    schedule flag: a start that differs from the golden's schedule, or a later request's committed
    position within the golden's horizon that has no key (``missing [n, R]``), counts in
    ``gold_sched_bad``."""
    buf, gs = comp.buf, comp.gold_serving
    within = np.array([step < gs["steps"] for step, _ in batch.extra["golden"]])
    sched_bad = torch.from_numpy((missing & within[:, None]).astype(np.float64)).to(comp.ref_device)
    buf["gold_sched_bad"][batch.rows] = sched_bad
    for j, (_, found) in enumerate(batch.extra["golden"]):
        if not found:
            continue
        i = batch.idx[j]
        for lane, dev_p, ck_dev, ck_bad, mismatch in found:
            if dev_p is not None:  # a NaN (no committed row) gives way to the start's deviation
                buf["gold_dev"][i, :, lane] = torch.fmax(buf["gold_dev"][i, :, lane], dev_p)
            if ck_dev is not None:
                buf["gold_ckpt_dev"][i, lane] = torch.fmax(buf["gold_ckpt_dev"][i, lane], ck_dev)
                buf["gold_ckpt_bad"][i, lane] += ck_bad
            buf["gold_sched_bad"][i, lane] += mismatch


MEASURES.register("golden", Measure(
    "golden", "the float64 twin vs the golden trajectory (NaN past the golden horizon: not covered)",
    head=("gold_dev",       # |proj(twin) - golden proj| / (|golden proj| + ||h|| / sqrt(K V))
          "gold_out_dev"),  # the same for the outputs of the accepted tokens (max over them)
    row=("gold_ckpt_bad", "gold_ckpt_dev",
         "gold_sched_bad"),  # churn: a start, or a request's step, that is not in the schedule golden was made for
    states=True, start=_golden_start, twin_snapshot=_golden_snapshot, on_batch=_golden_batch))
