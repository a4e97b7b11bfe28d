"""
What the assistant remembers about each family member.

Memories live in the server's SQLite database (WAL) in one table with an FTS5 index kept in sync by
triggers; retrieval is keyword search ranked by bm25 (no embeddings at this stage):

    memories(id, member, scope 'private' | 'family', text, pinned, source 'manual' | 'assistant',
             created, updated)

Who sees what (every function here takes the calling member's name and role and enforces it):
  - a member reads their own private memories and the family's shared ones, never another member's
    private ones (so a child never sees an adult's);
  - adults write, edit and forget family memories; a child writes only private ones;
  - the admin role manages accounts and does not read or write memories at all.
A memory the caller may not see is reported as not existing, so ids do not leak what others keep.
Deleting really deletes: secure_delete overwrites the freed bytes, the FTS index is rebuilt so the deleted
terms leave it, and the WAL is checkpointed and truncated. A memory forgotten through the server
(forget_later: the page, the API, the olvidar tool) leaves every list, search and turn at once and can be
brought back (take_back) for memory.forget_undo_s seconds; then Eraser erases it the same way.

Their command line is family/__main__.py's (python -m family). This module never imports torch.
"""

import dataclasses
import datetime
import os
import re
import sqlite3
import threading
import time

import config

SCOPES = ("private", "family")
SCOPE_WORDS = {"privado": "private", "familia": "family"}  # the tools' Spanish argument values
ROLES = ("admin", "adult", "child")
SOURCES = ("manual", "assistant")
DEFAULT_CONFIG = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "memory", "default.yaml"
)
WORD = re.compile(r"\w+")

TABLE_SQL = """
CREATE TABLE IF NOT EXISTS memories (
    id INTEGER PRIMARY KEY,
    member TEXT NOT NULL COLLATE NOCASE,  -- as the names of serve/app.py's members
    scope TEXT NOT NULL CHECK (scope IN ('private', 'family')),
    text TEXT NOT NULL,
    pinned INTEGER NOT NULL DEFAULT 0 CHECK (pinned IN (0, 1)),
    source TEXT NOT NULL CHECK (source IN ('manual', 'assistant')),
    created TEXT NOT NULL,
    updated TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS memories_by_member ON memories (member, scope);
CREATE INDEX IF NOT EXISTS memories_pinned ON memories (pinned) WHERE pinned = 1;
-- Memories forgotten through the server (forget_later): out of every list, search and turn at once, their
-- text kept here until erase_after (Unix seconds, memory.forget_undo_s later), when erase_due erases it.
CREATE TABLE IF NOT EXISTS forgotten_memories (
    forgotten_id INTEGER PRIMARY KEY,
    memory_id INTEGER NOT NULL,
    member TEXT NOT NULL COLLATE NOCASE,
    scope TEXT NOT NULL,
    text TEXT NOT NULL,
    pinned INTEGER NOT NULL,
    source TEXT NOT NULL,
    created TEXT NOT NULL,
    updated TEXT NOT NULL,
    forgotten_by TEXT NOT NULL COLLATE NOCASE,
    erase_after REAL NOT NULL
);
"""
INDEX_SQL = """
CREATE VIRTUAL TABLE IF NOT EXISTS memories_fts USING fts5 (
    text, content = 'memories', content_rowid = 'id', tokenize = 'unicode61 remove_diacritics 2'
);
"""
TRIGGERS_SQL = """
CREATE TRIGGER IF NOT EXISTS memories_ai AFTER INSERT ON memories BEGIN
    INSERT INTO memories_fts (rowid, text) VALUES (new.id, new.text);
END;
CREATE TRIGGER IF NOT EXISTS memories_ad AFTER DELETE ON memories BEGIN
    INSERT INTO memories_fts (memories_fts, rowid, text) VALUES ('delete', old.id, old.text);
END;
CREATE TRIGGER IF NOT EXISTS memories_au AFTER UPDATE OF text ON memories BEGIN
    INSERT INTO memories_fts (memories_fts, rowid, text) VALUES ('delete', old.id, old.text);
    INSERT INTO memories_fts (rowid, text) VALUES (new.id, new.text);
END;
"""
SCHEMA_SQL = TABLE_SQL + INDEX_SQL + TRIGGERS_SQL
# A broken FTS5 index cannot be dropped (its constructor fails before DROP TABLE runs), so its entry leaves
# the schema by hand, in one transaction with its shadow tables' drop and the rebuild from the content.
REBUILD_INDEX_SQL = f"""
BEGIN IMMEDIATE;
PRAGMA writable_schema = ON;
DELETE FROM sqlite_master WHERE type = 'table' AND name = 'memories_fts';
PRAGMA writable_schema = RESET;
DROP TABLE IF EXISTS memories_fts_data;
DROP TABLE IF EXISTS memories_fts_idx;
DROP TABLE IF EXISTS memories_fts_docsize;
DROP TABLE IF EXISTS memories_fts_config;
{INDEX_SQL}
INSERT INTO memories_fts (memories_fts) VALUES ('rebuild');
COMMIT;
"""


