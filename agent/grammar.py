"""
Constrained tool calls: once the model opens a call, the tokens up to </tool_call> can only spell
{"name": <a tool on offer>, "arguments": <an object valid for that tool's JSON Schema>}, so every call a
model writes parses and passes agent.argument_problem, whatever its logits say.

    constraint = grammar.constraint_for(tokenizer, conversation.get("tools"), settings, max_tokens,
                                        conversation["messages"])
    engine.generate(model, ids, max_new_tokens, ..., constraint=constraint)     # None: agent.constrained is off

Grounded calls (agent.grounding.mode "constrained", given the conversation's messages): the values of our
own tools' arguments can only be the conversation's (agent/grounding.py): calculadora's numbers those said
(digits or words) or configured constants, an expression's first number one said (when any is), with
operators and parentheses free; fecha_hora's dias a
number said (either sign) or a constant, its zona that of a place named (left out when none is);
a search's or a memory's text the user's recent words in order, with configured joining words between;
olvidar's id a memory shown. A tool with no value for a required argument is not callable, and with none
callable no call opens: the model answers in words or asks back. That grammar is EBNF (grounded_ebnf),
compiled when a reply opens a call and cached by its text (the conversation's candidates); a client's
own tools keep their schemas.

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
from decimal import Decimal

import numpy as np
import torch

import config
import data
from agent import answers, expression, grounding, tools

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
        # then those that close a grounded calculation's parentheses, and never those that open one
        self.parens = torch.tensor(
            [bool(raw) and set(raw) <= set(b") ") and b")" in raw for raw in self.bytes]
        )
        self.opens = torch.tensor([b"(" in raw for raw in self.bytes])

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

    def closers_mask(self, size, which=None):
        mask = torch.zeros(size, dtype=torch.bool)
        mask[: self.size] = self.ending if which is None else which
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


def own_tool(spec, settings):
    """The registered tool a definition is, or None for a client's own (even one named like ours)."""
    own = tools.TOOLS.get(spec["function"]["name"])
    return own if own is not None and spec == own.spec(settings) else None


def grammar_parameters(spec, settings):
    """The JSON Schema a call's arguments must match: the tool's own (as the client or agent.TOOLS gave
    it), tightened for our own tools to what the tools accept."""
    function = spec["function"]
    parameters = copy.deepcopy(function.get("parameters") or {"type": "object"})
    own = own_tool(spec, settings)
    if own is not None:
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
    """The compiled grammar of "\\n" + a call to one of the tools + "\\n" for one vocabulary: the tools'
    JSON Schemas, or with `grounded` (EBNF from grounded_ebnf) our own tools' grounded calls besides the
    schemas of `tools` (a client's)."""

    def __init__(self, vocab, tools, settings, grounded=None):
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
        parts = [xgrammar.Grammar.from_ebnf(grounded)] if grounded else []
        if tools:
            parts.append(xgrammar.Grammar.from_json_schema(
                json.dumps(call_schema(tools, settings)), any_whitespace=False, separators=(", ", ": ")
            ))  # fmt: skip
        body = parts[0] if len(parts) == 1 else xgrammar.Grammar.union(*parts)
        newline = xgrammar.Grammar.from_ebnf('root ::= "\\n"')
        with vocab.lock:
            self.compiled = vocab.compiler.compile_grammar(xgrammar.Grammar.concat(newline, body, newline))

    def matcher(self):
        import xgrammar

        return xgrammar.GrammarMatcher(self.compiled, override_stop_tokens=[self.vocab.close_id])


_grammars = {}
_grammars_lock = threading.Lock()


def tool_grammar(tokenizer, tools, settings, grounded=None):
    """The cached ToolGrammar of these tools (OpenAI tool definitions) for this tokenizer, and of the
    grounded calls when given (cached by their text: a conversation's set of candidates)."""
    vocab = vocabulary(tokenizer)
    key = (vocab, json.dumps(tools, sort_keys=True, ensure_ascii=False), grounded)
    with _grammars_lock:
        if key in _grammars:
            return _grammars[key]
    grammar = ToolGrammar(vocab, tools, settings, grounded)
    with _grammars_lock:
        if len(_grammars) >= settings["grammar_cache"]:
            _grammars.pop(next(iter(_grammars)))  # the oldest tool set goes
        _grammars[key] = grammar
    return grammar


def check_tools(tokenizer, tools, settings):
    """Compile (and cache) the grammar of client tools now, so a schema it cannot enforce is a clear error
    before any generation; raises GrammarError."""
    tool_grammar(tokenizer, tools, settings)


