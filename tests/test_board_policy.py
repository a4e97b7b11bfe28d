"""Each board's dtype policy on the CPU (configs/hardware/cpu-2060.yaml: float16 + GradScaler, Newton-Schulz
in float16, the loss in chunks; cpu-bf16.yaml: the 5090's and H200's bfloat16), at tiny shapes: pretraining,
SFT, DPO and the agent's SFT run a few steps, a float16 run cut in two resumes bit for bit, and a NaN streak
stops in one line with the last good checkpoint kept. What only a board shows is printed, not pretended."""

import json
import math
import os

import pytest
import torch
import yaml
from conftest import ROOT, tiny_config, write_jsonl
from test_dpo import dpo_config, pair_data  # noqa: F401 (a fixture, used by name)
from test_train import training_losses_times

import checkpoint
import hardware
import train
from agent import dataset, tools

POLICIES = ("cpu-2060", "cpu-bf16")
quiet = lambda *a, **k: None  # noqa: E731


def policy(name):
    """The profile's keys as command-line overrides: the run file's own hardware layer replaced whole."""
    with open(os.path.join(ROOT, "configs", "hardware", f"{name}.yaml"), encoding="utf-8") as f:
        profile = yaml.safe_load(f)["hardware"]
    return [f"hardware.{key}={json.dumps(value)}" for key, value in profile.items()]


def steps_of(cfg):
    with open(os.path.join(train.run_dir_of(cfg), "metrics.jsonl"), encoding="utf-8") as f:
        return [r for r in map(json.loads, f) if "loss" in r]


def run(cfg):
    lines = []
    train.train(cfg, log=lines.append)
    records = steps_of(cfg)
    assert records and all(math.isfinite(r["loss"]) for r in records), records
    assert records[-1]["skipped_steps"] == 0
    profile = cfg["hardware"]
    assert hardware.not_exercised(profile) in lines  # the run says what it did not exercise
    assert ("loss_scale" in records[-1]) == profile["grad_scaler"]
    return records


@pytest.mark.parametrize("name", POLICIES)
def test_pretraining_with_muon_runs_under_each_boards_policy(name, tmp_path, shard_data_dir):
    cfg = tiny_config(
        tmp_path, "shards", shard_data_dir, "run_name=pre", "train.optimizer=muon", *policy(name)
    )
    assert cfg["hardware"]["loss_chunk_size"] < cfg["train"]["micro_batch_size"] * cfg["model"]["seq_len"]
    run(cfg)


@pytest.mark.parametrize("name", POLICIES)
def test_sft_and_dpo_run_under_each_boards_policy(name, tmp_path, chat_data_dir, pair_data):  # noqa: F811
    sft = tiny_config(tmp_path, "chat", chat_data_dir, "run_name=sft", *policy(name))
    run(sft)
    dpo = dpo_config(pair_data, train.run_dir_of(sft), tmp_path, "run_name=dpo", *policy(name))
    records = run(dpo)
    assert all("margin" in r for r in records)


@pytest.fixture(scope="module")
def agent_conversations(tmp_path_factory):
    """A few generated tool-use conversations (the agent's SFT data), as make agent-data writes them."""
    settings = tools.load_settings()
    settings["synthetic"]["conversations"] = 40
    settings["synthetic"]["eval_fraction"] = 0.2
    train_rows, held_out = dataset.generate(settings)
    folder = tmp_path_factory.mktemp("agent")
    write_jsonl(folder / "train.jsonl", train_rows)
    write_jsonl(folder / "val.jsonl", held_out)
    return folder


@pytest.mark.parametrize("name", POLICIES)
def test_the_agents_sft_runs_under_each_boards_policy(name, tmp_path, agent_conversations, shard_data_dir):
    from chat import prepare

    (agent_conversations / "shard_dir.txt").write_text(shard_data_dir, encoding="utf-8")
    cfg = tiny_config(
        tmp_path, "chat", str(agent_conversations), "run_name=agent", "model.seq_len=1024",
        f"data.dir={tmp_path}/packed", "data.chat.too_long=truncate", "train.micro_batch_size=2",
        *policy(name),
    )  # fmt: skip
    prepare.prepare(cfg, log=quiet)
    run(cfg)


def test_a_float16_run_cut_in_two_resumes_bit_for_bit(tmp_path, byte_data_dir):
    # decay_fraction 0: the schedule of a run that will be extended does not depend on max_steps.
    common = ["train.decay_fraction=0", "train.optimizer=muon", *policy("cpu-2060")]
    full = tiny_config(tmp_path, "bytes", byte_data_dir, "run_name=full", *common)
    train.train(full, log=quiet)
    half = tiny_config(tmp_path, "bytes", byte_data_dir, "run_name=split", "train.max_steps=4", *common)
    assert train.train(half, log=quiet) == 4
    rest = tiny_config(tmp_path, "bytes", byte_data_dir, "run_name=split", *common)
    assert train.train(rest, resume=True, log=quiet) == 8
    a, b = (checkpoint.load_checkpoint(train.list_checkpoints(train.run_dir_of(c))[0]) for c in (full, rest))
    assert a["scaler"] == b["scaler"] and a["scaler"]["scale"] > 1
    count, differing, largest = checkpoint.compare_states(a, b)  # every parameter and optimizer tensor
    assert a["step"] == b["step"] == 8 and count > 0 and not differing, (differing[:5], largest)


def test_a_nan_streak_under_float16_stops_in_one_line_and_keeps_the_last_good_checkpoint(
    tmp_path, byte_data_dir
):
    cfg = tiny_config(
        tmp_path, "bytes", byte_data_dir, "run_name=nan", "train.max_nonfinite=3", "train.max_steps=20",
        *policy("cpu-2060"),
    )  # fmt: skip
    with training_losses_times(float("nan"), from_step=3):
        with pytest.raises(train.TrainError) as stopped:
            train.train(cfg, log=quiet)
    (line,) = str(stopped.value).splitlines()
    assert line.startswith("step 5: 3 consecutive non-finite") and "last good checkpoint" in line
    _, state = train.load_newest_checkpoint(str(tmp_path / "nan"))
    assert state["step"] == 4 and all(torch.isfinite(t).all() for t in state["model"].values())
