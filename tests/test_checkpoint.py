"""Checkpoints: atomic on disk, loadable with weights_only, RNG states handed back as CPU bytes."""

import hashlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import shard_overrides, tiny_config

import checkpoint
import config
import data
import fileio
import train
from chat import template
from corpus import pipeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fake_training_state(step):
    """The shape of a real checkpoint: tensors and plain containers only."""
    return {
        "step": step,
        "model": {"w": torch.full((4, 4), float(step))},
        "optimizer": {"state": {}, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95)}]},
        "ranks": [{"rng": checkpoint.rng_state(), "loader": {"position": step}}],
        "config": {"run_name": "t", "model": {}},
    }


def test_a_checkpoint_round_trips_through_weights_only_loading(tmp_path):
    path = checkpoint.save_checkpoint(str(tmp_path), 3, fake_training_state(3), keep_last=2)
    state = checkpoint.load_checkpoint(path)  # torch.load(..., weights_only=True) inside
    assert state["step"] == 3 and torch.equal(state["model"]["w"], torch.full((4, 4), 3.0))


def test_only_the_newest_keep_last_checkpoints_stay(tmp_path):
    for step in (10, 20, 30, 40):
        checkpoint.save_checkpoint(str(tmp_path), step, fake_training_state(step), keep_last=2)
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(str(tmp_path))] == [
        "ckpt_0000040.pt",
        "ckpt_0000030.pt",
    ]


