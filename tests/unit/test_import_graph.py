"""The packages import one way: no module reaches, directly or through others, back to itself.

The graph is read from the source with `ast`, so it sees every import a module makes: at the
top, inside functions (a lazy import hides a circle from Python, not from a reader) and under
`TYPE_CHECKING`. Tests are left out: they import whatever they check.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("geotrain", "infra", "training", "policies", "benchmarks")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[module_name(path)] = path
    return found


def resolve(name: str, known: dict[str, Path]) -> str | None:
    """The longest known module that `name` names (`a.b.c` may be attribute c of module a.b)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import sub` imports the submodule when there is one
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        for name in names:
            target = resolve(name, known)
            # a package's own submodule importing the package's __init__ is how Python loads
            # it, not a dependency the code chose; everything else counts
            if target and target != module and not module.startswith(target + "."):
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {module: imports_of(module, path, known) for module, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_cycle_finder_finds_a_planted_circle_and_nothing_in_a_chain():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_relative_and_lazy_imports_are_seen(tmp_path):
    known = {
        "pkg": tmp_path / "__init__.py",
        "pkg.a": tmp_path / "a.py",
        "pkg.b": tmp_path / "b.py",
    }
    (tmp_path / "a.py").write_text("def f():\n    from . import b\n")
    assert imports_of("pkg.a", known["pkg.a"], known) == {"pkg.b"}


def test_no_import_circles_outside_tests():
    found = cycles(graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_training_never_imports_infra_pulumi_or_the_cli():
    edges = graph()
    bad = {
        (module, target)
        for module, targets in edges.items()
        if module.startswith("training")
        for target in targets
        if target.split(".")[0] in {"infra", "geotrain", "policies", "benchmarks"}
    }
    assert not bad, sorted(bad)
