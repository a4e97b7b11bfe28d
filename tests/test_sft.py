"""Supervised fine-tuning: packing conversations, the chat loader, init_from, and the held-out evaluation."""

import contextlib
import glob
import io
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import (
    CHAT_SEQ_LEN,
    ROOT,
    TINY,
    chat_overrides,
    data_layer,
    example_conversations,
    tiny_config,
    write_jsonl,
)

import checkpoint
import config
import data
import fileio
import microbatch
import sample
import train
from chat import prepare, template
from evaluation import bpb
from model import Transformer

quiet = lambda *a, **k: None  # noqa: E731


def sft_config(folder, shard_dir, *overrides):
    """configs/sft-smoke-cpu.yaml made tiny, over conversations in folder/{train,val}.jsonl."""
    args = [*TINY, *chat_overrides(str(folder), shard_dir), f"train.runs_dir={folder}/runs", *overrides]
    return config.load(os.path.join(ROOT, "configs", "sft-smoke-cpu.yaml"), args)


@pytest.fixture(scope="module")
def tokenizer(shard_data_dir):
    return data.SentencePieceTokenizer(os.path.join(shard_data_dir, "tokenizer.model"))


def packed(data_cfg, split):
    record = data.read_manifest(data_cfg)["prepare"][split]
    tokens = np.concatenate(
        [data.read_shard(os.path.join(data_cfg["dir"], s["name"])) for s in record["shards"]]
    )
    masks = np.concatenate(
        [data.read_shard(os.path.join(data_cfg["dir"], s["mask"])) for s in record["shards"]]
    )
    row_len = record["seq_len"] + 1
    return tokens.reshape(-1, row_len), masks.reshape(-1, row_len), record


def contains(row, ids):
    return any(list(row[i : i + len(ids)]) == ids for i in range(len(row) - len(ids) + 1))


# -----------------------------------------------------------------------------
# Packing


def test_best_fit_puts_each_conversation_in_the_fullest_row_it_fits():
    assert prepare.best_fit([5, 4, 3, 3, 1], 8) == [[0, 2], [1, 3, 4]]
    assert prepare.best_fit([8, 8], 8) == [[0], [1]]


def test_packed_rows_start_with_bos_and_hold_whole_conversations_with_their_masks(
    tmp_path, shard_data_dir, tokenizer
):
    conversations = example_conversations(30)
    write_jsonl(tmp_path / "train.jsonl", conversations)
    write_jsonl(tmp_path / "val.jsonl", example_conversations(5, start=50))
    cfg = sft_config(tmp_path, shard_data_dir)
    prepare.prepare(cfg, log=quiet)
    tokens, masks, record = packed(cfg["data"], "train")
    assert (tokens[:, 0] == tokenizer.bos_id).all()
    assert record["stats"]["packed"] == 30 and record["stats"]["rows"] == len(tokens) < 30
    flat_tokens, flat_masks = tokens.ravel().tolist(), masks.ravel().tolist()
    for conversation in conversations:  # each one contiguous, once, with the mask render() gives it
        ids, mask = template.render(conversation, tokenizer)
        rows = [r for r in range(len(tokens)) if contains(tokens[r], ids)]
        assert len(rows) >= 1
        start = next(i for i in range(len(flat_tokens)) if flat_tokens[i : i + len(ids)] == ids)
        assert flat_masks[start : start + len(ids)] == mask
    used = sum(len(template.render(c, tokenizer)[0]) for c in conversations)
    assert record["stats"]["tokens"] == used
    assert masks.sum() == sum(sum(template.render(c, tokenizer)[1]) for c in conversations)  # padding: mask 0