class MemoryStoreError(Exception):
    """Bad input to the store (empty text, unknown scope, no such memory); the message says which."""


class MemoryNotFound(MemoryStoreError):
    """No memory with that id that the caller may see (or change): the same answer either way."""


class MemoryPermissionError(MemoryStoreError):
    """The caller's role does not allow this (the admin reading memories, a child writing family ones)."""


# -----------------------------------------------------------------------------
# Configuration and connections


def load_config(path=DEFAULT_CONFIG, overrides=()):
    """The validated `memory:` section of a memory layer file (configs/memory/*.yaml), with memory.key=value
    overrides (serve/app.py's command line passes them)."""
    return config.load_layer("memory", path, overrides)


def connect(db_path, cfg):
    """A connection to the family database with WAL, secure_delete and the memory tables in place."""
    os.makedirs(os.path.dirname(os.path.abspath(db_path)), exist_ok=True)
    # IMMEDIATE: a write transaction takes the write lock at BEGIN, waiting up to the busy timeout; a
    # deferred one that read first would fail at once with "database is locked" when another wrote.
    conn = sqlite3.connect(
        db_path, timeout=cfg["busy_timeout_ms"] / 1000, check_same_thread=False, isolation_level="IMMEDIATE"
    )
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA secure_delete = ON")
    ensure_schema(conn)
    return conn


def ensure_schema(conn, log=print):
    """The memory tables in place, and their keyword index readable: a broken one is rebuilt from the
    memories table, which holds every memory's text (nothing is lost)."""
    with conn:
        conn.executescript(SCHEMA_SQL)
    try:
        with conn:
            conn.execute("INSERT INTO memories_fts (memories_fts) VALUES ('integrity-check')")
    except sqlite3.DatabaseError as e:
        if getattr(e, "sqlite_errorcode", 0) & 0xFF != sqlite3.SQLITE_CORRUPT:
            raise
        try:
            conn.executescript(REBUILD_INDEX_SQL)
        except sqlite3.Error:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        count = conn.execute("SELECT count(*) FROM memories").fetchone()[0]
        path = conn.execute("PRAGMA database_list").fetchone()[2]
        log(f"{path}: the memories' keyword index could not be read ({e}); rebuilt from the {count} memories")


def now_text():
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# -----------------------------------------------------------------------------
# Access rules: the one place that says who reads and writes what


def check_reader(role):
    if role not in ROLES:
        raise MemoryPermissionError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    if role == "admin":
        raise MemoryPermissionError("the admin role manages accounts and does not read or write memories")


def readable_sql(member):
    """WHERE clause (on table alias m) and its parameters: the memories `member` may read."""
    return "(m.scope = 'family' OR (m.scope = 'private' AND m.member = ?))", (member,)


def check_scope_write(role, scope):
    check_reader(role)
    if scope not in SCOPES:
        raise MemoryStoreError(f"scope {scope!r} is not valid; expected one of {', '.join(SCOPES)}")
    if scope == "family" and role != "adult":
        raise MemoryPermissionError(f"a {role} may keep only private memories; family ones are for adults")


