"""The docs keep their word: every `make` command and `python X.py` command line written in README.md and
docs/*.md, in code blocks and in inline code, is accepted by what it names — the targets by the Makefile,
the subcommands, flags and their values by the script's own command line, the config files and
`section.key=value` settings by their schema — so a renamed flag breaks this test, not a reader's
copy-paste. Nothing runs: `make -n` prints a target's commands, and a script is stopped the moment it has
accepted its command line (argparse has parsed it, config.load has validated the run file, `python -m bench` has
picked its sections)."""

import argparse
import contextlib
import functools
import glob
import importlib
import io
import itertools
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from unittest import mock

import pytest
from conftest import ROOT
from users_shell import users_env

import config

DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]

PYTHONS = {"python", "python3", ".venv/bin/python", "torchrun", ".venv/bin/torchrun"}
COMMAND_WORDS = PYTHONS | {"make"}
SEPARATORS = {"|", "||", "&&", ";", "&"}
ELLIPSES = {"…", "..."}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
TOOL_LAYERS = ("agent", "serve", "memory")  # a tool's own layer file, set on its command line (serve.port=1)
PLACEHOLDER = re.compile(r"…|\.\.\.|\$|<|(?<![A-Za-z])[A-Z][A-Z_]{2,}(?![a-z])")  # CONFIG, runs/NOMBRE, $RUN
NOT_SHELL = {"python", "py", "yaml", "yml", "json", "toml", "go", "html", "javascript", "js"}


@dataclass
class Command:
    where: str  # file:line
    text: str  # as the docs write it
    partial: bool  # inline code is a mention: required arguments may be left out (as before a …)
    output: list[str] = field(default_factory=list)  # what a transcript (`$ command`) shows it prints


# -----------------------------------------------------------------------------
# Finding the commands


def starts_a_command(words):
    """The words after `sudo [-u USER]` and `VAR=value` prefixes, if they start with make or python."""
    if words[:1] == ["sudo"]:
        words = words[1:]
        while words and words[0].startswith("-"):
            words = words[2:] if words[0] in ("-u", "-g") else words[1:]
    while words and ASSIGNMENT.match(words[0]):
        words = words[1:]
    return words if words and words[0] in COMMAND_WORDS else None


def names_a_command(line):
    """Whether a line starts with make or python and an argument, without splitting it like a shell
    (prose may not split)."""
    words = starts_a_command(line.split()[:6])
    return words is not None and len(words) > 1  # a bare `python` or `make` names no command


def commands_in(path, name):
    """Every command line of a Markdown file: lines of shell code blocks (after a `$ ` prompt, with the
    output lines that follow it) and inline code spans."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    found, prose, fence, language, transcript = [], [], None, "", False
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if fence is None and stripped.startswith(("```", "~~~")):
            fence, language = stripped[:3], stripped[3:].strip().lower()
            block = lines[number:]
            end = next((i for i, text in enumerate(block) if text.strip().startswith(fence)), len(block))
            transcript = any(text.strip().startswith("$ ") for text in block[:end])
            prose.append("")
            continue
        if fence is not None:
            prose.append("")
            if stripped.startswith(fence):
                fence = None
            elif language in NOT_SHELL:
                pass
            elif transcript and not stripped.startswith("$ "):
                if found and found[-1].output is not None and stripped:
                    found[-1].output.append(stripped)
            else:
                text, following = (stripped[2:] if stripped.startswith("$ ") else stripped), number
                while text.endswith("\\") and following < len(lines):  # continued on the next line
                    text = text[:-1] + " " + lines[following].strip()
                    following += 1
                if names_a_command(text):
                    found.append(Command(f"{name}:{number}", text, partial=False))
                elif transcript:
                    found.append(Command(f"{name}:{number}", "", partial=True, output=None))  # not ours
            continue
        prose.append(line)
    text = "\n".join(prose)
    for match in re.finditer(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)", text, re.DOTALL):
        code = " ".join(match.group(2).split())
        if names_a_command(code):
            found.append(Command(f"{name}:{text.count(chr(10), 0, match.start()) + 1}", code, partial=True))
    return [c for c in found if c.text]


def variants(words):
    """The command lines a line stands for: `{a,b}` and `a|b|c` are alternatives, `[...]` optional parts
    (checked as given), and `…` / `...` end a mention. A word with spaces, quotes or colons (JSON, a
    prompt) is taken as it is."""
    choices = []
    for word in words:
        if word in ELLIPSES:
            break
        if re.search(r"[\s\"':]", word) or ASSIGNMENT.match(word):
            choices.append([word])
            continue
        word = word.lstrip("[").rstrip("]")
        braces = re.fullmatch(r"([^{]*)\{([\w.-]+(?:,[\w.-]+)+)\}(.*)", word)
        if braces:
            choices.append([braces[1] + option + braces[3] for option in braces[2].split(",")])
        elif word:
            choices.append(word.split("|"))
    return [list(line) for line in itertools.product(*choices)]


def segments(words):
    """The simple commands of a shell line: split at `|`, `&&`, `||`, `;`, without redirections."""
    parts, current, target = [], [], False
    for word in words:
        if word in SEPARATORS:
            parts.append(current)
            current = []
        elif re.match(r"^\d?(>>?|<)", word):
            target = re.fullmatch(r"\d?(>>?|<)", word) is not None  # `> FILE`: the next word goes too
        elif target:
            target = False
        else:
            current.append(word)
    return [p for p in parts + [current] if p]


# -----------------------------------------------------------------------------
# Checking them


class Accepted(Exception):
    """The script took its command line and was about to start working."""


def no_abbreviations(parser):
    """A flag must be written whole: an abbreviation works today and breaks when a longer flag arrives."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                no_abbreviations(sub)


