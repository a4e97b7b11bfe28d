"""The corpus pipeline (corpus.py): reading, cleaning, dedup, split, tokenizer training, encoding."""

import copy
import gzip
import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, data_layer, quiet, read_docs, shard_hashes

import config
import corpus
import data

NOVELAS = os.path.join(ROOT, "..", "shared", "corpus", "novelas-cligs.jsonl.gz")


# -----------------------------------------------------------------------------
# Corpus pipeline


def test_cleaning_normalizes_to_nfc_and_tidies_controls_and_whitespace():
    raw = "\n\t\n  \n  Cafe\u0301 \u00a0con\u200bleche\x07\r\nsegunda   \t\n\n\n\n\ufefftercera\u2028cuarta \n\n"
    assert corpus.clean_text(raw) == "  Café  con\u200bleche\nsegunda\n\ntercera\ncuarta"
    assert corpus.clean_text("a\tb") == "a\tb"  # tabs inside lines stay


def write_gz(path, text_or_bytes):
    raw = text_or_bytes.encode("utf-8") if isinstance(text_or_bytes, str) else text_or_bytes
    with gzip.open(path, "wb") as f:
        f.write(raw)


def corpus_cfg(tmp_path, inputs, **corpus):
    settings = {"inputs": inputs, "min_chars": 10, "val_fraction": 0.5, "max_documents_per_file": None}
    settings.update(corpus)
    return data_layer("corpus-smoke", dir=str(tmp_path / "out"), processes=1, corpus=settings)


def test_corpus_step_dedups_filters_counts_and_splits_by_hash(tmp_path):
    docs = [f"Documento número {i}: había una vez una historia." for i in range(40)]
    (tmp_path / "a.txt").write_text("\n\n".join(docs[:30] + [docs[3], "corto"]) + "\n")
    write_gz(tmp_path / "b.txt.gz", b"Texto con un byte \xff roto y otro \xc3 mas, largo\n")
    escaped = json.dumps({"body": "Un escape \ud83d suelto en JSON, largo"})  # a lone surrogate
    lines = [json.dumps({"body": d}) for d in docs[30:]] + ["{not json", json.dumps({"title": "x"}), escaped]
    write_gz(tmp_path / "c.jsonl.gz", "\n".join(lines + [json.dumps({"body": docs[0]})]) + "\n")
    (tmp_path / "whole").mkdir()
    (tmp_path / "whole" / "d.txt").write_text("Un documento\n\ncon una línea en blanco dentro.\n")
    inputs = [
        {"path": str(tmp_path / "*.txt*"), "documents": "blank_line"},
        {"path": str(tmp_path / "c.jsonl.gz"), "documents": "jsonl", "text_field": "body"},
        {"path": str(tmp_path / "whole" / "d.txt"), "documents": "file"},
    ]
    cfg = corpus_cfg(tmp_path, inputs)
    stats = corpus.build_corpus(cfg, log=quiet)
    assert stats["rejects"] == {"bad_json": 1, "missing_text_field": 1, "empty": 0, "too_short": 1}
    assert stats["duplicates"] == 2 and stats["undecodable"] == 3
    assert stats["documents_in"] == 32 + 1 + 14 + 1 and stats["documents_out"] == 40 + 3
    train, val = read_docs(cfg, "train"), read_docs(cfg, "val")
    assert 5 < len(val) < 38 and len(train) + len(val) == 43
    broken = [
        "Texto con un byte \ufffd roto y otro \ufffd mas, largo",
        "Un escape \ufffd suelto en JSON, largo",
    ]
    assert sorted(train + val) == sorted(docs + broken + ["Un documento\n\ncon una línea en blanco dentro."])
    assert [t for t in train if t in docs] == [d for d in docs if d in train]  # input order kept
    manifest = json.load(open(data.manifest_path(cfg)))
    assert manifest["corpus"]["stats"] == stats

    again = corpus_cfg(tmp_path, inputs)
    again["dir"] = str(tmp_path / "again")
    corpus.build_corpus(again, log=quiet)
    assert read_docs(again, "val") == val  # the split depends on the text only


def test_corpus_step_does_nothing_when_inputs_are_unchanged_and_rebuilds_when_they_change(tmp_path):
    (tmp_path / "a.txt").write_text("\n\n".join(f"Documento largo número {i}." for i in range(30)))
    cfg = corpus_cfg(tmp_path, [{"path": str(tmp_path / "a.txt"), "documents": "blank_line"}])
    corpus.build_corpus(cfg, log=quiet)
    before = os.stat(corpus.docs_path(cfg, "train")).st_mtime_ns
    said = []
    corpus.build_corpus(cfg, log=said.append)
    assert said == [f"corpus: up to date ({cfg['dir']}/docs_*.jsonl)"]
    assert os.stat(corpus.docs_path(cfg, "train")).st_mtime_ns == before
    (tmp_path / "a.txt").write_text("\n\n".join(f"Otro documento largo número {i}." for i in range(30)))
    corpus.build_corpus(cfg, log=said.append)
    assert "up to date" not in said[-1]
    assert all(d.startswith("Otro") for d in read_docs(cfg, "train") + read_docs(cfg, "val"))


