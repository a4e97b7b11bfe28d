"""
The one atomic writer and the file digests, with nothing heavy imported (no torch, no numpy), so that
config-level code (family/memories.py) can use them as well as the training side.

    write_atomic(path, write)   write(f) on a temp file beside path, fsync, rename over path, fsync the folder
    reporting_storage(path)     a block whose full or read-only filesystem becomes a StorageError naming path
    reports_storage_errors      a command's main whose StorageError is its one-line message and exit 74
    check_space(path, needed)   a StorageError now when the filesystem holding path has less than needed free
    free_bytes(path)            bytes free to this user on the filesystem holding path
    write_json(path, obj)       the same for a JSON document (indent 1, UTF-8, trailing newline)
    fsync_path(path)            fsync a file or a folder by name (after a rename into it)
    sha256_of_file(path)        hex sha256 of a file's bytes
    fingerprint(obj)            hex sha256 of a JSON-serializable value (keys sorted)
    code_version()              the git commit of this code (-dirty when tracked files differ)
    text_problem(value)         (path, why) of the first string of a JSON-like value that is not text
    undecodable_argument(argv)  why a command-line argument is not text in the locale's encoding, or None
    takes_text_arguments(prog)  a command's main(argv) that first refuses such an argument: one line, exit 2

A reader never sees half a file at `path`: it sees the old one or the new one. A folder is written the
same way by its owner: into a temp folder beside it, then one rename, then fsync_path of the parent.

A full disk (ENOSPC, a quota) or a read-only filesystem is a StorageError whose message is one line: the
path, the bytes needed where known and the bytes free. Whatever library was writing (torch's zip writer
turns the OSError into a RuntimeError), the cause is looked up in the exception's chain.

Text from outside: request bodies, conversations and command lines. JSON's "\\ud800" escape and Python's
surrogateescape decoding of bytes that are not UTF-8 both give lone surrogates: valid str, but not Unicode
text, and every UTF-8 writer (SQLite, sentencepiece, a JSON answer, the terminal) fails on them. The one
rule of what text is acceptable (LONE_SURROGATE) lives here, below everything that reads text from outside:
serve/openai_api.py's check of a request's text, chat/template.py's check of a conversation, and every
command line that takes text (takes_text_arguments).
"""

import contextlib
import errno
import functools
import hashlib
import json
import os
import re
import subprocess
import sys

# The errors that say the filesystem refuses to store more, and how a message names them: errno values,
# SQLite's primary result codes (SQLITE_FULL, SQLITE_READONLY) and Rust's io::Error text (safetensors).
STORAGE_ERRNOS = {errno.ENOSPC: "full", errno.EDQUOT: "full (disk quota exceeded)", errno.EROFS: "read-only"}
SQLITE_CODES = {13: "full", 8: "read-only"}
RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
# The exit status of a command stopped by a full or read-only disk (sysexits.h EX_IOERR), apart from bad
# input (2): a script or a person can tell "free some space and rerun" from "fix the command".
STORAGE_EXIT = 74


def exit_on_storage_error(error, then=None):
    """What a command does with a StorageError: its one-line message on stderr (then: what the person can do
    next, after a semicolon), and STORAGE_EXIT."""
    print(f"error: {error}" + (f"; {then}" if then else ""), file=sys.stderr)
    return STORAGE_EXIT


def reports_storage_errors(main):
    """A command's main, wrapped so that a StorageError from anywhere inside it ends the command through
    exit_on_storage_error: the one place every command line catches a full or read-only disk."""

    @functools.wraps(main)
    def main_reporting_storage_errors(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except StorageError as e:
            return exit_on_storage_error(e)

    return main_reporting_storage_errors


class StorageError(Exception):
    """A write the filesystem refused (full or read-only), or one check_space stopped ahead. path: the file;
    needed, free: bytes (None where not known); reason: "full", "full (disk quota exceeded)", "read-only"
    or "too full" (check_space)."""

    def __init__(self, path, reason, needed=None, free=None, what=None):
        self.path, self.reason, self.needed, self.free, self.what = path, reason, needed, free, what
        super().__init__(storage_message(path, reason, needed, free, what))


def size_text(size):
    """Bytes as people read them: 37.2 MB, 512 kB, 10 B (decimal units, as df -H and file managers)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:,.1f} {unit}"
    return f"{size} B"


def storage_message(path, reason, needed=None, free=None, what=None):
    folder = os.path.dirname(os.path.abspath(path))
    if reason == "read-only":
        return f"{path}: the filesystem holding {folder} is read-only; nothing can be written there"
    what = what or "writing it"
    need = f"{what} needs {size_text(needed)}" if needed is not None else f"{what} failed"
    have = f", {size_text(free)} free in {folder}" if free is not None else ""
    return f"{path}: the disk is {reason}: {need}{have}"


def free_bytes(path):
    """Bytes this user may still write on the filesystem holding path (or its nearest existing folder)."""
    folder = os.path.abspath(path)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    stats = os.statvfs(folder)
    return stats.f_bavail * stats.f_frsize


def storage_reason(error):
    """ "full" / "read-only" when an exception (or one in its chain of causes) is the filesystem refusing a
    write, else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, StorageError):
            return error.reason
        if isinstance(error, OSError) and error.errno in STORAGE_ERRNOS:
            return STORAGE_ERRNOS[error.errno]
        code = getattr(error, "sqlite_errorcode", None)
        if isinstance(code, int) and code & 0xFF in SQLITE_CODES:
            return SQLITE_CODES[code & 0xFF]
        rust = RUST_OS_ERROR.search(str(error)) if not isinstance(error, OSError) else None
        if rust and int(rust.group(1)) in STORAGE_ERRNOS:
            return STORAGE_ERRNOS[int(rust.group(1))]
        error = error.__cause__ or error.__context__
    return None


