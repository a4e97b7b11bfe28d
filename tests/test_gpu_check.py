"""bench/gpu_check.py, the GPU acceptance check: its plumbing runs on the CPU with tiny shapes (the way CI runs
`make gpu-check DEVICE=cpu`); the board and profile rules are checked against the capabilities of the
boards the project has profiles for."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT
from users_shell import users_env

import config
from bench import gpu_check
from hardware import DeviceCaps

STAMP = ".venv/.requirements.stamp"  # `make -o STAMP`: the shared .venv as it is, never reinstalled


def test_make_gpu_check_on_the_cpu_runs_every_step_and_writes_the_report(tmp_path):
    report = tmp_path / "gpu-report.md"
    env = users_env()
    done = subprocess.run(
        ["make", "-o", STAMP, "gpu-check", "DEVICE=cpu", f"ARGS=--cpu-ranks 2 --work {tmp_path / 'work'} --report {report}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "setup (venv and packages) took" in done.stdout and "all steps passed" in done.stdout
    text = report.read_text()
    verdicts = dict(re.findall(r"^\| (\w+) \| (PASS|FAIL|skipped) \|", text, re.MULTILINE))
    steps = ("board", "data", "pretrain", "resume", "ddp", "export", "serve")  # ddp: 2 gloo ranks
    assert [verdicts[step] for step in steps] == ["PASS"] * len(steps)
    assert verdicts["eval"] in ("PASS", "skipped")  # evaluation/runs.py, when the checkout has it
    for figure in ("matmul 512x512 in float32", "tokens/s (median of", "MFU: ", "PASS resume-check", "2 ranks: 2 steps",
                   "largest |difference|", "greedy continuation of 16 tokens: identical", "decode through"):  # fmt: skip
        assert figure in text, figure


RTX_2060 = DeviceCaps(True, "NVIDIA GeForce RTX 2060", (7, 5), bf16_native=False)
H100 = DeviceCaps(True, "NVIDIA H100 80GB HBM3", (9, 0), bf16_native=True)
RTX_5090 = DeviceCaps(True, "NVIDIA GeForce RTX 5090", (12, 0), bf16_native=True)
A100 = DeviceCaps(True, "NVIDIA A100-SXM4-80GB", (8, 0), bf16_native=True)


def test_each_board_gets_its_profile_and_run_file_and_another_board_is_told_what_to_write():
    assert gpu_check.pick_profile("cuda", RTX_2060)[0] == "turing-2060"
    assert gpu_check.pick_profile("cuda", H100)[0] == "hopper-h200"  # sm90, the same dense bf16 peak
    assert gpu_check.pick_profile("cuda", RTX_5090)[0] == "blackwell-5090"
    assert gpu_check.pick_profile("cpu", DeviceCaps(False))[0] == "cpu"
    for name in gpu_check.BOARDS.values():  # the board's run file trains tiny-50m on that profile
        run_file = os.path.join(ROOT, "configs", f"pretrain-{name.split('-')[-1]}.yaml")
        cfg = config.load(run_file)
        assert cfg["hardware"]["name"] == name and cfg["model"]["n_layers"] == 12
    with pytest.raises(
        gpu_check.CheckError, match=r"no shipped hardware profile for NVIDIA A100-SXM4-80GB \(sm80\)"
    ):
        gpu_check.pick_profile("cuda", A100)
    with pytest.raises(gpu_check.CheckError, match=r"RTX 2060 \(sm75\) has no native bf16"):
        gpu_check.pick_profile("cuda", RTX_2060, "hopper-h200")  # a profile the board cannot run
    with pytest.raises(gpu_check.CheckError, match="no CUDA device.*make gpu-check DEVICE=cpu"):
        gpu_check.pick_profile("cuda", DeviceCaps(False))


def test_a_failing_step_is_in_the_report_and_the_exit_status(tmp_path):
    report = tmp_path / "report.md"
    status = gpu_check.main(["--device", "cpu", "--profile", "nada", "--work", str(tmp_path / "w"),
                             "--report", str(report)])  # fmt: skip
    assert status == 1
    assert re.search(r"^\| board \| FAIL \| --profile nada: .*hardware/nada.yaml does not exist \|", report.read_text(),
                     re.MULTILINE)  # fmt: skip


# -----------------------------------------------------------------------------
# The offline check: an interpreter that has torch, numpy, pyyaml and sentencepiece only, the wheelhouse,
# and no package index or server to ask.

BASE = ("torch", "numpy", "pyyaml", "sentencepiece")  # what the GPU machine's interpreter brings


def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(names):
    """{canonical name: distribution} of these distributions and what they require, as installed here."""
    import importlib.metadata

    from packaging.requirements import Requirement

    found, todo = {}, list(names)
    while todo:
        name = todo.pop()
        if canonical(name) in found:
            continue
        dist = importlib.metadata.distribution(name)
        found[canonical(name)] = dist
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return found


def top_level_entries(dist):
    """The site-packages entries a distribution installed (its packages, modules and dist-info)."""
    return sorted({str(f).split("/")[0] for f in dist.files or [] if not str(f).startswith("..")})


def repack_wheel(dist, folder):
    """A wheel of an installed distribution (its files and dist-info, RECORD written anew): the test's
    wheelhouse is made from this machine's packages, so no index is needed to make it either."""
    import base64
    import hashlib
    import zipfile

    info = next(str(f).split("/")[0] for f in dist.files if str(f).split("/")[0].endswith(".dist-info"))
    wheel_info = dist.read_text("WHEEL").splitlines()
    tags = [line.split(": ")[1].split("-") for line in wheel_info if line.startswith("Tag: ")]
    tag = "-".join(".".join(dict.fromkeys(parts)) for parts in zip(*tags, strict=True))  # py2.py3-none-any
    name = f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}-{tag}.whl"
    records = []
    with zipfile.ZipFile(os.path.join(folder, name), "w", zipfile.ZIP_DEFLATED) as wheel:
        for entry in dist.files:
            path = str(entry)
            if path.startswith("..") or "__pycache__" in path or path == f"{info}/RECORD":
                continue
            content = dist.locate_file(entry).read_bytes()
            wheel.writestr(path, content)
            digest = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=").decode()
            records.append(f"{path},sha256={digest},{len(content)}")
        wheel.writestr(f"{info}/RECORD", "\n".join(records + [f"{info}/RECORD,,"]) + "\n")


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory):
    """A venv whose only packages are torch (with what torch needs), numpy, pyyaml and sentencepiece, linked
    from the shared .venv through a .pth file."""
    root = tmp_path_factory.mktemp("bare")
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True, timeout=300)
    base = root / "base"
    base.mkdir()
    for dist in closure(BASE).values():
        for entry in top_level_entries(dist):
            if not (base / entry).exists():
                (base / entry).symlink_to(dist.locate_file(entry))
    site = next((root / "venv" / "lib").glob("python3*/site-packages"))
    (site / "enlace-base.pth").write_text(str(base) + "\n")
    return root / "venv" / "bin" / "python"


