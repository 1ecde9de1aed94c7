"""The project's own battery of bad inputs and misbehaving code under test, run through both front
ends: ``drift run`` and ``pytest --pyargs drift`` with the plugin's options. Every case ``drift run``
refuses (exit 2) is a usage error under pytest (exit 4) before a test measures anything; a measured
regression (code under test that fails, ``sys.exit`` and ``os._exit`` included) is exit 1 in both; neither prints a
traceback, and both print drift's one line. A passing run is the control (0 and 0).

Each front end runs every case in one interpreter of its own (tests/front_end_driver.py, which
removes what a case's extension registered before the next), the two side by side: 16 decode steps
of ci-small per run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from drift.devices import npu_available

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
METHOD = f"{FIXTURES / 'ascend_backend.py'}:AscendHybridLinearAttnBackend.update_mamba_state_after_mtp_verify"
STEPS = 16  # the machinery, not the horizon: every case below shows at step 0
# One xdist work unit: the battery is a module fixture, which each worker would otherwise compute
# for itself (two batteries, each two interpreters, racing for the same cores).
pytestmark = pytest.mark.xdist_group("front-ends")

CODE = '''
import sys
from drift.check.checks import Check
from drift.check.registry import CHECKS, CheckSpec
from drift.plug.loader import KERNELS, REORDERED_FP32, KernelEntry
from drift.sim import kernels


def exits(self, last, track, steps):
    sys.exit(0)


def interrupts(self, last, track, steps):
    raise KeyboardInterrupt


def os_exits(self, last, track, steps):
    __import__("os")._exit(0)


def kernel_os_exits(args):
    __import__("os")._exit(0)


def two_args(args, other):
    return None


def wrong_op(mix_qkv, recurrent_state, beta):
    return None


def fails_consume():
    class Divides(Check):
        key = "divides"
        measures = ("state",)

        def consume(self, chunk):
            1 / 0
    CHECKS.add(CheckSpec("divides", "divides", 66, "a toy that raises", "consumer", build=lambda ctx: Divides(0.1)))


def fails_build():
    CHECKS.add(CheckSpec("keyerror", "keyerror", 67, "a toy that raises", "consumer", build=lambda ctx: {}["no"]))


def factory_none():
    KERNELS.register("none-kernel", KernelEntry("none-kernel", "yields no kernel", lambda arg: None, REORDERED_FP32))


def factory_no_args():
    KERNELS.register("noargs-kernel", KernelEntry("noargs-kernel", "yields a kernel of no arguments",
                                                  lambda arg: (lambda: None), REORDERED_FP32))


def builds_none():
    CHECKS.add(CheckSpec("nothing", "nothing", 68, "a toy whose build returns None", "consumer", build=lambda ctx: None))


def unknown_kind():
    from drift.flows.registry import FLOWS, Flow
    FLOWS.register("weird", Flow("weird", "a flow of no kind", "none", (), "no-such-kind"))


def factory_raises():
    def make(arg):
        raise RuntimeError("factory bug")
    KERNELS.register("boom-kernel", KernelEntry("boom-kernel", "raises", make, REORDERED_FP32))


if __import__("os").environ.get("TOY_EXTENSION"):
    globals()[__import__("os").environ["TOY_EXTENSION"]]()
'''
EXIT_AT_IMPORT = "import sys\nsys.exit(0)\n"
OS_EXIT_AT_IMPORT = "import os\nos._exit(0)\n"


def cases(tmp: Path) -> list[tuple]:
    """(id, drift run options, extension env, drift's exit code, words both must print)."""
    code, bye = tmp / "code.py", tmp / "bye.py"
    ext = {"DRIFT_EXTENSIONS": str(code)}
    out = [
        ("passes", [], {}, 0, ""),
        ("regression", ["--update", "mutant:step_plus1"], {}, 1, ""),
        ("regression-of-another-flow", ["--update", "mutant:vllm_start_plus1"], {}, 1, ""),  # runs in its own flow
        ("update-exits", ["--update", f"{code}:exits"], {}, 1, "SystemExit(0) (which would end the process"),
        ("update-interrupts", ["--update", f"{code}:interrupts"], {}, 1, "KeyboardInterrupt() (which would end"),
        # os._exit ends the interpreter at once with the code's status: 0 read as a pass (it was)
        ("update-os-exits", ["--update", f"{code}:os_exits"], {}, 1, "os._exit(0) (which would end the process"),
        ("kernel-os-exits", ["--kernel", f"{code}:kernel_os_exits"], {}, 1, "os._exit(0) (which would end"),
        ("update-not-found", ["--update", "nosuch.py:f"], {}, 2, "file 'nosuch.py' not found"),
        ("sequential-update-not-found", ["--mode", "sequential", "--update", "nosuch.py:f"], {}, 2, "not found"),
        ("harness-lacks", ["--flow", "vllm", "--update", METHOD], {}, 2, "read self.linear_attn_backend"),
        ("kernel-signature", ["--kernel", f"{code}:two_args"], {}, 2, "cannot take one VerifyArgs"),
        ("npu-op-signature", ["--kernel", f"npu-op:{code}:wrong_op"], {}, 2, "cannot take SGLang's call"),
        ("vllm-ascend-op-signature", ["--flow", "vllm", "--kernel", f"vllm-ascend-op:{code}:wrong_op"], {}, 2,
         "cannot take vllm-ascend's call"),
        ("bad-option", ["--rounding", "nosuch"], {}, 2, "nosuch"),
        ("ragged-drafts", ["--flow", "npu-accepted", "--drafts", "ragged"], {}, 2,
         "that flow verifies every row's D draft tokens"),
        ("factory-none", ["--kernel", "none-kernel"], {**ext, "TOY_EXTENSION": "factory_none"}, 2,
         "its factory returned NoneType"),
        ("factory-raises", ["--kernel", "boom-kernel"], {**ext, "TOY_EXTENSION": "factory_raises"}, 2,
         f"raised RuntimeError('factory bug') at {code}:"),
        ("factory-wrong-signature", ["--kernel", "noargs-kernel"], {**ext, "TOY_EXTENSION": "factory_no_args"}, 2,
         "its factory returned a kernel that has signature"),
        ("check-build-raises", [], {**ext, "TOY_EXTENSION": "fails_build"}, 2, "in its build"),
        # the extension's line, not the registry's that refused it (it crashed the parser once)
        ("flow-of-unknown-kind", [], {**ext, "TOY_EXTENSION": "unknown_kind"}, 2, f"is not a registered flow kind; "
         f"kinds: copy-commit, in-place, kernel-commit\") at {code}:"),
        ("check-builds-none", [], {**ext, "TOY_EXTENSION": "builds_none"}, 2, "its build returned NoneType"),
        ("check-consume-raises", [], {**ext, "TOY_EXTENSION": "fails_consume"}, 2, "in its consume"),
        ("extension-exits", [], {"DRIFT_EXTENSIONS": str(bye)}, 2, f"raised SystemExit(0) at {bye}:2"),
        ("extension-os-exits", [], {"DRIFT_EXTENSIONS": str(tmp / "os_bye.py")}, 2,
         f"raised os._exit(0) at {tmp / 'os_bye.py'}:2"),
        ("extension-is-a-directory", [], {"DRIFT_EXTENSIONS": str(tmp)}, 2, "is a directory, not a file"),
    ]
    if not npu_available():
        out.append(("device-absent", ["--device", "npu"], {}, 2, "device='npu' requested"))
    return out


def _driver(front: str, jobs: list, tmp: Path) -> list[tuple[int, str]]:
    """Every job ``(argv, env)`` of ``front`` through tests/front_end_driver.py, in one interpreter."""
    cases_file = tmp / f"{front}.json"
    cases_file.write_text(json.dumps(jobs))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "DRIFT_EXTENSIONS", "TOY_EXTENSION")}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "front_end_driver.py"), front, str(cases_file)],
                       cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    found = re.findall(r"@@case (\d+)@@\n(.*?)\n@@code (-?\d+)@@", p.stdout, re.S)
    assert len(found) == len(jobs), p.stdout[-3000:] + p.stderr[-3000:]
    return [(int(code), text) for _, text, code in found]


