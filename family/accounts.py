"""
The family's accounts and conversations, in one SQLite file (WAL): members with a role (admin, adult,
child), their API keys (stored as SHA-256: they are random 256-bit secrets) and web passwords or PINs
(salted scrypt), web sessions, and each member's conversations (with their ratings of the answers and
their consent to train on them: family/feedback.py's tables, created here). No HTTP here: serve/app.py is the only user,
and `python -m serve member ...` (serve/member_command.py) this store's command line.

Every query about conversations names their owner, so no member's rows can come back to another.
Deleting a member deletes their conversations, feedback and consent (foreign keys) and their memories; freed
pages are overwritten (secure_delete).
"""

import contextlib
import hashlib
import hmac
import json
import os
import re
import secrets
import sqlite3
import threading
import time
import uuid

import fileio
from family import feedback, memories

ROLES = ("admin", "adult", "child")
NAME_PATTERN = re.compile(r"^[A-Za-z0-9ÁÉÍÓÚÜÑáéíóúüñ][A-Za-z0-9ÁÉÍÓÚÜÑáéíóúüñ._-]{0,39}$")


class AccountError(Exception):
    """A problem with an account the person can fix (bad name, unknown member, weak password)."""


SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS members (
    id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE COLLATE NOCASE, role TEXT NOT NULL,
    key_hash TEXT NOT NULL UNIQUE, password_hash TEXT, created REAL NOT NULL,
    provisional INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS sessions (
    token_hash TEXT PRIMARY KEY, member_id INTEGER NOT NULL REFERENCES members(id) ON DELETE CASCADE,
    expires REAL NOT NULL);
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY, member_id INTEGER NOT NULL REFERENCES members(id) ON DELETE CASCADE,
    title TEXT NOT NULL, created REAL NOT NULL, updated REAL NOT NULL);
