"""DPO in train.py (objective.py): the loss against TRL's DPOTrainer on the same log-probabilities, the
degenerate pair, the reference computed once from the starting run and never changed, exact resume, DDP,
what is logged, and the config rules. Tiny runs over pairs made from the test conversations."""

import json
import math
import os
import types
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F
from conftest import CHAT_SEQ_LEN, ROOT, TINY, example_conversations, write_jsonl

import checkpoint
import config
import data
import hardware
import objective
import train
from chat import convert, prepare
from evaluation import plot
from model import Transformer

quiet = lambda *a, **k: None  # noqa: E731


# -----------------------------------------------------------------------------
# The loss, on tensors


def trl_loss(chosen, rejected, ref_chosen, ref_rejected, dpo):
    """TRL 1.16's DPOTrainer._compute_loss run on these sequence log-probabilities: its own code, with a
    stand-in for the model whose per-token log-probs sum to them and precomputed reference log-probs (TRL's
    precompute_ref_log_probs). Returns (loss, TRL's logged metrics)."""
    from trl.trainer.dpo_trainer import DPOTrainer

    pairs, length = len(chosen), 5
    per_token = torch.zeros(2 * pairs, length - 1)
    per_token[:, 0] = torch.cat([chosen, rejected])
    outputs = types.SimpleNamespace(
        log_probs=per_token,
        entropy=torch.zeros_like(per_token),
        mean_logits=torch.zeros_like(per_token),
        is_top1=torch.zeros_like(per_token, dtype=torch.bool),
    )
    trainer = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True),
        accelerator=types.SimpleNamespace(
            device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t
        ),
        aux_loss_enabled=False,
        precompute_ref_logps=True,
        ld_alpha=None,
        f_divergence_type="reverse_kl",
        loss_types=[dpo["loss_type"]],
        loss_weights=[1.0],
        beta=dpo["beta"],
        label_smoothing=dpo["label_smoothing"],
        use_weighting=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
        args=types.SimpleNamespace(),
    )
    ones = torch.ones(2 * pairs, length, dtype=torch.long)
    inputs = {"input_ids": ones, "attention_mask": ones, "completion_mask": ones}
    inputs |= {"ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}
    loss = DPOTrainer._compute_loss(trainer, lambda **kwargs: outputs, inputs, return_outputs=False)
    return loss, {key: values[0] for key, values in trainer._metrics["train"].items()}


@pytest.mark.parametrize(
    "dpo",
    [
        {"beta": 0.1, "loss_type": "sigmoid", "label_smoothing": 0.0},
        {"beta": 0.5, "loss_type": "sigmoid", "label_smoothing": 0.0},
        {"beta": 0.1, "loss_type": "robust", "label_smoothing": 0.1},
        {"beta": 0.3, "loss_type": "robust", "label_smoothing": 0.35},
    ],
)
def test_the_dpo_loss_and_rewards_equal_trls_dpotrainer_on_the_same_log_probs(dpo):
    torch.manual_seed(0)
    pairs = 64
    chosen, rejected = -200 * torch.rand(pairs) - 5, -200 * torch.rand(pairs) - 5
    ref_chosen, ref_rejected = chosen + 4 * torch.randn(pairs), rejected + 4 * torch.randn(pairs)
    expected, metrics = trl_loss(chosen, rejected, ref_chosen, ref_rejected, dpo)
    losses, chosen_rewards, rejected_rewards = objective.dpo_losses(
        chosen, rejected, ref_chosen, ref_rejected, dpo
    )
    assert abs(losses.mean().item() - expected.item()) < 1e-6
    assert 0.05 < expected.item() < 20  # a batch where the loss is neither ~0 nor saturated
    ours = objective.pair_means(objective.pair_stats(losses, chosen_rewards, rejected_rewards))
    assert ours["chosen_reward"] == pytest.approx(metrics["rewards/chosen"], abs=1e-6)
    assert ours["rejected_reward"] == pytest.approx(metrics["rewards/rejected"], abs=1e-6)
    assert ours["margin"] == pytest.approx(metrics["rewards/margins"], abs=1e-6)
    assert ours["accuracy"] == pytest.approx(metrics["rewards/accuracies"], abs=1e-6)
    assert 0 < ours["accuracy"] < 1


def test_an_answers_log_prob_is_minus_its_summed_cross_entropy_on_the_answer_tokens_only():
    torch.manual_seed(1)
    logits = torch.randn(3, 6, 11)
    targets = torch.randint(0, 11, (3, 6))
    targets[:, :2] = -1  # the prompt
    targets[1, 4:] = -1  # padding after a shorter answer
    expected = -F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-1, reduction="none").sum(1)
    assert torch.allclose(objective.completion_log_probs(logits, targets), expected, atol=1e-5)


