"""What the drift bound reads of a commit that folds per-token records into a checkpoint
(docs/bounds.md §9), in terms no flow kind owns: a kind whose commit folds returns a
:class:`FoldRounding` from ``FlowKind.fold_rounding(cfg)``, and the bound (drift/check) derives its
terms from these numbers alone -- never from the code under test.

* :class:`FoldRounding`: the rounding each fold injects (the records' store, the contraction's
  operands) and when the folds happen (every N commits, or when the ring fills);
* :class:`FoldSchedule`: that rule applied to the host's accept lengths, row by row: which steps
  fold. The update under test decides the same with its own cursors on the device; the bound
  decides it here, independently, from the declared design.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass(frozen=True)
class FoldRounding:
    """The roundings of one run's fold design and its cadence.

    * ``record_bits``: mantissa bits (the implicit bit included) to which each record's delta and
      key are rounded when the verify writes them, to nearest; None when the bound does not count
      that rounding (exact, or below the terms it keeps; docs/bounds.md §9 says which);
    * ``operand_bits``: the same for the fold's contraction operands (the decayed delta and the key
      as the ring holds it), accumulated in fp32; None when not counted (fp32 operands are the fp32
      compute term's);
    * ``key_operand_exact``: the key as the ring holds it is already on the operand grid (a
      record of at most ``operand_bits`` bits), so only the decayed delta is rounded;
    * ``every``: a row folds every ``every`` commits (1: every commit); ``when_full``: instead, when
      its ring's ``write_pos + 2 D`` would pass ``ring_len`` (SGLang's early flush);
    * ``ring_len``, ``draft_tokens``: the ring's length and D.
    """

    record_bits: Optional[int]
    operand_bits: Optional[int]
    key_operand_exact: bool
    every: int
    when_full: bool
    ring_len: int
    draft_tokens: int
    exact_checkpoint: bool  # the checkpoint dtype is the fold's fp32: its store rounds nothing

    @property
    def folds_every_commit(self) -> bool:
        return self.every == 1 and not self.when_full

    @property
    def trivial(self) -> bool:
        """Nothing beyond the copy-commit bound (docs/bounds.md §1-§4): no record or operand rounding
        counted, and a store after every step or none at all (an exact checkpoint)."""
        return (self.record_bits is None and self.operand_bits is None
                and (self.folds_every_commit or self.exact_checkpoint))


class FoldSchedule:
    """Which rows fold at each step under a :class:`FoldRounding`'s cadence, from the accept lengths
    (the accepted draft tokens and the bonus token: every active row accepts at least one; an idle
    row, 0, commits nothing). Per row it counts the records written and the commits made since its
    last fold (host int64 ``[R]``); a request that starts on a row begins with none
    (:meth:`restart`: SGLang 0.5.23 zeroes a freshly allocated request row's spec cursors,
    ``srt/mem_cache/memory_pool.py``, docs/semantics.md §12)."""

    def __init__(self, rounding: FoldRounding, rows: int):
        self.rounding = rounding
        self.records = np.zeros(rows, np.int64)
        self.commits = np.zeros(rows, np.int64)

    def step(self, accept: np.ndarray) -> np.ndarray:
        """One commit of ``accept`` tokens per row (host int ``[R]``): bool ``[R]``, the rows that fold."""
        fr = self.rounding
        accept = np.asarray(accept, np.int64)
        self.records += accept
        self.commits += accept > 0
        if fr.when_full:
            fold = self.records + 2 * fr.draft_tokens > fr.ring_len
        else:
            fold = (self.commits >= fr.every) & (self.records > 0)
        self.records[fold] = 0
        self.commits[fold] = 0
        return fold

    def restart(self, rows) -> None:
        """Rows where a request starts (host int indices): no records, no commits since a fold."""
        self.records[rows] = 0
        self.commits[rows] = 0

    def state_dict(self) -> dict:
        return {"records": self.records.copy(), "commits": self.commits.copy()}

    def load_state_dict(self, state: dict) -> None:
        self.records = np.asarray(state["records"], np.int64).copy()
        self.commits = np.asarray(state["commits"], np.int64).copy()