def storage_error(error, path, needed=None, what=None):
    """The StorageError an exception means (see storage_reason), with the bytes free now; None otherwise."""
    if isinstance(error, StorageError):
        return error
    reason = storage_reason(error)
    if reason is None:
        return None
    try:
        free = free_bytes(path)
    except OSError:
        free = None
    return StorageError(path, reason, needed, free, what)


@contextlib.contextmanager
def reporting_storage(path, needed=None, what=None):
    """Inside this block, a full or read-only filesystem raises StorageError naming path (needed: the bytes
    the write needs, when known); any other error passes through unchanged."""
    try:
        yield
    except Exception as e:
        problem = storage_error(e, path, needed, what)
        if problem is None or problem is e:
            raise
        raise problem from e


def check_space(path, needed, what=None):
    """A StorageError before writing when the filesystem holding path has less than needed bytes free."""
    free = free_bytes(path)
    if needed > free:
        raise StorageError(path, "too full", needed, free, what)
    return free


def fsync_path(path):
    """fsync a file or a folder by name (a folder's fsync makes the renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path, write, needed=None, what=None):
    """Call write(f) on a temp file beside `path`, fsync it, then rename it over `path`. On a full or
    read-only filesystem the old file stays, the temp file goes, and StorageError says so (needed: the
    caller's estimate of the file's size, for the message)."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with reporting_storage(path, needed, what):
        os.makedirs(directory, exist_ok=True)
        try:
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        fsync_path(directory)


def write_json(path, obj):
    text = json.dumps(obj, indent=1, ensure_ascii=False) + "\n"
    write_atomic(path, lambda f: f.write(text.encode("utf-8")))


def sha256_of_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fingerprint(obj):
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode("utf-8")).hexdigest()


def code_version():
    """The git commit of this code, with -dirty when tracked files differ; "unknown" outside git."""
    try:
        root = os.path.dirname(os.path.abspath(__file__))
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        return (commit + ("-dirty" if dirty else "")) or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# -----------------------------------------------------------------------------
# Text from outside

LONE_SURROGATE = re.compile("[\ud800-\udfff]")
NOT_TEXT = "is not Unicode text; send UTF-8 text"


def text_problem(value, max_depth=None, where="", max_chars=None):
    """(path, why) of the first string of a JSON-like value (a dict's keys included) that holds a lone
    surrogate or is longer than max_chars, or of nesting deeper than max_depth; None when every string is
    text. Linear in the value's size: a request is checked with it before any other work. The path joins keys and
    list indices with dots ("messages.0.content"; `where` for the value itself). A loop, not recursion: a
    deep value costs no stack."""
    pending = [(value, where, 0)]
    while pending:
        item, path, depth = pending.pop()
        if isinstance(item, str):
            if max_chars is not None and len(item) > max_chars:
                return path, f"{len(item)} characters; at most {max_chars} per text"
            found = LONE_SURROGATE.search(item)
            if found:
                code = f"\\u{ord(found.group()):04x}"
                return path, f"a lone surrogate ({code} at character {found.start()}) {NOT_TEXT}"
            continue
        if not isinstance(item, (dict, list)):
            continue
        if max_depth is not None and depth >= max_depth:
            return path, f"nested deeper than {max_depth} levels"
        children = item.items() if isinstance(item, dict) else enumerate(item)
        for key, child in reversed(list(children)):
            inner = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and max_chars is not None and len(key) > max_chars:
                return path, f"a key of {len(key)} characters; at most {max_chars}"
            if isinstance(key, str) and LONE_SURROGATE.search(key):
                return path, f"a key ({ascii(key)}) holds a lone surrogate, which {NOT_TEXT}"
            pending.append((child, inner, depth + 1))
    return None


def undecodable_argument(argv):
    """Why a command-line argument cannot be used as text, or None. Python decodes arguments with the
    locale's encoding and turns bytes that are not in it into lone surrogates (surrogateescape): the terminal
    sent another encoding than its locale says. No guess is made (Latin-1 decodes any bytes, so a wrong guess
    would store wrong text without a sign): the person sets the terminal to the locale's encoding."""
    for argument in argv:
        if LONE_SURROGATE.search(argument):
            encoding = sys.getfilesystemencoding().upper()
            locale = os.environ.get("LC_ALL") or os.environ.get("LANG") or "unset"
            return (
                f"the argument '{ascii(os.fsencode(argument))[2:-1]}' is not valid {encoding}: the terminal "
                f"sends another encoding than its locale (LANG {locale}) says; set the terminal to {encoding} "
                "and type it again"
            )
    return None


def takes_text_arguments(prog=None):
    """A command's main(argv), wrapped so that an argument undecodable_argument refuses ends the command
    with its one line ("prog: error: ...", or "error: ...") and exit 2, argparse's code for a bad command
    line, before main reads anything. argv None is sys.argv[1:], and main gets that list."""

    def wrap(main):
        @functools.wraps(main)
        def main_with_text_arguments(argv=None, *args, **kwargs):
            argv = sys.argv[1:] if argv is None else argv
            problem = undecodable_argument(argv)
            if problem:
                print(f"{prog}: error: {problem}" if prog else f"error: {problem}", file=sys.stderr)
                return 2
            return main(argv, *args, **kwargs)

        return main_with_text_arguments

    return wrap
