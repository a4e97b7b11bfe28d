"""The docs name what exists: the file paths, modules, dotted names, config keys, run folders and
anchors that README.md and docs/*.md write in their prose (inline code and links, outside code blocks)
are checked against the repository, so a move or a rename breaks this test, not a reader's search.
tests/test_docs.py checks the command lines (make targets, scripts, flags, settings)."""

import functools
import glob
import importlib
import importlib.util
import io
import json
import os
import re
import shutil
import tokenize

import pytest
import yaml
from conftest import ROOT

import config

DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]

# Folders a command makes (never committed): a path under them is checked by its run or data name only.
GENERATED = ("data", "runs", "var", "out")
PLACEHOLDER = re.compile(r"…|\.\.\.|<|\*|\{|(?<![A-Za-z])[A-Z][A-Z_]*(?![a-z])")  # runs/NOMBRE, <run>, runs/X
# Files a run or an export writes, named by their file name (`model.safetensors`), not modules.
FILE_EXTENSIONS = ("yaml", "yml", "json", "jsonl", "md", "txt", "safetensors", "gguf", "pt", "parquet",
                   "sqlite", "gz", "zst", "png", "log", "model", "html", "js", "cpp", "sh")  # fmt: skip
# Bare names of other projects that the pages use, with whose they are (a qualified name, as
# `torch.compile`, needs no entry: its package is found).
OTHER_PROJECTS = {
    "paws_es": "lm-eval task", "xnli_es": "lm-eval task", "xquad_es": "lm-eval task",
    "precompute_ref_log_probs": "TRL's DPOConfig", "llama_decode": "llama.cpp", "hf_xet": "Hugging Face's Xet",
    "repeat_interleave": "torch.Tensor",
    "cpp_wrapper": "torch._inductor.config", "quantize_dynamic": "torch.ao.quantization",
}  # fmt: skip
SOURCE_EXTENSIONS = (".py", ".yaml", ".yml", ".json", ".js", ".html", ".cpp", ".sh", ".service", ".toml")
CODE_SPAN = re.compile(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
LINK = re.compile(r"\]\(([^)\s]+)\)")
IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
RUN_FOLDER = re.compile(r"(?<![\w/.-])runs/([^\s/`'\")\]|,;:]*[\w>}*])")


# -----------------------------------------------------------------------------
# What the repository holds


@functools.cache
def tracked_files():
    """The repository's own files (relative paths), without the generated folders and the venvs."""
    found = []
    for folder, dirs, files in os.walk(ROOT):
        rel = os.path.relpath(folder, ROOT)
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"
                   and not (rel == "." and d in GENERATED)]  # fmt: skip
        found += [os.path.normpath(os.path.join(rel, f)) for f in files]
    return found


@functools.cache
def top_level_names():
    """The repository's top-level folders and files: a path starting with one of them is ours."""
    return {path.split(os.sep)[0] for path in tracked_files()}


def code_of_python(text):
    """Python code less its comments and docstrings: its names and its short one-line string literals
    ("buscar_web", "runs/x"). A stale name kept in a comment does not make it true."""
    kept = []
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == tokenize.NAME:
                kept.append(token.string)
            elif token.type == tokenize.STRING and len(token.string) < 80 and "\n" not in token.string:
                kept.append(token.string)
    except (tokenize.TokenError, SyntaxError):
        return text
    return "\n".join(kept)


@functools.cache
def code_texts():
    """The text of the code, the configs, the schemas and the Makefile less their comments and prose
    (docstrings, a schema's descriptions); the docs and the tests left out (a test makes its runs in a
    temporary folder, and this file plants stale names)."""
    texts = []
    for path in tracked_files():
        if path.startswith("tests" + os.sep) or not (
            path.endswith(SOURCE_EXTENSIONS) or os.path.basename(path) == "Makefile"
        ):
            continue
        with open(os.path.join(ROOT, path), encoding="utf-8", errors="replace") as f:
            text = f.read()
        if path.endswith(".py"):
            texts.append(code_of_python(text))
        elif path.endswith((".json", ".js", ".html", ".cpp")):
            texts.append(re.sub(r'"[^"\n]{80,}"', "", text))
        else:  # YAML, the Makefile, shell: `#` starts a comment
            texts.append(re.sub(r"(^|\s)#.*", "", text))
    return texts


@functools.cache
def code_words():
    """Every name the code, the configs and the schemas use."""
    return {word for text in code_texts() for word in IDENTIFIER.findall(text)}


