"""Device graphs for the simulated decode step: capture it once, replay it every step.

A decode step of a small batch is launch-bound on an accelerator (a ci-small step moves a few
MiB: microseconds of device bandwidth, against a few hundred kernel launches). Capturing the
step once and replaying it removes the launches, as the engines do:

* CUDA: ``torch.cuda.CUDAGraph`` captured under ``torch.cuda.graph`` on a side stream;
* Ascend: ``torch.npu.NPUGraph`` under ``torch.npu.graph(graph, pool=..., stream=...,
  auto_dispatch_capture=True)``, as SGLang 0.5.23's ``NPUGraphRunner`` captures its decode
  (``srt/hardware_backend/npu/graph_runner/npu_graph_runner.py``: ``_create_device_graph``,
  ``_capture_graph``);
* a CPU has no device graph: the step runs eagerly, and the host-syncs check on the virtual
  device answers the question capture asks (docs/semantics.md §11).

Capture is also a check. Work that reads device data on the host (``.item()``, ``bool(t)``,
a data-dependent shape) cannot be captured; :class:`StepGraph` then reports the failure
(:class:`GraphStatus`) with the exception and the innermost line outside torch, and the run
goes on eagerly.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from typing import Callable, Optional

import torch

_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = os.path.abspath(__file__)


@dataclass
class GraphStatus:
    """How the decode step ran. state: ``captured``, ``eager`` (not requested, or no device graph
    here) or ``failed`` (capture raised: ``error`` and ``where`` say what and at which line)."""

    state: str
    note: str
    error: Optional[str] = None
    where: Optional[str] = None

    @property
    def captured(self) -> bool:
        return self.state == "captured"

    @property
    def failed(self) -> bool:
        return self.state == "failed"


class _Api:
    """The device's graph API: new_graph(), capture(graph, stream) context, new_stream(),
    current_stream(), stream(s) context, synchronize()."""

    def __init__(self, module, graph_cls, capture, name: str):
        self.module, self.graph_cls, self._capture, self.name = module, graph_cls, capture, name

    def new_graph(self):
        return self.graph_cls()

    def capture(self, graph, stream):
        return self._capture(graph, stream)

    def new_stream(self):
        return self.module.Stream()

    def current_stream(self):
        return self.module.current_stream()

    def stream(self, s):
        return self.module.stream(s)

    def synchronize(self) -> None:
        self.module.synchronize()


def _npu_capture(npu):
    def capture(graph, stream):
        try:  # torch_npu releases with SGLang's keyword
            return npu.graph(graph, stream=stream, auto_dispatch_capture=True)
        except TypeError:  # older torch_npu: no auto_dispatch_capture
            return npu.graph(graph, stream=stream)
    return capture


def graph_api(device: torch.device) -> tuple[Optional[_Api], str]:
    """The graph API of ``device`` and a note; ``(None, why)`` where it has none."""
    if device.type == "cuda":
        if not hasattr(torch.cuda, "CUDAGraph"):
            return None, f"torch {torch.__version__} has no torch.cuda.CUDAGraph"
        return _Api(torch.cuda, torch.cuda.CUDAGraph, lambda g, s: torch.cuda.graph(g, stream=s),
                    "torch.cuda.CUDAGraph"), "torch.cuda.CUDAGraph"
    if device.type == "npu":
        npu = getattr(torch, "npu", None)
        if npu is None or not hasattr(npu, "NPUGraph"):
            return None, "this torch_npu has no torch.npu.NPUGraph"
        return _Api(npu, npu.NPUGraph, _npu_capture(npu), "torch.npu.NPUGraph"), "torch.npu.NPUGraph"
    return None, f"{device.type} has no device graph: the steps ran eagerly"


def blame(exc: BaseException) -> tuple[str, Optional[str]]:
    """(the root cause's type and first line, ``file:line: source`` of its innermost frame outside
    torch and this module): what broke a capture and the line that called it. Wrappers such as
    UpdateRaised are looked through to the exception they were raised from."""
    chain, seen = [], set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    root = chain[-1]
    first = (str(root).strip().splitlines() or [""])[0]
    error = f"{type(root).__name__}: {first}" if first else type(root).__name__
    for e in reversed(chain):  # innermost first
        for fs in reversed(traceback.extract_tb(e.__traceback__)):
            path = os.path.abspath(fs.filename)
            if path.startswith(_TORCH_DIR) or path == _THIS_FILE:
                continue
            return error, f"{fs.filename}:{fs.lineno}: {(fs.line or '').strip()}"
    return error, None


class StepGraph:
    """Runs ``body`` (no arguments; it reads and writes only tensors that live as long as this
    object) once eagerly as warm-up, then captures it and replays it on every later call.

    ``body`` must leave its outputs in persistent tensors (the replay rewrites them in place).
    On a device without graphs, or with ``enabled=False``, every call runs ``body`` eagerly.
    A capture that raises sets :attr:`status` to ``failed``; that call and every later one then
    run eagerly (the failed capture ran nothing: the step is redone eagerly).
    """

    def __init__(self, device: torch.device, body: Callable[[], None], enabled: bool = True, why_not: str = ""):
        self.body = body
        self.api, note = graph_api(device) if enabled else (None, why_not or "eager: graph capture disabled")
        self.graph = None
        self.calls = 0
        if self.api is None:
            self.status = GraphStatus("eager", note)
        else:
            self.status = GraphStatus("pending", f"{note}: captured after one warm-up step")
        self._stream = None

    def __call__(self) -> None:
        self.calls += 1
        if self.api is None or self.status.failed:
            self.body()
            return
        if self.graph is not None:
            self.graph.replay()
            return
        if self.calls == 1:  # warm-up on a side stream, as torch's graph docs ask
            self._stream = self.api.new_stream()
            self._stream.wait_stream(self.api.current_stream())
            with self.api.stream(self._stream):
                self.body()
            self.api.current_stream().wait_stream(self._stream)
            return
        graph = self.api.new_graph()
        try:
            with self.api.capture(graph, self._stream):
                self.body()
        except Exception as exc:  # noqa: BLE001 -- any failure of capture is the finding
            error, where = blame(exc)
            self.status = GraphStatus("failed", f"{self.api.name} capture failed; the run went on eagerly",
                                      error, where)
            self.body()
            return
        self.graph = graph
        self.status = GraphStatus("captured", f"{self.api.name}: the decode step was captured at call 2 "
                                              "and replayed after")
        graph.replay()
