"""The launcher's half of the launcher-trainer contract (docs/design.md, "What the launcher imports
from `pretrain`"): the `pretrain` modules the launcher may import are the ones that page names,
found by reading the imports rather than by trusting a list, and importing them loads no torch,
so the launcher starts in a fraction of a second and `--help` or a refusal never waits for torch."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from support.processes import ROOT, launcher_env

DESIGN = ROOT / "docs" / "design.md"
PROJECT_PACKAGES = ("launcher", "pretrain")
# What the replaced probes checked importing a launcher-side module never loads (torch above all:
# seconds to import), and what only a worker, a tokenizer's training, a download or a plot needs.
HEAVY = ("torch", "tqdm", "tokenizers", "tiktoken", "pyarrow", "huggingface_hub", "wandb", "matplotlib")


def source_file(module: str) -> Path | None:
    """The file a project module's code lives in, or None where the name is no module (a class, a function)."""
    path = ROOT.joinpath(*module.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def run_time_nodes(tree: ast.AST) -> list[ast.AST]:
    """The nodes of a module's tree, less the bodies of `if TYPE_CHECKING:`, which never run."""
    nodes, todo = [], [tree]
    while todo:
        node = todo.pop()
        nodes.append(node)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
        else:
            todo += ast.iter_child_nodes(node)
    return nodes


def imported_names(module: str) -> set[str]:
    """Every module name the source of `module` imports, at the top or inside a function, with the
    names `from package import name` brings (a submodule when it is one; source_file tells)."""
    path = source_file(module)
    assert path is not None, module
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in run_time_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                above = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{above}.{base}" if base else above
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def with_packages(name: str) -> list[str]:
    """A module and the packages above it, which importing it imports first."""
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def launcher_modules() -> list[str]:
    """Every module of the launcher package and its folders; __main__ only starts it (its imports are
    read like the rest)."""
    paths = (ROOT / "launcher").rglob("*.py")
    return sorted(".".join(path.relative_to(ROOT).with_suffix("").parts) for path in paths if path.stem != "__init__")


def has_code(module: str) -> bool:
    """Whether a module holds more than its docstring: a folder's __init__.py that only says what
    the folder owns is imported with each of its modules but brings nothing, so the design does not list it."""
    path = source_file(module)
    assert path is not None, module
    body = ast.parse(path.read_text(encoding="utf-8")).body
    return any(not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)) for node in body)


def launcher_reach() -> tuple[set[str], set[str]]:
    """The pretrain modules the launcher imports itself, and all it imports, through pretrain's own imports too."""
    direct = {
        name
        for module in launcher_modules()
        for imported in imported_names(module)
        for name in with_packages(imported)
        if name.startswith("pretrain.") and source_file(name) and has_code(name)
    }
    seen: set[str] = set()
    todo = [*launcher_modules(), "launcher"]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for imported in imported_names(module):
            todo += [name for name in with_packages(imported) if name.startswith(PROJECT_PACKAGES) and source_file(name)]
    return direct, {name for name in seen if name.startswith("pretrain.") and has_code(name)}


def torch_importing_functions(modules: set[str]) -> set[str]:
    """`module.function` for each function of these modules that imports torch when called
    (a module-level import, even under TYPE_CHECKING, is not one: the import test sees those)."""
    found: set[str] = set()
    for module in modules:
        path = source_file(module)
        assert path is not None, module
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.Import):
                        imported = [alias.name for alias in inner.names]
                    elif isinstance(inner, ast.ImportFrom) and not inner.level:
                        imported = [inner.module or ""]
                    else:
                        continue
                    if any(name.split(".")[0] == "torch" for name in imported):
                        found.add(f"{module}.{node.name}")
    return found


def design_block(marker: str) -> str:
    """The text docs/design.md holds between <!-- marker --> and <!-- /marker -->."""
    found = re.search(rf"<!-- {marker} -->\n(.*?)<!-- /{marker} -->", DESIGN.read_text(encoding="utf-8"), re.S)
    assert found, f"docs/design.md has no <!-- {marker} --> block"
    return found.group(1)


def documented_imports() -> tuple[set[str], set[str]]:
    """The pretrain modules the design names as the launcher's own (one line each, first), and all it names."""
    block = design_block("launcher-imports")
    return set(re.findall(r"^- `(pretrain[\w.]*)`", block, re.M)), set(re.findall(r"`(pretrain[\w.]*)`", block))


def test_the_pretrain_modules_the_launcher_imports_are_the_ones_the_design_names():
    direct, reached = launcher_reach()
    named_direct, named = documented_imports()

    assert direct == named_direct, f"imported, not named: {direct - named_direct}; named, not imported: {named_direct - direct}"
    assert reached == named, f"reached, not named: {reached - named}; named, not reached: {named - reached}"


def test_importing_the_launcher_and_every_pretrain_module_it_reaches_loads_no_torch():
    _, reached = launcher_reach()
    modules = launcher_modules() + sorted(reached)  # __main__ too: it starts the command only when run
    code = f"import sys\nfor m in {modules!r}: __import__(m)\nprint(','.join(m for m in {HEAVY!r} if m in sys.modules) or 'none')"

    result = subprocess.run([sys.executable, "-c", code], env=launcher_env(), capture_output=True, text=True, timeout=60)

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "none"


def test_the_functions_in_the_launchers_reach_that_import_torch_are_the_ones_the_design_names():
    _, reached = launcher_reach()
    names = "".join(re.findall(r"^- (.*?): ", design_block("launcher-torch"), re.M))  # each line's names, before its colon
    named = set(re.findall(r"`([\w.]+)`", names))

    assert torch_importing_functions(reached | set(launcher_modules())) == named