def test_a_pair_whose_chosen_answer_is_its_rejected_one_gives_log_2_and_no_gradient():
    torch.manual_seed(2)
    cfg = config.load(os.path.join(ROOT, "configs", "smoke-cpu.yaml"), TINY)
    model = Transformer(cfg["model"]).double()  # float64 (the norms compute in float32 whatever the dtype)
    cpu = types.SimpleNamespace(
        device=torch.device("cpu"), autocast=lambda: torch.autocast("cpu", enabled=False)
    )
    reference = torch.tensor([[-40.0, -40.0]], dtype=torch.float64)
    dpo = {"beta": 0.1, "loss_type": "sigmoid", "label_smoothing": 0.0}
    row = torch.randint(0, 256, (1, 16))
    y = row.roll(-1, 1).clone()
    y[:, :5] = -1  # the prompt is not scored

    def gradient(x):
        model.zero_grad()
        loss, sums, _ = objective.dpo_micro_step(
            model, (x, y.repeat(2, 1), torch.tensor([0])), reference, dpo, cpu
        )
        loss.backward()
        return loss.item(), sums, max(p.grad.abs().max().item() for p in model.parameters())

    loss, sums, same = gradient(row.repeat(2, 1))  # chosen row, rejected row: the same sequence
    assert loss == pytest.approx(math.log(2), abs=1e-12) and sums[1].item() == 0.0  # margin 0
    other = row.repeat(2, 1)
    other[1, 8:] = (other[1, 8:] + 1) % 256
    _, _, real = gradient(other)  # the same model with a different rejected answer
    assert real > 1e-5 and same < 1e-6 * real, (same, real)  # zero but for rounding


# -----------------------------------------------------------------------------
# Tiny DPO runs from a tiny pretrained run, over pairs made from the test conversations


@pytest.fixture(scope="module")
def pair_data(tmp_path_factory, shard_data_dir):
    """Folder with train.jsonl / val.jsonl of pairs (the test conversations' answers chosen, worse ones
    made up by convert.seed_pairs)."""
    folder = tmp_path_factory.mktemp("pairs")
    for split, conversations in (
        ("train", example_conversations(40)),
        ("val", example_conversations(8, 100)),
    ):
        where = [(f"{split}:{i}", c) for i, c in enumerate(conversations)]
        write_jsonl(folder / f"{split}.jsonl", convert.seed_pairs(where, seed=0))
    (folder / "shard_dir.txt").write_text(shard_data_dir, encoding="utf-8")
    return folder


def dpo_args(pair_data, init_from, runs_dir, *overrides):
    """train.py arguments of configs/dpo-smoke-cpu.yaml made tiny: TINY's model and schedule (micro-batches
    of 4 pairs), rows of CHAT_SEQ_LEN + 1 tokens of the shard tokenizer, starting from init_from."""
    shard_dir = (pair_data / "shard_dir.txt").read_text(encoding="utf-8")
    return [
        os.path.join(ROOT, "configs", "dpo-smoke-cpu.yaml"),
        *TINY,
        f"data.dir={pair_data}/packed",
        f"data.chat.tokenizer={shard_dir}/tokenizer.model",
        f"data.chat.train=[{pair_data}/train.jsonl]",
        f"data.chat.val=[{pair_data}/val.jsonl]",
        "data.chat.rows_per_shard=16",
        "model.vocab_size=512",
        f"model.seq_len={CHAT_SEQ_LEN}",
        f"train.init_from={init_from}",
        f"train.runs_dir={runs_dir}",
        "train.lr=3.0e-3",
        *overrides,
    ]


def dpo_config(pair_data, init_from, runs_dir, *overrides):
    """The resolved config of dpo_args(...), its pairs packed."""
    run_file, *rest = dpo_args(pair_data, init_from, runs_dir, *overrides)
    cfg = config.load(run_file, rest)
    prepare.prepare(cfg, log=quiet)
    return cfg


def newest(cfg):
    return checkpoint.load_checkpoint(train.list_checkpoints(train.run_dir_of(cfg))[0])


