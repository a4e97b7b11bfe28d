"""
How well a run uses its tools: on the generated held-out conversations and on the hand-written prompts,
side by side.

    python -m evaluation.tool_use runs/sft-agent-tiny-cpu [--generated data/agent/eval.jsonl]
                         [--handwritten conversations/agent/handwritten.jsonl] [--limit N]
                         [--grounding constrained|hint|off] [--call-bias-file PATH]
        -> the table below, printed and written to <run>/agent_eval.json (<run>/agent_eval-<mode>.json
           with --grounding, which sets agent.grounding.mode for this evaluation, agent/grounding.py, and
           for constrained and off agent.answers.grounding too, agent/answers.py)

First the call bias (agent/call_bias.py): on the generated set alone, each prompt's two greedy replies (one
opening a call at its first token, one not) and its margin; the candidates of agent.call_bias are swept and
the best by call_bias.RULE is chosen, written to <run>/call_bias.json (the server, sample.py --chat and
the report card read it) unless --grounding asks for other modes than the run's, then used for both sets.
Right tool and no tool are reported without it (0) and with it.

The generated set is agent/dataset.py's held-out split (its questions never in training). The hand-written
set (conversations/agent/handwritten.jsonl, README in that folder) is 105 prompts written for the project,
15 per tool and 15 that need none, each with the tool it needs and the values its arguments must hold (some
said only in words, or in an earlier turn of the conversation, its "before" turns); no
generated conversation repeats one of them. Both are asked as the server asks a family member's turn:
the six tools on offer (the generated conversations keep the three or six they were made with), the date,
and the member's memories in the system turn (memory.context_for_turn over a real memory database holding
the prompt's memories), each reply generated greedily with the calls constrained (agent/grammar.py) unless
the run's agent.constrained is off.

On each prompt:
  right tool    the first call names the tool the prompt needs, or no call when it needs none;
  valid syntax  every call of the reply parses, names a tool on offer and has arguments its schema
                accepts (over replies with a call; a call cut by --max-new-tokens counts as invalid and
                is counted apart);
  arguments     generated set: the first call's arguments equal the reference's; hand-written set: the
                call names the right tool and its arguments hold the prompt's key values (a number of the
                question in calculadora's expression, the zone or day offset of fecha_hora, the words of a
                search, a memory's text or number);
  uses result   given the reference call and its real result, the answer states the result's fact (the
                number, the date or time, a [n] citation, what was saved, found, forgotten, or that the
                tool failed);
  value         per tool: calculadora's expression has the reference's value; the others, as arguments;
  no tool       the prompt needs no tool and the reply makes no call (right tool over those prompts);
  unsaid        given the reference call and its result, the answer states a number neither the
                conversation nor the tool results hold (agent/answers.py told_numbers);
  spans         the first call's text (recordar's texto, buscar_web's and buscar_recuerdos' consulta) is
                at most grounding.max_spans spans of the user's words (agent/grounding.py is_spans);
  unavailable   the prompt needs a tool, but the conversation holds no value for a required argument
                (agent/grounding.py: no number, no memory number), so a grounded call cannot be made;
                "in words" counts those the model answered without a call, as the grammar lets it.
"""

import argparse
import datetime
import math
import os
import sys
import tempfile
import threading
import time
import unicodedata

import fileio
import search
from agent import answers, call_bias, dataset, grounding, tools
from chat import template
from family import memories

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HANDWRITTEN = os.path.join(ROOT, "conversations", "agent", "handwritten.jsonl")
CLOCK = datetime.datetime(2026, 11, 30, 11, 0, tzinfo=datetime.UTC)  # a Monday, 12:00 in Madrid
MEMBER = "familiar"
RATES = (("right", "all", "right tool"), ("needed_right", "needing", "right tool, prompts needing one"),
         ("no_tool", "none_needed", "no tool when none is needed"), ("valid", "called", "valid call syntax"),
         ("arguments", "needing", "arguments (exact / key values)"), ("uses", "answered", "uses the result"),
         ("unsaid", "answered", "answers stating an unsaid number"), ("spans", "texts", "text arguments that are spans"))  # fmt: skip
TEXT_ARGUMENTS = {"recordar": "texto", "buscar_web": "consulta", "buscar_recuerdos": "consulta"}


