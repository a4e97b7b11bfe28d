"""
The wheelhouse of the offline GPU check: what `make gpu-check OFFLINE=1` needs beyond an interpreter that
already has torch, packed on a machine with a package index and carried to one without.

    python -m bench.wheelhouse build OUT [--python-version 3.12]    make wheelhouse: wheels + shards
    python -m bench.wheelhouse check OUT --device cuda|cpu           this interpreter against OUT, one line
    python -m bench.wheelhouse install OUT                           pip --no-index from OUT's wheels

OUT/wheels/ holds requirements-gpu-check.txt's packages and their dependencies (binary wheels for one
Python version, pip download), OUT/data/<name>/ the pretokenised shards, tokenizer and manifest of the
embedded smoke corpus as the check's data layers read them (configs/data/corpus-smoke.yaml for a board,
configs/gpu-check-cpu.yaml's for DEVICE=cpu), and OUT/manifest.json the Python version, the wheels and the
data. `check` imports nothing beyond the standard library until it has said what is missing: this interpreter
runs it before anything is installed.
"""

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIREMENTS = os.path.join(ROOT, "requirements-gpu-check.txt")
# The data layers packed: the folder under OUT/data/ and the run file whose data layer it is (the check's
# own for DEVICE=cpu, built in data/gpu-check-cpu/ here; the smoke corpus for a board).
DATA = {"corpus-smoke": "configs/smoke-corpus-cpu.yaml", "gpu-check-cpu": "configs/gpu-check-cpu.yaml"}
DATA_FILES = ("manifest.json", "tokenizer.model", "tokenizer_info.json", "train_[0-9]*.bin", "val_[0-9]*.bin")
TORCH_RANGE = ((2, 11), (2, 13))  # the CUDA torch releases the training path is written for, both included
BASE_MODULES = {"torch": "torch", "numpy": "numpy", "yaml": "pyyaml", "sentencepiece": "sentencepiece"}
LIMIT_MB = 50  # what the wheels may weigh


class WheelhouseError(Exception):
    """One line saying what is missing or wrong, and what would fix it."""


def python_version():
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def read_manifest(out):
    path = os.path.join(out, "manifest.json")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError:
        raise WheelhouseError(f"{path}: missing; make the wheelhouse with `make wheelhouse` where pip "
                              "reaches a package index and copy the folder here") from None  # fmt: skip
    except ValueError as e:
        raise WheelhouseError(f"{path}: unreadable ({e}); make the wheelhouse again") from None


def torch_version_problem(version, cuda, device):
    """One line when this torch cannot run the check (an older release, or a CPU build for a board)."""
    release = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    low, high = TORCH_RANGE
    if not low <= release <= high:
        supported = f"{low[0]}.{low[1]}-{high[0]}.{high[1]}"
        return f"torch {version} is outside the supported {supported}; install a CUDA torch {supported}"
    if device == "cuda" and not cuda:
        return f"torch {version} is a CPU build; the check on a board needs a CUDA torch (2.11-2.13)"
    return None


def check(out, device):
    """Raise WheelhouseError naming the first thing this interpreter or OUT lacks."""
    manifest = read_manifest(out)
    if manifest["python"] != python_version():
        raise WheelhouseError(
            f"{out}: its wheels are for Python {manifest['python']}, this interpreter ({sys.executable}) is "
            f"Python {python_version()}; make the wheelhouse again with PY_VERSION={python_version()}"
        )
    import importlib.util

    missing = [f"{module} ({package})" for module, package in BASE_MODULES.items()
               if importlib.util.find_spec(module) is None]  # fmt: skip
    if missing:
        raise WheelhouseError(
            f"{sys.executable} lacks {', '.join(missing)}: the check runs on an interpreter that has torch, "
            "numpy, pyyaml and sentencepiece; the wheelhouse brings the rest"
        )
    import torch

    problem = torch_version_problem(torch.__version__, torch.version.cuda, device)
    if problem:
        raise WheelhouseError(problem)
    wanted = os.path.join(out, "data", "gpu-check-cpu" if device == "cpu" else "corpus-smoke")
    if not glob.glob(os.path.join(wanted, "train_[0-9]*.bin")):
        raise WheelhouseError(f"{wanted}: no train shards; make the wheelhouse again")