def test_a_dpo_run_logs_its_rewards_and_held_out_figures_and_keeps_the_starting_runs_reference_bit_for_bit(
    pair_data, chat_run, tmp_path
):
    cfg = dpo_config(pair_data, chat_run, tmp_path, "run_name=dpo", "train.eval_batches=10")  # every val pair
    logs = []
    assert train.train(cfg, log=logs.append) == 8
    assert any(line.startswith("global batch 8 pairs = 1 ranks x 4 pairs") for line in logs)

    # The reference is the starting run's log-probs: recomputed here from its checkpoint, the same bits.
    start, _ = checkpoint.init_checkpoint(cfg, quiet)
    board = hardware.setup_hardware(cfg["hardware"])
    base = Transformer(cfg["model"], attention_backend=board.attention_backend)
    base.load_state_dict(checkpoint.load_checkpoint(start)["model"])
    expected = objective.reference_log_probs(base, cfg, board, hardware.Dist(), quiet)
    checkpoints = [checkpoint.load_checkpoint(path) for path in train.list_checkpoints(train.run_dir_of(cfg))]
    assert [c["step"] for c in checkpoints] == [8, 6]
    for ckpt in checkpoints:
        for split in data.SPLITS:
            assert torch.equal(ckpt["reference"][split], expected[split]), split
    pairs = data.build_loader(cfg["data"], "train", 4, CHAT_SEQ_LEN, 0).pairs
    assert expected["train"].shape == (pairs, 2) and (expected["train"] < 0).all()
    moved = max((checkpoints[0]["model"][k] - w).abs().max().item() for k, w in base.state_dict().items())
    assert moved > 1e-3  # the tuned weights did move away from the reference

    with open(os.path.join(train.run_dir_of(cfg), "metrics.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 9))
    for record in steps:
        assert {"margin", "chosen_reward", "rejected_reward", "accuracy"} <= set(record)
        assert record["margin"] == pytest.approx(
            record["chosen_reward"] - record["rejected_reward"], abs=1e-6
        )
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=0.05)  # the model starts as its reference
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [4, 8]
    final = evals[-1]
    assert final["val_pairs"] == len(objective.split_loader(cfg, "val", hardware.Dist()).rank_pairs())
    assert (
        final["val_prompts"] == 8
        and 0 <= final["val_accuracy"] <= 1
        and 0 <= final["val_chosen_likelier"] <= 1
    )
    assert any("held-out reward accuracy" in line and "prompts" in line for line in logs)
    assert os.path.exists(plot.plot([train.run_dir_of(cfg)], str(tmp_path / "dpo.png")))  # make plot


def test_held_out_prompts_are_told_apart_by_their_whole_context_not_by_their_last_exchange(
    pair_data, tmp_path
):
    # val_chosen_likelier counts prompts: the pairs of one prompt and chosen answer share a key; two
    # conversations that end in the same exchange after different histories are two prompts; a pair that
    # had to drop its prompt's first exchange to fit (a long rejected answer) scores its answer in another
    # context, and counts on its own.
    folder = tmp_path / "pairs"
    folder.mkdir()
    (folder / "shard_dir.txt").write_text((pair_data / "shard_dir.txt").read_text(encoding="utf-8"))
    (folder / "train.jsonl").write_text((pair_data / "train.jsonl").read_text(encoding="utf-8"))

    def history(question):
        return [
            {"role": "user", "content": question},
            {"role": "assistant", "content": "Son 4."},
            {"role": "user", "content": "Gracias"},
        ]

    def pair(prompt, rejected):
        chosen = [{"role": "assistant", "content": "De nada."}]
        return {"prompt": prompt, "chosen": chosen, "rejected": [{"role": "assistant", "content": rejected}]}

    pairs = [
        pair(history("¿Cuánto es 2 más 2?"), "No sé."),
        pair(history("¿Cuánto es 2 más 2?"), "Nada."),
        pair(history("¿Y 3 más 1?"), "No sé."),
        pair(history("¿Cuánto es 2 más 2?"), "Pues mira, " * 7),  # too long with its first exchange
    ]
    write_jsonl(folder / "val.jsonl", pairs)
    cfg = dpo_config(folder, "runs/none", tmp_path)
    loader = data.build_loader(cfg["data"], "val", 4, CHAT_SEQ_LEN, 0)
    answer_starts = [int(loader.row(2 * p)[1].nonzero()[0][0]) for p in range(4)]
    assert answer_starts[3] < answer_starts[0]  # the last pair did lose its first exchange
    keys = [objective.prompt_key(loader, p) for p in range(4)]
    assert keys[0] == keys[1] and len({keys[0], keys[2], keys[3]}) == 3


def test_resuming_a_dpo_run_is_bit_exact_and_keeps_its_reference(pair_data, chat_run, tmp_path):
    def run(name, *overrides):
        return dpo_config(
            pair_data, chat_run, tmp_path, f"run_name={name}", "train.decay_fraction=0", *overrides
        )

    train.train(run("full"), log=quiet)
    assert train.train(run("split", "train.max_steps=4"), log=quiet) == 4
    logs = []
    assert train.train(run("split"), resume=True, log=logs.append) == 8
    assert not any(line.startswith("reference:") for line in logs)  # read from the checkpoint, not recomputed
    a, b = newest(run("full")), newest(run("split"))
    count, differing, largest = checkpoint.compare_states(a, b)
    assert count > 0 and not differing, f"{len(differing)}/{count} tensors differ (largest {largest})"
    assert all(torch.equal(a["reference"][s], b["reference"][s]) for s in data.SPLITS)


def test_two_dpo_ranks_with_accumulation_k_match_one_process_with_2k(pair_data, chat_run, tmp_path):
    from test_distributed import torchrun

    cfg = dpo_config(pair_data, chat_run, tmp_path, "run_name=ddp", "train.grad_accum_steps=1")
    ddp = torchrun(dpo_args(pair_data, chat_run, tmp_path, "run_name=ddp", "train.grad_accum_steps=1"))
    assert ddp.returncode == 0, ddp.stdout + ddp.stderr
    assert "global batch 8 pairs = 2 ranks x 4 pairs" in ddp.stdout
    single = dpo_config(pair_data, chat_run, tmp_path, "run_name=single", "train.grad_accum_steps=2")
    train.train(single, log=quiet)
    a, b = newest(cfg), newest(single)
    assert a["world_size"] == 2 and a["step"] == b["step"] == 8
    for split in data.SPLITS:  # each rank computed half of the reference; every rank holds all of it
        assert torch.allclose(a["reference"][split], b["reference"][split], atol=1e-4)
    for name, tensor in a["model"].items():
        assert torch.allclose(tensor, b["model"][name], rtol=1e-4, atol=1e-5), name


# -----------------------------------------------------------------------------
# Config rules


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.init_from=null"], "train.init_from: null, but DPO starts from a run"),
        (["train.dpo.label_smoothing=0.1"], "with loss_type sigmoid, which ignores it"),
        (
            ["train.dpo.label_smoothing=0.5", "train.dpo.loss_type=robust"],
            "train.dpo.label_smoothing: 0.5 is out of range",
        ),
        (["train.objective=next_token"], "data.format preference holds pairs for DPO; expected dpo"),
        (["train.objective=next_token"], "train.dpo: set, but train.objective is 'next_token'; remove it"),
        (["train.dpo.beta=0"], "train.dpo.beta: 0 is out of range; expected > 0"),
    ],
)
def test_a_dpo_config_that_cannot_work_is_refused_naming_the_key(overrides, message):
    with pytest.raises(config.ConfigError, match=message):
        config.load(os.path.join(ROOT, "configs", "dpo-smoke-cpu.yaml"), overrides)


