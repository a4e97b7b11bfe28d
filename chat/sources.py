"""
The conversation sources of data.chat.mixture, each `kind` read into (where, conversation) pairs; a row that
cannot become a conversation is counted by reason (the report shows them), never a traceback.

    oasst_trees    OpenAssistant's message trees (OASST2's 2023-11-05_oasst2_ready.trees.jsonl.gz: one tree a
                   line, {"message_tree_id", "prompt": {"message_id", "parent_id", "role": "prompter" |
                   "assistant", "lang", "text", "rank", "deleted", "review_result", "replies": [...]}}): the
                   trees whose prompt has the source's `lang`, walked into conversations, the best-ranked
                   branch (branches: best) or every branch whose replies' ranks are within max_rank (ranked)
    single_turn    one row, one user turn and one assistant turn (Aya: parquet with inputs, targets,
                   language, language_code): the columns `fields` names, the rows whose `select` columns match
    conversations  conversation JSONL files of this project (the tool conversations, the family seed set)

Files of a source with `hub` are those `python -m chat download CONFIG` fetched and verified (corpus/hub.py's
record in hub.local_dir); a file changed since, or never fetched, is an error saying to run it.
"""

import fnmatch
import glob
import json
import os
import zlib

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

import data
from chat import convert, template
from corpus import hub, sources

EXAMPLES = 3  # bad rows named per reason in the report


class BadRows:
    """Rows left out of one source, counted by reason, with the first few named."""

    def __init__(self):
        self.counts, self.examples = {}, {}

    def add(self, reason, where, count=1):
        self.counts[reason] = self.counts.get(reason, 0) + count
        examples = self.examples.setdefault(reason, [])
        if len(examples) < EXAMPLES:
            examples.append(where)


def label(index, source):
    return f"data.chat.mixture.sources[{index}] ({source['name']})"


def source_files(index, source):
    """The files a source reads: its `path` glob, or the files of its Hub dataset that the download verified."""
    what = label(index, source)
    if "hub" not in source:
        pattern = source["path"]
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        matches = [path for path in matches if os.path.isfile(path)]
        if not matches:
            raise template.ChatError(f"{what}.path: {pattern!r} matches no file")
        return matches
    local_dir = source["hub"]["local_dir"]
    fetch = "; fetch it with `python -m chat download CONFIG`"
    try:
        record = hub.read_record(local_dir)
    except data.DataError as e:
        raise template.ChatError(f"{what}: {e}") from None
    fetched = record.get("sources", {}).get(source["name"])
    if fetched is None or fetched["repo"] != source["hub"]["repo"]:
        raise template.ChatError(f"{what}: {source['hub']['repo']} is not downloaded into {local_dir}{fetch}")
    if fetched["revision"] != source["hub"]["revision"] or not all(
        fnmatch.fnmatchcase(name, source["hub"]["files"]) for name in fetched["files"]
    ):
        raise template.ChatError(
            f"{what}: {local_dir} holds {fetched['repo']}@{fetched['revision']} {fetched['files']}, not what "
            f"hub.revision and hub.files ask for now{fetch} again"
        )
    paths = []
    for name in fetched["files"]:
        path = os.path.join(local_dir, name)
        seen = record["files"].get(name)
        if (
            seen is None
            or not os.path.isfile(path)
            or seen["size"] != os.path.getsize(path)
            or seen["mtime_ns"] != os.stat(path).st_mtime_ns
        ):
            raise template.ChatError(f"{what}: {path} is missing or changed since its download{fetch} again")
        paths.append(path)
    return paths


def read_source(index, source):
    """([(where, conversation)], BadRows) of one source, in file order."""
    rows = BadRows()
    found = []
    for path in source_files(index, source):
        try:
            found += READERS[source["kind"]](path, source, rows)
        except (OSError, EOFError, zlib.error) as e:  # a damaged file, not a bug of ours
            raise template.ChatError(f"{label(index, source)}: {path}: unreadable ({e})") from None
    return found, rows


# -----------------------------------------------------------------------------
# OpenAssistant message trees


def ranked_replies(message, source):
    """The replies a branch may follow (branches: ranked): not deleted, not rejected by review, and ranked
    within max_rank (rank 0 is the best), or a lone unranked reply."""
    replies = [
        reply
        for reply in message.get("replies") or []
        if isinstance(reply, dict) and not reply.get("deleted") and reply.get("review_result") is not False
    ]
    if len(replies) < 2:
        return replies
    return [r for r in replies if isinstance(r.get("rank"), int) and r["rank"] <= source["max_rank"]]


