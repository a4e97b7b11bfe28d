"""bench/gpu_check.py, the GPU acceptance check: its plumbing runs on the CPU with tiny shapes (the way CI runs
`make gpu-check DEVICE=cpu`); the board and profile rules are checked against the capabilities of the
boards the project has profiles for."""

import os
import re
import subprocess

import pytest
from conftest import ROOT

import config
from bench import gpu_check
from hardware import DeviceCaps

STAMP = ".venv/.requirements.stamp"  # `make -o STAMP`: the shared .venv as it is, never reinstalled


def test_make_gpu_check_on_the_cpu_runs_every_step_and_writes_the_report(tmp_path):
    report = tmp_path / "gpu-report.md"
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
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