def option_strings(parser):
    known = {s for action in parser._actions for s in action.option_strings}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                known |= option_strings(sub)
    return known


def module_of(dotted):
    """The importable module `python -m dotted` runs when it is one of ours (a package runs its
    __main__), else None."""
    path = os.path.join(ROOT, *dotted.split("."))
    if os.path.isfile(path + ".py"):
        return dotted
    if os.path.isfile(os.path.join(path, "__main__.py")):
        return f"{dotted}.__main__"
    return None


def is_placeholder(word):
    return bool(PLACEHOLDER.search(word))


def run_cli(module_name, argv):
    """(accepted, output, parser, validated): the script's own verdict on argv, stopped before it works."""
    module = importlib.import_module(module_name)
    seen = {"parser": None, "validated": False}
    real_parse_args, real_load = argparse.ArgumentParser.parse_args, config.load

    def parse_args(parser, args=None, namespace=None):
        seen["parser"] = seen["parser"] or parser
        no_abbreviations(parser)
        real_parse_args(parser, args, namespace)
        raise Accepted

    def load(path, overrides=()):
        if not is_placeholder(path):
            real_load(path, overrides)
            seen["validated"] = True
        raise Accepted

    def picked(*args, **kwargs):
        raise Accepted

    out = io.StringIO()
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(argparse.ArgumentParser, "parse_args", parse_args))
        stack.enter_context(mock.patch.object(config, "load", load))
        stack.enter_context(mock.patch.object(sys, "argv", [f"{module_name}.py", *argv]))  # argparse's prog
        if hasattr(module, "SECTIONS"):  # bench: its sections are picked, not run
            stack.enter_context(mock.patch.dict(module.SECTIONS, dict.fromkeys(module.SECTIONS, picked)))
        stack.enter_context(contextlib.chdir(ROOT))  # the docs' paths are relative to the repository
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(out))
        try:
            code = module.main(list(argv))
        except Accepted:
            code = 0
        except SystemExit as e:
            code = e.code
    return code in (0, None), out.getvalue(), seen["parser"], seen["validated"]


def only_missing_arguments(output):
    """A mention's verdict: what is missing, nothing that is wrong."""
    lines = [line for line in output.splitlines() if line.strip()]
    return bool(lines) and all(
        line.startswith(("usage:", " ")) or "error: the following arguments are required" in line
        for line in lines
    )


