"""The import graph of tether's three layers: imports only go down (services, the ground floor; actors above
it; the learner on top), and no cycle of any length, between modules or between folders. Every import
counts: at a module's top, inside a function, or for typing only; importing ``a.b.c`` also imports the
packages ``a.b`` and ``a`` (their ``__init__`` runs first), so those are edges too."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"services": 0, "actors": 1, "learner": 2}


def module_files(root: Path, packages) -> dict[str, Path]:
    """Module name -> file, for every .py file under ``root/<package>`` (a package is its ``__init__``)."""
    files = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            files[".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")] = path
    return files


def import_graph(root: Path, packages) -> nx.DiGraph:
    """An edge a -> b for each module b of the tree that module a imports, and for b's parent packages."""
    files = module_files(root, packages)
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for name, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from a.b import c`: c is the module a.b.c where there is one, else a name of a.b
                targets |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                            for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        for target in targets:
            parts = target.split(".")
            for k in range(1, len(parts) + 1):
                imported = ".".join(parts[:k])
                if imported in files and imported != name and not name.startswith(imported + "."):
                    graph.add_edge(name, imported)  # a module's own packages are already running
    return graph


def folder_graph(graph: nx.DiGraph, root: Path, packages) -> nx.DiGraph:
    """The module graph collapsed to folders: ``services/tasks/base.py`` is in folder ``services.tasks``."""
    files = module_files(root, packages)
    folder = {name: ".".join(path.parent.relative_to(root).parts) for name, path in files.items()}
    folders = nx.DiGraph()
    folders.add_edges_from((folder[a], folder[b]) for a, b in graph.edges if folder[a] != folder[b])
    return folders


def cycles(graph: nx.DiGraph) -> list[list[str]]:
    """Each set of nodes that reach one another (a cycle of any length), sorted; none in an acyclic graph."""
    return sorted(sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1)


def test_imports_only_go_down_and_no_modules_or_folders_import_in_a_cycle():
    graph = import_graph(ROOT, LAYERS)
    upward = sorted((a, b) for a, b in graph.edges if LAYERS[b.split(".")[0]] > LAYERS[a.split(".")[0]])
    assert upward == [], upward
    assert cycles(graph) == [], cycles(graph)
    folders = folder_graph(graph, ROOT, LAYERS)
    assert cycles(folders) == [], [[(a, b) for a, b in graph.edges if a.startswith(tuple(c)) and
                                    b.startswith(tuple(c))] for c in cycles(folders)]


def test_the_check_finds_a_cycle_of_three_modules_through_a_function_a_typing_import_and_a_package(tmp_path):
    """a -> b inside a function, b -> c for typing only, c -> a through the package of a: three modules, no
    two of which import each other; and a folder cycle of two subpackages whose modules form no cycle."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.a import f\n")
    (pkg / "sub" / "a.py").write_text("def f():\n    from pkg.b import g\n    return g\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.c import h\n"
                              "def g(): ...\n")
    (pkg / "c.py").write_text("import pkg.sub.other\ndef h(): ...\n")
    (pkg / "sub" / "other.py").write_text("")
    graph = import_graph(tmp_path, ["pkg"])
    assert not any(graph.has_edge(x, y) and graph.has_edge(y, x) for x, y in graph.edges)  # no pair
    assert cycles(graph) == [["pkg.b", "pkg.c", "pkg.sub", "pkg.sub.a"]]
    # folders: pkg/x.py -> pkg/one/, pkg/one/y.py -> pkg/; no module cycle
    (pkg / "b.py").write_text("def g(): ...\n")
    (pkg / "c.py").write_text("def h(): ...\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "x.py").write_text("import pkg.sub.y\n")
    (pkg / "sub" / "y.py").write_text("from pkg.c import h\n")
    graph = import_graph(tmp_path, ["pkg"])
    assert cycles(graph) == []
    assert cycles(folder_graph(graph, tmp_path, ["pkg"])) == [["pkg", "pkg.sub"]]
