"""
How well a run uses its tools, on held-out conversations.

    python agent_eval.py runs/sft-agent data/agent/eval.jsonl [--limit 100]
        -> the four rates below, printed and written to <run>/agent_eval.json

The evaluation, on each held-out conversation:
- first reply (prompt: system + tools + the user's message), greedy:
  valid syntax = the reply parses with at least one well-formed call (over conversations that need one);
  right tool   = the first call names the tool the reference calls, or no call when it calls none
                 (over all conversations);
  exact args   = the first call's arguments equal the reference's (over conversations that need a call);
- answer (prompt: the reference call and its result), greedy:
  uses result  = the answer contains the fact of the result the reference answer states (over tool
                 conversations): the number, the date or time, a [n] citation, or that nothing was found.
"""

import argparse
import json
import os
import sys

import agent
import agent_data
import chat
import fileio


def reference_of(conversation):
    """(prompt messages, reference first assistant message, prompt up to the result, answer) of a
    generated conversation."""
    messages = conversation["messages"]
    first = messages[2]
    if "tool_calls" not in first:
        return messages[:2], first, None, first["content"]
    return messages[:2], first, messages[:4], messages[4]["content"]


def result_fact(name, arguments, result, answer):
    """The piece of a tool result the reference answer states (lower case), or None when there is none."""
    if result.startswith("Error:"):
        return "no he podido"
    if name == "buscar_web":
        return "no he encontrado" if result == "Sin resultados" else "[1]"
    if name == "fecha_hora":
        facts = agent_data.DATE_PATTERN.findall(result.split(": ")[-1]) + agent_data.TIME_PATTERN.findall(
            result
        )
        stated = [fact for fact in facts if fact in answer]
        return stated[0] if stated else None
    return result.lower()


def evaluate(conversations, reply, log=print, examples=5):
    """The four rates over the conversations; reply(conversation) -> generated text (the model). The
    report keeps the counts and the first `examples` questions with the model's first reply."""
    counts = dict.fromkeys(("tool", "all", "valid", "right", "exact", "answered", "uses"), 0)
    shown = []
    for index, conversation in enumerate(conversations):
        prompt, first, with_result, answer = reference_of(conversation)
        tools = conversation.get("tools")
        text = reply({"messages": prompt, "tools": tools})
        if len(shown) < examples:
            shown.append({"question": prompt[-1]["content"], "reply": text})
        calls = agent.parse_reply(text).calls
        good = bool(calls) and all(call.error is None for call in calls)
        expected = first["tool_calls"][0]["function"] if "tool_calls" in first else None
        counts["all"] += 1
        if expected is None:
            counts["right"] += not calls
        else:
            counts["tool"] += 1
            counts["valid"] += good
            counts["right"] += bool(calls) and calls[0].name == expected["name"]
            counts["exact"] += good and calls[0].arguments == chat.arguments_of(first["tool_calls"][0])
            fact = result_fact(
                expected["name"], expected["arguments"], with_result[3]["content"], answer.lower()
            )
            if fact is not None:
                counts["answered"] += 1
                text = agent.parse_reply(reply({"messages": with_result, "tools": tools})).content
                counts["uses"] += fact in text.lower()
        if (index + 1) % 25 == 0:
            log(f"  {index + 1}/{len(conversations)} conversations")
    rate = lambda part, whole: round(counts[part] / counts[whole], 4) if counts[whole] else None
    return {
        "counts": counts,
        "conversations": counts["all"],
        "needing_a_tool": counts["tool"],
        "valid_syntax_rate": rate("valid", "tool"),
        "right_tool_rate": rate("right", "all"),
        "exact_argument_rate": rate("exact", "tool"),
        "uses_result_rate": rate("uses", "answered"),
        "examples": shown,
    }


def model_reply(model, tokenizer, max_new_tokens, settings):
    """Greedy generation of the next assistant turn, up to <|end|>: the model as a policy, its tool calls
    constrained to the conversation's tools (agent_grammar) unless agent.constrained is off. The KV cache of
    the previous prompt is kept and rewound to the prefix the next prompt shares with it (the answer's
    prompt extends the first reply's), which halves the prefill of the evaluation; the logits are those
    of a full forward pass either way. Prompts longer than the context are cut from the left, as
    model.generate does."""
    import torch

    import agent_grammar

    end = tokenizer.special_ids["<|end|>"]
    state = {"ids": [], "cache": model.new_kv_cache()}

    def reply(conversation):
        ids, _ = chat.render(conversation, tokenizer, for_generation=True)
        ids = ids[-(model.seq_len - max_new_tokens) :]
        cached, cache = state["ids"], state["cache"]
        shared = 0
        while shared < min(len(cached), len(ids) - 1) and cached[shared] == ids[shared]:
            shared += 1
        cache.length = shared  # later positions are overwritten
        out = []
        constraint = agent_grammar.constraint_for(tokenizer, conversation.get("tools"), settings)
        with torch.no_grad():
            logits = model.forward_with_cache(torch.tensor([ids[shared:]]), cache)
            for _ in range(max_new_tokens):
                last = logits[0, -1] if constraint is None else constraint.mask(logits[0, -1])
                token = int(last.argmax())
                if constraint is not None:
                    constraint.accept(token)
                if token in (end, tokenizer.eos_id):
                    break
                out.append(token)
                logits = model.forward_with_cache(torch.tensor([[token]]), cache)
        state["ids"] = ids + out  # the tokens whose keys and values the cache holds
        return tokenizer.decode(out)

    return reply


def main(argv):
    check = argparse.ArgumentParser(description="The tool-use rates of a run on held-out conversations.")
    check.add_argument("run", help="run directory or checkpoint")
    check.add_argument("data", help="held-out conversations (eval.jsonl of generate)")
    check.add_argument("--offset", type=int, default=0, help="skip the first N conversations")
    check.add_argument("--limit", type=int, default=0, help="only N conversations")
    check.add_argument("--report", help="where to write the JSON report (default <run>/agent_eval.json)")
    check.add_argument("--max-new-tokens", type=int, default=96)
    args = check.parse_args(argv)

    from sample import SampleError, load_run

    try:
        model, cfg, tokenizer, ckpt_path = load_run(args.run)
    except SampleError as exc:
        print(f"agent_eval.py: {exc}", file=sys.stderr)
        return 2
    conversations = agent_data.read_jsonl(args.data)[args.offset :][: args.limit or None]
    settings = agent.load_settings(cfg.get("agent"))
    report = evaluate(conversations, model_reply(model, tokenizer, args.max_new_tokens, settings))
    report.update(checkpoint=ckpt_path, data=args.data, offset=args.offset)
    print(json.dumps(report, indent=1, ensure_ascii=False))

    folder = args.run if os.path.isdir(args.run) else os.path.dirname(args.run)
    fileio.write_json(args.report or os.path.join(folder, "agent_eval.json"), report)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
