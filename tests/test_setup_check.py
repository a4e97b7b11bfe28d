"""`make setup` checks what it needs before it makes .venv (scripts/check_setup.py): each missing
prerequisite is one line saying how to get it on Debian/Ubuntu, the exit is non-zero and nothing is
installed."""

import ast
import os
import shutil
import subprocess
import sys

from conftest import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "check_setup.py")
BASE_PYTHON = os.path.realpath(sys.executable)  # the interpreter itself, not this venv's link to it


def hidden_path(tmp_path, *tools):
    """A PATH folder holding only these tools: the compiler and ninja are not on it."""
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    for tool in tools:
        os.symlink(shutil.which(tool), folder / tool)
    return str(folder)


def check(*args, path=None, cwd=ROOT):
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    if path is not None:
        env["PATH"] = path
    return subprocess.run(
        [BASE_PYTHON, SCRIPT, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )


def test_a_machine_with_everything_passes_silently(tmp_path):
    done = check("--min-python", "3.11", "--min-free-gib", "0.001", "--venv", str(tmp_path / ".venv"))
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_a_hidden_compiler_and_ninja_are_one_line_each_with_their_debian_package(tmp_path):
    done = check("--min-python", "3.11", "--min-free-gib", "0", path=hidden_path(tmp_path))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1
    compiler = [line for line in lines if line.startswith("setup: no C++ compiler")]
    ninja = [line for line in lines if line.startswith("setup: no ninja")]
    assert len(compiler) == 1 and compiler[0].endswith("sudo apt install g++"), done.stderr
    assert len(ninja) == 1 and ninja[0].endswith("sudo apt install ninja-build"), done.stderr
    assert lines[-1] == f"setup: {len(lines) - 1} missing (above); nothing was installed"


def test_too_little_free_disk_for_a_fresh_install_names_the_threshold_but_an_existing_venv_passes(tmp_path):
    fresh = check("--min-python", "3.11", "--min-free-gib", "1e9", "--venv", str(tmp_path / ".venv"))
    assert fresh.returncode == 1
    assert f"GiB free under {tmp_path}, the install needs 1e+09 GiB (SETUP_FREE_GIB)" in fresh.stderr
    (tmp_path / ".venv").mkdir()
    again = check("--min-python", "3.11", "--min-free-gib", "1e9", "--venv", str(tmp_path / ".venv"))
    assert again.returncode == 0, again.stderr


def test_a_python_below_the_floor_names_the_packages_and_the_make_variable_to_use_them():
    done = check("--min-python", "99.1", "--min-free-gib", "0")
    assert done.returncode == 1
    assert "is too old: ENLACE needs 99.1 or newer" in done.stderr
    assert (
        "sudo apt install python99.1 python99.1-venv python99.1-dev, then make setup PYTHON=python99.1"
        in (done.stderr)
    )


def test_the_check_parses_on_the_old_python3_of_a_debian_11():
    with open(SCRIPT, encoding="utf-8") as f:
        ast.parse(f.read(), feature_version=(3, 6))


def test_make_setup_stops_before_making_the_venv_when_the_compiler_and_ninja_are_hidden(tmp_path):
    clone = tmp_path / "clone"
    (clone / "scripts").mkdir(parents=True)
    (clone / "chain").mkdir()
    for name in (
        "Makefile",
        "chain/commands.mk",
        "requirements.txt",
        "requirements-dev.txt",
        "scripts/check_setup.py",
    ):
        shutil.copy2(os.path.join(ROOT, name), clone / name)
    path = hidden_path(tmp_path, "make", "sh")
    os.symlink(BASE_PYTHON, os.path.join(path, "python3"))
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    done = subprocess.run(
        ["make", "--no-print-directory", "setup", "SETUP_FREE_GIB=0"],
        cwd=clone,
        env={**env, "PATH": path},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "setup: no C++ compiler" in done.stderr and "setup: no ninja" in done.stderr
    assert not (clone / ".venv").exists()
