"""evaluation/runs.py and evaluation/harness.py: ENLACE inside lm-evaluation-harness scores every request as lm-eval's own
`hf` backend scores the export, the score centres accuracy on chance, bad input is a clear error, training
can run benchmarks without changing what it learns, and a run gets a report card.

The tasks are the local fixtures in tests/fixtures/eval/ (conftest.py keeps the Hugging Face libraries
offline): a multiple-choice task, a rolling log-likelihood task and a generative task."""

import copy
import json
import os
import shutil

import pytest
import torch
from conftest import ROOT, quiet, tiny_config

import checkpoint
import evaluation.runs
import export
import train
from chat import template
from evaluation import harness

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "eval")
SETTINGS = harness.load_settings()
# A 64-token context: the few-shot prompts of the generative task and the longer texts of the rolling
# one do not fit, so cutting from the left and rolling windows are part of every comparison. A tiny model
# trained a little from a wide initialization (init_std 0.2) writes varied greedy text; a longer-trained
# one of this size repeats one token, which would prove little about generation.
EVAL_RUN = ["model.d_model=64", "model.seq_len=64", "model.init_std=0.2", "train.max_steps=20",
            "train.warmup_steps=2", "train.lr=1e-3", "train.eval_interval=0", "train.ckpt_interval=20"]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def run(runs, shard_data_dir):
    """The tiny run with its byte-fallback pieces, <unk> and control tokens taken out of what it writes
    (their embedding rows, tied to the head, zeroed), as a trained model rarely writes them. Of invalid
    UTF-8 from byte pieces, sentencepiece and tokenizers write different replacement characters; and
    lm-eval's `hf` matches stop strings against control tokens' names (it stops at "es" in
    "<|reserved_3|>"), which ENLACE's text never contains. Neither is a property of the evaluation."""
    train.train(tiny_config(runs, "shards", shard_data_dir, "run_name=base", *EVAL_RUN), log=quiet)
    path = checkpoint.list_checkpoints(str(runs / "base"))[0]
    state = torch.load(path, weights_only=True)
    processor = checkpoint.tokenizer_of(state, path, log=quiet).processor
    silent = [
        i
        for i in range(processor.get_piece_size())
        if processor.is_byte(i) or processor.is_unknown(i) or processor.is_control(i)
    ]
    for name in ("embed_tokens.weight", "lm_head.weight"):
        state["model"][name][silent] = 0.0
    torch.save(state, path)
    return str(runs / "base")


@pytest.fixture(scope="module")
def loaded(run):
    backend = SETTINGS["attention_backend"]["cpu"]  # as evaluation/runs.py loads it
    model, cfg, tokenizer, path = checkpoint.load_run(run, log=quiet, attention_backend=backend)
    return model, tokenizer, path


def enlace_lm(loaded, batch_size=4, model=None):
    base, tokenizer, path = loaded
    return harness.EnlaceLM.from_model(model or base, tokenizer, batch_size, 256, 1234, path)


def fixture_plan(tasks, chat_mode=False, include_path=FIXTURES):
    return harness.plan_of(tasks, SETTINGS, chat_mode, include_path)


def evaluate(lm, tasks, chat_mode=False, system=None, generation=None, include_path=FIXTURES):
    """lm-eval's evaluation of fixture tasks (fresh Task objects) -> results with every request's samples."""
    plan = fixture_plan(tasks, chat_mode, include_path)
    manager = harness.task_manager_for(plan)
    loaded = harness.load_tasks(manager, plan)
    for task in loaded:
        if generation and task.get_config("output_type") == "generate_until":
            task.set_config(key="generation_kwargs", value=generation)
    return harness.run(lm, manager, loaded, SETTINGS, chat_mode=chat_mode, system=system, full_record=False)


def responses(results, task):
    return [sample["resps"] for sample in results["samples"][task]]


# -----------------------------------------------------------------------------
# Parity with lm-eval's own Hugging Face backend on the export


@pytest.fixture(scope="module")
def hf_dir(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "hf"
    export.export(run, "hf", str(out), log=quiet)
    return str(out)


def hf_lm(hf_dir, **args):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=hf_dir, device="cpu", batch_size=1, dtype="float32", **args)


# Up to 16 tokens, cut at a newline or at "es" (often in the middle of a piece): stop strings matter.
GENERATION = {"until": ["\n", "Pregunta:", "es"], "max_gen_toks": 16, "do_sample": False}


