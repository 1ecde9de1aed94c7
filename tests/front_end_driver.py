"""Runs many cases of one front end in one interpreter, for tests/test_front_ends.py: ``python
front_end_driver.py drift|pytest CASES.json`` where CASES.json is a list of ``[argv, env]``. Each case
runs with ``env`` set (``DRIFT_EXTENSIONS`` ...), through ``drift.cli.main(argv)`` or
``pytest.main(argv)``; what an extension registered is removed afterwards, so no case sees another's.
Prints each case's output between markers, then its exit code."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys


def registries() -> list:
    from drift.check.registry import CHECKS
    from drift.flows.registry import FLOW_KINDS, FLOWS, UPDATES
    from drift.plug.loader import KERNELS
    from drift.plug.mutants import MUTANTS
    return [CHECKS, KERNELS, FLOWS, FLOW_KINDS, UPDATES, MUTANTS]


def run(front: str, argv: list[str]) -> int:
    if front == "drift":
        from drift.cli import main
        return main(argv)
    import pytest
    return int(pytest.main(argv))


def main() -> None:
    front, path = sys.argv[1], sys.argv[2]
    from drift.plug import extensions
    saved = [dict(r._entries) for r in registries()]
    for i, (argv, env) in enumerate(json.loads(open(path).read())):
        os.environ.update(env)
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                code = run(front, argv)
            except SystemExit as exc:  # argparse's usage error in drift's parser
                code = exc.code
        for key in env:
            del os.environ[key]
        for reg, entries in zip(registries(), saved):
            reg._entries.clear()
            reg._entries.update(entries)
        extensions._loaded.clear()
        for name in [m for m in sys.modules if m.startswith("drift_plugin_")]:  # file specs, imported afresh
            del sys.modules[name]
        print(f"@@case {i}@@\n{out.getvalue()}\n@@code {code}@@", flush=True)


if __name__ == "__main__":
    main()
