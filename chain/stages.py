"""
Stages that remember. A finished stage leaves <folder>/chain/<stage>.done: the hash of what it was made from
(its config section, the upstream stages' stamps, the code's version). A rerun skips a stage whose stamp
still matches; a stage that was started with the same stamp (<stage>.started) and not finished resumes
(train.py --resume from its last checkpoint; the corpus and chat commands go on from their own manifests);
one started or finished with another stamp starts afresh in an emptied folder. A stage writes only its own
folder, so a later failure never touches what a finished stage wrote.
"""

import glob
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import config
import fileio
from chain import plan as chain_plan
from chain import runfile

ROOT = os.path.dirname(runfile.CONFIGS)
# The code a stage's output depends on: every Python file of the project the stages run (not the tests,
# the benchmarks or the chain itself, which only orders them).
CODE_GLOBS = ("*.py", "*/*.py")
CODE_SKIP = ("tests", "bench", "scripts", "web", "chain")


class ChainStopped(Exception):
    """Ctrl-C (or SIGTERM) during a stage: the stage stopped at a safe point, nothing was stamped."""


class StageFailed(Exception):
    """A stage's command ended with an error; str() names the stage, its log and how to rerun it."""


def code_version():
    digest = hashlib.sha256()
    for pattern in CODE_GLOBS:
        for path in sorted(glob.glob(os.path.join(ROOT, pattern))):
            if os.path.relpath(path, ROOT).split(os.sep)[0] in CODE_SKIP:
                continue
            digest.update(os.path.relpath(path, ROOT).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()[:16]


def stage_inputs(chain, stage):
    """What the stage is made from, as the command reads it: the sections of its resolved config it
    uses, or its own fields."""
    record = {k: v for k, v in stage.items() if k != "args"}
    record["args"] = runfile.stage_args(chain, stage)
    if "config" in stage:
        cfg = runfile.load_stage_config(chain, stage)
        downloads = ("corpus-download", "corpus", "chat-download")
        sections = ("data",) if stage["command"] in downloads else tuple(cfg)
        if stage["command"] == "chat-prepare":
            sections = ("data", "model")
        record["config"] = {name: cfg[name] for name in sections}
    if "settings" in stage:
        record["settings"] = config.load_layer("agent", os.path.join(runfile.CONFIGS, stage["settings"]))
    if stage["command"] == "ask":  # the questions are the serve layer's, and so is the server
        record["settings"] = config.load_layer(
            "serve", os.path.join(runfile.CONFIGS, "serve", "default.yaml")
        )
    if "config" in record:
        record["files"] = local_files(input_patterns(record["config"].get("data", {})), chain["folder"])
    return record


def input_patterns(data_cfg):
    """The local files a data section reads: the corpus's sources that are not downloaded, the chat files."""
    sources = (data_cfg.get("corpus") or {}).get("sources", [])
    chat = data_cfg.get("chat") or {}
    return [s["path"] for s in sources if "hub" not in s] + chat.get("train", []) + chat.get("val", [])


def local_files(patterns, run_folder):
    """(path, size, modification time) of each file the patterns name: an edited input reruns its stage.
    Files in the run folder are an earlier stage's output, which its stamp already stands for."""
    found, ours = [], os.path.abspath(os.path.join(ROOT, run_folder)) + os.sep
    for pattern in patterns:
        for path in sorted(glob.glob(os.path.join(ROOT, pattern))):
            if os.path.abspath(path).startswith(ours):
                continue
            info = os.stat(path)
            found.append([os.path.relpath(path, ROOT), info.st_size, info.st_mtime_ns])
    return found


def stamps(chain):
    """{stage: stamp}: each stage's inputs, the stamps of the stages before it and the code's version."""
    code, result, upstream = code_version(), {}, []
    for stage in chain["stages"]:
        text = json.dumps([stage_inputs(chain, stage), upstream, code], sort_keys=True, default=str)
        result[stage["name"]] = hashlib.sha256(text.encode()).hexdigest()[:16]
        upstream = upstream + [result[stage["name"]]]
    return result


def mark_path(chain, name, kind):
    return os.path.join(chain["folder"], "chain", f"{name}.{kind}")


def read_mark(chain, name, kind):
    try:
        with open(mark_path(chain, name, kind), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_mark(chain, name, kind, record):
    os.makedirs(os.path.dirname(mark_path(chain, name, kind)), exist_ok=True)
    fileio.write_json(mark_path(chain, name, kind), record)


def finished(chain, stamp_of):
    """The stages whose stamp matches what they would be made from now."""
    return {n for n, s in stamp_of.items() if (read_mark(chain, n, "done") or {}).get("stamp") == s}


def prepare_stage(chain, stage, stamp, log):
    """Whether the stage resumes: a start with the same stamp resumes, any other start begins afresh in an
    emptied folder (a stale finished stage loses its stamp first)."""
    name = stage["name"]
    started = read_mark(chain, name, "started")
    if started and started.get("stamp") == stamp:
        return True
    if os.path.exists(mark_path(chain, name, "done")):
        os.remove(mark_path(chain, name, "done"))
    folder = runfile.folder_of(chain, name)
    if stage["command"] in runfile.OWN_FOLDER and os.path.isdir(folder):
        log(f"  {name}: made from other inputs before; starting it afresh")
        shutil.rmtree(folder)
    write_mark(chain, name, "started", {"stamp": stamp, "time": time.time()})
    return False


def shell_line(argv):
    words = [os.path.relpath(argv[0], ROOT) if argv[0] == sys.executable else argv[0], *argv[1:]]
    return " ".join(shlex.quote(w) for w in words)


def run_stage(chain, stage, resuming, log_path):
    """Run the stage's command with its output in log_path and on the terminal; raise StageFailed or
    ChainStopped."""
    folder = runfile.folder_of(chain, stage["name"])
    resume = stage["command"] == "train" and resuming and bool(glob.glob(os.path.join(folder, "ckpt_*.pt")))
    argv = runfile.command_line(chain, stage, resume=resume)
    stop = {"signal": None}

    def note(signum, frame):  # the child gets the same Ctrl-C and stops at its own safe point
        stop["signal"] = signal.Signals(signum).name

    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with open(log_path, "ab") as log_file:
            log_file.write(f"$ {shell_line(argv)}\n".encode())
            log_file.flush()
            env = dict(os.environ, PYTHONUNBUFFERED="1")  # each line as it is printed, not at exit
            child = subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
            # Bytes as they come, not lines: the progress bars of the data commands redraw with \r.
            last = b"\n"
            while chunk := child.stdout.read1(65536):
                log_file.write(chunk)
                log_file.flush()
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
                last = chunk
            if not last.endswith(b"\n"):  # the chain's next line starts a line of its own
                sys.stdout.write("\n")
            code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stop["signal"]:
        raise ChainStopped(stop["signal"])
    if code == 0 and stage["command"] == "train":
        code = unfinished_training(chain, stage, log_path)
    if code != 0:
        raise StageFailed(
            f"stage {stage['name']} failed (exit {code}); log: {log_path}; "
            f"rerun it alone: {shell_line(runfile.command_line(chain, stage, resume=resume))}"
        )


def unfinished_training(chain, stage, log_path):
    """0 when the training stage wrote its last step's checkpoint, else 1 with a note in its log: train.py
    ends with status 0 when a signal from outside the chain (SIGTERM to it alone) stops it early."""
    steps = runfile.load_stage_config(chain, stage)["train"]["max_steps"]
    last = os.path.join(runfile.folder_of(chain, stage["name"]), f"ckpt_{steps:07d}.pt")
    if os.path.exists(last):
        return 0
    with open(log_path, "a", encoding="utf-8") as log_file:
        log_file.write(f"chain: {last} is missing: the run stopped before its last step\n")
    return 1


def run_chain(chain, plan, log=print):
    """Run the stages in order: skip what is done, resume what was cut, stamp what finishes."""
    stamp_of = stamps(chain)
    done = finished(chain, stamp_of)
    total = len(chain["stages"])
    log_dir = os.path.join(chain["folder"], "chain")
    os.makedirs(log_dir, exist_ok=True)
    for n, (stage, estimate) in enumerate(zip(chain["stages"], plan["stages"], strict=True), 1):
        name = stage["name"]
        if name in done:
            log(f"stage {n}/{total} {name}: done already (stamp {stamp_of[name]}), skipped")
            continue
        resuming = prepare_stage(chain, stage, stamp_of[name], log)
        verb = "resuming" if resuming else "starting"
        log(f"stage {n}/{total} {name}: {verb} (plan: {chain_plan.human_hours(estimate['hours'])})")
        start = time.time()
        run_stage(chain, stage, resuming, os.path.join(log_dir, f"{name}.log"))
        took = time.time() - start
        write_mark(chain, name, "done", {"stamp": stamp_of[name], "seconds": round(took, 1)})
        os.remove(mark_path(chain, name, "started"))
        log(
            f"stage {n}/{total} {name}: done in {chain_plan.human_hours(took / 3600)} "
            f"({took:.0f} s; plan {chain_plan.human_hours(estimate['hours'])})"
        )


def write_run_report(chain, plan, final_run):
    """<folder>/report.md, the run's own report: each stage's measured time beside the plan's estimate,
    the data sources with their licences, and where the report card, the export and the answers are."""
    lines = [
        f"# Run {chain['board']} ({plan['hardware']['name']})",
        "",
        "| stage | took | plan |",
        "|---|---:|---:|",
    ]
    for stage, estimate in zip(chain["stages"], plan["stages"], strict=True):
        seconds = (read_mark(chain, stage["name"], "done") or {}).get("seconds")
        took = "–" if seconds is None else f"{seconds:.0f} s"
        lines.append(f"| {stage['name']} | {took} | {chain_plan.human_hours(estimate['hours'])} |")
    lines += ["", "## Data sources and their licences", ""]
    lines += [f"- {line.strip()}" for line in chain_plan.licence_lines(plan["stages"])[1:]]
    lines += ["", "## What it made", "", f"- the model: `{final_run}` (`make serve RUN={final_run}`)"]
    for name, path in (("report card", os.path.join(final_run, "report.md")),
                       ("answers of the served model", os.path.join(chain["folder"], "ask", "answers.md"))):  # fmt: skip
        if os.path.isfile(path):
            lines.append(f"- the {name}: `{path}`")
    exports = sorted(glob.glob(os.path.join(final_run, "export-*")))
    lines += [f"- an export: `{path}`" for path in exports]
    lines.append(
        f"- the plan as printed at the start: `{os.path.join(chain['folder'], 'chain', 'plan.txt')}`"
    )
    path = os.path.join(chain["folder"], "report.md")
    fileio.write_atomic(path, lambda f: f.write(("\n".join(lines) + "\n").encode()))
    return path
