"""
Conversations and the one chat template (the preparation command that packs them is chat/prepare.py).

A conversation is one JSON object per line of a .jsonl file, the OpenAI / TRL shape that public data and
other tools already use (schema/conversation.schema.json says what is valid):

    {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": "...",
                   "tool_calls": [{"type": "function", "function": {"name": ..., "arguments": {...}}}]?}],
     "tools": [{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}]?}

render(conversation, tokenizer) -> (ids, mask) is the template. Training, sample.py --chat, the server and
the export (which writes the same layout as a Jinja template) all use it. The layout, with [x] a control
token (never produced from text) and <x> a tool tag (a single piece of the tokenizer):

    [<|bos|>]
    [<|system|>] system text                                        [<|end|>]
                 + "\\n\\n" if both + "<tools>\\n" + one JSON tool per line + "\\n</tools>"   (when tools)
    [<|user|>] text                                                   [<|end|>]
    [<|assistant|>] text + "\\n" if both + "<tool_call>\\n" + {"name": .., "arguments": {..}} + "\\n</tool_call>"
                    (calls joined by "\\n")                             [<|end|>]
    [<|tool|>] "<tool_response>\\n" + result + "\\n</tool_response>"       [<|end|>]
    ... and, for generation, a final [<|assistant|>].

JSON is written by json.dumps(..., ensure_ascii=False) with its default separators, the same text as
Jinja's tojson in transformers' chat templates. mask is 1 on the tokens the model learns to produce (an
assistant turn's text, its calls and its closing <|end|>) and 0 elsewhere (<|bos|>, system, user and tool
turns, and the <|assistant|> opener, which the prompt supplies). Text between control tokens is encoded
with tokenizer.encode, so a user typing "<|system|>" gets plain text, never the control token.

Preference pairs (DPO) are TRL's conversational preference format, one per line: {"prompt": [messages],
"chosen": [assistant message], "rejected": [assistant message]}; each answer renders after its prompt with
the same template, trained on the answer only (render_pair). They come from the family's feedback
(`python -m chat preferences`, by family/feedback.py's rules and consent), from public sets (`python -m chat
import --from preference`) or, for the smoke run, from conversations with worse answers made up (`python -m
chat seed-pairs`).

The tool tags are single pieces that tokenizer.encode does find inside text, so text from outside the model
(the system turn with its memories, user turns, tool results such as a web page) could imitate the protocol
in front of it, and so could an answer stored and rendered again. plain_text() escapes them in every role's
text ("<tool_call>" -> "&lt;tool_call&gt;"): the only tag pieces in a prompt are the template's own and
those of the model's calls (tool_calls).
"""

import glob
import json
import os

import jsonschema

import config
import fileio

ROLES = ("system", "user", "assistant", "tool")
# data.TOOL_TAGS, the tokenizer's pieces for them (chat/template.py stays free of torch; a test keeps the two equal).
PROTOCOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<tools>", "</tools>")
# Bump when segments() changes what a conversation renders to: checkpoints record the version they
# were trained with, and the export writes it beside the Jinja copy of the template.
CHAT_TEMPLATE_VERSION = 1


class ChatError(Exception):
    """A conversation that cannot be rendered; the message says where and why."""


# -----------------------------------------------------------------------------
# Checking a conversation


def schema_problems(name, record, what):
    """Every error of record against schema/<name>.schema.json, as 'path: message' (what: the empty path)."""
    validator = jsonschema.Draft202012Validator(config.load_schema(name))
    errors = sorted(validator.iter_errors(record), key=lambda e: list(map(str, e.path)))
    return [f"{'.'.join(str(p) for p in error.absolute_path) or what}: {error.message}" for error in errors]


def conversation_problems(conversation):
    """Every reason this conversation is invalid (empty list when it is fine)."""
    problems = text_problems(conversation) or schema_problems("conversation", conversation, "conversation")
    if problems:
        return problems
    open_calls = 0  # calls of the last assistant turn not yet answered by a tool turn
    for index, message in enumerate(conversation["messages"]):
        role, where = message["role"], f"messages.{index}"
        if role == "system" and index != 0:
            problems.append(f"{where}: a system message may only come first")
        if "tool_calls" in message and role != "assistant":
            problems.append(f"{where}: only assistant messages carry tool_calls")
        if ("tool_call_id" in message or "name" in message) and role != "tool":
            problems.append(f"{where}: tool_call_id and name belong to tool messages")
        if role == "assistant":
            calls = message.get("tool_calls", [])
            for number, call in enumerate(calls):
                try:
                    arguments_of(call)
                except ChatError as e:
                    problems.append(f"{where}.tool_calls.{number}: {e}")
            open_calls = len(calls)
        elif role == "tool":
            if open_calls == 0:
                problems.append(f"{where}: a tool message without a preceding assistant tool call")
            open_calls = max(0, open_calls - 1)
        else:
            open_calls = 0
    return problems


