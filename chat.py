"""
Conversations and the one chat template.

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
"""

import json

import jsonschema

import config

ROLES = ("system", "user", "assistant", "tool")


class ChatError(Exception):
    """A conversation that cannot be rendered; the message says where and why."""


# -----------------------------------------------------------------------------
# Checking a conversation


def _schema_validator():
    return jsonschema.Draft202012Validator(config.load_schema("conversation"))


def conversation_problems(conversation):
    """Every reason this conversation is invalid (empty list when it is fine)."""
    problems = []
    for error in sorted(_schema_validator().iter_errors(conversation), key=lambda e: list(map(str, e.path))):
        where = ".".join(str(p) for p in error.absolute_path) or "conversation"
        problems.append(f"{where}: {error.message}")
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
            if not message["content"].strip() and not calls:
                problems.append(f"{where}: empty assistant content and no tool calls")
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


def check_conversation(conversation, where="conversation"):
    problems = conversation_problems(conversation)
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


def tool_call_text(call):
    body = json.dumps({"name": call["function"]["name"], "arguments": arguments_of(call)}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def tools_text(tools):
    return "<tools>\n" + "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools) + "\n</tools>"


def assistant_text(message):
    parts = [message["content"]] if message["content"] else []
    parts += [tool_call_text(call) for call in message.get("tool_calls", [])]
    return "\n".join(parts)


def segments(conversation, for_generation=False):
    """The layout as (control token or None, text, trained) triples, in order; render() encodes them."""
    messages = conversation["messages"]
    tools = conversation.get("tools") or []
    out = [("<|bos|>", "", False)]
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
    if system is not None or tools:
        text = "\n\n".join(part for part in (system, tools_text(tools) if tools else "") if part)
        out += [("<|system|>", text, False), ("<|end|>", "", False)]
    for message in messages[1:] if system is not None else messages:
        role = message["role"]
        if role == "user":
            out += [("<|user|>", message["content"], False), ("<|end|>", "", False)]
        elif role == "assistant":
            out += [
                ("<|assistant|>", "", False),
                (None, assistant_text(message), True),
                ("<|end|>", "", True),
            ]
        elif role == "tool":
            text = f"<tool_response>\n{message['content']}\n</tool_response>"
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
    the export produces, and what `chat.py show` prints."""
    check_conversation(conversation)
    return "".join((control or "") + text for control, text, _ in segments(conversation, for_generation))
