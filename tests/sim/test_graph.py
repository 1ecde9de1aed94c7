"""The captured decode step (drift.sim.graph, Simulation's graph path, the "graph_capture" check).

A CPU has no device graph, so the CPU tests drive the graph path through a stand-in API whose
"capture" runs the body (a CPU cannot defer work) and whose first replay after capture is
therefore skipped: everything else (persistent inputs copied once per chunk, the device step
counter, the persistent output, the slot guard's device index, the eager fallback after a failed
capture) is the code a GPU or NPU runs. On a CUDA device (``-m cuda --drift-device cuda``) the
real capture is compared with eager, bit for bit.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from drift.config import preset

from drift.flows.registry import FLOWS
from drift.check.runlevel import graph_result
from drift.runner import CheckedRun
from drift.sim import graph as graph_mod
from drift.sim.graph import GraphStatus, StepGraph, blame
from drift.dtypes import as_bits
from drift.simulate import Simulation, SlotGuard
from drift.runspec import resolve

from helpers import bad_spec

CI = preset("ci-small")


class FakeGraph:
    def __init__(self, log):
        self.body, self.log, self.skip_next = None, log, True

    def replay(self):
        self.log.append("replay")
        if self.skip_next:  # the fake capture already ran this step
            self.skip_next = False
            return
        self.body()


class FakeApi:
    """torch.cuda's graph API as StepGraph uses it, on the CPU."""

    name = "fake.Graph"

    def __init__(self, fail_on_item: bool = False):
        self.log, self.fail_on_item, self.capturing, self.current = [], fail_on_item, False, None

    def new_graph(self):
        self.current = FakeGraph(self.log)
        return self.current

    @contextlib.contextmanager
    def capture(self, graph, stream):
        """A device capture records work without running it; the CPU runs it. So that a capture
        that fails half-way leaves the simulation as a device would (untouched), the tensors a
        step writes are restored when the body raises."""
        self.log.append("capture")
        sim = _BODY[0].__self__
        written = [sim.pool.temporal, sim.pool.conv, sim.pool.intermediate_ssm, *sim.flow.buffers(),
                   sim._static["idx"]] + ([sim.guard.violations] if sim.guard is not None else [])
        saved = [t.clone() for t in written]
        self.capturing = True
        try:
            yield
        except BaseException:
            for t, v in zip(written, saved):
                t.copy_(v)
            raise
        finally:
            self.capturing = False

    def new_stream(self):
        return _FakeStream()

    def current_stream(self):
        return _FakeStream()

    def stream(self, s):
        return contextlib.nullcontext()

    def synchronize(self):
        pass


class _FakeStream:
    def wait_stream(self, other):
        pass


def install(monkeypatch, api: FakeApi):
    """Route StepGraph to ``api``; the body it captures is remembered for replays."""
    monkeypatch.setattr(graph_mod, "graph_api", lambda device: (api, "fake graph"))
    orig_capture = api.capture

    @contextlib.contextmanager
    def capture(graph, stream):
        with orig_capture(graph, stream):
            yield
        graph.body = _BODY[0]

    api.capture = capture
    real_init = StepGraph.__init__

    def init(self, device, body, enabled=True, why_not=""):
        _BODY[0] = body
        real_init(self, device, body, enabled, why_not)

    monkeypatch.setattr(StepGraph, "__init__", init)
    if api.fail_on_item:
        # Tensor.item as a capturing CUDA stream answers it. Compiled under a file name inside
        # torch, as the real error comes from torch, not from the caller's code.
        scope = {"real_item": torch.Tensor.item, "api": api}
        src = ("def item(t):\n"
               "    if api.capturing:\n"
               "        raise RuntimeError('CUDA error: operation not permitted when stream is capturing')\n"
               "    return real_item(t)\n")
        exec(compile(src, os.path.join(os.path.dirname(torch.__file__), "_fake_capture.py"), "exec"), scope)
        monkeypatch.setattr(torch.Tensor, "item", scope["item"])


_BODY = [None]


def final_bits(sim: Simulation, outs: list) -> tuple:
    t, c = sim.pool.bits()
    return t.clone(), c.clone(), torch.stack(outs)


class OutputTap:
    def __init__(self):
        self.outs = []

    def on_start(self, sim):
        pass

    def on_step(self, view):
        self.outs.append(as_bits(view.out).clone())

    def flush(self):
        pass

    def on_end(self):
        pass


def run(cfg, graph, update=None, steps=40):  # None: the flow's own update
    tap = OutputTap()
    sim = Simulation(resolve(cfg, update), observers=[tap], graph=graph)
    sim.stream.chunk_steps = 16  # several chunks in a short run (the guard's buffer is larger)
    info = sim.run(steps)
    return sim, info, final_bits(sim, tap.outs)


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("flow", FLOWS.names())
def test_the_graph_path_is_bit_identical_to_eager_across_chunks(monkeypatch, flow):
    cfg = CI.replace(flow=flow)
    _, eager_info, eager = run(cfg, graph=False)
    api = FakeApi()
    install(monkeypatch, api)
    sim, info, captured = run(cfg, graph=True)
    assert sim.graph_status.captured, sim.graph_status
    assert api.log.count("capture") == 1 and api.log.count("replay") == 40 - 1  # warm-up, capture, replays
    assert sim.stream.step == 40 and sim.stream.chunk_steps == 16  # inputs refilled at 2 chunk boundaries
    assert same(eager, captured)
    assert info.untouched_violation == eager_info.untouched_violation is None


