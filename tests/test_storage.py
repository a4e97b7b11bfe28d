"""A full disk, a read-only filesystem and an upgrade: every writer says what happened in one line (the path,
the bytes needed where known, the bytes free) and leaves the previous state intact; the files an earlier
release wrote still open. The small filesystem is a real tmpfs when the tests run as root (CI does);
elsewhere fileio's writes fail with ENOSPC past the disk's size (its open and free_bytes patched), and the
tests that need the kernel's own ENOSPC (SQLite, a read-only remount) are skipped."""

import contextlib
import copy
import errno
import json
import os
import pathlib
import pickletools
import re
import shutil
import sqlite3
import subprocess
import threading
import zipfile

import httpx
import numpy as np
import pytest
import torch
import yaml
from conftest import (
    ROOT,
    ScriptedModel,
    data_layer,
    live_server,
    sample_corpus,
    spanish_text,
    text_source,
    tiny_args,
    tiny_config,
)

import checkpoint
import config
import data
import export
import fileio
import train
from corpus import pipeline
from corpus.docs import docs_path
from decode import engine
from evaluation import plot
from family import accounts, feedback, memories, store
from serve import app

RELEASE = os.path.join(ROOT, "tests", "fixtures", "release-2026-12-02")
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


# -----------------------------------------------------------------------------
# The family's database: a full disk, and versions


def full_database(store):
    """The database may grow by no page at all: SQLite's own SQLITE_FULL, as on a full disk."""
    pages = store.db.execute("PRAGMA page_count").fetchone()[0]
    store.db.execute(f"PRAGMA max_page_count = {pages}")


def test_a_full_database_reports_sqlite_full_not_a_failed_rollback_and_recovers(tmp_path):
    store = accounts.Store(str(tmp_path / "family.sqlite"))
    store.add_member("ana", "adult")
    ana = store.member("ana")
    conversation = store.new_conversation(ana["id"], "antes")
    full_database(store)
    # After this plain INSERT, SQLite rolls the whole transaction back itself on SQLITE_FULL; a second
    # ROLLBACK used to fail with "cannot rollback - no transaction is active" and replace this error.
    with pytest.raises(fileio.StorageError) as caught:
        store.new_conversation(ana["id"], "palabra " * 10_000)
    assert caught.value.__cause__.sqlite_errorname == "SQLITE_FULL"
    assert one_line(caught.value).startswith(f"{store.path}: the disk is full: writing the family's database")
    assert store.storage_problem is caught.value
    # After this one (INSERT ... SELECT) only the statement is rolled back: the same error all the same.
    with pytest.raises(fileio.StorageError):
        store.add_message(ana["id"], conversation, "user", "palabra " * 10_000)
    assert [c["title"] for c in store.conversations(ana["id"])] == ["antes"]  # reading goes on
    assert store.conversation(ana["id"], conversation)["messages"] == []
    store.db.execute("PRAGMA max_page_count = 1073741823")  # room again: the next write works, unaided
    assert store.add_message(ana["id"], conversation, "user", "palabra " * 10_000)
    assert store.storage_problem is None
    assert store.query("PRAGMA integrity_check") == [{"integrity_check": "ok"}]


@needs_root("SQLite's own ENOSPC")
def test_the_database_on_a_full_disk_loses_no_committed_row_and_works_once_space_returns(disk):
    store = accounts.Store(os.path.join(disk.path, "family.sqlite"))
    store.add_member("ana", "adult")
    ana = store.member("ana")
    conversation = store.new_conversation(ana["id"], "antes")
    disk.fill(leave=20_000)
    with pytest.raises(fileio.StorageError) as caught:
        store.add_message(ana["id"], conversation, "user", "palabra " * 40_000)  # 320 kB of WAL frames
    assert "the disk is full" in one_line(caught.value) and caught.value.free <= 20_000 + 4096
    assert store.conversation(ana["id"], conversation)["messages"] == []
    disk.empty()
    assert store.add_message(ana["id"], conversation, "user", "palabra " * 40_000)
    assert len(store.conversation(ana["id"], conversation)["messages"]) == 1
    assert store.query("PRAGMA integrity_check") == [{"integrity_check": "ok"}]


def user_version(path):
    with contextlib.closing(sqlite3.connect(path)) as db:
        return db.execute("PRAGMA user_version").fetchone()[0]


