"""The micro-batch that fits: microbatch.py's estimate of a training step's peak memory, held to the
peak measured on the CPU (every tensor the allocator hands out, from the profiler's memory events)."""

import os
import subprocess
import sys

import pytest
import torch
import yaml

import config
import microbatch
import objective
import optim
from bench import model as bench_model
from model import Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def layer(kind, name):
    return config.load_layer(kind, os.path.join(ROOT, "configs", kind, f"{name}.yaml"))


def small_model(**changes):
    cfg = layer("model", "smoke")
    cfg.update(changes)
    return cfg


def measured_step_peak(model_cfg, micro_batch, dtype, loss_chunk_size):
    """Peak bytes of a steady-state training step as train.py runs it (autocast, AdamW, gradients set to
    None): what lives before the step (weights, optimizer state) plus the step's own peak."""
    torch.manual_seed(0)
    net = Transformer(model_cfg, "flash", loss_chunk_size)
    optimizer = optim.build_optimizer(net, layer("train", "smoke"), "float32")
    shape = (micro_batch, model_cfg["seq_len"])
    idx, targets = (
        torch.randint(0, model_cfg["vocab_size"], shape),
        torch.randint(0, model_cfg["vocab_size"], shape),
    )

    def step():
        with torch.autocast("cpu", dtype=getattr(torch, dtype), enabled=dtype != "float32"):
            _, losses = net(idx, targets)
        losses["loss"].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # AdamW's state now exists, as on every later step
    before = sum(p.nbytes for p in net.parameters())
    before += sum(t.nbytes for state in optimizer.state.values() for t in state.values())
    return before + bench_model.allocated_peak(step)


SHAPES = {  # the positions x vocab logits decide the first two, the vocab x d_model gradients the third
    "d64 L2 T32 vocab 1000 B4": (dict(d_model=64, n_layers=2, ffn_hidden=96, seq_len=32, vocab_size=1000), 4),
    "d128 L3 T64 vocab 4000 B4": (
        dict(d_model=128, n_layers=3, ffn_hidden=352, seq_len=64, vocab_size=4000),
        4,
    ),
    "d256 L2 T64 vocab 8000 B2, MHA": (
        dict(d_model=256, n_layers=2, n_kv_heads=4, ffn_hidden=768, seq_len=64, vocab_size=8000),
        2,
    ),
}
CASES = [(shape, dtype) for shape in SHAPES for dtype in ("float32", "bfloat16")]
CASES.append(("d64 L2 T32 vocab 1000 B4", "float16"))  # the RTX 2060's dtype: the sizes of bfloat16's


@pytest.mark.parametrize("loss_chunk_size", [0, 32])
@pytest.mark.parametrize("shape, dtype", CASES)
def test_the_estimated_step_peak_is_within_3_percent_of_the_measured_one(shape, dtype, loss_chunk_size):
    changes, micro_batch = SHAPES[shape]
    model_cfg = small_model(**changes)
    measured = measured_step_peak(model_cfg, micro_batch, dtype, loss_chunk_size)
    estimated = microbatch.step_peak_bytes(model_cfg, micro_batch, dtype, loss_chunk_size)
    assert abs(estimated / measured - 1) <= 0.03, (estimated, measured)


def test_the_parameter_count_is_the_models():
    for name in ("smoke", "tiny-50m"):
        cfg = layer("model", name)
        with torch.device("meta"):
            assert microbatch.parameter_counts(cfg)[0] == Transformer(cfg).num_params()


def test_the_largest_micro_batch_is_the_last_whose_estimate_fits():
    cfg, memory = layer("model", "tiny-50m"), 10.5 * microbatch.GIB
    for dtype, chunk in (("float16", 0), ("float16", 1024), ("float32", 1024)):
        fits = microbatch.largest_micro_batch(cfg, dtype, chunk, memory)
        assert fits > 0
        assert microbatch.step_peak_bytes(cfg, fits, dtype, chunk) <= memory
        assert microbatch.step_peak_bytes(cfg, fits + 1, dtype, chunk) > memory
    assert microbatch.largest_micro_batch(cfg, "float16", 1024, 1) == 0
    # At 32,000 tokens of vocabulary the full logits decide: chunked, twice the micro-batch fits.
    assert microbatch.largest_micro_batch(cfg, "float16", 1024, memory) >= 2 * microbatch.largest_micro_batch(
        cfg, "float16", 0, memory
    )


def test_a_run_on_a_gpu_profile_logs_its_estimate_and_warns_when_the_micro_batch_may_not_fit():
    cfg, profile_2060 = layer("model", "tiny-50m"), layer("hardware", "turing-2060")
    dtype, chunk, memory_gib = (profile_2060[key] for key in ("dtype", "loss_chunk_size", "memory_gib"))
    line = objective.memory_line(cfg, 16, dtype, chunk, memory_gib)
    assert line.startswith("memory: ~") and "GiB estimated for a step of 16 sequences" in line
    assert "WARNING" not in line
    full_logits = objective.memory_line(cfg, 16, dtype, 0, memory_gib)
    assert "WARNING: it may not fit hardware.memory_gib: lower train.micro_batch_size to" in full_logits
    assert "or set hardware.loss_chunk_size" in full_logits


def test_the_command_prints_a_run_and_the_gpu_table():
    run = subprocess.run(
        [sys.executable, "microbatch.py", "configs/pretrain-2060.yaml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert "loss in chunks of 1024" in run.stdout and "full logits" in run.stdout
    table = subprocess.run(
        [sys.executable, "microbatch.py", "--table"], cwd=ROOT, capture_output=True, text=True
    )
    assert table.returncode == 0, table.stderr
    rows = [line for line in table.stdout.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0][2:].strip("`") for row in rows[1:]] == microbatch.TABLE_PROFILES
    bad = subprocess.run(
        [sys.executable, "microbatch.py", "configs/pretrain-2060.yaml", "hardware.memory_gib=-1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "hardware.memory_gib" in bad.stderr


def test_every_shipped_hardware_profile_names_its_chunk_and_memory():
    for name in ("cpu", "turing-2060", "blackwell-5090", "hopper-h200"):
        with open(os.path.join(ROOT, "configs", "hardware", f"{name}.yaml"), encoding="utf-8") as f:
            profile_cfg = yaml.safe_load(f)["hardware"]
        assert profile_cfg["loss_chunk_size"] > 0, name  # the chunked loss is on everywhere
        assert (profile_cfg["memory_gib"] is None) == (profile_cfg["device"] == "cpu"), name


def test_the_docs_show_the_table_the_command_prints():
    with open(os.path.join(ROOT, "docs", "entrenamiento.md"), encoding="utf-8") as f:
        page = f.read().splitlines()
    assert all(row in page for row in microbatch.table())
