"""agent/call_bias.py: the decision to call, calibrated. A bias on <tool_call>'s logit at a reply's first token,
applied by the constraint every caller builds (agent/grammar.py constraint_for), chosen per run on the generated
evaluation set alone (evaluation/tool_use.py), written to RUN/call_bias.json and its report card, and used
where the run is served, sampled and evaluated."""

import io
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from test_agent_grammar import NoisyModel

import data
import sample
from agent import call_bias, dataset, grammar, tools
from evaluation import runs, tool_use
from serve import app

OPEN = data.TOKEN_TABLE["<tool_call>"]


@pytest.fixture(scope="module")
def tokenizer(shard_data_dir):
    return data.SentencePieceTokenizer(f"{shard_data_dir}/tokenizer.model")


@pytest.fixture(scope="module")
def settings():
    return tools.load_settings()


def first_token(tokenizer, settings, bias, open_logit, text_logit):
    """The greedy first token of a reply offered our tools, the model's logits standing in: <tool_call> at
    open_logit, a word at text_logit, the rest far below."""
    constraint = grammar.constraint_for(
        tokenizer, tools.tool_specs(settings), call_bias.with_value(settings, bias), 200
    )
    logits = torch.full((tokenizer.vocab_size,), -10.0)
    word = tokenizer.encode("Hola")[0]
    logits[OPEN], logits[word] = open_logit, text_logit
    token = int(constraint.mask(logits).argmax())
    return {OPEN: "call", word: "text"}[token], constraint


def test_the_call_bias_moves_the_first_decision_the_way_it_is_configured(tokenizer, settings):
    assert first_token(tokenizer, settings, 0.0, 0.5, 1.0)[0] == "text"
    assert first_token(tokenizer, settings, 1.0, 0.5, 1.0)[0] == "call"  # a positive bias opens more calls
    assert first_token(tokenizer, settings, 0.0, 1.0, 0.5)[0] == "call"
    chosen, constraint = first_token(tokenizer, settings, -1.0, 1.0, 0.5)  # a negative one, fewer
    assert chosen == "text" and constraint.margin == pytest.approx(0.5)  # the margin before the bias


def test_the_call_bias_weighs_only_the_first_token_of_a_reply(tokenizer, settings):
    constraint = grammar.constraint_for(
        tokenizer, tools.tool_specs(settings), call_bias.with_value(settings, 5.0)
    )
    logits = torch.zeros(tokenizer.vocab_size)
    assert constraint.mask(logits.clone())[OPEN] == 5.0
    constraint.accept(tokenizer.encode("Hola")[0])
    assert constraint.mask(logits.clone())[OPEN] == 0.0  # a call after some text: as the model ranks it


def decision(needed, margin, called, words=None):
    return call_bias.Decision(needed, margin, called, words)


def test_the_chooser_takes_the_best_balance_of_right_tool_and_no_tool_and_the_smallest_bias_on_a_tie():
    decided = [decision("calculadora", -1.5, "calculadora"), decision("fecha_hora", 0.5, "fecha_hora"),
               decision(None, 0.2, "buscar_web"), decision(None, -3.0, "calculadora")]  # fmt: skip
    value, rows = call_bias.choose(decided, [-4, -1, 0, 1, 2, 4])
    by_bias = {row["bias"]: row for row in rows}
    assert by_bias[0]["right_tool"] == 0.5 and by_bias[0]["no_tool"] == 0.5
    assert by_bias[-1]["right_tool"] == 0.0 and by_bias[-1]["no_tool"] == 1.0
    assert by_bias[2]["right_tool"] == 1.0 and by_bias[2]["no_tool"] == 0.5  # the best balance: 0.75
    assert by_bias[4]["no_tool"] == 0.0 and value == 2  # 2 and 4 would tie on right tool; 2 keeps no tool
    flat = [decision("calculadora", 1.0, "calculadora"), decision(None, -1.0, "calculadora")]
    assert call_bias.choose(flat, [-0.5, 0.5, 0])[0] == 0  # every candidate alike: the smallest in size
    late = [
        decision("calculadora", None, None, "calculadora")
    ]  # no call may open first: the later one counts
    assert call_bias.rates(late, 4)["right_tool"] == 1.0


def test_the_chooser_never_reads_the_handwritten_set(settings):
    entries = dataset.read_jsonl(tool_use.HANDWRITTEN)[:2]
    count = tools.Agent(settings).count_tokens
    handwritten = list(tool_use.handwritten_cases(entries, settings, count, 4096))
    with pytest.raises(ValueError, match="generated set only"):
        tool_use.choose_bias(handwritten, [], settings["call_bias"]["candidates"])


