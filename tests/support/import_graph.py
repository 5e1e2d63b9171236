"""Reading a project's imports with `ast`, for the tests that check which module imports which
(tests/test_import_cycles.py; the launcher contract's reading, tests/test_launcher_contract.py, is the same
resolution less `if TYPE_CHECKING:`).

Every import statement counts: at module level, inside a function or a class, under `try:`, and under
`if TYPE_CHECKING:` (each `Import` says where it stands). Each is resolved to the project files it makes
Python run, the way the import system does:

- `import a.b.c` and `from a.b.c import X` (X no submodule) import the module a/b/c (its .py file or its
  package's __init__.py); `from a.b import c`, where a/b/c.py or a/b/c/ exists, imports that submodule,
  and `from a.b import name`, where name is something a/b/__init__.py defines, imports a/b/__init__.py.
- Relative imports (`from . import x`, `from ..y import z`) are resolved against the importing
  module's package first, then read the same way.
- Importing a module runs the __init__.py of each package above it first, so those count too, except
  the packages above the importing module itself: they have always started before it runs (importing
  pretrain.config.schema from pretrain/config/loading.py imports schema.py alone; from
  launcher/cli.py it imports pretrain/config/__init__.py and schema.py). A statement that names such a
  package itself still imports its __init__.py (`from pretrain.config import Config` in loading.py).
- Names outside the given packages (the standard library, torch) are not followed; an import by a
  computed name (`importlib.import_module(name)`) is not read.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

MODULE_LEVEL, IN_FUNCTION, TYPE_CHECKING_ONLY = "module level", "in a function", "under TYPE_CHECKING"
STATEMENT_PARTS = (ast.stmt, ast.excepthandler, ast.match_case)  # what can hold an import statement (no expression can)


@dataclass(frozen=True)
class Import:
    """One project module an import statement makes Python run: where the statement is, and what it imports."""

    line: int
    where: str  # MODULE_LEVEL, IN_FUNCTION or TYPE_CHECKING_ONLY (the last wins when both hold)
    module: str  # the dotted name of the module it imports


def source_file(root: Path, module: str) -> Path | None:
    """The file a module's code lives in under root (a package's __init__.py), or None where the
    dotted name is no module there (a class, a function, another project's module, a folder without __init__)."""
    path = root.joinpath(*module.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def module_name(root: Path, path: Path) -> str:
    """The dotted name of the module a file under root holds (a package's __init__.py: the package)."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Every module of these top-level folders under root (their .py files), by dotted name."""
    files = (path for package in packages for path in (root / package).rglob("*.py"))
    return {module_name(root, path): path for path in sorted(files) if "__pycache__" not in path.parts}


def with_packages(name: str) -> list[str]:
    """A module and the packages above it, outermost first: importing it imports them first."""
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _statements(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Each import statement of a module's tree with where it stands."""
    todo: list[tuple[ast.AST, bool, bool]] = [(tree, False, False)]  # node, inside a function, under TYPE_CHECKING
    while todo:
        node, in_function, type_checking = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, TYPE_CHECKING_ONLY if type_checking else IN_FUNCTION if in_function else MODULE_LEVEL
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += [(child, in_function, True) for child in node.body]
            todo += [(child, in_function, type_checking) for child in node.orelse]
            continue
        inner = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        todo += [(child, inner, type_checking) for child in ast.iter_child_nodes(node) if isinstance(child, STATEMENT_PARTS)]


def named_modules(root: Path, module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The dotted names one import statement of `module` names as modules: `import a.b` names a.b;
    `from a import b` names a.b where it is a submodule under root, else a (b is an attribute of a's
    __init__); relative names are resolved against the module's package."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module if is_package else module.rpartition(".")[0]
        above = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        base = f"{above}.{base}" if base else above
    submodules = [f"{base}.{alias.name}" for alias in node.names if source_file(root, f"{base}.{alias.name}")]
    attributes = len(submodules) < len(node.names)  # `*` or a name that is no submodule
    return submodules + ([base] if attributes else [])


def imports(root: Path, module: str, packages: Iterable[str]) -> list[Import]:
    """Every module of these packages that `module`'s imports make Python run, one entry per
    statement and module: the module each names, and the packages above it that have not started
    before `module` runs (those above `module` itself have). A package above `module` that a
    statement names itself (`from pkg import name` in pkg/sub.py, name no submodule) counts."""
    path = source_file(root, module)
    assert path is not None, module
    own = set(with_packages(module))
    tops = set(packages)
    found: list[Import] = []
    for node, where in _statements(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        for name in named_modules(root, module, path.name == "__init__.py", node):
            if name.split(".")[0] not in tops:
                continue
            above = with_packages(name)[:-1]
            for imported in [*(package for package in above if package not in own), name]:
                if imported != module and source_file(root, imported):
                    found.append(Import(node.lineno, where, imported))
    return found


def import_graph(root: Path, packages: Iterable[str]) -> dict[str, dict[str, Import]]:
    """Each module of the packages, with the modules it imports and the first statement that does."""
    packages = tuple(packages)
    graph: dict[str, dict[str, Import]] = {}
    for module in package_modules(root, packages):
        edges: dict[str, Import] = {}
        for found in sorted(imports(root, module, packages), key=lambda found: found.line):
            edges.setdefault(found.module, found)
        graph[module] = edges
    return graph


def tangles(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or not (strongly connected
    components of more than one module), each sorted, largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]  # iterative Tarjan: no recursion limit to meet
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return sorted(groups, key=lambda group: (-len(group), group))


def cycles(graph: dict[str, dict[str, Import]], group: list[str]) -> list[list[str]]:
    """Cycles through one tangle that together use every import between its modules: for each
    import not yet in a named cycle, the shortest way back from what it imports to where it
    stands. Each cycle starts and ends at the same module."""
    members = set(group)
    edges = [(a, b) for a in group for b in sorted(graph[a]) if b in members]
    covered: set[tuple[str, str]] = set()
    found: list[list[str]] = []
    for first, second in edges:
        if (first, second) in covered:
            continue
        came_from: dict[str, str] = {second: second}
        todo = deque([second])
        while first not in came_from:
            node = todo.popleft()
            for child in sorted(graph[node]):
                if child in members and child not in came_from:
                    came_from[child] = node
                    todo.append(child)
        path = [first]
        while path[-1] != second:
            path.append(came_from[path[-1]])
        cycle = [first, *reversed(path)]
        covered.update(zip(cycle, cycle[1:], strict=False))
        found.append(cycle)
    return found