def test_corpus_errors_name_the_missing_glob_the_unreadable_file_and_the_empty_corpus(tmp_path):
    missing = corpus_cfg(tmp_path, [{"path": str(tmp_path / "nada" / "*.txt"), "documents": "blank_line"}])
    with pytest.raises(data.DataError, match=r"data.corpus.inputs\[0\].path: no file matches .*nada/\*\.txt"):
        corpus.build_corpus(missing, log=quiet)
    (tmp_path / "bad.txt.gz").write_bytes(gzip.compress(b"Un texto largo para leer.\n" * 100)[:60])
    unreadable = corpus_cfg(tmp_path, [{"path": str(tmp_path / "bad.txt.gz"), "documents": "blank_line"}])
    with pytest.raises(data.DataError, match=r"bad.txt.gz: cannot read \(.*\) \[data.corpus.inputs\[0\]\]"):
        corpus.build_corpus(unreadable, log=quiet)
    (tmp_path / "short.txt").write_text("hola\n\nadiós\n")
    empty = corpus_cfg(tmp_path, [{"path": str(tmp_path / "short.txt"), "documents": "blank_line"}])
    with pytest.raises(data.DataError, match="no document survived .*too_short.: 2"):
        corpus.build_corpus(empty, log=quiet)
    assert not os.path.exists(corpus.docs_path(empty, "train"))  # nothing half-written left behind


def test_the_tokenizer_info_records_settings_and_the_corpus_hash(pipeline):
    info = json.load(open(os.path.join(pipeline["dir"], "tokenizer_info.json")))
    corpus = json.load(open(data.manifest_path(pipeline)))["corpus"]
    assert info["corpus_sha256"] == corpus["outputs"]["train"]["sha256"]
    assert info["sha256"] == data.sha256_of_file(data.tokenizer_path(pipeline))
    settings = info["settings"]
    assert (
        settings["byte_fallback"]
        and settings["split_digits"]
        and settings["normalization_rule_name"] == "identity"
    )
    assert settings["remove_extra_whitespaces"] is False and settings["vocab_size"] == 512


# -----------------------------------------------------------------------------
# Encoding


def test_shards_hold_every_document_as_bos_ids_eos_in_order(pipeline):
    tokenizer = data.load_tokenizer(pipeline)
    for split in data.SPLITS:
        paths = data.shard_paths(pipeline, split)
        assert all(data.read_shard_header(p)[1] == 512 for p in paths)
        tokens = data.load_split_tokens(pipeline, split).tolist()
        expected = []
        for text in read_docs(pipeline, split):
            expected += [1, *tokenizer.encode(text), 2]
        assert tokens == expected
    assert len(data.shard_paths(pipeline, "train")) > 3  # 5,000-token shards
    manifest = json.load(open(data.manifest_path(pipeline)))["encode"]["train"]
    assert manifest["complete"] and manifest["tokens"] == sum(s["tokens"] for s in manifest["shards"])
    assert [s["sha256"] for s in manifest["shards"]] == shard_hashes(pipeline, "train")


def test_encoding_is_identical_whatever_the_number_of_processes(pipeline, tmp_path):
    for processes in (2, 3):
        cfg = copy.deepcopy(pipeline) | {"dir": str(tmp_path / str(processes)), "processes": processes}
        shutil.copytree(pipeline["dir"], cfg["dir"], ignore=shutil.ignore_patterns("*_0*.bin"))
        manifest = json.load(open(data.manifest_path(cfg)))
        del manifest["encode"]
        data.write_json(data.manifest_path(cfg), manifest)
        corpus.encode(cfg, log=quiet)
        for split in data.SPLITS:
            assert shard_hashes(cfg, split) == shard_hashes(pipeline, split)