def plain(text):
    """Lower case without accents: how key values are compared."""
    decomposed = unicodedata.normalize("NFD", str(text).lower())
    return "".join(ch for ch in decomposed if unicodedata.category(ch) != "Mn").replace(",", ".")


def result_fact(name, result, answer=None):
    """The piece of a tool result an answer must state (lower case). For fecha_hora, the date or time the
    reference answer states, or without one any date or time of the result."""
    if result.startswith("Error:"):
        return "no he podido"
    if name == "buscar_web":
        return "no he encontrado" if result == "Sin resultados" else "[1]"
    if name == "recordar":
        return "guardado"
    if name == "buscar_recuerdos":
        if not result.startswith("- ["):
            return "nada guardado"
        return " ".join(result.split("\n")[0].split()[-3:]).lower()
    if name == "olvidar":
        return "borrado"
    if name == "fecha_hora":
        facts = dataset.DATE_PATTERN.findall(result.split(": ")[-1]) + dataset.TIME_PATTERN.findall(result)
        stated = [fact for fact in facts if answer is None or fact in answer]
        return stated or None
    return result.lower()


def states(answer, fact):
    answer = answer.lower()
    return any(piece in answer for piece in fact) if isinstance(fact, list) else fact in answer


# -----------------------------------------------------------------------------
# The two sets as cases: the first prompt, what the reply must do, and the prompt with the result


def generated_cases(conversations):
    for conversation in conversations:
        messages, tools = conversation["messages"], conversation.get("tools")
        first = messages[2]
        case = {"set": "generated", "question": messages[1]["content"], "tools": tools,
                "prompt": {"messages": messages[:2], "tools": tools}, "tool": None, "reference": first}  # fmt: skip
        if "tool_calls" in first:
            call = first["tool_calls"][0]["function"]
            expected = template.arguments_of(first["tool_calls"][0])
            result, answer = messages[3]["content"], messages[4]["content"].lower()
            case.update(tool=call["name"], check=lambda arguments, expected=expected: arguments == expected,
                        expected=expected)  # fmt: skip
            fact = result_fact(call["name"], result, answer)
            if fact:
                answer_prompt = {"messages": messages[:4], "tools": tools}
                case.update(answer_prompt=answer_prompt, fact=fact, reference_answer=messages[4]["content"])
        yield case


def key_values_hold(arguments, keys):
    """Each key: None (absent), a list of words its text holds, or the value it equals."""
    for key, wanted in keys.items():
        if wanted is None:
            if key in arguments:
                return False
        elif isinstance(wanted, list):
            if not all(plain(word) in plain(arguments.get(key, "")) for word in wanted):
                return False
        elif arguments.get(key) != wanted:
            return False
    return True


def handwritten_cases(entries, settings, count_tokens, context_len):
    """Each entry as the server would ask it of an adult member whose memories are the entry's."""
    cfg = memories.load_config()
    with tempfile.TemporaryDirectory(prefix="agent-eval-") as folder:
        for number, entry in enumerate(entries):
            conn = memories.connect(os.path.join(folder, f"{number}.sqlite"), cfg)
            for held in entry.get("memories", []):
                held = held if isinstance(held, dict) else {"text": held, "scope": "private"}
                memories.add(conn, MEMBER, "adult", held["text"], cfg, held["scope"])
            caller = memories.Caller(MEMBER, "adult", conn, threading.Lock(), cfg)
            block = memories.context_for_turn(
                conn, MEMBER, "adult", entry["prompt"], cfg, count_tokens, context_len
            )
            results = [search.SearchResult(**entry["result"], rank=1)] if "result" in entry else []
            helper = tools.Agent(settings, clock=lambda: CLOCK, member=caller, count_tokens=count_tokens,
                                 searcher=dataset.CannedSearch(results))  # fmt: skip
            system = (
                [{"role": "system", "content": "\n\n".join((settings["system_prompt"], block))}]
                if block
                else []
            )
            messages = system + entry.get("before", []) + [{"role": "user", "content": entry["prompt"]}]
            prompt = helper.conversation(messages)
            case = {"set": "handwritten", "question": entry["prompt"], "tools": prompt["tools"], "prompt": prompt,
                    "tool": entry["tool"]}  # fmt: skip
            if entry["tool"]:
                context = helper.new_context()
                context.question = entry["prompt"]
                result = helper.call(tools.Call(entry["tool"], entry["call"]), context)
                call = {"type": "function", "function": {"name": entry["tool"], "arguments": entry["call"]}}
                case["reference"] = {"role": "assistant", "content": "", "tool_calls": [call]}
                with_result = messages + [
                    case["reference"],
                    {"role": "tool", "content": result.text, "name": entry["tool"]},
                ]
                case.update(check=lambda arguments, keys=entry["keys"]: key_values_hold(arguments, keys), expected=entry["call"],
                            answer_prompt=helper.conversation(with_result), fact=result_fact(entry["tool"], result.text))  # fmt: skip
            conn.close()
            yield case