@functools.cache
def run_folders():
    """The names a command gives a folder under runs/: run_name of the run files, and what the code,
    the Makefile and the chains write after runs/."""
    names = {name for text in code_texts() for name in RUN_FOLDER.findall(text)}
    for path in glob.glob(os.path.join(ROOT, "configs", "*.yaml")):
        with open(path, encoding="utf-8") as f:
            names.add(str((yaml.safe_load(f) or {}).get("run_name", "")))
    return names


def schema_paths(node, defs, prefix=(), depth=0):
    """Every key path a JSON schema allows (through $ref, allOf/anyOf/oneOf and items)."""
    if not isinstance(node, dict) or depth > 12:
        return set()
    if "$ref" in node:
        node = {**defs.get(node["$ref"].split("/")[-1], {}), **{k: v for k, v in node.items() if k != "$ref"}}
    paths = set()
    for key, child in node.get("properties", {}).items():
        paths.add(prefix + (key,))
        paths |= schema_paths(child, defs, prefix + (key,), depth + 1)
    for combined in ("allOf", "anyOf", "oneOf"):
        for child in node.get(combined, []):
            paths |= schema_paths(child, defs, prefix, depth + 1)
    for child in (node.get("items"), node.get("additionalProperties"), node.get("then"), node.get("else")):
        paths |= schema_paths(child, defs, prefix, depth + 1)
    return paths


@functools.cache
def config_keys():
    """Every config key path, whole (`serve.compile.cpu`, the layer first; a run file's own keys bare)."""
    keys = set()
    for path in glob.glob(os.path.join(ROOT, "schema", "*.schema.json")):
        layer = os.path.basename(path).split(".")[0]
        with open(path, encoding="utf-8") as f:
            schema = json.load(f)
        keys |= {(layer, *p) for p in schema_paths(schema, schema.get("$defs", {}))}
        if layer == "run":
            keys |= schema_paths(schema, {})
    return keys


def is_config_key(parts):
    """A whole key path, or the tail of one (`grounding.day_words` of agent.grounding.day_words)."""
    parts = tuple(parts)
    return any(key[-len(parts) :] == parts for key in config_keys() if len(key) >= len(parts))


def is_our_module(name):
    return os.path.isfile(os.path.join(ROOT, name + ".py")) or os.path.isdir(os.path.join(ROOT, name))


def resolves_in_code(parts):
    """Whether `a.b.c` is a module of ours and attributes of it (importing only our own modules)."""
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        if not os.path.exists(os.path.join(ROOT, *parts[:cut])) and not os.path.isfile(
            os.path.join(ROOT, *parts[:cut]) + ".py"
        ):
            continue
        try:
            value = importlib.import_module(name)
        except ImportError:
            return False
        for attribute in parts[cut:]:
            if not hasattr(value, attribute):
                return cut == len(parts) - 1 and defined_in_package(parts[:cut], attribute)
            value = getattr(value, attribute)
        return True
    return False


def defined_in_package(package, name):
    """The project's short form `chat.render`: a top-level name of one of the package's modules."""
    definition = re.compile(rf"^(?:def|class) {re.escape(name)}\b|^{re.escape(name)}\s*[:=]", re.MULTILINE)
    for path in glob.glob(os.path.join(ROOT, *package, "*.py")):
        with open(path, encoding="utf-8") as f:
            if definition.search(f.read()):
                return True
    return False


# -----------------------------------------------------------------------------
# What a page names


def prose_of(path):
    """The page less its code blocks: each fenced line reads as empty, so line numbers hold."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    prose, fence = [], None
    for line in lines:
        stripped = line.strip()
        if fence is None and stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
            prose.append("")
        elif fence is not None:
            fence = None if stripped.startswith(fence) else fence
            prose.append("")
        else:
            prose.append(line)
    return "\n".join(prose)


def spans_in(path):
    """(line, text) of each inline code span of a page's prose."""
    text = prose_of(path)
    return [
        (text.count("\n", 0, m.start()) + 1, " ".join(m.group(2).split())) for m in CODE_SPAN.finditer(text)
    ]