CREATE INDEX IF NOT EXISTS conversations_of_member ON conversations(member_id, updated);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY, conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL, content TEXT NOT NULL, created REAL NOT NULL);
CREATE INDEX IF NOT EXISTS messages_of_conversation ON messages(conversation_id, id);
"""


def sha256(text):
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def hash_password(password, cost):
    salt = secrets.token_bytes(16)
    digest = hashlib.scrypt(password.encode("utf-8"), salt=salt, n=cost["n"], r=cost["r"], p=cost["p"],
                            maxmem=256 * 1024 * 1024)  # fmt: skip
    return f"scrypt${cost['n']}${cost['r']}${cost['p']}${salt.hex()}${digest.hex()}"


def password_matches(password, stored):
    _, n, r, p, salt, digest = stored.split("$")
    candidate = hashlib.scrypt(password.encode("utf-8"), salt=bytes.fromhex(salt), n=int(n), r=int(r),
                               p=int(p), maxmem=256 * 1024 * 1024)  # fmt: skip
    return hmac.compare_digest(candidate.hex(), digest)


class Store:
    """The SQLite database. One connection shared under a lock: every statement here takes microseconds,
    so the event loop calls it directly. Each write is one committed transaction (synchronous=FULL)."""

    def __init__(self, path, busy_timeout_ms=None):
        """busy_timeout_ms: how long a statement waits for another process's write lock before raising
        sqlite3.OperationalError "database is locked" (serve.busy_timeout_ms; None: the sqlite3 module's
        default, 5 s)."""
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        self.path, self.storage_problem = path, None  # storage_problem: the last write refused by the disk
        timeout = {} if busy_timeout_ms is None else {"timeout": busy_timeout_ms / 1000}
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, **timeout)
        self.db.row_factory = sqlite3.Row
        self.lock = threading.Lock()
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("PRAGMA foreign_keys=ON")
        self.db.execute("PRAGMA secure_delete=ON")  # a deleted account or conversation leaves no text behind
        self.migrate()
        memories.ensure_schema(self.db)
        feedback.ensure_schema(self.db)

    # --- the schema's versions: PRAGMA user_version counts the steps a file has taken
    def tables_of_release_2026_12_02(self):
        """Step 1: the tables as release 2026-12-02 left them (a new file gets them all; a file of that
        release or before, at user_version 0, already has them), and members.provisional (an account
        made through the admin API until the member changes the password) on files older than it."""
        for statement in SCHEMA_SQL.split(";"):  # not executescript: it would commit the transaction
            if statement.strip():
                self.db.execute(statement)
        columns = [row["name"] for row in self.db.execute("PRAGMA table_info(members)")]
        if "provisional" not in columns:
            self.db.execute("ALTER TABLE members ADD COLUMN provisional INTEGER NOT NULL DEFAULT 0")

    def answers_given_to_children(self):
        """Step 2: the digests of the answers the API gave each child (serve/app.py checks that a child's
        request brings back only those as assistant turns)."""
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS answers (member_id INTEGER NOT NULL REFERENCES members(id) ON DELETE "
            "CASCADE, digest TEXT NOT NULL, created REAL NOT NULL, PRIMARY KEY (member_id, digest)) WITHOUT ROWID"
        )

    def tool_work_of_answers(self):
        """Step 3: messages.tool_messages, an answer's tool calls and results (OpenAI messages, JSON) kept on
        the answer's own row, so a follow-up reads them and the answers keep their numbers (feedback's
        message_index)."""
        columns = [row["name"] for row in self.db.execute("PRAGMA table_info(messages)")]
        if "tool_messages" not in columns:
            self.db.execute("ALTER TABLE messages ADD COLUMN tool_messages TEXT")

    # MIGRATIONS[n] takes a file from user_version n to n + 1. Add steps at the end; never edit one.
    MIGRATIONS = (tables_of_release_2026_12_02, answers_given_to_children, tool_work_of_answers)

    def migrate(self):
        """Take the file forward step by step to len(MIGRATIONS), all in one write transaction (two processes
        opening an old file do not race, and a failed step leaves the file as it was); refuse a file that
        newer code has taken further."""
        with self.transaction():
            version = self.db.execute("PRAGMA user_version").fetchone()[0]
            if version > len(self.MIGRATIONS):
                raise AccountError(
                    f"{self.path}: database schema version {version}, newer than this code's "
                    f"{len(self.MIGRATIONS)}: a later ENLACE wrote it; update this checkout, or restore a "
                    "snapshot taken before the upgrade (python -m family restore)"
                )
            for step in range(version, len(self.MIGRATIONS)):
                self.MIGRATIONS[step](self)
                self.db.execute(f"PRAGMA user_version = {step + 1}")

    # --- a full or read-only disk
    def storage_error(self, error):
        """The fileio.StorageError a database error means (SQLITE_FULL, SQLITE_READONLY), else None. The
        first of an episode is kept in storage_problem until a write commits again."""
        if isinstance(error, fileio.StorageError):
            return error
        code = getattr(error, "sqlite_errorcode", None)
        reasons = {sqlite3.SQLITE_FULL: "full", sqlite3.SQLITE_READONLY: "read-only"}
        if code is None or code & 0xFF not in reasons:
            return None
        try:
            free = fileio.free_bytes(self.path)
        except OSError:
            free = None
        problem = fileio.StorageError(
            self.path, reasons[code & 0xFF], free=free, what="writing the family's database"
        )
        if self.storage_problem is None:
            self.storage_problem = problem
        return problem

    def query(self, sql, args=()):
        with self.lock:
            return [dict(row) for row in self.db.execute(sql, args)]

    @contextlib.contextmanager
    def transaction(self):
        """One write transaction under the lock: committed at the end, rolled back on any exception."""
        with self.lock:
            try:
                self.db.execute("BEGIN IMMEDIATE")  # a read-only file refuses already here
            except sqlite3.Error as e:
                problem = self.storage_error(e)
                if problem is not None:
                    raise problem from e
                raise
            try:
                yield
                self.db.execute("COMMIT")
            except BaseException as e:
                # SQLite has already rolled back after some errors (SQLITE_FULL among them): a second
                # ROLLBACK would fail and hide the first error.
                if self.db.in_transaction:
                    self.db.execute("ROLLBACK")
                problem = self.storage_error(e)
                if problem is not None and problem is not e:
                    raise problem from e
                raise
            self.storage_problem = None  # a write went through: the disk has room again

    def write(self, *statements):
        """Run (sql, args) statements in one transaction; returns the last cursor's rowcount."""
        count = 0
        with self.transaction():
            for sql, args in statements:
                count = self.db.execute(sql, args).rowcount
        return count

    # members
    def add_member(self, name, role, password_hash=None, provisional=False):
        """Create a member (with their password's hash, in the same transaction); returns their new API key
        (shown once, stored as a hash). A provisional member's credentials only reach GET /api/me and the
        password change (serve/app.py), which ends the provisional state and replaces the key."""
        if not NAME_PATTERN.match(name):
            raise AccountError(f"member name {name!r}: use 1-40 letters, digits, '.', '_' or '-'")
        if role not in ROLES:
            raise AccountError(f"role {role!r}: expected one of {', '.join(ROLES)}")
        if self.member(name):
            raise AccountError(f"member {name!r} already exists")
        key = "enl-" + secrets.token_urlsafe(32)
        sql = "INSERT INTO members (name, role, key_hash, password_hash, provisional, created) VALUES (?, ?, ?, ?, ?, ?)"
        self.write((sql, (name, role, sha256(key), password_hash, int(provisional), time.time())))
        return key

    def member(self, name):
        rows = self.query("SELECT * FROM members WHERE name = ?", (name,))
        return rows[0] if rows else None

    def members(self):
        return self.query("SELECT id, name, role, password_hash IS NOT NULL AS has_password, provisional, "
                          "created FROM members ORDER BY name")  # fmt: skip

    def remove_member(self, name):
        removed = self.write(("DELETE FROM members WHERE name = ?", (name,))) > 0
        if removed:
            with self.lock:
                memories.member_removed(self.db, name)  # their memories go with the account
        return removed

    def new_key(self, name):
        key = "enl-" + secrets.token_urlsafe(32)
        if not self.write(("UPDATE members SET key_hash = ? WHERE name = ?", (sha256(key), name))):
            return None
        return key

    def set_password(self, name, password_hash):
        """A password set on the server (`python -m serve member password`): every session of the member
        ends with the old password, in the same transaction."""
        with self.transaction():
            sql = "UPDATE members SET password_hash = ? WHERE name = ?"
            changed = self.db.execute(sql, (password_hash, name)).rowcount
            sql = "DELETE FROM sessions WHERE member_id = (SELECT id FROM members WHERE name = ?)"
            self.db.execute(sql, (name,))
        return changed > 0

    def change_password(self, member_id, password_hash, keep_session=None):
        """The member's own password change, in one transaction: the new hash, every session but
        keep_session (the token of the one asking, if they came by cookie) ended, and a provisional account
        made final with a new API key, returned (None when the key stays): the admin who created the account
        knew its first password and key, and neither works afterwards."""
        keep = sha256(keep_session) if keep_session else ""
        with self.transaction():
            row = self.db.execute("SELECT provisional FROM members WHERE id = ?", (member_id,)).fetchone()
            key = "enl-" + secrets.token_urlsafe(32) if row and row["provisional"] else None
            self.db.execute(
                "UPDATE members SET password_hash = ?, provisional = 0, key_hash = COALESCE(?, key_hash) WHERE id = ?",
                (password_hash, key and sha256(key), member_id),
            )
            self.db.execute("DELETE FROM sessions WHERE member_id = ? AND token_hash != ?", (member_id, keep))
        return key

    def member_by_key(self, key):
        rows = self.query("SELECT * FROM members WHERE key_hash = ?", (sha256(key),))
        return rows[0] if rows else None

    # answers given (to children, through the API): their digests, kept for session_days
    def add_answer(self, member_id, text, days=30):
        digest = hashlib.sha256(f"{member_id}\0{text.strip()}".encode("utf-8", "surrogatepass")).hexdigest()
        now = time.time()
        self.write(("DELETE FROM answers WHERE created < ?", (now - days * 86400,)),
                   ("INSERT OR REPLACE INTO answers (member_id, digest, created) VALUES (?, ?, ?)",
                    (member_id, digest, now)))  # fmt: skip

    def gave_answer(self, member_id, text):
        digest = hashlib.sha256(f"{member_id}\0{text.strip()}".encode("utf-8", "surrogatepass")).hexdigest()
        sql = "SELECT 1 FROM answers WHERE member_id = ? AND digest = ?"
        return bool(self.query(sql, (member_id, digest)))

    # sessions
    def new_session(self, member_id, days):
        """A new login's token, in two halves joined by '.': the cookie's and the page's (serve/web.py);
        expired sessions are dropped on the way."""
        token, now = f"{secrets.token_urlsafe(32)}.{secrets.token_urlsafe(32)}", time.time()
        sql = "INSERT INTO sessions (token_hash, member_id, expires) VALUES (?, ?, ?)"
        self.write(
            ("DELETE FROM sessions WHERE expires <= ?", (now,)),
            (sql, (sha256(token), member_id, now + days * 86400)),
        )
        return token

    def member_by_session(self, token):
        sql = "SELECT m.* FROM sessions s JOIN members m ON m.id = s.member_id WHERE s.token_hash = ? AND s.expires > ?"
        rows = self.query(sql, (sha256(token), time.time()))
        return rows[0] if rows else None

    def end_session(self, token):
        self.write(("DELETE FROM sessions WHERE token_hash = ?", (sha256(token),)))

    # conversations: every query names the owner, so nobody else's rows can come back
    def conversations(self, member_id):
        sql = (
            "SELECT id, title, created, updated FROM conversations WHERE member_id = ? ORDER BY updated DESC"
        )
        return self.query(sql, (member_id,))

    def conversation(self, member_id, conversation_id):
        rows = self.query(
            "SELECT id, title, created, updated FROM conversations WHERE id = ? AND member_id = ?",
            (conversation_id, member_id),
        )
        if not rows:
            return None
        sql = (
            "SELECT role, content, created, tool_messages FROM messages WHERE conversation_id = ? ORDER BY id"
        )
        messages = self.query(sql, (conversation_id,))
        for message in messages:  # an answer's tool calls and results, where it had some
            work = message.pop("tool_messages")
            if work:
                message["tool_messages"] = json.loads(work)
        return rows[0] | {"messages": messages}

    def new_conversation(self, member_id, title):
        conversation_id = uuid.uuid4().hex
        now = time.time()
        sql = "INSERT INTO conversations (id, member_id, title, created, updated) VALUES (?, ?, ?, ?, ?)"
        self.write((sql, (conversation_id, member_id, title, now, now)))
        return conversation_id

    def delete_conversation(self, member_id, conversation_id):
        sql = "DELETE FROM conversations WHERE id = ? AND member_id = ?"
        return self.write((sql, (conversation_id, member_id))) > 0

    def add_message(self, member_id, conversation_id, role, content, title=None, tool_messages=None):
        """Append one message (and retitle) in one transaction; False if the conversation is not theirs. An
        answer keeps the calls and results of its tools (OpenAI messages) on its row."""
        now = time.time()
        owned = "SELECT 1 FROM conversations WHERE id = ? AND member_id = ?"
        work = json.dumps(tool_messages, ensure_ascii=False) if tool_messages else None
        statements = [
            ("INSERT INTO messages (conversation_id, role, content, created, tool_messages) SELECT ?, ?, ?, ?, ? "
             f"WHERE EXISTS ({owned})", (conversation_id, role, content, now, work, conversation_id, member_id)),
        ]  # fmt: skip
        sql = (
            "UPDATE conversations SET updated = ?, title = COALESCE(?, title) WHERE id = ? AND member_id = ?"
        )
        statements.append((sql, (now, title, conversation_id, member_id)))
        return self.write(*statements) > 0


