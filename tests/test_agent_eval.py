"""agent_eval.py: the evaluation's rates on held-out conversations, and the model as a policy."""

import json

import pytest

import agent
import agent_data
import agent_eval
import agent_grammar
import chat
import config


@pytest.fixture(scope="module")
def generated():
    settings = agent.load_settings()
    settings["synthetic"]["conversations"] = 300
    settings["synthetic"]["eval_fraction"] = 0.2
    return agent_data.generate(settings)


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
    report = agent_eval.evaluate(held_out, replaying(held_out), log=lambda *a: None)
    assert report["conversations"] == len(held_out)
    assert report["valid_syntax_rate"] == report["right_tool_rate"] == 1.0
    assert report["exact_argument_rate"] == report["uses_result_rate"] == 1.0


def test_a_model_that_never_calls_scores_zero_syntax_and_right_tool_only_where_none_is_needed(generated):
    _, held_out = generated
    report = agent_eval.evaluate(held_out, replaying(held_out, silent=True), log=lambda *a: None)
    no_tool = sum("tool_calls" not in c["messages"][2] for c in held_out)
    assert report["valid_syntax_rate"] == report["exact_argument_rate"] == report["uses_result_rate"] == 0.0
    assert report["right_tool_rate"] == round(no_tool / len(held_out), 4)
    assert report["needing_a_tool"] == len(held_out) - no_tool


def test_broken_json_counts_against_syntax_but_the_named_tool_still_counts_as_right(generated):
    _, held_out = generated
    report = agent_eval.evaluate(held_out, replaying(held_out, broken=True), log=lambda *a: None)
    assert report["valid_syntax_rate"] == report["exact_argument_rate"] == 0.0
    assert report["right_tool_rate"] == 1.0


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
    reply = agent_eval.model_reply(model, tokenizer, max_new_tokens=6, settings=agent.load_settings())
    end = tokenizer.special_ids["<|end|>"]
    for prompt in prompts:
        ids, _ = chat.render(prompt, tokenizer, for_generation=True)
        constraint = agent_grammar.constraint_for(tokenizer, prompt["tools"], agent.load_settings())
        expected = list(model.generate(torch.tensor(ids), 6, 0.0, stop_token=end, constraint=constraint))
        assert reply(prompt) == tokenizer.decode([t for t in expected if t != end])
    report = agent_eval.evaluate(held_out[:3], reply, log=lambda *a: None)
    assert report["conversations"] == 3 and 0.0 <= report["right_tool_rate"] <= 1.0
