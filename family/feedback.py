"""
The family's ratings of the assistant's answers, and each member's consent to train on them.

Two tables in the server's SQLite database, beside the conversations (accounts.Store creates them):

    feedback(id, member_id, conversation_id, message_index, prompt, answer, rating, better, created, updated)
        one row per rated answer: 1 (👍) or -1 (👎), and optionally the answer the member wanted instead
        (better). prompt (the conversation's messages before the answer, as JSON) and answer are copied
        when the rating is given: messages never change, and a pair needs them as they were.
    training_consent(member_id, granted, set_by, updated)
        "usar mis valoraciones para entrenar": off unless a row says granted = 1.

Who may do what (every function here takes the calling member and enforces it):
  - a member rates, lists, exports and deletes only their own feedback; another member's, the admin
    included, is reported as not existing. Deleting a conversation or an account deletes its feedback
    (foreign keys), and deleted text is overwritten (secure_delete) and leaves the WAL.
  - an adult (or the admin) sets their own consent; a child's is set by an adult or the admin of the
    family, never by the child;
  - training reads only the feedback of members whose consent is on when it reads (training_records):
    turning consent off withdraws what was given before, turning it on includes it.

preference_pairs() turns those records into DPO pairs: an answer with a better version gives (better,
original); a 👎 answer and a 👍 answer of the same member to the same prompt give a pair; a lone 👎 without
a better answer is counted, never made into a pair. `python -m chat preferences --db DB OUT.jsonl` writes
them. No torch, no HTTP: serve/web.py's routes and chat/prepare.py call these functions.
"""

import json
import time

RATINGS = (1, -1)
ADULT_ROLES = ("adult", "admin")

SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS feedback (
    id INTEGER PRIMARY KEY,
    member_id INTEGER NOT NULL REFERENCES members(id) ON DELETE CASCADE,
    conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    message_index INTEGER NOT NULL,
    prompt TEXT NOT NULL,
    answer TEXT NOT NULL,
    rating INTEGER NOT NULL CHECK (rating IN (1, -1)),
    better TEXT,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    UNIQUE (conversation_id, message_index));
CREATE INDEX IF NOT EXISTS feedback_of_member ON feedback(member_id, conversation_id);
CREATE TABLE IF NOT EXISTS training_consent (
    member_id INTEGER PRIMARY KEY REFERENCES members(id) ON DELETE CASCADE,
    granted INTEGER NOT NULL CHECK (granted IN (0, 1)),
    set_by TEXT NOT NULL,
    updated REAL NOT NULL);
"""


class FeedbackError(Exception):
    """Bad feedback (the message names the field and what would be right)."""


class FeedbackNotFound(FeedbackError):
    """Not there, or not the caller's: the same answer, so ids do not leak what others keep."""


class ConsentForbidden(FeedbackError):
    """A consent the caller may not change."""


def ensure_schema(conn):
    conn.executescript(SCHEMA_SQL)


def as_dict(row):
    return {
        "id": row["id"],
        "conversation_id": row["conversation_id"],
        "message_index": row["message_index"],
        "prompt": json.loads(row["prompt"]),
        "answer": row["answer"],
        "rating": row["rating"],
        "better": row["better"],
        "created": row["created"],
        "updated": row["updated"],
    }


# -----------------------------------------------------------------------------
# A member's own feedback (the caller is always the owner: member_id is theirs)


def rate(conn, member_id, conversation_id, message_index, prompt, answer, rating, better=None):
    """Store (or replace) the member's rating of one answer of their conversation. prompt: the messages
    before it [{"role", "content"}]; the caller (serve/web.py) has checked that the conversation is
    theirs and that message_index is an assistant answer. Returns the stored feedback."""
    if rating not in RATINGS or isinstance(rating, bool):
        raise FeedbackError(f"rating: {rating!r}; expected 1 (👍) or -1 (👎)")
    if better is not None and (not isinstance(better, str) or not better.strip()):
        raise FeedbackError("better: expected the text of the answer you wanted, or no 'better' at all")
    if better is not None and better.strip() == answer.strip():
        raise FeedbackError("better: the same as the answer; write the answer you wanted instead")
    now = time.time()
    with conn:
        conn.execute(
            "INSERT INTO feedback (member_id, conversation_id, message_index, prompt, answer, rating, better, "
            "created, updated) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (conversation_id, message_index) "
            "DO UPDATE SET rating = excluded.rating, better = excluded.better, updated = excluded.updated "
            "WHERE feedback.member_id = excluded.member_id",
            (member_id, conversation_id, message_index, json.dumps(prompt, ensure_ascii=False), answer,
             rating, better, now, now),
        )  # fmt: skip
    return of_message(conn, member_id, conversation_id, message_index)


def of_message(conn, member_id, conversation_id, message_index):
    rows = conn.execute(
        "SELECT * FROM feedback WHERE member_id = ? AND conversation_id = ? AND message_index = ?",
        (member_id, conversation_id, message_index),
    ).fetchall()
    if not rows:
        raise FeedbackNotFound(f"no feedback of yours on message {message_index} of {conversation_id!r}")
    return as_dict(rows[0])


def list_feedback(conn, member_id, conversation_id=None):
    """The member's feedback, newest first (of one conversation, in message order, when given)."""
    if conversation_id is None:
        rows = conn.execute(
            "SELECT * FROM feedback WHERE member_id = ? ORDER BY updated DESC, id DESC", (member_id,)
        )
    else:
        rows = conn.execute(
            "SELECT * FROM feedback WHERE member_id = ? AND conversation_id = ? ORDER BY message_index",
            (member_id, conversation_id),
        )
    return [as_dict(row) for row in rows]


