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


def imports_of(path):
    """(line, module name) of every import the file makes, at the top or inside a function (`import a.b`,
    `from a import b`, `importlib.import_module("a")`), as written and, for `from a import b`, also as `a.b`
    (b may be a module of package a)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return found


def imported_names(path):
    """Every module name the file imports (imports_of without the lines)."""
    return {name for _, name in imports_of(path)}


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


# The floors of the house, bottom up (shared/DESIGN.md): a module imports only modules of its own floor or
# below. A package's floor holds all its modules; a module named here on its own overrides its package's.
FLOORS = [
    ["config", "fileio", "hardware", "optim"],
    # chat.template: the one chat template imports only config and fileio, and every checkpoint records its
    # version (checkpoint.py), so it stands a floor below the rest of chat/.
    ["model", "data", "checkpoint", "search", "family", "chat.template"],
    ["decode", "objective", "microbatch", "corpus", "chat"],
    ["train", "sample", "agent", "export"],
    ["evaluation", "chain"],
    ["serve"],
    ["bench"],
]
# The one upward import the house allows, and why.
UPWARD_ALLOWED = {
    (
        "train",
        "evaluation.harness",
    ): "train.eval asks lm-eval's suites during training, lazily, only when set",
}


def floor_of(module, floors=FLOORS):
    """The floor (0 = bottom) of a project module: its own entry, else its package's; None if unlisted."""
    named = {name: level for level, names in enumerate(floors) for name in names}
    return named.get(module, named.get(module.split(".")[0]))


def upward_imports(root, floors=FLOORS, allowed=UPWARD_ALLOWED):
    """'path:line: a (floor n) imports b (floor m)' for every import of a module on a higher floor, and
    'path: a is on no floor' for a module the floors do not place."""
    modules = project_modules(root)
    found = []
    for name, path in sorted(modules.items()):
        here = floor_of(name, floors)
        where = os.path.relpath(path, root)
        if here is None:
            found.append(f"{where}: {name} is on no floor (add it to FLOORS)")
            continue
        imports = imports_of(path)
        for line, imported in imports:
            target = resolve(imported, modules)
            if target is None or target == name or (name, target) in allowed:
                continue
            if any(
                other.startswith(f"{imported}.") and resolve(other, modules) != target
                for n, other in imports
                if n == line
            ):
                continue  # `from chat import template`: the package's __init__ only on the way to template
            there = floor_of(target, floors)
            if there is not None and there > here:
                found.append(
                    f"{where}:{line}: {name} (floor {here + 1}) imports {target} (floor {there + 1})"
                )
    return sorted(set(found))


def package_graph(graph):
    """The import graph with each module folded into its top-level name (corpus.filters -> corpus)."""
    folded = {}
    for module, imported in graph.items():
        top = module.split(".")[0]
        folded.setdefault(top, set()).update(i.split(".")[0] for i in imported)
    return {top: sorted(names - {top}) for top, names in folded.items()}


def test_every_import_goes_to_its_own_floor_or_below():
    found = upward_imports(ROOT)
    assert not found, "imports that go up a floor (move what both need below, FLOORS in this file):\n" + (
        "\n".join("  " + line for line in found)
    )


def test_no_package_imports_one_that_imports_it_back():
    found = circles(package_graph(import_graph(ROOT)))
    assert not found, "package circles:\n" + "\n".join("  " + " -> ".join(path) for path in found)


def test_only_the_server_and_its_benchmarks_import_serve():
    graph = import_graph(ROOT)
    users = {module for module, imported in graph.items() for i in imported if i.split(".")[0] == "serve"}
    assert {module.split(".")[0] for module in users} <= {"serve"}, sorted(users)


def test_an_upward_import_is_named_with_its_line(tmp_path):
    (tmp_path / "low.py").write_text("import os\n\n\ndef f():\n    from high import thing\n")
    (tmp_path / "high.py").write_text("import low\n")
    (tmp_path / "stray.py").write_text("")
    found = upward_imports(str(tmp_path), floors=[["low"], ["high"]], allowed={})
    assert found == [
        "low.py:5: low (floor 1) imports high (floor 2)",
        "stray.py: stray is on no floor (add it to FLOORS)",
    ]
    assert (
        upward_imports(str(tmp_path), floors=[["low"], ["high"], ["stray"]], allowed={("low", "high"): "why"})
        == []
    )


def test_a_package_circle_through_different_modules_is_found(tmp_path):
    for package, body in (("bench", "import train\n"), ("train_helpers", "from bench import tool\n")):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / "tool.py").write_text(body)
    assert circles(import_graph(str(tmp_path))) == []  # no module circle...
    (tmp_path / "train.py").write_text("from train_helpers import tool\n")
    assert circles(package_graph(import_graph(str(tmp_path)))) == [
        ["bench", "train", "train_helpers", "bench"]
    ]
