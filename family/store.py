"""
The family database as a whole: the server's lock on it, and its snapshots and their restore.

Snapshots: a consistent copy taken while the server runs (VACUUM INTO), integrity-checked, with a
manifest (time, sha256, the model and tokenizer the server was using, its resolved config, the code
version); the last N are kept. Restoring needs the server stopped: the server holds an flock on
<database>.lock for its whole life, and restore takes the same lock.

    python -m family snapshot
    python -m family restore var/snapshots/20261130T120000.000Z

The tables inside are their owners': family/memories.py's memories, family/accounts.py's members,
sessions and conversations, family/feedback.py's ratings and consent. This module never imports torch.
"""

import contextlib
import datetime
import fcntl
import json
import os
import re
import shutil
import sqlite3
import threading

import fileio

SNAPSHOT_NAME = re.compile(r"^\d{8}T\d{6}\.\d{3}Z$")
MANIFEST_KEYS = ("format", "created", "database", "integrity_check", "server", "memory_config")


class SnapshotError(Exception):
    """A snapshot that cannot be taken or trusted, or a restore that must not happen; names the file."""


# -----------------------------------------------------------------------------
# The server's lock: held for the server's whole life, taken by restore


def lock_path(db_path):
    return db_path + ".lock"


def hold_lock(db_path, info=None):
    """Take the database's lock (fcntl.flock on <db>.lock) and return its file descriptor: held until
    os.close(fd) or the end of the process (the kernel releases it even after SIGKILL). The server
    passes `info` (pid, the run and checkpoint it serves with their sha256, its resolved config, the code
    version), written to the lock file for snapshots to record; restore passes nothing and leaves the
    last server's info in place. Raises SnapshotError if another process holds it."""
    path = lock_path(db_path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = server_info(db_path) or {}
        raise SnapshotError(
            f"{db_path}: the server is running (pid {holder.get('pid', '?')} holds {path}); stop it first"
        ) from None
    if info is not None:
        body = json.dumps({"pid": os.getpid(), **info}, ensure_ascii=False, indent=1).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, body, 0)
        os.fsync(fd)
    return fd


@contextlib.contextmanager
def server_lock(db_path, info=None):
    """hold_lock for the duration of a with block."""
    fd = hold_lock(db_path, info)
    try:
        yield
    finally:
        os.close(fd)


def server_info(db_path):
    """What the last server to hold the lock said it was serving (None if no server ever ran)."""
    try:
        with open(lock_path(db_path), encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    try:
        return json.loads(text) if text.strip() else None
    except ValueError:
        return None


# -----------------------------------------------------------------------------
# Private files: the server and the family command line run under umask 0077 (PRIVATE_UMASK)


PRIVATE_UMASK = 0o077  # files 0600, folders 0700: scrypt hashes of 4-digit PINs fall offline in minutes


def make_private(db_path, snapshot_dir, log=print):
    """Tighten an existing database (with its WAL, shared memory and lock files) and its snapshots that
    other users of the machine could read, made before the server set its umask; one line says so."""
    widened = []
    for path in (db_path, db_path + "-wal", db_path + "-shm", lock_path(db_path)):
        if os.path.isfile(path) and os.stat(path).st_mode & 0o077:
            widened.append(f"{os.path.basename(path)} {os.stat(path).st_mode & 0o777:04o}")
            os.chmod(path, 0o600)
    if os.path.isdir(snapshot_dir):
        for folder, _, files in os.walk(snapshot_dir):
            for path, private in [(folder, 0o700)] + [(os.path.join(folder, f), 0o600) for f in files]:
                if os.stat(path).st_mode & 0o077:
                    widened.append(f"{os.path.relpath(path, os.path.dirname(snapshot_dir))} "
                                   f"{os.stat(path).st_mode & 0o777:04o}")  # fmt: skip
                    os.chmod(path, private)
    if widened:
        shown = ", ".join(widened[:4]) + (f" and {len(widened) - 4} more" if len(widened) > 4 else "")
        log(
            f"{db_path}: other users of this machine could read {shown}; made private (files 0600, folders 0700)"
        )
    return widened


# -----------------------------------------------------------------------------
# Snapshots


def integrity(path):
    """PRAGMA integrity_check of a database file opened read-only; 'ok' or the problems, one per line."""
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            rows = conn.execute("PRAGMA integrity_check").fetchall()
        finally:
            conn.close()
    except sqlite3.DatabaseError as e:
        return f"not a readable SQLite database ({e})"
    return "\n".join(str(row[0]) for row in rows)


def list_snapshots(folder):
    """Complete snapshot folders, oldest first (a temp folder of an interrupted snapshot never matches)."""
    if not os.path.isdir(folder):
        return []
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if SNAPSHOT_NAME.match(n))


