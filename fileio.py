"""
The one atomic writer and the file digests, with nothing heavy imported (no torch, no numpy), so that
config-level code (family/memories.py) can use them as well as the training side.

    write_atomic(path, write)   write(f) on a temp file beside path, fsync, rename over path, fsync the folder
    write_json(path, obj)       the same for a JSON document (indent 1, UTF-8, trailing newline)
    fsync_path(path)            fsync a file or a folder by name (after a rename into it)
    sha256_of_file(path)        hex sha256 of a file's bytes
    fingerprint(obj)            hex sha256 of a JSON-serializable value (keys sorted)
    code_version()              the git commit of this code (-dirty when tracked files differ)

A reader never sees half a file at `path`: it sees the old one or the new one. A folder is written the
same way by its owner: into a temp folder beside it, then one rename, then fsync_path of the parent.
"""

import hashlib
import json
import os
import subprocess


def fsync_path(path):
    """fsync a file or a folder by name (a folder's fsync makes the renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path, write):
    """Call write(f) on a temp file beside `path`, fsync it, then rename it over `path`."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
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
