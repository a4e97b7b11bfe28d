"""A full disk, a read-only filesystem and an upgrade: every writer says what happened in one line (the path,
the bytes needed where known, the bytes free) and leaves the previous state intact; the files an earlier
release wrote still open. The small filesystem is a real tmpfs when the tests run as root (CI does);
elsewhere fileio's writes fail with ENOSPC past the disk's size (its open and free_bytes patched), and the
tests that need the kernel's own ENOSPC (SQLite, a read-only remount) are skipped."""

import errno
import os
import subprocess

import pytest
import torch

import checkpoint
import fileio

DISK_BYTES = 4 * 2**20
IS_ROOT = os.geteuid() == 0


class SmallDisk:
    """A folder on a small filesystem. fill(leave) leaves `leave` bytes free; empty() frees the space again."""

    def __init__(self, path, monkeypatch):
        self.path, self.monkeypatch = str(path), monkeypatch
        os.makedirs(self.path)
        self.real = IS_ROOT
        if self.real:
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", self.path], check=True
            )
        else:
            self.room = DISK_BYTES
            monkeypatch.setattr(fileio, "open", self.limited_open, raising=False)
            monkeypatch.setattr(fileio, "free_bytes", lambda path: self.room)
        self.ballast = os.path.join(self.path, "ballast")

    def limited_open(self, path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)  # noqa: SIM115 - returned to the caller
        return LimitedFile(f, self) if "w" in mode or "a" in mode else f

    def fill(self, leave):
        if not self.real:
            self.room = leave
            return
        with open(self.ballast, "ab") as f:
            f.write(b"\0" * max(0, fileio.free_bytes(self.path) - leave))

    def empty(self):
        if self.real:
            os.remove(self.ballast)
        else:
            self.room = DISK_BYTES

    def read_only(self):
        subprocess.run(["mount", "-o", "remount,ro", self.path], check=True)

    def close(self):
        if self.real:
            subprocess.run(["umount", "-l", self.path], check=True)


class LimitedFile:
    """A file whose writes fail with ENOSPC once the disk's room is used up (the non-root stand-in)."""

    def __init__(self, f, disk):
        self.f, self.disk = f, disk

    def write(self, data):
        if len(data) > self.disk.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.disk.room -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@pytest.fixture
def disk(tmp_path, monkeypatch):
    small = SmallDisk(tmp_path / "disk", monkeypatch)
    yield small
    small.close()


def needs_root(reason):
    return pytest.mark.skipif(not IS_ROOT, reason=f"needs a real tmpfs (root): {reason}")


def one_line(error):
    text = str(error)
    assert "\n" not in text and "Traceback" not in text
    return text


# -----------------------------------------------------------------------------
# The one atomic writer


def test_a_full_disk_mid_write_keeps_the_old_file_and_names_path_size_and_free_space(disk):
    path = os.path.join(disk.path, "notes.bin")
    fileio.write_atomic(path, lambda f: f.write(b"old" * 1000))
    disk.fill(leave=100_000)
    with pytest.raises(fileio.StorageError) as caught:
        fileio.write_atomic(path, lambda f: f.write(b"x" * 300_000), needed=300_000, what="the notes")
    text = one_line(caught.value)
    assert text.startswith(f"{path}: the disk is full: the notes needs 300.0 kB, ")
    assert " free in " in text
    assert open(path, "rb").read() == b"old" * 1000
    assert sorted(os.listdir(disk.path)) == sorted(["notes.bin"] + (["ballast"] if disk.real else []))
    disk.empty()  # space returns: the same write goes through
    fileio.write_atomic(path, lambda f: f.write(b"x" * 300_000))
    assert os.path.getsize(path) == 300_000


def test_check_space_refuses_before_writing_and_says_how_much_is_missing(disk):
    disk.fill(leave=50_000)
    with pytest.raises(fileio.StorageError) as caught:
        fileio.check_space(os.path.join(disk.path, "big.bin"), 2_000_000, what="the export")
    text = one_line(caught.value)
    assert "the export needs 2.0 MB" in text and caught.value.free < 2_000_000
    assert fileio.check_space(os.path.join(disk.path, "small.bin"), 1_000) >= 1_000


@needs_root("a read-only remount")
def test_a_read_only_filesystem_is_named_as_such(disk):
    path = os.path.join(disk.path, "notes.bin")
    fileio.write_atomic(path, lambda f: f.write(b"old"))
    disk.read_only()
    with pytest.raises(fileio.StorageError) as caught:
        fileio.write_atomic(path, lambda f: f.write(b"new"))
    assert (
        one_line(caught.value)
        == f"{path}: the filesystem holding {disk.path} is read-only; nothing can be written there"
    )
    assert open(path, "rb").read() == b"old"


def test_an_error_that_is_not_about_storage_passes_through_unchanged(tmp_path):
    with pytest.raises(ZeroDivisionError):
        fileio.write_atomic(str(tmp_path / "x"), lambda f: 1 / 0)
    assert os.listdir(tmp_path) == []


# -----------------------------------------------------------------------------
# Checkpoints


def training_state(step, size):
    return {
        "step": step,
        "model": {"w": torch.full((size,), float(step))},
        "optimizer": {"state": {}, "param_groups": [{"lr": 1e-3}]},
        "ranks": [{"loader": {"position": step}}],
        "config": {"run_name": "t", "model": {}},
    }


def test_a_checkpoint_on_a_full_disk_keeps_the_last_good_one_and_says_what_it_needs(disk):
    run_dir = os.path.join(disk.path, "run")
    first = checkpoint.save_checkpoint(run_dir, 2, training_state(2, 100_000), keep_last=2)
    disk.fill(leave=200_000)  # room for half a checkpoint (400 kB): torch's zip writer fails mid-file
    with pytest.raises(fileio.StorageError) as caught:
        checkpoint.save_checkpoint(run_dir, 4, training_state(4, 100_000), keep_last=2)
    text = one_line(caught.value)
    needed = fileio.size_text(os.path.getsize(first))
    assert text.startswith(
        f"{checkpoint.checkpoint_path(run_dir, 4)}: the disk is full: checkpoint 4 needs {needed}"
    )
    assert checkpoint.list_checkpoints(run_dir) == [first]
    assert [n for n in os.listdir(run_dir) if n.endswith(".tmp")] == []
    assert checkpoint.load_checkpoint(first)["step"] == 2


def test_a_checkpoint_records_its_format_and_one_from_newer_code_is_refused_by_name(tmp_path):
    path = checkpoint.save_checkpoint(str(tmp_path), 1, training_state(1, 4), keep_last=2)
    assert checkpoint.load_checkpoint(path)["format"] == checkpoint.CHECKPOINT_FORMAT
    newer = training_state(2, 4) | {"format": checkpoint.CHECKPOINT_FORMAT + 1, "code_version": "abc123"}
    torch.save(newer, checkpoint.checkpoint_path(str(tmp_path), 2))
    with pytest.raises(checkpoint.CheckpointError) as caught:
        checkpoint.read_run(str(tmp_path))  # the newest is refused, not skipped in silence
    assert f"format {checkpoint.CHECKPOINT_FORMAT + 1}, newer than this code reads" in str(caught.value)
    assert "abc123" in str(caught.value)