# The texts of the rolling fixture, each continued: prompts that end differently (the sums' prompts all
# end with "Respuesta:", and a tiny model's greedy answer to them is the same).
CONTINUE = """task: enlace_test_continue
dataset_path: json
dataset_kwargs:
  data_files:
    test: tests/fixtures/eval/rolling_test.jsonl
output_type: generate_until
test_split: test
doc_to_text: "{{text}}"
doc_to_target: ""
generation_kwargs: {until: ["\\n", "es"], max_gen_toks: 16, do_sample: false}
metric_list: [{metric: exact_match}]
"""


@pytest.fixture(scope="module")
def both(loaded, hf_dir, tmp_path_factory):
    """The choice and generative fixture tasks and the continuation task through `enlace` (batch 4:
    sorted, padded batches) and through lm-eval's `hf` on the export (batch 1, add_bos_token=True: the
    contexts start with <|bos|> as ENLACE's do)."""
    folder = tmp_path_factory.mktemp("tasks")
    (folder / "continue.yaml").write_text(CONTINUE)
    tasks, paths = (
        "enlace_fixture_choice,enlace_fixture_generate,enlace_test_continue",
        [FIXTURES, str(folder)],
    )
    ours = evaluate(enlace_lm(loaded), tasks, generation=GENERATION, include_path=paths)
    theirs = evaluate(hf_lm(hf_dir, add_bos_token=True), tasks, generation=GENERATION, include_path=paths)
    return ours, theirs


def test_every_multiple_choice_loglikelihood_is_hf_s_within_1e_4_and_so_is_the_accuracy(both):
    ours, theirs = both
    task = "enlace_fixture_choice"
    pairs = [(a, b) for doc_a, doc_b in zip(responses(ours, task), responses(theirs, task), strict=True)
             for a, b in zip(doc_a, doc_b, strict=True)]  # fmt: skip
    assert len(pairs) == 45  # every choice of the 16 questions
    assert max(abs(a[0][0] - b[0][0]) for a, b in pairs) < 1e-4
    assert [a[0][1] for a, b in pairs] == [b[0][1] for a, b in pairs]  # is-greedy flags
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"][task][metric] == theirs["results"][task][metric]


def test_greedy_generations_are_hf_s_text(both):
    ours, theirs = both
    for task in ("enlace_fixture_generate", "enlace_test_continue"):
        texts = [r[0][0] for r in responses(ours, task)]
        assert texts == [r[0][0] for r in responses(theirs, task)], task
    assert len(set(texts)) >= 6 and sum(len(t) >= 8 for t in texts) >= 3, "degenerate text proves little"


def test_rolling_loglikelihood_is_hf_s_within_1e_4_over_several_windows(loaded, hf_dir):
    # The texts are scored after the prefix token without a <|bos|> of their own: `hf` with its default
    # tokenizer settings (with add_bos_token=True it would also score P(<|bos|> | <|bos|>)).
    ours = evaluate(enlace_lm(loaded), "enlace_fixture_rolling")
    theirs = evaluate(hf_lm(hf_dir), "enlace_fixture_rolling")
    a, b = (
        [r[0][0] for r in responses(res, "enlace_fixture_rolling")] for res in (ours, theirs)
    )  # fmt: skip
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4
    _, tokenizer, _ = loaded
    longest = max(
        len(tokenizer.encode(json.loads(line)["text"])) for line in open(f"{FIXTURES}/rolling_test.jsonl")
    )
    assert longest > 2 * 64, "the longest text spans several 64-token windows"
    assert ours["results"]["enlace_fixture_rolling"]["bits_per_byte,none"] == pytest.approx(
        theirs["results"]["enlace_fixture_rolling"]["bits_per_byte,none"], abs=1e-6
    )