@pytest.fixture(scope="module")
def wheelhouse_dir(tmp_path_factory):
    """requirements-gpu-check.txt's closure beyond the base, repacked from this machine, and the
    pretokenised shards the real packer writes."""
    from bench import wheelhouse

    out = tmp_path_factory.mktemp("wheelhouse")
    (out / "wheels").mkdir()
    with open(wheelhouse.REQUIREMENTS, encoding="utf-8") as f:
        wanted = [line.split("==")[0].strip() for line in f if line.strip() and not line.startswith("#")]
    base = closure(BASE)
    for key, dist in closure(wanted).items():
        if key not in base:
            repack_wheel(dist, out / "wheels")
    wheelhouse.write_manifest(
        str(out), wheelhouse.python_version(), wheelhouse.pack_data(str(out), ["gpu-check-cpu"])
    )
    return out


def no_network_env(tmp_path):
    """No index, no proxy that answers, no Hub: any attempt to reach one fails at once."""
    dead = "http://127.0.0.1:9"
    env = users_env(drop=("PYTHONPATH",))
    return env | {"PIP_INDEX_URL": f"{dead}/simple", "PIP_NO_INDEX": "1", "http_proxy": dead, "https_proxy": dead,
                  "HTTP_PROXY": dead, "HTTPS_PROXY": dead, "no_proxy": "127.0.0.1,localhost",
                  "HF_ENDPOINT": dead, "HOME": str(tmp_path)}  # fmt: skip