def test_negative_control_a_graph_that_replays_a_stale_step_differs(monkeypatch):
    """The comparison above can fail: a graph whose step counter never advances replays step 0's
    inputs forever and ends elsewhere."""
    _, _, eager = run(CI, graph=False)
    install(monkeypatch, FakeApi())
    real_body = Simulation._graph_body

    def stuck(self):
        real_body(self)
        self._static["idx"].sub_(1)

    monkeypatch.setattr(Simulation, "_graph_body", stuck)
    _, _, captured = run(CI, graph=True)
    assert not same(eager, captured)


def test_the_slot_guard_still_fires_inside_the_graph(monkeypatch):
    """Every replayed step records its own guard flags (the device index): the untouched-slot
    writes of a bad update are flagged at the same steps with and without the graph."""
    seen = []
    real_flush = SlotGuard.flush

    def flush(self, step0, count, offset=0):
        v = self.violations[offset:offset + count].any(1)
        seen.extend(step0 + i for i in torch.nonzero(v).flatten().tolist())
        real_flush(self, step0, count, offset)

    monkeypatch.setattr(SlotGuard, "flush", flush)
    run(CI, graph=False, update=bad_spec("track_unconditional"))
    eager, seen[:] = list(seen), []
    install(monkeypatch, FakeApi())
    sim, info, _ = run(CI, graph=True, update=bad_spec("track_unconditional"))
    assert sim.graph_status.captured and info.untouched_violation is not None
    assert seen == eager and max(seen) >= 16  # flagged in replayed steps of later chunks too


def test_a_sync_in_the_update_fails_capture_naming_the_line_and_the_run_goes_on_eagerly(monkeypatch):
    _, _, eager = run(CI, graph=False, update="sglang-31659")
    install(monkeypatch, FakeApi(fail_on_item=True))
    sim, info, captured = run(CI, graph=True, update="sglang-31659")
    st = sim.graph_status
    assert st.failed and "operation not permitted when stream is capturing" in st.error
    assert "drift/flows/copy_commit/updates.py" in st.where and ".item()" in st.where
    assert same(eager, captured) and info.steps == 40
    res = graph_result(st, None, sim.device)
    assert res.failed and res.where == st.where and "graph mode" in res.detail


def test_the_check_passes_a_captured_step_and_is_not_asked_without_graph_mode():
    ok = graph_result(GraphStatus("captured", "fake: captured"), None, torch.device("cuda"))
    assert ok.passed and ok.applicable
    off = Simulation(resolve(CI), graph=False).graph_status
    assert off.state == "eager" and "--no-graph" in off.note
    res = graph_result(off, None, torch.device("cpu"))
    assert not res.applicable and not res.failed


def capture_check(update):
    run_ = CheckedRun(resolve(CI, update))
    return {r.key: r for r in run_.results(run_.run(4))}["graph_capture"]


def test_on_the_cpu_the_virtual_device_answers_for_capture():
    good = capture_check("sglang-0.5.23")
    assert good.passed and good.extra["answered_by"] == "host_syncs" and good.verdict == "info"
    bad = capture_check("sglang-31659")  # negative control: .item() in the update
    # Not passed, named at the line; informational because "host_syncs" gates the same finding.
    assert not bad.passed and "copy_commit/updates.py" in bad.where and bad.verdict == "info" and not bad.failed


def test_stochastic_rounding_and_sequential_decode_run_eagerly_and_say_why():
    sr = Simulation(resolve(CI.replace(store_rounding="stochastic")), graph=True).graph_status
    assert sr.state == "eager" and "stochastic" in sr.note
    seq = Simulation(resolve(CI, mode="sequential"), graph=True).graph_status
    assert seq.state == "eager" and "sequential" in seq.note


def test_blame_names_the_innermost_line_outside_torch():
    def update_like(t):
        return t.nonzero().item()  # the offending line

    try:
        update_like(torch.zeros(3, 1))
    except Exception as exc:  # noqa: BLE001
        error, where = blame(exc)
    assert error.startswith("RuntimeError") and where.endswith("return t.nonzero().item()  # the offending line")
    assert __file__.rsplit("/", 1)[-1] in where


@pytest.mark.cuda
def test_cuda_capture_replays_bit_identical_to_eager(drift_device):
    cfg = CI.replace(device=drift_device)
    _, _, eager = run(cfg, graph=False)
    sim, _, captured = run(cfg, graph=True)
    assert sim.graph_status.captured, sim.graph_status
    assert same(eager, captured)


@pytest.mark.cuda
def test_cuda_capture_of_a_syncing_update_fails_with_its_line(drift_device):
    sim, info, _ = run(CI.replace(device=drift_device), graph=True, update="sglang-31659", steps=8)
    assert sim.graph_status.failed and "copy_commit/updates.py" in (sim.graph_status.where or "")
    assert info.steps == 8
