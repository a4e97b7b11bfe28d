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
allowed is masked ("un", "una", "uno" stay: articles). A word split over several tokens is not seen.
Ordinals ("primero", "2.º") are not cardinals and stay free. The masks are cached per run written, so the
cost per token is a dictionary look-up and an index_fill (make bench ARGS=answers measures it).
"""

import functools
import re
from decimal import Decimal

import torch

from agent import expression, grounding

ARTICLES = {"un", "una", "uno"}
NUMBER_HEAD = re.compile(r"[\d.,]*")
SCALES = {"cien": 100, "ciento": 100, "mil": 1000, "millon": 1000000, "millones": 1000000}


@functools.lru_cache(maxsize=4)
def number_tokens(vocab):
    """(the tokens whose text starts with a digit or a mark, grouped by what they write of a number:
    [(text, indices)]; tokens holding a digit anywhere, with their text; number-word tokens with their word
    and value) of a vocabulary (agent/grammar.py's Vocabulary: .bytes, .size)."""
    groups, digits, words = {}, [], []
    for index, raw in enumerate(vocab.bytes):
        text = raw.decode("utf-8", "replace")
        if not text:
            continue
        if text[0].isdigit() or text[0] in ".,":
            # tokens that write the same number chars and then no digit act alike on a run: "." and ".\n"
            head = NUMBER_HEAD.match(text).group()
            rest = text[len(head) :]
            key = (head + " ") if rest and not any(ch.isdigit() for ch in rest) else text
            groups.setdefault(key, []).append(index)
        if any(ch.isdigit() for ch in text):
            digits.append((index, text))
        word = grounding.plain(text.strip())
        if word and word not in ARTICLES:
            value = word_value(word)
            if value is not None:
                words.append((index, word, value))
    return list(groups.items()), digits, words


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
        self.vocab, self.run, self.masks = vocab, "", {}
        self.continuing, self.digits, words = number_tokens(vocab)
        self.forms = set().union(*(forms_of(value) for value in values)) if values else set()
        self.prefixes = {form[:size] for form in self.forms for size in range(1, len(form) + 1)}
        allowed = set(values)
        biggest = max(values, default=0)
        self.banned_words = [index for index, word, value in words
                             if value not in allowed and not (word in SCALES and biggest >= value)]  # fmt: skip

    def whole(self, run):
        return run.rstrip(".,") in self.forms

    def open(self, run):
        return run in self.prefixes or (run[-1] in ".," and run[:-1] in self.forms)

    def after(self, run, text):
        """The run after writing text, or None where the text writes a number not told."""
        for ch in text:
            if ch.isdigit() or (ch in ".," and run and run[-1].isdigit()):
                run += ch
            else:
                if run and not self.whole(run):
                    return None
                run = ""
        return run if not run or self.open(run) else None

    def choice(self):
        """("only", the tokens allowed) while a number is not yet whole, else ("ban", the tokens that would
        write a number not told): index lists, a few hundred at most of a 32,000-token vocabulary."""
        if self.run and not self.whole(self.run):  # only digits (or a mark) may follow
            return "only", [index for text, group in self.continuing if self.after(self.run, text) is not None
                             for index in group]  # fmt: skip
        if self.run:
            banned = [index for text, group in self.continuing if self.after(self.run, text) is None
                      for index in group]  # fmt: skip
        else:
            banned = [index for index, text in self.digits if self.after(self.run, text) is None]
        return "ban", banned + self.banned_words

    def mask(self, logits):
        if self.run not in self.masks:
            if len(self.masks) > 256:
                self.masks.clear()
            kind, indices = self.choice()
            self.masks[self.run] = kind, torch.tensor(indices, dtype=torch.long, device=logits.device)
        kind, indices = self.masks[self.run]
        if kind == "ban":
            return logits.index_fill(0, indices, float("-inf")) if len(indices) else logits
        if not len(indices):  # never an empty choice
            return logits
        out = torch.full_like(logits, float("-inf"))
        out[indices] = logits[indices]
        return out

    def accept(self, token):
        text = self.vocab.bytes[token].decode("utf-8", "replace") if token < len(self.vocab.bytes) else ""
        run = self.run
        for ch in text:
            run = run + ch if ch.isdigit() or (ch in ".," and run and run[-1].isdigit()) else ""
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
