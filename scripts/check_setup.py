"""What `make setup` needs before it creates .venv, checked with whatever python3 the system has: one
line per missing thing, saying how to get it on Debian/Ubuntu, and a non-zero exit. Nothing is installed.

    python3 scripts/check_setup.py --min-python 3.11 --min-free-gib 10 --venv .venv

It runs on an old python3 too (Debian 11 ships 3.9), so it keeps to what Python 3.6 parses (f-strings
yes; no walrus, no match, no `X | Y` types) and to the standard library. The thresholds come from the Makefile (SETUP_PYTHON_MIN, SETUP_FREE_GIB).
"""

import argparse
import importlib.util
import os
import shutil
import sys
import sysconfig


def version_of(text):
    try:
        return tuple(int(part) for part in text.split("."))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a version such as 3.11, got {text!r}") from None


def python_problems(minimum):
    """The interpreter's version, its venv module with pip (ensurepip) and its C headers."""
    here = "{}.{}".format(*sys.version_info[:2])
    wanted = ".".join(str(part) for part in minimum)
    if sys.version_info[: len(minimum)] < minimum:
        return [
            f"Python {here} ({sys.executable}) is too old: ENLACE needs {wanted} or newer. Debian/Ubuntu: sudo apt install "
            f"python{wanted} python{wanted}-venv python{wanted}-dev, then make setup PYTHON=python{wanted}"
        ]
    problems = []
    if importlib.util.find_spec("ensurepip") is None or importlib.util.find_spec("venv") is None:
        problems.append(
            f"python{here} cannot make a virtual environment (no ensurepip): sudo apt install python{here}-venv"
        )
    include = sysconfig.get_paths().get("include") or ""
    if not os.path.isfile(os.path.join(include, "Python.h")):
        problems.append(
            f"no Python.h for python{here} (the C++ kernels and the compiled decode step build against it): "
            f"sudo apt install python{here}-dev"
        )
    return problems


def tool_problems():
    """The C++ compiler and ninja that torch.utils.cpp_extension and AOTInductor build with."""
    problems = []
    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None and shutil.which("g++") is None:
        problems.append(
            f"no C++ compiler ({compiler} or g++ on PATH; without one the kernels and the compiled decode step "
            "turn off): sudo apt install g++"
        )
    if shutil.which("ninja") is None:
        problems.append(
            "no ninja on PATH (torch builds the C++ kernels with it): sudo apt install ninja-build"
        )
    return problems


def disk_problems(venv, min_free_gib):
    """Room for a fresh install: only when the virtual environment is not there yet."""
    if os.path.exists(venv):
        return []
    folder = os.path.dirname(os.path.abspath(venv))
    free_gib = shutil.disk_usage(folder).free / 2**30
    if free_gib < min_free_gib:
        return [
            f"{free_gib:.1f} GiB free under {folder}, the install needs {min_free_gib:g} GiB (SETUP_FREE_GIB): free some space or "
            "clone the repository onto a larger disk"
        ]
    return []


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--min-python", type=version_of, required=True, help="e.g. 3.11")
    parser.add_argument("--min-free-gib", type=float, required=True, help="free disk a fresh install needs")
    parser.add_argument("--venv", default=".venv", help="the virtual environment make setup creates")
    args = parser.parse_args(argv)
    problems = (
        python_problems(args.min_python) + tool_problems() + disk_problems(args.venv, args.min_free_gib)
    )
    for problem in problems:
        print("setup: " + problem, file=sys.stderr)
    if problems:
        print(f"setup: {len(problems)} missing (above); nothing was installed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
