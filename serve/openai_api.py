"""
OpenAI's chat-completions shapes, for serve/app.py: errors in OpenAI's form, the request's fields checked into
chat/template.py's conversation and the sampling settings (each bad field a 400 naming it), and the reply's text as
it streams (stop strings held back, the model's <tool_call>s turned into OpenAI tool_calls). Neither HTTP
nor the model: serve/app.py reads the requests and answers them, serve/worker.py generates.
"""

import json
import secrets

import fileio
from agent import tools
from chat import visible

MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """An error answered in OpenAI's shape {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error"}
    TYPES |= {
        404: "not_found_error",
        405: "invalid_request_error",
        408: "invalid_request_error",
        413: "invalid_request_error",
        415: "invalid_request_error",
        421: "invalid_request_error",
        429: "rate_limit_error",
    }
    TYPES |= {503: "server_overloaded"}

    def __init__(self, status, message, param=None, code=None, retry_after=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after

    def body(self):
        kind = self.TYPES.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def expect(value, kinds, param, what):
    """value if it has one of the types (bool is not a number here), else a 400 naming the field."""
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if not ok:
        raise ApiError(400, f"{param}: expected {what}, got {json.dumps(value)[:80]}", param=param,
                       code="invalid_type")  # fmt: skip
    return value


def check_text(value, max_depth, max_chars):
    """The one check of a request's text (web.read_json runs it on every JSON body, before any other
    work): every string and key must be Unicode text (JSON's "\\ud800" escape gives a lone surrogate, which
    SQLite, the tokenizer and the JSON answer all refuse) of at most max_chars characters (serve.max_text_chars:
    no tokenizing or memory search of a text the model could never read), and the nesting at most max_depth
    deep; else a 400 naming the field."""
    problem = fileio.text_problem(value, max_depth, max_chars=max_chars)
    if problem:
        raise text_error(*problem)


def text_error(param, why):
    return ApiError(400, f"{param or 'body'}: {why}", param=param or None,
                    code="invalid_text")  # fmt: skip


def text_of(content, param):
    """A message's content as text: a string, null, or a list of {"type": "text", "text": ...} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    expect(content, list, param, "a string or a list of text parts")
    texts = []
    for index, part in enumerate(content):
        where = f"{param}.{index}"
        expect(part, dict, where, 'a content part like {"type": "text", "text": "..."}')
        if part.get("type") != "text":
            raise ApiError(400, f"{where}: only text parts are supported, got type {part.get('type')!r}",
                           param=where, code="unsupported_content")  # fmt: skip
        texts.append(expect(part.get("text"), str, f"{where}.text", "a string"))
    return "".join(texts)


def conversation_of(messages, limits):
    """OpenAI messages -> chat/template.py's conversation: system and developer texts become the one leading system
    message, content parts are joined, assistant tool calls kept."""
    expect(messages, list, "messages", "a list of messages")
    if not messages:
        raise ApiError(400, "messages: the list is empty; send at least one message", param="messages",
                       code="empty_messages")  # fmt: skip
    if len(messages) > limits["max_messages"]:
        raise ApiError(400, f"messages: {len(messages)} messages; at most {limits['max_messages']} per request",
                       param="messages", code="too_many_messages")  # fmt: skip
    system, turns = [], []
    for index, message in enumerate(messages):
        where = f"messages.{index}"
        expect(message, dict, where, "an object with role and content")
        role = message.get("role")
        if role not in MESSAGE_ROLES:
            raise ApiError(400, f"{where}.role: {role!r} is not one of {', '.join(MESSAGE_ROLES)}",
                           param=f"{where}.role", code="invalid_value")  # fmt: skip
        content = text_of(message.get("content"), f"{where}.content")
        if role in ("system", "developer"):
            if turns:
                raise ApiError(400, f"{where}: {role} messages must come before the conversation's turns",
                               param=where, code="invalid_value")  # fmt: skip
            system.append(content)
            continue
        turn = {"role": role, "content": content}
        if role == "assistant" and message.get("tool_calls"):
            calls = expect(message["tool_calls"], list, f"{where}.tool_calls", "a list of tool calls")
            turn["tool_calls"] = [
                {"type": "function", "function": {
                    "name": call["function"]["name"], "arguments": call["function"]["arguments"]}}
                for call in calls if isinstance(call, dict) and isinstance(call.get("function"), dict)
                and "name" in call["function"] and "arguments" in call["function"]
            ]  # fmt: skip
            if len(turn["tool_calls"]) != len(calls):
                raise ApiError(400, f"{where}.tool_calls: each call needs function.name and function.arguments",
                               param=f"{where}.tool_calls", code="invalid_value")  # fmt: skip
        turns.append(turn)
    if not turns:
        raise ApiError(400, "messages: only system messages; add a user message", param="messages",
                       code="empty_messages")  # fmt: skip
    return system, turns