@functools.cache
def check_python(words, partial, shown):
    """What is wrong with one `python X.py ...` command line (a tuple of words), or None."""
    rest = words[1:]
    if words[0].endswith("torchrun"):
        while rest and rest[0].startswith("-"):
            rest = rest[1:]
    if rest[:1] == ("-m",) and len(rest) > 1:
        script, argv = f"-m {rest[1]}", rest[2:]
        name = module_of(rest[1])
        if name is None:
            return None  # python -m pip, python -m venv: not a module of ours
    elif not rest or rest[0].startswith("-"):
        return None  # python -c ...: not a script of ours
    else:
        script, argv = rest[0], rest[1:]
        if not os.path.isfile(os.path.join(ROOT, script)):
            return f"there is no {script} in the repository"
        if "/" in script:
            return None  # a helper script elsewhere: it exists, its command line is its own business
        name = script[:-3]
    if not hasattr(importlib.import_module(name), "main"):
        return f"{script} has no main(argv)"
    accepted, output, parser, validated = run_cli(name, argv)
    lines = [line.strip() for line in output.strip().splitlines()]
    message = " / ".join([line for line in lines if "error:" in line] or lines[-3:])
    flags = [w.split("=")[0] for w in argv if re.match(r"^--?[A-Za-z]", w)]
    unknown = [f for f in flags if parser is not None and f not in option_strings(parser)]
    if unknown:
        message += f" (no option {', '.join(unknown)})"
    if not accepted and any(
        f"value: '{w}'" in message or f"choice: '{w}'" in message for w in argv if is_placeholder(w)
    ):
        accepted = True  # `--port $PORT`, `--to FORMAT`: a placeholder stands where a typed value goes
    if not accepted:
        if shown and all(line in lines for line in shown):
            return None  # the docs show the error it prints, word for word
        if shown:
            return f"the docs show output it no longer prints; it prints: {message}"
        if not (partial and only_missing_arguments(output)):
            return f"{script} rejects it: {message}"
    if unknown:  # a mention left out what was required, and argparse stopped before the flags
        return f"{script} has no option {', '.join(unknown)}"
    if not validated:
        settings = [(w, layer) for w in argv for layer in TOOL_LAYERS if config.is_override(w, layer)]
        for setting, layer in settings:
            try:
                config.load_layer(layer, os.path.join(ROOT, "configs", layer, "default.yaml"), [setting])
            except config.ConfigError as e:
                return f"{setting}: " + "; ".join(e.problems)
    return None