# -----------------------------------------------------------------------------
# Scoring


def valid_calls(calls, specs, settings):
    """Whether every call is well formed, names a tool on offer and has arguments its schema accepts."""
    offered = {spec["function"]["name"]: spec for spec in specs or []}
    for call in calls:
        if call.error or call.name not in offered:
            return False
        entry = tools.TOOLS.get(call.name)
        if entry is not None and tools.argument_problem(entry, call.arguments, settings):
            return False
    return bool(calls)


def value_right(case, arguments, settings):
    """calculadora: whether the expression's value is the reference expression's; other tools: the
    arguments check."""
    if case["tool"] != "calculadora":
        return case["check"](arguments)
    limits = settings["calculator"]
    try:
        got = tools.calculate(str(arguments.get("expresion", "")), limits)
        wanted = tools.calculate(case["expected"]["expresion"], limits)
    except tools.ToolFailure:
        return False
    return math.isclose(got, wanted, rel_tol=1e-9, abs_tol=1e-12)


def value_unavailable(case, settings):
    """Whether the prompt holds no value for a required argument of the tool it needs."""
    found = grounding.candidates(case["prompt"]["messages"], settings)
    return case["tool"] is not None and not grounding.callable_tool(case["tool"], found)


def unsaid_numbers(answer, messages, settings):
    """The numbers an answer states that the conversation and its tool results do not hold (agent/answers.py's
    told_numbers: what agent.answers.grounding "constrained" lets it write)."""
    told = set(answers.told_numbers(messages, settings))
    return [value for value in grounding.spoken_numbers(answer) if value not in told]


def text_is_spans(call, messages, settings):
    """None for a call without a text argument; else whether its text is spans of the user's words."""
    key = TEXT_ARGUMENTS.get(call.name)
    value = (
        call.arguments.get(key) if key and call.error is None and isinstance(call.arguments, dict) else None
    )
    if not isinstance(value, str):
        return None
    found, grounded = grounding.candidates(messages, settings), settings["grounding"]
    return grounding.is_spans(value, found, grounded["joining_words"], grounded["max_spans"])


def evaluate(cases, reply, settings, log=print, examples=5, first=None):
    """Counts and rates over the cases; reply(conversation) -> (text, cut) with cut True when the budget
    ended the reply inside a call; first(index, case) -> (text, cut), when given, is the reply to a case's
    prompt (the call bias's choice between its two replies). The report keeps the first `examples`
    questions and replies."""
    counts = dict.fromkeys(("all", "right", "needed_right", "none_needed", "no_tool", "called", "valid", "cut", "needing",
                            "arguments", "answered", "uses", "unsaid", "texts", "spans", "unavailable", "in_words"), 0)  # fmt: skip
    by_tool, shown = {}, []
    for index, case in enumerate(cases):
        text, cut = first(index, case) if first else reply(case["prompt"])
        if len(shown) < examples:
            shown.append({"question": case["question"], "reply": text})
        calls = tools.parse_reply(text).calls
        tool = case["tool"]
        row = by_tool.setdefault(
            tool or "ninguna", dict.fromkeys(("prompts", "right", "arguments", "value"), 0)
        )
        right = (calls[0].name == tool) if (calls and tool) else (not calls and tool is None)
        counts["all"] += 1
        counts["right"] += right
        row["prompts"] += 1
        row["right"] += right
        if tool is None:
            counts["none_needed"] += 1
            counts["no_tool"] += right
        if calls or cut:
            counts["called"] += 1
            counts["valid"] += valid_calls(calls, case["tools"], settings) and not cut
            counts["cut"] += cut
        if calls and (spans := text_is_spans(calls[0], case["prompt"]["messages"], settings)) is not None:
            counts["texts"] += 1
            counts["spans"] += spans
        if tool is not None:
            counts["needing"] += 1
            counts["needed_right"] += right
            holds = right and calls[0].error is None and case["check"](calls[0].arguments)
            counts["arguments"] += holds
            row["arguments"] += holds
            row["value"] += (
                right and calls[0].error is None and value_right(case, calls[0].arguments, settings)
            )
            if value_unavailable(case, settings):
                counts["unavailable"] += 1
                counts["in_words"] += not calls
        if "answer_prompt" in case:
            counts["answered"] += 1
            answer, _ = reply(case["answer_prompt"])
            content = tools.parse_reply(answer).content
            counts["uses"] += states(content, case["fact"])
            counts["unsaid"] += bool(unsaid_numbers(content, case["answer_prompt"]["messages"], settings))
        if (index + 1) % 25 == 0:
            log(f"  {index + 1} prompts")
    report = {"counts": counts, "by_tool": by_tool, "examples": shown}
    for part, whole, _ in RATES:
        report[part + "_rate"] = round(counts[part] / counts[whole], 4) if counts[whole] else None
    return report