def may_change(role, memory):
    """Whether the reader of `memory` (a row they may read) may edit or forget it: their own private
    memories (a readable private row is always the reader's own), and family ones for an adult."""
    return memory["scope"] == "private" or role == "adult"


def readable_row(conn, member, role, memory_id):
    """The row of a memory the caller may read, or None (an id past SQLite's 64-bit integers is none)."""
    check_reader(role)
    if not -(2**63) <= memory_id < 2**63:
        return None
    where, params = readable_sql(member)
    return conn.execute(
        f"SELECT * FROM memories m WHERE m.id = ? AND {where}", (memory_id, *params)
    ).fetchone()


def writable_row(conn, member, role, memory_id):
    """The row of a memory the caller may change. Any other id reads as not existing, so a member cannot
    probe others' memories."""
    row = readable_row(conn, member, role, memory_id)
    if row is None or not may_change(role, row):
        raise MemoryNotFound(f"no memory {memory_id} of {member}")
    return row


def check_text(text, cfg):
    text = (text or "").strip()
    if not text:
        raise MemoryStoreError("a memory needs some text")
    if len(text) > cfg["max_text_chars"]:
        raise MemoryStoreError(f"a memory holds at most {cfg['max_text_chars']} characters; got {len(text)}")
    return text


# -----------------------------------------------------------------------------
# The store


def as_dict(row):
    return {
        "id": row["id"],
        "member": row["member"],
        "scope": row["scope"],
        "text": row["text"],
        "pinned": bool(row["pinned"]),
        "source": row["source"],
        "created": row["created"],
        "updated": row["updated"],
    }


def add(conn, member, role, text, cfg, scope="private", pinned=False, source="manual"):
    """Store a memory of `member`; returns its id."""
    check_scope_write(role, scope)
    if source not in SOURCES:
        raise MemoryStoreError(f"source {source!r} is not valid; expected one of {', '.join(SOURCES)}")
    text = check_text(text, cfg)
    stamp = now_text()
    with conn:
        cursor = conn.execute(
            "INSERT INTO memories (member, scope, text, pinned, source, created, updated) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (member, scope, text, int(bool(pinned)), source, stamp, stamp),
        )
    return cursor.lastrowid


def list_memories(conn, member, role):
    """Every memory `member` may read (their private ones and the family's), newest first, each with
    `editable`: whether they may change it."""
    check_reader(role)
    where, params = readable_sql(member)
    rows = conn.execute(f"SELECT * FROM memories m WHERE {where} ORDER BY m.updated DESC, m.id DESC", params)
    return [as_dict(row) | {"editable": may_change(role, row)} for row in rows]


def get(conn, member, role, memory_id):
    row = readable_row(conn, member, role, memory_id)
    if row is None:
        raise MemoryNotFound(f"no memory {memory_id} of {member}")
    return as_dict(row)


def edit(conn, member, role, memory_id, cfg, text=None, pinned=None, scope=None):
    """Change the text, pin or scope of a memory the caller may change; returns it as a dict."""
    row = writable_row(conn, member, role, memory_id)
    new_text = row["text"] if text is None else check_text(text, cfg)
    new_pinned = row["pinned"] if pinned is None else int(bool(pinned))
    new_scope = row["scope"] if scope is None else scope
    if new_scope != row["scope"]:
        check_scope_write(role, new_scope)
        if row["member"] != member:
            raise MemoryPermissionError(
                f"memory {memory_id} belongs to {row['member']}; only they re-scope it"
            )
    conn.execute("PRAGMA secure_delete = ON")  # the old text's bytes are overwritten too
    with conn:
        conn.execute(
            "UPDATE memories SET text = ?, pinned = ?, scope = ?, updated = ? WHERE id = ?",
            (new_text, new_pinned, new_scope, now_text(), memory_id),
        )
    if new_text != row["text"]:
        purge(conn)
    return get(conn, member, role, memory_id)


def forget(conn, member, role, memory_id):
    """Delete one memory the caller may change, for real; returns the deleted memory."""
    row = writable_row(conn, member, role, memory_id)
    conn.execute("PRAGMA secure_delete = ON")  # per connection; the caller's may have it off
    with conn:
        conn.execute("DELETE FROM memories WHERE id = ?", (memory_id,))
    purge(conn)
    return as_dict(row)