def test_chat_prompts_are_chat_render_s_ids_and_score_as_the_export_s_template(loaded, hf_dir):
    lm = enlace_lm(loaded)
    seen = []
    render = lm.apply_chat_template
    lm.apply_chat_template = lambda history, **kw: seen.append(history) or render(history, **kw)
    system = "Eres ENLACE, breve."
    ours = evaluate(lm, "enlace_fixture_choice", chat_mode=True, system=system)
    theirs = evaluate(hf_lm(hf_dir), "enlace_fixture_choice", chat_mode=True, system=system)
    _, tokenizer, _ = loaded
    assert len(seen) == 16 and seen[0][0] == {"role": "system", "content": system}
    for history in seen:
        text = template.render_text({"messages": history}, for_generation=True)
        assert lm.rendered[text] == template.render({"messages": history}, tokenizer, for_generation=True)[0]
    a = [r[0][0] for doc in responses(ours, "enlace_fixture_choice") for r in doc]
    b = [r[0][0] for doc in responses(theirs, "enlace_fixture_choice") for r in doc]
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4


def test_lm_eval_builds_the_model_from_its_registry_name(run):
    from lm_eval import evaluator

    plan = fixture_plan("enlace_fixture_choice")
    manager = harness.task_manager_for(plan)
    results = evaluator.simple_evaluate(model="enlace", model_args={"run": run}, tasks=["enlace_fixture_choice"],
                                        task_manager=manager, limit=2, batch_size=2)  # fmt: skip
    assert results["results"]["enlace_fixture_choice"]["sample_len"] == 2


# -----------------------------------------------------------------------------
# Scoring: what the model prefers decides the accuracy; the score is centred on chance


def hidden_and_forward(loaded):
    model, tokenizer, _ = loaded
    idx = torch.tensor([[tokenizer.bos_id] + tokenizer.encode("Había una vez un pueblo junto a un río")])
    with torch.no_grad():
        return model.lm_head(harness.hidden_states(model, idx)), model(idx)[0]


def test_the_head_applied_to_hidden_states_is_the_model_s_forward(loaded):
    head, forward = hidden_and_forward(loaded)
    assert torch.equal(head, forward)


def test_a_context_longer_than_the_window_is_cut_from_the_left_and_only_the_continuation_is_scored(loaded):
    # ids 0..11 in a 4-token window: inputs 7 8 9 10; the continuation 10 11 is predicted at positions
    # 2 and 3 (after 9 and after 10); 0..6 are dropped.
    assert harness.context_window(list(range(10)), [10, 11], seq_len=4) == ([7, 8, 9, 10], [10, 11])
    with pytest.raises(harness.EvalError, match="continuation of 5 tokens does not fit"):
        harness.context_window([1], [1, 2, 3, 4, 5], seq_len=4)
    model, tokenizer, _ = loaded
    context = [tokenizer.bos_id] + tokenizer.encode(open(f"{FIXTURES}/rolling_test.jsonl").read())[:100]
    continuation = tokenizer.encode(" y el gato")
    lm = enlace_lm(loaded)
    [(logprob, _)] = lm._loglikelihood_tokens([(None, context, continuation)])
    tokens = (context + continuation)[-65:]  # the last seq_len + 1 tokens
    with torch.no_grad():
        logits = model(torch.tensor([tokens[:-1]]))[0][0, -len(continuation) :]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(continuation)[:, None]).sum().item()
    assert logprob == pytest.approx(expected, abs=1e-5)
    assert lm.truncated == 1


YES_NO = """task: enlace_test_yes_no
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "Pregunta: {{{{question}}}}\\nRespuesta:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list: [{{metric: acc}}]
"""
QUESTIONS = ["¿El agua moja?", "¿El sol calienta?", "¿Los peces nadan?", "¿La nieve es fría?",
             "¿Los perros ladran?", "¿El fuego quema?", "¿Las plantas crecen?", "¿La noche es oscura?"]  # fmt: skip


def preferring(loaded, answer):
    """The run's model with its head rewired: every position predicts the same distribution, which
    favours the tokens of `answer` (" sí" or " no") over those of the other."""
    model, tokenizer, _ = loaded
    ids = {word: set(tokenizer.encode(" " + word)) for word in ("sí", "no")}
    other = "no" if answer == "sí" else "sí"
    assert not ids["sí"] & ids["no"]
    bias = torch.zeros(tokenizer.vocab_size)
    bias[sorted(ids[answer])], bias[sorted(ids[other])] = 8.0, -8.0
    rewired = copy.deepcopy(model)
    rewired.lm_head = torch.nn.Linear(model.cfg["d_model"], tokenizer.vocab_size, bias=True)
    with torch.no_grad():
        rewired.lm_head.weight.zero_()
        rewired.lm_head.bias.copy_(bias)
    return enlace_lm(loaded, model=rewired)