def test_too_long_conversations_are_dropped_and_counted_or_cut_after_an_answer(
    tmp_path, shard_data_dir, tokenizer
):
    long_answer = "Había una vez un barco muy pequeño que navegaba por el mar. " * 20
    too_long = {
        "messages": [
            {"role": "user", "content": "Hola"},
            {"role": "assistant", "content": "Hola, ¿qué tal?"},
            {"role": "user", "content": "Cuéntame un cuento"},
            {"role": "assistant", "content": long_answer},
        ]
    }
    write_jsonl(tmp_path / "train.jsonl", example_conversations(6) + [too_long])
    write_jsonl(tmp_path / "val.jsonl", example_conversations(2))
    cfg = sft_config(tmp_path, shard_data_dir, "data.chat.too_long=drop")
    logs = []
    prepare.prepare(cfg, log=logs.append)
    stats = packed(cfg["data"], "train")[2]["stats"]
    assert (stats["dropped_too_long"], stats["truncated"], stats["packed"]) == (1, 0, 6)
    assert any(f"{tmp_path}/train.jsonl:7" in line and "longer than a row" in line for line in logs)

    cfg = sft_config(tmp_path, shard_data_dir, "data.chat.too_long=truncate")
    prepare.prepare(cfg, log=quiet)
    tokens, _, record = packed(cfg["data"], "train")
    assert (record["stats"]["dropped_too_long"], record["stats"]["truncated"]) == (0, 1)
    first_turn = template.render({"messages": too_long["messages"][:2]}, tokenizer)[0]
    assert any(contains(row, first_turn) for row in tokens)


def test_truncation_never_ends_a_conversation_on_a_pending_tool_call(tokenizer):
    call = {"type": "function", "function": {"name": "calculadora", "arguments": {"expresion": "2+2"}}}
    conversation = {
        "messages": [
            {"role": "user", "content": "Hola"},
            {"role": "assistant", "content": "¡Hola!"},
            {"role": "user", "content": "¿Cuánto es 2+2?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "4"},
            {"role": "assistant", "content": "Son 4. " * 40},
        ]
    }
    with_call = template.render({"messages": conversation["messages"][:4]}, tokenizer)[0]
    first_answer = template.render({"messages": conversation["messages"][:2]}, tokenizer)
    assert len(with_call) < len(template.render(conversation, tokenizer)[0])
    assert prepare.truncate_at_turn(conversation, tokenizer, len(with_call)) == first_answer
    assert prepare.truncate_at_turn(conversation, tokenizer, len(first_answer[0]) - 1) is None


def test_prepare_resumes_after_the_last_finished_shard_and_a_rerun_does_nothing(tmp_path, shard_data_dir):
    write_jsonl(tmp_path / "train.jsonl", example_conversations(40))
    write_jsonl(tmp_path / "val.jsonl", example_conversations(4))
    cfg = sft_config(tmp_path, shard_data_dir, "data.chat.rows_per_shard=2")
    prepare.prepare(cfg, log=quiet)
    tokens, masks, record = packed(cfg["data"], "train")
    assert len(record["shards"]) >= 3
    # An interruption after the second shard: the manifest lists two, the rest are gone or half-written.
    manifest = data.read_manifest(cfg["data"])
    manifest["prepare"]["train"] |= {"complete": False, "shards": record["shards"][:2]}
    fileio.write_json(data.manifest_path(cfg["data"]), manifest)
    os.remove(os.path.join(cfg["data"]["dir"], record["shards"][-1]["name"]))
    logs = []
    prepare.prepare(cfg, log=logs.append)
    assert any("train resuming after 2 finished shard(s)" in line for line in logs)
    again = packed(cfg["data"], "train")
    assert np.array_equal(again[0], tokens) and np.array_equal(again[1], masks) and again[2]["complete"]
    logs = []
    prepare.prepare(cfg, log=logs.append)
    assert any("train up to date" in line for line in logs) and any("val up to date" in line for line in logs)


def test_a_bad_line_is_fatal_naming_file_and_line_or_skipped_when_configured(tmp_path, shard_data_dir):
    bad = [
        {"messages": [{"role": "robot", "content": "bip"}]},
        {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "4"}]},
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": " "}]},
    ]
    write_jsonl(tmp_path / "train.jsonl", example_conversations(2) + bad + example_conversations(2))
    write_jsonl(tmp_path / "val.jsonl", example_conversations(2))
    cfg = sft_config(tmp_path, shard_data_dir)
    with pytest.raises(
        template.ChatError, match=rf"{tmp_path}/train.jsonl:3: messages.0.role: 'robot' is not one of"
    ):
        prepare.prepare(cfg, log=quiet)
    assert not data.shard_paths(cfg["data"], "train")  # nothing half-written

    cfg = sft_config(tmp_path, shard_data_dir, "data.chat.bad_lines=skip")
    logs = []
    prepare.prepare(cfg, log=logs.append)
    assert packed(cfg["data"], "train")[2]["stats"]["skipped_bad_lines"] == 3
    assert packed(cfg["data"], "train")[2]["stats"]["packed"] == 4
    assert any("train.jsonl:4: messages.1: a tool message without a preceding" in line for line in logs)
    assert any("train.jsonl:5: messages.1: empty assistant content" in line for line in logs)