def test_a_new_database_starts_at_the_newest_schema_version(tmp_path):
    store = accounts.Store(str(tmp_path / "family.sqlite"))
    assert user_version(store.path) == len(accounts.Store.MIGRATIONS)
    assert store.member("nadie") is None


def test_a_database_from_newer_code_is_refused_with_its_version_and_left_as_it_is(tmp_path):
    path = str(tmp_path / "family.sqlite")
    accounts.Store(path).db.execute("PRAGMA user_version = 99")
    with pytest.raises(accounts.AccountError) as caught:
        accounts.Store(path)
    newest = len(accounts.Store.MIGRATIONS)
    assert str(caught.value).startswith(
        f"{path}: database schema version 99, newer than this code's {newest}: a later ENLACE wrote it"
    )
    assert user_version(path) == 99


def test_a_failed_migration_step_leaves_the_file_at_its_old_version(tmp_path, monkeypatch):
    path = str(tmp_path / "old.sqlite")
    shutil.copy(os.path.join(RELEASE, "enlace.sqlite"), path)

    def broken_step(store):
        store.db.execute("CREATE TABLE half_done (x)")
        raise sqlite3.OperationalError("step 2 failed")

    monkeypatch.setattr(accounts.Store, "MIGRATIONS", (*accounts.Store.MIGRATIONS, broken_step))
    with pytest.raises(sqlite3.OperationalError, match="step 2 failed"):
        accounts.Store(path)
    assert user_version(path) == 0
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert db.execute("SELECT name FROM sqlite_master WHERE name = 'half_done'").fetchall() == []


# -----------------------------------------------------------------------------
# What release 2026-12-02 wrote (tests/fixtures/release-2026-12-02/make.py), opened by today's code


def test_the_family_database_of_release_2026_12_02_opens_migrated_with_everything_in_it(tmp_path):
    path = str(tmp_path / "enlace.sqlite")
    shutil.copy(os.path.join(RELEASE, "enlace.sqlite"), path)  # the fixture itself is never written
    assert user_version(path) == 0
    store = accounts.Store(path)
    assert user_version(path) == len(accounts.Store.MIGRATIONS)
    assert [(m["name"], m["role"]) for m in store.members()] == [
        ("ana", "adult"),
        ("luis", "child"),
        ("papa", "admin"),
    ]
    with open(os.path.join(RELEASE, "ana.key")) as f:
        ana = store.member_by_key(f.read().strip())
    assert ana["name"] == "ana"
    (conversation,) = store.conversations(ana["id"])
    messages = store.conversation(ana["id"], conversation["id"])["messages"]
    assert [(m["role"], m["content"]) for m in messages] == [
        ("user", "¿Cuánto es 2 + 2?"),
        ("assistant", "Son 4."),
    ]
    with store.lock:
        remembered = memories.list_memories(store.db, "ana", "adult")
        (rating,) = feedback.list_feedback(store.db, ana["id"])
        consented = feedback.consent(store.db, ana["id"])
    assert sorted(m["text"] for m in remembered) == [
        "Ana es alérgica a las nueces.",
        "La cena familiar es los domingos.",
    ]
    assert (rating["rating"], rating["answer"]) == (1, "Son 4.") and consented["granted"]
    assert store.add_message(ana["id"], conversation["id"], "user", "¿Y 3 + 3?")  # and it takes writes
    assert store.query("PRAGMA integrity_check") == [{"integrity_check": "ok"}]


# -----------------------------------------------------------------------------
# The family's server on a full disk


