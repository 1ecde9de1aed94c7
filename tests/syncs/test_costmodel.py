"""Cost model (drift.syncs.costmodel, ``drift bench-update``): structure and relations that must hold.

No wall-clock timing is asserted; device latency is checked only where an accelerator exists.
"""

from __future__ import annotations

import json

import pytest

from drift.cli import main
from drift.config import preset
from drift.syncs.costmodel import BYTES_MODEL, CostRow, format_table, measure, to_json
from drift.flows.registry import FLOWS, updates_of
from drift.runspec import resolve

CI = preset("ci-small")
BATCHES = (1, 4, 16)
STEPS = 8


def runs_of(cfg, updates=None):
    """``cfg`` resolved with each of ``updates`` (default: the built-ins of its flow's kind)."""
    return [resolve(cfg, u) for u in (updates or updates_of(FLOWS[cfg.flow].kind))]


@pytest.fixture(scope="module")
def rows() -> dict[tuple[str, int], CostRow]:
    return {(r.update, r.requests): r for r in measure(runs_of(CI), batch_sizes=BATCHES, steps=STEPS)}


def test_one_row_per_update_and_batch(rows):
    assert sorted(rows) == sorted((u, b) for u in updates_of("copy-commit") for b in BATCHES)  # the preset's flow
    for (u, b), r in rows.items():
        assert r.rows == b + CI.num_padded and r.steps == STEPS
        assert 0 <= r.tracking_steps <= STEPS
        assert r.ops_per_step > r.view_ops_per_step > 0 and r.bytes_per_step > 0
        assert r.latency_us is None and r.latency_device is None  # cpu config: no device timing


def test_sync_relations(rows):
    for b in BATCHES:
        g, s, d = (rows[(u, b)] for u in ("sglang-31659", "sglang-32130", "sglang-0.5.23"))
        assert d.syncs_per_step == 0.0
        assert g.syncs_per_step >= 1.0
        # Tracking is on: sync_free builds its boolean mask every step.
        assert s.syncs_per_step >= 1.0
        # guarded = sync_free's path + exactly one .item() per step (ci-small has a padded row,
        # so the guard never fires and both take the same tracking path).
        assert g.syncs_per_step - s.syncs_per_step == 1.0
        assert g.ops_per_step > s.ops_per_step


def test_device_select_cost_is_data_independent(rows):
    """No data-dependent control flow: the same ops every step at every batch size, and bytes
    growing with the batch (every tensor it touches grows with rows and slots)."""
    ops = {rows[("sglang-0.5.23", b)].ops_per_step for b in BATCHES}
    assert len(ops) == 1 and float(next(iter(ops))).is_integer()
    moved = [rows[("sglang-0.5.23", b)].bytes_per_step for b in BATCHES]
    assert moved == sorted(moved) and len(set(moved)) == len(moved)


def test_unconditional_copy_costs_bytes(rows):
    """The #32130 trade-off, as measured: device_select copies the conv window of every row
    each step (a self-copy for untracked ones), sync_free only of tracked rows and not at all
    on steps without one. Padded rows are never tracked, so device_select copies at least one
    window more per step (gather + scatter: 2 * L * W * C * 2 B = 18 KiB on ci-small), far
    more than the index tensors ([N] int64) its torch.where reads beyond sync_free's masks."""
    for b in BATCHES:
        assert rows[("sglang-0.5.23", b)].bytes_per_step > rows[("sglang-32130", b)].bytes_per_step


def test_shape_only_counts_equal_real_data_counts():
    real = measure(runs_of(CI), batch_sizes=(1, 3), steps=4, shape_only=False)
    shape = measure(runs_of(CI), batch_sizes=(1, 3), steps=4, shape_only=True)
    assert real == shape


def test_table_and_json(rows):
    rs = list(rows.values())
    table = format_table(rs).splitlines()
    assert table[0].startswith("| update | requests |") and len(table) == 2 + len(rs) + 2
    assert table[-1] == f"bytes/step: {BYTES_MODEL}."
    data = json.loads(to_json(rs))
    assert [d["update"] for d in data] == [r.update for r in rs]
    assert all(d["bytes_model"] == BYTES_MODEL and d["latency_us"] is None for d in data)


def test_cli_bench_update_json(capsys):
    assert main(["bench-update", "--batches", "1,2", "--steps", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(d["update"], d["requests"]) for d in data] == [(u, b) for b in (1, 2) for u in updates_of("copy-commit")]


def test_cli_bench_update_rejects_bad_batches(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench-update", "--batches", "0,4"])
    assert exc.value.code == 2 and "batch sizes >= 1" in capsys.readouterr().err


@pytest.mark.cuda
def test_cuda_latency_is_measured():
    [row] = measure(runs_of(CI.replace(device="cuda"), ["sglang-0.5.23"]), batch_sizes=(4,), steps=4)
    assert row.latency_us is not None and row.latency_us > 0 and row.latency_device.startswith("cuda")


def test_cli_bench_update_measures_another_flows_update_under_its_flow(capsys):
    from drift.flows.registry import FLOWS
    other = [f for f in FLOWS if FLOWS[f].kind != "copy-commit"][0]
    # the vllm flow's bookkeeping without --flow runs in its own flow; in the copy-commit one it is refused
    assert main(["bench-update", "--update", "vllm-0.33.0", "--batches", "1", "--steps", "1", "--json"]) == 0
    assert [d["update"] for d in json.loads(capsys.readouterr().out)] == ["vllm-0.33.0"]
    assert main(["bench-update", "--flow", "sglang", "--update", "vllm-0.33.0", "--batches", "1", "--steps", "1"]) == 2
    assert f"pass --flow {other}" in capsys.readouterr().err
    assert main(["bench-update", "--flow", other, "--batches", "1", "--steps", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [d["update"] for d in data] == ["vllm-0.33.0"] and data[0]["syncs_per_step"] == 0



def test_measuring_a_small_run_takes_one_intra_op_thread(monkeypatch):
    """measure runs a small run's update on one intra-op thread (drift.openmp.run_threads), as run_checked does:
    on two, its first op started OpenMP's pool, whose thread kept every later run of the process (drift
    tradeoff's) from forking its scan (drift tradeoff 16.7 s against 19.3 s, its JSON byte-equal). The count as
    it was afterwards. Fails where measure runs the update on torch's count (a spy sees 2)."""
    from drift.syncs.detector import SyncDetector
    from helpers import threads_inside

    seen, after, rows = threads_inside(
        monkeypatch, SyncDetector, "run",
        lambda: measure([resolve(preset("ci-small", steps=64), "sglang-0.5.23")], [4], steps=8))
    assert seen and set(seen) == {1} and after == 2 and rows[0].bytes_per_step > 0
