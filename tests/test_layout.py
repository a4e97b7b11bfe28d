"""The house by stage: the design card's core stays flat at the root (at most 13 files), each stage is a
package named for it, no module takes the name of a builtin or of a standard-library module, and no
function is longer than a screen and a half (120 lines)."""

import ast
import builtins
import os
import sys

from conftest import ROOT

STAGES = ("agent", "bench", "chain", "chat", "corpus", "decode", "evaluation", "family", "serve")
SKIPPED = {".venv", ".git", "runs", "data", "out", "var", "tests", "scripts", "node_modules"}


def python_files():
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [s for s in subfolders if s not in SKIPPED and not s.startswith(".")]
        yield from (os.path.join(folder, f) for f in files if f.endswith(".py"))


def long_functions(path, limit):
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    return [
        f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > limit
    ]


def test_the_root_keeps_at_most_thirteen_python_files():
    root_files = sorted(name for name in os.listdir(ROOT) if name.endswith(".py"))
    assert len(root_files) <= 13, root_files


def test_every_stage_is_a_package_named_for_it():
    for stage in STAGES:
        assert os.path.isfile(os.path.join(ROOT, stage, "__init__.py")), stage


def test_no_module_shadows_a_builtin_or_a_standard_library_module():
    taken = set(sys.stdlib_module_names) | set(dir(builtins))
    names = {os.path.splitext(os.path.basename(path))[0] for path in python_files()} | set(STAGES)
    assert not names & taken - {"__init__", "__main__"}, sorted(names & taken)


def test_no_function_is_longer_than_120_lines():
    found = [problem for path in python_files() for problem in long_functions(path, 120)]
    assert not found, "\n".join(found)


def test_a_long_function_is_found_and_named(tmp_path):
    path = tmp_path / "x.py"
    path.write_text("def short():\n    pass\n\n\ndef long():\n" + "    x = 1\n" * 130)
    assert long_functions(str(path), 120) == [f"{os.path.relpath(str(path), ROOT)}:5 long (131 lines)"]


def test_the_repository_ships_an_mit_licence_that_the_seed_data_names():
    with open(os.path.join(ROOT, "LICENSE"), encoding="utf-8") as f:
        licence = f.read()
    assert licence.startswith("MIT License") and "The ENLACE authors" in licence
    with open(os.path.join(ROOT, "conversations", "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert "MIT" in readme and "`LICENSE`" in readme
