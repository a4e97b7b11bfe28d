"""Imports go downwards: no module of the project (the flat *.py files at the top of the repository)
imports one that imports it back, directly or through others. An import inside a function counts too: it
hides the circle from Python at import time, not from a reader who has to know both files at once."""

import ast
import os

from conftest import ROOT


def project_modules(root):
    return {name[:-3]: os.path.join(root, name) for name in os.listdir(root) if name.endswith(".py")}


def imported_names(path):
    """Every module name the file imports, at the top or inside a function (`import a.b`, `from a import
    b`, `importlib.import_module("a")`)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.add(node.args[0].value.split(".")[0])
    return names


def import_graph(root):
    """module -> the project's modules it imports."""
    modules = project_modules(root)
    return {name: sorted((imported_names(path) & modules.keys()) - {name}) for name, path in modules.items()}


def circles(graph):
    """One import path per circle, each as [a, b, ..., a], shortest first found from each module."""
    found, seen = [], set()
    for start in sorted(graph):
        paths = [[start]]  # breadth first: the shortest way back to start
        visited = {start}
        while paths:
            path = paths.pop(0)
            for following in graph[path[-1]]:
                if following == start:
                    key = frozenset(path)
                    if key not in seen:
                        seen.add(key)
                        found.append(path + [start])
                    paths = []
                    break
                if following not in visited:
                    visited.add(following)
                    paths.append(path + [following])
    return found


def test_no_module_imports_one_that_imports_it_back():
    found = circles(import_graph(ROOT))
    assert not found, "import circles (imports go downwards; move what both need to a module below):\n" + (
        "\n".join("  " + " -> ".join(path) for path in found)
    )


def test_the_graph_holds_the_imports_made_inside_functions():
    graph = import_graph(ROOT)
    assert {"corpus", "corpus_docs", "serve", "serve_worker", "config", "fileio"} <= graph.keys()
    assert "corpus_encode" in graph["corpus"]  # corpus.encode() imports it when it runs
    assert "sample" in graph["agent_data"]  # agent_data.main() imports it for `eval` only
    assert graph["fileio"] == [] and graph["config"] == []  # the bottom of the house


def test_a_circle_through_a_lazy_import_is_found_and_named(tmp_path):
    (tmp_path / "top.py").write_text("import middle\n")
    (tmp_path / "middle.py").write_text("def f():\n    from bottom import g\n    return g\n")
    (tmp_path / "bottom.py").write_text(
        "import os\n\ndef g():\n    import importlib\n    return importlib.import_module('top')\n"
    )
    (tmp_path / "apart.py").write_text("import top.sub\nimport json\n")
    graph = import_graph(str(tmp_path))
    assert graph == {"top": ["middle"], "middle": ["bottom"], "bottom": ["top"], "apart": ["top"]}
    assert circles(graph) == [["bottom", "top", "middle", "bottom"]]
