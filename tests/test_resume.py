"""The owner's acceptance criterion: resuming from a checkpoint reproduces an uninterrupted run, every
parameter and every optimizer tensor bit for bit, for both loaders, with gradient accumulation."""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, start_training, tiny_args, tiny_config, wait_for_step

import checkpoint
import train

STEPS = 8
quiet = lambda *a, **k: None  # noqa: E731


@pytest.fixture(params=["bytes", "shards", "chat"])
def dataset(request, byte_data_dir, shard_data_dir):
    if request.param == "chat":  # SFT: packed conversations with a loss mask
        return "chat", request.getfixturevalue("chat_data_dir")
    return request.param, byte_data_dir if request.param == "bytes" else shard_data_dir


def final_checkpoint(cfg):
    return checkpoint.load_checkpoint(train.list_checkpoints(train.run_dir_of(cfg))[0])


def assert_bit_identical(a, b):
    count, differing, largest = checkpoint.compare_states(a, b)
    assert a["step"] == b["step"] == STEPS
    assert count > 0 and not differing, (
        f"{len(differing)} tensors differ (largest {largest}): {differing[:5]}"
    )


def test_resume_after_a_max_steps_stop_is_bit_exact_with_accumulation(tmp_path, dataset):
    # decay_fraction 0: the schedule of a run that will be extended does not depend on max_steps.
    kind, data_dir = dataset
    full = tiny_config(tmp_path, kind, data_dir, "run_name=full", "train.decay_fraction=0")
    train.train(full, log=quiet)

    half = tiny_config(
        tmp_path, kind, data_dir, "run_name=split", "train.decay_fraction=0", f"train.max_steps={STEPS // 2}"
    )
    assert train.train(half, log=quiet) == STEPS // 2
    rest = tiny_config(tmp_path, kind, data_dir, "run_name=split", "train.decay_fraction=0")
    assert rest["train"]["grad_accum_steps"] > 1
    assert train.train(rest, resume=True, log=quiet) == STEPS

    assert_bit_identical(final_checkpoint(full), final_checkpoint(rest))


def test_resume_after_sigterm_is_bit_exact_with_accumulation(tmp_path, dataset):
    kind, data_dir = dataset
    steps = 150  # long enough that SIGTERM lands mid-run; the schedule is the same for both runs
    common = [
        f"train.max_steps={steps}",
        "train.warmup_steps=20",
        "train.ckpt_interval=1000",
        "train.eval_interval=0",
    ]
    full = tiny_config(tmp_path, kind, data_dir, "run_name=full", *common)
    train.train(full, log=quiet)

    args = tiny_args(tmp_path, kind, data_dir, "run_name=split", *common)
    proc = start_training(args)
    wait_for_step(os.path.join(tmp_path, "split", "metrics.jsonl"), 5, proc)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output
    assert "(SIGTERM); continue with --resume" in output
    stopped_at = checkpoint.load_checkpoint(train.list_checkpoints(os.path.join(tmp_path, "split"))[0])[
        "step"
    ]
    assert 5 <= stopped_at < steps

    rest = tiny_config(tmp_path, kind, data_dir, "run_name=split", *common)
    assert train.train(rest, resume=True, log=quiet) == steps
    a, b = final_checkpoint(full), final_checkpoint(rest)
    count, differing, largest = checkpoint.compare_states(a, b)
    assert a["step"] == b["step"] == steps
    assert not differing, f"{len(differing)}/{count} tensors differ (largest {largest})"