def branches(root, source):
    """Lists of messages from the root, one per branch the source's `branches` takes: convert.best_thread's
    one (best), or every branch of ranked replies (ranked)."""
    if source["branches"] == "best":
        return [convert.best_thread(root, lambda message: message.get("replies") or [])]
    threads, pending = [], [[root]]
    while pending:
        thread = pending.pop()
        replies = ranked_replies(thread[-1], source)
        if not replies:
            threads.append(thread)
        pending += [thread + [reply] for reply in reversed(replies)]
    return threads


def conversation_of(thread, source):
    """The conversation of a branch cut after its last assistant message (None when it has none); raises
    ChatError naming the reason key of a message it cannot take."""
    roles, field = source["roles"], source["text_field"]
    for message in thread:
        if message.get("role") not in roles:
            raise template.ChatError("unknown_role")
        text = message.get(field)
        if not isinstance(text, str):
            raise template.ChatError("missing_field")
        if not text.strip():
            raise template.ChatError("empty_turn")
    while thread and roles[thread[-1]["role"]] != "assistant":
        thread = thread[:-1]
    messages = [{"role": roles[message["role"]], "content": message[field]} for message in thread]
    return {"messages": messages} if messages else None


def read_oasst_trees(path, source, rows):
    found = []
    with sources.open_input(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                tree = json.loads(line)
            except ValueError:
                rows.add("not_json", where)
                continue
            root = tree.get("prompt") if isinstance(tree, dict) else None
            if not isinstance(root, dict):
                rows.add("missing_field", where)
                continue
            if root.get("lang") != source["lang"] or root.get("deleted"):
                rows.add("other_language" if root.get("lang") != source["lang"] else "deleted", where)
                continue
            seen = set()
            for number_in_tree, thread in enumerate(branches(root, source)):
                try:
                    conversation = conversation_of(thread, source)
                except template.ChatError as e:
                    rows.add(str(e), where)
                    break
                if conversation is None:
                    rows.add("no_answer", where)
                    continue
                key = json.dumps(conversation, sort_keys=True)
                if key in seen:  # branches ending on a prompter share their answered prefix
                    continue
                seen.add(key)
                found.append((f"{where} branch {number_in_tree}", conversation))
    return found


# -----------------------------------------------------------------------------
# Single-turn rows (Aya) and this project's conversation files


def read_single_turn(path, source, rows):
    """The rows whose `select` columns match (chosen by pyarrow: Aya's 200,000 rows never become Python
    objects, only the few thousand kept), each one user turn and one assistant turn."""
    fields, select = source["fields"], source.get("select", {})
    columns = [fields["user"], fields["assistant"], *select]
    try:
        table = pq.read_table(path, columns=columns)
    except (KeyError, ValueError) as e:  # pyarrow: a missing column, or not a parquet file
        raise template.ChatError(f"{path}: cannot read the columns {columns} ({e})") from None
    chosen = pa.array([True] * table.num_rows)
    for key, value in select.items():
        chosen = pc.and_(chosen, pc.fill_null(pc.equal(table[key], value), False))
    numbers = pc.indices_nonzero(chosen).to_pylist()
    if len(numbers) < table.num_rows:
        rows.add(
            "not_selected", f"{path}: {table.num_rows - len(numbers):,} rows", table.num_rows - len(numbers)
        )
    found = []
    for number, row in zip(numbers, table.take(pa.array(numbers, pa.int64())).to_pylist(), strict=True):
        where = f"{path}: row {number}"
        user, assistant = row.get(fields["user"]), row.get(fields["assistant"])
        if not isinstance(user, str) or not isinstance(assistant, str):
            rows.add("missing_field", where)
        elif not user.strip() or not assistant.strip():
            rows.add("empty_turn", where)
        else:
            messages = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
            found.append((where, {"messages": messages}))
    return found


def read_conversation_file(path, source, rows):
    found, _ = template.read_jsonl(
        path, template.training_problems, "skip", log=lambda line: rows.add("bad_conversation", line)
    )
    return [(where, {key: value for key, value in c.items() if key != "source"}) for where, c in found]


READERS = {
    "oasst_trees": read_oasst_trees,
    "single_turn": read_single_turn,
    "conversations": read_conversation_file,
}