def test_an_interrupted_encode_resumes_after_its_finished_shards(pipeline, tmp_path):
    cfg = copy.deepcopy(pipeline) | {"dir": str(tmp_path / "resume")}
    shutil.copytree(pipeline["dir"], cfg["dir"])
    manifest = json.load(open(data.manifest_path(cfg)))
    train = manifest["encode"]["train"]
    kept = train["shards"][:2]
    assert kept[-1]["next_token"] > 0  # the third shard starts inside a document: the harder resume
    train["shards"], train["complete"] = kept, False  # as if killed while writing the third shard
    data.write_json(data.manifest_path(cfg), manifest)
    finished = [os.stat(os.path.join(cfg["dir"], s["name"])) for s in kept]
    with open(os.path.join(cfg["dir"], data.shard_name("train", 2)), "r+b") as f:
        f.truncate(1500)  # the shard being written when the run died

    said = []
    corpus.encode(cfg, log=said.append)
    assert (
        said[0]
        == "encode: train resuming after 2 finished shards, at document " + f"{kept[-1]['next_document']:,}"
    )
    assert shard_hashes(cfg, "train") == shard_hashes(pipeline, "train")
    for shard, before in zip(kept, finished, strict=True):
        after = os.stat(os.path.join(cfg["dir"], shard["name"]))
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # not rewritten
    corpus.encode(cfg, log=said.append)
    assert said[-2:] == [
        f"encode: train up to date ({len(shard_hashes(pipeline, 'train'))} shard(s) in {cfg['dir']}/)",
        f"encode: val up to date ({len(shard_hashes(pipeline, 'val'))} shard(s) in {cfg['dir']}/)",
    ]


@pytest.mark.skipif(not os.path.exists(NOVELAS), reason="../shared/corpus/novelas-cligs.jsonl.gz not present")
def test_the_stage1_corpus_reads_novelas_jsonl_gz(tmp_path):
    cfg = data_layer(
        "corpus", dir=str(tmp_path), processes=1, corpus={"max_documents_per_file": 12, "val_fraction": 0.5}
    )
    assert os.path.normpath(cfg["corpus"]["inputs"][0]["path"]) == os.path.relpath(NOVELAS, ROOT)
    cfg["corpus"]["inputs"][0]["path"] = NOVELAS
    stats = corpus.build_corpus(cfg, log=quiet)
    assert stats["documents_out"] == 12 and stats["undecodable"] == 0


# -----------------------------------------------------------------------------
# Command line and scripts (a run file composed by config.py)


SMOKE_RUN = os.path.join(ROOT, "configs", "smoke-cpu.yaml")  # make data-smoke / make smoke
CORPUS_SMOKE_RUN = os.path.join(ROOT, "configs", "smoke-corpus-cpu.yaml")  # make corpus-smoke


def run_corpus_cli(*args):
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "corpus.py"), *args], capture_output=True, text=True, cwd=ROOT
    )


def test_make_corpus_smoke_path_builds_shards_a_loader_can_train_on(tmp_path):
    out = tmp_path / "corpus-smoke"
    overrides = [f"data.dir={out}", "data.corpus.max_documents_per_file=200", "data.tokenizer.vocab_size=400"]
    result = run_corpus_cli("all", CORPUS_SMOKE_RUN, *overrides, "model.vocab_size=400")
    assert result.returncode == 0, result.stderr
    assert "tokenizer: 400 tokens" in result.stdout
    for name in (
        "tokenizer.model",
        "tokenizer_info.json",
        "manifest.json",
        "train_000000.bin",
        "val_000000.bin",
    ):
        assert (out / name).exists(), name
    cfg = config.load(CORPUS_SMOKE_RUN, overrides + ["model.vocab_size=400"])["data"]
    assert data.load_tokenizer(cfg).vocab_size == 400
    x, _ = data.build_loader(cfg, "val", 2, 16, seed=0).next_batch()
    assert x.shape == (2, 16)


def test_the_command_line_reports_errors_without_a_traceback(tmp_path):
    result = run_corpus_cli("encode", CORPUS_SMOKE_RUN, f"data.dir={tmp_path / 'empty'}")
    assert result.returncode == 2
    assert (
        result.stderr.startswith("error: ") and "run `python corpus.py corpus CONFIG` first" in result.stderr
    )
    assert "Traceback" not in result.stderr
    result = run_corpus_cli("all", SMOKE_RUN, "data.format=shards")
    assert result.returncode == 2 and "data.tokenizer: required key missing" in result.stderr
    assert "Traceback" not in result.stderr


def test_prepare_smoke_data_builds_once_then_does_nothing(tmp_path):
    script = os.path.join(ROOT, "scripts", "prepare_smoke_data.sh")
    out = tmp_path / "smoke"
    first = subprocess.run([script, f"data.dir={out}"], capture_output=True, text=True, cwd=ROOT)
    assert first.returncode == 0, first.stderr
    train, val = (out / "train.bin").read_bytes(), (out / "val.bin").read_bytes()
    assert len(train) + len(val) > 4_500_000 and 0.02 < len(val) / len(train) < 0.1
    assert train.decode("utf-8") and val.decode("utf-8")
    both = (train + val).decode("utf-8")
    assert "Donde hay concordia siempre hay victoria.\n\t\t-- Publio Siro." in both
    assert "Capítulo 1\nEN el principio crió Dios" in both
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    second = subprocess.run([script, f"data.dir={out}"], capture_output=True, text=True, cwd=ROOT)
    assert second.returncode == 0, second.stderr
    assert "up to date" in second.stdout and "encode: train up to date" in second.stdout
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