def snapshot(db_path, cfg, log=print):
    """A consistent copy of the live database (the server may be writing): VACUUM INTO a temp folder,
    integrity_check, manifest, then one rename makes it a snapshot. Keeps the newest keep_last."""
    if not os.path.isfile(db_path):
        raise SnapshotError(f"{db_path}: no such database")
    snap_cfg = cfg["snapshots"]
    folder = snap_cfg["dir"]
    os.makedirs(folder, exist_ok=True)
    created = datetime.datetime.now(datetime.UTC)
    name = created.strftime("%Y%m%dT%H%M%S.") + f"{created.microsecond // 1000:03d}Z"
    final = os.path.join(folder, name)
    if os.path.exists(final):
        raise SnapshotError(f"{final}: already exists; snapshots are at most one per millisecond")
    tmp = os.path.join(folder, f".tmp-{name}-{os.getpid()}")
    # The copy is at most the database and its WAL; a disk without room for it refuses before writing.
    wal = f"{db_path}-wal"
    needed = os.path.getsize(db_path) + (os.path.getsize(wal) if os.path.exists(wal) else 0)
    fileio.check_space(final, needed, what="the snapshot")
    os.makedirs(tmp)
    try:
        copy = os.path.join(tmp, "database.sqlite")
        source = sqlite3.connect(db_path, timeout=cfg["busy_timeout_ms"] / 1000)
        try:
            with fileio.reporting_storage(final, needed, what="the snapshot"):
                source.execute("VACUUM INTO ?", (copy,))
        finally:
            source.close()
        fileio.fsync_path(copy)
        check = integrity(copy)
        if check != "ok":
            raise SnapshotError(f"{db_path}: the copy fails integrity_check: {check}")
        manifest = {
            "format": 1,
            "created": created.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "database": {
                "file": "database.sqlite",
                "bytes": os.path.getsize(copy),
                "sha256": fileio.sha256_of_file(copy),
                "source": os.path.abspath(db_path),
            },
            "integrity_check": check,
            "server": server_info(db_path),
            "memory_config": cfg,
            "code_version": fileio.code_version(),  # of the code taking it (the server's is under "server")
        }
        fileio.write_json(os.path.join(tmp, "manifest.json"), manifest)
        os.rename(tmp, final)
        fileio.fsync_path(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in list_snapshots(folder)[: -snap_cfg["keep_last"]]:
        shutil.rmtree(old)
    log(
        f"snapshot {final}: {manifest['database']['bytes']} bytes, sha256 {manifest['database']['sha256'][:16]}…"
    )
    return final


def verify(snapshot_dir):
    """The manifest of a snapshot whose database matches it byte for byte and passes integrity_check."""
    manifest_file = os.path.join(snapshot_dir, "manifest.json")
    try:
        with open(manifest_file, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise SnapshotError(f"{manifest_file}: missing; {snapshot_dir} is not a complete snapshot") from None
    except ValueError as e:
        raise SnapshotError(f"{manifest_file}: not valid JSON ({e})") from None
    missing = [key for key in MANIFEST_KEYS if key not in manifest] if isinstance(manifest, dict) else ["all"]
    if missing or not isinstance(manifest["database"], dict) or manifest["format"] != 1:
        raise SnapshotError(f"{manifest_file}: not a format-1 snapshot manifest (missing {missing})")
    database = manifest["database"]
    path = os.path.join(snapshot_dir, os.path.basename(str(database.get("file", ""))))
    if not os.path.isfile(path):
        raise SnapshotError(f"{path}: missing; the manifest names it")
    size = os.path.getsize(path)
    if size != database.get("bytes"):
        raise SnapshotError(f"{path}: {size} bytes but the manifest says {database.get('bytes')}; truncated?")
    digest = fileio.sha256_of_file(path)
    if digest != database.get("sha256"):
        raise SnapshotError(f"{path}: sha256 {digest} differs from the manifest's {database.get('sha256')}")
    check = integrity(path)
    if check != "ok":
        raise SnapshotError(f"{path}: fails integrity_check: {check}")
    return manifest


def describe_model(manifest):
    server = manifest.get("server")
    if not server:
        return (
            "no model recorded: no server had used this database when the snapshot was taken "
            f"(by code {manifest.get('code_version', 'unrecorded')})"
        )
    return (
        f"taken with model checkpoint {server.get('checkpoint')} (sha256 {server.get('checkpoint_sha256')}), "
        f"tokenizer {server.get('tokenizer')} (sha256 {server.get('tokenizer_sha256')}), "
        f"code {server.get('code_version')}"
    )


def restore(snapshot_dir, db_path, log=print):
    """Replace the live database by a verified snapshot, atomically, with the server stopped. A snapshot
    that fails verification leaves the live database untouched. Returns the snapshot's manifest."""
    with server_lock(db_path):
        manifest = verify(snapshot_dir)
        source = os.path.join(snapshot_dir, os.path.basename(manifest["database"]["file"]))
        tmp = f"{db_path}.restore-{os.getpid()}.tmp"
        try:
            shutil.copyfile(source, tmp)
            fileio.fsync_path(tmp)
            if fileio.sha256_of_file(tmp) != manifest["database"]["sha256"]:
                raise SnapshotError(f"{tmp}: the copy of {source} does not match its manifest")
            # Fold the live WAL into the live file first, so that removing it below loses nothing even if
            # we stop before the rename; a stale WAL must never meet the restored file.
            if os.path.exists(db_path):
                with contextlib.suppress(sqlite3.DatabaseError):
                    live = sqlite3.connect(db_path)
                    try:
                        live.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
                    finally:
                        live.close()
            for leftover in (db_path + "-wal", db_path + "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(leftover)
            os.replace(tmp, db_path)
            fileio.fsync_path(os.path.dirname(os.path.abspath(db_path)))
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
    log(f"restored {db_path} from {snapshot_dir} (taken {manifest['created']})")
    log(f"the snapshot's model: {describe_model(manifest)}")
    return manifest


def snapshot_every(db_path, cfg, stop, log=print):
    """The server's schedule: a snapshot every snapshots.every_hours until `stop` (a threading.Event) is
    set. Returns the started daemon thread, or None when the schedule is off (every_hours 0)."""
    hours = cfg["snapshots"]["every_hours"]
    if not hours:
        return None

    def loop():
        while not stop.wait(hours * 3600):
            try:
                snapshot(db_path, cfg, log)
            except (SnapshotError, sqlite3.Error, OSError) as e:
                log(f"warning: scheduled snapshot failed: {e}")

    thread = threading.Thread(target=loop, name="snapshots", daemon=True)
    thread.start()
    return thread
