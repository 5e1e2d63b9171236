"""pretrain/data/ in layers (issue 43, item 2): its __init__ lists every module of the folder from
the entries down to the ground, and each module imports only modules listed after it (at module
level, inside a function or under TYPE_CHECKING alike), so following a config's `data` section from
`prepare()` goes down through where files are read, which files a run needs and where they come
from, and never back up."""

from __future__ import annotations

import re

import pretrain.data
from support.import_graph import IN_FUNCTION, Import, import_graph
from support.processes import ROOT

FOLDER = ROOT / "pretrain" / "data"


def listed_order() -> list[str]:
    """The folder's modules in the order its __init__ docstring's list gives them, top to bottom."""
    listing = (pretrain.data.__doc__ or "").split("top to bottom:")[1].split("Outside the folder")[0]
    names = re.findall(r"\b(\w+)\.py\b", listing)
    order: list[str] = []
    for name in names:
        if name not in order and (FOLDER / f"{name}.py").is_file():
            order.append(name)
    return [*order, "__init__"]


def test_the_init_lists_every_module_of_the_folder_once():
    on_disk = sorted(path.stem for path in FOLDER.glob("*.py"))
    assert sorted(listed_order()) == on_disk


def upward_imports(graph: dict[str, dict[str, Import]], order: list[str]) -> list[str]:
    """Each import of one pretrain.data module by another that is not listed below it."""
    rank = {name: place for place, name in enumerate(order)}
    upward = []
    for module, targets in graph.items():
        if not module.startswith("pretrain.data"):
            continue
        source = module.removeprefix("pretrain.data").lstrip(".") or "__init__"
        for target, statement in targets.items():
            if not target.startswith("pretrain.data"):
                continue
            imported = target.removeprefix("pretrain.data").lstrip(".") or "__init__"
            if imported != source and rank[imported] <= rank[source]:
                upward.append(f"{source}.py line {statement.line} ({statement.where}) imports {imported}.py, listed above it")
    return upward


def test_each_module_imports_only_modules_listed_below_it():
    upward = upward_imports(import_graph(ROOT, ["pretrain"]), listed_order())
    assert not upward, "\n".join(upward)


def test_an_import_that_runs_back_up_is_named_with_its_line():
    """The check itself: the real graph, with hub_client.py (where files come from) importing hub.py
    (which files a run needs) inside a function, fails naming that import."""
    graph = import_graph(ROOT, ["pretrain"])
    graph["pretrain.data.hub_client"]["pretrain.data.hub"] = Import(line=7, where=IN_FUNCTION, module="pretrain.data.hub")
    assert upward_imports(graph, listed_order()) == ["hub_client.py line 7 (in a function) imports hub.py, listed above it"]