@needs_root("SQLite's own ENOSPC: the database's pages have room inside them that a page cap cannot take")
def test_the_server_answers_507_for_writes_on_a_full_disk_keeps_reading_and_recovers(disk, chat_model, capfd):
    with live_server(chat_model, pathlib.Path(disk.path), "serve.tools=false") as (url, server):
        ana = {"Authorization": f"Bearer {server.store.add_member('ana', 'adult')}"}
        papa = {"Authorization": f"Bearer {server.store.add_member('papa', 'admin')}"}
        conversation = httpx.post(url + "/api/conversations", headers=ana, json={"title": "antes"}).json()[
            "id"
        ]
        turn = {"content": "hola", "stream": False, "max_tokens": 2}
        disk.fill(leave=0)  # the WAL grows with each write: none has room

        refused = httpx.post(f"{url}/api/conversations/{conversation}/messages", headers=ana, json=turn)
        assert refused.status_code == 507 and refused.headers["retry-after"] == "2"
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "storage_full")
        assert error["message"].startswith("the server's storage is full: this could not be saved")
        memory_refused = httpx.post(url + "/api/memories", headers=ana, json={"text": "Ana toca el piano."})
        assert memory_refused.status_code == 507 and memory_refused.json()["error"]["code"] == "storage_full"
        assert httpx.post(f"{url}/api/conversations", headers=ana, json={"title": "nueva"}).status_code == 507

        # What needs no write goes on: the stored conversations, and chatting through the API.
        assert httpx.get(f"{url}/api/conversations/{conversation}", headers=ana).json()["messages"] == []
        chat = {"model": server.model_id, "messages": [{"role": "user", "content": "hola"}], "max_tokens": 2}
        assert httpx.post(url + "/v1/chat/completions", headers=ana, json=chat).status_code == 200
        status = httpx.get(url + "/api/server", headers=papa).json()["storage"]
        assert status["reason"] == "full" and status["path"] == server.store.path
        assert status["message"].startswith(
            f"{server.store.path}: the disk is full: writing the family's database"
        )
        logged = [line for line in capfd.readouterr().err.splitlines() if line.startswith("serve: storage: ")]
        assert logged == [f"serve: storage: {status['message']}"]  # three refusals, one line

        disk.empty()  # space returns: nothing to restart
        answered = httpx.post(f"{url}/api/conversations/{conversation}/messages", headers=ana, json=turn)
        assert answered.status_code == 200
        assert len(httpx.get(f"{url}/api/conversations/{conversation}", headers=ana).json()["messages"]) == 2
        assert httpx.get(url + "/api/server", headers=papa).json()["storage"] is None
        assert server.store.query("PRAGMA integrity_check") == [{"integrity_check": "ok"}]


def pickled_globals(path):
    """The module-level names a checkpoint's pickle refers to (what unpickling would import)."""
    with zipfile.ZipFile(path) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        ops = list(pickletools.genops(archive.read(name)))
    names = {arg.replace(" ", ".") for op, arg, _ in ops if op.name == "GLOBAL"}
    names |= {
        f"{ops[i - 2][1]}.{ops[i - 1][1]}" for i, (op, _, _) in enumerate(ops) if op.name == "STACK_GLOBAL"
    }
    return names


def only_torch_and_containers(names):
    return all(name.split(".")[0] in ("torch", "collections", "builtins") for name in names)


def release_data(folder):
    """The byte data the release's run was trained on, laid out as its make.py did."""
    text = spanish_text(30_000).encode("utf-8")
    os.makedirs(folder)
    (folder / "train.bin").write_bytes(text[:25_000])
    (folder / "val.bin").write_bytes(text[25_000:])
    return str(folder)