def test_a_file_that_is_not_utf8_is_refused_naming_the_line(tmp_path, shard_data_dir):
    good = json.dumps(example_conversations(1)[0]) + "\n"
    (tmp_path / "train.jsonl").write_bytes(
        good.encode() + '{"messages": [{"role": "user", "content": "caña"}]}\n'.encode("latin-1")
    )
    write_jsonl(tmp_path / "val.jsonl", example_conversations(2))
    cfg = sft_config(tmp_path, shard_data_dir)
    with pytest.raises(template.ChatError, match=r"train.jsonl:2: not UTF-8 \(byte 0xf1 at column 46\)"):
        prepare.prepare(cfg, log=quiet)
    assert not data.shard_paths(cfg["data"], "train")  # nothing half-written
    assert "prepare" not in data.read_manifest(cfg["data"])


# -----------------------------------------------------------------------------
# The chat loader


def chat_loader(chat_data_dir, shard_data_dir, split="train", rank=0, world_size=1, batch_size=4):
    cfg = sft_config(chat_data_dir, shard_data_dir)
    return data.build_loader(cfg["data"], split, batch_size, CHAT_SEQ_LEN, 7, rank, world_size)


def test_targets_are_minus_one_exactly_where_the_mask_is_zero(chat_data_dir, shard_data_dir):
    loader = chat_loader(chat_data_dir, shard_data_dir)
    tokens, masks, _ = packed(sft_config(chat_data_dir, shard_data_dir)["data"], "train")
    rows = {tuple(row[:-1]): (row, mask) for row, mask in zip(tokens.tolist(), masks.tolist(), strict=True)}
    for _ in range(3):
        x, y = loader.next_batch()
        for xi, yi in zip(x.tolist(), y.tolist(), strict=True):
            row, mask = rows[tuple(xi)]
            assert yi == [t if m else -1 for t, m in zip(row[1:], mask[1:], strict=True)]
            assert xi[0] == 1  # <|bos|>


def test_the_chat_loader_restores_its_exact_position_and_covers_each_row_once_per_epoch(
    chat_data_dir, shard_data_dir
):
    loader = chat_loader(chat_data_dir, shard_data_dir)
    for _ in range(5):
        loader.next_batch()
    state = loader.state_dict()
    expected = [loader.next_batch() for _ in range(4)]
    restored = chat_loader(chat_data_dir, shard_data_dir)
    restored.load_state_dict(state)
    for (x, y), (rx, ry) in zip(expected, [restored.next_batch() for _ in range(4)], strict=True):
        assert torch.equal(x, rx) and torch.equal(y, ry)

    total = int(chat_loader(chat_data_dir, shard_data_dir).row_starts[-1])
    seen = []
    for rank in range(2):
        ranked = chat_loader(chat_data_dir, shard_data_dir, rank=rank, world_size=2, batch_size=1)
        seen += [int(ranked.rows_of_epoch()[i]) for i in range(ranked.rows_per_rank)]
    assert len(set(seen)) == len(seen) == total - total % 2  # the ranks' rows never overlap

    other = chat_loader(chat_data_dir, shard_data_dir, batch_size=2)
    with pytest.raises(data.DataError, match="batch_size: state has 4, this loader has 2"):
        other.load_state_dict(state)


def test_a_batch_without_trained_tokens_gives_zero_loss_and_finite_gradients():
    torch.manual_seed(0)
    cfg = config.load(os.path.join(ROOT, "configs", "smoke-cpu.yaml"), TINY)
    model = Transformer(cfg["model"])
    x = torch.randint(0, 256, (2, 16))
    _, losses = model(x, torch.full((2, 16), -1))
    losses["loss"].backward()
    assert losses["loss"].item() == 0.0
    assert all(torch.isfinite(p.grad).all() and not p.grad.any() for p in model.parameters())


