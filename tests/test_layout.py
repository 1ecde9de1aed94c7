"""The package's shape: imports run strictly downward through the stages, with no cycle (every
import counts, the ones inside functions too), and nothing in drift/ cites a document outside
the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import drift

ROOT = Path(drift.__file__).resolve().parent
# The stages, bottom up; a module may import only from its own stage or the ones below it.
STAGES = [
    {"drift.version", "drift._help", "drift.errors", "drift.registry", "drift.dtypes", "drift.layouts", "drift.compat",
     "drift.config", "drift.devices", "drift.fileio", "drift.openmp",
     "drift.checkpoint"},
    {"drift.sim"},
    {"drift.runspec"},
    {"drift.capture"},
    {"drift.plug"},
    {"drift.simulate"},
    {"drift.check"},
    {"drift.syncs"},
    {"drift.runner"},
    {"drift.jobs"},
    {"drift.options", "drift.cli", "drift.pytest_plugin", "drift.test_gate", "drift", "drift.__main__"},
]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """drift modules ``name`` imports, anywhere in the file (relative imports resolved)."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base if is_pkg else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # ``from pkg import submodule`` imports the submodule; ``from mod import name`` the module.
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        out |= {t for t in targets if t in known and t != name}
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports(name, path, known) for name, path in mods.items()}


def find_cycle(g: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``g`` as a list of modules (empty when there is none)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str]:
        state[n] = 1
        stack.append(n)
        for m in sorted(g.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return []

    for n in sorted(g):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return []


def stage(name: str) -> int:
    for i, group in enumerate(STAGES):
        if any(name == g or (g != "drift" and name.startswith(g + ".")) for g in group):
            return i
    raise AssertionError(f"{name} belongs to no stage; add it to STAGES")


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    """Negative control: the check above can fail."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_imports_run_strictly_downward():
    g = graph()
    up = [(a, b) for a, deps in g.items() for b in deps if stage(b) > stage(a)]
    assert not up, "imports that run back up the stages: " + ", ".join(f"{a} -> {b}" for a, b in up)


def test_the_graph_is_read():
    """Control: the walk sees the imports it must (relative, package-level and in functions)."""
    g = graph()
    assert "drift.sim.kernels" in g["drift.sim.twin"]
    assert {"drift.plug.parts", "drift.plug.updates"} <= g["drift.plug.mutants"]
    assert "drift.jobs.report" in g["drift.cli"]  # imported inside a function


# Citations of the team's outside summary page, which users never have (docs/semantics.md is the
# project's own account). Assembled from parts so that this file does not cite it either.
OUTSIDE = "REFERENCE"
OUTSIDE_CITATIONS = [f"{OUTSIDE} section", f"{OUTSIDE}.md", "../" + "shared", "shared/" + OUTSIDE]


@pytest.mark.parametrize("needle", OUTSIDE_CITATIONS)
def test_nothing_cites_a_document_outside_the_repository(needle):
    hits = [f"{p.relative_to(ROOT.parent)}:{i}" for p in ROOT.rglob("*") if p.suffix in (".py", ".c")
            for i, line in enumerate(p.read_text().splitlines(), 1) if needle in line]
    assert not hits, f"{needle!r} cited at " + ", ".join(hits) + " (cite docs/semantics.md instead)"


def test_pyproject_lists_every_package():
    """pyproject.toml lists drift's packages (golden/ ships as drift._golden): a package missing
    from the list would be missing from the wheel."""
    text = (ROOT.parent / "pyproject.toml").read_text()
    try:
        import tomllib  # Python >= 3.11
        listed = set(tomllib.loads(text)["tool"]["setuptools"]["packages"])
    except ModuleNotFoundError:  # Python 3.10: the one list, read by hand
        block = re.search(r"^packages = \[(.*?)\]", text, re.S | re.M).group(1)
        listed = set(re.findall(r'"([^"]+)"', block))
    found = {module_name(p.parent / "__init__.py") for p in ROOT.rglob("__init__.py")}
    assert found <= listed, f"not in pyproject.toml's packages: {sorted(found - listed)}"
    assert "drift._golden" in listed
