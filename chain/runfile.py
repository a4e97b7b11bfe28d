"""
A chain file and the command line of each of its stages.

    chain:
      board: cpu
      folder: runs/run-cpu
      hardware: hardware/cpu.yaml
      assume: {...}               # what the plan assumes where nothing was measured
      stages:
        - {name: corpus, command: corpus, config: smoke-corpus-cpu.yaml}
        - {name: pretrain, command: train, config: smoke-corpus-cpu.yaml, data: corpus}
        ...

Each stage writes <folder>/<name>/ (downloads go to the data layer's shared hub folder); the chain wires the
folders with the one override syntax (data.dir=..., train.runs_dir=..., run_name=..., train.init_from=...),
so a stage's command line is also what reruns it alone. The whole file is checked at start, every stage's
run file with it, and every problem reported at once.
"""

import json
import os
import sys

import yaml

import config
import hardware
from chain import commands

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
CHAIN_DIR = os.path.join(CONFIGS, "chain")
# Commands whose output is the stage's own folder (cleared when the stage starts afresh).
OWN_FOLDER = ("corpus", "agent-data", "chat-prepare", "train")
NEEDS = {
    "corpus-download": ("config",),
    "corpus": ("config",),
    "chat-download": ("config",),
    "eval-download": ("tasks",),
    "agent-data": (),
    "chat-prepare": ("config", "data"),
    "train": ("config", "data"),
    "evaluate": ("from", "tasks"),
    "report": ("from",),
    "export": ("from", "to"),
    "tool-eval": ("from",),
    "ask": ("from",),
}


def boards():
    return sorted(name[:-5] for name in os.listdir(CHAIN_DIR) if name.endswith(".yaml"))


def chain_path(board):
    """configs/chain/<board>.yaml, or a ConfigError of one line that lists the boards."""
    if board.endswith(".yaml") and os.path.isfile(board):
        return board
    path = os.path.join(CHAIN_DIR, f"{board}.yaml")
    if not os.path.isfile(path):
        raise config.ConfigError([f"BOARD={board}: unknown board; boards: {', '.join(boards())}"])
    return path


def load(board, overrides=()):
    """The chain section of a board's file (checked, its stages' run files with it) and that file's path."""
    path = chain_path(board)
    chain = config.load_layer("chain", path, overrides)
    problems = stage_problems(chain, path)
    if problems:
        raise config.ConfigError(problems)
    return chain, path


def stage_problems(chain, path):
    """Every problem of the stages beyond the schema: what each command needs, the stages it names, and
    each stage's run file loaded with the overrides it will get."""
    problems, seen = [], set()
    for index, stage in enumerate(chain["stages"]):
        where = f"{path}: stages.{index} ({stage['name']})"
        if stage["name"] in seen:
            problems.append(f"{where}: name: {stage['name']!r} is used twice; each stage needs its own")
        for key in NEEDS[stage["command"]]:
            if key not in stage:
                problems.append(f"{where}: {key}: required by command {stage['command']}")
        if stage["command"] == "chat-download" and "chat_download_mb" not in chain["assume"]:
            problems.append(f"{path}: assume.chat_download_mb: required by command chat-download")
        named = [(key, stage[key]) for key in ("data", "from") if key in stage]
        named += [(f"mixture_from.{source}", name) for source, name in stage.get("mixture_from", {}).items()]
        for key, name in named:
            if name not in seen:
                problems.append(
                    f"{where}: {key}: {name!r} is not an earlier stage; earlier: {', '.join(seen) or 'none'}"
                )
        seen.add(stage["name"])
        if "config" in stage and not any(p.startswith(where) for p in problems):
            try:
                cfg = load_stage_config(chain, stage)
            except config.ConfigError as e:
                problems.extend(f"{where}: {line}" for line in e.problems)
                continue
            if (
                stage["command"] == "train"
            ):  # its attention kernel on the profile's board, before any download
                problems.extend(
                    f"{where}: {line}" for line in hardware.attention_problems(cfg["hardware"], cfg["model"])
                )
    return problems


def stage_by_name(chain, name):
    return next(s for s in chain["stages"] if s["name"] == name)


