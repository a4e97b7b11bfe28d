"""evaluation/tool_use.py: the rates on the generated and the hand-written sets, and the model as a policy."""

import json

import pytest

import config
from agent import dataset, grammar, tools
from chat import template
from decode import engine
from evaluation import tool_use


@pytest.fixture(scope="module")
def settings():
    return tools.load_settings()


@pytest.fixture(scope="module")
def held_out(settings):
    small = json.loads(json.dumps(settings))
    small["synthetic"].update(conversations=300, eval_fraction=0.2)
    return dataset.generate(small)[1]


@pytest.fixture(scope="module")
def handwritten_cases(settings):
    entries = dataset.read_jsonl(tool_use.HANDWRITTEN)
    return list(tool_use.handwritten_cases(entries, settings, tools.Agent(settings).count_tokens, 4096))


def replaying(cases, broken=False, silent=False):
    """A policy that gives each case's reference reply (or a broken / tool-less version of it), and for
    an answer prompt repeats the tool's result."""
    by_prompt = {}
    for case in cases:
        messages = case["prompt"]["messages"]
        reference = case.get("reference") or {"content": "Eso no necesita herramientas."}
        by_prompt[json.dumps(messages)] = template.assistant_text(reference)
        if "answer_prompt" in case:  # the reference answer, or (hand-written set) the result itself
            answer = case.get("reference_answer", case["answer_prompt"]["messages"][-1]["content"])
            by_prompt[json.dumps(case["answer_prompt"]["messages"])] = answer

    def reply(conversation):
        text = by_prompt[json.dumps(conversation["messages"])]
        if silent:
            return "No lo sé.", False
        if broken and "<tool_call>" in text:
            return text.replace("}}", "}"), False
        return text, False

    return reply


def test_the_reference_replies_score_one_on_every_rate_of_both_sets(held_out, handwritten_cases, settings):
    for cases in (list(tool_use.generated_cases(held_out)), handwritten_cases):
        report = tool_use.evaluate(cases, replaying(cases), settings, log=lambda *a: None)
        assert report["counts"]["all"] == len(cases)
        assert report["right_rate"] == report["valid_rate"] == report["arguments_rate"] == 1.0
        assert report["uses_rate"] == 1.0 and report["counts"]["cut"] == 0
        calculations = report["by_tool"]["calculadora"]
        assert calculations["value"] == calculations["prompts"]  # the reference's own value


def test_the_handwritten_set_is_asked_as_the_server_asks_a_member(handwritten_cases, settings):
    assert len(handwritten_cases) >= 80
    for case in handwritten_cases:
        assert [spec["function"]["name"] for spec in case["tools"]] == list(tools.TOOLS)  # all six
        system = case["prompt"]["messages"][0]["content"]
        assert (
            system.startswith(settings["system_prompt"])
            and "Hoy es lunes, 30 de noviembre de 2026." in system
        )
        if case["tool"] == "olvidar" and "recuerdo" not in case["question"].lower():
            number = case["answer_prompt"]["messages"][-2]["tool_calls"][0]["function"]["arguments"]["id"]
            assert f"- [{number}] " in system  # the number to forget is listed, as the server lists it
        if "answer_prompt" in case:
            result = case["answer_prompt"]["messages"][-1]["content"]
            assert not result.startswith("Error"), (case["question"], result)  # every reference call works


def test_a_model_that_never_calls_is_right_only_where_no_tool_is_needed(handwritten_cases, settings):
    report = tool_use.evaluate(handwritten_cases, replaying(handwritten_cases, silent=True), settings)
    no_tool = sum(case["tool"] is None for case in handwritten_cases)
    assert report["right_rate"] == round(no_tool / len(handwritten_cases), 4)
    assert report["valid_rate"] is None and report["arguments_rate"] == report["uses_rate"] == 0.0
    assert report["by_tool"]["ninguna"] == {"prompts": no_tool, "right": no_tool, "arguments": 0, "value": 0}


def test_broken_json_counts_against_syntax_but_the_named_tool_still_counts_as_right(
    handwritten_cases, settings
):
    report = tool_use.evaluate(handwritten_cases, replaying(handwritten_cases, broken=True), settings)
    assert report["valid_rate"] == report["arguments_rate"] == 0.0 and report["right_rate"] == 1.0