def sampling_of(body, limits, member):
    """(max_tokens, temperature, top_p, seed, stop strings) of a request, with the config's defaults and
    the member's cap."""
    cap = limits["child"]["max_tokens"] if member["role"] == "child" else limits["max_tokens"]
    max_tokens = limits["default_max_tokens"]
    for key in ("max_completion_tokens", "max_tokens"):
        if body.get(key) is not None:
            max_tokens = expect(body[key], int, key, "an integer >= 1")
            if max_tokens < 1:
                raise ApiError(400, f"{key}: {max_tokens} must be >= 1", param=key, code="invalid_value")
            break
    temperature = body.get("temperature")
    temperature = (
        limits["temperature"]
        if temperature is None
        else expect(temperature, (int, float), "temperature", "a number")
    )
    if not 0 <= temperature <= 2:
        raise ApiError(400, f"temperature: {temperature} must be between 0 and 2", param="temperature",
                       code="invalid_value")  # fmt: skip
    top_p = body.get("top_p")
    top_p = limits["top_p"] if top_p is None else expect(top_p, (int, float), "top_p", "a number")
    if not 0 < top_p <= 1:
        raise ApiError(400, f"top_p: {top_p} must be in (0, 1]", param="top_p", code="invalid_value")
    seed = body.get("seed")
    seed = secrets.randbits(63) if seed is None else expect(seed, int, "seed", "an integer") % (1 << 63)
    stop = body.get("stop")
    stop = (
        []
        if stop is None
        else [stop]
        if isinstance(stop, str)
        else expect(stop, list, "stop", "a string or a list of strings")
    )
    if len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "stop: expected up to 4 non-empty strings", param="stop", code="invalid_value")
    if body.get("n") not in (None, 1):
        raise ApiError(400, "n: only n=1 is supported", param="n", code="invalid_value")
    return min(max_tokens, cap), float(temperature), float(top_p), seed, stop


def check_tools(body):
    tools = body.get("tools")
    if tools is None or body.get("tool_choice") == "none":
        return None
    expect(tools, list, "tools", "a list of tool definitions")
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(400, f'tools.{index}: expected {{"type": "function", "function": {{"name": ...}}}}',
                           param=f"tools.{index}", code="invalid_value")  # fmt: skip
    return tools or None


def tool_calls_of(text, specs):
    """OpenAI tool_calls of a reply (agent/tools.py's strict parser), or None unless every call is well formed
    and names a tool the client offered."""
    names = {tool["function"]["name"] for tool in specs}
    calls = tools.parse_reply(text).calls
    if not calls or any(call.error or call.name not in names for call in calls):
        return None
    try:
        return [
            {"id": "call_" + secrets.token_hex(12), "type": "function",
             "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
            for call in calls
        ]  # fmt: skip
    except RecursionError:  # arguments nested nearly as deep as json.loads allows: text, not a call
        return None


def tool_messages(messages):
    """An agent turn's calls and results as OpenAI messages (arguments as JSON text, as OpenAI sends them):
    the assistant messages with tool_calls and the tool messages answering them."""
    out = []
    for message in messages:
        if message["role"] == "assistant":
            calls = [call | {"function": call["function"] | {"arguments": json.dumps(call["function"]["arguments"],
                     ensure_ascii=False)}} for call in message.get("tool_calls", [])]  # fmt: skip
            out.append({"role": "assistant", "content": message["content"] or None, "tool_calls": calls})
        else:
            out.append({key: message[key] for key in ("role", "content", "tool_call_id", "name")})
    return out


class Reply:
    """The text of an answer as it streams: only what chat/visible.py lets a person see (never a call, a tag
    or call-shaped JSON), holding back what could still become one or a stop string. Stop strings apply to
    that visible text only, never inside a call; the client's tools' calls come back from finish()."""

    TAG = "<tool_call>"

    def __init__(self, stops, tools):
        self.stops, self.tools = stops, tools
        self.text, self.sent, self.stopped = "", 0, False
        self.tool_messages = []  # the server's own tools' calls and results (OpenAI tool messages)
        self.hold = max((len(s) for s in stops), default=1) - 1

    def add(self, piece):
        """The new text to show; sets stopped once a stop string appeared (the text ends before it)."""
        if self.stopped:  # pieces the worker made before it saw the cancel
            return ""
        self.text += piece
        seen = visible.shown(self.text, final=False)
        if self.stop_in(seen):
            return self.take(len(self.text))
        return self.take(len(seen) - self.hold)

    def stop_in(self, seen):
        """Whether a stop string appears in the visible text seen; the text then ends before the first."""
        found = [seen.find(stop) for stop in self.stops if stop in seen]
        if found:
            self.text, self.stopped = self.text[: min(found)], True
        return bool(found)

    def take(self, end):
        if end <= self.sent:
            return ""
        new, self.sent = self.text[self.sent : end], end
        return new

    def finish(self):
        """(remaining text, tool calls or None) once generation ended."""
        if not self.stopped:
            self.stop_in(visible.shown(self.text))
        calls = None
        if self.tools and self.TAG in self.text:
            calls = tool_calls_of(self.text[self.text.index(self.TAG) :], self.tools)
        return self.take(len(visible.shown(self.text))), calls
