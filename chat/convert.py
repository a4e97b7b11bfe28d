"""
Records in other shapes -> chat/template.py's conversations and preference pairs: the importers of `python -m chat
import --from ...` (public conversation sets: alpaca, sharegpt, oasst; public preference sets: TRL's
preference formats) and the pairs `python -m chat seed-pairs` makes from conversations. Pure conversion of
already-read records, no files and no template: chat/prepare.py reads the files, checks what comes out against the
schemas and writes the JSONL.

Each importer takes (where, record) pairs and yields (where, conversation or pair) or (where, RecordError)
for a record it cannot convert, so that the caller reports or skips it.
"""

import random
import re


class RecordError(Exception):
    """A record that cannot be converted; the message says which field and why."""


def field(record, key):
    value = record.get(key) if isinstance(record, dict) else None
    if not isinstance(value, str):
        raise RecordError(f"missing or non-text field {key!r}")
    return value


def from_alpaca(records, source):
    """{"instruction", "input"?, "output", "system"?} -> system?, user (instruction + input), assistant."""
    for where, record in records:
        try:
            user = field(record, "instruction").strip()
            if record.get("input"):
                user += "\n\n" + field(record, "input").strip()
            messages = [
                {"role": "user", "content": user},
                {"role": "assistant", "content": field(record, "output")},
            ]
            if record.get("system"):
                messages.insert(0, {"role": "system", "content": field(record, "system")})
            yield where, {"messages": messages, "source": source}
        except RecordError as e:
            yield where, e


SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
}


def from_sharegpt(records, source):
    """{"conversations": [{"from": "human" | "gpt" | "system" ..., "value": ...}], "system"?}."""
    for where, record in records:
        turns = record.get("conversations") if isinstance(record, dict) else None
        if not isinstance(turns, list):
            yield where, RecordError("missing list 'conversations'")
            continue
        messages = [{"role": "system", "content": record["system"]}] if record.get("system") else []
        try:
            for number, turn in enumerate(turns):
                speaker = turn.get("from") if isinstance(turn, dict) else None
                if speaker not in SHAREGPT_ROLES:
                    raise RecordError(
                        f"conversations.{number}: unknown speaker {speaker!r}; known: {', '.join(SHAREGPT_ROLES)}"
                    )
                messages.append({"role": SHAREGPT_ROLES[speaker], "content": field(turn, "value")})
        except RecordError as e:
            yield where, e
            continue
        yield where, {"messages": messages, "source": source}


def best_thread(root, replies_of):
    """The thread from root following, at each message, its best-ranked reply (rank 0 is best; unranked
    replies come after ranked ones, ties keep the file's order); deleted messages are never followed."""
    thread, node = [root], root
    while True:
        replies = [
            r for r in replies_of(node) if not r.get("deleted") and r.get("review_result") is not False
        ]
        if not replies:
            return thread
        ranked = sorted(
            enumerate(replies),
            key=lambda item: (item[1].get("rank") is None, item[1].get("rank") or 0, item[0]),
        )
        node = ranked[0][1]
        thread.append(node)


def from_oasst(records, source, lang=None):
    """OpenAssistant message trees -> the highest-ranked thread of each root. Reads both exports: trees
    (one tree per line, {"prompt": {..., "replies": [...]}}) and flat messages (one message per line with
    message_id / parent_id)."""
    records = list(records)
    trees, children, roots = [], {}, []
    for where, record in records:
        if not isinstance(record, dict):
            yield where, RecordError(f"expected a JSON object, got {type(record).__name__}")
        elif isinstance(record.get("prompt"), dict):
            trees.append((where, record["prompt"]))
        elif "message_id" in record:
            if record.get("parent_id") is None:
                roots.append((where, record))
            else:
                children.setdefault(record["parent_id"], []).append(record)
        else:
            yield where, RecordError("neither a message tree ({'prompt': ...}) nor a message (message_id)")
    roles = {"prompter": "user", "assistant": "assistant"}
    for where, root, replies_of in [(w, r, lambda m: m.get("replies") or []) for w, r in trees] + [
        (w, r, lambda m: children.get(m["message_id"], [])) for w, r in roots
    ]:
        if root.get("deleted") or (lang and root.get("lang") != lang):
            continue
        thread = best_thread(root, replies_of)
        while thread and thread[-1].get("role") != "assistant":
            thread.pop()  # a thread ends with an answer
        if not thread:
            continue
        try:
            messages = []
            for message in thread:
                if message.get("role") not in roles:
                    raise RecordError(
                        f"unknown OASST role {message.get('role')!r}; known: prompter, assistant"
                    )
                messages.append({"role": roles[message["role"]], "content": field(message, "text")})
        except RecordError as e:
            yield where, e
            continue
        yield where, {"messages": messages, "source": source}


def messages_of(value, what):
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise RecordError(f"{what}: expected a list of messages")
    return [dict(m) for m in value]


