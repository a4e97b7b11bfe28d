"""The Makefile: every target it declares is one a user can run (a dry run names its commands), and the
first ones a new user types work on a fresh clone."""

import os
import re
import shlex
import shutil
import subprocess

import pytest
from conftest import ROOT, TINY
from users_shell import users_env


def phony_targets():
    with open(f"{ROOT}/Makefile", encoding="utf-8") as f:
        text = f.read()
    declared = re.search(r"^\.PHONY:((?:.*\\\n)*.*)$", text, re.MULTILINE).group(1)
    return declared.replace("\\", " ").split()


@pytest.mark.parametrize("target", phony_targets())
def test_every_declared_make_target_has_commands(target):
    # -B: as if nothing were built yet (an up-to-date `setup` has nothing to do, yet has commands).
    dry = subprocess.run(
        ["make", "-n", "-B", target], cwd=ROOT, env=users_env(), capture_output=True, text=True, timeout=60
    )
    assert dry.returncode == 0, dry.stderr
    assert "Nothing to be done" not in dry.stdout + dry.stderr, f"make {target} has no recipe"
    assert dry.stdout.strip(), f"make {target} runs nothing"


@pytest.mark.parametrize("old, new", [("chat", "sample-chat"), ("eval", "bpb")])
def test_a_renamed_target_names_its_new_name_and_runs_nothing(old, new):
    # `make chat` ran sample.py, not chat/, and `make eval` the run's bits per byte, not evaluation/'s suites
    done = subprocess.run(
        ["make", "--no-print-directory", old, "RUN=runs/none"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )  # under `make test` the inner make would print its directory (MAKELEVEL is inherited)
    assert done.returncode == 2 and f"make {old} is now make {new} RUN=" in done.stderr
    assert done.stdout == ""


# -----------------------------------------------------------------------------
# A new user's first commands: on a fresh clone nothing is built yet, so the targets build their data.

STAMP = ".venv/.requirements.stamp"  # `make -o STAMP`: the shared .venv is used as it is, never reinstalled
SMALL_DATA = "data.corpus.max_documents_per_file=400"  # the embedded corpus, cut to keep the build short


def fresh_clone(tmp_path):
    """The files git tracks in this checkout, as a fresh clone has them (no data/, no runs/), with this
    checkout's .venv."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    clone = tmp_path / "clone"
    for name in filter(None, listed.decode().split("\0")):
        if os.path.isfile(os.path.join(ROOT, name)):  # a tracked file deleted in the working tree is skipped
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.join(ROOT, name), clone / name)
    os.symlink(os.path.realpath(os.path.join(ROOT, ".venv")), clone / ".venv")
    assert not (clone / "data").exists() and not (clone / "runs").exists()
    return clone


def make(clone, *args):
    env = users_env()
    return subprocess.run(
        ["make", "-o", STAMP, *args], cwd=clone, env=env, capture_output=True, text=True, timeout=600
    )


def test_make_resume_check_and_make_bpb_build_their_data_on_a_fresh_clone(tmp_path):
    clone = fresh_clone(tmp_path)
    overrides = " ".join([*TINY, SMALL_DATA])
    check = make(clone, "resume-check", "CONFIG=configs/smoke-cpu.yaml", f"ARGS={overrides}")
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]
    assert "PASS resume-check:" in check.stdout.strip().splitlines()[-1]
    assert (clone / "data" / "smoke" / "train.bin").exists()

    # A run whose data is gone (trained elsewhere, copied here): make bpb rebuilds it from the run's config.
    train = [".venv/bin/python", "train.py", "configs/smoke-cpu.yaml", *TINY, SMALL_DATA]
    subprocess.run(train, cwd=clone, capture_output=True, check=True, timeout=600)
    shutil.rmtree(clone / "data")
    evaluation = make(clone, "bpb", "RUN=runs/smoke-cpu")
    assert evaluation.returncode == 0, evaluation.stdout[-2000:] + evaluation.stderr[-2000:]
    assert re.search(
        r"val split: \d+ tokens, \d+ bytes \| loss [\d.]+ \| bpb [\d.]+$", evaluation.stdout, re.M
    )


def test_make_eval_bench_and_make_report_work_on_a_fresh_clone(tmp_path):
    clone = fresh_clone(tmp_path)
    # Without runs/smoke-corpus-cpu both targets train it first (make smoke-corpus), as make serve does.
    for target in ("eval-bench", "report"):
        dry = make(clone, "-n", target, "RUN=runs/smoke-corpus-cpu", "TASKS=fixtures")
        assert "train.py configs/smoke-corpus-cpu.yaml" in dry.stdout, target
    # Here the run is trained small (the same pipeline and run file, fewer documents, steps and tokens).
    small = [
        SMALL_DATA,
        "data.tokenizer.vocab_size=512",
        "model.vocab_size=512",
        "data.encode.tokens_per_shard=8000",
    ]
    python = ".venv/bin/python"
    subprocess.run([python, "-m", "corpus", "all", "configs/smoke-corpus-cpu.yaml", *small], cwd=clone,
                   capture_output=True, check=True, timeout=600)  # fmt: skip
    subprocess.run([python, "train.py", "configs/smoke-corpus-cpu.yaml", *TINY, *small], cwd=clone,
                   capture_output=True, check=True, timeout=600)  # fmt: skip
    bench = make(clone, "eval-bench", "RUN=runs/smoke-corpus-cpu", "TASKS=fixtures")
    assert bench.returncode == 0, bench.stdout[-2000:] + bench.stderr[-2000:]
    assert (
        "| enlace_fixture_choice | 0 | 16 | acc,none |" in bench.stdout and "**centred score:" in bench.stdout
    )
    assert (clone / "runs" / "smoke-corpus-cpu" / "eval" / "0000008-fixtures.json").is_file()
    report = make(clone, "report", "RUN=runs/smoke-corpus-cpu")
    assert report.returncode == 0, report.stdout[-2000:] + report.stderr[-2000:]
    card = (clone / "runs" / "smoke-corpus-cpu" / "report.md").read_text()
    assert "| enlace_fixture_choice | 0 | 16 | acc,none |" in card and "per token over" in card
    assert (clone / "runs" / "smoke-corpus-cpu" / "plot.png").is_file()


# -----------------------------------------------------------------------------
# One table of the stages' commands (chain/commands.mk): a target that runs a kind of chain stage runs the
# command line the chain runs for that stage.

# The chain's commands no make target runs: the chain alone downloads a suite's tasks and asks its server.
CHAIN_ONLY = {"eval-download", "ask"}


def target_of(chain, stage, tail):
    """(make target, its variables, which line of its dry run) that run the stage's command, given the
    words the chain puts after it (`tail`: the stage's own words, its wiring, --resume or --force)."""
    from chain import runfile

    command = stage["command"]
    run_file = os.path.join("configs", stage.get("config", ""))
    run = runfile.folder_of(chain, stage["from"]) if "from" in stage else None
    args = {"ARGS": shlex.join(tail)}
    if command == "corpus-download":
        return "corpus-download", {"CONFIG": run_file, **args}, -1
    if command == "corpus":  # resume-check builds the data first, as the chain's corpus stage does
        return "resume-check", {"CONFIG": run_file, **args}, 0
    if command in ("chat-download", "chat-prepare"):  # no ARGS: sft passes its own to train.py alone
        return command, {"SFT_CONFIG": run_file}, -1
    if command == "train":
        return "pretrain", {"CONFIG": run_file, "RESUME": "1", "ARGS": shlex.join(tail[:-1])}, -1
    if command == "agent-data":  # make agent-data-16k is the stage with configs/agent/ladder-16k.yaml
        folder = runfile.folder_of(chain, stage["name"])
        if "settings" in stage:
            assert stage["settings"] == "agent/ladder-16k.yaml"
            return "agent-data-16k", {"AGENT_DATA_16K": folder}, -1
        return "agent-data", {"AGENT_DATA": folder}, -1
    if command == "evaluate":
        return "eval-bench", {"RUN": run, "TASKS": stage["tasks"], **args}, -1
    if command == "report":
        return "report", {"RUN": run, **args}, -1
    if command == "export":
        return (
            "export",
            {"RUN": run, "OUT": os.path.join(run, f"export-{stage['to']}"), "TO": stage["to"], **args},
            -1,
        )
    if command == "tool-eval":  # make agent-eval passes --generated $(AGENT_DATA)/eval.jsonl itself
        at = tail.index("--generated")
        generated = tail[at + 1]
        assert generated.endswith("/eval.jsonl")
        rest = tail[:at] + tail[at + 2 :]
        return (
            "agent-eval",
            {"RUN": run, "AGENT_DATA": os.path.dirname(generated), "ARGS": shlex.join(rest)},
            -1,
        )
    raise AssertionError(f"no make target runs the chain's {command} stage")


@pytest.mark.parametrize("board", ["cpu", "2060", "h200"])
def test_each_target_that_runs_a_chain_stage_runs_the_command_line_the_chain_runs(board):
    from chain import commands, runfile

    chain, _ = runfile.load(board)
    for stage in chain["stages"]:
        if stage["command"] in CHAIN_ONLY:
            continue
        argv = runfile.command_line(chain, stage, resume=True)[1:]
        ending = ["--force"] if stage["command"] == "export" else []
        tail = runfile.stage_args(chain, stage) + runfile.wiring(chain, stage) + ending
        if stage["command"] == "train":
            tail += commands.command("resume")
        target, variables, line = target_of(chain, stage, tail)
        dry = subprocess.run(
            ["make", "-n", "-B", "-o", STAMP, target, *(f"{k}={v}" for k, v in variables.items())],
            cwd=ROOT, env=users_env(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert dry.returncode == 0, dry.stderr
        words = shlex.split(dry.stdout.strip().splitlines()[line])
        assert words[0] == ".venv/bin/python", (target, words)
        want = argv if "ARGS" in variables else argv[: len(argv) - len(tail)]
        assert words[1:] == want, f"make {target} and the chain's stage {stage['name']} differ"


def test_the_table_has_a_command_for_every_kind_of_stage_and_nothing_else():
    from chain import commands, runfile

    options = {"resume", "agent-settings"}  # words a command takes as an option, not a stage's kind
    assert set(commands.table()) - options == set(runfile.NEEDS)


def test_a_line_of_the_table_make_reads_but_the_chain_could_not_is_an_error_naming_it(tmp_path, monkeypatch):
    from chain import commands

    table = tmp_path / "commands.mk"
    table.write_text("# a comment\nSTAGE.train = train.py $(1)\nSTAGE.corpus = -m corpus all $(1)/x\n")
    monkeypatch.setattr(commands, "TABLE", str(table))
    commands.table.cache_clear()
    try:
        with pytest.raises(
            ValueError, match=r"commands.mk:3: not `STAGE.<name> = <words>` with each \$\(n\) a word"
        ):
            commands.table()
    finally:
        commands.table.cache_clear()
