"""The drift bound model (derivation and calibration: docs/bounds.md).

The error of the committed state obeys an exact linear recurrence, because the gated
delta rule is linear in the state for fixed inputs::

    e_n = J_n e_{n-1} + delta_n,   J_n = prod over the step's tokens of a_t (I - beta_t k_t k_t^T)

with ``delta_n`` the store rounding(s) of step n. Modelling each rounding as unbiased and
independent (exact in expectation for stochastic rounding; the standard probabilistic
model for round-to-nearest, Connolly-Higham-Mary 2021) and the error as spread evenly
over the r-dimensional key span gives an *envelope* of the expected error energy::

    env2_n = rho2_n * env2_{n-1} + kappa * w_n * ||ulp(x_n)||_F^2
    rho2_n = prod_t a_t^2 (1 - (2 beta_t - beta_t^2) / r)

with ``kappa`` the variance of one rounding in ulp^2 (1/12 round-to-nearest, 1/6
stochastic) and ``w_n`` the contraction-weighted number of roundings (1 for MTP).
For ``rho2 < 1`` this is the bounded regime ``~ u |x| / sqrt(1 - rho2)``; for
``rho2 -> 1`` it grows like sqrt(n) (random walk). Biased rounding (truncation,
stagnation of round-to-nearest) grows faster and leaves the envelope.

The bound is ``BOUND_CONSTANT * sqrt(env2_n)``, one constant calibrated on 20 seeds of
a correct implementation with a stated margin.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..checkpoint import restore, saveable
from ..dtypes import STORE_DTYPES
from ..flows.fold_model import FoldRounding
from .checks import Check
from .registry import CHECKS, CheckSpec
from .result import CheckResult
from .compare import MetricsChunk
from .metrics import DriftCurves, growth_exponents, rel_err, ulp_err

# Variance of one store rounding in units of ulp^2: uniform error on [-ulp/2, ulp/2] for
# round-to-nearest (1/12); p(1-p) ulp^2 with p uniform for stochastic rounding (1/6).
# Truncation is a known-bad store: it is held to the round-to-nearest model so it fails.
KAPPA = {"rne": 1.0 / 12.0, "stochastic": 1.0 / 6.0, "truncate": 1.0 / 12.0}
# Variance of one rounding's squared error in ulp^4: Var(d^2) = E d^4 - (E d^2)^2 with
# E d^4 = 1/80 for uniform round-to-nearest (1/80 - 1/144 = 1/180) and
# E d^4 = int p(1-p)((1-p)^3 + p^3) dp = 1/15 for stochastic rounding (1/15 - 1/36 = 7/180).
KAPPA4 = {"rne": 1.0 / 180.0, "stochastic": 7.0 / 180.0, "truncate": 1.0 / 180.0}
# The bound allows the error energy Z standard deviations above its expectation: the energy
# of one rounding is a weighted sum of the elements' squared errors, dominated by the largest
# elements, so a head whose state is nearly rank one (fast decay) has few effective terms.
FLUCTUATION_Z = 6.0
# fp32 compute of one token rounds ~3 times at the state's scale (h * a, the k v'^T product,
# the sum; the k^T h dot product adds a beta^2-weighted share): 3/12 ulp_fp32^2. Measured in
# isolation on random ci-small-shaped states: 3.06 to 3.24 ulp^2/12 per token.
KAPPA_COMPUTE = 3.0 / 12.0
COMPUTE_MANTISSA = 24  # fp32 compute
# Floor of the bound, relative to the true state: inputs, gates and norms are computed in
# fp32 too, which the rounding envelope leaves out; it matters only for fp32 states, whose
# store is exact. 1e-5 is the fp32 sanity tolerance (the fp32-state sanity test, tests/check/test_precision.py); measured fp32-state
# errors stay below ~1e-6 (docs/bounds.md).
COMPUTE_FLOOR = 1e-5

# max over 20 seeds x 3 cases (MTP round-to-nearest, MTP stochastic, sequential) x (layers,
# rows, heads) x 4,096 steps of error / sqrt(env2 + Z sqrt(var2)) for a correct implementation
# on ci-small: docs/bounds.md, docs/calibration.json (scripts/calibrate_bounds.py). The median
# seed's worst is 1.07-1.09; the margin covers longer horizons and unseen seeds.
CALIBRATED_RATIO = 1.1589
BOUND_MARGIN = 1.25
BOUND_CONSTANT = CALIBRATED_RATIO * BOUND_MARGIN

GROWTH_LIMIT = 0.6  # growth exponent allowed for non-stagnating heads (random walk is 0.5)

# A head is stagnation-prone when its per-step decay a satisfies 1 - a < 2^-p (2^-8 for bf16): then
# fl(a x) == x for elements whose mantissa is near 1 (relative half-ulp up to 2^-p);
# drift.dtypes.StoreDtype.stagnation_margin.


class BoundCheck(Check):
    """Every (layer, row, head) error within ``BOUND_CONSTANT * sqrt(env2)`` at every step.

    Also records, per (layer, head), downsampled curves of the relative error, the bf16-ULP
    error, the bound (as a relative error) and the bound ratio, and the growth exponent.
    """

    key = "drift_bound"
    # the envelope's terms and the state error it bounds, plus what its OutputBound reads
    measures = ("state", "bound_terms", "outputs")
    _state = Check._state + ("env2", "var2", "worst_head", "logdecay_sum", "logdecay_n")

    def __init__(self, constant: float = BOUND_CONSTANT, growth_limit: float = GROWTH_LIMIT,
                 initial_env2: Optional[np.ndarray] = None, fold: Optional[FoldRounding] = None):
        super().__init__(1.0)
        self.constant = constant
        self.growth_limit = growth_limit
        self.initial_env2 = initial_env2  # [L, R, HV]; default: one rounding of the start state
        self.last_env2: Optional[np.ndarray] = None  # [S, L, R, HV] of the last chunk
        # A commit that folds records (drift/flows/fold_model.py): its design's terms (docs/bounds.md §9),
        # read from the fold_terms measure; none where the design adds nothing to §1-§4's model.
        self.fold = None if fold is None or fold.trivial else fold
        if self.fold is not None:
            self.measures = type(self).measures + ("fold_terms",)

    def start(self, comparison) -> None:
        super().start(comparison)
        sim = comparison.sim
        cfg = sim.cfg
        self.cfg = cfg
        self.kappa = KAPPA[cfg.store_rounding]
        self.kappa4 = KAPPA4[cfg.store_rounding]
        if self.initial_env2 is None:
            self.env2 = self.kappa * comparison.ulp2_initial  # [L, R, HV]: the prefill store
            self.var2 = self.kappa4 * comparison.ulp4_initial
        else:
            self.env2 = np.asarray(self.initial_env2, np.float64).copy()
            self.var2 = np.zeros_like(self.env2)
        # ulp^2 on the fp32 grid = ulp^2 on the state's grid * 4^-(24 - p) (same exponents).
        self.compute_scale = KAPPA_COMPUTE * 4.0 ** -(COMPUTE_MANTISSA - STORE_DTYPES[cfg.ssm_dtype].mantissa_bits)
        self.curves = DriftCurves((cfg.num_layers, cfg.num_v_heads))
        self.logdecay_sum = np.zeros((cfg.num_layers, cfg.num_v_heads))  # sum over steps and rows
        self.logdecay_n = 0
        self.worst_head = np.zeros((cfg.num_layers, cfg.num_v_heads))
        self.outputs = OutputBound()
        self.outputs.start(comparison)
        self.snapshots: dict = {}  # request -> envelope (env2, var2) of its last tracked snapshot (churn)

    def _start_envelope(self, chunk: MetricsChunk, s: int, e2: np.ndarray, v2: np.ndarray) -> None:
        """Under a churning lifecycle, the envelope of a lane whose request starts at step ``s`` (in place,
        ``[L, R, HV]``): a prefill or a resume stores its exact state once (one rounding of the start, as a
        fixed run's prefill store); a prefix hit restores its source's snapshot, whose envelope is the
        source's before the step it was tracked plus that snapshot's own rounding (kept when the source was
        tracked, by request id; its contraction through the extend is left out: an upper bound), and its
        extend stores once more."""
        from ..sim.serving import START_PREFIX

        one, one4 = self.kappa * chunk.start_ulp2[s], self.kappa4 * chunk.start_ulp4[s]
        for lane in np.nonzero(chunk.start[s])[0]:
            carried = (0.0, 0.0)
            if chunk.start[s, lane] == START_PREFIX:
                carried = self.snapshots.get(int(chunk.source[s, lane]), (0.0, 0.0))
            e2[:, lane] = carried[0] + one[:, lane]
            v2[:, lane] = carried[1] + one4[:, lane]

    def _keep_snapshot_envelope(self, chunk: MetricsChunk, s: int, e2: np.ndarray, v2: np.ndarray) -> None:
        """The envelope of the snapshots tracked at step ``s`` (before the step, plus one rounding), by request."""
        for lane in np.nonzero((chunk.track[s] >= 0) & chunk.live[s])[0]:
            q = int(chunk.request[s, lane])
            self.snapshots[q] = (e2[:, lane] + self.kappa * chunk.ulp2_run[s][:, lane],
                                 v2[:, lane] + self.kappa4 * chunk.ulp4_run[s][:, lane])
        while len(self.snapshots) > 64 * self.cfg.num_requests:
            self.snapshots.pop(next(iter(self.snapshots)))

    def consume(self, chunk: MetricsChunk) -> None:
        env = np.empty_like(chunk.err2)
        var = np.empty_like(chunk.err2)
        prev_env, prev_var = np.empty_like(chunk.err2), np.empty_like(chunk.err2)  # before each step
        e2, v2 = self.env2, self.var2
        exact = self.cfg.ssm_dtype == "float32"  # fp32 -> fp32 store is exact
        store = 0.0 if exact else self.kappa * chunk.round_w * chunk.ulp2_run
        store_var = 0.0 if exact else self.kappa4 * chunk.round_w ** 2 * chunk.ulp4_run
        seen_extra = seen_extra_var = 0.0  # roundings in what is compared that the next step never reads
        if self.fold is not None:  # docs/bounds.md §9: the store only where the row folds, and the design's terms
            folds = chunk.fold[:, None, :, None]  # [S, 1, R, 1]
            store, store_var = store * folds, store_var * folds
            if not exact:  # a row with records pending is compared as its fp32 state rounded to the checkpoint
                seen_extra = KAPPA["rne"] * chunk.ulp2_run * (1.0 - folds)
                seen_extra_var = KAPPA4["rne"] * chunk.ulp4_run * (1.0 - folds)
            store = store + chunk.rec2 + chunk.op2
            store_var = store_var + chunk.rec4 + chunk.op4
        inject = store + self.compute_scale * chunk.tok_w * chunk.ulp2_run
        serving = "start" in chunk.arrays
        for s in range(chunk.count):
            if serving:
                e2, v2 = e2.copy(), v2.copy()
                self._start_envelope(chunk, s, e2, v2)
                self._keep_snapshot_envelope(chunk, s, e2, v2)
            prev_env[s], prev_var[s] = e2, v2
            e2 = chunk.rho2[s] * e2 + inject[s]
            v2 = chunk.rho2[s] ** 2 * v2 + (store_var[s] if not (exact and self.fold is None) else 0.0)
            env[s], var[s] = e2, v2
        self.env2, self.var2 = e2, v2
        self.last_env2 = env
        expected = env + seen_extra + FLUCTUATION_Z * np.sqrt(var + seen_extra_var)
        bound = np.sqrt(self.constant ** 2 * expected + COMPUTE_FLOOR ** 2 * chunk.ref2)
        ratio = np.sqrt(chunk.err2) / np.maximum(bound, 1e-300)
        self._update(ratio, chunk.step0)
        self.worst_head = np.maximum(self.worst_head, np.nan_to_num(ratio, nan=np.inf).max((0, 2)))
        rel = rel_err(chunk.err2, chunk.ref2, self.floor)
        series = {"rel_err": rel, "ulp_err": ulp_err(chunk.err2, chunk.ulp2_bf16),
                  "bound_rel": bound / np.maximum(np.sqrt(chunk.ref2), self.floor), "bound_ratio": ratio}
        if serving:  # each request's curve by its own steps (age); an idle lane adds nothing
            for lane in range(chunk.err2.shape[2]):
                live = chunk.live[:, lane]
                if live.any():
                    for name, values in series.items():
                        self.curves.add(name, chunk.age[live, lane] + 1, values[live][:, :, lane:lane + 1])
        else:
            steps = chunk.steps + 1  # steps completed
            for name, values in series.items():
                self.curves.add(name, steps, values)
        self.logdecay_sum = self.logdecay_sum + chunk.logdecay.sum((0, 2))
        self.logdecay_n += chunk.count * chunk.logdecay.shape[2]
        self.outputs.consume_bound(chunk, prev_env, prev_var, self.constant)

    # ---------------------------------------------------------------- summary
    def head_decay(self) -> np.ndarray:
        """Geometric-mean per-step decay ``a`` of each (layer, head): exp(mean of sum g)."""
        return np.exp(self.logdecay_sum / max(self.logdecay_n, 1))

    def stagnation_prone(self) -> np.ndarray:
        """``[L, HV]`` bool: heads whose per-step decay is within the dtype's half-ulp of 1."""
        return (1.0 - self.head_decay()) < STORE_DTYPES[self.cfg.ssm_dtype].stagnation_margin

    def growth(self) -> np.ndarray:
        """``[L, HV]`` growth exponent of the mean relative error (NaN when too short to fit).

        Fitted over steps >= max(64, horizon / 64): past the transient of the slowest
        non-stagnating head (1 / (1 - rho2) ~ 40 steps on ci-small).
        """
        x, y = self.curves.curve("rel_err", "mean")
        start = max(64.0, float(x.max()) / 64.0) if len(x) else 64.0
        return growth_exponents(x, y, start) if len(x) else np.full(self.curves.shape, np.nan)

    def summary(self) -> dict:
        x, rel = self.curves.curve("rel_err", "max") if self.curves.series else (np.zeros(0), None)
        return {
            "bound_constant": self.constant, "kappa": self.kappa,
            "worst_ratio_per_head": np.round(self.worst_head, 4).tolist(),
            "growth_exponent": [[None if np.isnan(v) else round(float(v), 3) for v in row] for row in self.growth()],
            "stagnation_prone": self.stagnation_prone().tolist(),
            "step_decay": np.round(self.head_decay(), 6).tolist(),
            "curves": self.curves.to_dict(),
        }

    def result(self) -> CheckResult:
        res = super().result()
        res.extra["bound"] = self.summary() if self.seen else {}
        return res

    def state_dict(self) -> dict:
        return {**super().state_dict(), "curves": self.curves.state_dict(), "outputs": self.outputs.state_dict(),
                "snapshots": [[q, saveable(e), saveable(v)] for q, (e, v) in self.snapshots.items()]}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.curves.load_state_dict(state["curves"])
        self.outputs.load_state_dict(state["outputs"])
        self.snapshots = {int(q): (restore(e), restore(v)) for q, e, v in state.get("snapshots", [])}


class OutputBound(Check):
    """The verify op's outputs of the accepted tokens within their derived bound (docs/bounds.md).

    Per (layer, row, head) and step, over the accepted tokens t, the output error is the step's
    starting error carried to the output plus the op's own bf16 rounding of the output
    (docs/semantics.md §5: ``o = S q`` of the fp32 running state, cast to bf16 round-to-nearest):

    * carried: ``E||E_t q_t||^2 = w_t env2_prev`` with ``w_t = rho2(<= t) sum_k q_tk^2 c_k`` (the
      committed error, contracted through token t, read by q_t; ``c_k`` the share of its energy in
      key column k), held to ``BOUND_CONSTANT`` times the root of it plus FLUCTUATION_Z standard
      deviations. An output reads the error row by row (V terms, not the state's K V), so it
      fluctuates more: ``Var <= W^2 (var2 + 2 rho_V (env2^2 + var2))`` with ``W = sum_t w_t`` and
      ``rho_V = sum_v r_v^2`` the error energy's concentration over the V rows;
    * rounding: round to nearest moves each output by at most half its ulp: at most
      ``sqrt(sum_t ||ulp_bf16(o_t)||^2 / 4)``, a hard bound;

    added (Minkowski), plus COMPUTE_FLOOR of the outputs. Fed by the :class:`BoundCheck` (it owns
    the state envelope); MTP only.
    """

    key = "output_bound"
    measures = ("bound_terms", "outputs")  # fed by the BoundCheck, which declares these for it

    def __init__(self):
        super().__init__(1.0)

    def start(self, comparison) -> None:
        super().start(comparison)
        self.applies = comparison.sim.mode == "mtp"

    def consume_bound(self, chunk: MetricsChunk, prev_env: np.ndarray, prev_var: np.ndarray, constant: float) -> None:
        if not self.applies:
            return
        spread = prev_var + 2.0 * chunk.out_rows * (prev_env ** 2 + prev_var)  # docs/bounds.md §8
        carried = constant * np.sqrt(chunk.out_w * (prev_env + FLUCTUATION_Z * np.sqrt(spread)))
        bound = carried + np.sqrt(chunk.out_round2) + COMPUTE_FLOOR * np.sqrt(chunk.out_ref2)
        ratio = np.where(chunk.out_ref2 > 0, np.sqrt(chunk.out_err2) / np.maximum(bound, 1e-300), 0.0)
        self._update(ratio, chunk.step0)

    def result(self) -> CheckResult:
        if not self.applies:
            return CheckResult(self.name, True, None, None, "", "not applicable: sequential decode has no verify op",
                               extra={"applicable": False})
        return super().result()


class OutputBoundCheck:
    """The :class:`OutputBound` of a :class:`BoundCheck`, as a check result."""

    name = property(lambda self: CHECKS.title("output_bound"))

    def __init__(self, bound: BoundCheck):
        self.bound = bound

    def result(self) -> CheckResult:
        if not getattr(self.bound, "outputs", None):
            return CheckResult(self.name, False, None, 1.0, "", "no step was compared")
        return self.bound.outputs.result()


class GrowthCheck:
    """Growth exponent of every non-stagnating head at most GROWTH_LIMIT (reads a BoundCheck)."""

    name = property(lambda self: CHECKS.title("growth_exponent"))

    def __init__(self, bound: BoundCheck, limit: float = GROWTH_LIMIT):
        self.bound, self.limit = bound, limit

    def result(self) -> CheckResult:
        if not self.bound.seen:
            return CheckResult(self.name, False, None, self.limit, "", "no step was compared")
        g = self.bound.growth()
        prone = self.bound.stagnation_prone()
        judged = np.where(prone | np.isnan(g), -np.inf, g)
        if not np.isfinite(judged).any():
            return CheckResult(self.name, True, None, self.limit, "",
                               "no non-stagnating head with enough steps to fit (run longer)",
                               extra={"applicable": False})
        l, h = np.unravel_index(int(np.argmax(judged)), judged.shape)
        worst = float(judged[l, h])
        ok = worst <= self.limit
        note = f"{int(prone.sum())} stagnation-prone head(s) not judged" if prone.any() else ""
        return CheckResult(self.name, ok, worst, self.limit, f"layer {l}, head {h}",
                           note if ok else f"error grows like step^{worst:.2f}; {note}".rstrip("; "))


def _mtp(ctx) -> bool:
    return ctx.mode == "mtp"


def fold_rounding_of(ctx) -> Optional[FoldRounding]:
    """The fold design of an MTP run whose flow kind's commit folds records (``FlowKind.fold_rounding``)."""
    from ..flows.registry import FLOW_KINDS, FLOWS

    if ctx.mode != "mtp" or ctx.cfg.flow not in FLOWS:
        return None
    return FLOW_KINDS[FLOWS[ctx.cfg.flow].kind].fold_rounding(ctx.cfg)


for _spec in (
    CheckSpec("drift_bound", "drift bound", 70, "state error above `C * envelope` at any step, layer, row, head "
              "(bf16 drift, biased rounding)", "consumer",
              build=lambda ctx: BoundCheck(initial_env2=ctx.env2_start, fold=fold_rounding_of(ctx))),
    CheckSpec("growth_exponent", "growth exponent", 80, f"error of a non-stagnating head growing faster than "
              f"`step^{GROWTH_LIMIT}`", "derived", needs=("drift_bound",),
              build=lambda ctx: GrowthCheck(ctx.checks["drift_bound"])),
    CheckSpec("output_bound", "output bound", 90, "output error above the carried state error plus the op's own "
              "bf16 output rounding (`docs/bounds.md` §8)", "derived", needs=("drift_bound",),
              build=lambda ctx: OutputBoundCheck(ctx.checks["drift_bound"])),
):
    CHECKS.add(_spec)
