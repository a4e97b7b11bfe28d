"""
Answers grounded in what was said and computed: after a tool result, the answer may state only the numbers
the conversation or the tool results contain (agent.answers.grounding "constrained"), enforced while
decoding by a per-turn mask over the tokens that write digits and Spanish number words.

    guard = answers.guard_for(vocab, messages, settings)   # None: off, or no tool result in this turn
    guard.mask(logits) -> logits; guard.accept(token)       # ToolCallConstraint calls them in free text

The numbers allowed: those with digits or in words of the user turns, the system turn (today's date, the
memories) and the tool results of the conversation, the latest tool results first, at most
answers.max_candidates of them, plus answers.numbers (small counts: "los 2", "1 persona"). A failed tool's
result ("Error: ...") offers none: after it the answer states no computed number. Each number may be
written in the forms the calculator reads as it ("1250", "1.250", "1250,5", "1.250,5") or as said.

A number is a run of digits with "." or "," between them. The guard follows the run the answer is writing:
a token may extend it only to a prefix of an allowed form, and may end it (any other character, the end of
the answer) only where it is a whole allowed number; a run ending in a mark ("Son 42.") is that number and
its punctuation. Number words ("quince", "mil") are whole tokens of the vocabulary: one whose value is not
allowed is masked; the words grounding.spoken_numbers does not count alone ("una", "media") stay. A word
split over several tokens is not seen.
Ordinals ("primero", "2.º") are not cardinals and stay free.

No loop over the vocabulary runs while decoding. Once per vocabulary (number_tokens), the tokens that write
number characters are laid out as a trie of what they write first (their lead: "1", "12", ".5") with the
token ids ending at each node, and the numbers a token writes after other characters (" 15", "año2026") as
rows of string ids; once per answer (AnswerGuard), which of those strings are whole or open numbers for its
forms, as tensors; once per run being written, a walk of the trie that follows only the allowed forms (a few
nodes mid-number). The masks are cached per run, so the cost per token is a dictionary look-up and an
index_fill (make bench ARGS=answers measures it, with decoding's tokens/s with and without).
"""

import functools
import re
from decimal import Decimal

import torch

from agent import expression, grounding

NUMBER_HEAD = re.compile(r"[\d.,]*")
SCALES = {"cien": 100, "ciento": 100, "mil": 1000, "millon": 1000000, "millones": 1000000}


def extends(run, ch):
    """Whether a character extends the number a run is writing: a digit, or a mark after a digit."""
    return ch.isdigit() or (ch in ".," and bool(run) and run[-1].isdigit())


def segments(text):
    """(the numbers a text closes, the number it leaves open) when written from outside any number: the
    pieces AnswerGuard.after checks with whole and open."""
    closed, run = [], ""
    for ch in text:
        if extends(run, ch):
            run += ch
        else:
            if run:
                closed.append(run)
            run = ""
    return closed, run


class NumberTokens:
    """A vocabulary's tokens by the numbers they write (see the module docstring): .trie, nodes of
    {"children": {char: node}, "pure": ids of tokens whose whole text is this lead, "rest": rows of the tokens
    that go on after it with other characters}; rows' .row_tokens, .closing (string ids, padded with 0, the
    empty string) and .final; .strings and .string_ids; .relevant_ids, every token that writes a digit or a mark; .size;
    .words, number-word tokens with their word and value."""

    def __init__(self, vocab):
        self.trie, self.strings, self.string_ids = {"children": {}, "pure": [], "rest": []}, [""], {"": 0}
        rows, relevant, self.words = [], [], []
        for index, raw in enumerate(vocab.bytes):
            text = raw.decode("utf-8", "replace")
            if not text:
                continue
            lead = NUMBER_HEAD.match(text).group()
            rest = text[len(lead) :]
            node = self.trie
            for ch in lead:
                node = node["children"].setdefault(ch, {"children": {}, "pure": [], "rest": []})
            if lead and not rest:
                node["pure"].append(index)
            elif rest and (lead or any(ch.isdigit() for ch in rest)):
                closed, final = segments(rest)
                node["rest"].append(len(rows))
                rows.append((index, [self.string_id(s) for s in closed], self.string_id(final)))
            if lead or any(ch.isdigit() for ch in rest):
                relevant.append(index)
            word = grounding.plain(text.strip())
            if word and word not in grounding.LONE_WORDS:  # what spoken_numbers does not count
                value = word_value(word)
                if value is not None:
                    self.words.append((index, word, value))
        width = max((len(closing) for _, closing, _ in rows), default=0) or 1
        self.row_tokens = torch.tensor([index for index, _, _ in rows], dtype=torch.long)
        self.closing = torch.tensor([closing + [0] * (width - len(closing)) for _, closing, _ in rows],
                                    dtype=torch.long).reshape(len(rows), width)  # fmt: skip
        self.final = torch.tensor([final for _, _, final in rows], dtype=torch.long)
        self.size = max(vocab.size, len(vocab.bytes))
        self.relevant_ids = torch.tensor(relevant, dtype=torch.long)
        self.freeze(self.trie)

    def string_id(self, text):
        if text not in self.string_ids:
            self.string_ids[text] = len(self.strings)
            self.strings.append(text)
        return self.string_ids[text]

    def freeze(self, node):  # lists to tensors, None for none (a check the trie's walk makes per node)
        node["pure"] = torch.tensor(node["pure"], dtype=torch.long) if node["pure"] else None
        node["rest"] = torch.tensor(node["rest"], dtype=torch.long) if node["rest"] else None
        for child in node["children"].values():
            self.freeze(child)