def constraint_for(tokenizer, tools, settings, max_tokens=None, messages=None):
    """The constraint of one reply offered these tools (None or [] for none), or None when
    agent.constrained is off. With max_tokens, the reply's budget: its last call_reserve_tokens close an
    open call and open none (see ToolCallConstraint). With the conversation's messages so far and
    agent.grounding.mode "constrained", our own tools' values come from it (GroundedGrammar); a client's
    tools keep their schemas."""
    if not settings["constrained"]:
        return None
    answer = answers.guard_for(vocabulary(tokenizer), messages, settings)
    grammar = None
    if tools and messages is not None and settings["grounding"]["mode"] == "constrained":
        grammar = GroundedGrammar(tokenizer, tools, settings, grounding.candidates(messages, settings))
        grammar = grammar if grammar.callable else None
    elif tools:
        grammar = tool_grammar(tokenizer, tools, settings)
    return ToolCallConstraint(vocabulary(tokenizer), grammar, max_tokens, settings["call_reserve_tokens"], answer,
                              settings["call_bias"]["value"])  # fmt: skip


# -----------------------------------------------------------------------------
# Grounded calls: our own tools' values are the conversation's (agent/grounding.py)


class GroundedGrammar:
    """The grammar of a reply's calls grounded in its conversation: built when the reply opens a call
    (most replies open none), from the cache when the candidates are those of an earlier reply. Not
    callable when no tool on offer has a value for its required arguments: then no call opens, and the
    model answers in words or asks back."""

    def __init__(self, tokenizer, tools, settings, found):
        self.tokenizer, self.settings, self.found = tokenizer, settings, found
        own = [spec["function"]["name"] for spec in tools if own_tool(spec, settings)]
        self.others = [spec for spec in tools if not own_tool(spec, settings)]
        self.ebnf = grounded_ebnf(own, found, settings)
        self.callable = bool(self.ebnf or self.others)

    def matcher(self):
        return tool_grammar(self.tokenizer, self.others, self.settings, self.ebnf).matcher()


def literal(text):
    return json.dumps(text, ensure_ascii=False)


def alternatives(texts):
    return " | ".join(literal(text) for text in dict.fromkeys(texts))


def words_rules(words, joining, ends=(), spans=2):
    """EBNF rules `w` (and w_*): a text made of at most `spans` contiguous spans of the user's words (a
    span never crosses the end of a turn, `ends`), each later span starting after the one before; inside a
    span a joining word may be left out or one added ("farmacia de guardia hoy Logroño"), the words
    separated by a space or ", ". Linear in the words: spans * 2 rules a word."""
    last, stops = len(words), set(ends) | {len(words)}
    plain = {grounding.plain(word) for word in joining}
    rules = ['w ::= (w_j " ")? w_q1_0', f"w_j ::= {alternatives(joining)}", 'w_g ::= (" " | ", ") (w_j " ")?']
    for level in range(1, spans + 1):
        for index, word in enumerate(words):
            forms = alternatives((word, word.lower(), word[:1].upper() + word[1:]))
            steps = []
            after = index + 1  # the next word, or one after joining words left out ("hora el partido")
            while after not in stops:
                steps.append(f"w_a{level}_{after}")
                if grounding.plain(words[after]) not in plain:
                    break
                after += 1
            if level < spans and index + 1 < last:
                steps.append(f"w_q{level + 1}_{index + 1}")  # the next span, further on
            more = f" (w_g ({' | '.join(steps)}))?" if steps else ""
            rules.append(f"w_a{level}_{index} ::= ({forms}){more}")
            later = f" | w_q{level}_{index + 1}" if index + 1 < last else ""
            rules.append(f"w_q{level}_{index} ::= w_a{level}_{index}{later}")
    return rules


