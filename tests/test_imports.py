"""Imports go downwards: no module of the project (the flat *.py files at the top of the repository and
the modules of each stage's package) imports one that imports it back, directly or through others. An import inside a function counts too: it
hides the circle from Python at import time, not from a reader who has to know both files at once."""

import ast
import os

from conftest import ROOT


def project_modules(root):
    """name -> path: the top-level files (`config`) and the modules of each package, a folder with an
    __init__.py (`corpus` for corpus/__init__.py, `corpus.filters` for corpus/filters.py)."""
    modules = {}
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if name.endswith(".py"):
            modules[name[:-3]] = path
        elif os.path.isfile(os.path.join(path, "__init__.py")):
            for file in sorted(os.listdir(path)):
                if file.endswith(".py"):
                    module = name if file == "__init__.py" else f"{name}.{file[:-3]}"
                    modules[module] = os.path.join(path, file)
    return modules


def imported_names(path):
    """Every module name the file imports, at the top or inside a function (`import a.b`, `from a import
    b`, `importlib.import_module("a")`), as written and, for `from a import b`, also as `a.b` (b may be a
    module of package a)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.add(node.args[0].value)
    return names


def resolve(name, modules):
    """The project module an imported name loads: the longest known prefix (`a.b.c` -> `a.b`), or None."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def import_graph(root):
    """module -> the project's modules it imports."""
    modules = project_modules(root)
    graph = {}
    for name, path in modules.items():
        found = {resolve(imported, modules) for imported in imported_names(path)}
        graph[name] = sorted(found - {None, name})
    return graph


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
    assert {"corpus.pipeline", "corpus.docs", "serve.app", "serve.worker", "config", "fileio"} <= graph.keys()
    assert "corpus.encode" in graph["corpus.pipeline"]  # pipeline.encode() imports it when it runs
    assert "sample" in graph["evaluation.tool_use"]  # tool_use.main() imports it when it loads a run
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


def test_a_circle_between_modules_of_packages_is_found_through_from_imports(tmp_path):
    (tmp_path / "stage").mkdir()
    (tmp_path / "stage" / "__init__.py").write_text("")
    (tmp_path / "stage" / "a.py").write_text("from stage import b as bee\n")
    (tmp_path / "stage" / "b.py").write_text("def f():\n    import low\n")
    (tmp_path / "low.py").write_text("from stage.a import thing\n")
    (tmp_path / "notes").mkdir()  # a folder without __init__.py is no package
    (tmp_path / "notes" / "x.py").write_text("import low\n")
    graph = import_graph(str(tmp_path))
    assert graph == {"low": ["stage.a"], "stage": [], "stage.a": ["stage", "stage.b"], "stage.b": ["low"]}
    assert circles(graph) == [["low", "stage.a", "stage.b", "low"]]