def test_a_model_preferring_the_right_answers_scores_100_percent_and_the_wrong_ones_0(loaded, tmp_path):
    # Every right answer is "sí", in first or second place: what the model prefers decides the accuracy,
    # whatever the order of the choices and of the requests (sorted by length for batching).
    docs = [{"question": q, "choices": ["sí", "no"] if i % 3 else ["no", "sí"], "answer": 0 if i % 3 else 1}
            for i, q in enumerate(QUESTIONS)]  # fmt: skip
    (tmp_path / "yes_no.jsonl").write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs))
    (tmp_path / "yes_no.yaml").write_text(YES_NO.format(data=tmp_path / "yes_no.jsonl"))
    plan = fixture_plan("enlace_test_yes_no", include_path=str(tmp_path))
    for answer, accuracy in (("sí", 1.0), ("no", 0.0)):
        results = evaluate(preferring(loaded, answer), "enlace_test_yes_no", include_path=str(tmp_path))
        [row] = harness.score_rows(results, plan)
        assert row["metric"] == "acc,none" and row["value"] == accuracy
        assert row["chance"] == 0.5 and row["centred"] == 2 * accuracy - 1


def test_the_centred_score_is_0_at_chance_1_at_perfect_and_the_mean_over_tasks():
    assert harness.centred(0.25, 0.25) == 0 and harness.centred(1.0, 1 / 3) == 1
    assert harness.centred(0.5, 0.5) == 0 and harness.centred(0.0, 0.0) == 0
    rows = [{"centred": 0.0}, {"centred": 0.5}, {"centred": None}]  # None: a perplexity task, not counted
    assert harness.score(rows) == 0.25


# -----------------------------------------------------------------------------
# The command


def test_eval_writes_lm_eval_s_results_a_table_and_samples_and_reuses_them(run, capsys):
    args = [run, "--tasks", "fixtures", "--log-samples"]
    assert evaluation.runs.main(args) == 0
    table = capsys.readouterr().out
    stem = os.path.join(run, "eval", "0000020-fixtures")
    stored = json.load(open(stem + ".json"))
    assert set(stored["results"]) == {
        "enlace_fixture_choice",
        "enlace_fixture_rolling",
        "enlace_fixture_generate",
    }
    assert {"configs", "versions", "n-shot", "config", "date"} <= set(stored)  # lm-eval's own record
    ckpt = os.path.join(run, "ckpt_0000020.pt")
    assert stored["enlace"]["step"] == 20 and stored["enlace"]["sha256"] == checkpoint_sha(ckpt)
    assert stored["results"]["enlace_fixture_choice"]["acc,none"] == stored["enlace"]["rows"][0]["value"]
    assert table == open(stem + ".md").read() and "| enlace_fixture_choice | 0 | 16 | acc,none |" in table
    assert "**centred score:" in table
    samples = [json.loads(line) for line in open(stem + "-samples-enlace_fixture_choice.jsonl")]
    assert len(samples) == 16 and all(len(s["resps"]) == len(s["doc"]["choices"]) for s in samples)

    assert evaluation.runs.main(args) == 0  # the same checkpoint and request: the stored result
    again = capsys.readouterr()
    assert again.out == table and "reused" in again.err
    assert evaluation.runs.main([*args, "--limit", "3"]) == 0  # another request: another file
    assert os.path.isfile(stem + "-limit3.json") and "reused" not in capsys.readouterr().err


def checkpoint_sha(path):
    import fileio

    return fileio.sha256_of_file(path)


def test_a_byte_level_run_is_evaluated_with_its_byte_tokenizer_and_refuses_chat(
    tmp_path, byte_data_dir, capsys
):
    train.train(
        tiny_config(tmp_path, "bytes", byte_data_dir, "run_name=bytes", "model.seq_len=64"), log=quiet
    )
    run = str(tmp_path / "bytes")
    assert (
        evaluation.runs.main(
            [run, "--tasks", "enlace_fixture_choice", "--include-path", FIXTURES, "--limit", "4"]
        )
        == 0
    )
    assert "| enlace_fixture_choice | 0 | 4 | acc,none |" in capsys.readouterr().out
    assert evaluation.runs.main([run, "--tasks", "fixtures", "--chat"]) == 2
    assert "a bytes run has no chat template" in capsys.readouterr().err