def test_the_chosen_bias_lands_in_the_card_and_is_used_where_the_run_is_served_sampled_and_evaluated(
    chat_run, settings, tmp_path, monkeypatch
):
    run = tmp_path / "run"
    shutil.copytree(chat_run, run)
    small = json.loads(json.dumps(settings))
    small["synthetic"].update(conversations=60, eval_fraction=0.2)
    generated = tmp_path / "eval.jsonl"
    dataset.write_jsonl(str(generated), dataset.generate(small)[1])
    seen = []
    choose = call_bias.choose
    monkeypatch.setattr(
        call_bias, "choose", lambda decided, candidates: seen.append(decided) or choose(decided, candidates)
    )
    argv = [str(run), "--generated", str(generated), "--limit", "4", "--max-new-tokens", "6"]
    # another hand-written set changes nothing of the choice: it is never read for it
    other = tmp_path / "other.jsonl"
    dataset.write_jsonl(str(other), dataset.read_jsonl(tool_use.HANDWRITTEN)[-4:])
    assert tool_use.main([*argv, "--handwritten", str(other), "--report", str(tmp_path / "other.json")]) == 0
    first = json.loads((run / call_bias.FILE).read_text())
    assert tool_use.main(argv) == 0
    record = json.loads((run / call_bias.FILE).read_text())
    assert record["sweep"] == first["sweep"] and record["chosen_on"] == str(generated)
    assert len(seen) == 2 and all(len(decided) == 4 for decided in seen)  # the 4 generated prompts alone
    # the fixture's run writes gibberish: choose a bias by hand so the test sees it travel
    record["value"] = 3.5
    (run / call_bias.FILE).write_text(json.dumps(record))
    report = json.loads((run / "agent_eval.json").read_text())
    assert report["call_bias"]["chosen_on"] == str(generated) and set(report["sets"]["hand-written"]["call_bias"]) == {
        "value", "without", "with"}  # fmt: skip
    assert "Call bias **3.5**" in runs.agent_rates(str(run))
    served, line = app.agent_settings_for(str(run))
    assert served["call_bias"]["value"] == 3.5 and "3.5" in line and call_bias.FILE in line
    assert call_bias.settings_for_run(settings, str(run))["call_bias"]["value"] == 3.5  # sample.py --chat's
    (run / call_bias.FILE).unlink()
    assert app.agent_settings_for(str(run))[0]["call_bias"]["value"] == settings["call_bias"]["value"]
    # evaluated in other modes than it is served with, the run's own bias is left alone
    assert tool_use.main([*argv, "--grounding", "off", "--report", str(tmp_path / "off.json")]) == 0
    assert not (run / call_bias.FILE).exists()
    assert json.loads((tmp_path / "off.json").read_text())["call_bias"]["file"] is None


def test_the_chat_repl_decides_with_the_runs_own_call_bias(tokenizer, settings, tmp_path, monkeypatch):
    monkeypatch.setattr(tools, "searcher_from_env", lambda provider: dataset.CannedSearch([]))
    (tmp_path / call_bias.FILE).write_text(json.dumps({"value": 7.0, "chosen_on": "eval.jsonl", "sweep": []}))
    seen, build = [], grammar.constraint_for
    monkeypatch.setattr(grammar, "constraint_for", lambda *a, **k: seen.append(build(*a, **k)) or seen[-1])
    args = SimpleNamespace(run=str(tmp_path), max_new_tokens=60, temperature=1.0, top_k=None, top_p=None, seed=0,
                           system="", no_tools=False)  # fmt: skip
    model = NoisyModel(tokenizer, adversarial=False, ends=True).eval()
    sample.run_chat(model, tokenizer, {"model": model.cfg, "agent": settings}, args,
                    io.StringIO("¿Cuánto es 17 por 23?\n/exit\n"), io.StringIO())  # fmt: skip
    assert seen and all(constraint.bias == 7.0 for constraint in seen)


def test_the_sweep_generates_the_other_reply_only_where_a_candidate_would_flip_the_first_token():
    margins = {"seguro": 10.0, "dudoso": 1.0, "nunca": -9.0}
    calls = []

    def policy(conversation, bias):  # a stand-in model: its first-token margin, and what each path writes
        question = conversation["messages"][-1]["content"]
        calls.append((question, bias))
        policy.margin = margins[question]
        opens = policy.margin + bias > 0
        return ('<tool_call>\n{"name": "calculadora", "arguments": {"expresion": "2+2"}}\n</tool_call>' if opens
                else "Son cuatro.", False)  # fmt: skip

    cases = [
        {"prompt": {"messages": [{"role": "user", "content": q}]}, "tool": "calculadora"} for q in margins
    ]
    decided = tool_use.decisions(cases, policy, [0.0, -4, -1, 1, 4], log=lambda *a: None)
    assert [sum(q == question for q, _ in calls) for question in margins] == [1, 2, 1]
    for (decision, opened, words), margin in zip(decided, margins.values(), strict=True):
        assert decision.margin == margin
        for bias in (-4, -1, 0.0, 1, 4):  # each bias finds the reply it would give
            chosen = opened if call_bias.opens(decision, bias) else words
            assert chosen is not None and ("<tool_call>" in chosen[0]) == (margin + bias > 0)