def decisions(cases, policy, biases, log=print):
    """The call bias's material (agent/call_bias.py) for these biases: per case, its Decision and its two
    replies, the one that opens a call at its first token and the one that does not; the model's own reply
    (bias 0) first, and the other only where one of the biases would flip its first token (a confident model
    needs one reply a prompt). policy(conversation, bias) -> (text, cut), with policy.margin the first
    token's margin of its latest reply."""
    out = []
    for index, case in enumerate(cases):
        own = policy(case["prompt"], 0.0)
        margin = policy.margin
        opened, words = (own, None) if margin is not None and margin > 0 else (None, own)
        if margin is not None and opened is None and margin + max(biases) > 0:
            opened = policy(case["prompt"], call_bias.FORCE)
        if opened is not None and words is None and margin + min(biases) <= 0:
            words = policy(case["prompt"], -call_bias.FORCE)
        first = [tools.parse_reply(reply[0]).calls if reply else [] for reply in (opened, words)]
        decision = call_bias.Decision(
            case["tool"], margin, *(calls[0].name if calls else None for calls in first)
        )
        out.append((decision, opened, words))
        if (index + 1) % 25 == 0:
            log(f"  {index + 1} prompts")
    return out


def choose_bias(cases, decided, candidates):
    """(the bias chosen on the generated set, the sweep's rows) from decisions(cases): never another set's."""
    others = {case["set"] for case in cases} - {"generated"}
    if others:
        raise ValueError(f"the call bias is chosen on the generated set only, not on {sorted(others)}")
    return call_bias.choose([decision for decision, _, _ in decided], candidates)


def biased(decided, bias):
    """first(index, case) for evaluate: of each case's two replies, the one a greedy reply under this bias is."""
    return lambda index, case: (decided[index][1] if call_bias.opens(decided[index][0], bias)
                                else decided[index][2])  # fmt: skip


def model_reply(model, tokenizer, max_new_tokens, settings):
    """Greedy generation of the next assistant turn, up to <|end|>, its tool calls constrained to the
    conversation's tools (agent/grammar.py) unless agent.constrained is off: the model as a policy,
    reply(conversation, bias=None) -> (text, whether the budget ended it inside a call), the call bias
    agent.call_bias.value unless given; reply.margin is the latest reply's first-token margin (None where
    no call could open). The KV cache of the previous prompt is kept and rewound to the prefix the next
    prompt shares with it (an answer's prompt extends its question's); the logits are those of a full
    forward pass either way. Prompts longer than the context are cut from the left, as engine.generate
    does."""
    import torch

    from agent import grammar
    from decode import engine, kvcache

    end = tokenizer.special_ids["<|end|>"]
    state = {"ids": [], "cache": kvcache.new_kv_cache(model)}

    def reply(conversation, bias=None):
        ids, _ = template.render(conversation, tokenizer, for_generation=True)
        ids = ids[-(model.seq_len - max_new_tokens) :]
        cached, cache = state["ids"], state["cache"]
        shared = 0
        while shared < min(len(cached), len(ids) - 1) and cached[shared] == ids[shared]:
            shared += 1
        cache.length = shared  # later positions are overwritten
        out = []
        chosen = settings if bias is None else call_bias.with_value(settings, bias)
        constraint = grammar.constraint_for(
            tokenizer, conversation.get("tools"), chosen, max_new_tokens, conversation["messages"]
        )
        with torch.no_grad():
            logits = engine.forward_with_cache(model, torch.tensor([ids[shared:]]), cache)
            for _ in range(max_new_tokens):
                last = logits[0, -1] if constraint is None else constraint.mask(logits[0, -1])
                token = int(last.argmax())
                if constraint is not None:
                    constraint.accept(token)
                if token in (end, tokenizer.eos_id):
                    break
                out.append(token)
                logits = engine.forward_with_cache(model, torch.tensor([[token]]), cache)
        state["ids"] = ids + out  # the tokens whose keys and values the cache holds
        reply.margin = None if constraint is None else constraint.margin
        text = tokenizer.decode(out)
        cut = len(out) == max_new_tokens and (constraint.in_call if constraint else text.count("<tool_call>") > text.count("</tool_call>"))  # fmt: skip
        return text, cut

    reply.margin = None
    return reply