# -----------------------------------------------------------------------------
# init_from


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, shard_data_dir):
    runs = tmp_path_factory.mktemp("base")
    cfg = tiny_config(runs, "shards", shard_data_dir, "run_name=base", "train.max_steps=4")
    train.train(cfg, log=quiet)
    return str(runs / "base")


def test_init_from_starts_from_the_pretrained_weights_with_a_fresh_schedule(
    chat_data_dir, shard_data_dir, base_run, tmp_path
):
    cfg = sft_config(
        chat_data_dir,
        shard_data_dir,
        f"train.runs_dir={tmp_path}",
        f"train.init_from={base_run}",
        "train.max_steps=2",
        "train.lr=1.0e-9",
        "train.warmup_steps=0",
        "train.decay_fraction=0",
    )
    logs = []
    assert train.train(cfg, log=logs.append) == 2  # steps count from 0, not from the base run's 4
    assert any(line.startswith(f"initialized from {base_run}/ckpt_0000004.pt (step 4)") for line in logs)
    base = checkpoint.load_checkpoint(train.list_checkpoints(base_run)[0])
    tuned = checkpoint.load_checkpoint(train.list_checkpoints(train.run_dir_of(cfg))[0])
    assert tuned["optimizer"]["state"][0]["step"] == 2  # a fresh AdamW
    for name, weight in base["model"].items():
        assert torch.allclose(weight, tuned["model"][name], atol=1e-6), name


def test_a_resumed_fine_tuning_continues_its_own_checkpoint_bit_exact_not_the_base_run(
    chat_data_dir, shard_data_dir, base_run, tmp_path
):
    def sft(name, *overrides):
        return sft_config(
            chat_data_dir,
            shard_data_dir,
            f"train.runs_dir={tmp_path}",
            f"run_name={name}",
            f"train.init_from={base_run}",
            "train.decay_fraction=0",  # the schedule of a run that will be extended ignores max_steps
            *overrides,
        )

    full = sft("full")
    assert train.train(full, log=quiet) == 8
    assert train.train(sft("split", "train.max_steps=4"), log=quiet) == 4
    logs = []
    assert train.train(sft("split"), resume=True, log=logs.append) == 8
    assert not any(line.startswith("initialized from") for line in logs)

    def final(cfg):
        return checkpoint.load_checkpoint(train.list_checkpoints(train.run_dir_of(cfg))[0])

    count, differing, largest = checkpoint.compare_states(final(full), final(sft("split")))
    assert count > 0 and not differing, f"{len(differing)} tensors differ (largest {largest})"


def test_init_from_a_run_of_another_shape_or_tokenizer_is_refused_naming_the_setting(
    chat_data_dir, shard_data_dir, base_run, tmp_path
):
    cfg = sft_config(
        chat_data_dir,
        shard_data_dir,
        f"train.runs_dir={tmp_path}",
        f"train.init_from={base_run}",
        "model.d_model=64",
    )
    with pytest.raises(
        train.TrainError,
        match=r"train.init_from: .*ckpt_0000004.pt does not fit this run:\n  model.d_model: .* has 32, this run has 64",
    ):
        train.train(cfg, log=quiet)
    assert not os.path.exists(train.run_dir_of(cfg))  # nothing half-written

    state = checkpoint.load_checkpoint(train.list_checkpoints(base_run)[0])
    state["tokenizer"]["sha256"] = "0" * 64
    other = tmp_path / "other-tokenizer.pt"
    torch.save(state, other)
    cfg = sft_config(chat_data_dir, shard_data_dir, f"train.runs_dir={tmp_path}", f"train.init_from={other}")
    with pytest.raises(
        train.TrainError, match="tokenizer: .* was trained with 000000000000, this run's data gives"
    ):
        train.train(cfg, log=quiet)

    cfg = sft_config(
        chat_data_dir, shard_data_dir, f"train.runs_dir={tmp_path}", f"train.init_from={tmp_path}/nothing"
    )
    with pytest.raises(
        train.TrainError, match="train.init_from: .*nothing: no such run directory or checkpoint file"
    ):
        train.train(cfg, log=quiet)


