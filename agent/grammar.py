"""
Constrained tool calls: once the model opens a call, the tokens up to </tool_call> can only spell
{"name": <a tool on offer>, "arguments": <an object valid for that tool's JSON Schema>}, so every call a
model writes parses and passes agent.argument_problem, whatever its logits say.

    constraint = grammar.constraint_for(tokenizer, conversation.get("tools"), settings)
    model.generate(ids, max_new_tokens, ..., constraint=constraint)     # None: agent.constrained is off

A constraint follows one reply token by token (the contract every generation path shares):
constraint.mask(logits) takes the next token's logits, shape (vocab,), and returns them with the forbidden
tokens at -inf; constraint.accept(token) is told the token chosen. Its states follow chat.render's layout:

    text   free text, not constrained, except that </tool_call> and the tags spelled out of smaller pieces
           ("<", "tool", "_call", ">") are forbidden: a call opens only with the one <tool_call> token (17
           in data.py's table) and nothing closes that is not open. With no tools on offer, <tool_call> too.
    call   after <tool_call>: xgrammar's matcher for "\\n" + the call's JSON + "\\n", with </tool_call> as its
           stop token. The control tokens and the other tags are special to it (never inside a call), and
           the tags spelled out of pieces are forbidden inside the JSON's strings too.
    after  a call closed: <|end|> (or <|eos|>), or "\\n" and the next <tool_call>, since nothing may follow
           the calls (agent.parse_reply).

The JSON is laid out as chat.render writes it (json.dumps' separators, no other whitespace). The grammar of
a tool set is compiled once and cached; the vocabulary once per tokenizer. Our own tools' schemas are
tightened for the grammar only, to what the tools refuse anyway: an IANA zone from tzdata, dias within
date.max_days, memory ids within SQLite's integers. Given the reply's budget, the constraint also keeps a
call from being cut by it (call_reserve_tokens, see ToolCallConstraint). So every call is valid by
construction: tests/test_agent_grammar.py samples from uniform noise and from adversarial logits.

String lengths are not bounded for our tools: xgrammar 0.2.9 compiles a maxLength into a rule that lets raw
control characters in (plain_bounded_strings works around it for the clients' schemas, at a cost that grows
with the bound: ~10 ms a token for 150 characters in make bench's conditions, against ~30 µs unbounded).

llguidance, the other engine vLLM offers, is measured beside xgrammar in `make bench ARGS=agent`
(bench/agent.py); xgrammar computes the mask several times faster on our vocabulary and is the one used here.

    python -m agent.grammar structural-tag [--member]   # the same constraint as vLLM's response_format
"""

import argparse
import copy
import functools
import json
import re
import sys
import threading
import zoneinfo

import numpy as np
import torch

import config
import data
from agent import tools

TAGS = (b"<tool_call>", b"</tool_call>")
LONGEST_TAG = max(map(len, TAGS))
SQLITE_MAX_INTEGER = 2**63 - 1  # memory ids are SQLite rowids
ENGINE_PREFIX = re.compile(r"^\[[\d:]+\] \S+: ")  # xgrammar's "[20:57:23] /project/cpp/x.cc:5082: "


class GrammarError(ValueError):
    """A tool's schema the grammar engine cannot enforce; the message names the tool."""


# -----------------------------------------------------------------------------
# The vocabulary as the grammar engine sees it (once per tokenizer)