def test_resume_check_command_prints_pass(tmp_path, byte_data_dir):
    args = tiny_args(tmp_path, "bytes", byte_data_dir, "run_name=check")
    result = subprocess.run(
        [sys.executable, "train.py", *args, "--resume-check"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    last_line = result.stdout.strip().splitlines()[-1]
    assert last_line.startswith("PASS resume-check:") and "bit-identical" in last_line
    assert os.listdir(tmp_path) == [], "the check cleans up its scratch runs"


@pytest.mark.parametrize("sig, phase", [(signal.SIGTERM, "uninterrupted"), (signal.SIGINT, "resumed")])
def test_a_signal_ends_the_resume_check_at_once_without_a_verdict_or_leftovers(
    tmp_path, byte_data_dir, sig, phase
):
    steps = 40  # the signal lands while the phase under test still has steps to go
    args = tiny_args(tmp_path, "bytes", byte_data_dir, f"train.max_steps={steps}", "train.eval_interval=0")
    proc = subprocess.Popen(
        [sys.executable, "train.py", *args, "train.ckpt_interval=1000", "--resume-check"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 600  # generous: a loaded 2-core machine runs these steps slowly
    metrics = []
    while not metrics or not wait_until_step(metrics[0], steps // 2 + 2 if phase == "resumed" else 2):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the check ended or stalled before the signal: {proc.communicate()}")
        metrics = glob.glob(os.path.join(tmp_path, "resume-check-*", phase, "metrics.jsonl"))
        time.sleep(0.01)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, stderr
    assert f"resume-check interrupted by {sig.name}: no verdict" in stderr
    assert "PASS" not in stdout + stderr and "FAIL" not in stdout + stderr
    if phase == "uninterrupted":
        assert "resume to" not in stdout, "the check went on to its next phase"
    assert os.listdir(tmp_path) == [], "the scratch runs are removed"


def wait_until_step(metrics_path, step):
    with open(metrics_path) as f:
        return any(json.loads(line).get("step", 0) >= step for line in f if line.strip())


def test_resume_check_reports_fail_with_the_largest_difference(tmp_path):
    a = {"step": 2, "model": {"w": torch.zeros(3)}, "optimizer": {"state": {0: {"exp_avg": torch.ones(3)}}}}
    b = {"step": 2, "model": {"w": torch.tensor([0.0, 0.5, 0.0])}, "optimizer": a["optimizer"]}
    count, differing, largest = checkpoint.compare_states(a, b)
    assert (count, differing, largest) == (2, ["model.w"], 0.5)


def test_resume_with_a_changed_shape_is_refused_listing_the_differences(tmp_path, byte_data_dir):
    cfg = tiny_config(tmp_path, "bytes", byte_data_dir, "run_name=shape", "train.max_steps=2")
    train.train(cfg, log=quiet)
    changed = tiny_config(
        tmp_path, "bytes", byte_data_dir, "run_name=shape", "model.d_model=64", "train.micro_batch_size=2"
    )
    with pytest.raises(train.TrainError) as excinfo:
        train.train(changed, resume=True, log=quiet)
    message = str(excinfo.value)
    assert "shape-defining settings changed" in message
    assert "model.d_model: checkpoint has 32, config has 64" in message
    assert "train.micro_batch_size: checkpoint has 4, config has 2" in message


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path, byte_data_dir):
    cfg = tiny_config(tmp_path, "bytes", byte_data_dir, "run_name=nothing")
    with pytest.raises(train.TrainError, match="no usable checkpoint"):
        train.train(cfg, resume=True, log=quiet)


def test_a_fresh_run_never_overwrites_a_run_with_checkpoints(tmp_path, byte_data_dir):
    cfg = tiny_config(
        tmp_path, "bytes", byte_data_dir, "run_name=taken", "train.max_steps=2", "train.replace_run=false"
    )
    train.train(cfg, log=quiet)
    with pytest.raises(train.TrainError, match="already holds checkpoints; pass --resume"):
        train.train(cfg, log=quiet)


def test_the_float16_grad_scaler_path_resumes_bit_exact(tmp_path, byte_data_dir):
    # The RTX 2060 path (float16 autocast + GradScaler) run on the CPU's float16 autocast; config.py keeps
    # real CPU runs in float32, so the profile is switched on the resolved dict. The scaler's state
    # travels in the checkpoint.
    def fp16(cfg):
        cfg["hardware"] |= {"dtype": "float16", "grad_scaler": True}
        return cfg

    common = ["train.decay_fraction=0"]
    full = fp16(tiny_config(tmp_path, "bytes", byte_data_dir, "run_name=full", *common))
    train.train(full, log=quiet)
    half = fp16(tiny_config(tmp_path, "bytes", byte_data_dir, "run_name=split", *common, "train.max_steps=4"))
    train.train(half, log=quiet)
    assert final_checkpoint(half)["scaler"]["_growth_tracker"] == 4
    rest = fp16(tiny_config(tmp_path, "bytes", byte_data_dir, "run_name=split", *common))
    train.train(rest, resume=True, log=quiet)
    a, b = final_checkpoint(full), final_checkpoint(rest)
    assert_bit_identical(a, b)
    assert a["scaler"] == b["scaler"]
