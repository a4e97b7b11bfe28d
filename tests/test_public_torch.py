"""The training path stands on torch's public API only: a private module or helper (torch.optim._muon's
_adjust_lr, Optimizer._init_group) may change or vanish in any torch but the pin, and then train.py fails
before step 1 on the family's machine."""

import ast

from conftest import ROOT
from test_imports import imported_names, project_modules

# The modules a training step runs through (train.py's own floors); their code is walked for private calls.
TRAINING_STEP = ("train", "optim", "model", "hardware", "objective", "microbatch", "data", "checkpoint",
                 "config", "fileio")  # fmt: skip


def training_path():
    """Every project module train.py imports, directly or through others: a private import in any of them
    breaks train.py at start."""
    modules, seen, todo = project_modules(ROOT), set(), ["train"]
    while todo:
        name = todo.pop()
        if name in seen or name not in modules:
            continue
        seen.add(name)
        todo.extend(n for n in imported_names(modules[name]) if n in modules)
    return {name: modules[name] for name in seen}


def private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def attribute_chain(node):
    """['torch', 'optim', '_muon'] for torch.optim._muon; None where the chain does not start at a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def private_imports(tree):
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [n for n in names if n.split(".")[0] == "torch" and any(map(private, n.split(".")))]
    return found


def private_torch_uses(tree):
    """torch._x attribute chains, and self._x where the class derives from a torch class and does not
    define _x itself (an inherited private helper: Optimizer._init_group)."""
    found = []
    for node in ast.walk(tree):
        chain = attribute_chain(node) if isinstance(node, ast.Attribute) else None
        if chain and chain[0] == "torch" and any(map(private, chain)):
            found.append(".".join(chain))
        if isinstance(node, ast.ClassDef) and any(
            (attribute_chain(b) or [""])[0] == "torch" for b in node.bases
        ):
            own = {n.name for n in ast.walk(node) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
            own |= {t.attr for n in ast.walk(node) if isinstance(n, ast.Assign) for t in n.targets
                    if isinstance(t, ast.Attribute)}  # fmt: skip
            for inner in ast.walk(node):
                chain = attribute_chain(inner) if isinstance(inner, ast.Attribute) else None
                if chain and chain[0] == "self" and private(chain[1]) and chain[1] not in own:
                    found.append(f"{node.name}: self.{chain[1]} (inherited from torch)")
    # torch._dynamo.mark_static_address holds torch._dynamo: name the whole chain once
    return sorted(f for f in set(found) if not any(g.startswith(f + ".") for g in found))


def parse(path):
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), path)


def test_no_module_train_py_imports_imports_a_private_torch_module():
    path = training_path()
    assert set(TRAINING_STEP) <= set(path)
    found = {name: private_imports(parse(file)) for name, file in path.items()}
    assert {name: names for name, names in found.items() if names} == {}


def test_no_module_of_the_training_step_uses_a_private_torch_helper():
    path = training_path()
    found = {name: private_torch_uses(parse(path[name])) for name in TRAINING_STEP}
    assert {name: uses for name, uses in found.items() if uses} == {}


def test_the_walk_finds_what_it_is_for():
    sample = ast.parse(
        "import torch\nfrom torch.optim._muon import _adjust_lr\nfrom torch.utils import _pytree\n"
        "class Muon(torch.optim.Muon):\n    def step(self):\n        self._init_group()\n"
        "        self._mine()\n        torch._dynamo.mark_static_address(x)\n        torch.__version__\n"
        "    def _mine(self):\n        pass\n"
    )
    assert private_imports(sample) == [
        "torch.optim._muon",
        "torch.optim._muon._adjust_lr",
        "torch.utils._pytree",
    ]
    assert private_torch_uses(sample) == [
        "Muon: self._init_group (inherited from torch)",
        "torch._dynamo.mark_static_address",
    ]
