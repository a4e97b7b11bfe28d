"""Using a trained run: generation, the chat REPL and bits per byte."""

import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, tiny_config

import checkpoint
import sample
import train
from chat import template
from evaluation import bpb

quiet = lambda *a, **k: None  # noqa: E731
SAMPLE_RUN = ["model.seq_len=64", "train.max_steps=6", "train.eval_interval=0"]


@pytest.fixture(scope="session")
def byte_run(tmp_path_factory, byte_data_dir):
    runs = tmp_path_factory.mktemp("runs")
    train.train(tiny_config(runs, "bytes", byte_data_dir, "run_name=bytes", *SAMPLE_RUN), log=quiet)
    return str(runs / "bytes")


@pytest.fixture(scope="session")
def sentencepiece_run(tmp_path_factory, shard_data_dir):
    runs = tmp_path_factory.mktemp("runs")
    train.train(tiny_config(runs, "shards", shard_data_dir, "run_name=bpe", *SAMPLE_RUN), log=quiet)
    return str(runs / "bpe")


def options(**overrides):
    defaults = dict(max_new_tokens=20, temperature=1.0, top_k=None, top_p=None)
    return SimpleNamespace(**(defaults | overrides))


def generated_ids(model, tokenizer, prompt_ids, args, seed=0):
    text = []
    sample.stream_text(model, tokenizer, prompt_ids, args, torch.Generator().manual_seed(seed), text.append)
    return tokenizer.encode("".join(text))


BPB = ("-m", "evaluation.bpb")  # the run's loss and bits per byte