def password_problem(password, settings, role):
    """Why a password or PIN is refused (None when it is fine). A child may have a PIN of
    serve.child.min_password_chars digits (the login throttle, not the PIN, keeps guessers out: see
    docs/servidor.md); an adult's or admin's password has serve.min_password_chars characters and is not
    digits alone nor one character repeated."""
    if role == "child":
        shortest = settings["child"]["min_password_chars"]
        return f"password: at least {shortest} characters" if len(password) < shortest else None
    shortest = settings["min_password_chars"]
    if len(password) < shortest:
        return f"password: at least {shortest} characters for an adult (a PIN is for children)"
    if password.isdigit() or len(set(password)) == 1:
        return "password: not digits alone nor one character repeated (a PIN is for children)"
    return None


class LoginThrottle:
    """Guesses of passwords (logins and password changes), counted on the event loop before the hash is
    computed: begin() checks and counts in one step (nothing awaits in between), so parallel guesses are
    counted each. Each attempt counts as a failure until finish(ticket, True) says it was right.
      - per member name and client address: login_max_failures failures lock that name for that address
        for login_lockout_s; nothing clears a lock before its time (a failure or even a right password that
        was already in flight), and the owner on another device is not locked out by a stranger;
      - per client address (all names), and per name (all addresses): after login_throttle's free failures
        each attempt must wait delay_s, doubling with each failure up to max_delay_s: a guesser slows down,
        the owner waits at most seconds.
    Entries are forgotten login_throttle.forget_s after their last failure."""

    def __init__(self, settings, clock=time.monotonic):
        self.settings, self.clock = settings, clock
        self.locks = {}  # (name, address) -> [failures, locked until]
        self.delays = {}  # ("address", a) or ("name", n) -> [failures, next attempt allowed at, last failure]

    def forget_old(self, now):
        forget = self.settings["login_throttle"]["forget_s"]
        if len(self.locks) + len(self.delays) < 1024:  # a flood of addresses is pruned, a family never
            return
        self.locks = {k: v for k, v in self.locks.items() if v[1] > now or now - v[2] < forget}
        self.delays = {k: v for k, v in self.delays.items() if now - v[2] < forget}

    def begin(self, name, address):
        """(seconds to wait, None) when this attempt is refused unheard, else (0, ticket)."""
        now, throttle = self.clock(), self.settings["login_throttle"]
        self.forget_old(now)
        name = name.lower()
        lock = self.locks.get((name, address))
        if lock and lock[1] > now:
            return lock[1] - now, None
        delays = [
            (("address", address), throttle["free_failures"]),
            (("name", name), throttle["name_free_failures"]),
        ]
        for key, _ in delays:
            entry = self.delays.get(key)
            if entry and now - entry[2] >= throttle["forget_s"]:
                del self.delays[key]
            elif entry and entry[1] > now:
                return entry[1] - now, None
        if lock is None or lock[1] or now - lock[2] >= throttle["forget_s"]:  # a lock over, or old counts
            lock = self.locks[(name, address)] = [0, 0.0, now]
        lock[0], lock[2] = lock[0] + 1, now
        if lock[0] >= self.settings["login_max_failures"]:
            lock[1] = now + self.settings["login_lockout_s"]
        previous = []
        for key, free in delays:
            entry = self.delays.setdefault(key, [0, 0.0, now])
            previous.append((key, entry[1]))
            entry[0], entry[2] = entry[0] + 1, now
            if entry[0] > free:
                wait = throttle["delay_s"] * 2 ** (entry[0] - free - 1)
                entry[1] = now + min(wait, throttle["max_delay_s"])
        return 0, ((name, address), lock[0], previous)

    def finish(self, ticket, right):
        """A right password takes back its counts (a lock stays until its time); a wrong one keeps them."""
        if not right:
            return
        pair, number, previous = ticket
        lock = self.locks.get(pair)
        if lock and lock[0] == number:  # no guess began after this one: the owner's, the lock goes
            del self.locks[pair]
        for key, allowed in previous:
            entry = self.delays.get(key)
            if entry:
                entry[0], entry[1] = max(entry[0] - 1, 0), allowed