def test_a_writer_killed_mid_write_leaves_nothing_a_resume_would_trust(tmp_path):
    checkpoint.save_checkpoint(str(tmp_path), 10, fake_training_state(10), keep_last=3)
    # A real writer process goes through fileio.write_atomic (what checkpoints use), writes half the checkpoint and is SIGKILLed.
    writer = textwrap.dedent(f"""
        import io, sys, time, torch
        sys.path.insert(0, {ROOT!r})
        import checkpoint, fileio
        buffer = io.BytesIO()
        torch.save({{"step": 20, "model": {{"w": torch.zeros(256, 1024)}}}}, buffer)
        payload = buffer.getvalue()

        def write_half_then_hang(f):
            f.write(payload[: len(payload) // 2])
            f.flush()
            print("half written", flush=True)
            time.sleep(60)

        fileio.write_atomic(checkpoint.checkpoint_path({str(tmp_path)!r}, 20), write_half_then_hang)
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "half written"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    leftovers = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert leftovers, "the killed writer should have left its temp file behind"
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(str(tmp_path))] == ["ckpt_0000010.pt"]
    path, state = checkpoint.load_newest_checkpoint(str(tmp_path))
    assert state["step"] == 10
    checkpoint.save_checkpoint(str(tmp_path), 30, fake_training_state(30), keep_last=3)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")], "stale temp files are cleaned up"


def test_a_truncated_newest_checkpoint_is_reported_and_the_previous_one_used(tmp_path):
    checkpoint.save_checkpoint(str(tmp_path), 10, fake_training_state(10), keep_last=3)
    newest = checkpoint.save_checkpoint(str(tmp_path), 20, fake_training_state(20), keep_last=3)
    with open(newest, "r+b") as f:
        f.truncate(os.path.getsize(newest) // 3)
    messages = []
    path, state = checkpoint.load_newest_checkpoint(str(tmp_path), log=messages.append)
    assert state["step"] == 10
    assert len(messages) == 1 and "skipping unreadable checkpoint" in messages[0] and newest in messages[0]


def test_resume_without_any_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="no usable checkpoint"):
        checkpoint.load_newest_checkpoint(str(tmp_path))


def test_rng_states_reach_the_setters_as_cpu_uint8(tmp_path, monkeypatch):
    # The GPU-server failure: a checkpoint loaded onto the GPU hands set_rng_state a CUDA tensor and torch
    # raises "RNG state must be a torch.ByteTensor". Whatever the stored form, the setters get CPU bytes.
    state = checkpoint.rng_state()
    state["torch_cpu"] = state["torch_cpu"].to(torch.int64)  # a state that lost its dtype on the way
    path = checkpoint.save_checkpoint(
        str(tmp_path), 1, fake_training_state(1) | {"ranks": [{"rng": state}]}, 2
    )
    loaded = checkpoint.load_checkpoint(path)["ranks"][0]["rng"]
    received = []
    real_setter = torch.set_rng_state
    monkeypatch.setattr(torch, "set_rng_state", lambda s: (received.append(s), real_setter(s)))
    checkpoint.set_rng_state(loaded)
    assert len(received) == 1
    assert received[0].device.type == "cpu" and received[0].dtype == torch.uint8


def test_restored_rng_states_replay_the_same_random_numbers():
    state = checkpoint.rng_state()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    expected = (random.random(), np.random.rand(), torch.rand(3))
    buffer.seek(0)
    checkpoint.set_rng_state(torch.load(buffer, weights_only=True))
    replay = (random.random(), np.random.rand(), torch.rand(3))
    assert replay[:2] == expected[:2] and torch.equal(replay[2], expected[2])


# -----------------------------------------------------------------------------
# Self-contained checkpoints: the tokenizer travels inside


@pytest.fixture(scope="module")
def retrained_data(tmp_path_factory, shard_data_dir):
    """A tiny run on a copy of the shard data, then that copy's tokenizer retrained (same vocabulary size,
    other pieces): the situation in which a checkpoint must not trust data/."""
    root = tmp_path_factory.mktemp("retrained")
    data_dir = root / "data"
    shutil.copytree(shard_data_dir, data_dir)
    cfg = tiny_config(root / "runs", "shards", data_dir, "run_name=bpe", "train.max_steps=2")
    train.train(cfg, log=lambda *a, **k: None)
    before = fileio.sha256_of_file(data_dir / "tokenizer.model")
    other = config.load(
        os.path.join(ROOT, "configs", "smoke-corpus-cpu.yaml"),
        shard_overrides(str(data_dir)) + ["data.tokenizer.character_coverage=0.98"],
    )
    pipeline.train_tokenizer(other["data"], log=lambda *a, **k: None)
    after = fileio.sha256_of_file(data_dir / "tokenizer.model")
    assert before != after, "the retrained tokenizer should differ"
    return cfg, before, after


def test_a_run_decodes_with_the_tokenizer_inside_its_checkpoint_not_the_retrained_one(retrained_data):
    cfg, trained_with, retrained = retrained_data
    state = checkpoint.load_checkpoint(checkpoint.list_checkpoints(train.run_dir_of(cfg))[0])
    record = state["tokenizer"]
    assert record["sha256"] == trained_with and hashlib.sha256(record["model"]).hexdigest() == trained_with
    assert record["chat_template_version"] == template.CHAT_TEMPLATE_VERSION
    warnings = []
    model, run_cfg, tokenizer, _ = checkpoint.load_run(train.run_dir_of(cfg), log=warnings.append)
    assert hashlib.sha256(tokenizer.processor.serialized_model_proto()).hexdigest() == trained_with
    assert not warnings
    from_data_dir = data.load_tokenizer(run_cfg["data"])
    text = "¿Dónde está el niño? ¡Aquí!"
    assert tokenizer.encode(text) != from_data_dir.encode(text), "the two tokenizers should disagree"


def test_sample_serve_and_export_use_the_tokenizer_inside_the_checkpoint(retrained_data, tmp_path):
    import export
    import sample
    from decode import load

    cfg, trained_with, retrained = retrained_data
    run_dir = train.run_dir_of(cfg)
    sha256 = lambda tokenizer: hashlib.sha256(tokenizer.processor.serialized_model_proto()).hexdigest()  # noqa: E731
    assert sha256(sample.load_run(run_dir)[2]) == trained_with
    assert sha256(load.load_model(run_dir, "cpu")[1]) == trained_with
    export.export(run_dir, "hf", str(tmp_path / "hf"), log=lambda *a: None)
    assert fileio.sha256_of_file(tmp_path / "hf" / "tokenizer.model") == trained_with != retrained


def test_inference_code_loads_checkpoints_without_importing_the_training_loop():
    # train.py pulls in the loop, DDP and the optimizer; sample, serve and export read runs through checkpoint.py.
    probe = "import sys, checkpoint, sample, serve.app, export; print('train' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_resuming_on_a_data_dir_with_another_tokenizer_is_refused_naming_both_hashes(retrained_data):
    cfg, trained_with, retrained = retrained_data
    more = json.loads(json.dumps(cfg))
    more["train"]["max_steps"] = 4
    with pytest.raises(train.TrainError) as excinfo:
        train.train(more, resume=True, log=lambda *a, **k: None)
    assert trained_with in str(excinfo.value) and retrained in str(excinfo.value)
    assert len(checkpoint.list_checkpoints(train.run_dir_of(cfg))) == 1, "nothing new was written"


def test_an_old_checkpoint_without_its_tokenizer_loads_from_the_data_dir_with_a_warning(
    tmp_path, shard_data_dir
):
    cfg = tiny_config(tmp_path, "shards", shard_data_dir, "run_name=old", "train.max_steps=2")
    train.train(cfg, log=lambda *a, **k: None)
    path = checkpoint.list_checkpoints(train.run_dir_of(cfg))[0]
    state = checkpoint.load_checkpoint(path)
    state["tokenizer"] = "sentencepiece"  # what checkpoints carried before
    torch.save(state, path)
    warnings = []
    _, _, tokenizer, _ = checkpoint.load_run(path, log=warnings.append)
    assert tokenizer.path == os.path.join(shard_data_dir, "tokenizer.model")
    assert len(warnings) == 2 and "predates self-contained checkpoints" in warnings[0]
    assert "does not record the chat template version" in warnings[1] and path in warnings[1]


def test_a_checkpoint_whose_stored_tokenizer_was_altered_is_refused(tmp_path, shard_data_dir):
    cfg = tiny_config(tmp_path, "shards", shard_data_dir, "run_name=altered", "train.max_steps=2")
    train.train(cfg, log=lambda *a, **k: None)
    path = checkpoint.list_checkpoints(train.run_dir_of(cfg))[0]
    state = checkpoint.load_checkpoint(path)
    state["tokenizer"]["model"] = state["tokenizer"]["model"][:-1] + b"x"
    torch.save(state, path)
    with pytest.raises(checkpoint.CheckpointError, match="does not match its sha256"):
        checkpoint.load_run(path)


def run_with_chat_template_version(tmp_path, shard_data_dir, version):
    """A tiny run's checkpoint, its recorded chat template version changed (None: removed)."""
    cfg = tiny_config(tmp_path, "shards", shard_data_dir, "run_name=template", "train.max_steps=2")
    train.train(cfg, log=lambda *a, **k: None)
    path = checkpoint.list_checkpoints(train.run_dir_of(cfg))[0]
    state = checkpoint.load_checkpoint(path)
    assert state["tokenizer"]["chat_template_version"] == template.CHAT_TEMPLATE_VERSION
    if version is None:
        del state["tokenizer"]["chat_template_version"]
    else:
        state["tokenizer"]["chat_template_version"] = version
    torch.save(state, path)
    return path, state["code_version"]