@functools.lru_cache(maxsize=4)
def number_tokens(vocab):
    """The NumberTokens of a vocabulary (agent/grammar.py's Vocabulary: .bytes, .size), built once."""
    return NumberTokens(vocab)


def word_value(word):
    """The value of a single Spanish number word ("quince" 15, "mil" 1000), or None."""
    if word in SCALES:
        return Decimal(SCALES[word])
    value, used = grounding.read_words([word], 0)
    return value if used == 1 and value is not None and value == int(value) else None


def forms_of(value):
    """The ways an answer may write a number: the calculator's forms ("1250", "1250,5") and Spanish
    thousands ("1.250", "1.250,5"), cents kept ("7,50")."""
    forms = set(expression.number_forms(value))
    whole, _, fraction = format(value.normalize(), "f").partition(".")
    sign = "-" if whole.startswith("-") else ""
    whole = whole.lstrip("-")
    if len(whole) > 3:
        grouped = f"{int(whole):,}".replace(",", ".")
        forms.add(sign + grouped + ("," + fraction if fraction else ""))
    if fraction and len(fraction) == 1:
        forms |= {form + "0" for form in list(forms) if "," in form}
    return {form.lstrip("-") for form in forms}


def told_numbers(messages, settings):
    """The values an answer may state: the latest tool results' numbers first, then the user turns', then
    the system turn's, bounded by answers.max_candidates, and answers.numbers."""
    answers = settings["answers"]
    texts = []
    for message in reversed(messages):
        content = message.get("content")
        if not isinstance(content, str) or message.get("role") not in ("tool", "user", "system"):
            continue
        if message["role"] == "tool" and content.startswith("Error:"):
            continue  # a failed tool computed nothing
        rank = {"tool": 0, "user": 1, "system": 2}[message["role"]]
        texts.append((rank, content))
    values = []
    for _, text in sorted(texts, key=lambda item: item[0]):
        for value in grounding.spoken_numbers(text):
            if value not in values:
                values.append(value)
    values = values[: answers["max_candidates"]]
    return values + [Decimal(n) for n in answers["numbers"] if Decimal(n) not in values]


