"""The import graph runs one way: server -> engine -> memory, with no circles.

Every ``.py`` file under ``server/``, ``engine/``, ``memory/`` and ``bench/`` is
parsed with ``ast``; imports at module level and inside functions both count
(a lazy import is still a dependency), relative imports are resolved, and
``import a.b`` depends on module ``a.b`` (a package's ``__init__`` is a module
of its own). ``bench`` is the top floor and may import anything.
"""

from __future__ import annotations

import ast
from collections.abc import Container, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bench", "server", "engine", "memory")
# Higher floors may import lower ones, never the other way round.
FLOOR = {"memory": 0, "engine": 1, "server": 2, "bench": 3}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def repo_modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[module_name(path)] = path
    return found


def imported_modules(path: Path, module: str, modules: Container[str]) -> Iterator[str]:
    """Every module ``path`` imports, relative imports made absolute.

    ``import a.b`` and ``from a.b import name`` depend on ``a.b``; ``from a import b``
    depends on ``a.b`` when that is a module, else on ``a``.
    """
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield sub if sub in modules else base


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the repo it imports (third-party ones are left out)."""
    modules = repo_modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for target in imported_modules(path, name, modules):
            if target in modules and target != name:
                graph[name].add(target)
    return graph


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for source, targets in graph.items():
        for target in targets:
            if FLOOR[target.split(".")[0]] > FLOOR[source.split(".")[0]]:
                bad.append(f"{source} -> {target}")
    return sorted(bad)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_every_layer() -> None:
    graph = import_graph()
    assert {name.split(".")[0] for name in graph} == set(PACKAGES)
    # A known edge, so that an empty graph cannot pass the checks below.
    assert "engine" in {t.split(".")[0] for t in graph["server.app"]}


def test_no_layer_imports_upward() -> None:
    bad = upward_imports(import_graph())
    assert not bad, "imports running up the layers (server -> engine -> memory):\n" + "\n".join(bad)


def test_no_import_cycles() -> None:
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import circles, each as the imports among its modules:\n" + "\n".join(
        ", ".join(f"{m} -> {t}" for m in c for t in sorted(graph[m]) if t in c) for c in found
    )


# Each API family's router; only the app that mounts them may import more than one.
API_FAMILIES = {"openai": ("server.openai_routes", "server.models_routes"),
                "responses": ("server.responses",), "anthropic": ("server.anthropic",),
                "admin": ("server.admin_routes",)}


def family_of(module: str) -> str | None:
    for family, prefixes in API_FAMILIES.items():
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return family
    return None


def test_no_api_family_imports_another() -> None:
    graph = import_graph()
    bad = sorted(f"{source} -> {target}" for source, targets in graph.items() for target in targets
                 if family_of(source) and family_of(target) and family_of(source) != family_of(target))
    assert not bad, "API families importing each other (share through server.state etc.):\n" + "\n".join(bad)
    users = {s for s, targets in graph.items() if s.startswith("server.") and not family_of(s)
             and len({family_of(t) for t in targets} - {None}) > 1}
    assert users <= {"server.app"}, f"modules other than the app that import several families: {users}"