def empty_answers(messages, where="messages"):
    """'PATH: empty assistant content and no tool calls' for each assistant turn that says nothing (of
    messages that conversation_problems already found valid)."""
    return [
        f"{where}.{index}: empty assistant content and no tool calls"
        for index, message in enumerate(messages)
        if message["role"] == "assistant" and not message["content"].strip() and not message.get("tool_calls")
    ]


def training_problems(conversation):
    """conversation_problems and what a training example must also hold: every assistant turn answers
    (text or a tool call) — an empty turn would teach the model to say nothing. Rendering alone accepts
    one: the model may end an answer at once, and a served conversation goes on after it."""
    return conversation_problems(conversation) or empty_answers(conversation["messages"])


def text_problems(conversation):
    """A string that is not Unicode text (a lone surrogate, as JSON's "\\ud800" escape gives): the tokenizer
    cannot encode it."""
    problem = fileio.text_problem(conversation)
    return [f"{problem[0] or 'conversation'}: {problem[1]}"] if problem else []


def check_conversation(conversation, where="conversation", training=False):
    problems = (training_problems if training else conversation_problems)(conversation)
    if problems:
        raise ChatError(f"{where}: " + "; ".join(problems))


def arguments_of(call):
    """A call's arguments as a dict; OpenAI sends them as a JSON string, TRL data as an object."""
    arguments = call["function"]["arguments"]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            raise ChatError(f"arguments are not valid JSON ({e})") from None
    if not isinstance(arguments, dict):
        raise ChatError(f"arguments must be a JSON object, got {type(arguments).__name__}")
    return arguments


# -----------------------------------------------------------------------------
# The template


def plain_text(text):
    """Text from outside the model with the protocol's tags escaped (the template's <tools> list, its tags
    around a tool result and the model's own calls are the only tag pieces a prompt holds)."""
    if "<" in text:
        for tag in PROTOCOL_TAGS:
            text = text.replace(tag, f"&lt;{tag[1:-1]}&gt;")
    return text


