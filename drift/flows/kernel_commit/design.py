"""The kernel-commit design's options: how the ring stores its records, how the fold contracts them
into the checkpoint, and when it folds (docs/semantics.md §6, "The kernel-commit design's options";
the rounding each choice adds: docs/bounds.md §9).

Three registries, one per option (``--ring-records``, ``--fold-contraction``, ``--fold-cadence``;
``Config.flow_options``), each choice citing the engine and kernel that make it. The defaults are
SGLang 0.5.23's, so a run that sets none is the ``sglang-replayssm`` flow as before. The checkpoint
dtype is the profile's state dtype (``--profile``), and the fold's store rounding the run's
``--rounding`` (``rne``, or ``stochastic`` declared, for a bf16 checkpoint).

:class:`CommitDesign` is one run's resolved choices: what the pool allocates, what the ring rule
writes, what the update's fold computes (:attr:`ReplayHarness.commit_design`), and -- through
:meth:`CommitDesign.fold_rounding` -- what the drift bound counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ...config import Config
from ...dtypes import FP32_MANTISSA_BITS, round_mantissa
from ...errors import ConfigError
from ...registry import Registry
from ..base import DesignConfig, OptionChoice, option_choice
from ..fold_model import FoldRounding

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
RING_RECORDS_OPTION, CONTRACTION_OPTION, CADENCE_OPTION = "ring-records", "fold-contraction", "fold-cadence"
SGLANG_FILE = "sglang 0.5.23, sglang/kernels/ops/attention/linear/gdn_replayssm_spec_decode.py"
POOL_FILE = "sglang 0.5.23, sglang/srt/mem_cache/memory_pool.py: MambaPool"
UCACHE_FILE = "flashinfer-python 0.7.2.post1, flashinfer/gdn_kernels/gdn_decode_bf16_wy_ucache_flush.py"
COMMIT_FILE = "flashinfer-python 0.7.2.post1, flashinfer/gdn_decode.py: gated_delta_rule_replayssm_commit"


@dataclass(frozen=True)
class RingRecords(OptionChoice):
    """How the verify stores each record's delta ``d`` and normalised key ``k`` (the log-decay ``g``
    is fp32 in every design): ``dtype`` the high part's, ``low_part`` whether a second ``dtype``
    part holds what the first leaves (``x - hi`` rounded to ``dtype``); ``bits`` the record's
    precision (mantissa bits, the implicit bit included: about twice ``dtype``'s with a low part);
    ``modelled`` whether the bound counts its rounding (docs/bounds.md §9)."""

    dtype: torch.dtype = BF16
    low_part: bool = False
    bits: int = FP32_MANTISSA_BITS
    modelled: bool = False

    @property
    def record_bytes(self) -> int:
        """Bytes per stored element of d or k (both parts)."""
        return self.dtype.itemsize * (2 if self.low_part else 1)


@dataclass(frozen=True)
class FoldContraction(OptionChoice):
    """How the fold forms ``sum_c (w_c d_c) k_c^T`` (fp32 accumulation in every design): ``split``
    the decayed delta as a high and a low part in the record dtype, each multiplied with the key's
    parts as the ring holds them (SGLang's compensated products); else both operands rounded to
    nearest to ``bits`` mantissa bits (None: fp32 operands)."""

    split: bool = False
    bits: Optional[int] = None


@dataclass(frozen=True)
class FoldCadence(OptionChoice):
    """When a row's records are folded into its checkpoint: ``rule`` one of ``sglang`` (every commit
    for a 16-bit checkpoint, when the ring fills for fp32), ``every-commit``, ``ring-full``
    (``write_pos + 2 D > ring length``), ``every`` (every N commits, written ``every:N``)."""

    rule: str = "sglang"


RING_RECORDS: Registry[RingRecords] = Registry("ring-records choice")
for _r in (
    RingRecords("bf16-split", "delta and key each a bf16 high part plus a bf16 low part (what the high part "
                "leaves); g fp32", f"SGLang 0.5.23's spec ring: {POOL_FILE} (ring_dtype = conv_dtype, the activation "
                "dtype; replayssm_rawv / replayssm_rawk low parts allocated when ring_dtype != float32), "
                f"{SGLANG_FILE}: gdn_replayssm_spec_circular_kernel (STORE_D_RESIDUAL, STORE_K_RESIDUAL)",
                default=True, dtype=BF16, low_part=True, bits=16, modelled=False),
    RingRecords("fp32", "delta and key in fp32, no low parts: the verify's fp32 values stored as they are",
                f"SGLang 0.5.23's allocation rule with an fp32 activation dtype: {POOL_FILE} (ring_dtype = "
                "conv_dtype = float32: no replayssm_rawv / replayssm_rawk)",
                dtype=F32, low_part=False, bits=FP32_MANTISSA_BITS, modelled=False),
    RingRecords("bf16", "delta and key in bf16, the high part only (rounded to nearest)",
                f"FlashInfer's STP ReplaySSM decode (flashinfer #4974): {UCACHE_FILE} (u and k rings in the IO "
                "dtype, bf16 by default)", dtype=BF16, low_part=False, bits=8, modelled=True),
    RingRecords("fp16", "delta and key in fp16, the high part only (rounded to nearest; fp16's range -- "
                "overflow past 65504, subnormals below 2^-14, zero below 2^-25 -- is not in the bound)",
                f"{UCACHE_FILE} with GDN_UCACHE_RING_DTYPE=fp16 under bf16 IO (\"fp16 rings under bf16 "
                "activations\", flashinfer #4974)", dtype=F16, low_part=False, bits=11, modelled=True),
):
    RING_RECORDS.register(_r.name, _r)

FOLD_CONTRACTIONS: Registry[FoldContraction] = Registry("fold-contraction choice")
for _c in (
    FoldContraction("split", "the decayed delta split into a high and a low part in the record dtype, each "
                    "multiplied with the key's parts, fp32 accumulation (exact products for 16-bit records)",
                    f"SGLang 0.5.23: {SGLANG_FILE}: gdn_replayssm_compact_commit_kernel (active_hi / active_lo, "
                    "tl.dot with keys and key_residual)", default=True, split=True),
    FoldContraction("fp32", "fp32 operands and accumulation",
                    f"FlashInfer's ReplaySSM commit with backend=\"simt\" (\"Use simt to retain FP32 contractions\"): "
                    f"{COMMIT_FILE}", bits=None),
    FoldContraction("tf32", "both operands rounded to nearest to a 10-bit stored mantissa (TF32, as tensor "
                    "cores round fp32 operands), fp32 accumulation",
                    f"FlashInfer's ReplaySSM commit with backend=\"tcgen05\" (flashinfer #5314: \"TF32 "
                    f"outputs/checkpoints are not bitwise identical to FP32 recurrence\"): {COMMIT_FILE}", bits=11),
    FoldContraction("bf16", "both operands rounded to nearest to bf16, fp32 accumulation (one bf16 tensor-core "
                    "product, no low part)", f"FlashInfer's STP flush fold (D = b_d @ khist, bf16 MMA with f32 "
                    f"accumulation): {UCACHE_FILE}", bits=8),
):
    FOLD_CONTRACTIONS.register(_c.name, _c)

FOLD_CADENCES: Registry[FoldCadence] = Registry("fold-cadence choice")
for _f in (
    FoldCadence("sglang", "every commit for a 16-bit checkpoint, when the ring fills for an fp32 one",
                "SGLang 0.5.23: sglang/srt/speculative/spec_utils.py: commit_mamba_states_after_verify "
                "(fold_every_commit = temporal.dtype != float32)", default=True, rule="sglang"),
    FoldCadence("every-commit", "every commit folds the accepted records and restarts the ring",
                f"SGLang 0.5.23 with a 16-bit checkpoint; FlashInfer's ReplaySSM commit (windows \"consumed once "
                f"by gated_delta_rule_replayssm_commit before the next verify\"): {COMMIT_FILE}", rule="every-commit"),
    FoldCadence("ring-full", "a row folds once its ring's write_pos + 2 D would pass the ring length (the "
                "early-flush margin)", f"SGLang 0.5.23 with an fp32 checkpoint: {SGLANG_FILE}: "
                "_advance_gdn_spec_cursors_kernel; FlashInfer's STP lazy flush (flush_min): " + UCACHE_FILE,
                rule="ring-full"),
    FoldCadence("every", "a row folds every N commits (N >= 2, N D at most the ring length)",
                f"FlashInfer's STP kernel, which \"flushes periodically\" (flashinfer #4974): {UCACHE_FILE}",
                rule="every", takes_arg=True),
):
    FOLD_CADENCES.register(_f.name, _f)

OPTIONS = {RING_RECORDS_OPTION: RING_RECORDS, CONTRACTION_OPTION: FOLD_CONTRACTIONS, CADENCE_OPTION: FOLD_CADENCES}
OPTION_TITLES = {RING_RECORDS_OPTION: "how the verify stores each ring record's delta and key",
                 CONTRACTION_OPTION: "the precision of the commit fold's contraction",
                 CADENCE_OPTION: "when the commit folds a row's records into its checkpoint"}
STORE_ROUNDINGS = ("rne", "stochastic")  # the fold's store: to nearest, or stochastic when declared


def ring_length(num_draft_tokens: int) -> int:
    """SGLang's default ring length, 16 (``MambaPool(linear_replayssm_cache_len=16)``), raised to the
    smallest power of two >= 2 D where D needs it: the cursors mask positions by ``& (L - 1)`` (a
    power of two) and keep a ``2 * max_spec_len`` early-flush margin (``_advance_gdn_spec_cursors_kernel``:
    "Config enforces max_cache_len >= 2 * max_spec_len")."""
    n = 16
    while n < 2 * num_draft_tokens:
        n *= 2
    return n


@dataclass(frozen=True)
class CommitDesign:
    """One run's kernel-commit design: the three choices, the checkpoint dtype (the profile's state
    dtype), the fold's store rounding (``rne`` or declared ``stochastic``), and the ring's length and
    D. ``every``: commits between folds under ``every:N`` (None otherwise)."""

    records: RingRecords
    contraction: FoldContraction
    cadence: FoldCadence
    every: Optional[int]
    checkpoint_dtype: torch.dtype
    store_rounding: str
    ring_len: int
    draft_tokens: int

    @classmethod
    def of(cls, cfg: Config) -> "CommitDesign":
        """``cfg``'s design; ConfigError (exit 2) for a choice not known, or a design whose bound is not
        derived (docs/bounds.md §9): a cadence that would overflow the ring, a store rounding other
        than to nearest or a declared stochastic one of a bf16 checkpoint."""
        records = option_choice(OPTIONS, cfg, RING_RECORDS_OPTION)[0]
        contraction = option_choice(OPTIONS, cfg, CONTRACTION_OPTION)[0]
        cadence, every = option_choice(OPTIONS, cfg, CADENCE_OPTION)
        D, RL = cfg.num_draft_tokens, ring_length(cfg.num_draft_tokens)
        if cadence.rule == "every" and not (2 <= every and every * D <= RL):
            raise ConfigError(f"flow option {CADENCE_OPTION}=every:{every} (--{CADENCE_OPTION}): folding every "
                              f"{every} commits needs 2 <= N and N * D <= the ring length ({RL} records, D = {D}: "
                              f"N <= {RL // D}), else the verify's records would overflow the ring before the fold "
                              f"and no bound is derived for it; use every-commit for N = 1")
        if cfg.store_rounding not in STORE_ROUNDINGS:
            raise ConfigError(f"store_rounding={cfg.store_rounding!r} under flow={cfg.flow!r}: its verify stores no "
                              "state and the commit's fold stores the checkpoint; its bound is derived for a fold "
                              f"that rounds to nearest or, declared, stochastically: {', '.join(STORE_ROUNDINGS)}")
        return cls(records, contraction, cadence, every, cfg.torch_ssm_dtype, cfg.store_rounding, RL, D)

    @property
    def folds_every_commit(self) -> bool:
        """Every commit folds (SGLang's ``fold_every_commit``): under ``sglang`` for a 16-bit checkpoint."""
        rule = self.cadence.rule
        return rule == "every-commit" or (rule == "sglang" and self.checkpoint_dtype != F32)

    @property
    def folds_when_full(self) -> bool:
        return not self.folds_every_commit and self.cadence.rule != "every"

    def split_records(self, x: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """fp32 ``x`` as its stored parts: the high part in the record dtype and, with a low part, what
        it leaves rounded to the record dtype (None without one)."""
        hi = x.to(self.records.dtype)
        if not self.records.low_part:
            return hi, None
        return hi, (x - hi.to(F32)).to(self.records.dtype)

    def operand(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 ``x`` as a contraction operand of a non-split fold: rounded to the choice's mantissa bits."""
        bits = self.contraction.bits
        return x if bits is None else round_mantissa(x, bits)

    def fold_rounding(self) -> FoldRounding:
        rec, op = self.records, self.contraction
        return FoldRounding(record_bits=rec.bits if rec.modelled else None, operand_bits=op.bits,
                            key_operand_exact=op.bits is not None and rec.bits <= op.bits,
                            every=1 if self.folds_every_commit else (self.every or 1), when_full=self.folds_when_full,
                            ring_len=self.ring_len, draft_tokens=self.draft_tokens,
                            exact_checkpoint=self.checkpoint_dtype == F32)

    def describe(self) -> str:
        """One line naming the choices (the report's config line)."""
        cad = f"every:{self.every}" if self.every else self.cadence.name
        return (f"ring records {self.records.name}, fold contraction {self.contraction.name}, fold cadence {cad}, "
                f"checkpoint {str(self.checkpoint_dtype).replace('torch.', '')}, fold store {self.store_rounding}")


# The design space's trade-off table (docs/teeth.md, drift/jobs/teeth.py): SGLang 0.5.23 as it ships
# for each checkpoint dtype, FlashInfer's designs (#5314's TF32 and FP32 folds of an fp32 checkpoint
# every commit -- its raw-input windows are lossless records, fp32 here -- and #4974's STP ring:
# bf16 or fp16 records, a bf16 fold, folded when the ring fills), SGLang's ring with a lazy fold of
# a bf16 checkpoint, and a declared stochastic fold store.
_FLASHINFER = {RING_RECORDS_OPTION: "fp32", CADENCE_OPTION: "every-commit"}
TRADEOFF_DESIGNS = (
    DesignConfig("SGLang 0.5.23, bf16 checkpoint", {}, "bfloat16", note="SGLang 0.5.23 (--mamba-ssm-dtype bfloat16)"),
    DesignConfig("SGLang 0.5.23, fp32 checkpoint", {}, "float32", note="SGLang 0.5.23 (CUDA's default fp32 state)"),
    DesignConfig("TF32 fold, fp32 checkpoint", {**_FLASHINFER, CONTRACTION_OPTION: "tf32"}, "float32",
                 note="FlashInfer #5314 (tcgen05 commit)"),
    DesignConfig("FP32 fold, fp32 checkpoint", {**_FLASHINFER, CONTRACTION_OPTION: "fp32"}, "float32",
                 note="FlashInfer #5314 (simt commit)"),
    DesignConfig("fp16 ring, bf16 checkpoint", {RING_RECORDS_OPTION: "fp16"}, "bfloat16",
                 note="FlashInfer #4974's fp16 ring in SGLang's commit"),
    DesignConfig("bf16 ring, bf16 fold, lazy", {RING_RECORDS_OPTION: "bf16", CONTRACTION_OPTION: "bf16",
                                                CADENCE_OPTION: "ring-full"}, "bfloat16",
                 note="FlashInfer #4974 (STP kernel, bf16 IO)"),
    DesignConfig("SGLang ring, lazy fold, bf16 checkpoint", {CADENCE_OPTION: "ring-full"}, "bfloat16",
                 note="SGLang's fp32 cadence on a bf16 checkpoint"),
    DesignConfig("SGLang 0.5.23, stochastic fold store", {}, "bfloat16", "stochastic",
                 note="a declared stochastic-rounding fold"),
)
# The nightly runs SGLang's default (both checkpoints) and the designs whose precision the field is
# changing: the TF32 fold and the fp16 ring.
NIGHTLY_DESIGNS = TRADEOFF_DESIGNS[0:3] + TRADEOFF_DESIGNS[4:5]