def calculation_rules(depth, operators, paired=False):
    """EBNF `c_e0`: numbers with operators between, parentheses nested at most `depth` deep (so that a
    budget's last tokens can always close them). The first number of each (parenthesised) expression is
    one the conversation said (`c_s`), or with `paired` the whole starts with two numbers of the latest
    user turn (`c_pair`, pair_rules); the later ones may be constants too (`c_n`). `operators`: those the
    latest turn's words allow (grounding.said_operators); "%" is a percentage after a number, "mod" the
    remainder written "%" between two. A small model that has not learnt to copy otherwise writes "1234
    por 56" with constants ("2**1*1", then "1234*2", then "1234*1234")."""
    between = [("%" if operator == "mod" else operator) for operator in operators if operator != "%"]
    percent = ' ("%" | " %")?' if "%" in operators else ""
    rules = ['c_sp ::= " " | ""', f"c_o ::= {alternatives(between)}", f"c_p ::= {percent or chr(34) * 2}",
             'c_pct ::= "%" | " %"']  # fmt: skip
    for level in range(depth + 1):
        inner = f' | "(" c_sp c_e{level + 1} c_sp ")"' if level < depth else ""
        first = "c_pair" if paired and level == 0 else f"c_f{level}"
        rules.append(f"c_e{level} ::= {first} (c_sp c_o c_sp c_t{level})*")
        for term, number in ((f"c_f{level}", "c_s"), (f"c_t{level}", "c_n")):
            rules.append(f'{term} ::= ("-" | "+")? ({number}{inner})')
    return rules


def numbers_ebnf(numbers, forms, percents):
    """EBNF of one of `numbers` in each form `forms` gives, maybe a percentage (c_p); one of `percents`
    (said only as a percentage: grounding.percent_numbers) always with its "%" (c_pct)."""
    plain = [n for n in numbers if n not in percents]
    shares = [n for n in numbers if n in percents]
    parts = [f"({alternatives(forms(plain))}) c_p"] if plain else []
    parts += [f"({alternatives(forms(shares))}) c_pct"] if shares else []
    return " | ".join(parts)


def pair_rules(numbers, forms, pairs=(), percents=(), ordered=()):
    """EBNF `c_pair`: one of `numbers`, an operator, another of them or one the question pairs it with
    ("12 por 12": grounding.joined_numbers), that second one maybe in parentheses after a constant and an
    operator ("100*(1-10%)"); each signed, each maybe a percentage (c_p). A pair joined by words of an
    operator whose order matters (`ordered`: grounding.ordered_pairs) keeps its order. Quadratic in the
    numbers: the latest turn's, at most grounding.max_candidates."""
    signed = '("-" | "+")?'
    rules = []
    for index, number in enumerate(numbers):
        partners = [n for n in numbers if n != number] + [b for a, b in pairs if a == number]
        partners += [a for a, b in pairs if b == number]
        partners = [n for n in partners if (n, number) not in ordered]  # "9.75 entre 3": never 3/9.75
        if not partners:
            continue
        others = f"{signed} ({numbers_ebnf(list(dict.fromkeys(partners)), forms, percents)})"
        first = numbers_ebnf([number], forms, percents)
        rules.append(
            f'c_q{index} ::= {signed} ({first}) c_sp c_o c_sp ({others} | "(" c_sp c_n c_sp c_o c_sp '
            f'{others} c_sp ")")'
        )
    if not rules:  # pairs said both ways round ("3 entre 9 entre 3"): no order kept
        return pair_rules(numbers, forms, pairs, percents)
    rules.append("c_pair ::= " + " | ".join(rule.split(" ::= ")[0] for rule in rules))
    return rules


def date_arguments(found, key):
    """EBNF of fecha_hora's arguments: dias among the days said (or 0), zona among the places named (left
    out when none is: the family's own zone); what the latest user turn asks about (found.asked_days,
    found.asked_zones) must be there."""

    def offsets(days):
        return alternatives(str(day) for day in sorted({abs(day) for day in days}) if day)

    days = offsets(found.days)
    day = f'{key("dias")} ("0" | "-"? ({days}))' if days else f'{key("dias")} "0"'
    if found.asked_days:
        day = f'{key("dias")} "-"? ({offsets(found.asked_days)})'
    comma = literal(", ")
    zones = found.asked_zones or found.zones  # else no place is named: zona is left out, the family's own
    zone = f"{key('zona')} ({alternatives(json.dumps(zone) for zone in zones)})" if zones else None
    if found.asked_zones:
        return f"{zone} ({comma} {day})" if found.asked_days else f"{zone} ({comma} {day})?"
    if found.asked_days:
        return f"({zone} {comma})? {day}" if zone else day
    return f"(({zone}) ({comma} {day})? | {day})?" if zone else f"({day})?"