def forget_later(conn, member, role, memory_id, undo_s, now=None):
    """Forget a memory the caller may change so that take_back can undo it for undo_s seconds: it leaves
    every list, search and turn at once, and its text waits in forgotten_memories until erase_due erases it
    for good. undo_s 0 erases it now (forget). Returns the memory, with erase_after (Unix seconds, or None)."""
    if undo_s <= 0:
        return forget(conn, member, role, memory_id) | {"erase_after": None}
    row = writable_row(conn, member, role, memory_id)
    erase_after = (time.time() if now is None else now) + undo_s
    with conn:
        conn.execute(
            "INSERT INTO forgotten_memories (memory_id, member, scope, text, pinned, source, created, updated, "
            "forgotten_by, erase_after) SELECT id, member, scope, text, pinned, source, created, updated, ?, ? "
            "FROM memories WHERE id = ?",
            (member, erase_after, memory_id),
        )
        conn.execute("DELETE FROM memories WHERE id = ?", (memory_id,))
    return as_dict(row) | {"erase_after": erase_after}


def take_back(conn, member, role, memory_id, now=None):
    """Undo forget_later while its time lasts: the memory `member` forgot is kept again, under its old id
    unless a new memory took it meanwhile. Returns it; MemoryNotFound when there is none to bring back."""
    check_reader(role)
    now = time.time() if now is None else now
    row = conn.execute(
        "SELECT * FROM forgotten_memories WHERE memory_id = ? AND forgotten_by = ? AND erase_after > ? "
        "ORDER BY forgotten_id DESC LIMIT 1",
        (memory_id, member, now),
    ).fetchone()
    if row is None:
        raise MemoryNotFound(f"no memory {memory_id} forgotten by {member} that can still be brought back")
    taken = conn.execute("SELECT 1 FROM memories WHERE id = ?", (memory_id,)).fetchone()
    with conn:
        cursor = conn.execute(
            "INSERT INTO memories (id, member, scope, text, pinned, source, created, updated) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (None if taken else memory_id, *(row[key] for key in ("member", "scope", "text", "pinned",
                                                                 "source", "created", "updated"))),
        )  # fmt: skip
        conn.execute("DELETE FROM forgotten_memories WHERE forgotten_id = ?", (row["forgotten_id"],))
    return as_dict(conn.execute("SELECT * FROM memories WHERE id = ?", (cursor.lastrowid,)).fetchone())


def erase_due(conn, now=None):
    """Erase for good the forgotten memories whose undo time is over (purge: no byte of them left in the
    files or the index); returns how many."""
    conn.execute("PRAGMA secure_delete = ON")
    with conn:
        count = conn.execute(
            "DELETE FROM forgotten_memories WHERE erase_after <= ?", (time.time() if now is None else now,)
        ).rowcount
    if count:
        purge(conn)
    return count


def next_erasure(conn):
    """When erase_due has something to erase next (Unix seconds), or None."""
    return conn.execute("SELECT min(erase_after) FROM forgotten_memories").fetchone()[0]


class Eraser:
    """Erases forgotten memories when their undo time ends, on a daemon thread, through the connection and
    lock the server shares: wake() it after forget_later. A database another program holds locked is
    tried again retry_s later; a closed connection (the server gone) ends the thread."""

    def __init__(self, conn, lock, log, retry_s=5.0):
        self.conn, self.lock, self.log, self.retry_s = conn, lock, log, retry_s
        self.woken = threading.Event()
        threading.Thread(target=self.run, name="memory-eraser", daemon=True).start()

    def wake(self):
        self.woken.set()

    def run(self):
        while True:
            self.woken.clear()
            with self.lock:
                try:
                    erase_due(self.conn)
                    due = next_erasure(self.conn)
                except sqlite3.ProgrammingError:  # the connection was closed
                    return
                except sqlite3.Error as e:
                    self.log(f"forgotten memories not erased yet ({e}); trying again in {self.retry_s:g} s")
                    due = time.time() + self.retry_s
            self.woken.wait(None if due is None else max(0.0, due - time.time()))