@pytest.mark.parametrize(
    "arguments, keys, holds",
    [
        ({"expresion": "3*2.35"}, {"expresion": ["3", "2,35"]}, True),  # a decimal point or comma alike
        ({"expresion": "3*2"}, {"expresion": ["3", "2,35"]}, False),
        ({"consulta": "farmacia guardia cuenca"}, {"consulta": ["farmacia", "Cuenca"]}, True),
        ({"zona": "America/Bogota"}, {"zona": "America/Bogota"}, True),
        ({"zona": "America/Lima"}, {"zona": "America/Bogota"}, False),
        ({}, {"zona": None, "dias": None}, True),
        ({"dias": 0}, {"zona": None, "dias": None}, False),
        ({"texto": "Guardar", "ambito": "privado"}, {"texto": ["guardar"], "ambito": "familia"}, False),
    ],
)
def test_key_values_are_compared_without_case_accents_or_the_decimal_sign(arguments, keys, holds):
    assert tool_use.key_values_hold(arguments, keys) is holds


def tiny_model(shard_data_dir, seq_len):
    import torch

    import data
    from model import Transformer

    tokenizer = data.SentencePieceTokenizer(f"{shard_data_dir}/tokenizer.model")
    torch.manual_seed(0)
    cfg = config.load_layer("model", f"{tools.ROOT}/configs/model/smoke.yaml")
    cfg.update(vocab_size=tokenizer.vocab_size, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2)
    cfg.update(ffn_hidden=64, seq_len=seq_len)
    return Transformer(cfg).eval(), tokenizer


def test_the_model_policy_reuses_its_cache_and_generates_what_generate_does(
    held_out, shard_data_dir, settings
):
    import torch

    model, tokenizer = tiny_model(shard_data_dir, 2048)
    tool_conversation = next(c for c in held_out if "tool_calls" in c["messages"][2])
    prompts = [
        {"messages": tool_conversation["messages"][:2], "tools": tool_conversation["tools"]},
        {"messages": tool_conversation["messages"][:4], "tools": tool_conversation["tools"]},  # extends it
        {"messages": held_out[1]["messages"][:2], "tools": held_out[1]["tools"]},
        {"messages": tool_conversation["messages"][:2], "tools": tool_conversation["tools"]},
    ]
    reply = tool_use.model_reply(model, tokenizer, 6, settings)
    end = tokenizer.special_ids["<|end|>"]
    for prompt in prompts:
        ids, _ = template.render(prompt, tokenizer, for_generation=True)
        constraint = grammar.constraint_for(tokenizer, prompt["tools"], settings, 6, prompt["messages"])
        expected = list(
            engine.generate(model, torch.tensor(ids), 6, 0.0, stop_token=end, constraint=constraint)
        )
        assert reply(prompt)[0] == tokenizer.decode([t for t in expected if t != end])


def test_agent_eval_prints_both_sets_side_by_side_and_writes_the_report(chat_run, held_out, tmp_path, capsys):
    path = tmp_path / "eval.jsonl"
    dataset.write_jsonl(str(path), held_out)
    report = tmp_path / "report.json"
    argv = [
        chat_run,
        "--generated",
        str(path),
        "--limit",
        "3",
        "--max-new-tokens",
        "6",
        "--call-bias-file",
        str(tmp_path / "call_bias.json"),
        "--report",
        str(report),
    ]
    assert tool_use.main(argv) == 0
    shown = capsys.readouterr().out
    assert "generated" in shown and "hand-written" in shown and "right tool" in shown
    written = json.loads(report.read_text())
    assert written["sets"]["hand-written"]["counts"]["all"] == 3 and written["constrained"] is True
    assert written["grounding"] == "constrained" and "value unavailable" in shown
    hint = tmp_path / "hint.json"
    assert tool_use.main([*argv[:-1], str(hint), "--grounding", "hint"]) == 0
    assert json.loads(hint.read_text())["grounding"] == "hint"
    assert tool_use.report_name("hint") == "agent_eval-hint.json"
    assert tool_use.main([chat_run, "--generated", str(tmp_path / "missing.jsonl")]) == 2


def test_a_calculation_counts_its_value_and_a_prompt_without_the_values_counts_as_unavailable(settings):
    prompt = {
        "messages": [{"role": "user", "content": "Haz cualquier cuenta"}],
        "tools": tools.tool_specs(settings),
    }
    case = {"set": "handwritten", "question": "", "tools": prompt["tools"], "prompt": prompt, "tool": "calculadora",
            "check": lambda arguments: False, "expected": {"expresion": "17*23"}}  # fmt: skip
    settings = {**settings, "grounding": {**settings["grounding"], "numbers": []}}
    other = dict(case, expected={"expresion": "17*24"})
    words = lambda conversation: ("No sé qué cuenta quieres: ¿me dices los números?", False)  # noqa: E731
    report = tool_use.evaluate([case, other], words, settings, log=lambda *a: None)
    assert report["counts"]["unavailable"] == 2 and report["counts"]["in_words"] == 2
    assert tool_use.value_right(case, {"expresion": "23 * 17"}, settings)
    assert not tool_use.value_right(other, {"expresion": "23 * 17"}, settings)