class Vocabulary:
    """A sentencepiece tokenizer's tokens as bytes, xgrammar's view of them and a compiler bound to it."""

    def __init__(self, tokenizer):
        import xgrammar  # imports transformers: only when the first constraint is built

        if "<|end|>" not in tokenizer.special_ids:
            raise GrammarError(
                f"the {tokenizer.name} tokenizer has no control tokens; tool calls need ENLACE's"
            )
        processor = tokenizer.processor
        self.size = tokenizer.vocab_size
        self.open_id, self.close_id = data.TOKEN_TABLE["<tool_call>"], data.TOKEN_TABLE["</tool_call>"]
        self.newline_id = data.TOKEN_TABLE[data.NEWLINE]
        self.end_ids = [tokenizer.special_ids["<|end|>"], tokenizer.eos_id]
        # Every token of data.py's table but the newline is special: xgrammar never lets one into a call
        # (an empty string is how its TokenizerInfo tells a special token), </tool_call> only as the stop.
        protocol = set(data.TOKEN_TABLE.values()) - {self.newline_id}
        pieces, self.bytes, self.byte_ids = [], [], {}
        for index in range(self.size):
            piece = processor.id_to_piece(index)
            if index in protocol:
                pieces.append("")
                self.bytes.append(b"")
            elif processor.is_byte(index):
                pieces.append(piece)
                self.bytes.append(bytes([int(piece[3:5], 16)]))
                self.byte_ids[int(piece[3:5], 16)] = index
            else:
                pieces.append(piece)
                self.bytes.append(piece.replace("\u2581", " ").encode("utf-8"))
        self.info = xgrammar.TokenizerInfo(
            pieces, xgrammar.VocabType.BYTE_FALLBACK, stop_token_ids=[self.close_id]
        )
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.lock = threading.Lock()
        # Tokens that could finish a tag spelled out of pieces: those holding ">" (every tag ends with it).
        self.closers = [(index, raw) for index, raw in enumerate(self.bytes) if b">" in raw]
        self.whole_tags = [index for index, raw in self.closers if any(tag in raw for tag in TAGS)]
        # Tokens that only close what is open: what an open call is steered to when the budget ends.
        ending = [index for index, raw in enumerate(self.bytes) if raw and set(raw) <= set(b'"}]\n')]
        self.ending = torch.zeros(self.size, dtype=torch.bool)
        self.ending[ending + [self.close_id]] = True

        self.lengths = torch.tensor([len(raw) for raw in self.bytes])

    def allowed(self, bitmask, size):
        """A grammar engine's bitmask (int32 words, bit i of word w: token 32 w + i) as a bool tensor of
        `size` tokens (the model's vocabulary may be larger than the tokenizer's)."""
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[: self.size]
        allowed = torch.zeros(size, dtype=torch.bool)
        allowed[: self.size] = torch.from_numpy(bits.view(bool))
        return allowed

    def invalid_after(self, lead, size):
        """The byte tokens that cannot follow the lead byte of a UTF-8 sequence: xgrammar 0.2.9 takes an
        overlong form (E0 80 AF for "/") or a surrogate (ED A0 80) as one character, which Python decodes as
        three replacement characters, past a schema's maxLength and never what the model meant."""
        mask = torch.zeros(size, dtype=torch.bool)
        for value in OVERLONG_OR_SURROGATE.get(lead, ()):
            if value in self.byte_ids:
                mask[self.byte_ids[value]] = True
        return mask

    def closers_mask(self, size):
        mask = torch.zeros(size, dtype=torch.bool)
        mask[: self.size] = self.ending
        return mask

    def lengths_of(self, size):
        lengths = torch.zeros(size, dtype=torch.long)
        lengths[: self.size] = self.lengths
        return lengths

    def tag_completions(self, tail):
        """Tokens (besides <tool_call> itself) that would finish "<tool_call>" or "</tool_call>" after
        the text `tail` (the last bytes written, holding no whole tag)."""
        if b"<" not in tail:
            return self.whole_tags
        return [index for index, raw in self.closers if any(tag in tail + raw for tag in TAGS)]


@functools.lru_cache(maxsize=4)
def vocabulary(tokenizer):
    return Vocabulary(tokenizer)


# -----------------------------------------------------------------------------
# The grammar of a set of tools (once per tool set)


def grammar_parameters(spec, settings):
    """The JSON Schema a call's arguments must match: the tool's own (as the client or agent.TOOLS gave
    it), tightened for our own tools to what the tools accept."""
    function = spec["function"]
    parameters = copy.deepcopy(function.get("parameters") or {"type": "object"})
    own = tools.TOOLS.get(function["name"])
    if own is not None and spec == own.spec(settings):
        properties = parameters["properties"]
        for schema in properties.values():
            if schema.get("type") == "integer":
                schema.setdefault("maximum", SQLITE_MAX_INTEGER)
        if own.name == "fecha_hora":
            properties["zona"] = {"enum": sorted(zoneinfo.available_timezones())}
            limit = settings["date"]["max_days"]
            properties["dias"].update(minimum=-limit, maximum=limit)
    return plain_bounded_strings(parameters)


def plain_bounded_strings(schema):
    """The schema with each string's minLength/maxLength (without a pattern of its own) turned into a
    pattern of as many plain characters: no quote, backslash or control character. xgrammar 0.2.9 compiles
    a length bound into a rule that lets raw control characters in (which json.loads refuses) and no
    escapes; the pattern keeps the JSON valid, for a value that then never holds a quote or backslash. Nor
    a surrogate: xgrammar takes their UTF-8 form (ED A0 80) as one character, which decodes as three
    replacement characters and so breaks the bound."""
    if isinstance(schema, list):
        return [plain_bounded_strings(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: plain_bounded_strings(value) for key, value in schema.items()}
    bounded = "minLength" in schema or "maxLength" in schema
    if schema.get("type") == "string" and bounded and "pattern" not in schema and "format" not in schema:
        low, high = schema.pop("minLength", 0), schema.pop("maxLength", "")
        schema["pattern"] = f'^[^"\\\\\\x00-\\x1f\\ud800-\\udfff]{{{low},{high}}}$'
    return schema


def call_schema(tools, settings):
    """One JSON Schema for a call to any of the tools: {"name": const, "arguments": ...} per tool."""
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": spec["function"]["name"]},
                    "arguments": grammar_parameters(spec, settings),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for spec in tools
        ]
    }