def grounded_ebnf(names, found, settings):
    """EBNF of a call to one of our own tools `names` with the values in `found` (grounding.Candidates),
    laid out as chat.render writes it; a tool with a required argument and no value for it is left out.
    None when none is left."""
    rules, calls = [], []
    names = [name for name in names if grounding.callable_tool(name, found)]

    def call(name, arguments):  # arguments: EBNF of the object's inside, between its braces
        head = literal('{"name": ' + json.dumps(name) + ', "arguments": {')
        calls.append(f"{head} {arguments} " + literal("}}"))

    def key(name):
        return literal(f'"{name}": ')

    if "calculadora" in names:
        forms = lambda numbers: [f for n in numbers for f in expression.number_forms(Decimal(n))]  # noqa: E731
        paired = settings["grounding"]["said_first"] > 1 and len(found.latest) > 1
        rules += calculation_rules(settings["grounding"]["max_parentheses"], found.operators, paired)
        percents = found.percents if "%" in found.operators else ()
        rules += pair_rules(found.latest, forms, found.pairs, percents, found.ordered) if paired else []
        rules.append(f"c_n ::= {numbers_ebnf(found.numbers, forms, percents)}")
        rules.append(f"c_s ::= {numbers_ebnf(found.said or found.numbers, forms, percents)}")
        call("calculadora", f'{key("expresion")} "\\"" c_e0 "\\""')
    if "fecha_hora" in names:
        call("fecha_hora", date_arguments(found, key))
    if {"buscar_web", "recordar", "buscar_recuerdos"} & set(names):
        grounded = settings["grounding"]
        rules += words_rules(found.words, grounded["joining_words"], found.turn_ends, grounded["max_spans"])
        text = '"\\"" w "\\""'
        if "buscar_web" in names:
            most = settings["search"]["max_results"]
            count = alternatives(str(n) for n in range(1, most + 1))
            call(
                "buscar_web", f"{key('consulta')} {text} ({literal(', ')} {key('max_resultados')} ({count}))?"
            )
        if "recordar" in names:
            scope = alternatives(['"privado"', '"familia"'])
            call("recordar", f"{key('texto')} {text} ({literal(', ')} {key('ambito')} ({scope}))?")
        if "buscar_recuerdos" in names:
            call("buscar_recuerdos", f"{key('consulta')} {text}")
    if "olvidar" in names:
        call("olvidar", f"{key('id')} ({alternatives(str(n) for n in found.ids)})")
    if not calls:
        return None
    return "\n".join([f"root ::= {' | '.join(f'({c})' for c in calls)}", *rules])


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
    the budget never cuts a call (ours close in a few tokens from anywhere). At the reply's first token,
    where a call may open, `bias` is added to <tool_call>'s logit (agent/call_bias.py) and the margin it
    had over the best other token, after the masks, is kept in .margin (None where no call may open)."""

    def __init__(self, vocab, grammar, max_tokens=None, reserve=0, answer=None, bias=0.0):
        self.vocab, self.grammar, self.answer = vocab, grammar, answer  # answer: an answers.AnswerGuard
        self.bias, self.margin = bias, None
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
            if self.answer is not None:
                logits = self.answer.mask(logits)
            return self.decide(logits) if opening and self.accepted == 0 else logits
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
        if self.reserve < self.left() <= 2 * self.reserve:
            # a call opened late: its name and keys in the longest steps, so that the last `reserve` tokens
            # are left to close it (greedy calls would otherwise spell it one character at a time)
            lengths = vocab.lengths_of(logits.shape[0])
            allowed = allowed & (lengths == lengths.masked_fill(~allowed, -1).max())
        if self.left() <= self.reserve:
            size = logits.shape[0]
            closing = allowed & vocab.closers_mask(size)
            if not closing.any():
                closing = allowed & vocab.closers_mask(size, vocab.parens)
            if not closing.any():  # a name, an enum value, a key or a number to finish: in the longest steps
                if (allowed & ~vocab.closers_mask(size, vocab.opens)).any():
                    allowed = allowed & ~vocab.closers_mask(size, vocab.opens)
                lengths = vocab.lengths_of(size)
                closing = allowed & (lengths == lengths.masked_fill(~allowed, -1).max())
            allowed = closing
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

    def decide(self, logits):
        """The first token's logits with the call bias on <tool_call>; its margin kept (agent/call_bias.py)."""
        opener = self.vocab.open_id
        top = logits.topk(2)
        best_other = top.values[1] if int(top.indices[0]) == opener else top.values[0]
        self.margin = float(logits[opener] - best_other)
        if self.bias:
            logits[opener] += self.bias
        return logits

    def accept(self, token):
        vocab = self.vocab
        self.accepted += 1
        if self.state == TEXT:
            if token == vocab.open_id and self.grammar is not None:
                self.state, self.tail = CALL, b""
                self.matcher = self.grammar.matcher()
            else:
                self.tail = (self.tail + vocab.bytes[token])[-(LONGEST_TAG - 1) :]
                if self.answer is not None:
                    self.answer.accept(token)
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
