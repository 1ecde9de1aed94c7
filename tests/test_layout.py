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
     "drift.lifecycles",
     "drift.config", "drift.devices", "drift.fileio", "drift.mkl", "drift.openmp", "drift.process_end",
     "drift.checkpoint"},
    {"drift.sim"},
    {"drift.flows"},
    {"drift.capture"},
    {"drift.plug"},
    {"drift.runspec"},
    {"drift.simulate"},
    {"drift.check"},
    {"drift.syncs"},
    {"drift.runner"},
    {"drift.jobs"},
    {"drift.options", "drift.cli", "drift.pytest_plugin", "drift.gate_ahead", "drift.test_gate", "drift",
     "drift.__main__"},
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
    assert {"drift.flows.copy_commit.updates", "drift.registry"} <= g["drift.plug.mutants"]
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


def _kind_mentions(files, names, packages=True):
    """``(path, line number, name)`` for each line of ``files`` that spells a flow kind's name
    as registered (and, with ``packages``, as its package ``drift/flows/<kind>/`` spells it)."""
    spellings = {s for n in names for s in ((n, n.replace("-", "_")) if packages else (n,))}
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(spellings))) + r")\b")
    return [(p, i, m.group(1)) for p in files
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            for m in [pattern.search(line)] if m]


def test_no_flow_kind_is_named_outside_its_package():
    """A kind is one package plus one registry line: the stages around drift/flows reach kinds
    through the registry and never name one. Exempt: drift/plug, whose updates, mutants and
    engine adapters each target one kind's flow and import from its package by design, and the
    generated --help text, which lists the registry."""
    from drift.flows.registry import FLOW_KINDS
    outside = [p for p in ROOT.rglob("*.py") if p.name != "_help.py"
               and not {"flows", "plug"} & set(p.relative_to(ROOT).parts)]
    assert not _kind_mentions(outside, list(FLOW_KINDS))


def test_no_registered_kind_name_anywhere_outside_the_flows():
    """The issue's grep: a registered kind name (``copy-commit``, ...) appears in no module of
    drift/ outside drift/flows, the plugs included (they import a kind's package, never its name)."""
    from drift.flows.registry import FLOW_KINDS
    outside = [p for p in ROOT.rglob("*.py") if "flows" not in p.relative_to(ROOT).parts]
    assert not _kind_mentions(outside, list(FLOW_KINDS), packages=False)


def test_kind_mention_finder_finds_the_kinds_inside_their_packages():
    """Negative control: the same scan over drift/flows finds every registered kind."""
    from drift.flows.registry import FLOW_KINDS
    found = {name for _, _, name in _kind_mentions(sorted((ROOT / "flows").rglob("*.py")), list(FLOW_KINDS))}
    assert {n.replace("_", "-") for n in found} >= set(FLOW_KINDS)


def _glossary():
    """(term, what-it-is cell) of each row of docs/semantics.md's glossary table."""
    text = (ROOT.parent / "docs" / "semantics.md").read_text(encoding="utf-8")
    body = text[text.index("## Glossary"):]
    rows = [line.split("|")[1:-1] for line in body.splitlines() if line.startswith("| ")]
    return [(cells[0].strip(), cells[1]) for cells in rows[1:] if cells[0].strip() != "drift's name"]


def _spellings(term: str) -> set[str]:
    words = term.split()
    return {"_".join(words).lower(), "".join(w.capitalize() for w in words), "".join(words).lower()}


def _used_in(source: str, term: str) -> bool:
    return any(re.search(rf"\b{re.escape(s)}s?\b", source, re.I if s.islower() else 0) for s in _spellings(term))


def test_each_glossary_term_is_a_name_the_code_uses():
    """One name per idea: every term the glossary defines is spelled in drift's code (snake_case,
    CamelCase or as one word), and every drift/ file a row cites exists."""
    source = "\n".join(p.read_text(encoding="utf-8") for p in ROOT.rglob("*.py") if p.name != "_help.py")
    rows = _glossary()
    assert len(rows) >= 15, "the glossary table was not found"
    assert not [t for t, _ in rows if not _used_in(source, t)]
    cited = {m for _, cell in rows for m in re.findall(r"`(drift/[\w/]+\.py)", cell)}
    assert not [c for c in cited if not (ROOT.parent / c).exists()]


def test_the_glossary_check_finds_a_term_no_code_uses():
    """Negative control: a term no code spells (the retired "start rule") is not found."""
    source = "\n".join(p.read_text(encoding="utf-8") for p in ROOT.rglob("*.py") if p.name != "_help.py")
    assert not _used_in(source, "start rule") and _used_in(source, "verify rule")


def test_every_path_the_docs_cite_exists():
    """README.md and docs/*.md cite drift/ and tests/ files by path; each must exist (a moved module
    leaves no stale pointer)."""
    repo = ROOT.parent
    texts = [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]
    cited = {m for t in texts for m in re.findall(r"\b((?:drift|tests)/[\w/]+\.py)\b", t.read_text(encoding="utf-8"))}
    assert cited, "no cited path found: the pattern is wrong"
    assert sorted(c for c in cited if not (repo / c).exists()) == []


def test_the_test_extra_cannot_replace_torch():
    """issue 32: `[test]` beside an older PyPI torch must keep it. PyPI's torch pins triton (2.4.x:
    3.0.0), so a triton requirement in `test` lets pip swap torch; triton is its own extra
    (docs/torch_range.md), and .ci/run asks for it beside its +cpu torch."""
    import tomllib

    checkout = Path(__file__).resolve().parents[1]
    extras = tomllib.loads((checkout / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {re.split(r"[<>=!;\[ ]", req, maxsplit=1)[0].lower() for req in extras["test"]}
    assert names <= {"pytest", "pytest-xdist"}, names  # neither depends on torch or triton
    assert any(req.startswith("triton") for req in extras["triton"])
    assert '".[test,triton,capture]"' in (checkout / ".ci" / "run").read_text()
