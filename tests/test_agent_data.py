"""agent_data.py: the seeded tool-use conversations and the evaluation's four rates."""

import collections
import json

import pytest

import agent
import agent_data
import agent_grammar
import chat
import config


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
        fact = agent_data.result_fact(call["name"], call["arguments"], result, answer.lower())
        assert fact is not None and fact in answer.lower(), (result, answer)
        seen[kind_of(conversation)] += 1
    assert min(seen.values()) > 0


def replaying(conversations, broken=False, silent=False):
    """A policy that gives the reference reply (or a broken / tool-less version of it)."""
    by_prompt = {}
    for conversation in conversations:
        messages = conversation["messages"]
        by_prompt[json.dumps(messages[:2])] = chat.assistant_text(messages[2])
        if "tool_calls" in messages[2]:
            by_prompt[json.dumps(messages[:4])] = messages[4]["content"]

    def reply(conversation):
        text = by_prompt[json.dumps(conversation["messages"])]
        if silent:
            return "No lo sé."
        if broken and "<tool_call>" in text:
            return text.replace("}}", "}")
        return text

    return reply


def test_the_reference_replies_score_one_on_every_rate(generated):
    _, held_out = generated
    report = agent_data.evaluate(held_out, replaying(held_out), log=lambda *a: None)
    assert report["conversations"] == len(held_out)
    assert report["valid_syntax_rate"] == report["right_tool_rate"] == 1.0
    assert report["exact_argument_rate"] == report["uses_result_rate"] == 1.0


def test_a_model_that_never_calls_scores_zero_syntax_and_right_tool_only_where_none_is_needed(generated):
    _, held_out = generated
    report = agent_data.evaluate(held_out, replaying(held_out, silent=True), log=lambda *a: None)
    no_tool = sum("tool_calls" not in c["messages"][2] for c in held_out)
    assert report["valid_syntax_rate"] == report["exact_argument_rate"] == report["uses_result_rate"] == 0.0
    assert report["right_tool_rate"] == round(no_tool / len(held_out), 4)
    assert report["needing_a_tool"] == len(held_out) - no_tool


def test_broken_json_counts_against_syntax_but_the_named_tool_still_counts_as_right(generated):
    _, held_out = generated
    report = agent_data.evaluate(held_out, replaying(held_out, broken=True), log=lambda *a: None)
    assert report["valid_syntax_rate"] == report["exact_argument_rate"] == 0.0
    assert report["right_tool_rate"] == 1.0


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


def test_the_model_policy_reuses_its_cache_and_generates_what_generate_does(generated, shard_data_dir):
    import torch

    import data
    from model import Transformer

    tokenizer = data.SentencePieceTokenizer(f"{shard_data_dir}/tokenizer.model")
    torch.manual_seed(0)
    cfg = config.load_layer("model", f"{agent.ROOT}/configs/model/smoke.yaml")
    cfg.update(vocab_size=tokenizer.vocab_size, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2)
    cfg.update(ffn_hidden=64, seq_len=2048)
    model = Transformer(cfg).eval()
    _, held_out = generated
    tool_conversation = next(c for c in held_out if "tool_calls" in c["messages"][2])
    prompts = [
        {"messages": tool_conversation["messages"][:2], "tools": tool_conversation["tools"]},
        {"messages": tool_conversation["messages"][:4], "tools": tool_conversation["tools"]},  # extends it
        {"messages": held_out[1]["messages"][:2], "tools": held_out[1]["tools"]},
        {"messages": tool_conversation["messages"][:2], "tools": tool_conversation["tools"]},
    ]
    reply = agent_data.model_reply(model, tokenizer, max_new_tokens=6, settings=agent.load_settings())
    end = tokenizer.special_ids["<|end|>"]
    for prompt in prompts:
        ids, _ = chat.render(prompt, tokenizer, for_generation=True)
        constraint = agent_grammar.constraint_for(tokenizer, prompt["tools"], agent.load_settings())
        expected = list(model.generate(torch.tensor(ids), 6, 0.0, stop_token=end, constraint=constraint))
        assert reply(prompt) == tokenizer.decode([t for t in expected if t != end])
    report = agent_data.evaluate(held_out[:3], reply, log=lambda *a: None)
    assert report["conversations"] == 3 and 0.0 <= report["right_tool_rate"] <= 1.0
