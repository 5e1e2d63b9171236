"""Imports run one way: no module of launcher/, pretrain/ or benchmarks/ imports, directly or through
others, a module that imports it back (issue 43). A newcomer can then tell which of two modules is the
higher one, and a change low down never drags a circle.

What counts as importing (tests/support/import_graph.py reads it with `ast`):
- every import statement: at module level, inside a function, under `if TYPE_CHECKING:`. An import
  hidden in a function still ties the two modules together, so it breaks no cycle;
- `from package import name` imports package/name.py where that is a submodule, and package/__init__.py
  where name is something the __init__ defines; relative imports are resolved to their files;
- importing a module imports the __init__.py of each package above it too, except the packages above
  the importing module itself, which Python has started before that module runs.

So a package's __init__.py may re-export its submodules (pretrain/config/__init__.py imports batch,
loading, schema, ...), and those submodules may import each other by their own names
(`from pretrain.config.schema import ...`, `from . import schema`): no cycle. A cycle is a submodule
importing back through its package's face (`from pretrain.config import Config` inside
pretrain/config/loading.py: __init__ -> loading -> __init__), or a module outside the package that
imports any module of it (so runs its __init__.py first) while that __init__.py, through what it
re-exports, imports the outside module.

The failure names every cycle, as files in import order ("launcher/attempts.py -> launcher/launch.py
-> launcher/attempts.py"); a tangle of many modules is named by as many cycles as it takes to use
each import inside it once, then each of those imports with its line and where it stands.
"""

from __future__ import annotations

import time
from pathlib import Path

from support.processes import ROOT
from support.import_graph import IN_FUNCTION, MODULE_LEVEL, TYPE_CHECKING_ONLY, Import, cycles, import_graph, source_file, tangles

PACKAGES = ("launcher", "pretrain", "benchmarks")


def shown(root: Path, module: str) -> str:
    """A module as its file, relative to root."""
    path = source_file(root, module)
    assert path is not None, module
    return path.relative_to(root).as_posix()


def cycle_report(root: Path, packages: tuple[str, ...]) -> list[str]:
    """One paragraph per group of modules importing each other: its cycles, then the imports in them."""
    graph = import_graph(root, packages)
    paragraphs = []
    for group in tangles(graph):
        lines = [f"{len(group)} modules import each other: {', '.join(shown(root, module) for module in group)}"]
        named = cycles(graph, group)
        lines += ["  " + " -> ".join(shown(root, module) for module in cycle) for cycle in named]
        used = sorted({(a, b) for cycle in named for a, b in zip(cycle, cycle[1:], strict=False)})
        lines.append("  the imports in them:")
        for a, b in used:
            found: Import = graph[a][b]
            lines.append(f"    {shown(root, a)}:{found.line} imports {shown(root, b)} ({found.where})")
        paragraphs.append("\n".join(lines))
    return paragraphs


def cycle_lines(root: Path, packages: tuple[str, ...]) -> list[str]:
    """Just the named cycles, as files in import order."""
    graph = import_graph(root, packages)
    return [" -> ".join(shown(root, module) for module in cycle) for group in tangles(graph) for cycle in cycles(graph, group)]


def test_no_module_of_launcher_pretrain_or_benchmarks_imports_itself_through_others():
    started = time.perf_counter()
    paragraphs = cycle_report(ROOT, PACKAGES)
    seconds = time.perf_counter() - started

    assert not paragraphs, f"{len(paragraphs)} import cycle(s), in {seconds:.1f} s:\n" + "\n".join(paragraphs)


# --- the cycle finder on a tiny package of its own ---------------------------------------


def write(root: Path, files: dict[str, str]) -> Path:
    """A package tree under root: each file's text by its path."""
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def test_a_cycle_is_found_and_named_in_import_order(tmp_path):
    root = write(
        tmp_path,
        {
            "pkg/__init__.py": '"""A package."""\n',
            "pkg/a.py": "from pkg.b import f\n",
            "pkg/b.py": "from pkg.c import g\n\ndef f():\n    pass\n",
            "pkg/c.py": "import pkg.a\n\ndef g():\n    pass\n",
        },
    )

    assert cycle_lines(root, ("pkg",)) == ["pkg/a.py -> pkg/b.py -> pkg/c.py -> pkg/a.py"]


def test_an_import_inside_a_function_closes_a_cycle(tmp_path):
    root = write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low.py": "def late():\n    from pkg.high import run\n    return run\n",
            "pkg/high.py": "from pkg.low import late\n\ndef run():\n    pass\n",
        },
    )

    assert cycle_lines(root, ("pkg",)) == ["pkg/high.py -> pkg/low.py -> pkg/high.py"]
    assert import_graph(root, ("pkg",))["pkg.low"]["pkg.high"] == Import(2, IN_FUNCTION, "pkg.high")


def test_an_import_under_type_checking_closes_a_cycle(tmp_path):
    root = write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/types.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .user import User\n",
            "pkg/user.py": "from . import types\n\nclass User:\n    pass\n",
        },
    )

    assert cycle_lines(root, ("pkg",)) == ["pkg/types.py -> pkg/user.py -> pkg/types.py"]
    assert import_graph(root, ("pkg",))["pkg.types"]["pkg.user"] == Import(4, TYPE_CHECKING_ONLY, "pkg.user")


def test_imports_that_run_one_way_make_no_cycle(tmp_path):
    root = write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/base.py": "import json\n",
            "pkg/middle.py": "from pkg import base\nfrom pkg.base import json\n",
            "pkg/top.py": "from typing import TYPE_CHECKING\nfrom . import middle\n\n"
            "if TYPE_CHECKING:\n    from .base import json\n\ndef run():\n    from pkg.middle import base\n",
        },
    )

    graph = import_graph(root, ("pkg",))

    assert cycle_lines(root, ("pkg",)) == []
    assert set(graph["pkg.top"]) == {"pkg.middle", "pkg.base"}
    assert graph["pkg.middle"]["pkg.base"] == Import(1, MODULE_LEVEL, "pkg.base")


def test_a_package_may_re_export_its_submodules_but_not_be_imported_back_by_them(tmp_path):
    files = {
        "pkg/__init__.py": "",
        "pkg/config/__init__.py": "from pkg.config.schema import Config\nfrom .loading import load\n",
        "pkg/config/schema.py": "class Config:\n    pass\n",
        "pkg/config/loading.py": "from pkg.config.schema import Config\n\ndef load():\n    return Config()\n",
        "pkg/user.py": "from pkg.config import Config\nfrom pkg import config\n",
    }
    root = write(tmp_path, files)

    assert cycle_lines(root, ("pkg",)) == []
    assert set(import_graph(root, ("pkg",))["pkg.user"]) == {"pkg.config"}  # an attribute, then a submodule: the __init__

    write(root, {"pkg/config/loading.py": "def load():\n    from pkg.config import Config\n    return Config()\n"})
    assert cycle_lines(root, ("pkg",)) == ["pkg/config/__init__.py -> pkg/config/loading.py -> pkg/config/__init__.py"]


def test_importing_a_submodule_from_outside_its_package_runs_the_package_init(tmp_path):
    root = write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/data/__init__.py": "from pkg.errors import DataError\n",
            "pkg/data/reader.py": "def read():\n    pass\n",
            "pkg/errors.py": "from pkg.data.reader import read\n\nclass DataError(Exception):\n    pass\n",
        },
    )

    assert cycle_lines(root, ("pkg",)) == ["pkg/data/__init__.py -> pkg/errors.py -> pkg/data/__init__.py"]
