"""The host-sync detector (drift.syncs): controls, the built-in updates, plug-ins, the runner hook.

Plugged-in implementations join the update tests through ``DRIFT_UPDATES`` (comma-separated
specs, ``path/to/file.py:Class.method`` or ``module:qualname``); like ``sglang-0.5.23`` they
must be sync-free with tracking on and off.

Every control is a one-line function, so the line a sync must be reported at is its
``co_firstlineno``; the lines in drift/flows/copy_commit/updates.py are found by searching its source.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import types

import numpy as np
import pytest
import torch

# torch's fake-tensor classes (private) come through drift.compat, with fallbacks where a torch lacks
# one: FakeTensorDeviceMismatchError is RuntimeError there (torch raised that before pytorch#185412).
from drift.compat import (DataDependentOutputException, DynamicOutputShapeException, FakeTensorDeviceMismatchError,
                          FakeTensorMode)
from drift.flows.copy_commit import updates as parts
from drift.sim import kernels
from drift.config import preset
from drift.plug.loader import load_update
from drift.sim.shim import kernels_in_use, sgl_kernels
from drift.sim.stream import InputStream
from drift.syncs.detector import (DETECTOR_CUDA, DETECTOR_DISPATCH, DETECTOR_NPU, SyncDetector, VirtualDeviceError,
                                  VirtualTensor, _armed, _is_internal, detect_syncs, display_path, host_data,
                                  to_virtual)
from drift.syncs.scan import representative_steps, scan_update, step_indices, sync_check, virtual_pool
from drift.runspec import resolve

HERE = os.path.abspath(__file__)
FIXTURE = os.path.join(os.path.dirname(os.path.dirname(HERE)), "fixtures", "syncs_plugin_fixture.py")
CI = preset("ci-small")
CI_NO_TRACK = CI.replace(track_interval=0)
STEPS = 4  # two tracking and two non-tracking steps (representative_steps alternates)
PLUGINS = [s.strip() for s in os.environ.get("DRIFT_UPDATES", "").split(",") if s.strip()]
CLEAN_UPDATES = ["sglang-0.5.23", f"{FIXTURE}:DeviceSideBackend.update_mamba_state_after_mtp_verify", *PLUGINS]


# Debug logging off, as in a serving engine: an f-string still formats its tensor (before the call),
# a lazy "%s" argument is never formatted.
LOG = logging.getLogger("drift.tests.syncs")
LOG.setLevel(logging.INFO)


def _inputs():
    """t float32 [4], m bool [4] (2 set), i int64 0-dim (2), idx int64 [4] (sum 6): CPU tensors."""
    return (torch.arange(4, dtype=torch.float32), torch.tensor([True, False, True, False]),
            torch.tensor(2, dtype=torch.int64), torch.tensor([3, 1, 0, 2], dtype=torch.int64))


# ------------------------------------------------------------------ controls
# One line each on purpose (flake8: E704/E302 accepted here): the reported line must be the def line.
def c_item(t, m, i, idx): return t.sum().item()
def c_bool(t, m, i, idx): return bool(t.sum() > 0)
def c_if(t, m, i, idx): return 1 if t.sum() else 0
def c_float(t, m, i, idx): return float(t.sum())
def c_int(t, m, i, idx): return int(t.sum())
def c_mask_read(t, m, i, idx): return t[m]
def c_mask_write(t, m, i, idx): t[m] = t[:2] * 2
def c_nonzero(t, m, i, idx): return torch.nonzero(m)
def c_where_1arg(t, m, i, idx): return torch.where(m)
def c_masked_select(t, m, i, idx): return torch.masked_select(t, m)
def c_unique(t, m, i, idx): return torch.unique(idx)
def c_equal(t, m, i, idx): return torch.equal(t, t)
def c_allclose(t, m, i, idx): return torch.allclose(t, t)
def c_repeat_interleave(t, m, i, idx): return torch.repeat_interleave(t, idx)
def c_tolist(t, m, i, idx): return t.tolist()
def c_cpu(t, m, i, idx): return t.cpu()
def c_numpy(t, m, i, idx): return t.numpy()
def c_index_0dim(t, m, i, idx): return t[i]
def c_narrow_tensor(t, m, i, idx): return t.narrow(0, 0, i)
def c_to_cpu(t, m, i, idx): return t.to("cpu")
def c_np_asarray(t, m, i, idx): return np.asarray(t)
def c_tensor_from_host(t, m, i, idx): return torch.tensor([1.0, 2.0], device=t.device)
def c_host_to_device(t, m, i, idx): return torch.ones(4).to(t.device)
def c_host_operand(t, m, i, idx): return t + torch.ones(4)
def c_log_fstring(t, m, i, idx): return LOG.debug(f"{t}")
def c_log_fstring_0dim(t, m, i, idx): return LOG.debug(f"accepted {i}")
def c_log_str(t, m, i, idx): return LOG.debug("t = " + str(t))
def c_log_repr(t, m, i, idx): return LOG.debug(repr(t))
def c_log_format(t, m, i, idx): return LOG.debug(format(t))

def n_numel(t, m, i, idx): return t.numel()
def n_shape(t, m, i, idx): return t.shape[0]
def n_where_3arg(t, m, i, idx): return torch.where(m, t, -t)
def n_masked_fill(t, m, i, idx): return t.masked_fill(m, 1.0)
def n_index_select(t, m, i, idx): return t.index_select(0, idx)
def n_index_copy(t, m, i, idx): return t.clone().index_copy_(0, idx, t * 2)
def n_nonzero_static(t, m, i, idx): return torch.nonzero_static(m, size=4)
def n_repeat_interleave_sized(t, m, i, idx): return torch.repeat_interleave(t, idx, output_size=6)
def n_cpu_scalar_operand(t, m, i, idx): return t + torch.tensor(1.0)
def n_factory_on_device(t, m, i, idx): return torch.arange(4, device=t.device, dtype=torch.float32) + t
def n_log_fstring_metadata(t, m, i, idx): return LOG.debug(f"{t.shape} {t.dtype} {t.device} {t.dim()}")
def n_log_lazy(t, m, i, idx): return LOG.debug("%s", t)  # the level is off: never formatted

# What torch's FakeTensorMode on a non-CPU device does with a control (an independent oracle):
DD = "data-dependent"  # refuses it: DataDependentOutputException / DynamicOutputShapeException
RUNS = "runs"  # runs it: a copy or a fixed-shape op, no data needed to know the output
HOST_READ = "host read"  # .numpy() / __array__ of a fake tensor fail before any dispatch
MISMATCH = "device mismatch"  # a non-0-dim host operand next to a device tensor

# (control, aten op(s) or Python call it must be reported as, the fake-tensor oracle's verdict)
POSITIVE = [
    (c_item, {"aten._local_scalar_dense"}, DD),
    (c_bool, {"aten._local_scalar_dense", "aten.is_nonzero"}, DD),
    (c_if, {"aten._local_scalar_dense", "aten.is_nonzero"}, DD),
    (c_float, {"aten._local_scalar_dense"}, DD),
    (c_int, {"aten._local_scalar_dense"}, DD),
    (c_mask_read, {"aten.index.Tensor"}, DD),
    (c_mask_write, {"aten.index_put_", "aten._index_put_impl_"}, RUNS),  # fake index_put_ has a meta kernel
    (c_nonzero, {"aten.nonzero"}, DD),
    (c_where_1arg, {"aten.nonzero"}, DD),
    (c_masked_select, {"aten.masked_select"}, DD),
    (c_unique, {"aten._unique2", "aten._unique"}, DD),
    (c_equal, {"aten.equal"}, DD),
    (c_allclose, {"aten.allclose", "aten._local_scalar_dense"}, DD),
    (c_repeat_interleave, {"aten.repeat_interleave.Tensor"}, DD),
    (c_tolist, {"Tensor.tolist"}, DD),
    (c_cpu, {"aten._to_copy"}, RUNS),
    (c_numpy, {"Tensor.numpy"}, HOST_READ),
    (c_index_0dim, {"aten._local_scalar_dense"}, DD),
    (c_narrow_tensor, {"aten._local_scalar_dense"}, DD),
    (c_to_cpu, {"aten._to_copy"}, RUNS),
    (c_np_asarray, {"Tensor.__array__"}, HOST_READ),
    (c_tensor_from_host, {"torch.tensor"}, RUNS),
    (c_host_to_device, {"aten._to_copy"}, RUNS),
    (c_host_operand, {"aten.add.Tensor"}, MISMATCH),
    # Formatting prints the values (torch/_tensor_str.py copies them to the host); a fake tensor's repr
    # prints none, so the oracle runs these.
    (c_log_fstring, {"Tensor.__format__"}, RUNS),
    (c_log_fstring_0dim, {"Tensor.__format__"}, RUNS),
    (c_log_str, {"Tensor.__repr__"}, RUNS),
    (c_log_repr, {"Tensor.__repr__"}, RUNS),
    (c_log_format, {"Tensor.__format__"}, RUNS),
]
NEGATIVE = [n_numel, n_shape, n_where_3arg, n_masked_fill, n_index_select, n_index_copy, n_nonzero_static,
            n_repeat_interleave_sized, n_cpu_scalar_operand, n_factory_on_device, n_log_fstring_metadata,
            n_log_lazy]
# answered from the tensor's metadata (a lazy log argument is never formatted): nothing is dispatched
METADATA_ONLY = {n_numel, n_shape, n_log_fstring_metadata, n_log_lazy}


def _same(a, b) -> bool:
    """Equal results, virtual or host: tensors by value (NaN-free here), else by ==."""
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, VirtualTensor):
        a = host_data(a)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return type(a) is type(b) and a == b


def _run_control(fn):
    """(result on the virtual device, result on the host, the detector's report)."""
    host = fn(*_inputs())
    det = SyncDetector()
    virt = det.run(fn, *to_virtual(_inputs()))
    return virt, host, det.report


@pytest.mark.parametrize("fn,ops,oracle", POSITIVE, ids=[p[0].__name__[2:] for p in POSITIVE])
def test_positive_control_caught(fn, ops, oracle):
    virt, host, rep = _run_control(fn)
    assert len(rep.events) == 1, rep.format()
    ev = rep.events[0]
    assert ev.op in ops, rep.format()
    assert (ev.file, ev.line, ev.function) == (HERE, fn.__code__.co_firstlineno, fn.__name__), rep.format()
    assert ev.seen_by == (DETECTOR_DISPATCH,)
    # The call ran to its end on real values: the same result as on the host.
    if fn is not c_mask_write:
        assert _same(virt, host), (virt, host)


@pytest.mark.parametrize("fn", NEGATIVE, ids=[f.__name__[2:] for f in NEGATIVE])
def test_negative_control_clean(fn):
    virt, host, rep = _run_control(fn)
    assert rep.events == [], rep.format()
    # Nothing dispatched for metadata reads; the others were watched (ops seen) and ran right.
    assert (rep.ops == 0) == (fn in METADATA_ONLY), rep.ops
    assert _same(virt, host), (virt, host)


@pytest.mark.parametrize("fn,oracle", [(p[0], p[2]) for p in POSITIVE] + [(n, RUNS) for n in NEGATIVE],
                         ids=[p[0].__name__ for p in POSITIVE] + [n.__name__ for n in NEGATIVE])
def test_controls_agree_with_fake_tensor_oracle(fn, oracle):
    """torch's own FakeTensorMode on a non-CPU device refuses the data-dependent controls and runs
    every negative one (an independent check that the controls are what they claim to be)."""
    if FakeTensorMode is None:
        pytest.fail("this torch has no torch._subclasses.fake_tensor.FakeTensorMode: the oracle cannot run")
    raises = {DD: pytest.raises((DataDependentOutputException, DynamicOutputShapeException)),
              HOST_READ: pytest.raises(RuntimeError, match="subclass"),
              # "... at least two devices, meta and cpu" (FakeTensorDeviceMismatchError) or, before it
              # existed, "... found two different devices meta, cpu" (a RuntimeError)
              MISMATCH: pytest.raises(FakeTensorDeviceMismatchError, match=r"two (different )?devices"),
              RUNS: contextlib.nullcontext()}[oracle]
    if fn is c_tolist:
        # torch 2.4's FakeTensor.tolist asks the (absent) shape env for unbacked symbols and fails
        # with an AttributeError instead of DataDependentOutputException (2.6+): the same refusal.
        raises = pytest.raises((DataDependentOutputException, DynamicOutputShapeException, AttributeError),
                               match=r"_local_scalar_dense|create_unbacked_symint")
    with FakeTensorMode():
        args = tuple(torch.empty_like(x, device="meta") for x in _inputs())
        with raises:
            fn(*args)


def test_context_manager_reports_line_and_detectors():
    t = to_virtual(torch.arange(4, dtype=torch.float32))
    with SyncDetector() as det:
        total = t.sum().item(); line = inspect.currentframe().f_lineno  # noqa: E702
    assert total == 6.0
    [ev] = det.report.events
    assert (ev.file, ev.line, ev.op, ev.api) == (HERE, line, "aten._local_scalar_dense", "Tensor.item")
    assert ev.where.endswith(f"test_syncs.py:{line}") and "t.sum().item()" in ev.code
    rep = det.report
    assert rep.detectors[0] == DETECTOR_DISPATCH
    assert (DETECTOR_CUDA in rep.detectors) == torch.cuda.is_available()
    assert rep.devices == ["virtual"] and rep.calls == 1


def test_formatting_a_virtual_tensor_reads_no_data_but_is_a_host_read():
    """repr / f-strings of a virtual tensor print metadata only; under a detector each is one host
    read (as on the device, where torch's repr copies the values); outside one nothing is recorded."""
    t = to_virtual(torch.arange(4))
    assert "VirtualTensor(shape=(4,)" in repr(t) and f"{t}" == repr(t)
    for fn, api in ((repr, "Tensor.__repr__"), (str, "Tensor.__repr__"), (format, "Tensor.__format__")):
        [ev] = detect_syncs(fn, t).events
        assert ev.api == api and "formatting a tensor" in ev.reason
    assert f"{to_virtual(torch.tensor(0.5)):.2f}" == "0.50"  # a 0-dim tensor formats its value, as torch's


def test_plain_meta_tensor_is_a_clear_error():
    """A meta tensor made outside the detector has no data the virtual device could use."""
    t, z = to_virtual(torch.arange(4, dtype=torch.float32)), torch.zeros(4, device="meta")
    with pytest.raises(VirtualDeviceError, match="factory op"):
        SyncDetector().run(lambda: t + z)


def test_frame_filter_skips_torch_and_detector_only():
    import drift.syncs.detector as syncs_mod
    assert _is_internal(torch.__file__) and _is_internal(syncs_mod.__file__)
    assert not _is_internal(kernels.__file__) and not _is_internal(parts.__file__)


def test_sync_inside_portable_kernel_is_located_there():
    """drift's kernels are code under test: a sync inside one is reported at its line in kernels.py,
    with the caller in the stack (here: host index tensors force a host-to-device copy)."""
    pool = virtual_pool(CI)
    host_slots = torch.tensor([1, 2], dtype=torch.int64)
    steps = to_virtual(torch.tensor([0, 2], dtype=torch.int64))
    det = SyncDetector()
    det.run(kernels.conv_state_rollback, pool.conv, host_slots, steps, CI.num_draft_tokens)
    assert det.report.events, "a host index tensor must show as a sync"
    ev = det.report.events[0]
    assert os.path.samefile(ev.file, kernels.__file__) and ev.function == "conv_state_rollback"
    assert ev.op == "aten._to_copy" and "host-to-device" in ev.reason


def _pool_pair():
    """The same pool twice: on the host and on the virtual device (independent storage)."""
    from drift.sim.pool import StatePool
    return StatePool(CI, torch.device("cpu")), virtual_pool(CI)


@pytest.mark.parametrize("via", ["kernels", "shim"])
def test_portable_kernels_and_shim_are_clean(via):
    mod = kernels if via == "kernels" else sgl_kernels()
    if via == "shim":
        assert kernels_in_use() == "drift portable (shim)", "sgl_kernel_npu is installed: the shim is not in use"
        assert mod.move_intermediate_cache is kernels.move_intermediate_cache
    host, virt = _pool_pair()
    g = torch.Generator().manual_seed(0)
    for p in (host, virt):  # same scratch and conv contents in both
        data = torch.randn(p.intermediate_ssm.shape, generator=torch.Generator().manual_seed(1))
        (host_data(p.intermediate_ssm) if p is virt else p.intermediate_ssm).copy_(data)
        cdata = torch.randn(p.conv.shape, generator=torch.Generator().manual_seed(2))
        (host_data(p.conv) if p is virt else p.conv).copy_(cdata)
    N, D = CI.num_rows, CI.num_draft_tokens
    last = torch.randint(0, D, (N,), generator=g)
    last[-CI.num_padded:] = -1  # padded rows
    src = torch.arange(N)

    def both(p, wrap):
        mod.move_intermediate_cache(p.temporal, p.intermediate_ssm, p.row_slots, wrap(src), wrap(last))
        mod.conv_state_rollback(p.conv, p.row_slots, wrap(last), D)

    both(host, lambda x: x)
    det = SyncDetector()
    det.run(both, virt, to_virtual)
    assert det.report.events == [], det.report.format()
    assert det.report.ops > 0
    for a, b in zip(host.bits(), (host_data(virt.temporal), host_data(virt.conv))):
        assert torch.equal(a, b.view(a.dtype)), "the virtual device must compute exactly what the host does"


def test_debug_mode_armed_and_restored():
    """_armed sets "error" on each backend for the block and restores the previous mode, also on error."""
    calls = []
    fake = types.SimpleNamespace(get_sync_debug_mode=lambda: 0, set_sync_debug_mode=calls.append)
    with pytest.raises(KeyError):
        with _armed([("fake", fake)]):
            assert calls == ["error"]
            raise KeyError("boom")
    assert calls == ["error", 0]


@pytest.mark.parametrize("backend,name", [("NPU", DETECTOR_NPU), ("CUDA", DETECTOR_CUDA)])
def test_debug_mode_error_recorded_and_stops_call(monkeypatch, backend, name):
    """What the detector does when a debug mode raises inside an op (the message is the one
    c10 / torch_npu raise): the op's event is confirmed by that detector and the call stops."""
    import drift.syncs.detector as syncs_mod
    real = syncs_mod._execute

    def raising(func, args, kwargs):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError(f"called a synchronizing {backend} operation")
        return real(func, args, kwargs)

    monkeypatch.setattr(syncs_mod, "_execute", raising)
    t = to_virtual(torch.arange(4, dtype=torch.float32))
    after = []
    det = SyncDetector()
    assert det.run(lambda: (t.sum().item(), after.append(1))) is None
    assert after == [] and len(det.report.stopped) == 1
    [ev] = det.report.events
    assert ev.op == "aten._local_scalar_dense" and ev.seen_by == (DETECTOR_DISPATCH, name)
    # Raised by the copy inside a host read (.tolist() of a real device tensor): the read's own
    # event is confirmed, not counted twice.
    det3 = SyncDetector()
    det3.run(t.tolist)
    det3._reads.append(0)
    det3._flag_debug("aten._to_copy", backend, det3._reads[-1])
    assert [e.seen_by for e in det3.report.events] == [(DETECTOR_DISPATCH, name)]
    # Raised outside any dispatched op (e.g. inside a C++ extension): still one event, located.
    det2 = SyncDetector()

    def ext(): raise RuntimeError(f"called a synchronizing {backend} operation")  # noqa: E704
    assert det2.run(ext) is None
    [ev2] = det2.report.events
    assert ev2.seen_by == (name,) and ev2.line == ext.__code__.co_firstlineno


# ------------------------------------------------------------------ the update under test
def _lines(fn, needle: str) -> set[int]:
    """Line numbers (in fn's file) of fn's code lines containing ``needle`` (docstring and
    comment-only lines skipped)."""
    src, start = inspect.getsourcelines(fn)
    return {start + k for k, line in enumerate(src)
            if needle in line.split("#")[0] and not line.strip().startswith(('"""', "#"))}


ITEM_LINE = _lines(parts.commit_unless_all_step0, ".item()")
# sglang-31659 and sglang-32130 share the boolean-mask tracking part of their SGLang versions.
GUARDED_MASK = SYNC_FREE_MASK = _lines(parts.track_boolean_mask, "[mask]")


def _in_updates(ev) -> bool:
    return os.path.samefile(ev.file, parts.__file__)


def test_step_indices_match_the_stream():
    """step_indices runs the stream on a one-channel config: same indices as the real one."""
    last, trk = step_indices(CI, 40)
    chunk = InputStream(CI, torch.device("cpu")).chunk(40)
    assert torch.equal(last, chunk.last_steps) and torch.equal(trk, chunk.track_steps)


@pytest.mark.parametrize("cfg", [CI, CI_NO_TRACK], ids=["tracking-on", "tracking-off"])
def test_representative_steps_cover_both_kinds_and_padding(cfg):
    steps, last, trk = representative_steps(cfg, STEPS)
    assert len(steps) == STEPS and steps == sorted(steps)
    assert cfg.num_padded >= 1 and bool((last[:, -cfg.num_padded:] == -1).all())
    tracking = (trk >= 0).any(1)
    if cfg.track_interval:
        assert 0 < int(tracking.sum()) < STEPS
    else:
        assert not bool(tracking.any())


@pytest.mark.parametrize("cfg", [CI, CI_NO_TRACK], ids=["tracking-on", "tracking-off"])
def test_guarded_flagged_every_step_at_its_item_line(cfg):
    assert len(ITEM_LINE) == 1 and GUARDED_MASK
    scan = scan_update(resolve(cfg, "sglang-31659"), steps=STEPS)
    for step, events in scan.per_step().items():
        assert events, f"step {step}: no sync reported"
        first = events[0]
        assert _in_updates(first) and first.line in ITEM_LINE and first.op == "aten._local_scalar_dense", \
            f"step {step}: first sync is {first.describe()}"
        assert first.api == "Tensor.item" and first.function == "commit_unless_all_step0"
        assert sum(e.line in ITEM_LINE for e in events) == 1
        rest = events[1:]
        assert all(_in_updates(e) and e.line in GUARDED_MASK for e in rest), [e.describe() for e in rest]
        # With tracking on the #32130-era mask path syncs too; with it off only the .item() remains.
        assert bool(rest) == (cfg.track_interval > 0)


@pytest.mark.parametrize("cfg", [CI, CI_NO_TRACK], ids=["tracking-on", "tracking-off"])
def test_sync_free_flagged_only_on_its_tracking_path(cfg):
    assert SYNC_FREE_MASK
    scan = scan_update(resolve(cfg, "sglang-32130"), steps=STEPS)
    for step, events in scan.per_step().items():
        if cfg.track_interval == 0:
            assert events == [], [e.describe() for e in events]
            continue
        # The mask is built on every step with tracking on, tracked rows or not.
        assert events, f"step {step}: the boolean-mask tracking path was not flagged"
        assert all(_in_updates(e) and e.line in SYNC_FREE_MASK and e.op == "aten.index.Tensor" for e in events), \
            [e.describe() for e in events]
    assert scan.track_on == (cfg.track_interval > 0) and scan.padded_rows == CI.num_padded


@pytest.mark.parametrize("cfg", [CI, CI_NO_TRACK], ids=["tracking-on", "tracking-off"])
@pytest.mark.parametrize("spec", CLEAN_UPDATES, ids=lambda s: s.rsplit(os.sep, 1)[-1])
def test_sync_free_contract_holds(spec, cfg):
    scan = scan_update(resolve(cfg, spec), steps=STEPS)
    assert scan.events == [], scan.passes["virtual"].format()
    assert scan.passes["virtual"].ops > 0  # the update really ran under the detector


@pytest.mark.parametrize("track", [16, 0], ids=["tracking-on", "tracking-off"])
def test_vllm_builtin_with_its_align_copy_is_sync_free(track):
    """vllm-0.33.0 under its flow; with tracking on, the tracking steps run the align copy."""
    cfg = CI.replace(flow="vllm", track_interval=track)
    scan = scan_update(resolve(cfg, "vllm-0.33.0"), steps=STEPS)
    assert scan.events == [], scan.passes["virtual"].format()
    assert scan.passes["virtual"].ops > 0 and any(scan.tracking) == (track > 0)


# ------------------------------------------------------------------ runner hook
def test_sync_check_fails_guarded_naming_the_item_line():
    res = sync_check(resolve(CI, "sglang-31659"), steps=STEPS)
    line = next(iter(ITEM_LINE))
    assert res.key == "host_syncs" and not res.passed and res.limit == 0.0
    assert "aten._local_scalar_dense" in res.where and res.where.split(" at ")[1].startswith(
        f"{display_path(parts.__file__)}:{line} ")
    # one .item() per step plus at least one mask sync per step (tracking is on)
    by_pass = res.extra["syncs_by_pass"]
    assert by_pass["virtual"] >= 2 * STEPS and res.worst == max(by_pass.values()) / STEPS
    assert DETECTOR_DISPATCH in res.detail and DETECTOR_DISPATCH in res.extra["detectors"]
    assert (DETECTOR_CUDA in res.extra["detectors"]) == torch.cuda.is_available()
    json.dumps(res.to_dict())  # the runner writes it into report.json


@pytest.mark.parametrize("cfg,passed", [(CI, False), (CI_NO_TRACK, True)], ids=["tracking-on", "tracking-off"])
def test_sync_check_sync_free(cfg, passed):
    res = sync_check(resolve(cfg, "sglang-32130"), steps=STEPS)
    assert res.passed is passed and (res.worst == 0.0) is passed
    if not passed:
        assert f"copy_commit/updates.py:{min(SYNC_FREE_MASK)}" in res.where


def _commit_logging_metadata(b) -> None:
    LOG.debug(f"committing {b.last.shape} {b.last.dtype} on {b.last.device}")  # metadata only: no read
    parts.commit_all(b)


def test_a_formatted_tensor_in_the_update_fails_the_sync_check_and_its_metadata_passes():
    """logger.debug(f"{last_steps}") in the commit (the log_fstring mutant) is a host read every step,
    reported at its line; the same log line of the tensor's shape and dtype is clean."""
    from drift.plug import mutants

    res = sync_check(resolve(CI, "mutant:log_fstring"), steps=STEPS)
    [line] = _lines(mutants.commit_logging_steps, "_LOG.debug(f")
    assert not res.passed and res.worst == 1.0, res.detail  # one read per step
    assert res.where.startswith("Tensor.__format__ at ") and f"plug/mutants.py:{line} " in res.where, res.where
    clean = parts.SGLANG_0523.but(commit=_commit_logging_metadata).build("logs-metadata", "logs shape and dtype")
    ok = sync_check(resolve(CI, clean), steps=STEPS)
    assert ok.passed and ok.worst == 0.0, ok.where


def test_sync_check_device_select_passes():
    res = sync_check(resolve(CI, "sglang-0.5.23"), steps=STEPS)
    assert res.passed and res.worst == 0.0 and res.where == "" and "no host-device sync" in res.detail
    assert "2 tracking" in res.detail and "1 padded row" in res.detail


def test_sync_check_plugin_from_file_spec():
    spec = f"{FIXTURE}:ListBackend.update_mamba_state_after_mtp_verify"
    res = sync_check(resolve(CI, spec), steps=STEPS)
    [line] = _lines(load_update(spec).fn, ".tolist()")
    assert not res.passed and res.where.startswith("Tensor.tolist at ") and res.where.endswith(
        f"syncs_plugin_fixture.py:{line} in update_mamba_state_after_mtp_verify")
    assert res.worst == 1.0  # one host read per step, tracking on


def test_the_scan_catches_syncs_without_importing_dynamo():
    """The scan never imports torch._dynamo (torch wraps a dispatch mode's ``__torch_dispatch__``
    in ``_disable_dynamo`` unless the mode opts out, and the wrap's first call imports it: a third
    of the scan's time), and still catches the guarded update's ``.item()``. Control: a plain
    dispatch mode, in the same fresh interpreter, does import it."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from drift.config import preset\n"
            "from drift.runspec import resolve\n"
            "from drift.syncs.scan import sync_check\n"
            "cfg = preset('ci-small')\n"
            "found = [sync_check(resolve(cfg, u), 2).passed for u in ('sglang-31659', 'sglang-0.5.23')]\n"
            "print(found, 'torch._dynamo' in sys.modules)\n"
            "from torch.utils._python_dispatch import TorchDispatchMode\n"
            "class Plain(TorchDispatchMode):\n"
            "    def __torch_dispatch__(self, func, types, args=(), kwargs=None):\n"
            "        return func(*args, **(kwargs or {}))\n"
            "with Plain():\n"
            "    torch.ones(2) + 1\n"
            "print(hasattr(TorchDispatchMode, '_should_skip_dynamo'), 'torch._dynamo' in sys.modules)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    scan, control = run.stdout.split("\n")[-3:-1]
    assert scan == "[False, True] False", run.stdout  # the guarded update fails, the released one passes
    assert control in ("True True", "False False"), run.stdout  # a torch without the hook never wraps


@pytest.mark.cuda
def test_cuda_debug_mode_confirms_guarded_item():
    scan = scan_update(resolve(CI.replace(device="cuda"), "sglang-31659"), steps=STEPS)
    rep = scan.passes["cuda"]
    assert DETECTOR_CUDA in rep.detectors and len(rep.stopped) == STEPS
    for step, events in scan.per_step("cuda").items():
        assert events and events[0].line in ITEM_LINE and DETECTOR_CUDA in events[0].seen_by, step
    assert scan_update(resolve(CI.replace(device="cuda"), "sglang-0.5.23"), steps=STEPS).events == []