def tool_call_text(call):
    body = json.dumps({"name": call["function"]["name"], "arguments": arguments_of(call)}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def tools_text(tools):
    return "<tools>\n" + "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools) + "\n</tools>"


def assistant_text(message):
    """An assistant turn's text (escaped like every other role's: a stored answer that held a tag never
    becomes one in the next prompt) and its calls, the only tag pieces of the turn."""
    parts = [plain_text(message["content"])] if message["content"] else []
    parts += [tool_call_text(call) for call in message.get("tool_calls", [])]
    return "\n".join(parts)


def segments(conversation, for_generation=False):
    """The layout as (control token or None, text, trained) triples, in order; render() encodes them. Every
    role's text goes through plain_text(): only the template's own tags and the calls' are protocol."""
    messages = conversation["messages"]
    tools = conversation.get("tools") or []
    out = [("<|bos|>", "", False)]
    system = plain_text(messages[0]["content"]) if messages and messages[0]["role"] == "system" else None
    if system is not None or tools:
        text = "\n\n".join(part for part in (system, tools_text(tools) if tools else "") if part)
        out += [("<|system|>", text, False), ("<|end|>", "", False)]
    for message in messages[1:] if system is not None else messages:
        role = message["role"]
        if role == "user":
            out += [("<|user|>", plain_text(message["content"]), False), ("<|end|>", "", False)]
        elif role == "assistant":
            out += [
                ("<|assistant|>", "", False),
                (None, assistant_text(message), True),
                ("<|end|>", "", True),
            ]
        elif role == "tool":
            text = f"<tool_response>\n{plain_text(message['content'])}\n</tool_response>"
            out += [("<|tool|>", text, False), ("<|end|>", "", False)]
        else:
            raise ChatError(f"a {role} message may only come first")
    if for_generation:
        out.append(("<|assistant|>", "", False))
    return out


def render(conversation, tokenizer, for_generation=False):
    """(ids, mask) of a conversation; for_generation appends the <|assistant|> opener of the next reply."""
    check_conversation(conversation)
    special = tokenizer.special_ids
    if "<|end|>" not in special:
        raise ChatError(
            f"the {tokenizer.name} tokenizer has no control tokens; chat needs a sentencepiece tokenizer "
            "trained by this project (data.format: shards)"
        )
    ids, mask = [], []
    for control, text, trained in segments(conversation, for_generation):
        if control is not None:
            ids.append(special[control])
            mask.append(int(trained))
        if text:
            encoded = tokenizer.encode(text)
            ids += encoded
            mask += [int(trained)] * len(encoded)
    return ids, mask


def render_text(conversation, for_generation=False):
    """The rendered conversation as one string (control tokens written out): what the Jinja template of
    the export produces, and what `python -m chat show` prints."""
    check_conversation(conversation)
    return "".join((control or "") + text for control, text, _ in segments(conversation, for_generation))


# -----------------------------------------------------------------------------
# Reading conversation files


def decode_utf8(raw, path):
    """The text of a file's bytes; a file that is not UTF-8 is refused, naming the line and column."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise ChatError(
            f"{path}:{line}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {column}); convert the file, "
            "e.g. `iconv -f latin1 -t utf-8 IN > OUT`"
        ) from None


def read_conversations(path, bad_lines="fatal", log=print):
    """[(where, conversation)] of a JSONL file, where = 'FILE:LINE'; blank lines are ignored. A line that
    is not a valid conversation raises ChatError naming FILE:LINE and the reason, or with bad_lines='skip'
    is reported and left out. Returns (conversations, number of skipped lines)."""
    return read_jsonl(path, training_problems, bad_lines, log)


def read_jsonl(path, problems_of, bad_lines="fatal", log=print):
    """[(where, record)] of a JSONL file of JSON objects that problems_of(record) finds valid, and the
    number of lines skipped (see read_conversations)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ChatError(f"{path}: cannot read ({e.strerror})") from None
    records, skipped = [], 0
    for number, line in enumerate(decode_utf8(raw, path).split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except ValueError as e:
            problems = [f"not JSON ({e})"]
        else:
            problems = (
                problems_of(record)
                if isinstance(record, dict)
                else [f"expected a JSON object, got {type(record).__name__}"]
            )
        if problems:
            if bad_lines == "fatal":
                raise ChatError(f"{where}: " + "; ".join(problems))
            log(f"skipping {where}: " + "; ".join(problems))
            skipped += 1
            continue
        records.append((where, record))
    return records, skipped


def expand_paths(patterns, key):
    """Files named by paths or globs (a glob's matches sorted by name); a pattern matching nothing is an
    error naming the config key."""
    paths = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        matches = [path for path in matches if os.path.isfile(path)]
        if not matches:
            raise ChatError(f"{key}: {pattern!r} matches no file")
        paths += matches
    return paths


# -----------------------------------------------------------------------------
# Preference pairs: prompt + chosen and prompt + rejected are each a valid conversation; the prompt ends
# with the user's (or a tool's) turn, each answer is assistant turns (tool calls and results between them)


def preference_problems(pair):
    """Every reason this preference pair is invalid (empty list when it is fine)."""
    problems = schema_problems("preference", pair, "pair")
    if problems:
        return problems
    if pair["prompt"][-1].get("role") not in ("user", "tool"):
        problems.append("prompt: must end with a user (or tool) message, the turn the answers reply to")
    tools = {"tools": pair["tools"]} if "tools" in pair else {}
    for side in ("chosen", "rejected"):
        if pair[side][0].get("role") != "assistant" or pair[side][-1].get("role") != "assistant":
            problems.append(f"{side}: must start and end with an assistant message")
        conversation = {"messages": pair["prompt"] + pair[side]} | tools
        problems += [f"{side}: {problem}" for problem in conversation_problems(conversation)]
    # The rejected answer may be empty (a model that said nothing is worth pushing away from); the chosen
    # one is what the model is pushed towards.
    return problems or empty_answers(pair["chosen"], "chosen")


def read_preferences(path, bad_lines="fatal", log=print):
    """[(where, pair)] of a preference JSONL file and the number of lines skipped (as read_conversations)."""
    return read_jsonl(path, preference_problems, bad_lines, log)


def render_pair(pair, tokenizer):
    """((ids, mask) of prompt + chosen, (ids, mask) of prompt + rejected), rendered by render(): the mask is
    kept on the answer's tokens only, since the prompt's own assistant turns are context here."""
    tools = {"tools": pair["tools"]} if "tools" in pair else {}
    prompt_ids, _ = render({"messages": pair["prompt"]} | tools, tokenizer, for_generation=True)
    rendered = []
    for side in ("chosen", "rejected"):
        ids, mask = render({"messages": pair["prompt"] + pair[side]} | tools, tokenizer)
        if ids[: len(prompt_ids)] != prompt_ids:  # render() lays out turns one after another
            raise ChatError(f"{side}: prompt + answer does not start with the rendered prompt")
        rendered.append((ids, [0] * len(prompt_ids) + mask[len(prompt_ids) :]))
    return rendered
