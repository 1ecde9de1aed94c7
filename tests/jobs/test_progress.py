"""Long commands show progress per item with an ETA on stderr (tqdm), and --quiet silences it."""

from __future__ import annotations

import io

from drift.cli import main
from drift.config import preset
from drift.jobs.bench import bench
from drift.jobs.report import progress_printer
from drift.jobs.teeth import tradeoff


def _recorder():
    calls = []
    return calls, lambda done, total, what="": calls.append((done, total, what))


def test_mutants_reports_each_mutant_and_quiet_silences_it(capsys):
    assert main(["mutants", "--steps", "64", "--mutant", "item_guard", "--json"]) == 0
    err = capsys.readouterr().err
    assert "drift mutants ci-small" in err and "1/1" in err and "item_guard" in err
    assert main(["mutants", "--steps", "64", "--mutant", "item_guard", "--json", "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_tradeoff_reports_every_run():
    calls, record = _recorder()
    rows = tradeoff(preset("ci-small", steps=16), impls=("sglang-0.5.23", "sglang-32130"), unpadded_guard=False,
                    flows=("sglang",), progress=record)
    assert [c[:2] for c in calls] == [(1, 2), (2, 2)] and len(rows) == 2
    assert calls[0][2] == "sglang-0.5.23, sglang flow"


def test_bench_reports_each_timed_part():
    calls, record = _recorder()
    bench(preset("ci-small").replace(num_layers=1), steps=1, naive_steps=1, repeats=1, threads=1, stage_steps=0,
          progress=record)
    total = calls[0][1]
    # warm-up, one probe, one block, one naive step (no device graph on a CPU, no stage profile)
    assert [c[0] for c in calls] == list(range(1, total + 1)) and total == 4
    assert calls[-1][2] == "naive step 1/1"


def test_progress_printer_writes_rate_and_eta_lines_off_a_terminal():
    out = io.StringIO()  # not a tty: plain lines
    update = progress_printer("job", stream=out, unit="run")
    for i in range(1, 4):
        update(i, 3, f"item {i}")
    text = out.getvalue()
    assert "job" in text and "3/3" in text and "item 3" in text and "run" in text


def test_an_open_progress_bar_starts_no_thread():
    """A bar open over a command's runs leaves the process one thread, so each run may still fork its scan and
    its comparison (drift.check.forked.fork_refusal counts threads): tqdm's monitor thread is off. The
    control: a plain tqdm bar starts it (the comparison can fail)."""
    import threading

    from tqdm import tqdm

    before = set(threading.enumerate())
    update = progress_printer("job", stream=io.StringIO(), unit="run")
    update(1, 3, "item 1")
    assert set(threading.enumerate()) == before
    update(3, 3)
    plain = tqdm(total=3, file=io.StringIO())
    try:
        assert [t.name for t in set(threading.enumerate()) - before] == ["tqdm_monitor"]
    finally:
        plain.close()


def test_bench_update_reports_each_row_and_quiet_silences_it(capsys):
    assert main(["bench-update", "--batches", "1,2", "--steps", "2", "--update", "sglang-0.5.23", "--json"]) == 0
    err = capsys.readouterr().err
    assert "drift bench-update ci-small" in err and "2/2" in err and "sglang-0.5.23, batch 2" in err
    assert main(["bench-update", "--batches", "1", "--steps", "2", "--update", "sglang-0.5.23", "--json",
                 "--quiet"]) == 0
    assert capsys.readouterr().err == ""
