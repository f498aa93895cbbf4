"""The package's shape: no import cycles, no private names imported across modules, short functions.

These hold the layout a newcomer relies on (docs/DESIGN.md): each stage in its own subpackage, each
module importable on its own, and no function too long to read in one sitting.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "eagle3build"
MAX_FUNCTION_LINES = 120


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), filename=str(path))
    return out


def _imports(name: str, tree: ast.Module, modules: dict) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every eagle3build import, at any depth."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:  # relative: resolve against this module's package
                pkg = name.split(".") if name in modules and _is_package(name) else name.split(".")[:-1]
                base = ".".join(pkg[: len(pkg) - node.level + 1] + [node.module])
            if not base.startswith("eagle3build"):
                continue
            names = [a.name for a in node.names]
            submodules = [f"{base}.{n}" for n in names if f"{base}.{n}" in modules]
            for sub in submodules:
                found.append((sub, [], node.lineno))
            rest = [n for n in names if f"{base}.{n}" not in modules]
            if rest or not submodules:
                found.append((base, rest, node.lineno))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("eagle3build"):
                    found.append((a.name, [], node.lineno))
    return found


def _is_package(name: str) -> bool:
    return (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()


def _graph(level) -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, tree in modules.items():
        src = level(name)
        for target, _, _ in _imports(name, tree, modules):
            dst = level(target)
            if dst != src:
                graph.setdefault(src, set()).add(dst)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _subpackage(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and _is_package(".".join(parts[:2])) else module


def test_no_import_cycle_between_modules():
    assert _cycle(_graph(lambda m: m)) is None


def test_no_import_cycle_between_subpackages():
    cycle = _cycle(_graph(_subpackage))
    assert cycle is None, f"subpackages import each other: {' -> '.join(cycle)}"


def test_no_private_name_imported_from_another_module():
    modules = _modules()
    offenders = [
        f"{name}:{line} imports {n} from {target}"
        for name, tree in modules.items()
        for target, names, line in _imports(name, tree, modules)
        for n in names
        if n.startswith("_") and not n.startswith("__") and target != name
    ]
    assert offenders == []


def test_no_function_longer_than_a_sitting():
    long = [
        f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for name, tree in _modules().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long == []


def test_the_checks_catch_what_they_claim():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    tree = ast.parse("from eagle3build.shards import _private, public\n")
    assert ("eagle3build.shards", ["_private", "public"], 1) in _imports("eagle3build.x", tree, _modules())