class AnswerGuard:
    """mask(logits) / accept(token) over an answer's free text: its numbers only those told (see the
    module docstring)."""

    def __init__(self, vocab, values):
        self.vocab, self.run, self.masks, self.rests = vocab, "", {}, {}
        self.tokens = number_tokens(vocab)
        self.forms = set().union(*(forms_of(value) for value in values)) if values else set()
        self.prefixes = {form[:size] for form in self.forms for size in range(1, len(form) + 1)}
        allowed = set(values)
        biggest = max(values, default=0)
        self.banned_words = torch.tensor([index for index, word, value in self.tokens.words
                                          if value not in allowed and not (word in SCALES and biggest >= value)],
                                         dtype=torch.long)  # fmt: skip
        # which of the vocabulary's number strings are whole or open for these forms: looked up from the
        # forms' side (a few per form), then every row's rest checked at once
        ids, count = self.tokens.string_ids, len(self.tokens.strings)
        whole, opened = torch.zeros(count, dtype=torch.bool), torch.zeros(count, dtype=torch.bool)
        whole[0] = opened[0] = True  # the empty string: no number
        for form in self.forms:
            for text in (form, form + ".", form + ","):
                if text in ids:
                    whole[ids[text]] = opened[ids[text]] = True
        for prefix in self.prefixes:
            if prefix in ids:
                opened[ids[prefix]] = True
        rows = self.tokens
        self.rest_ok = (
            whole[rows.closing].all(dim=1) & opened[rows.final] if len(rows.final) else rows.final.bool()
        )

    def whole(self, run):
        return run.rstrip(".,") in self.forms

    def open(self, run):
        return run in self.prefixes or (run[-1] in ".," and run[:-1] in self.forms)

    def after(self, run, text):
        """The run after writing text, or None where the text writes a number not told: the rule the masks
        follow, token by token (choice computes it for every token at once)."""
        for ch in text:
            if extends(run, ch):
                run += ch
            else:
                if run and not self.whole(run):
                    return None
                run = ""
        return run if not run or self.open(run) else None

    def allowed_after(self, run):
        """The tokens that may follow this run (of those writing a digit or a mark), as a list of id tensors:
        a walk of the trie of leads that follows only runs that stay open."""
        found = []

        def visit(node, state, root=False):
            if not root and node["pure"] is not None:  # the token's text is this lead: its run stays open
                found.append(node["pure"])
            if node["rest"] is not None and (
                not state or self.whole(state)
            ):  # it ends the run, then its rest
                found.append(self.rest_tokens(node))
            for ch, child in node["children"].items():
                if extends(state, ch):
                    if self.open(state + ch):
                        visit(child, state + ch)
                elif not state or self.whole(state):
                    visit(child, "")

        visit(self.tokens.trie, run, root=True)
        return found

    def rest_tokens(self, node):
        """The tokens of a trie node whose rest writes only numbers told (cached per node for this answer)."""
        key = id(node)
        if key not in self.rests:
            rows = node["rest"]
            self.rests[key] = self.tokens.row_tokens[rows[self.rest_ok[rows]]]
        return self.rests[key]

    def choice(self):
        """("only", the tokens allowed) while a number is not yet whole (None: never an empty choice), else
        ("ban", the tokens that would write a number not told, or a number word not told): id tensors, a few
        thousand at most of a 32,000-token vocabulary (index_fill of ids costs a third of a masked_fill)."""
        found = self.allowed_after(self.run)
        if self.run and not self.whole(self.run):  # only digits (or a mark) that keep it told may follow
            return "only", torch.cat(found) if found else None
        allowed = torch.zeros(self.tokens.size, dtype=torch.bool)
        for ids in found:
            allowed[ids] = True
        relevant = self.tokens.relevant_ids
        return "ban", torch.cat([relevant[~allowed[relevant]], self.banned_words])

    def mask(self, logits):
        if self.run not in self.masks:
            if len(self.masks) > 256:
                self.masks.clear()
            kind, ids = self.choice()
            self.masks[self.run] = kind, None if ids is None else ids[ids < logits.shape[0]].to(logits.device)
        kind, ids = self.masks[self.run]
        if ids is None or not len(ids):
            return logits
        if kind == "ban":
            return logits.index_fill(0, ids, float("-inf"))
        out = torch.full_like(logits, float("-inf"))
        out[ids] = logits[ids]
        return out

    def accept(self, token):
        text = self.vocab.bytes[token].decode("utf-8", "replace") if token < len(self.vocab.bytes) else ""
        run = self.run
        for ch in text:
            run = run + ch if extends(run, ch) else ""
        self.run = run


def guard_for(vocab, messages, settings):
    """The AnswerGuard of a reply to these messages: with answers.grounding "constrained" and a tool result
    after the latest user turn; else None."""
    if settings["answers"]["grounding"] != "constrained" or not messages:
        return None
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    if not any(m.get("role") == "tool" for m in messages[last_user + 1 :]):
        return None
    return AnswerGuard(vocab, told_numbers(messages, settings))