def folder_of(chain, name):
    return os.path.join(chain["folder"], name)


def wiring(chain, stage):
    """The overrides that put a stage's output in its folder and point it at its upstream stages."""
    command, own = stage["command"], folder_of(chain, stage["name"])
    if command == "corpus":
        return [f"data.dir={own}"]
    if command == "corpus-download":
        return []
    if command == "chat-prepare":
        tokenizer = os.path.join(folder_of(chain, stage["data"]), "tokenizer.model")
        return [f"data.dir={own}", f"data.chat.tokenizer={tokenizer}"] + mixture_wiring(chain, stage)
    if command == "train":
        words = [f"data.dir={folder_of(chain, stage['data'])}", f"train.runs_dir={chain['folder']}"]
        words.append(f"run_name={stage['name']}")
        words.extend(policy_overrides(chain))
        if "from" in stage:
            words.append(f"train.init_from={folder_of(chain, stage['from'])}")
        return words
    return []


def policy_overrides(chain):
    """hardware.key=value for every key of the chain's policy profile (none without one): the training
    stages run a board's dtype policy on the CPU whatever hardware layer their run files name."""
    if "policy" not in chain:
        return []
    profile = config.load_layer("hardware", os.path.join(CONFIGS, chain["policy"]))
    return [f"hardware.{key}={json.dumps(value)}" for key, value in profile.items()]  # JSON is YAML


def mixture_wiring(chain, stage):
    """The override that points the mixture sources of stage["mixture_from"] at the earlier stages' folders
    (the list is given whole: the override syntax names keys, not list items)."""
    moved = stage.get("mixture_from")
    if not moved:
        return []
    own = [w for w in stage_args(chain, stage) if config.is_override(w)]
    mix_cfg = config.load(os.path.join(CONFIGS, stage["config"]), own)["data"]["chat"].get("mixture") or {}
    sources = []
    for source in mix_cfg.get("sources", []):
        if source["name"] in moved:
            name = os.path.basename(source["path"])
            source = dict(source, path=os.path.join(folder_of(chain, moved[source["name"]]), name))
        sources.append(source)
    flow = yaml.safe_dump(sources, default_flow_style=True, width=float("inf"), allow_unicode=True).strip()
    return [f"data.chat.mixture.sources={flow}"]


def stage_args(chain, stage):
    """The stage's own words with {run} replaced by the run folder."""
    return [word.replace("{run}", chain["folder"]) for word in stage.get("args", [])]


def config_overrides(chain, stage):
    return [w for w in stage_args(chain, stage) if config.is_override(w)] + wiring(chain, stage)


def load_stage_config(chain, stage):
    """The stage's resolved config (its run file with the chain's overrides), as its command reads it."""
    return config.load(os.path.join(CONFIGS, stage["config"]), config_overrides(chain, stage))


def command_line(chain, stage, resume=False):
    """The argv that runs the stage alone (sys.executable for python): its command from chain/commands.mk
    (the Makefile's targets run the same), the stage's own words, then the chain's wiring."""
    command, extra = stage["command"], stage_args(chain, stage)
    if "config" in stage:
        words = commands.command(command, os.path.join("configs", stage["config"]))
    elif command == "eval-download":
        words = commands.command(command, stage["tasks"])
    elif command == "agent-data":
        words = commands.command(command, folder_of(chain, stage["name"]))
        if "settings" in stage:
            words += commands.command("agent-settings", os.path.join("configs", stage["settings"]))
    else:
        run = folder_of(chain, stage["from"])
        if command == "evaluate":
            words = commands.command(command, run, stage["tasks"])
        elif command == "export":
            words = commands.command(command, run, os.path.join(run, f"export-{stage['to']}"), stage["to"])
        elif command == "ask":
            words = commands.command(command, run, folder_of(chain, stage["name"]))
        else:
            words = commands.command(command, run)
    ending = []
    if command == "train" and resume:
        ending = commands.command("resume")
    elif command == "export":  # the chain's rerun of the stage writes its folder again
        ending = ["--force"]
    return [sys.executable, *words, *extra, *wiring(chain, stage), *ending]
