"""No import cycles in the project's code.

A cycle makes the order of imports matter (a half-initialised module, an ``ImportError`` that
depends on which module a process imports first) and means neither module can be read or
tested without the other. The graph is built statically: every ``.py`` under the packages in
:data:`PACKAGES` is a node, every import of another of them an edge — at module level or inside
a function alike (an import moved into a function hides a cycle; it does not break it). Imports
under ``if TYPE_CHECKING:`` never run, so they are left out of the first test; the second counts
them too, because a type-only import still says one module reads the other's insides, and holds
the few such cycles still accepted in an explicit list that must stay exact.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import networkx as nx
import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("coordinator", "worker", "gateway", "kvledger", "kernels", "shared", "bench")

#: Cycles accepted for now, each the exact set of modules of one strongly connected component of
#: the graph *with* ``TYPE_CHECKING`` imports. A new cycle fails the test, and so does an entry
#: here that no longer is one (remove it when it is broken, or correct it when it changes).
ACCEPTED_TYPE_ONLY_CYCLES: list[frozenset[str]] = []


def modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name → file, for every ``.py`` under ``packages`` (a package is its ``__init__``)."""
    out: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
           (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, with_type_checking: bool) -> Iterable[ast.Import | ast.ImportFrom]:
    """Every import statement anywhere in ``tree`` (functions and classes included), without the
    bodies of ``if TYPE_CHECKING:`` unless asked for (their ``else`` branches run, so they count)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not with_type_checking:
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), with_type_checking)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _imports(node, with_type_checking)


def import_graph(root: Path, packages: Iterable[str] = PACKAGES, *,
                 with_type_checking: bool = False) -> nx.DiGraph:
    """Modules and their imports of one another; each edge keeps the ``file:line`` of its first import.

    ``import a.b.c`` and ``from a.b import c`` (``c`` a module) point at ``a.b.c``; ``from a.b
    import name`` (a name defined in ``a/b/__init__.py``) at ``a.b``. Importing a submodule runs its
    packages' ``__init__`` too, but that is not counted as an edge: a package whose ``__init__``
    re-exports its modules would otherwise form a cycle with each of them.
    """
    mods = modules(root, packages)

    def resolve(name: str) -> str | None:   # the longest prefix that is one of ours
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = nx.DiGraph()
    for mod, path in mods.items():
        graph.add_node(mod)
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), filename=str(path)), with_type_checking):
            if isinstance(node, ast.Import):
                targets = [resolve(a.name) for a in node.names]
            else:
                base = node.module or ""
                if node.level:   # relative: from the package, one level up per extra dot
                    up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [resolve(f"{base}.{a.name}") for a in node.names]
            for target in targets:
                if target and target != mod and not graph.has_edge(mod, target):
                    graph.add_edge(mod, target, at=f"{path.relative_to(root)}:{node.lineno}")
    return graph


def cycles(graph: nx.DiGraph) -> set[frozenset[str]]:
    """The strongly connected components of more than one module: each is one or more cycles."""
    return {frozenset(c) for c in nx.strongly_connected_components(graph) if len(c) > 1}


def describe(graph: nx.DiGraph, cycle: frozenset[str]) -> str:
    """One cycle with the imports that close it, where they are."""
    edges = sorted((a, b, graph.edges[a, b]["at"]) for a, b in graph.subgraph(cycle).edges)
    return "{" + ", ".join(sorted(cycle)) + "}\n" + "\n".join(f"    {a} -> {b}  ({at})" for a, b, at in edges)


def test_no_module_imports_itself_back() -> None:
    graph = import_graph(REPO)
    found = cycles(graph)
    assert not found, "import cycles (break them: move the shared piece into a module of its own, or pass it " \
                      "as a parameter):\n" + "\n".join(describe(graph, c) for c in sorted(found, key=sorted))


def test_type_only_cycles_are_exactly_the_accepted_ones() -> None:
    graph = import_graph(REPO, with_type_checking=True)
    found = cycles(graph)
    accepted = set(ACCEPTED_TYPE_ONLY_CYCLES)
    new, gone = found - accepted, accepted - found
    assert not new and not gone, (
        "".join(f"new cycle (counting `if TYPE_CHECKING:` imports):\n{describe(graph, c)}\n" for c in sorted(new, key=sorted))
        + "".join(f"accepted cycle no longer found (remove or correct it in ACCEPTED_TYPE_ONLY_CYCLES): "
                  f"{sorted(c)}\n" for c in sorted(gone, key=sorted)))


# ---- the checker itself --------------------------------------------------------------------------


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checker_counts_imports_inside_functions_and_names_the_cycle(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import f\n",
        "pkg/b.py": "def f():\n    from pkg import a\n",
        "pkg/c.py": "import pkg.a\n",
    })
    graph = import_graph(root, ("pkg",))
    assert cycles(graph) == {frozenset({"pkg.a", "pkg.b"})}
    assert describe(graph, frozenset({"pkg.a", "pkg.b"})) == \
        "{pkg.a, pkg.b}\n    pkg.a -> pkg.b  (pkg/a.py:1)\n    pkg.b -> pkg.a  (pkg/b.py:2)"


def test_the_checker_leaves_type_checking_imports_out_unless_asked(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "import pkg.b\n",
        "pkg/b.py": "import typing\nif typing.TYPE_CHECKING:\n    from pkg.a import A\nelse:\n    import pkg.c\n",
        "pkg/c.py": "",
    })
    assert cycles(import_graph(root, ("pkg",))) == set()
    assert set(import_graph(root, ("pkg",)).successors("pkg.b")) == {"pkg.c"}   # the else branch runs
    assert cycles(import_graph(root, ("pkg",), with_type_checking=True)) == {frozenset({"pkg.a", "pkg.b"})}


@pytest.mark.parametrize(("source", "target"), [
    ("from . import sibling\n", "pkg.sub.sibling"),           # relative, a module
    ("from .sibling import name\n", "pkg.sub.sibling"),       # relative, a name in a module
    ("from .. import top\n", "pkg.top"),                      # two dots: the parent package
    ("from pkg.sub import name_in_init\n", "pkg.sub"),        # a name the package's __init__ defines
    ("import pkg.sub.sibling as s\n", "pkg.sub.sibling"),
])
def test_the_checker_resolves_each_import_to_the_module_it_loads(tmp_path: Path, source: str, target: str) -> None:
    root = _tree(tmp_path, {"pkg/__init__.py": "", "pkg/top.py": "", "pkg/sub/__init__.py": "name_in_init = 1\n",
                            "pkg/sub/sibling.py": "name = 1\n", "pkg/sub/m.py": source})
    assert set(import_graph(root, ("pkg",)).successors("pkg.sub.m")) == {target}