def _as_pytest(options: list[str]) -> list[str]:
    """drift run's options as the plugin spells them (--update X -> --drift-update X)."""
    return [f"--drift-{o[2:]}" if o.startswith("--") else o for o in options]


@pytest.fixture(scope="module")
def battery(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("front_ends")
    (tmp / "code.py").write_text(CODE)
    (tmp / "bye.py").write_text(EXIT_AT_IMPORT)
    (tmp / "os_bye.py").write_text(OS_EXIT_AT_IMPORT)
    todo = cases(tmp)
    run = [(["run", "--preset", "ci-small", "--steps", str(STEPS), "--quiet", *opts], env) for _, opts, env, _, _ in todo]
    gate = [(["-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist", "--pyargs", "drift", "--drift-steps", str(STEPS),
              *_as_pytest(opts)], env) for _, opts, env, _, _ in todo]
    with ThreadPoolExecutor(max_workers=2) as pool:  # the two front ends side by side
        runs, gates = pool.map(lambda front, jobs: _driver(front, jobs, tmp), ("drift", "pytest"), (run, gate))
    return {case[0]: (case, runs[i], gates[i]) for i, case in enumerate(todo)}


PYTEST_CODE = {0: 0, 1: 1, 2: 4}  # drift's exit code -> pytest's for the same case


@pytest.mark.parametrize("case", [c[0] for c in cases(Path("/x"))])
def test_both_front_ends_agree(battery, case):
    (_, opts, _, code, words), (run_code, run_out), (py_code, py_out) = battery[case]
    assert run_code == code, run_out
    assert py_code == PYTEST_CODE[code], py_out
    for out in (run_out, py_out):
        assert "Traceback" not in out and "INTERNALERROR" not in out, out
        assert words in out, out
    if code == 2:  # one line from drift; the same line under pytest, before any test ran
        lines = [ln for ln in run_out.splitlines() if ln.strip()]
        usage = case == "bad-option"  # argparse's usage lines come first
        assert (len(lines) == 1 or usage) and "error:" in lines[-1], run_out
        assert "drift: error:" in py_out or "error: argument --drift-" in py_out, py_out
        assert " passed" not in py_out and " failed" not in py_out or case == "check-consume-raises", py_out
    if code == 1:
        assert "FAIL" in run_out and " failed" in py_out, (run_out, py_out)