# -----------------------------------------------------------------------------
# Held-out evaluation (python -m evaluation.bpb --chat-eval)


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, chat_data_dir, shard_data_dir):
    runs = tmp_path_factory.mktemp("sft")
    cfg = sft_config(chat_data_dir, shard_data_dir, f"train.runs_dir={runs}", "train.max_steps=4")
    train.train(cfg, log=quiet)
    return str(runs / cfg["run_name"])


def test_chat_eval_scores_assistant_tokens_only_and_counts_answers_ending_with_end(sft_run, tmp_path):
    model, cfg, tokenizer, _ = sample.load_run(sft_run)
    conversation = example_conversations(1, start=4)[0]  # system, two exchanges
    path = write_jsonl(tmp_path / "one.jsonl", [conversation])
    args = SimpleNamespace(run=sft_run, chat_eval=path, max_new_tokens=5, show=1, limit=0, batch=None)
    out = io.StringIO()
    result = bpb.run_chat_eval(model, cfg, tokenizer, args, out=out)

    ids, mask = template.render(conversation, tokenizer)
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids[:-1]]))
    targets = torch.tensor([t if m else -1 for t, m in zip(ids[1:], mask[1:], strict=True)])
    expected = torch.nn.functional.cross_entropy(logits[0], targets, ignore_index=-1).item()
    assert result["assistant_tokens"] == sum(mask) and result["loss"] == pytest.approx(expected, rel=1e-5)
    trained_bytes = sum(tokenizer.token_bytes[t] for t, m in zip(ids, mask, strict=True) if m)
    assert trained_bytes > 0  # <|end|> has none: bits per byte counts the text of the answers
    assert result["bpb"] == pytest.approx(expected * sum(mask) / (math.log(2) * trained_bytes), rel=1e-5)
    assert result["ended"] in (0.0, 1.0)
    end = tokenizer.special_ids["<|end|>"]
    ends = [p for p in range(len(ids) - 1) if ids[p + 1] == end and mask[p + 1]]
    assert len(ends) == 2  # two answers
    guessed = sum(int(logits[0, p].argmax()) == end for p in ends)
    assert result["end_guessed"] == guessed / 2
    assert "answers ending with <|end|> within 5 tokens" in out.getvalue()


def test_chat_eval_counts_an_answer_as_ended_only_when_end_comes_within_the_budget(sft_run, tmp_path):
    # The trained weights, rewired so that greedy decoding is known: with every o_proj and down_proj at
    # zero the layers add nothing, and a position's logits are norm(E[its token]) . E. The <|assistant|>
    # opener then points to a word u (E[u] leans on its direction), u points to <|end|> (E[end] lies along
    # the rest of E[u]), so every answer is exactly [u, <|end|>]: ended with a budget of 2, not of 1.
    model, cfg, tokenizer, _ = sample.load_run(sft_run)
    assistant, end = tokenizer.special_ids["<|assistant|>"], tokenizer.special_ids["<|end|>"]
    word = tokenizer.encode("hola")[0]
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embedding = model.embed_tokens.weight
        first, second = torch.eye(embedding.shape[1])[:2]
        embedding[assistant] = first
        embedding[word] = 10 * first + 100 * second
        embedding[end] = 1000 * second
    path = write_jsonl(tmp_path / "two.jsonl", example_conversations(2, start=1))
    for budget, ended in ((1, 0.0), (2, 1.0), (5, 1.0)):
        args = SimpleNamespace(
            run=sft_run, chat_eval=path, max_new_tokens=budget, show=1, limit=0, batch=None
        )
        out = io.StringIO()
        assert bpb.run_chat_eval(model, cfg, tokenizer, args, out=out)["ended"] == ended, budget
        assert f"answers ending with <|end|> within {budget} tokens: {int(2 * ended)}/2" in out.getvalue()
        assert out.getvalue().split("\n")[2].endswith(" <|end|>" if ended else " [budget]")


def test_chat_eval_of_the_runs_val_files_from_the_command_line(sft_run):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "evaluation.bpb",
            sft_run,
            "--chat-eval",
            "val",
            "--max-new-tokens",
            "4",
            "--show",
            "0",
            "--limit",
            "5",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "val.jsonl: 5 conversations" in result.stdout  # the first 5 of 12 and "| bpb " in result.stdout