# -----------------------------------------------------------------------------


def table(reports):
    """The side-by-side figures: rates with their counts, then right tool and key values per tool."""
    names = list(reports)
    lines = [f"{'':34s}" + "".join(f"{name:>24s}" for name in names)]
    for part, whole, label in RATES:
        cells = []
        for name in names:
            counts, rate = reports[name]["counts"], reports[name][part + "_rate"]
            cells.append("-" if rate is None else f"{100 * rate:.1f}% ({counts[part]}/{counts[whole]})")
        lines.append(f"{label:34s}" + "".join(f"{cell:>24s}" for cell in cells))
    lines.append(
        f"{'calls cut by --max-new-tokens':34s}"
        + "".join(f"{reports[n]['counts']['cut']:>24d}" for n in names)
    )
    lines.append(
        f"{'value unavailable · in words':34s}"
        + "".join(
            f"{c['unavailable']:>16d} · {c['in_words']:<5d}" for c in (reports[n]["counts"] for n in names)
        )
    )
    tools = sorted({tool for report in reports.values() for tool in report["by_tool"]})
    for tool in tools:
        cells = []
        for name in names:
            row = reports[name]["by_tool"].get(tool)
            cells.append("-" if row is None else f"{row['right']}/{row['prompts']} · args {row['arguments']}")
        lines.append(f"  {tool + ': right tool · arguments':32s}" + "".join(f"{cell:>24s}" for cell in cells))
        if tool == "calculadora":
            values = (
                "-" if tool not in reports[n]["by_tool"] else str(reports[n]["by_tool"][tool]["value"])
                for n in names
            )
            lines.append(f"  {'calculadora: value right':32s}" + "".join(f"{cell:>24s}" for cell in values))
    return "\n".join(lines)


def report_name(grounding_mode=None):
    """The report's file in the run's folder: agent_eval.json, or per grounding mode when one is asked."""
    return f"agent_eval-{grounding_mode}.json" if grounding_mode else "agent_eval.json"


def settings_for(cfg, grounding_mode=None):
    """The run's agent settings; with a grounding mode, the calls' (agent.grounding.mode) and, for
    constrained or off, the answers' (agent.answers.grounding) set to it: hint has no answer mask."""
    settings = tools.load_settings(cfg.get("agent"))
    if grounding_mode:
        settings = {**settings, "grounding": {**settings["grounding"], "mode": grounding_mode}}
    if grounding_mode in ("constrained", "off"):
        settings = {**settings, "answers": {**settings["answers"], "grounding": grounding_mode}}
    return settings


def bias_table(reports):
    """right tool (prompts needing one) and no tool (prompts needing none) without the call bias and with the
    chosen one, per set."""
    lines = []
    for name, report in reports.items():
        bias = report["call_bias"]
        cells = []
        for label, row in (("without (0)", bias["without"]), (f"with ({bias['value']:g})", bias["with"])):
            counts = row["counts"]
            cells.append(f"{label}: right tool {counts['right']}/{counts['needing']}, "
                         f"no tool {counts['no_tool']}/{counts['none']}")  # fmt: skip
        lines.append(f"  call bias, {name}: " + " | ".join(cells))
    return "\n".join(lines)