@pytest.mark.slow  # a venv, pip from the wheelhouse, and the check's training, export and server: minutes
def test_make_gpu_check_offline_runs_on_an_interpreter_with_torch_numpy_pyyaml_sentencepiece_and_the_wheelhouse(
    bare_python, wheelhouse_dir, tmp_path
):
    assert subprocess.run([bare_python, "-c", "import jsonschema"], capture_output=True).returncode != 0
    report = tmp_path / "gpu-report.md"
    hardware_file = tmp_path / "hardware" / "cpu.yaml"  # the measured block goes to a copy, not the repo's
    hardware_file.parent.mkdir()
    hardware_file.write_text(open(os.path.join(ROOT, "configs", "hardware", "cpu.yaml")).read())
    args = f"--work {tmp_path / 'work'} --report {report} --measured-file {hardware_file}"
    done = subprocess.run(
        ["make", "-o", STAMP, "gpu-check", "DEVICE=cpu", "OFFLINE=1", f"PYTHON={bare_python}",
         f"WHEELHOUSE={wheelhouse_dir}", f"ARGS={args}"],
        cwd=ROOT, env=no_network_env(tmp_path), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "all steps passed" in done.stdout
    text = report.read_text()
    verdicts = dict(re.findall(r"^\| ([\w-]+) \| (PASS|FAIL|skipped) \|", text, re.MULTILINE))
    for step in ("board", "data", "pretrain", "resume", "export", "serve"):
        assert verdicts[step] == "PASS", step
    assert verdicts["eval"] == "skipped" and "lm-eval is not installed" in text
    assert "the wheelhouse's gpu-check-cpu shards" in text and "nothing built here" in text
    assert "matmul 512x512 in bfloat16" in text and "matmul 512x512 in float16" in text
    assert not (tmp_path / "work" / "data").exists()  # no corpus was built
    measured = config.load_layer("hardware", str(hardware_file))["measured"]
    assert set(measured) == {"smoke"} and measured["smoke"]["tokens_per_s"] > 0
    assert "cpu, torch 2." in measured["smoke"]["machine"]


def test_offline_what_the_interpreter_or_the_wheelhouse_lacks_is_one_line(
    bare_python, wheelhouse_dir, tmp_path
):
    def check(python, house, device="cpu"):
        done = subprocess.run(
            [str(python), "-m", "bench.wheelhouse", "check", str(house), "--device", device],
            cwd=ROOT, env=no_network_env(tmp_path), capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode in (0, 2) and "Traceback" not in done.stderr, done.stderr
        return done.returncode, done.stderr.strip()

    assert check(bare_python, wheelhouse_dir) == (0, "")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    other = tmp_path / "other"
    shutil.copytree(wheelhouse_dir, other)
    manifest = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps(manifest | {"python": "3.99"}))
    status, line = check(bare_python, other)
    assert status == 2 and line.count("\n") == 0
    assert "wheels are for Python 3.99" in line and f"is Python {version}" in line
    status, line = check(bare_python, wheelhouse_dir, device="cuda")  # this torch is a CPU build
    assert status == 2 and line.startswith("gpu-check: torch ") and "is a CPU build" in line
    status, line = check(sys.executable, tmp_path / "nowhere")
    assert status == 2 and "manifest.json: missing; make the wheelhouse" in line
    bare_venv = tmp_path / "empty"  # no torch at all
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare_venv)], check=True, timeout=300)
    status, line = check(bare_venv / "bin" / "python", wheelhouse_dir)
    assert status == 2 and line.count("\n") == 0
    assert "lacks torch (torch), numpy (numpy), yaml (pyyaml), sentencepiece (sentencepiece)" in line


def test_a_torch_older_than_the_supported_range_is_one_line():
    from bench import wheelhouse

    assert wheelhouse.torch_version_problem("2.13.0+cu128", "12.8", "cuda") is None
    assert wheelhouse.torch_version_problem("2.11.1", "12.6", "cuda") is None
    assert wheelhouse.torch_version_problem("2.10.0+cu126", "12.6", "cuda") == (
        "torch 2.10.0+cu126 is outside the supported 2.11-2.13; install a CUDA torch 2.11-2.13"
    )
    assert "CPU build" in wheelhouse.torch_version_problem("2.12.0+cpu", None, "cuda")