def test_sample_serve_and_export_refuse_a_run_trained_with_another_chat_template_version(
    tmp_path, shard_data_dir
):
    import export
    import sample
    from decode import load

    other = template.CHAT_TEMPLATE_VERSION + 1
    path, commit = run_with_chat_template_version(tmp_path, shard_data_dir, other)
    refusals = []
    for attempt, error in [
        (lambda: sample.load_run(path), sample.SampleError),
        (lambda: load.load_model(path, "cpu"), load.LoadError),
        (lambda: export.export(path, "hf", str(tmp_path / "hf"), log=lambda *a: None), export.ExportError),
    ]:
        with pytest.raises(error) as excinfo:
            attempt()
        refusals.append(str(excinfo.value))
    for message in refusals:
        assert message.startswith(f"{path}: trained with chat template version {other}, ")
        assert f"this code renders version {template.CHAT_TEMPLATE_VERSION}" in message
        assert f"check out the commit it was trained with ({commit})" in message
    assert not os.path.exists(tmp_path / "hf"), "the export wrote nothing"


def test_a_checkpoint_without_its_chat_template_version_loads_with_a_warning(tmp_path, shard_data_dir):
    path, _ = run_with_chat_template_version(tmp_path, shard_data_dir, None)
    warnings = []
    checkpoint.load_run(path, log=warnings.append)
    assert warnings == [
        f"warning: {path} does not record the chat template version it was trained with; "
        f"assuming this code's (version {template.CHAT_TEMPLATE_VERSION})"
    ]


def test_a_run_is_served_on_the_device_it_trained_on_where_this_machine_has_it(tmp_path, monkeypatch):
    gpu_run, cpu_run, copied = tmp_path / "gpu", tmp_path / "cpu", tmp_path / "copied"
    for run, device in ((gpu_run, "cuda"), (cpu_run, "cpu")):
        run.mkdir()
        (run / "config.yaml").write_text(f"hardware:\n  name: x\n  device: {device}\n")
    copied.mkdir()  # a checkpoint without its run's config.yaml
    said = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert checkpoint.device_for(str(gpu_run), log=said.append) == "cuda"
    assert checkpoint.device_for(str(gpu_run / "ckpt_000100.pt"), log=said.append) == "cuda"
    assert checkpoint.device_for(str(cpu_run), log=said.append) == "cpu"
    assert checkpoint.device_for(str(copied), log=said.append) == "cpu"
    assert checkpoint.device_for(str(cpu_run), "cuda", log=said.append) == "cuda"  # asked for: as asked
    assert said == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert checkpoint.device_for(str(gpu_run), log=said.append) == "cpu"
    assert said == [f"{gpu_run}: trained on cuda, but this machine has no CUDA device: running on the CPU"]
