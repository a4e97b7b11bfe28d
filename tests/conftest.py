"""Shared fixtures: tiny runs built from the shipped run files plus overrides (a config is data)."""

import gzip
import json
import os
import subprocess
import sys
import time

import pytest

import config
import data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A model and schedule small enough that a run of a few steps takes well under a second on the CPU.
TINY = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_hidden=64",
    "model.seq_len=16",
    "train.micro_batch_size=4",
    "train.grad_accum_steps=2",
    "train.max_steps=8",
    "train.warmup_steps=2",
    "train.decay_fraction=0.25",
    "train.eval_interval=4",
    "train.eval_batches=2",
    "train.log_interval=1",
    "train.ckpt_interval=2",
    "train.keep_last=2",
    "train.sample_tokens=0",
    "hardware.peak_tflops=1.0",  # skips the ~1 s start-up matmul that measures the MFU reference
]


def spanish_text(max_chars):
    with gzip.open(os.path.join(ROOT, "corpus", "fortunes-es.txt.gz"), "rt", encoding="utf-8") as f:
        return f.read(max_chars)


@pytest.fixture(scope="session")
def byte_data_dir(tmp_path_factory):
    """train.bin / val.bin of real Spanish text, as scripts/prepare_smoke_data.sh lays them out."""
    folder = tmp_path_factory.mktemp("bytes")
    text = spanish_text(60_000).encode("utf-8")
    (folder / "train.bin").write_bytes(text[:50_000])
    (folder / "val.bin").write_bytes(text[50_000:])
    return str(folder)


@pytest.fixture(scope="session")
def shard_data_dir(tmp_path_factory):
    """The stage-1 pipeline (corpus -> tokenizer -> shards) run small on the embedded corpus."""
    folder = tmp_path_factory.mktemp("shards")
    cfg = config.load(os.path.join(ROOT, "configs", "smoke-corpus-cpu.yaml"), shard_overrides(str(folder)))
    data_cfg = cfg["data"]
    data.build_corpus(data_cfg, log=lambda *a: None)
    data.train_tokenizer(data_cfg, log=lambda *a: None)
    data.encode(data_cfg, log=lambda *a: None)
    return str(folder)


def shard_overrides(folder):
    return [
        f"data.dir={folder}",
        "data.corpus.max_documents_per_file=400",
        "data.tokenizer.vocab_size=512",
        "data.tokenizer.character_coverage=0.995",
        "model.vocab_size=512",
        "data.encode.tokens_per_shard=8000",
        "data.processes=1",
    ]


def tiny_args(runs_dir, data_kind, data_dir, *overrides):
    """train.py arguments of a tiny run over the byte or shard test data, writing runs under runs_dir."""
    if data_kind == "bytes":
        run_file, data_overrides = "configs/smoke-cpu.yaml", [f"data.dir={data_dir}"]
    else:
        run_file, data_overrides = "configs/smoke-corpus-cpu.yaml", shard_overrides(data_dir)
    return [run_file, *TINY, *data_overrides, f"train.runs_dir={runs_dir}", *overrides]


def tiny_config(runs_dir, data_kind, data_dir, *overrides):
    """The resolved config of tiny_args(...)."""
    run_file, *rest = tiny_args(runs_dir, data_kind, data_dir, *overrides)
    return config.load(os.path.join(ROOT, run_file), rest)


def start_training(args):
    """train.py in a subprocess, its output captured: for tests that signal a real training process."""
    command = [sys.executable, "train.py", *args]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_step(metrics_path, step, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"training ended before step {step}: {proc.communicate()}"
        if os.path.exists(metrics_path):
            with open(metrics_path) as f:
                if any(json.loads(line).get("step", 0) >= step for line in f if line.strip()):
                    return
        time.sleep(0.01)
    raise AssertionError(f"no step {step} in {metrics_path} after {timeout}s")