def forget_all(conn, member, role):
    """Delete every memory `member` wrote (private and family), those waiting to be erased too; returns how
    many were kept."""
    check_reader(role)
    conn.execute("PRAGMA secure_delete = ON")
    with conn:
        count = conn.execute("DELETE FROM memories WHERE member = ?", (member,)).rowcount
        conn.execute("DELETE FROM forgotten_memories WHERE member = ?", (member,))
    purge(conn)
    return count


def member_removed(conn, member):
    """Delete every memory of a member whose account is gone (serve/app.py calls it), and those they forgot,
    so that a new member given the same name later starts with none and can bring none back; returns how
    many were kept."""
    conn.execute("PRAGMA secure_delete = ON")
    with conn:
        count = conn.execute("DELETE FROM memories WHERE member = ?", (member,)).rowcount
        conn.execute("DELETE FROM forgotten_memories WHERE member = ? OR forgotten_by = ?", (member, member))
    purge(conn)
    return count


def export(conn, member, role):
    """Everything `member` wrote, as a JSON-ready dict."""
    check_reader(role)
    rows = conn.execute("SELECT * FROM memories WHERE member = ? ORDER BY id", (member,))
    return {"member": member, "exported": now_text(), "memories": [as_dict(row) for row in rows]}


def purge(conn):
    """Make deleted text unrecoverable: rebuild the FTS index from the table (a delete only marks terms as
    gone until the index is rewritten), zero freed pages (secure_delete), and empty the WAL that still
    holds old pages. The checkpoint cannot complete while another connection reads; the next purge
    finishes it. Not FTS5's 'optimize': SQLite 3.40 (Debian 12's) adds a level to the index at each one,
    and past 2,000 levels (about 1,200 forgets or edits) the index can no longer be read; a rebuild
    leaves one level and takes ~20 ms for 18,000 memories."""
    conn.execute("PRAGMA secure_delete = ON")
    with conn:
        conn.execute("INSERT INTO memories_fts (memories_fts) VALUES ('rebuild')")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()


# -----------------------------------------------------------------------------
# Retrieval


def fts_query(text, cfg):
    """An FTS5 query from user text: its words as quoted terms joined by OR (never the raw text, whose
    quotes, stars, parentheses and NEAR/AND/NOT would be FTS5 syntax). None when no word is left."""
    terms = query_terms(text, cfg)
    return " OR ".join(f'"{term}"' for term in terms) or None


def query_terms(text, cfg):
    """The first max_query_terms distinct words of the text worth searching: one pass that stops there
    (a set, not a list, remembers the words seen), so a long message costs no more than its first words.
    serve/app.py calls it before taking the database's lock."""
    stopwords, terms = set(cfg["stopwords"]), {}  # a dict keeps their order
    long_enough = re.compile(rf"\w{{{cfg['min_term_chars']},}}")  # shorter words skipped by the regex engine
    for found in long_enough.finditer(text):
        word = found.group().lower()
        if word not in stopwords and word not in terms:
            terms[word] = None
            if len(terms) == cfg["max_query_terms"]:
                break
    return list(terms)


def search(conn, member, role, query, limit, cfg, exclude_pinned=False):
    """The `limit` best bm25 matches of `query` among the memories `member` may read."""
    check_reader(role)
    match = fts_query(query, cfg)
    if match is None or limit <= 0:
        return []
    where, params = readable_sql(member)
    pinned = "AND m.pinned = 0" if exclude_pinned else ""
    rows = conn.execute(
        "SELECT m.* FROM memories_fts JOIN memories m ON m.id = memories_fts.rowid "
        f"WHERE memories_fts MATCH ? AND {where} {pinned} ORDER BY bm25(memories_fts) LIMIT ?",
        (match, *params, limit),
    )
    return [as_dict(row) for row in rows]


def pinned_memories(conn, member, role):
    check_reader(role)
    where, params = readable_sql(member)
    rows = conn.execute(
        f"SELECT * FROM memories m WHERE m.pinned = 1 AND {where} ORDER BY m.updated DESC, m.id DESC", params
    )
    return [as_dict(row) for row in rows]