def remove(conn, member_id, feedback_id):
    """Delete one of the member's feedback; returns its id."""
    conn.execute("PRAGMA secure_delete = ON")
    with conn:
        count = conn.execute(
            "DELETE FROM feedback WHERE id = ? AND member_id = ?", (feedback_id, member_id)
        ).rowcount
    if not count:
        raise FeedbackNotFound(f"no feedback {feedback_id} of yours")
    purge(conn)
    return feedback_id


def remove_of_message(conn, member_id, conversation_id, message_index):
    """Withdraw the member's rating of one answer; returns the id it had."""
    feedback_id = of_message(conn, member_id, conversation_id, message_index)["id"]
    return remove(conn, member_id, feedback_id)


def remove_all(conn, member_id):
    """Delete all of the member's feedback; returns how many."""
    conn.execute("PRAGMA secure_delete = ON")
    with conn:
        count = conn.execute("DELETE FROM feedback WHERE member_id = ?", (member_id,)).rowcount
    purge(conn)
    return count


def purge(conn):
    """Deleted text unrecoverable: freed pages are zeroed (secure_delete, on before every delete) and the
    WAL that still holds the old pages is emptied. The checkpoint cannot complete while another connection
    reads; the next purge finishes it."""
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()


def export(conn, member):
    """The member's feedback and consent, as a JSON-ready dict (what "Exportar" downloads)."""
    return {
        "member": member["name"],
        "exported": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "consent": consent(conn, member["id"]),
        "feedback": list_feedback(conn, member["id"]),
    }


# -----------------------------------------------------------------------------
# Consent


def consent(conn, member_id):
    """{"granted": bool, "set_by": name or None, "updated": time or None}; off until someone sets it."""
    rows = conn.execute("SELECT * FROM training_consent WHERE member_id = ?", (member_id,)).fetchall()
    if not rows:
        return {"granted": False, "set_by": None, "updated": None}
    return {"granted": bool(rows[0]["granted"]), "set_by": rows[0]["set_by"], "updated": rows[0]["updated"]}


def may_set_consent(actor, target):
    """Why `actor` may not set `target`'s consent (None when they may): members are {"id", "name", "role"}."""
    if actor["role"] not in ADULT_ROLES:
        return "a child's consent is set by an adult of the family"
    if target["id"] != actor["id"] and target["role"] != "child":
        return f"only {target['name']} sets their own consent"
    return None


def set_consent(conn, actor, target, granted):
    """actor sets target's consent (themselves, or a child of the family when actor is an adult)."""
    if not isinstance(granted, bool):
        raise FeedbackError(f"granted: {granted!r}; expected true or false")
    refusal = may_set_consent(actor, target)
    if refusal:
        raise ConsentForbidden(refusal)
    with conn:
        conn.execute(
            "INSERT INTO training_consent (member_id, granted, set_by, updated) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (member_id) DO UPDATE SET granted = excluded.granted, set_by = excluded.set_by, "
            "updated = excluded.updated",
            (target["id"], int(granted), actor["name"], time.time()),
        )
    return consent(conn, target["id"])


# -----------------------------------------------------------------------------
# Training: consented feedback -> preference pairs


def training_records(conn):
    """The feedback of every member whose consent is on now, oldest first; nobody else's."""
    rows = conn.execute(
        "SELECT f.* FROM feedback f JOIN training_consent c ON c.member_id = f.member_id "
        "WHERE c.granted = 1 ORDER BY f.id"
    )
    return [as_dict(row) | {"member_id": row["member_id"]} for row in rows]


def unconsented_count(conn):
    """How many ratings are left out because their member's consent is off."""
    sql = (
        "SELECT COUNT(*) FROM feedback f LEFT JOIN training_consent c ON c.member_id = f.member_id "
        "WHERE COALESCE(c.granted, 0) = 0"
    )
    return conn.execute(sql).fetchone()[0]


def preference_pairs(records):
    """(pairs in TRL's conversational preference format, counts) of training_records(): each answer with a
    better version gives (better, answer); each 👎 answer without one is paired with every 👍 answer (not
    an empty one) the same member gave to the same prompt; a 👎 with no such 👍 is counted as lone, 👍
    answers as liked."""
    pairs, counts = [], {"improved": 0, "rated_pairs": 0, "lone_dislikes": 0, "likes": 0}

    def pair(prompt, chosen, rejected, source):
        return {
            "prompt": prompt,
            "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}],
            "source": source,
        }

    liked = {}
    for record in records:
        if record["rating"] == 1:
            key = (record["member_id"], json.dumps(record["prompt"], sort_keys=True))
            liked.setdefault(key, []).append(record["answer"])
            counts["likes"] += 1
    for record in records:
        prompt = [{"role": m["role"], "content": m["content"]} for m in record["prompt"]]
        if record["better"] is not None:
            pairs.append(pair(prompt, record["better"], record["answer"], "feedback:improved"))
            counts["improved"] += 1
        elif record["rating"] == -1:
            key = (record["member_id"], json.dumps(record["prompt"], sort_keys=True))
            # An empty 👍 answer (the model ended at once) is nothing to push towards.
            better = [a for a in liked.get(key, []) if a != record["answer"] and a.strip()]
            pairs += [pair(prompt, answer, record["answer"], "feedback:rated") for answer in better]
            counts["rated_pairs"] += len(better)
            counts["lone_dislikes"] += int(not better)
    return pairs, counts
