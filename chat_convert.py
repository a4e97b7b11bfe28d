"""
Records of public data sets in other shapes -> chat.py's conversations (the importers of `python chat.py
import --from ...`). Pure conversion of already-read records, no files and no template: chat.py reads the
files, checks what comes out against the conversation schema and writes the JSONL.

Each converter takes (where, record) pairs and yields (where, conversation) or (where, RecordError) for a
record it cannot convert, so that the caller reports or skips it.
"""


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


IMPORTERS = {"alpaca": from_alpaca, "sharegpt": from_sharegpt, "oasst": from_oasst}