def slug(heading):
    """GitHub's anchor for a heading: lower case, code marks and punctuation gone, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.cache
def anchors_of(path):
    found, counts = set(), {}
    for line in prose_of(path).split("\n"):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def path_problem(text):
    """What is wrong with a file path a page names (`agent/grammar.py`, `runs/sft-2060`), or None."""
    first = text.split("/")[0]
    if first in GENERATED:
        return None  # runs/NAME: name_problems checks it wherever the page writes it
    if PLACEHOLDER.search(text) and "*" not in text:
        return None
    if first not in top_level_names() or ("/" not in text and not text.endswith(".py")):
        return None  # a file of another project, a file inside a run (report.md), a URL path
    if not glob.glob(os.path.join(ROOT, text.rstrip("/"))):
        return f"there is no {text} in the repository"
    return None


def dotted_problem(text):
    """What is wrong with `a.b.c` (a module and its attributes, a config key), or None."""
    parts = text.split(".")
    if is_config_key(parts) or (is_our_module(parts[0]) and resolves_in_code(parts)):
        return None
    if is_our_module(parts[0]):
        return f"{text} is neither a config key nor a module of ours and its attributes"
    if importlib.util.find_spec(parts[0]) is not None:
        return None  # torch.compile: another project's name
    missing = [p for p in parts if p not in code_words() and p not in OTHER_PROJECTS]
    if missing:
        return f"{text}: {', '.join(missing)} is no name of the code, a module or a config key"
    return None


def setting_problem(text):
    """What the schema says against a `layer.key=value` setting a page writes (`serve.compile.cpu=aot`): a
    tool layer's setting over its default file, a run's over configs/smoke-cpu.yaml."""
    layer = text.split(".", 1)[0]
    try:
        if layer in ("agent", "serve", "memory"):
            config.load_layer(layer, os.path.join(ROOT, "configs", layer, "default.yaml"), [text])
        elif layer in ("model", "train", "data", "hardware"):
            config.load(os.path.join(ROOT, "configs", "smoke-cpu.yaml"), [text])
    except config.ConfigError as e:
        return "; ".join(e.problems)
    return None


def span_problem(text):
    if re.fullmatch(r"[a-z]+(\.\w+)+=[^\s…]+", text) and not PLACEHOLDER.search(text.split("=", 1)[1]):
        return setting_problem(text)
    words = text.split()
    if len(words) == 2 and words[0].endswith(".py") and re.fullmatch(r"[a-z][\w-]*", words[1]):
        return script_subcommand_problem(*words)
    if len(words) != 1 or text.startswith(("-", "http", "$")):
        return None
    if "/" in text or re.fullmatch(r"[\w.-]+\.py", text):
        return path_problem(text)
    if re.fullmatch(r"[a-z_]\w*(\.[A-Za-z_]\w*)+", text) and text.rsplit(".", 1)[1] not in FILE_EXTENSIONS:
        return dotted_problem(text)
    if (
        re.fullmatch(r"[a-z][a-z0-9]*_[a-z0-9_]+", text)
        and text not in code_words()
        and text not in OTHER_PROJECTS
    ):
        return f"{text} is no name of the code, a module or a config key"
    return None


def script_subcommand_problem(script, command):
    """`agent/dataset.py generate`: the script exists and takes that subcommand."""
    path = os.path.join(ROOT, script)
    if not os.path.isfile(path):
        return f"there is no {script} in the repository"
    with open(path, encoding="utf-8") as f:
        source = f.read()
    if "add_subparsers" in source and not re.search(
        rf"add_parser\(\s*[\"']{re.escape(command)}[\"']", source
    ):
        return f"{script} has no subcommand {command}"
    return None


def link_problem(page, target):
    """What is wrong with a link of a page: its file must exist, its anchor must be a heading there."""
    if re.match(r"[a-z]+:", target):
        return None  # http://, mailto:
    file, _, anchor = target.partition("#")
    path = os.path.normpath(os.path.join(os.path.dirname(page), file)) if file else page
    if not os.path.exists(path):
        return f"the link {target} names no file"
    if anchor and path.endswith(".md") and anchor not in anchors_of(path):
        return f"the link {target}: {os.path.basename(path)} has no heading #{anchor}"
    return None


def name_problems(path, name):
    """`file:line: what is wrong`, one per stale name or broken link of a page."""
    problems = [f"{name}:{line}: `{text}`: {problem}" for line, text in spans_in(path)
                if (problem := span_problem(text))]  # fmt: skip
    with open(path, encoding="utf-8") as f:
        whole = f.read()  # code blocks too: `python export.py runs/sft` names a run as prose does
    for match in RUN_FOLDER.finditer(whole):
        chosen = whole[: match.start()].endswith("--runs-dir ")  # a folder the command is told to make
        if not chosen and not PLACEHOLDER.search(match.group(1)) and match.group(1) not in run_folders():
            line = whole.count("\n", 0, match.start()) + 1
            problems.append(f"{name}:{line}: runs/{match.group(1)}: no run file or command makes it")
    text = prose_of(path)
    for match in LINK.finditer(text):
        problem = link_problem(path, match.group(1))
        if problem:
            problems.append(f"{name}:{text.count(chr(10), 0, match.start()) + 1}: {problem}")
    return problems


# -----------------------------------------------------------------------------
# The docs


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_module_config_key_and_anchor_a_page_names_exists(doc):
    problems = name_problems(os.path.join(ROOT, doc), doc)
    assert not problems, "names in the docs that the repository no longer has:\n" + "\n".join(problems)


# -----------------------------------------------------------------------------
# The check itself: what it finds


def planted(tmp_path, text, name="page.md"):
    (tmp_path / "docs").mkdir(exist_ok=True)
    path = tmp_path / "docs" / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_a_page_copied_with_a_stale_module_a_wrong_config_key_and_a_broken_anchor_fails_on_each(tmp_path):
    shutil.copytree(os.path.join(ROOT, "docs"), tmp_path / "docs")  # the pages its links name
    copy = tmp_path / "docs" / "servidor.md"
    assert not name_problems(str(copy), "servidor.md"), "the copy is clean before anything is planted"
    copy.write_text(
        copy.read_text(encoding="utf-8")
        + "\nLa gramática vive en `agent_grammar.structural_tag` y en `eval_harness`.\n"
        "El puerto es `serve.puerto`; el paso compilado, `serve.compile.gpu`.\n"
        "Ver [la cola](#una-seccion-que-no-existe) y [la memoria](memorias.md#tampoco-esta).\n",
        encoding="utf-8",
    )
    problems = [p.split(": ", 1)[1] for p in name_problems(str(copy), "servidor.md")]
    assert problems == [
        "`agent_grammar.structural_tag`: agent_grammar.structural_tag: agent_grammar is no name of the code,"
        " a module or a config key",
        "`eval_harness`: eval_harness is no name of the code, a module or a config key",
        "`serve.puerto`: serve.puerto is neither a config key nor a module of ours and its attributes",
        "`serve.compile.gpu`: serve.compile.gpu is neither a config key nor a module of ours and its attributes",
        "the link #una-seccion-que-no-existe: servidor.md has no heading #una-seccion-que-no-existe",
        "the link memorias.md#tampoco-esta: memorias.md has no heading #tampoco-esta",
    ]


def test_a_moved_file_a_missing_subcommand_and_an_unmade_run_folder_are_named(tmp_path):
    doc = planted(
        tmp_path,
        "Ver `agent/grammar.py`, `agent/gramatica.py`, `serve/engine.py`, `decode/*.cpp`, `agent/dataset.py generate`,\n"
        "`agent/dataset.py eval`, `runs/sft-2060`, `runs/sft`, `runs/NOMBRE` y `report.md`.\n",
    )
    problems = name_problems(doc, "page.md")
    assert [p.split(": ", 1)[1] for p in problems] == [
        "`agent/gramatica.py`: there is no agent/gramatica.py in the repository",
        "`serve/engine.py`: there is no serve/engine.py in the repository",  # decode/engine.py since the move
        "`agent/dataset.py eval`: agent/dataset.py has no subcommand eval",
        "runs/sft: no run file or command makes it",
    ]


def test_anchors_follow_githubs_rule_for_accents_code_and_repeated_headings(tmp_path):
    doc = planted(
        tmp_path,
        "# Índice\n## La `cola` y el 429\n## Repetida\n## Repetida\n```\n# no es un título\n```\n"
        "[a](#índice) [b](#la-cola-y-el-429) [c](#repetida-1) [d](#no-es-un-título) [e](#repetida-2)\n",
    )
    problems = name_problems(doc, "page.md")
    assert [p.rsplit("#", 1)[1] for p in problems] == ["no-es-un-título", "repetida-2"]


def test_a_module_attribute_and_a_config_key_tail_resolve_but_a_renamed_attribute_does_not():
    assert span_problem("chat.render") is None
    assert span_problem("grounding.day_words") is None  # the tail of agent.grounding.day_words
    assert span_problem("torch.compile") is None
    assert "neither a config key nor a module" in span_problem("chat.render_it")


def test_a_setting_written_in_prose_is_checked_by_its_schema():
    assert span_problem("serve.compile.cpu=aot") is None
    assert "serve.compile.cpu: 'inductor' is not allowed" in span_problem("serve.compile.cpu=inductor")
    assert "train.sede: unknown key" in span_problem("train.sede=3")
    assert span_problem("serve.port=PUERTO") is None  # a placeholder stands where a value goes