def test_the_run_of_release_2026_12_02_loads_samples_and_resumes_with_todays_code(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(os.path.join(RELEASE, "run"), run)  # the fixture itself is never written
    old = str(run / "ckpt_0000004.pt")
    assert "format" not in checkpoint.load_checkpoint(old)  # format 0
    assert only_torch_and_containers(pickled_globals(old))
    model, cfg, tokenizer, path = checkpoint.load_run(str(run), log=lambda message: None)
    assert (path, tokenizer.name) == (old, "bytes")
    tokens = list(engine.generate(model, torch.tensor(tokenizer.encode("La ")), 8, temperature=0.0))
    assert len(tokens) == 8 and all(0 <= t < tokenizer.vocab_size for t in tokens)

    # Its config.yaml (no config_format: format 0) loads, and training goes on from step 4.
    data_dir = release_data(tmp_path / "data")
    overrides = [
        f"train.runs_dir={tmp_path}",
        f"data.dir={data_dir}",
        "train.max_steps=6",
        "train.ckpt_interval=2",
    ]
    resumed = config.load(str(run / "config.yaml"), overrides)
    assert train.train(resumed, resume=True, log=lambda *a, **k: None) == 6
    new = checkpoint.checkpoint_path(str(run), 6)
    assert checkpoint.load_checkpoint(new)["format"] == checkpoint.CHECKPOINT_FORMAT
    assert only_torch_and_containers(pickled_globals(new))  # no module path of ours: files may move
    with open(run / "config.yaml") as f:
        assert yaml.safe_load(f)["config_format"] == config.CONFIG_FORMAT


def test_a_config_yaml_from_newer_code_is_refused_by_name(tmp_path):
    saved = tmp_path / "config.yaml"
    with open(os.path.join(RELEASE, "run", "config.yaml")) as f:
        saved.write_text(f"config_format: {config.CONFIG_FORMAT + 1}\n" + f.read())
    with pytest.raises(config.ConfigError) as caught:
        config.load(str(saved))
    assert caught.value.problems == [
        f"{saved}: config_format: {config.CONFIG_FORMAT + 1} is newer than this code reads ({config.CONFIG_FORMAT}); "
        "a later ENLACE wrote it: update this checkout"
    ]


# -----------------------------------------------------------------------------
# Writers that check the room they need before writing a large file


def test_a_shard_that_does_not_fit_is_refused_before_writing_and_the_old_one_stays(disk):
    path = os.path.join(disk.path, data.shard_name("train", 0))
    data.write_shard(path, np.arange(1000), 65536)
    before = fileio.sha256_of_file(path)
    disk.fill(leave=100_000)
    with pytest.raises(fileio.StorageError) as caught:
        data.write_shard(path, np.zeros(200_000), 65536)  # 400 kB
    needed = fileio.size_text(data.HEADER_BYTES + 400_000)
    assert one_line(caught.value).startswith(f"{path}: the disk is too full: the shard needs {needed}, ")
    assert fileio.sha256_of_file(path) == before


def test_a_corpus_whose_documents_do_not_fit_is_refused_and_the_old_outputs_stay(disk):
    cfg = data_layer(
        "corpus-smoke",
        dir=os.path.join(disk.path, "data"),
        processes=1,
        corpus={"sources": [text_source("sample", sample_corpus(pathlib.Path(disk.path) / "sample.txt"))]},
    )
    pipeline.build_corpus(cfg, log=lambda *a: None)
    train_docs = docs_path(cfg, "train")
    before = fileio.sha256_of_file(train_docs)
    cfg["corpus"]["min_chars"] += 1  # another corpus: built again
    disk.fill(leave=20_000)
    with pytest.raises(fileio.StorageError) as caught:
        pipeline.build_corpus(cfg, log=lambda *a: None)
    assert re.search("the disk is (too )?full", one_line(caught.value)) and caught.value.path.startswith(
        cfg["dir"]
    )
    assert fileio.sha256_of_file(train_docs) == before
    assert [name for name in os.listdir(cfg["dir"]) if name.endswith(".tmp")] == []


def test_a_snapshot_that_does_not_fit_is_refused_and_the_older_ones_stay(disk, tmp_path):
    cfg = copy.deepcopy(memories.load_config())
    cfg["snapshots"]["dir"] = os.path.join(disk.path, "snapshots")
    database = str(tmp_path / "family.sqlite")
    conn = memories.connect(database, cfg)
    memories.add(conn, "ana", "adult", "Ana es alérgica a las nueces.", cfg)
    first = store.snapshot(database, cfg, log=lambda message: None)
    conn.execute("CREATE TABLE ballast (x)")
    with conn:
        conn.execute("INSERT INTO ballast VALUES (?)", (b"\0" * 300_000,))
    conn.close()
    disk.fill(leave=100_000)
    with pytest.raises(fileio.StorageError) as caught:
        store.snapshot(database, cfg, log=lambda message: None)
    assert " the disk is too full: the snapshot needs " in one_line(caught.value)
    assert store.list_snapshots(cfg["snapshots"]["dir"]) == [first]
    assert store.verify(first)["integrity_check"] == "ok"


def test_an_export_that_does_not_fit_is_refused_with_its_own_exit_status(disk, chat_run, capsys):
    out = os.path.join(disk.path, "hf")
    disk.fill(leave=100_000)
    assert export.main([chat_run, out, "--to", "hf"]) == fileio.STORAGE_EXIT
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: {out}: the disk is too full: the hf export (f32) needs ")
    assert not os.path.exists(out) and [n for n in os.listdir(disk.path) if n.startswith(".hf")] == []


# -----------------------------------------------------------------------------
# Training: room for keep_last + 1 checkpoints, checked at start


def tiny_model_and_optimizer():
    from model import Transformer

    cfg = config.load(
        os.path.join(ROOT, "configs", "smoke-cpu.yaml"), ["model.d_model=64", "model.n_layers=2"]
    )
    model = Transformer(cfg["model"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_a_checkpoints_size_is_estimated_from_the_weights_and_the_optimizer_before_any_step(tmp_path):
    model, optimizer = tiny_model_and_optimizer()
    estimate = checkpoint.estimate_checkpoint_bytes(model, optimizer)
    model(torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16)))[1]["loss"].backward()
    optimizer.step()
    measured = checkpoint.estimate_checkpoint_bytes(model, optimizer)  # AdamW's state, as it is now
    assert estimate <= measured <= 1.001 * estimate  # plus a step counter per parameter
    path = checkpoint.save_checkpoint(str(tmp_path), 1, training_state(1, 1) | {"model": model.state_dict(),
                                      "optimizer": optimizer.state_dict()}, keep_last=2)  # fmt: skip
    assert estimate <= os.path.getsize(path) <= 1.05 * estimate  # the rest is the zip's and pickle's framing


def test_a_run_dir_without_room_for_keep_last_plus_one_checkpoints_is_refused_or_warned_about(disk):
    run_dir = os.path.join(disk.path, "run")
    disk.fill(leave=1_000_000)
    with pytest.raises(fileio.StorageError) as caught:
        checkpoint.check_room_for_checkpoints(run_dir, 400_000, keep_last=2, mode="refuse")
    text = one_line(caught.value)
    assert text.startswith(
        f"{run_dir}/ckpt_*.pt: the disk is too full: 3 checkpoints of about 400.0 kB (train.keep_last=2 kept "
        "while the next is written; free space, lower train.keep_last or set train.space_check=warn) needs 1.2 MB, "
    )
    warnings = []
    checkpoint.check_room_for_checkpoints(run_dir, 400_000, keep_last=2, mode="warn", log=warnings.append)
    assert warnings == [f"warning: {text} (train.space_check=warn: training anyway)"]
    checkpoint.check_room_for_checkpoints(run_dir, 300_000, keep_last=2, mode="refuse")  # 900 kB fits


# -----------------------------------------------------------------------------
# Command lines: a full disk is one line and exit status 74, apart from bad input (2)


@needs_root("SQLite's own ENOSPC")
def test_adding_a_member_on_a_full_disk_says_so_and_exits_74(disk, capsys):
    database = os.path.join(disk.path, "family.sqlite")
    accounts.Store(database).add_member("papa", "admin")
    disk.fill(leave=0)
    argv = ["member", "add", "ana", "--role", "adult", f"serve.database={database}"]
    assert app.main(argv) == fileio.STORAGE_EXIT
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: {database}: the disk is full: writing the family's database")
    disk.empty()
    assert app.main(argv) == 0


def test_a_plot_on_a_full_disk_says_so_and_exits_74(disk, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(os.path.join(RELEASE, "run"), run)
    out = os.path.join(disk.path, "plot.png")
    disk.fill(leave=1_000)
    assert plot.main([str(run), "--out", out]) == fileio.STORAGE_EXIT
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: {out}: the disk is full: writing it failed, ")
    assert not os.path.exists(out)


class GatedModel(ScriptedModel):
    """A scripted model whose generations stop after their first token until `gate` is set."""

    def __init__(self, *scripts):
        super().__init__(*scripts)
        self.gate = threading.Event()

    def decoder(self, slots, allocate=False):
        decoder = super().decoder(slots, allocate)
        advance = decoder.advance

        def gated(tokens):
            if any(row.step >= 1 for row in tokens):
                self.gate.wait(30)
            advance(tokens)

        decoder.advance = gated
        return decoder


@needs_root("SQLite's own ENOSPC")
def test_an_answer_the_disk_cannot_store_ends_its_stream_with_the_507_error_and_the_question_stays(
    disk, chat_model
):
    tokenizer = chat_model[1]
    model = GatedModel(tokenizer.encode("Son cuatro, como siempre."))
    with live_server(chat_model, pathlib.Path(disk.path), "serve.tools=false", model=model) as (url, server):
        ana = {"Authorization": f"Bearer {server.store.add_member('ana', 'adult')}"}
        conversation = httpx.post(url + "/api/conversations", headers=ana, json={}).json()["id"]
        turn = {"content": "¿2 + 2?", "stream": True, "max_tokens": 8}
        events = []
        with httpx.stream(
            "POST", f"{url}/api/conversations/{conversation}/messages", headers=ana, json=turn
        ) as answer:
            for line in filter(None, answer.iter_lines()):
                if not events:  # the first event: the question is stored; the answer will not be
                    disk.fill(leave=0)
                    model.gate.set()
                events.append(line)
        errors = [json.loads(line[6:])["error"] for line in events if line.startswith('data: {"error"')]
        assert [e["code"] for e in errors] == ["storage_full"] and events[-1] == "data: [DONE]"
        disk.empty()
        stored = httpx.get(f"{url}/api/conversations/{conversation}", headers=ana).json()["messages"]
        assert [(m["role"], m["content"]) for m in stored] == [("user", "¿2 + 2?")]


def checkpoint_size(tmp_path, byte_data_dir):
    """The bytes of one checkpoint of the tiny run (its first, at step 2)."""
    train.train(tiny_config(tmp_path / "sizing", "bytes", byte_data_dir, "run_name=s", "train.max_steps=2"),
                log=lambda *a, **k: None)  # fmt: skip
    return os.path.getsize(checkpoint.checkpoint_path(str(tmp_path / "sizing" / "s"), 2))


def test_train_refuses_at_start_a_run_dir_without_room_for_keep_last_plus_one_checkpoints(
    disk, tmp_path, byte_data_dir, capsys
):
    size = checkpoint_size(tmp_path, byte_data_dir)
    disk.fill(leave=2 * size)  # keep_last=2: three are needed
    argv = tiny_args(disk.path, "bytes", byte_data_dir, "run_name=r")
    assert train.main(argv) == fileio.STORAGE_EXIT
    (line,) = capsys.readouterr().err.strip().splitlines()
    run_dir = os.path.join(disk.path, "r")
    assert line.startswith(f"error: {run_dir}/ckpt_*.pt: the disk is too full: 3 checkpoints of about ")
    assert line.endswith("; no checkpoint was written yet (free space, then start it again)")
    assert checkpoint.list_checkpoints(run_dir) == []


def test_a_disk_that_fills_mid_run_stops_training_with_74_naming_the_last_good_checkpoint_then_resume_finishes(
    disk, tmp_path, byte_data_dir, capsys
):
    size = checkpoint_size(tmp_path, byte_data_dir)
    disk.fill(leave=size * 3 // 2)  # one checkpoint and a half, as the person had
    argv = tiny_args(disk.path, "bytes", byte_data_dir, "run_name=r", "train.space_check=warn")
    assert train.main(argv) == fileio.STORAGE_EXIT
    err = capsys.readouterr().err.strip().splitlines()
    run_dir = os.path.join(disk.path, "r")
    first = checkpoint.checkpoint_path(run_dir, 2)
    assert err[-1].startswith(
        f"error: {checkpoint.checkpoint_path(run_dir, 4)}: the disk is full: checkpoint 4 needs "
    )
    assert err[-1].endswith(f"; the last good checkpoint is {first} (free space, then --resume)")
    assert checkpoint.list_checkpoints(run_dir) == [first]
    assert [name for name in os.listdir(run_dir) if name.endswith(".tmp")] == []
    disk.empty()
    assert train.main([*argv, "--resume"]) == 0
    assert checkpoint.load_checkpoint(checkpoint.list_checkpoints(run_dir)[0])["step"] == 8


def test_a_database_of_the_previous_schema_keeps_its_conversations_and_their_answers_numbers(tmp_path):
    path = str(tmp_path / "family.sqlite")
    with contextlib.closing(sqlite3.connect(path)) as db:  # as schema version 2 left a file
        db.executescript(accounts.SCHEMA_SQL)
        db.execute("INSERT INTO members (name, role, key_hash, created) VALUES ('ana', 'adult', 'k', 0)")
        db.execute("INSERT INTO conversations VALUES ('c1', 1, 'Raciones', 0, 0)")
        db.executemany("INSERT INTO messages (conversation_id, role, content, created) VALUES ('c1', ?, ?, 0)",
                       [("user", "¿Cuántas raciones?"), ("assistant", "Doce.")])  # fmt: skip
        db.execute("PRAGMA user_version = 2")
        db.commit()
    store = accounts.Store(path)
    assert user_version(path) == len(accounts.Store.MIGRATIONS) == 3
    work = [{"role": "tool", "content": "27", "tool_call_id": "call_1", "name": "calculadora"}]
    assert store.add_message(1, "c1", "user", "¿y para 9?") and store.add_message(
        1, "c1", "assistant", "27.", None, work
    )
    messages = store.conversation(1, "c1")["messages"]
    assert [(m["role"], m["content"]) for m in messages] == [
        ("user", "¿Cuántas raciones?"), ("assistant", "Doce."), ("user", "¿y para 9?"), ("assistant", "27.")
    ]  # fmt: skip
    assert "tool_messages" not in messages[1] and messages[3]["tool_messages"] == work