class ToolGrammar:
    """The compiled grammar of "\\n" + a call to one of the tools + "\\n" for one vocabulary."""

    def __init__(self, vocab, tools, settings):
        import xgrammar

        self.vocab = vocab
        self.names = [spec["function"]["name"] for spec in tools]
        for spec in tools:  # each schema alone first, so that an error names its tool
            try:
                xgrammar.Grammar.from_json_schema(json.dumps(call_schema([spec], settings)))
            except (RuntimeError, ValueError, TypeError) as exc:
                why = ENGINE_PREFIX.sub("", str(exc).strip().splitlines()[0])[:200]
                raise GrammarError(
                    f"tool {spec['function']['name']!r}: its parameters cannot be enforced as a JSON Schema "
                    f"({why})"
                ) from None
        body = xgrammar.Grammar.from_json_schema(
            json.dumps(call_schema(tools, settings)), any_whitespace=False, separators=(", ", ": ")
        )
        newline = xgrammar.Grammar.from_ebnf('root ::= "\\n"')
        with vocab.lock:
            self.compiled = vocab.compiler.compile_grammar(xgrammar.Grammar.concat(newline, body, newline))

    def matcher(self):
        import xgrammar

        return xgrammar.GrammarMatcher(self.compiled, override_stop_tokens=[self.vocab.close_id])


_grammars = {}
_grammars_lock = threading.Lock()


def tool_grammar(tokenizer, tools, settings):
    """The cached ToolGrammar of these tools (OpenAI tool definitions) for this tokenizer."""
    vocab = vocabulary(tokenizer)
    key = (vocab, json.dumps(tools, sort_keys=True, ensure_ascii=False))
    with _grammars_lock:
        if key in _grammars:
            return _grammars[key]
    grammar = ToolGrammar(vocab, tools, settings)
    with _grammars_lock:
        if len(_grammars) >= settings["grammar_cache"]:
            _grammars.pop(next(iter(_grammars)))  # the oldest tool set goes
        _grammars[key] = grammar
    return grammar


def check_tools(tokenizer, tools, settings):
    """Compile (and cache) the grammar of client tools now, so a schema it cannot enforce is a clear error
    before any generation; raises GrammarError."""
    tool_grammar(tokenizer, tools, settings)


def constraint_for(tokenizer, tools, settings, max_tokens=None):
    """The constraint of one reply offered these tools (None or [] for none), or None when
    agent.constrained is off. With max_tokens, the reply's budget: its last call_reserve_tokens close an
    open call and open none (see ToolCallConstraint)."""
    if not settings["constrained"]:
        return None
    grammar = tool_grammar(tokenizer, tools, settings) if tools else None
    return ToolCallConstraint(vocabulary(tokenizer), grammar, max_tokens, settings["call_reserve_tokens"])


# -----------------------------------------------------------------------------
# One reply's constraint

TEXT, CALL, AFTER, NEXT = "text", "call", "after", "next"
# second bytes that make a 3- or 4-byte UTF-8 sequence overlong, a surrogate or past U+10FFFF (RFC 3629)
OVERLONG_OR_SURROGATE = {0xE0: range(0x80, 0xA0), 0xED: range(0xA0, 0xC0), 0xF0: range(0x80, 0x90),
                         0xF4: range(0x90, 0xC0)}  # fmt: skip


