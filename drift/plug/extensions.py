"""Extensions: modules that register entries (a verify kernel, a check, a profile, a layout, a store
dtype, a flow) in drift's registries from outside the package (docs/extending.md).

``DRIFT_EXTENSIONS`` names them, comma-separated, each ``package.module`` or ``path/to/file.py``;
``drift`` and the pytest plugin import them before they read any option, so the new entries are
choices of ``--profile``, ``--kernel`` ... and rows of the report like the built-in ones.
"""

from __future__ import annotations

import importlib
import os

from ..errors import ENDS_PROCESS, LoadError, ended_by_code, raised_at
from .specs import module_from_file

ENV = "DRIFT_EXTENSIONS"
_loaded: dict[str, object] = {}


def load_extensions(value: "str | None" = None) -> list[str]:
    """Import every extension ``value`` (default: ``$DRIFT_EXTENSIONS``) names, once each; LoadError
    naming the variable, the entry and what its import raised."""
    text = os.environ.get(ENV, "") if value is None else value
    names = [n.strip() for n in text.split(",") if n.strip()]
    for name in names:
        if name in _loaded:
            continue
        if name.endswith(".py") or "/" in name or os.sep in name:
            _loaded[name] = module_from_file(name, f"{ENV}={text}", "extension")
            continue
        try:
            _loaded[name] = importlib.import_module(name)
        except (Exception, *ENDS_PROCESS) as exc:  # sys.exit(main()) at import: refused, not an exit
            if not isinstance(exc, Exception) and not ended_by_code(exc):
                raise  # a signal
            raise LoadError(f"{ENV}={text}: importing extension {name!r} raised {exc!r} at {raised_at(exc)}; fix "
                            f"the module or remove it from {ENV}") from exc
    return names