def from_preference(records, source):
    """TRL's preference formats -> the explicit conversational one (chat/template.py's preference pairs):
      - {"prompt": [messages], "chosen": [messages], "rejected": [messages]}: kept (answers that repeat the
        prompt's messages first lose them);
      - {"prompt": "text", "chosen": "text", "rejected": "text"} (standard): a user turn and two answers;
      - {"chosen": [messages], "rejected": [messages]} (implicit prompt), also with a "prompt" text beside
        them (UltraFeedback's layout): the prompt is the messages both share, up to the last one before
        the answers (an assistant message).
    "tools" is kept; other fields are dropped."""
    for where, record in records:
        try:
            if not isinstance(record, dict):
                raise RecordError(f"expected a JSON object, got {type(record).__name__}")
            chosen, rejected, prompt = record.get("chosen"), record.get("rejected"), record.get("prompt")
            if isinstance(chosen, str) and isinstance(rejected, str):
                if not isinstance(prompt, str):
                    raise RecordError("standard format: 'prompt' must be text like 'chosen' and 'rejected'")
                prompt = [{"role": "user", "content": prompt}]
                chosen = [{"role": "assistant", "content": chosen}]
                rejected = [{"role": "assistant", "content": rejected}]
            else:
                chosen, rejected = messages_of(chosen, "chosen"), messages_of(rejected, "rejected")
                if isinstance(prompt, list):
                    prompt = messages_of(prompt, "prompt")
                    for side in (chosen, rejected):  # answers that repeat the prompt first
                        if side[: len(prompt)] == prompt:
                            del side[: len(prompt)]
                else:  # implicit prompt: what both share, ending before an assistant message
                    shared = 0
                    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
                        shared += 1
                    while shared and chosen[shared - 1].get("role") == "assistant":
                        shared -= 1
                    if shared == 0:
                        raise RecordError(
                            "no 'prompt', and 'chosen' and 'rejected' share no opening messages"
                        )
                    prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
            pair = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
            if "tools" in record:
                pair["tools"] = record["tools"]
            yield where, pair | {"source": source}
        except RecordError as e:
            yield where, e


IMPORTERS = {
    "alpaca": from_alpaca,
    "sharegpt": from_sharegpt,
    "oasst": from_oasst,
    "preference": from_preference,
}


# -----------------------------------------------------------------------------
# Pairs made from conversations (python -m chat seed-pairs): the DPO demonstration's data

# A sentence that sends the reader to a health or legal professional or service (the seed set's health
# and legal answers all end with one).
REFERRAL = re.compile(
    r"médic|pediatra|farmac|enfermer|urgencias|\b(112|911|123|024)\b|profesional|especialista|dentista|"
    r"psicólog|toxicológ|centro de salud|hospital|abogad|notari|gestor|oficina de (consumo|vivienda)|asociación de|web oficial",
    re.IGNORECASE,
)
SENTENCE_END = re.compile(r"(?<=[.!?…:])\s+")


def without_referrals(text):
    """The text with every sentence (or list item) that matches REFERRAL removed."""
    lines = []
    for line in text.split("\n"):
        kept = [sentence for sentence in SENTENCE_END.split(line) if not REFERRAL.search(sentence)]
        if kept or not line.strip():
            lines.append(" ".join(kept))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def truncated(text):
    """The text cut at the end of the sentence (or line) closest to its middle, or at the word closest to
    it when it has no such end before."""
    ends = [m.start() for m in SENTENCE_END.finditer(text) if m.start() < len(text) - 1]
    if not ends:
        ends = [m.start() for m in re.finditer(r" ", text)] or [len(text) // 2]
    return text[: min(ends, key=lambda at: abs(at - len(text) / 2))].rstrip()


def seed_pairs(conversations, seed):
    """Preference pairs from (where, conversation) pairs whose last message is the assistant's answer: the
    answer is chosen, and each of these worse answers is rejected in a pair of its own: the answer cut to
    its first half (truncated); the answer of another conversation, drawn with random.Random(seed)
    (another conversation's); the answer without its sentences that refer to a health or legal
    professional or service, when it has some (referral removed)."""
    rng = random.Random(seed)
    pairs = []
    for index, (where, conversation) in enumerate(conversations):
        messages = conversation["messages"]
        if messages[-1]["role"] != "assistant" or messages[-1].get("tool_calls") or len(conversations) < 2:
            continue
        prompt, answer = messages[:-1], messages[-1]["content"]
        other = rng.choice([i for i in range(len(conversations)) if i != index])
        worse = {
            "truncated": truncated(answer),
            "other-answer": conversations[other][1]["messages"][-1]["content"],
            "referral-removed": without_referrals(answer),
        }
        for kind, text in worse.items():
            if text and text != answer:
                pairs.append(
                    {
                        "prompt": prompt,
                        "chosen": [{"role": "assistant", "content": answer}],
                        "rejected": [{"role": "assistant", "content": text}],
                        "source": f"seed-pairs:{kind}:{where}",
                    }
                )
    return pairs