class ToolCallConstraint:
    """mask(logits) / accept(token) for one reply (see the module docstring). Given the reply's budget
    (max_tokens), a call opens only while twice `reserve` tokens are left, and in the last `reserve`
    tokens an open call is steered to its end: where the grammar allows tokens made only of closing
    characters (a quote, a brace, a bracket, the newline, </tool_call>), only those are allowed, and where
    it allows none (a tool's name, an enum value, a key to finish) only the longest allowed tokens, so that
    the budget never cuts a call (ours close in a few tokens from anywhere)."""

    def __init__(self, vocab, grammar, max_tokens=None, reserve=0):
        self.vocab, self.grammar = vocab, grammar
        self.state, self.tail, self.matcher = TEXT, b"", None
        self.bitmask = torch.zeros(1, (vocab.size + 31) // 32, dtype=torch.int32)
        self.calls, self.accepted = 0, 0
        self.max_tokens, self.reserve = max_tokens, reserve

    def left(self):
        return float("inf") if self.max_tokens is None else self.max_tokens - self.accepted

    @property
    def in_call(self):
        return self.state == CALL

    def mask(self, logits):
        vocab = self.vocab
        opening = self.grammar is not None and self.left() > 2 * self.reserve
        if self.state == TEXT:
            banned = [vocab.close_id, *vocab.tag_completions(self.tail)]
            if not opening:
                banned.append(vocab.open_id)
            logits[banned] = float("-inf")
            return logits
        if self.state in (AFTER, NEXT):
            allowed = vocab.end_ids + [vocab.newline_id] * opening if self.state == AFTER else [vocab.open_id]
            out = torch.full_like(logits, float("-inf"))
            out[allowed] = logits[allowed]
            return out
        self.matcher.fill_next_token_bitmask(self.bitmask)
        allowed = vocab.allowed(self.bitmask, logits.shape[0])
        if self.tail[-1:] and self.tail[-1] in OVERLONG_OR_SURROGATE:  # a byte token opened a character
            allowed &= ~vocab.invalid_after(self.tail[-1], logits.shape[0])
        spelled = vocab.tag_completions(self.tail)
        if spelled and allowed[spelled].any():
            fewer = allowed.clone()
            fewer[spelled] = False
            if fewer.any():  # never an empty choice: a schema's own enum may spell a tag
                allowed = fewer
        if self.left() <= self.reserve:
            closing = allowed & vocab.closers_mask(logits.shape[0])
            if not closing.any():  # a name, an enum value or a key to finish first: in the longest steps
                lengths = vocab.lengths_of(logits.shape[0])
                closing = allowed & (lengths == lengths.masked_fill(~allowed, -1).max())
            allowed = closing
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

    def accept(self, token):
        vocab = self.vocab
        self.accepted += 1
        if self.state == TEXT:
            if token == vocab.open_id and self.grammar is not None:
                self.state, self.tail = CALL, b""
                self.matcher = self.grammar.matcher()
            else:
                self.tail = (self.tail + vocab.bytes[token])[-(LONGEST_TAG - 1) :]
        elif self.state == CALL:
            if not self.matcher.accept_token(token):
                raise ValueError(f"token {token} is outside the tool-call grammar: was the mask applied?")
            if token == vocab.close_id:
                self.state, self.calls = AFTER, self.calls + 1
            else:
                self.tail = (self.tail + vocab.bytes[token])[-(LONGEST_TAG - 1) :]
        elif self.state == AFTER:
            self.state = NEXT if token == vocab.newline_id else AFTER
        elif self.state == NEXT:
            self.state, self.tail = CALL, b""
            self.matcher = self.grammar.matcher()


# -----------------------------------------------------------------------------
# The same guarantee elsewhere: vLLM's structural tag (xgrammar or llguidance behind it)


def structural_tag(tools, settings):
    """vLLM's response_format for these tools: free text until "<tool_call>", then a call laid out as
    chat.render writes it, its arguments valid for the tool's schema (tightened as above).

        client.chat.completions.create(..., tools=tools, response_format=structural_tag(tools, settings))
    """
    structures = [
        {
            "begin": '<tool_call>\n{"name": ' + json.dumps(spec["function"]["name"]) + ', "arguments": ',
            "schema": grammar_parameters(spec, settings),
            "end": "}\n</tool_call>",
        }
        for spec in tools
    ]
    return {"type": "structural_tag", "structures": structures, "triggers": ["<tool_call>"]}


def main(argv):
    parser = argparse.ArgumentParser(description="The tool-call constraint as other engines take it.")
    parser.add_argument("what", choices=["structural-tag"], help="vLLM's response_format (structural tag)")
    parser.add_argument(
        "--member", action="store_true", help="the tools a family member gets (with memories)"
    )
    parser.add_argument("--settings", default=tools.DEFAULT_SETTINGS, help="an agent layer file")
    args = parser.parse_args(argv)
    try:
        settings = tools.load_settings(path=args.settings)
    except config.ConfigError as exc:
        print(f"agent/grammar.py: {exc}", file=sys.stderr)
        return 2
    specs = tools.tool_specs(settings, tools.default_tools(member="member" if args.member else None))
    print(json.dumps(structural_tag(specs, settings), ensure_ascii=False, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