def memory_line(memory):
    scope = " (familia)" if memory["scope"] == "family" else ""
    return f"- [{memory['id']}]{scope} {memory['text']}"


def context_for_turn(conn, member, role, user_text, cfg, count_tokens, context_len=None):
    """The memories for the system turn of a reply to `user_text`: the member's pinned ones, then the top-k
    bm25 matches, as long as the block fits cfg['token_budget'] tokens, and cfg['context_share'] of the
    model's context_len when given (count_tokens(text) -> int, the served tokenizer's count). Empty
    string when there is nothing to say, or for the admin role."""
    if role == "admin":
        return ""
    memories = pinned_memories(conn, member, role)
    memories += search(conn, member, role, user_text, cfg["top_k"], cfg, exclude_pinned=True)
    if not memories:
        return ""
    budget = cfg["token_budget"]
    if context_len is not None:
        budget = min(budget, int(cfg["context_share"] * context_len))
    lines = [cfg["header"]]
    used = count_tokens(cfg["header"])
    for memory in memories:
        line = memory_line(memory)
        cost = count_tokens("\n" + line)
        if used + cost > budget:
            continue  # a shorter memory further down may still fit
        lines.append(line)
        used += cost
    return "\n".join(lines) if len(lines) > 1 else ""


# -----------------------------------------------------------------------------
# The agent's tools: Spanish text for the model, acting only as the calling member


class Refusal(Exception):
    """A memory tool call that cannot be done; the message (Spanish) is for the model."""


@dataclasses.dataclass(frozen=True)
class Caller:
    """A member as the memory tools see them: name and role, and the family database they reach (a
    connection and the lock that serializes its use, both shared with the server)."""

    name: str
    role: str
    conn: object
    lock: object
    cfg: dict
    forgot: object = None  # called after olvidar (the server's Eraser.wake)

    def run(self, tool_function, **arguments):
        with self.lock:
            result = tool_function(self.conn, self.name, self.role, self.cfg, **arguments)
        if tool_function is olvidar and self.forgot is not None:
            self.forgot()
        return result


def recordar(conn, member, role, cfg, texto, ambito="privado"):
    scope = SCOPE_WORDS.get(ambito or "privado")
    if scope is None:
        raise Refusal(f"ámbito «{ambito}» no válido: usa «privado» o «familia»")
    if role == "admin":
        raise Refusal("la cuenta de administración no guarda recuerdos")
    if scope == "family" and role != "adult":
        raise Refusal(
            "solo una persona adulta puede guardar recuerdos de la familia; guárdalo como «privado»"
        )
    try:
        memory_id = add(conn, member, role, texto, cfg, scope=scope, source="assistant")
    except MemoryStoreError as e:
        raise Refusal(f"no se pudo guardar el recuerdo: {spanish_store_error(e, cfg)}") from None
    where = "de la familia" if scope == "family" else "privado"
    return f"Recuerdo {memory_id} guardado ({where})."


def buscar_recuerdos(conn, member, role, cfg, consulta):
    if role == "admin":
        raise Refusal("la cuenta de administración no tiene recuerdos")
    found = search(conn, member, role, consulta, cfg["search_results"], cfg)
    if not found:
        return "Sin recuerdos que coincidan."
    return "\n".join(memory_line(memory) for memory in found)


def olvidar(conn, member, role, cfg, id):  # noqa: A002 - the tool's argument name, as the model writes it
    if role == "admin":
        raise Refusal("la cuenta de administración no tiene recuerdos")
    try:
        memory = forget_later(conn, member, role, int(id), cfg["forget_undo_s"])
    except (MemoryStoreError, ValueError):
        raise Refusal(f"no hay ningún recuerdo {id} que puedas borrar") from None
    return f"Recuerdo {memory['id']} borrado: «{memory['text']}»."


def spanish_store_error(error, cfg):
    message = str(error)
    if message.startswith("a memory needs"):
        return "el texto está vacío"
    if message.startswith("a memory holds"):
        return f"el texto pasa de {cfg['max_text_chars']} caracteres"
    return message