def test_the_final_sample_of_a_chat_run_answers_the_prompt_as_a_user_turn(sft_run):
    cfg = checkpoint.load_checkpoint(train.list_checkpoints(sft_run)[0])["config"]
    assert cfg["data"]["format"] == "chat"
    model, _, tokenizer, _ = sample.load_run(sft_run)
    hardware = SimpleNamespace(device=torch.device("cpu"), autocast=contextlib.nullcontext)
    text = train.sample_text(model, tokenizer, cfg["train"] | {"sample_tokens": 5}, hardware, chat_run=True)
    assert text.startswith(cfg["train"]["sample_prompt"] + " -> ")


@pytest.mark.parametrize(
    "run_file", ["sft-2060.yaml", "sft-5090.yaml", "sft-smoke-cpu.yaml", "sft-agent-cpu.yaml"]
)
def test_each_shipped_sft_run_starts_from_a_shipped_run_of_its_shape_and_tokenizer(run_file):
    # What init_checkpoint checks at start-up, checked here on the shipped files, so a change to a
    # pretraining run file cannot leave the owner's `make sft` failing after the pretraining is done.
    cfg = config.load(os.path.join(ROOT, "configs", run_file))
    init_from = cfg["train"]["init_from"]
    base = config.load(os.path.join(ROOT, "configs", os.path.basename(init_from) + ".yaml"))
    assert init_from == os.path.join(base["train"]["runs_dir"], base["run_name"])
    assert {
        key: (base["model"][key], cfg["model"][key])
        for key in cfg["model"]
        if key not in checkpoint.INIT_FREE_MODEL_KEYS and base["model"][key] != cfg["model"][key]
    } == {}
    assert cfg["data"]["chat"]["tokenizer"] == data.tokenizer_path(base["data"])


@pytest.mark.parametrize("board", ["2060", "5090"])
def test_each_boards_tool_use_run_follows_its_general_sft_run_with_room_for_the_tools_system_turn(board):
    cfg = config.load(os.path.join(ROOT, "configs", f"sft-agent-{board}.yaml"))
    base = config.load(os.path.join(ROOT, "configs", f"sft-{board}.yaml"))
    assert cfg["train"]["init_from"] == os.path.join(base["train"]["runs_dir"], base["run_name"])
    assert cfg["hardware"] == base["hardware"]
    assert {k: v for k, v in cfg["model"].items() if k not in checkpoint.INIT_FREE_MODEL_KEYS} == {
        k: v for k, v in base["model"].items() if k not in checkpoint.INIT_FREE_MODEL_KEYS
    }
    assert cfg["data"]["chat"]["tokenizer"] == base["data"]["chat"]["tokenizer"]
    # The system turn with the six tools and a member's memories: at most 1,587 tokens of the 4k BPE and
    # 1,168 of a 32k BPE (configs/train/sft-agent.yaml); the longest conversation 1,914 and 1,395.
    assert cfg["model"]["seq_len"] >= 2048 > base["model"]["seq_len"]
    assert cfg["data"]["chat"]["too_long"] == "drop"  # a conversation that does not fit is never cut
    hardware = cfg["hardware"]
    peak = microbatch.step_peak_bytes(
        cfg["model"], cfg["train"]["micro_batch_size"], hardware["dtype"], hardware["loss_chunk_size"]
    )
    assert peak <= hardware["memory_gib"] * microbatch.GIB


@pytest.mark.parametrize("layer", ["sft", "sft-smoke", "sft-agent"])
def test_no_shipped_sft_data_layer_trains_on_the_held_out_conversations(layer):
    chat_cfg = data_layer(layer)["chat"]
    with contextlib.chdir(ROOT):
        trained = {os.path.realpath(p) for pattern in chat_cfg["train"] for p in glob.glob(pattern)}
        held_out = {os.path.realpath(p) for pattern in chat_cfg["val"] for p in glob.glob(pattern)}
        held_out.add(os.path.realpath("conversations/heldout.jsonl"))
    assert not trained & held_out
