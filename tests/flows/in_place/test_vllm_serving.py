"""The vllm flow under a serving lifecycle (docs/semantics.md §12, "vLLM's serving bookkeeping"):
vLLM 0.33.0's MRV1 bookkeeping in align mode -- requests that finish and arrive, prefix hits, the
persistent batch's condense, migrations of the running state, padded rows at changing graph buckets --
runs clean with the built-in rendering on ci-small and ci-heads, and each serving mutant of the
catalogue is caught (its negative control). The horizons are short (the lead's gate runs 4,096
steps); each test says which events it needs and checks they happened.
"""

from __future__ import annotations

import pytest

from helpers import figures, resumed_from_checkpoint
from drift import preset
from drift.errors import ConfigError
from drift.flows.in_place import updates as U
from drift.plug.mutants import MUTANTS
from drift.runner import run_checked
from drift.runspec import resolve

SERVING_MUTANTS = ("vllm_condense_accept", "vllm_add_inherits_accept", "vllm_migrate_keeps_accept",
                   "vllm_hit_wrong_column", "vllm_stale_padded_rows")


class Counting:
    """Serving parts that count what the built-in ones did: migrations (preprocess_mamba's copies), rows
    moved by condense, requests added."""

    def __init__(self):
        self.migrations = self.moves = self.adds = 0

    def parts(self) -> U.ServingParts:
        def reset_after_copy(batch, row):
            self.migrations += 1
            U.reset_accept_after_copy(batch, row)

        def move_accept(batch, src, dst):
            self.moves += 1
            U.move_accept_count(batch, src, dst)

        def reset_accept(batch, row):
            self.adds += 1
            U.reset_accept_count(batch, row)

        return U.ServingParts(reset_after_copy=reset_after_copy, move_accept=move_accept, reset_accept=reset_accept)


@pytest.mark.parametrize("name", ["ci-small", "ci-heads"])
def test_the_builtin_bookkeeping_passes_a_serving_run_and_the_run_had_the_events(name):
    count = Counting()
    update = U.bookkeeping(serving=count.parts(), name="vllm-0.33.0-counted")
    cfg = preset(name, flow="vllm", lifecycle="serving", steps=384)
    rep = run_checked(resolve(cfg, update), sync_scan=False)
    assert rep.passed, [c.key for c in rep.checks if c.failed]
    events = rep.info.meta["events"]
    # what the checks saw: requests that ended and started, prefix hits among them, rows moved by
    # condense, padded rows, and the running state migrating to new columns
    assert events["ends"]["finish"] >= 3 and events["starts"]["prefix hit"] >= 2 and events["row_moves"] >= 2
    assert max(events["padded_rows"]) >= 1 and len(events["buckets"]) >= 2
    assert count.moves >= 2 and count.adds == events["requests"] + events["starts"]["resume"]
    assert count.migrations >= 50


def test_a_serving_run_with_preemptions_and_ragged_drafts_passes():
    """Resumed requests (a full re-prefill, has_initial_state off) and varlen rows (seq_len = computed +
    the row's own drafts): the horizon is long enough for preemptions on ci-small."""
    cfg = preset("ci-small", flow="vllm", lifecycle="serving", steps=1536, drafts="ragged", num_layers=1)
    rep = run_checked(resolve(cfg), sync_scan=False)
    assert rep.passed, [c.key for c in rep.checks if c.failed]
    assert rep.info.meta["events"]["starts"]["resume"] >= 1


@pytest.mark.parametrize("mutant", SERVING_MUTANTS)
def test_each_serving_mutant_is_caught(mutant):
    m = MUTANTS[mutant]
    assert m.flow == "vllm" and m.config == {"lifecycle": "serving"}
    cfg = preset("ci-small", steps=192).replace(**m.config)
    rep = run_checked(resolve(cfg, f"mutant:{mutant}", choose_flow=True), sync_scan=False)
    assert rep.config.flow == "vllm"
    assert [c.key for c in rep.checks if c.failed]
    if mutant == "vllm_stale_padded_rows":  # the slot guard names the block by the request that held it
        guard = next(c for c in rep.checks if c.key == "untouched_slots")
        assert guard.failed and "request" in guard.detail
    if mutant in ("vllm_add_inherits_accept", "vllm_hit_wrong_column"):  # a prefix hit's restore, bit for bit
        starts = next(c for c in rep.checks if c.key == "request_starts")
        assert starts.failed and "whose restore differs from the snapshot the cache keeps" in starts.detail


def test_the_serving_mutants_pass_the_fixed_batch():
    """Why they carry lifecycle='serving': with one request per row and no events, none of their parts
    runs (the builder's padded tail is NULL from the start)."""
    for mutant in SERVING_MUTANTS:
        rep = run_checked(resolve(preset("ci-small", steps=48, flow="vllm"), f"mutant:{mutant}"), sync_scan=False)
        assert not [c.key for c in rep.checks if c.failed], mutant


def test_without_prefix_caching_no_state_moves():
    """track_interval 0 (vLLM's mode "none": no prefix caching, mamba_block_size = max_model_len): each
    request keeps its 1 + num_spec blocks, so preprocess_mamba never copies; the run passes."""
    count = Counting()
    cfg = preset("ci-small", flow="vllm", lifecycle="serving", steps=128, track_interval=0)
    rep = run_checked(resolve(cfg, U.bookkeeping(serving=count.parts(), name="counted")), sync_scan=False)
    assert rep.passed, [c.key for c in rep.checks if c.failed]
    assert count.migrations == 0 and count.adds >= 5


def test_a_block_smaller_than_a_step_is_refused_under_serving():
    with pytest.raises(ConfigError, match="track_interval"):
        resolve(preset("ci-small", flow="vllm", lifecycle="serving", track_interval=2))
    resolve(preset("ci-small", flow="vllm", track_interval=2))  # the fixed batch keeps its blocks: allowed


def test_the_fixed_batch_runs_none_of_the_serving_parts():
    count = Counting()
    rep = run_checked(resolve(preset("ci-small", steps=32, flow="vllm"),
                              U.bookkeeping(serving=count.parts(), name="counted")), sync_scan=False)
    assert rep.passed, [c.key for c in rep.checks if c.failed]
    assert (count.migrations, count.moves, count.adds) == (0, 0, 0)


def test_a_serving_run_resumed_from_a_checkpoint_gives_the_same_figures(tmp_path):
    """The engine state (block pool, columns, persistent batch, runner, prefix cache, index buffers) comes
    back from a checkpoint file (no pickle), so a resumed run's figures and events equal an uninterrupted
    run's. The negative control: a resume that loses the accept counts the last step left (all 1) differs."""
    from drift import checkpoint
    from drift.runner import CheckedRun

    cfg = preset("ci-small", flow="vllm", lifecycle="serving", steps=384, num_layers=1)
    path = tmp_path / "ckpt.pt"
    whole_rep, rep = resumed_from_checkpoint(cfg, path, 192)
    assert figures(rep) == figures(whole_rep)
    assert rep.info.meta["events"] == whole_rep.info.meta["events"]
    state = checkpoint.load(path)
    accept = state["sim"]["serving"]["flow"]["buffers"]["accept"]
    assert (accept > 1).any()  # the control can tell: some row accepted more than one token
    accept.fill_(1)
    lost = CheckedRun(resolve(cfg))
    lost_rep = lost.report(lost.run(resume_state=state), sync_scan=False)
    assert figures(lost_rep) != figures(whole_rep)