def without_tokenizer(run, tmp_path):
    """A copy of the run's checkpoint from before checkpoints carried their tokenizer, whose data folder
    (and so its tokenizer) is gone."""
    state = torch.load(os.path.join(run, "ckpt_0000020.pt"), weights_only=True)
    del state["tokenizer"]
    state["config"]["data"]["dir"] = str(tmp_path / "gone")
    (tmp_path / "old").mkdir()
    torch.save(state, tmp_path / "old" / "ckpt_0000020.pt")
    return str(tmp_path / "old")


@pytest.mark.parametrize(
    "case, expected",
    [
        ("no checkpoints", "no checkpoints (ckpt_<step>.pt); train it first"),
        ("tokenizer missing", "tokenizer not found"),
        ("unknown task", "'enlace_fixture_choise': no such lm-eval task or suite; did you mean enlace_fixture_choice"),
        ("unknown suite", "'enlace-e': no such lm-eval task or suite; did you mean enlace-es"),
        ("dataset unreadable", "enlace_fixture_missing: cannot read json files tests/fixtures/eval/nothing-here.jsonl (not found)"),
        ("real suite offline", "belebele_spa_Latn: cannot read facebook/belebele (spa_Latn)"),
    ],
)  # fmt: skip
def test_bad_input_is_a_clear_error_and_writes_nothing(case, expected, run, tmp_path, capsys):
    target, tasks = run, "fixtures"
    if case == "no checkpoints":
        target = str(tmp_path)
    elif case == "tokenizer missing":
        target = without_tokenizer(run, tmp_path)
    elif case == "unknown task":
        tasks = "enlace_fixture_choise"
    elif case == "unknown suite":
        tasks = "enlace-e"
    elif case == "dataset unreadable":
        shutil.copy(f"{FIXTURES}/enlace_fixture_choice.yaml", tmp_path / "missing.yaml")
        text = (tmp_path / "missing.yaml").read_text().replace("choice_test.jsonl", "nothing-here.jsonl")
        (tmp_path / "missing.yaml").write_text(
            text.replace("task: enlace_fixture_choice", "task: enlace_fixture_missing")
        )
        tasks = "enlace_fixture_missing"
    else:
        tasks = "enlace-es"
    before = sorted(os.listdir(os.path.join(run, "eval"))) if os.path.isdir(os.path.join(run, "eval")) else []
    include = str(tmp_path) if case == "dataset unreadable" else FIXTURES  # one task index for the rest
    assert evaluation.runs.main([target, "--tasks", tasks, "--include-path", include, "--limit", "2"]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err
    if case == "real suite offline":  # every SpanishBench dataset is named, and how to get them
        assert (
            "BSC-LT/COPA-es" in err
            and "python -m evaluation download" in err
            and "HF_DATASETS_OFFLINE=1" in err
        )
    after = sorted(os.listdir(os.path.join(run, "eval"))) if os.path.isdir(os.path.join(run, "eval")) else []
    assert after == before and not os.path.exists(os.path.join(target, "eval", "0000020-enlace-es.json"))


def test_limit_0_is_refused_by_the_command_line(run, capsys):
    with pytest.raises(SystemExit) as exit_status:
        evaluation.runs.main([run, "--limit", "0"])
    assert exit_status.value.code == 2 and "--limit 0: expected a number >= 1" in capsys.readouterr().err


# -----------------------------------------------------------------------------
# During training (train.eval)

TRAIN_EVAL = f"train.eval={{tasks: enlace_fixture_choice, include_path: {FIXTURES}, limit: 4, interval: 4}}"


def test_train_eval_logs_a_benchmark_at_its_interval_and_leaves_the_training_unchanged(
    tmp_path, shard_data_dir
):
    for name, extra in (("plain", []), ("benchmarked", [TRAIN_EVAL])):
        train.train(tiny_config(tmp_path, "shards", shard_data_dir, f"run_name={name}", *extra), log=quiet)
    records = [json.loads(line) for line in open(tmp_path / "benchmarked" / "metrics.jsonl")]
    benchmarks = [r for r in records if "eval_score" in r]
    assert [r["step"] for r in benchmarks] == [4, 8]
    assert all(set(r["eval_tasks"]) == {"enlace_fixture_choice"} and r["eval_limit"] == 4 for r in benchmarks)
    assert all(-1 <= r["eval_score"] <= 1 for r in benchmarks)
    plain, benchmarked = (
        torch.load(tmp_path / n / "ckpt_0000008.pt", weights_only=True) for n in ("plain", "benchmarked")
    )
    assert all(torch.equal(plain["model"][k], benchmarked["model"][k]) for k in plain["model"])


def test_train_eval_without_its_data_trains_without_the_benchmark_and_says_how_to_fetch_it(
    tmp_path, shard_data_dir
):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    text = open(f"{FIXTURES}/enlace_fixture_choice.yaml").read().replace("choice_test.jsonl", "gone.jsonl")
    (tasks / "gone.yaml").write_text(text)
    block = f"train.eval={{tasks: enlace_fixture_choice, include_path: {tasks}, limit: 4, interval: 4}}"
    said = []
    train.train(tiny_config(tmp_path, "shards", shard_data_dir, "run_name=gone", block), log=said.append)
    (skipped,) = [line for line in said if line.startswith("train.eval:")]
    assert (
        "train.eval: skipped, training without the benchmark: enlace_fixture_choice: cannot read json"
        in skipped
    )
    assert "`python -m evaluation download enlace_fixture_choice`" in skipped and "\n" not in skipped
    records = [json.loads(line) for line in open(tmp_path / "gone" / "metrics.jsonl")]
    assert records and not any("eval_score" in r for r in records)
    assert checkpoint.list_checkpoints(str(tmp_path / "gone"))  # it trained to the end


def test_train_eval_naming_a_task_that_does_not_exist_still_stops_the_run_before_its_first_step(
    tmp_path, shard_data_dir
):
    block = f"train.eval={{tasks: enlace_fixture_choise, include_path: {FIXTURES}, limit: 4, interval: 4}}"
    with pytest.raises(train.TrainError, match=r"train.eval: 'enlace_fixture_choise': no such lm-eval task"):
        train.train(tiny_config(tmp_path, "shards", shard_data_dir, "run_name=typo", block), log=quiet)
    assert not checkpoint.list_checkpoints(str(tmp_path / "typo"))


# -----------------------------------------------------------------------------
# The report card


def test_the_report_card_shows_the_run_its_benchmarks_its_fine_tuned_run_samples_and_plot(
    run, runs, chat_data_dir, capsys
):  # fmt: skip
    assert evaluation.runs.main([run, "--tasks", "fixtures"]) == 0  # stored (or reused) for the card
    sft = tiny_config(
        runs, "chat", chat_data_dir, "run_name=sft", f"train.init_from={run}", "model.d_model=64"
    )
    train.train(sft, log=quiet)
    rates = {"conversations": 12, "valid_syntax_rate": 0.5, "right_tool_rate": 0.75, "exact_argument_rate": 0.25,
             "uses_result_rate": None, "data": "data/agent/eval.jsonl"}  # what agent/dataset.py eval writes  # fmt: skip
    (runs / "sft" / "agent_eval.json").write_text(json.dumps(rates))
    capsys.readouterr()

    assert evaluation.runs.main(["report", run]) == 0
    card = open(os.path.join(run, "report.md")).read()
    assert card == capsys.readouterr().out
    for part in ["# Report card: base", "ckpt_0000020.pt` (step 20 of 20)", "| model | 0.",
                 "20 steps × 512 tokens = 10,240 tokens seen", "profile `cpu`: cpu, float32", "| wall time |",
                 "characters (", "bytes) per token over", "| val | loss ", "#### base · step 20 · fixtures",
                 "| enlace_fixture_choice | 0 | 16 | acc,none |", f"### fine-tuned from it: `{os.path.relpath(runs / 'sft')}`",
                 "## Samples", "> **Había una vez**", "![loss, val loss, bits per byte and learning rate](plot.png)"]:  # fmt: skip
        assert part in card, part
    assert os.path.isfile(os.path.join(run, "plot.png")) and card.count("> **") == 3

    assert evaluation.runs.main(["report", str(runs / "sft")]) == 0
    card = capsys.readouterr().out
    assert f"### base run `{run}`" in card and "#### base · step 20 · fixtures" in card
    assert "## Tool use" in card and "| 12 | 0.500 | 0.750 | 0.250 | – |" in card
    assert "> **¿Qué podemos cenar hoy?** →" in card and "n/a (conversation data" in card