@functools.cache
def make_dry_run(words):
    """The command lines `make` would run for these targets and settings (`VAR=…` keeps the default)."""
    settings = [w for w in words[1:] if ASSIGNMENT.match(w) and w.split("=", 1)[1] not in ELLIPSES]
    targets = [w for w in words[1:] if not ASSIGNMENT.match(w) and not w.startswith("-")]
    env = users_env()
    dry = subprocess.run(
        ["make", "-n", "-B", *targets, *settings],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if dry.returncode != 0:
        return None, dry.stderr.strip().splitlines()[-1] if dry.stderr.strip() else f"exit {dry.returncode}"
    nothing = re.findall(r"Nothing to be done for '([^']+)'", dry.stdout + dry.stderr)
    if nothing:  # a name in .PHONY whose rule is gone
        return None, f"the Makefile has no rule for {', '.join(nothing)}"
    lines = re.sub(r"\\\n\s*", " ", dry.stdout).splitlines()
    return [line for line in lines if not line.startswith("make[")], None


def command_problems(command):
    """`file:line: command: what is wrong`, one per problem of a command as the docs write it."""
    try:
        words = shlex.split(command.text, comments=True)
    except ValueError as e:
        return [f"{command.where}: `{command.text}`: a shell cannot split it ({e})"]
    problems, partial = [], command.partial or any(word in ELLIPSES for word in words)
    for simple in segments(words):
        simple = starts_a_command(simple)
        if simple is None:
            continue
        for line in variants(simple):
            if line[0] == "make":
                ran, error = make_dry_run(tuple(line))
                if error:
                    problems.append(f"{command.where}: `{shlex.join(line)}`: {error}")
                    continue
                for printed in ran:
                    try:
                        printed_words = shlex.split(printed)
                    except ValueError:
                        continue  # a shell construct of a recipe, not a command line of ours
                    for part in segments(printed_words):
                        part = starts_a_command(part)
                        if part and part[0] in PYTHONS:
                            problem = check_python(tuple(part), partial, ())
                            if problem:
                                problems.append(
                                    f"{command.where}: `{shlex.join(line)}` runs `{shlex.join(part)}`: {problem}"
                                )
            else:
                problem = check_python(tuple(line), partial, tuple(command.output))
                if problem:
                    problems.append(f"{command.where}: `{shlex.join(line)}`: {problem}")
    return problems


def doc_problems(path, name):
    return [p for command in commands_in(path, name) for p in command_problems(command)]


# -----------------------------------------------------------------------------
# The docs


@pytest.mark.parametrize("doc", DOCS)
def test_every_command_written_in_the_docs_is_accepted_by_what_it_names(doc):
    commands = commands_in(os.path.join(ROOT, doc), doc)
    assert commands, f"{doc}: no make or python command found: the page should start with its commands"
    problems = [p for command in commands for p in command_problems(command)]
    assert not problems, "commands in the docs that do not work as written:\n" + "\n".join(problems)


README_CELL_LIMIT = 300  # characters: a status cell says what is done and links the page with the figures


def long_table_cells(path, limit):
    """'file:line: N characters' for each cell of a Markdown table (outside code blocks) over limit."""
    found, fenced = [], False
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif not fenced and line.startswith("|"):
                cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
                found += [f"{os.path.basename(path)}:{number}: {len(c.strip())} characters"
                          for c in cells if len(c.strip()) > limit]  # fmt: skip
    return found


def test_every_table_cell_of_the_readme_fits_in_300_characters():
    long = long_table_cells(os.path.join(ROOT, "README.md"), README_CELL_LIMIT)
    assert not long, "README.md table cells over 300 characters (move the figures to docs/):\n" + "\n".join(
        long
    )


# -----------------------------------------------------------------------------
# The check itself: what it finds and what it refuses


def write_doc(tmp_path, text):
    path = tmp_path / "page.md"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_commands_are_found_in_code_blocks_tables_and_inline_code(tmp_path):
    doc = write_doc(
        tmp_path,
        "# Página\n\n```bash\nmake smoke   # comentario\nls runs/\npython sample.py runs/x \\\n  --chat\n```\n\n"
        "| etapa | órdenes |\n|---|---|\n| corpus | `make corpus-smoke`, `python -m serve member add …` |\n\n"
        "Con `make plot\nRUN=runs/a` y `python` a secas.\n",
    )
    found = [(c.where, c.text, c.partial) for c in commands_in(doc, "page.md")]
    assert found == [
        ("page.md:4", "make smoke   # comentario", False),
        ("page.md:6", "python sample.py runs/x  --chat", False),
        ("page.md:12", "make corpus-smoke", True),
        ("page.md:12", "python -m serve member add …", True),
        ("page.md:14", "make plot RUN=runs/a", True),
    ]


def test_a_table_cell_over_the_limit_is_named_by_line_and_length_but_not_one_in_code_or_an_escaped_pipe(
    tmp_path,
):
    cell = "x" * 12
    doc = write_doc(
        tmp_path,
        f"| a | b |\n|---|---|\n| corto | {cell} |\n| `a \\| b` {cell} | c |\n\n```text\n| {cell}{cell} |\n```\n",
    )
    assert long_table_cells(doc, 11) == ["page.md:3: 12 characters", "page.md:4: 21 characters"]
    assert long_table_cells(doc, 21) == []


def test_a_renamed_flag_fails_naming_the_file_the_line_and_the_flag(tmp_path):
    doc = write_doc(
        tmp_path,
        "```bash\npython export.py runs/sft --to hf out/x\npython export.py runs/sft --format hf out/x\n```\n",
    )
    problems = doc_problems(doc, "page.md")
    assert len(problems) == 1
    assert problems[0].startswith(
        "page.md:3: `python export.py runs/sft --format hf out/x`: export.py rejects it"
    )
    assert "--format" in problems[0]


def test_a_flag_passed_through_make_args_is_checked_by_the_script_make_runs(tmp_path):
    doc = write_doc(
        tmp_path,
        '```bash\nmake export RUN=runs/sft TO=gguf ARGS="--dtype f16"\nmake export RUN=runs/sft ARGS="--dtipe f16"\n```\n',
    )
    problems = doc_problems(doc, "page.md")
    assert len(problems) == 1 and problems[0].startswith(
        "page.md:3: `make export RUN=runs/sft 'ARGS=--dtipe f16'` runs"
    )
    assert (
        "export.py runs/sft out/sft-hf --to hf --dtipe f16" in problems[0]
        and "unrecognized arguments" in problems[0]
    )


def test_a_missing_make_target_fails(tmp_path):
    problems = doc_problems(write_doc(tmp_path, "Usa `make smoke` y `make smok`.\n"), "page.md")
    assert (
        len(problems) == 1
        and "page.md:1: `make smok`: " in problems[0]
        and "No rule to make target" in problems[0]
    )


def test_subcommands_choices_and_abbreviations_are_checked(tmp_path):
    doc = write_doc(
        tmp_path,
        "```bash\npython -m serve member add ana --role admin\npython -m serve member ad ana --role admin\n"
        "python -m serve member add ana --role abuela\npython -m family list --mem ana\n"
        "python -m chat import --from alpaca|sharegpt|oasst FICHERO out.jsonl [--lang es]\n"
        "python -m corpus {corpus,tokenise} CONFIG\n"
        'python -m agent call calculadora \'{"expresion": "2+2", "x": [1]}\'   # JSON as it is\n```\n',
    )
    problems = doc_problems(doc, "page.md")
    assert [p.split(": `")[0] for p in problems] == ["page.md:3", "page.md:4", "page.md:5", "page.md:7"]
    assert "invalid choice: 'ad'" in problems[0] and "invalid choice: 'abuela'" in problems[1]
    assert "--mem" in problems[2] and "python -m corpus tokenise CONFIG" in problems[3]


def test_config_files_and_settings_are_validated_by_their_schema(tmp_path):
    doc = write_doc(
        tmp_path,
        "```bash\npython train.py configs/smoke-cpu.yaml train.seed=3\npython train.py configs/smoke-cpu.yaml train.sede=3\n"
        "make pretrain CONFIG=configs/nope.yaml\nmake pretrain CONFIG=…\n"
        "python -m serve runs/x serve.queue_size=4\npython -m serve runs/x serve.queue_sise=4\n```\n",
    )
    problems = doc_problems(doc, "page.md")
    assert [p.split(": `")[0] for p in problems] == ["page.md:3", "page.md:4", "page.md:7"]
    assert "train.sede: unknown key" in problems[0] and "configs/nope.yaml" in problems[1]
    assert "serve.queue_sise: unknown key" in problems[2]


def test_a_mention_may_leave_out_arguments_but_not_get_one_wrong(tmp_path):
    doc = write_doc(
        tmp_path,
        "Con `python -m serve member add` o `python -m family …`, nunca `python -m serve member add --rol x`.\n"
        "El puerto: `python -m serve $RUN --port $PORT`, no `python -m serve $RUN --port ocho`.\n",
    )
    problems = doc_problems(doc, "page.md")
    assert len(problems) == 2 and "no option --rol" in problems[0]
    assert problems[1].startswith("page.md:2: `python -m serve '$RUN' --port ocho`: -m serve rejects it")


def test_a_transcript_may_show_an_error_but_only_the_one_the_command_prints(tmp_path):
    shown = "configs/smoke-cpu.yaml: 1 config problem:\n  command line (train.sede=1): train.sede: unknown key; did you mean train.seed?"
    right = write_doc(
        tmp_path, f"```\n$ python config.py configs/smoke-cpu.yaml train.sede=1\n{shown}\n```\n"
    )
    assert doc_problems(right, "page.md") == []
    wrong = write_doc(
        tmp_path, f"```\n$ python config.py configs/smoke-cpu.yaml train.sedes=1\n{shown}\n```\n"
    )
    assert "the docs show output it no longer prints" in doc_problems(wrong, "page.md")[0]


def test_a_module_run_with_python_m_is_checked_like_a_script(tmp_path):
    doc = write_doc(
        tmp_path,
        "```bash\npython -m pip install x\npython -m export runs/sft --to hf out/x\n"
        "python -m export runs/sft --format hf out/x\npython -m nothing_of_ours --flag\n```\n",
    )
    problems = doc_problems(doc, "page.md")
    assert len(problems) == 1 and problems[0].startswith("page.md:4: `python -m export runs/sft --format hf")
    assert "-m export rejects it" in problems[0] and "--format" in problems[0]
