"""agent_data.py: the seeded tool-use conversations and the evaluation's four rates."""

import collections
import json

import pytest

import agent
import agent_data
import agent_eval
import chat


@pytest.fixture(scope="module")
def small():
    settings = agent.load_settings()
    settings["synthetic"]["conversations"] = 300
    settings["synthetic"]["eval_fraction"] = 0.2
    return settings


@pytest.fixture(scope="module")
def generated(small):
    return agent_data.generate(small)


def kind_of(conversation):
    return conversation["source"].split()[1]


def test_the_same_seed_writes_the_same_conversations_and_another_seed_others(small, generated):
    assert agent_data.generate(small) == generated
    other = json.loads(json.dumps(small))
    other["synthetic"]["seed"] += 1
    assert agent_data.generate(other)[0] != generated[0]


def test_every_kind_of_the_mix_is_there_and_every_conversation_renders(generated):
    train, held_out = generated
    kinds = collections.Counter(kind_of(c) for c in train + held_out)
    assert set(kinds) == set(agent.load_settings()["synthetic"]["mix"])
    for conversation in train + held_out:
        chat.check_conversation(conversation)
        assert conversation["tools"] == agent.tool_specs(agent.load_settings())
        assert conversation["messages"][0]["content"].startswith(agent.load_settings()["system_prompt"])


def test_no_question_is_both_trained_on_and_held_out(generated):
    train, held_out = generated
    asked = [c["messages"][1]["content"] for c in held_out]
    assert len(asked) == len(set(asked)) > 10
    assert not set(asked) & {c["messages"][1]["content"] for c in train}


def test_tool_results_are_the_real_tools_and_answers_state_them(generated, small):
    train, held_out = generated
    seen = collections.Counter()
    for conversation in train + held_out:
        messages = conversation["messages"]
        if "tool_calls" not in messages[2]:
            assert len(messages) == 3
            continue
        call = messages[2]["tool_calls"][0]["function"]
        result, answer = messages[3]["content"], messages[4]["content"]
        if call["name"] == "calculadora":
            value = agent.calculate(call["arguments"]["expresion"], small["calculator"])
            assert result == agent.format_number(value)
        if kind_of(conversation) == "sin_resultados":
            assert result == "Sin resultados"
        if kind_of(conversation) == "error_busqueda":
            assert result.startswith("Error: la búsqueda ha fallado en todos los proveedores")
        if kind_of(conversation) == "buscar_web":
            assert result.startswith("[1] ") and answer.startswith("Según [1]")
            assert answer.endswith("\n\nFuentes:\n[1] " + result.split(" — ")[1].split("\n")[0])
        fact = agent_eval.result_fact(call["name"], call["arguments"], result, answer.lower())
        assert fact is not None and fact in answer.lower(), (result, answer)
        seen[kind_of(conversation)] += 1
    assert min(seen.values()) > 0


def test_generate_writes_both_files(tmp_path):
    settings_file = tmp_path / "agent" / "tiny.yaml"
    settings_file.parent.mkdir()
    (tmp_path / "agent" / "default.yaml").write_text(open(agent.DEFAULT_SETTINGS, encoding="utf-8").read())
    settings_file.write_text("include: agent/default.yaml\nagent:\n  synthetic:\n    conversations: 40\n")
    assert agent_data.main(["generate", str(tmp_path / "out"), "--settings", str(settings_file)]) == 0
    train = agent_data.read_jsonl(tmp_path / "out" / "train.jsonl")
    held_out = agent_data.read_jsonl(tmp_path / "out" / "eval.jsonl")
    assert 0 < len(held_out) < len(train) and len(train) + len(held_out) <= 40
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["eval.jsonl", "train.jsonl"]