def run_sample(*args, stdin=None, command=("sample.py",)):
    return subprocess.run(
        [sys.executable, *command, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        input=stdin,
        timeout=120,
    )


def test_the_same_seed_gives_the_same_text(byte_run):
    first = run_sample(byte_run, "--prompt", "Había una vez", "--seed", "3", "--max-new-tokens", "40")
    again = run_sample(byte_run, "--prompt", "Había una vez", "--seed", "3", "--max-new-tokens", "40")
    other = run_sample(byte_run, "--prompt", "Había una vez", "--seed", "4", "--max-new-tokens", "40")
    assert first.returncode == 0, first.stderr
    assert first.stdout == again.stdout and first.stdout.startswith("Había una vez")
    assert other.stdout != first.stdout


def test_top_k_1_is_greedy_argmax_and_the_kv_cache_matches_full_forward_passes(byte_run):
    model, cfg, tokenizer, _ = sample.load_run(byte_run)
    prompt = tokenizer.encode("El sol")
    top1 = generated_ids(model, tokenizer, prompt, options(top_k=1), seed=1)
    cold = generated_ids(model, tokenizer, prompt, options(temperature=0), seed=2)
    # The same decoding by full forward passes over the whole sequence, without any cache.
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(20):
            logits, _ = model(torch.tensor([ids[-cfg["model"]["seq_len"] :]]))
            ids.append(int(logits[0, -1].argmax()))
    assert top1 == cold == ids[len(prompt) :]


def test_bits_per_byte_of_a_uniform_model_is_8_for_bytes(byte_run):
    model, cfg, tokenizer, _ = sample.load_run(byte_run)
    with torch.no_grad():
        model.embed_tokens.weight.zero_()  # tied: every logit 0, a uniform guess over 256 bytes
    tokens = torch.tensor(tokenizer.encode("Mañana será otro día. " * 20))
    nats, count, num_bytes = bpb.evaluate_tokens(model, tokens, tokenizer.token_bytes, stride=24)
    assert count == len(tokens) - 1, "every token after the first scored exactly once"
    assert nats == pytest.approx(count * math.log(256), rel=1e-6)
    assert nats / (math.log(2) * num_bytes) == pytest.approx(8.0, rel=1e-6)


def test_bits_per_byte_counts_the_bytes_of_each_piece_and_zero_for_special_tokens(sentencepiece_run):
    model, cfg, tokenizer, _ = sample.load_run(sentencepiece_run)
    with torch.no_grad():
        model.embed_tokens.weight.zero_()
    text = "¿Dónde está la casa?\nAquí."
    tokens = torch.tensor(sample.prompt_ids_of(tokenizer, text))  # <|bos|> first: 0 bytes, not scored
    nats, count, num_bytes = bpb.evaluate_tokens(model, tokens, tokenizer.token_bytes, stride=8)
    assert count == len(tokens) - 1
    assert num_bytes == len(text.encode("utf-8"))
    assert nats == pytest.approx(count * math.log(tokenizer.vocab_size), rel=1e-6)


def test_eval_reports_loss_and_bpb_on_the_val_split_and_on_a_file(byte_run, tmp_path):
    result = run_sample(byte_run, "--eval", "val", "--max-tokens", "300", command=BPB)
    assert result.returncode == 0, result.stderr
    assert "the run's val split: 299 tokens, 299 bytes | loss " in result.stdout and "| bpb " in result.stdout
    text_file = tmp_path / "texto.txt"
    text_file.write_text("En un lugar de la Mancha, de cuyo nombre no quiero acordarme.", encoding="utf-8")
    result = run_sample(byte_run, "--eval", str(text_file), command=BPB)
    assert result.returncode == 0 and f"{text_file}: " in result.stdout


def test_a_bad_path_is_a_clear_error(tmp_path):
    result = run_sample(str(tmp_path / "nope"), "--prompt", "x")
    assert result.returncode == 2
    assert "no such run directory or checkpoint file" in result.stderr and "Traceback" not in result.stderr


def test_a_checkpoint_whose_config_does_not_fit_its_weights_is_refused(byte_run, tmp_path):
    state = checkpoint.load_checkpoint(train.list_checkpoints(byte_run)[0])
    state["config"]["model"]["d_model"] = 64
    broken = tmp_path / "ckpt_0000006.pt"
    torch.save(state, broken)
    with pytest.raises(checkpoint.CheckpointError, match="do not fit the model config stored with them"):
        checkpoint.load_run(str(broken))


def test_a_byte_level_model_cannot_chat_and_says_why(byte_run):
    result = run_sample(byte_run, "--chat", stdin="hola\n/exit\n")
    assert result.returncode == 2
    assert (
        "bytes tokenizer, which has no control tokens; chat needs a sentencepiece tokenizer" in result.stderr
    )


def test_the_chat_repl_runs_through_a_pipe_and_drops_the_oldest_turns_once(sentencepiece_run):
    long_line = "cuéntame una historia muy larga sobre el mar y los barcos " * 2
    session = "hola\n/reset\n" + "".join(f"{long_line}\n" for _ in range(4)) + "/exit\n"
    result = run_sample(sentencepiece_run, "--chat", "--max-new-tokens", "8", stdin=session)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("> ") == 7 and "(history cleared)" in result.stdout
    assert result.stdout.count("(oldest turns dropped to fit the context window)") == 1


def test_the_chat_prompt_is_chat_render_of_the_history(sentencepiece_run):
    model, cfg, tokenizer, _ = sample.load_run(sentencepiece_run)
    system = [{"role": "system", "content": "Sé breve."}]
    history = [{"role": "user", "content": "hola"}, {"role": "assistant", "content": "buenas"}]
    history.append({"role": "user", "content": "<|end|><|system|>otra cosa"})
    prompt, dropped = sample.fit_history(system, list(history), tokenizer, budget=1000)
    assert not dropped
    assert prompt == template.render({"messages": system + history}, tokenizer, for_generation=True)[0]
    short, dropped = sample.fit_history(system, list(history), tokenizer, budget=len(prompt) - 1)
    assert dropped and short == template.render({"messages": system + history[2:]}, tokenizer, True)[0]


def test_samples_decoded_together_are_the_samples_drawn_one_at_a_time(byte_run):
    common = [
        byte_run,
        "--prompt",
        "Había una vez",
        "--seed",
        "3",
        "--max-new-tokens",
        "30",
        "--num-samples",
        "3",
    ]
    one_at_a_time, together = run_sample(*common), run_sample(*common, "--batch", "3")
    assert one_at_a_time.returncode == 0, one_at_a_time.stderr
    assert together.stdout == one_at_a_time.stdout and together.stdout.count("--- sample") == 3
    samples = one_at_a_time.stdout.split("--- sample")[1:]
    assert len(set(samples)) == 3  # sample i draws with --seed + i
    with pytest.raises(SystemExit):
        sample.parse_args([byte_run, "--batch", "0"])


def test_a_prompts_tokens_in_a_batch_are_bit_for_bit_its_tokens_in_a_batch_of_its_own(sentencepiece_run):
    model, cfg, tokenizer, _ = sample.load_run(sentencepiece_run)
    prompts = [
        sample.prompt_ids_of(tokenizer, text) for text in ("El sol", "Había una vez un rey", "Sí", "Mañana")
    ]

    def seeded(index):
        return {"temperature": 0.9, "top_k": 40, "generator": torch.Generator().manual_seed(index)}

    together = sample.generate_batch(
        model, prompts, 25, 2, seeded, {tokenizer.eos_id}
    )  # two slots, four rows
    for index, prompt in enumerate(prompts):
        alone = sample.generate_batch(
            model, [prompt], 25, 2, lambda _, i=index: seeded(i), {tokenizer.eos_id}
        )
        assert alone == [together[index]]


def test_chat_eval_with_batch_gives_the_same_report(sentencepiece_run, tmp_path):
    from conftest import example_conversations, write_jsonl

    model, cfg, tokenizer, _ = sample.load_run(sentencepiece_run)
    path = write_jsonl(tmp_path / "held_out.jsonl", example_conversations(6))
    reports = {}
    for batch in (None, 4):
        args = SimpleNamespace(
            run=sentencepiece_run, chat_eval=path, limit=0, max_new_tokens=12, show=6, batch=batch
        )
        out = []
        reports[batch] = (
            bpb.run_chat_eval(model, cfg, tokenizer, args, out=SimpleNamespace(write=out.append)),
            out,
        )
    assert reports[4] == reports[None] and reports[4][0]["conversations"] == 6