def test_dpo_needs_preference_pairs_and_pairs_need_dpo():
    with pytest.raises(
        config.ConfigError, match="data.format: 'chat', but train.objective dpo trains on preference"
    ):
        config.load(os.path.join(ROOT, "configs", "sft-smoke-cpu.yaml"), ["train.objective=dpo", "train.dpo.beta=0.1",
                    "train.dpo.loss_type=sigmoid", "train.dpo.label_smoothing=0"])  # fmt: skip
    with pytest.raises(config.ConfigError, match="train.dpo: required key missing"):
        config.load(os.path.join(ROOT, "configs", "sft-smoke-cpu.yaml"), ["train.objective=dpo"])


@pytest.mark.parametrize("run_file", ["dpo-2060.yaml", "dpo-5090.yaml", "dpo-smoke-cpu.yaml"])
def test_each_shipped_dpo_run_starts_from_the_shipped_sft_run_of_its_shape_and_tokenizer(run_file):
    # What init_checkpoint checks at start-up, checked on the shipped files: `make dpo` after `make sft`.
    cfg = config.load(os.path.join(ROOT, "configs", run_file))
    init_from = cfg["train"]["init_from"]
    base = config.load(os.path.join(ROOT, "configs", os.path.basename(init_from) + ".yaml"))
    assert init_from == os.path.join(base["train"]["runs_dir"], base["run_name"])
    assert base["train"]["objective"] == "next_token" and base["data"]["format"] == "chat"
    differing = {
        key: (base["model"][key], cfg["model"][key])
        for key in cfg["model"]
        if key not in checkpoint.INIT_FREE_MODEL_KEYS and base["model"][key] != cfg["model"][key]
    }
    assert differing == {}
    assert cfg["data"]["chat"]["tokenizer"] == base["data"]["chat"]["tokenizer"]
