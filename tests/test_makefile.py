"""The Makefile: every target it declares is one a user can run (a dry run names its commands), and the
first ones a new user types work on a fresh clone."""

import os
import re
import shutil
import subprocess

import pytest
from conftest import ROOT, TINY


def phony_targets():
    with open(f"{ROOT}/Makefile", encoding="utf-8") as f:
        text = f.read()
    declared = re.search(r"^\.PHONY:((?:.*\\\n)*.*)$", text, re.MULTILINE).group(1)
    return declared.replace("\\", " ").split()


@pytest.mark.parametrize("target", phony_targets())
def test_every_declared_make_target_has_commands(target):
    # -B: as if nothing were built yet (an up-to-date `setup` has nothing to do, yet has commands).
    dry = subprocess.run(["make", "-n", "-B", target], cwd=ROOT, capture_output=True, text=True, timeout=60)
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
    # As a user's shell runs it: under `make test` the inherited MAKELEVEL/MAKEFLAGS would make the inner
    # make print "Entering/Leaving directory" lines around the output.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
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