@fileio.reports_storage_errors
def main(argv):
    parser = argparse.ArgumentParser(
        description="The tool-use rates of a run, generated and hand-written sets."
    )
    parser.add_argument("run", help="run directory or checkpoint")
    parser.add_argument("--generated", default="data/agent/eval.jsonl", help="agent/dataset.py's eval.jsonl")
    parser.add_argument("--handwritten", default=HANDWRITTEN, help="the hand-written prompts")
    parser.add_argument("--limit", type=int, default=0, help="only the first N of each set")
    parser.add_argument("--report", help="where to write the JSON report (default <run>/agent_eval.json)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--grounding", choices=["constrained", "hint", "off"],
                        help="agent.grounding.mode for this evaluation, and agent.answers.grounding for "
                             "constrained and off (default: the run's)")  # fmt: skip
    parser.add_argument("--call-bias-file", help="where to write the chosen call bias (default "
                        "<run>/call_bias.json, which serving the run uses, when the modes are the run's own)")  # fmt: skip
    args = parser.parse_args(argv)

    from sample import SampleError, load_run

    try:
        model, cfg, tokenizer, ckpt_path = load_run(args.run)
        generated = dataset.read_jsonl(args.generated)[: args.limit or None]
        entries = dataset.read_jsonl(args.handwritten)[: args.limit or None]
    except (SampleError, OSError) as exc:
        print(f"evaluation/tool_use.py: {exc}", file=sys.stderr)
        return 2
    settings = settings_for(cfg, args.grounding)
    policy = model_reply(model, tokenizer, args.max_new_tokens, settings)
    count_tokens = lambda text: len(tokenizer.encode(text))  # noqa: E731
    folder = call_bias.folder_of(args.run)
    # the call bias, chosen on the generated set before the hand-written one is read
    print("generated: the call bias's sweep")
    started = time.perf_counter()
    cases = {"generated": list(generated_cases(generated))}
    candidates = settings["call_bias"]["candidates"]
    decided = {"generated": decisions(cases["generated"], policy, [0.0, *candidates])}
    seconds = {"sweep": time.perf_counter() - started}
    chosen, sweep = choose_bias(cases["generated"], decided["generated"], candidates)
    served = settings == settings_for(cfg)  # the run as the server runs it: its chosen bias is the run's
    bias_path = args.call_bias_file or (os.path.join(folder, call_bias.FILE) if served else None)
    if bias_path:
        call_bias.write(bias_path, chosen, sweep, args.generated)
    settings = call_bias.with_value(settings, chosen)
    policy = model_reply(model, tokenizer, args.max_new_tokens, settings)
    cases["hand-written"] = list(handwritten_cases(entries, settings, count_tokens, model.seq_len))
    reports = {}
    for name in ("generated", "hand-written"):
        print(f"{name}:")
        started = time.perf_counter()
        if name not in decided:
            decided[name] = decisions(cases[name], policy, [0.0, chosen])
        reports[name] = evaluate(cases[name], policy, settings, first=biased(decided[name], chosen))
        seconds[name] = time.perf_counter() - started
        marks = [decision for decision, _, _ in decided[name]]
        reports[name]["call_bias"] = {"value": chosen, "without": call_bias.rates(marks, 0.0),
                                      "with": call_bias.rates(marks, chosen)}  # fmt: skip
    constrained = "constrained" if settings["constrained"] else "unconstrained"
    mode, answering = settings["grounding"]["mode"], settings["answers"]["grounding"]
    print(f"\nagent eval of {ckpt_path}: greedy, {constrained} calls, grounding {mode}, answers {answering}, "
          f"call bias {chosen:g} (chosen on the generated set), up to {args.max_new_tokens} new tokens")  # fmt: skip
    print(table(reports))
    print(bias_table(reports))
    print("wall time: " + ", ".join(f"{name} {value:.0f} s" for name, value in seconds.items()))
    report = {"checkpoint": ckpt_path, "constrained": settings["constrained"], "grounding": mode,
              "answers": answering, "call_bias": {"value": chosen, "rule": call_bias.RULE, "sweep": sweep,
                                                  "chosen_on": args.generated, "file": bias_path},
              "sets": reports, "data": {"generated": args.generated, "hand-written": args.handwritten},
              "seconds": {name: round(value, 1) for name, value in seconds.items()}}  # fmt: skip
    fileio.write_json(args.report or os.path.join(folder, report_name(args.grounding)), report)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