def install(out):
    """pip install --no-index from OUT's wheels into this interpreter's environment (what it has already
    is kept); skipped when the same wheels were installed before."""
    wheels = sorted(os.listdir(os.path.join(out, "wheels")))
    stamp = os.path.join(sys.prefix, ".enlace-gpu-check-wheels")
    if os.path.exists(stamp) and open(stamp, encoding="utf-8").read().split() == wheels:
        return False
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--find-links",
               os.path.join(out, "wheels"), "-r", REQUIREMENTS]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise WheelhouseError(f"pip install --no-index from {out}/wheels failed: {last}")
    with open(stamp, "w", encoding="utf-8") as f:
        f.write("\n".join(wheels))
    return True


# -----------------------------------------------------------------------------
# build (on a machine with a package index)


def download_wheels(out, version):
    """pip download of requirements-gpu-check.txt and its dependencies, binary wheels for `version`."""
    target = os.path.join(out, "wheels")
    shutil.rmtree(target, ignore_errors=True)
    os.makedirs(target)
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "-d", target,
               "-r", REQUIREMENTS]  # fmt: skip
    if version != python_version():
        platforms = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
        command += ["--python-version", version, "--implementation", "cp"]
        command += [word for platform in platforms for word in ("--platform", platform)]
    if subprocess.run(command).returncode != 0:
        raise WheelhouseError("pip download failed (above): make wheelhouse needs a package index")


def pack_data(out, names=tuple(DATA), log=print):
    """Each packed data layer built here (the corpus steps skip what is up to date) and copied to OUT."""
    import config
    from corpus import pipeline

    packed = {}
    for name in names:
        run_file = DATA[name]
        layer = config.load(os.path.join(ROOT, run_file))["data"]
        if name == "gpu-check-cpu":  # built in the work folder by the check itself otherwise
            layer = layer | {"dir": os.path.join(ROOT, "data", "gpu-check-cpu")}
        for step in (pipeline.build_corpus, pipeline.train_tokenizer, pipeline.encode):
            step(layer, log=log)
        folder = os.path.join(out, "data", name)
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        files = sorted(
            path for pattern in DATA_FILES for path in glob.glob(os.path.join(layer["dir"], pattern))
        )
        for path in files:
            shutil.copy2(path, folder)
        packed[name] = {"run_file": run_file, "files": [os.path.basename(path) for path in files]}
    return packed


def write_manifest(out, version, packed):
    """OUT/manifest.json: the Python the wheels are for, the wheels and their weight, the data packed."""
    wheels = sorted(os.listdir(os.path.join(out, "wheels")))
    size = sum(os.path.getsize(os.path.join(out, "wheels", name)) for name in wheels) / 1e6
    if size > LIMIT_MB:
        raise WheelhouseError(f"{out}/wheels: {size:.1f} MB, over the {LIMIT_MB} MB a wheelhouse may weigh")
    manifest = {"python": version, "wheels": wheels, "wheels_mb": round(size, 1), "data": packed}
    with open(os.path.join(out, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
    return manifest


def build(out, version, log=print):
    download_wheels(out, version)
    manifest = write_manifest(out, version, pack_data(out, log=log))
    wheels, size = manifest["wheels"], manifest["wheels_mb"]
    log(f"wheelhouse: {out}/: {len(wheels)} wheels for Python {version} ({size:.1f} MB) and the shards of "
        f"{', '.join(manifest['data'])}; copy it to the GPU machine and run "
        f"`make gpu-check PYTHON=... OFFLINE=1 WHEELHOUSE={out}`")  # fmt: skip


def main(argv):
    parser = argparse.ArgumentParser(prog="python -m bench.wheelhouse", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("build", "check", "install"))
    parser.add_argument("out", help="the wheelhouse folder")
    parser.add_argument("--python-version", default=python_version(), help="build: the GPU machine's X.Y")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            build(args.out, args.python_version)
        elif args.command == "check":
            check(args.out, args.device)
        elif install(args.out):
            print(f"gpu-check: installed {args.out}/wheels into {sys.prefix} (no index asked)")
    except WheelhouseError as e:
        print(f"gpu-check: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
